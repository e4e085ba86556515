"""The cpu backend with real processes, real zmq sockets and real shared memory."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import signal
import time
from typing import Any

import msgspec
import numpy as np
import procs
import pytest
from helpers import raw_spec, settle
from mmwire.transport import Consumer, CurveKeys, GlobalIndex, Grid, Item, Producer
from mmwire.transport.errors import (
    ArenaFull,
    ClosedResourceError,
    EnvelopeError,
    InvalidRequest,
    NotAConsumer,
    OffsetError,
    StaleReference,
)
from mmwire.transport.wire import CpuRef, InlineRef, encode_batch
from procs import CHILDREN


def _raw_item(img: np.ndarray, owners: tuple[int, ...]) -> Item:  # type: ignore[type-arg]
    return Item(data=img, consumers=owners, preprocess=raw_spec(img.shape[1], img.shape[0]))


class _Inbox:
    """A child-process queue read by message kind; messages of other kinds wait their turn.

    The parked messages belong to this inbox alone (keying them by ``id(queue)`` let a later
    test's queue, reusing a freed id, read an earlier test's leftovers).
    """

    def __init__(self) -> None:
        self.q: Any = CHILDREN.Queue()
        self._parked: list[tuple] = []  # type: ignore[type-arg]

    def get(self, kind: str, timeout: float = 60) -> tuple:  # type: ignore[type-arg]
        for i, msg in enumerate(self._parked):
            if msg[0] == kind:
                return self._parked.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            msg = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            if msg[0] == kind:
                return msg  # type: ignore[no-any-return]
            self._parked.append(msg)


def test_four_ranks_read_their_items_byte_exact(rng: np.random.Generator) -> None:
    p = Producer(arena_size=1 << 24)
    inbox = _Inbox()
    q = inbox.q
    kids = [
        CHILDREN.Process(target=procs.consume, args=(r, p.endpoint, p.handover_path, 2, q))
        for r in range(4)
    ]
    try:
        for k in kids:
            k.start()
        p.wait_for_consumers(range(4), 60)
        sizes = [(37, 53), (61, 29), (45, 46), (80, 12)]
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        owners = [(2,), (0,), (2,), (1,)]  # rank 3 owns nothing
        p.publish("req-a", [_raw_item(img, o) for img, o in zip(images, owners)])
        p.publish("req-b", [_raw_item(images[0], (3,)), _raw_item(images[1], (0, 1))])
        per_rank: dict[int, list[tuple]] = {r: [] for r in range(4)}  # type: ignore[type-arg]
        for _ in range(8):
            m = inbox.get("batch")
            per_rank[m[1]].append(m)
        first = {r: msgs[0] for r, msgs in per_rank.items()}
        for r in range(4):
            _, rank, digests, opened, _rss, _ = first[r]
            want = {
                i: hashlib.sha256(images[i].tobytes()).hexdigest()
                for i, o in enumerate(owners)
                if rank in o
            }
            assert digests == want
            assert opened == len(want)
        assert first[3][3] == 0 and first[3][4] == 0, "a non-owner must never touch the arena"
        assert per_rank[3][1][2] == {0: hashlib.sha256(images[0].tobytes()).hexdigest()}
        for _ in range(4):
            inbox.get("done")
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        st = p.statistics().arena
        assert st.leases_outstanding == 0 and st.bytes_in_use == 0
        # req-b's payloads were resident (req-a's lease): referenced again, not copied
        assert st.leases_total == 1 and st.payloads_reused == 2
    finally:
        for k in kids:
            k.join(10)
        p.close()


def test_killed_consumer_releases_its_leases(rng: np.random.Generator) -> None:
    p = Producer(arena_size=1 << 22)
    # Separate queues: a process killed right after a put can die holding its queue's
    # write lock, which would then block every other writer of that queue.
    holder_inbox, survivor_inbox = _Inbox(), _Inbox()
    holder = CHILDREN.Process(
        target=procs.consume, args=(0, p.endpoint, p.handover_path, 1, holder_inbox.q, True)
    )
    survivor = CHILDREN.Process(
        target=procs.consume, args=(1, p.endpoint, p.handover_path, 2, survivor_inbox.q)
    )
    try:
        holder.start()
        survivor.start()
        p.wait_for_consumers([0, 1], 60)
        img = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
        p.publish("r1", [_raw_item(img, (0,)), _raw_item(img[:20], (1,))])
        victim = holder_inbox.get("batch")
        survivor_inbox.get("batch")
        assert p.statistics().arena.leases_outstanding == 1
        os.kill(victim[5], signal.SIGKILL)
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert p.statistics().arena.bytes_in_use == 0
        p.publish("r2", [_raw_item(img[:10], (1,))])  # the survivor keeps working
        assert survivor_inbox.get("done")[1] == 1
    finally:
        holder.join(10)
        survivor.join(10)
        p.close()


def test_killed_producer_leaves_nothing_and_consumers_get_an_error() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    prod_q, inbox = CHILDREN.Queue(), _Inbox()  # separate queues, as in the test above
    prod = CHILDREN.Process(target=procs.producer_then_die, args=(prod_q,))
    prod.start()
    endpoint, handover = prod_q.get(timeout=60)
    cons = CHILDREN.Process(target=procs.wait_then_recv, args=(0, endpoint, handover, inbox.q))
    cons.start()
    inbox.get("joined")
    time.sleep(0.5)
    os.kill(prod.pid, signal.SIGKILL)  # type: ignore[arg-type]
    msg = inbox.get("peer-gone", 30)
    assert "producer went away" in msg[2]
    cons.join(10)
    prod.join(10)
    leaked = {n for n in set(os.listdir("/dev/shm")) - shm_before if not n.startswith("sem.mp-")}
    assert leaked == set()  # (the test's own multiprocessing queue semaphores aside)


@pytest.mark.producer(full_timeout=0.3)
def test_tiny_arena_back_pressure_then_arena_full(pair: tuple[Producer, Consumer]) -> None:
    p, c = pair
    # ~1.4 MiB each: two fit in a 4 MiB arena (distinct, so none is reused by digest)
    imgs = [np.full((700, 700, 3), k, np.uint8) for k in range(3)]
    img = imgs[1]
    p.publish("a", [_raw_item(imgs[0], (0,))])
    p.publish("b", [_raw_item(img, (0,))])
    with pytest.raises(ArenaFull, match=r"needs \d+ bytes; arena has \d+ of \d+ bytes free"):
        p.publish("c", [_raw_item(imgs[2], (0,))])
    a = c.recv(5)
    b = c.recv(5)
    assert np.array_equal(b.open(GlobalIndex(0)), img)
    a.release()  # back-pressure resolves once a lease comes back
    p.publish("c", [_raw_item(imgs[2], (0,))])
    cc = c.recv(5)
    assert cc.envelopes[GlobalIndex(0)].request_id == "c"
    b.release()
    cc.release()
    assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    assert p.statistics().arena.bytes_in_use == 0


@pytest.mark.producer(on_full="inline", full_timeout=0.1)
def test_inline_fallback_when_full(pair: tuple[Producer, Consumer]) -> None:
    p, c = pair
    img = np.arange(900 * 900 * 3, dtype=np.uint64).astype(np.uint8).reshape(900, 900, 3)
    p.publish("a", [_raw_item(img[::-1].copy(), (0,))])  # another payload: not reused
    with pytest.warns(RuntimeWarning, match="arena full"):
        envs = p.publish("b", [_raw_item(img, (0,))])
    assert isinstance(envs[0].payload, InlineRef)
    c.recv(5).release()
    with c.recv(5) as b:
        assert np.array_equal(b.open(GlobalIndex(0)), img)
    assert p.statistics().inline_fallbacks == 1


def test_stale_forged_and_foreign_references(pair: tuple[Producer, Consumer]) -> None:
    p, c = pair
    img = np.full((20, 30, 3), 7, np.uint8)
    envs = p.publish("r", [_raw_item(img, (0,))])
    batch = c.recv(5)
    env = envs[0]
    ref = env.payload
    assert isinstance(ref, CpuRef)

    def forged(**change: int) -> Any:
        e = msgspec.structs.replace(env, payload=msgspec.structs.replace(ref, **change))
        return c.decode(encode_batch([e])).open(GlobalIndex(0))

    with pytest.raises(StaleReference, match="generation"):
        forged(generation=ref.generation + 1)
    with pytest.raises(OffsetError, match="outside its lease"):
        forged(offset=ref.offset + 8192)
    with pytest.raises(OffsetError, match="outside the arena"):
        forged(lease=1 << 40)
    with pytest.raises(StaleReference, match="not mapped"):
        c.decode(
            encode_batch(
                [
                    msgspec.structs.replace(
                        env, payload=msgspec.structs.replace(ref, arena_id="f" * 32)
                    )
                ]
            )
        ).open(GlobalIndex(0))
    other = msgspec.structs.replace(env, consumers=(5,))
    with pytest.raises(NotAConsumer, match="rank 0 is not a consumer"):
        c.decode(encode_batch([other])).open(GlobalIndex(0))
    with pytest.raises(EnvelopeError):
        c.decode([b"\x00garbage"])
    assert np.array_equal(batch.open(GlobalIndex(0)), img)  # still serving
    batch.release()
    with pytest.raises(ClosedResourceError):
        batch.open(GlobalIndex(0))
    assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    # a released lease stays resident for reuse by digest until its room is needed
    assert np.array_equal(c.decode(encode_batch([env])).open(GlobalIndex(0)), img)
    room = p.arena.allocate([p.arena.capacity - 4096], set(), 1.0)  # all of it: evicts it
    with pytest.raises(StaleReference):
        c.decode(encode_batch([env])).open(GlobalIndex(0))
    p.arena.release_all(room.start, room.generation)


def test_non_owner_cannot_open(pair: tuple[Producer, Consumer]) -> None:
    p, c = pair
    c1 = Consumer(1, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0, 1], 10)
        p.publish("r", [_raw_item(np.zeros((9, 9, 3), np.uint8), (0,))])
        b1 = c1.recv(5)
        assert b1.owned == ()
        with pytest.raises(NotAConsumer):
            b1.open(GlobalIndex(0))
        b1.release()  # releases nothing: rank 1 holds no lease
        assert c1.statistics().leases_held == 0
        c.recv(5).release()
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    finally:
        c1.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run an intruder under another uid")
def test_connection_from_another_uid_is_refused(tmp_path: Any) -> None:
    p = Producer(arena_size=1 << 20)
    inbox = _Inbox()
    q = inbox.q
    try:
        # an abstract socket has no file permissions: the SO_PEERCRED check refuses
        kid = CHILDREN.Process(target=procs.intruder, args=(p.handover_path, q))
        kid.start()
        msg = q.get(timeout=60)
        kid.join(10)
        assert msg.startswith("HandoverRefused") and "uid 65534 is not in the allowed uids" in msg
        assert p.statistics().handovers_refused == 1
    finally:
        p.close()


def test_ten_thousand_requests_keep_fds_and_rss_flat(pair: tuple[Producer, Consumer]) -> None:
    p, c = pair
    imgs = [np.full((h, h + 3, 3), h % 251, np.uint8) for h in (8, 17, 33)]

    def run(n: int) -> None:
        for i in range(n):
            p.publish(f"r{i}", [_raw_item(img, (0,)) for img in imgs])
            with c.recv(5) as b:
                assert b.open(GlobalIndex(2))[0, 0, 0] == 33
            if i % 64 == 0:
                p.poll(0)

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    run(500)
    gc.collect()  # an earlier test's garbage closing its descriptors mid-run is no gain here
    fds, rss = len(os.listdir("/proc/self/fd")), rss_kib()
    run(10_000)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds  # a leak adds; nothing here may
    assert rss_kib() - rss < 8 * 1024, "RSS grew by more than 8 MiB over 10k requests"
    assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    assert p.statistics().arena.bytes_in_use == 0


@pytest.mark.parametrize("use_curve", [False, True])
def test_cross_host_consumer_over_tcp(use_curve: bool, rng: np.random.Generator) -> None:
    server = CurveKeys.generate() if use_curve else None
    client = CurveKeys.generate() if use_curve else None
    with contextlib.ExitStack() as insecure:
        if not use_curve:  # tcp without CURVE is refused unless asked for, and then warns
            insecure.enter_context(pytest.warns(RuntimeWarning, match="without CURVE"))
        p = Producer(
            "tcp://127.0.0.1:*",
            arena_size=1 << 24,
            curve=server,
            curve_clients=[client.public] if client else (),
            allow_insecure_tcp=not use_curve,
        )
    remote = Consumer(
        1,
        p.endpoint,
        handover=None,
        curve_server_key=server.public if server else None,
        curve=client,
    )
    local = Consumer(  # rank 0 shares the host (and the arena) with the producer
        0,
        p.endpoint,
        handover=p.handover_path,
        curve_server_key=server.public if server else None,
        curve=client,
    )
    try:
        p.wait_for_consumers([0, 1], 10)
        big = rng.integers(0, 256, (512, 700, 3), dtype=np.uint8)  # above the copy threshold
        small = rng.integers(0, 256, (7, 9, 3), dtype=np.uint8)
        p.publish("x", [_raw_item(big, (1,)), _raw_item(small, (1,))])
        with remote.recv(10) as b:
            assert isinstance(b.envelopes[GlobalIndex(0)].payload, InlineRef)
            assert np.array_equal(b.open(GlobalIndex(0)), big)
            assert np.array_equal(b.open(GlobalIndex(1)), small)
        assert not remote.statistics().arena_mapped
        # A remote rank gets the bytes of its own items only; the rest is metadata.
        p.publish("y", [_raw_item(small, (0,)), _raw_item(big, (1,))])
        with remote.recv(10) as b:
            assert isinstance(b.envelopes[GlobalIndex(0)].payload, CpuRef)
            assert isinstance(b.envelopes[GlobalIndex(1)].payload, InlineRef)
            assert b.owned == (GlobalIndex(1),)
            assert np.array_equal(b.open(GlobalIndex(1)), big)
            with pytest.raises(NotAConsumer):
                b.open(GlobalIndex(0))
        local.recv(10).release()  # "x": nothing of rank 0's
        with local.recv(10) as b:
            assert np.array_equal(b.open(GlobalIndex(0)), small)
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert p.statistics().arena.bytes_in_use == 0
        if use_curve:  # a client without the key gets nothing
            stranger = Consumer(2, p.endpoint, curve_server_key=server.public)  # type: ignore[union-attr]
            try:
                with pytest.raises(TimeoutError):
                    p.wait_for_consumers([2], 1.0)
            finally:
                stranger.close()
    finally:
        local.close()
        remote.close()
        p.close()


def test_publish_accepts_tensors_pil_and_encoded_bytes(
    pair: tuple[Producer, Consumer],
) -> None:
    import io

    import torch
    from PIL import Image

    p, c = pair
    rgba = Image.fromarray(np.arange(12 * 10 * 4, dtype=np.uint8).reshape(12, 10, 4), "RGBA")
    png = io.BytesIO()
    Image.fromarray(np.full((6, 8, 3), 200, np.uint8)).save(png, "PNG")
    emb = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    envs = p.publish(
        "m",
        [
            Item(data=rgba, consumers=(0,), preprocess=raw_spec),
            Item(data=png.getvalue(), consumers=(0,), preprocess=raw_spec, decode=True),
            Item(data=emb, consumers=(0,), kind="embedding", grid=Grid((4, 4))),
            Item(data=png.getvalue(), consumers=(0,), preprocess=raw_spec),  # as it is
        ],
    )
    assert envs[0].tensor.shape == (12, 10, 4) and envs[1].tensor.shape == (6, 8, 3)
    assert envs[3].kind == "encoded" and envs[3].tensor.shape == (len(png.getvalue()),)
    with c.recv(5) as b:
        assert np.array_equal(b.open(GlobalIndex(0)), np.asarray(rgba))
        assert (b.open(GlobalIndex(1)) == 200).all()
        assert torch.equal(b.open_tensor(GlobalIndex(2)), emb)
        assert bytes(b.open(GlobalIndex(3))) == png.getvalue()
    with pytest.raises(InvalidRequest, match="cannot publish"):
        p.publish("bad", [Item(data=[1, 2], consumers=(0,), kind="embedding", grid=Grid((1, 1)))])
    # the consumer's release reaches the producer asynchronously
    assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    assert p.statistics().arena.leases_outstanding == 0


def test_a_big_endian_array_arrives_with_its_values(pair: tuple[Producer, Consumer]) -> None:
    """The wire's dtypes are the hosts' byte order: a big-endian array is converted once."""
    p, c = pair
    values = np.arange(-50, 50, dtype=">i4").reshape(10, 10)
    envs = p.publish(
        "be", [Item(data=values, consumers=(0,), kind="processed", grid=Grid((1, 10)))]
    )
    assert envs[0].tensor.dtype == "int32"
    with c.recv(5) as batch:
        got = batch.open(GlobalIndex(0))
        assert got.dtype == np.dtype("int32") and np.array_equal(got, values)
