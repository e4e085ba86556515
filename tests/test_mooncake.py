"""The cross-host backend: payloads pulled through Mooncake's Transfer Engine, for real,
between processes over loopback TCP (its CPU build; CI installs it and its system
libraries, and sets ``MMWIRE_REQUIRE_MOONCAKE`` so that a missing engine fails there)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import procs
import pytest
from helpers import settle
from mmwire.transport import (
    AsyncConsumer,
    Consumer,
    CurveKeys,
    GlobalIndex,
    Grid,
    Item,
    MooncakeTransfer,
    Producer,
    ProducerAddress,
)
from mmwire.transport.errors import (
    ConfigurationError,
    HandoverRefused,
    OffsetError,
    PeerGone,
    StaleReference,
)
from mmwire.transport.wire import CpuRef, encode_batch
from procs import CHILDREN

try:
    import mooncake.engine  # noqa: F401

    WHY = ""
except ImportError as e:
    WHY = str(e)
if WHY and os.environ.get("MMWIRE_REQUIRE_MOONCAKE"):
    raise RuntimeError(f"MMWIRE_REQUIRE_MOONCAKE is set and the engine does not import: {WHY}")

pytestmark = pytest.mark.skipif(bool(WHY), reason=f"Mooncake does not import here: {WHY}")


def _item(data: np.ndarray[Any, Any], *ranks: int) -> Item:
    return Item(data, consumers=ranks, kind="embedding", grid=Grid((1, 1)))


def _window(p: Producer) -> Any:
    st = p.statistics().transfer_window
    assert st is not None
    return st


def _idle(p: Producer) -> bool:
    """No lease outstanding in the producer's arena or its transfer window."""
    return p.statistics().arena.leases_outstanding == 0 and _window(p).leases_outstanding == 0


def _sha(a: np.ndarray[Any, Any]) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


@contextmanager
def _remote_producer(
    window_size: int = 64 << 20, **kw: Any
) -> Iterator[tuple[Producer, CurveKeys, CurveKeys]]:
    server, client = CurveKeys.generate(), CurveKeys.generate()
    p = Producer(
        "tcp://127.0.0.1:*",
        curve=server,
        curve_clients=[client.public],
        transfer=MooncakeTransfer(window_size=window_size),
        **kw,
    )
    try:
        yield p, server, client
    finally:
        p.close()


def _puller(p: Producer, server: CurveKeys, client: CurveKeys, rank: int = 0) -> Consumer:
    return Consumer(
        rank,
        p.endpoint,
        curve_server_key=server.public,
        curve=client,
        transfer=MooncakeTransfer(),
        receive_pool_size=16 << 20,
    )


def test_a_remote_rank_pulls_its_own_items_and_the_arena_is_free_once_it_has(
    rng: np.random.Generator,
) -> None:
    with _remote_producer(arena_size=1 << 25, reuse=False) as (p, server, client):
        local = Consumer(
            0, p.endpoint, handover=p.handover_path, curve_server_key=server.public, curve=client
        )
        q, go = CHILDREN.Queue(), CHILDREN.Queue()
        proc = CHILDREN.Process(
            target=procs.mooncake_consume, args=(1, p.endpoint, server.public, client, 2, q, go)
        )
        proc.start()
        try:
            assert q.get(timeout=60)[0] == "joined"
            p.wait_for_consumers([0, 1], 30)
            for n in range(2):  # distinct sizes; rank 1 owns some, rank 0 others, one both
                data = [
                    rng.integers(0, 256, size, dtype=np.uint8) for size in (3 << 20, 777, 65_537)
                ]
                owners = [(1,), (0,), (0, 1)] if n == 0 else [(0,), (1,), (1,)]
                p.publish(f"r{n}", [_item(d, *o) for d, o in zip(data, owners)])
                tag, rank, digests, kinds = q.get(timeout=60)
                assert tag == "batch" and rank == 1
                assert kinds == ["CpuRef"] * 3  # references travel, not the bytes
                want = {k: _sha(d) for k, (d, o) in enumerate(zip(data, owners)) if 1 in o}
                assert digests == want
                with local.recv(10) as b:
                    assert all(np.array_equal(b.open(g), data[g.value]) for g in b.owned)
                # rank 1 still holds its batch, but the transfer is done: nothing is leased
                assert settle(p, lambda: _idle(p))
                go.put("release")
            assert q.get(timeout=30)[0] == "done"
        finally:
            proc.join(30)
            local.close()
        assert proc.exitcode == 0
        assert p.statistics().arena.bytes_in_use == 0


