"""The asyncio ends, pollable consumers, releases from any thread, and one rank fed by
several producers: real processes, real zmq sockets, real shared memory."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import procs
import pytest
from helpers import raw_spec, settle
from mmwire.transport import (
    AsyncConsumer,
    AsyncProducer,
    Consumer,
    ConsumerGroup,
    GlobalIndex,
    Item,
    Producer,
)
from mmwire.transport.errors import ConfigurationError, PeerGone
from procs import CHILDREN


def _item(pixels: np.ndarray[Any, Any], owners: tuple[int, ...] = (0,)) -> Item:
    return Item(pixels, consumers=owners, preprocess=raw_spec(pixels.shape[1], pixels.shape[0]))


def _distinct(i: int, shape: tuple[int, int, int] = (16, 16, 3)) -> np.ndarray[Any, Any]:
    n = shape[0] * shape[1] * shape[2]
    return np.resize(np.frombuffer(procs.pattern(i, 32), np.uint8), n).reshape(shape)


def test_the_loop_keeps_running_while_an_async_rank_waits_and_a_frontend_publishes() -> None:
    async def main() -> tuple[list[float], list[str]]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:  # what every other request on the loop would see
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async with (
            AsyncProducer(arena_size=256 << 20) as ap,
            AsyncConsumer(0, ap.address) as c,
        ):
            await ap.wait_for_consumers([0], 10)
            # made before the ticker starts: making them on the loop is the test's own stall
            big = np.random.default_rng(1).integers(0, 256, (3000, 4000, 3), np.uint8)
            images = [big, big[::-1].copy(), big]
            tick = asyncio.create_task(ticker())
            with pytest.raises(TimeoutError):
                await c.recv(0.5)  # a sync recv here froze the loop for 0.5 s
            got = []
            for i, image in enumerate(images):  # 36 MB each: copied and hashed on the worker
                await ap.publish(f"r{i}", [_item(image)])
                async with c.recv(10) as batch:
                    got.append(batch.envelopes[GlobalIndex(0)].request_id)
                    assert np.array_equal(batch.open(GlobalIndex(0)), image)
            stop.set()
            await tick
            assert settle(ap.producer, lambda: ap.statistics().arena.leases_outstanding == 0)
        return gaps, got

    gaps, got = asyncio.run(main())
    assert got == ["r0", "r1", "r2"]
    assert len(gaps) > 40
    # a blocked loop shows as one gap of the whole wait (0.5 s); scheduling noise on a
    # loaded machine stays far below it
    assert max(gaps) < 0.25, f"the loop stalled for {max(gaps):.3f} s"


def test_async_with_releases_and_a_release_from_an_executor_thread_reaches_the_producer() -> None:
    async def main() -> None:
        async with AsyncProducer(arena_size=8 << 20) as ap:
            c = AsyncConsumer(0, ap.address)
            await ap.wait_for_consumers([0], 10)
            loop = asyncio.get_running_loop()
            pool = ThreadPoolExecutor(4)
            for i in range(200):
                await ap.publish(f"r{i}", [_item(_distinct(i))])
                batch = await c.recv(10)
                assert np.array_equal(batch.open(GlobalIndex(0)), _distinct(i))
                # the engine's worker finishes with it off the loop: that thread releases
                await loop.run_in_executor(pool, batch.release)
            for _ in range(200):
                if ap.statistics().arena.leases_outstanding == 0:
                    break
                await asyncio.sleep(0.05)
            assert ap.statistics().arena.leases_outstanding == 0
            assert c.group.statistics()[0].leases_held == 0
            c.close()
            pool.shutdown()

    asyncio.run(main())


def test_an_async_consumer_needs_a_running_loop() -> None:
    with Producer(arena_size=1 << 20) as p, pytest.raises(ConfigurationError, match="event loop"):
        AsyncConsumer(0, p.address)


def test_async_publish_awaits_back_pressure_without_blocking_the_loop() -> None:
    async def main() -> None:
        async with (
            AsyncProducer(arena_size=4 << 20, full_timeout=10) as ap,
            AsyncConsumer(0, ap.address) as c,
        ):
            await ap.wait_for_consumers([0], 10)
            imgs = [_distinct(i, (700, 700, 3)) for i in range(3)]  # two fit
            await ap.publish("a", [_item(imgs[0])])
            await ap.publish("b", [_item(imgs[1])])
            third = asyncio.create_task(ap.publish("c", [_item(imgs[2])]))

            async def waiting() -> None:
                while ap.statistics().arena.waiting_for_room == 0:
                    await asyncio.sleep(0.005)

            await asyncio.wait_for(waiting(), 10)  # it reached the wait for room
            assert not third.done()  # and waits, on the worker thread
            first = await c.recv(5)  # the loop is free: this rank still receives
            first.release()
            await asyncio.wait_for(third, 10)
            assert ap.statistics().arena.waiting_for_room == 0
            for name in ("b", "c"):
                async with c.recv(5) as batch:
                    assert batch.envelopes[GlobalIndex(0)].request_id == name

    asyncio.run(main())


def test_a_scheduler_loop_polls_without_blocking_and_sleeps_on_the_descriptor() -> None:
    with Producer(arena_size=8 << 20) as p, Consumer(0, p.endpoint, handover=p.handover_path) as c:
        p.wait_for_consumers([0], 10)
        assert c.try_recv() is None
        fd = c.fileno()
        for i in range(50):
            p.publish(f"r{i}", [_item(_distinct(i))])
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while len(seen) < 50 and time.monotonic() < deadline:
            while (batch := c.try_recv()) is not None:  # drain before sleeping
                with batch:
                    seen.append(batch.envelopes[GlobalIndex(0)].request_id)
            select.select([fd], [], [], 0.05)
        assert seen == [f"r{i}" for i in range(50)]
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)


def test_releases_from_many_threads_while_the_rank_keeps_receiving() -> None:
    n = 2000
    with Producer(arena_size=64 << 20, max_backlog=n + 10) as p:
        c = Consumer(0, p.endpoint, handover=p.handover_path, max_backlog=n + 10)
        try:
            p.wait_for_consumers([0], 10)
            for i in range(n):
                p.publish(f"r{i}", [_item(_distinct(i, (4, 4, 3)))])
            with ThreadPoolExecutor(8) as pool:
                for i in range(n):
                    batch = c.recv(10)  # this thread uses the socket...
                    assert np.array_equal(batch.open(GlobalIndex(0)), _distinct(i, (4, 4, 3)))
                    pool.submit(batch.release)  # ...while eight others release
            c.try_recv()  # sends whatever a busy socket left queued
            assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
            assert c.statistics().leases_held == 0
            assert p.statistics().releases_ignored == 0
        finally:
            c.close()


def test_one_rank_fed_by_two_producers_survives_one_of_them_crashing() -> None:
    local = Producer(arena_size=8 << 20)
    q: Any = CHILDREN.Queue()
    kid = CHILDREN.Process(target=procs.produce_forever, args=("far", q))
    kid.start()
    group = None
    try:
        _, _, endpoint, handover = q.get(timeout=60)
        far = local.address.__class__(endpoint, handover)
        group = ConsumerGroup(0, [local.address, far])
        local.wait_for_consumers([0], 10)
        order: dict[str, list[int]] = {"near": [], "far": []}
        gone: list[str] = []
        i = 0
        deadline = time.monotonic() + 60
        while len(order["near"]) < 200 and time.monotonic() < deadline:
            if i < 200:
                local.publish(f"near-{i}", [_item(_distinct(10_000 + i))])
                i += 1
            if i == 100 and kid.is_alive():
                time.sleep(0.05)
                os.kill(kid.pid or 0, signal.SIGKILL)  # mid-run, its batches in flight
                kid.join(10)
            try:
                batch = group.recv(0.01)
            except TimeoutError:
                continue
            except PeerGone as e:
                gone.append(str(e))
                continue
            with batch:
                name, k = batch.envelopes[GlobalIndex(0)].request_id.split("-")
                if name == "near":
                    assert np.array_equal(batch.open(GlobalIndex(0)), _distinct(10_000 + int(k)))
                else:
                    try:
                        assert np.array_equal(batch.open(GlobalIndex(0)), _distinct(int(k)))
                    except PeerGone:
                        assert not kid.is_alive()  # queued before the crash, opened after
                order[name].append(int(k))
        assert order["near"] == list(range(200)), "the live producer lost or reordered one"
        assert order["far"] == list(range(len(order["far"]))) and order["far"]
        assert len(gone) == 1 and "producer 1" in gone[0]
        assert group.producers_live == 1
        assert settle(local, lambda: local.statistics().arena.leases_outstanding == 0)
    finally:
        if kid.is_alive():
            kid.kill()
        if group is not None:
            group.close()
        local.close()


def test_an_async_rank_receives_from_two_frontends_in_their_own_order() -> None:
    async def main() -> None:
        async with (
            AsyncProducer(arena_size=8 << 20) as a,
            AsyncProducer(arena_size=8 << 20) as b,
            AsyncConsumer(0, [a.address, b.address]) as c,
        ):
            await a.wait_for_consumers([0], 10)
            await b.wait_for_consumers([0], 10)

            async def feed(ap: AsyncProducer, name: str) -> None:
                for i in range(50):
                    await ap.publish(f"{name}-{i}", [_item(_distinct(i))])

            feeding = asyncio.gather(feed(a, "a"), feed(b, "b"))
            seen: dict[str, list[int]] = {"a": [], "b": []}
            for _ in range(100):
                async with c.recv(10) as batch:
                    name, i = batch.envelopes[GlobalIndex(0)].request_id.split("-")
                    assert np.array_equal(batch.open(GlobalIndex(0)), _distinct(int(i)))
                    seen[name].append(int(i))
            await feeding
            assert seen == {"a": list(range(50)), "b": list(range(50))}

    asyncio.run(main())


def test_a_consumer_group_needs_a_producer() -> None:
    with pytest.raises(ConfigurationError, match="at least one"):
        ConsumerGroup(0, [])


def test_a_thread_that_releases_after_the_consumer_closed_does_not_raise() -> None:
    with Producer(arena_size=8 << 20) as p:
        c = Consumer(0, p.endpoint, handover=p.handover_path)
        p.wait_for_consumers([0], 10)
        p.publish("r", [_item(_distinct(0))])
        batch = c.recv(10)
        c.close()
        t = threading.Thread(target=batch.release)
        t.start()
        t.join(5)
        assert not t.is_alive()


def test_a_cancelled_publish_is_withdrawn_or_reported_sent_never_duplicated() -> None:
    taken = threading.Event()

    def spec_on_the_worker(width: int, height: int) -> Any:
        taken.set()  # the worker thread is running this publish
        return raw_spec(width, height)

    async def main() -> None:
        async with (
            AsyncProducer(arena_size=4 << 20, full_timeout=10) as ap,
            AsyncConsumer(0, ap.address) as c,
        ):
            await ap.wait_for_consumers([0], 10)
            imgs = [_distinct(i, (700, 700, 3)) for i in range(3)]  # two fit
            await ap.publish("a", [_item(imgs[0])])
            await ap.publish("b", [_item(imgs[1])])
            # "c" is taken by the worker and waits for room; "d" is queued behind it
            third = Item(imgs[2], consumers=(0,), preprocess=spec_on_the_worker)
            started = asyncio.create_task(ap.publish("c", [third]))
            queued = asyncio.create_task(ap.publish("d", [_item(_distinct(9))]))
            assert await asyncio.get_running_loop().run_in_executor(None, taken.wait, 10)
            started.cancel()
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued  # withdrawn: never sent
            (await c.recv(5)).release()  # room for "c"
            sent = await asyncio.wait_for(started, 10)  # sent: its envelopes, not an error
            assert [e.request_id for e in sent] == ["c"]
            await ap.publish("e", [_item(_distinct(8))])
            names = []
            for _ in range(3):
                async with c.recv(5) as batch:
                    names.append(batch.envelopes[GlobalIndex(0)].request_id)
            assert names == ["b", "c", "e"]
            assert c.try_recv() is None

    asyncio.run(main())


def test_a_small_publish_runs_on_the_loop_and_a_large_one_on_the_worker_in_order() -> None:
    """A small request is published on the event loop's own thread (no hop to a thread); a
    large one on the worker; a small one awaited behind a large one still running waits
    for it, so the rank receives them in the order they were awaited."""
    threads: dict[str, int] = {}
    gate = threading.Event()

    def spec_seen_by(name: str, hold: bool = False) -> Any:
        def spec(width: int, height: int) -> Any:
            threads[name] = threading.get_ident()
            if hold:
                gate.wait(10)  # keep the worker busy until the small one is queued
            return raw_spec(width, height)

        return spec

    async def main() -> None:
        async with (
            AsyncProducer(arena_size=16 << 20) as ap,
            AsyncConsumer(0, ap.address) as c,
        ):
            await ap.wait_for_consumers([0], 10)
            loop_thread = threading.get_ident()
            small, large = _distinct(1, (64, 64, 3)), _distinct(2, (700, 700, 3))  # 12 KiB, 1.4 MiB
            await ap.publish("small", [Item(small, consumers=(0,), preprocess=spec_seen_by("s"))])
            assert threads["s"] == loop_thread
            first = asyncio.create_task(
                ap.publish(
                    "large", [Item(large, consumers=(0,), preprocess=spec_seen_by("l", True))]
                )
            )
            await asyncio.sleep(0)  # "large" went to the worker, which its spec holds
            second = asyncio.create_task(
                ap.publish(
                    "after",
                    [Item(small[::-1].copy(), consumers=(0,), preprocess=spec_seen_by("a"))],
                )
            )
            await asyncio.sleep(0)
            gate.set()
            await asyncio.gather(first, second)
            assert threads["l"] != loop_thread and threads["a"] == threads["l"]
            names = []
            for _ in range(3):
                async with c.recv(5) as batch:
                    names.append(batch.envelopes[GlobalIndex(0)].request_id)
            assert names == ["small", "large", "after"]

    asyncio.run(main())