def test_a_producer_without_a_transfer_engine_refuses_a_pulling_join() -> None:
    server, client = CurveKeys.generate(), CurveKeys.generate()
    p = Producer("tcp://127.0.0.1:*", curve=server, curve_clients=[client.public])
    c = Consumer(
        0, p.endpoint, curve_server_key=server.public, curve=client, transfer=MooncakeTransfer()
    )
    try:
        with pytest.raises(HandoverRefused, match="no `transfer`"):
            c.recv(10)
        assert p.statistics().consumers == ()
    finally:
        c.close()
        p.close()


def test_forged_and_stale_references_are_refused_and_the_rank_keeps_serving() -> None:
    with _remote_producer(window_size=1 << 22, arena_size=1 << 22, reuse=False) as (
        p,
        server,
        client,
    ):
        c = _puller(p, server, client)
        try:
            p.wait_for_consumers([0], 30)
            first = np.full(5000, 7, np.uint8)
            p.publish("old", [_item(first, 0)])
            with c.recv(10) as b:
                old = list(b.envelopes.values())
                assert np.array_equal(b.open(GlobalIndex(0)), first)
            assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
            assert settle(p, lambda: _window(p).leases_outstanding == 0)  # its range is free
            p.publish("new", [_item(np.full(5000, 9, np.uint8), 0)])  # the same range, reused
            with c.recv(10) as b:
                assert int(b.open(GlobalIndex(0))[0]) == 9
            ref = old[0].payload
            assert isinstance(ref, CpuRef)

            def forged(**change: Any) -> list[Any]:
                env = msgspec.structs.replace(
                    old[0], payload=msgspec.structs.replace(ref, **change)
                )
                return encode_batch([env])

            with pytest.raises(StaleReference, match="generation"):  # read, then refused
                c.decode(encode_batch(old))
            with pytest.raises(StaleReference, match="not the offered one"):
                c.decode(forged(arena_id="f" * 32))
            with pytest.raises(OffsetError, match="outside the offered arena"):
                c.decode(forged(offset=(1 << 22) - 100))
            with pytest.raises(OffsetError, match="outside lease"):
                c.decode(forged(offset=ref.lease))
            last = np.arange(3000, dtype=np.uint8)
            p.publish("after", [_item(last, 0)])
            with c.recv(10) as b:
                assert np.array_equal(b.open(GlobalIndex(0)), last)
            # the refused batches' releases named leases this member no longer holds
            assert settle(p, lambda: _window(p).leases_outstanding == 0)
            assert p.statistics().arena.leases_outstanding == 0
        finally:
            c.close()


def test_a_remote_rank_killed_before_it_pulls_frees_its_leases() -> None:
    with _remote_producer(arena_size=1 << 24) as (p, server, client):
        q, go = CHILDREN.Queue(), CHILDREN.Queue()
        proc = CHILDREN.Process(
            target=procs.mooncake_consume, args=(0, p.endpoint, server.public, client, 5, q, go)
        )
        proc.start()
        try:
            _, _, pid = q.get(timeout=60)
            p.wait_for_consumers([0], 30)
            os.kill(pid, signal.SIGSTOP)  # it never pulls
            for n in range(3):
                p.publish(f"r{n}", [_item(np.full(1 << 20, n, np.uint8), 0)])
            assert _window(p).leases_outstanding == 3
            assert p.statistics().arena.leases_outstanding == 0  # it reads the window only
            os.kill(pid, signal.SIGKILL)
            # its connection's heartbeat lapses, its member ends, and its leases go back
            assert settle(p, lambda: _window(p).leases_outstanding == 0, timeout=40)
            assert p.statistics().consumers == ()
        finally:
            proc.join(10)
        # the producer serves a new rank 0 in its place
        c = _puller(p, server, client)
        try:
            p.wait_for_consumers([0], 30)
            p.publish("again", [_item(np.full(100, 5, np.uint8), 0)])
            with c.recv(10) as b:
                assert b.open(GlobalIndex(0)).tolist() == [5] * 100
        finally:
            c.close()


def test_a_producer_killed_before_the_pull_gives_the_rank_a_typed_error() -> None:
    client = CurveKeys.generate()
    q = CHILDREN.Queue()
    proc = CHILDREN.Process(target=procs.mooncake_produce_then_hang, args=(client.public, q))
    proc.start()
    c = None
    try:
        endpoint, server_key = q.get(timeout=60)
        c = Consumer(
            0,
            endpoint,
            curve_server_key=server_key,
            curve=client,
            transfer=MooncakeTransfer(),
            receive_pool_size=8 << 20,
        )
        assert q.get(timeout=60) == "sent"
        proc.kill()
        proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match="failed"):
            c.recv(30)
        assert time.monotonic() - t0 < 20
        with pytest.raises(TimeoutError):  # nothing left half-received
            c.recv(0.5)
    finally:
        if c is not None:
            c.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_an_asyncio_rank_of_two_producers_pulls_from_both() -> None:
    """``transfer`` passes through AsyncConsumer and ConsumerGroup to each producer's
    consumer: one receive pool and one offer per producer."""

    async def run(a: Producer, b: Producer, server: CurveKeys, client: CurveKeys) -> None:
        c = AsyncConsumer(
            0,
            [ProducerAddress(a.endpoint), ProducerAddress(b.endpoint)],
            curve_server_key=server.public,
            curve=client,
            transfer=MooncakeTransfer(),
            receive_pool_size=4 << 20,
        )
        try:
            for p in (a, b):
                await asyncio.to_thread(p.wait_for_consumers, [0], 30)
            a.publish("from-a", [_item(np.full(70_001, 1, np.uint8), 0)])
            b.publish("from-b", [_item(np.full(30_003, 2, np.uint8), 0)])
            got = {}
            for _ in range(2):
                async with c.recv(10) as batch:
                    env = batch.envelopes[GlobalIndex(0)]
                    got[env.request_id] = batch.open(GlobalIndex(0)).copy()
            assert got["from-a"].tolist() == [1] * 70_001
            assert got["from-b"].tolist() == [2] * 30_003
        finally:
            c.close()

    server, client = CurveKeys.generate(), CurveKeys.generate()
    producers = [
        Producer(
            "tcp://127.0.0.1:*",
            arena_size=1 << 22,
            curve=server,
            curve_clients=[client.public],
            transfer=MooncakeTransfer(),
        )
        for _ in range(2)
    ]
    try:
        asyncio.run(run(*producers, server, client))
        for p in producers:
            assert settle(p, lambda p=p: _idle(p))
    finally:
        for p in producers:
            p.close()


def test_a_stranger_on_the_engine_sees_no_local_payload_and_cannot_feed_a_rank_tampered_bytes(
    rng: np.random.Generator,
) -> None:
    """A process that never joined uses the engine's Python API as an attacker would: the
    only memory it reaches is the transfer window, which holds no local rank's bytes, and
    what it writes there is refused by the remote rank, which keeps serving."""
    with _remote_producer(window_size=4 << 20, arena_size=16 << 20) as (p, server, client):
        local = Consumer(
            0, p.endpoint, handover=p.handover_path, curve_server_key=server.public, curve=client
        )
        q, go, sq = CHILDREN.Queue(), CHILDREN.Queue(), CHILDREN.Queue()
        proc = CHILDREN.Process(
            target=procs.mooncake_pull_on_go, args=(1, p.endpoint, server.public, client, 2, q, go)
        )
        proc.start()
        try:
            assert q.get(timeout=60)[0] == "joined"
            p.wait_for_consumers([0, 1], 30)
            secret = rng.integers(0, 256, 100_003, np.uint8)
            remote = rng.integers(0, 256, 50_001, np.uint8)
            p.publish("r0", [_item(secret, 0), _item(remote, 1)])
            assert p._transfer is not None
            session = p._transfer.offer.session
            stranger = CHILDREN.Process(
                target=procs.mooncake_stranger,
                args=(session, 4 << 20, secret.tobytes(), remote.tobytes(), sq),
            )
            stranger.start()
            read, saw_secret, found, wrote = sq.get(timeout=60)
            stranger.join(30)
            assert read == 0 and found >= 0 and wrote == 0  # it did read and write the window
            assert not saw_secret  # but the local rank's payload is not there
            go.put("pull")
            assert q.get(timeout=60) == ("error", "IntegrityError")
            again = rng.integers(0, 256, 7_777, np.uint8)
            p.publish("r1", [_item(again, 1)])
            go.put("pull")
            assert q.get(timeout=60) == ("batch", {0: _sha(again)})
            with local.recv(10) as b:
                assert np.array_equal(b.open(GlobalIndex(0)), secret)
            assert q.get(timeout=30)[0] == "done"
            assert settle(p, lambda: _idle(p))
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
            local.close()


def test_a_producer_refuses_an_engine_on_an_untrusted_network_unless_told() -> None:
    with pytest.raises(ConfigurationError, match="trusted_network=True"):
        Producer(arena_size=1 << 20, transfer=MooncakeTransfer(hostname="10.1.2.3"))
    with pytest.raises(ConfigurationError, match="trusted_network=True"):
        Consumer(0, "tcp://10.1.2.3:5555", transfer=MooncakeTransfer(hostname="10.1.2.3"))


def test_two_remote_ranks_get_every_byte_right_while_a_stranger_hammers_the_engine() -> None:
    """500 requests to two remote ranks while a stranger floods the engine's port with junk
    connections and reads and overwrites the window: each rank gets every item it owns
    byte for byte, or a typed error for it, never other bytes; each request a rank could
    not take is reported lost, and the producer is left with no lease outstanding."""
    n = 500
    with _remote_producer(window_size=4 << 20, arena_size=32 << 20) as (p, server, client):
        q, hq, stop = CHILDREN.Queue(), CHILDREN.Queue(), CHILDREN.Event()
        ranks = [
            CHILDREN.Process(
                target=procs.mooncake_checker, args=(r, p.endpoint, server.public, client, q)
            )
            for r in (0, 1)
        ]
        for proc in ranks:
            proc.start()
        assert p._transfer is not None
        stranger = CHILDREN.Process(
            target=procs.mooncake_hammer, args=(p._transfer.offer.session, 4 << 20, stop, hq)
        )
        try:
            assert {q.get(timeout=60)[0] for _ in ranks} == {"joined"}
            p.wait_for_consumers([0, 1], 30)
            stranger.start()
            assert hq.get(timeout=60) == ("hammering",)
            for i in range(n):  # one item per rank per request, the owner alternating
                items = [
                    _item(np.frombuffer(procs.hammer_payload(i, k), np.uint8), (i + k) % 2)
                    for k in range(2)
                ]
                p.publish(f"r{i}", items)
            stop.set()
            tag, junk, reads, writes = hq.get(timeout=60)
            assert tag == "hammered" and junk > 0 and reads > 0 and writes > 0
            p.publish("stop", [_item(np.zeros(1, np.uint8), 0, 1)])
            reports = sorted(q.get(timeout=120) for _ in ranks)
            assert settle(p, lambda: _idle(p))
            lost = p.take_lost()
            for rank, (tag, r, exact, wrong, errors) in enumerate(reports):
                assert (tag, r, wrong) == ("checked", rank, 0), reports
                # tampered bytes fail their digest; a tampered lease header, its generation
                assert set(errors) <= {"IntegrityError", "StaleReference"}, reports
                assert exact > 0 and exact + sum(errors.values()) == n, reports
                # each request a rank could not take is reported to the producer, at once
                refused = [x for x in lost if x.rank == rank]
                odd = [x for x in refused if "could not take it" not in x.reason]
                assert not odd, odd  # e.g. its last release dropped as it closed
                assert len(refused) == sum(errors.values()), (reports, lost)
        finally:
            stop.set()
            for proc in (*ranks, stranger):
                if proc.pid is not None:
                    proc.join(30)
                    if proc.is_alive():
                        proc.kill()
