"""Buggy, slow, hung, replaced and hostile peers, with real processes, sockets and memfds.

Each test here is one way a peer can misbehave; the producer must keep serving, lose
nothing silently, leak nothing, and report a typed ``MmwireError``.
"""

from __future__ import annotations

import collections
import io
import logging
import mmap
import os
import signal
import socket
import struct
import tempfile
import threading
import time
import zlib
from multiprocessing import forkserver
from typing import Any

import msgspec
import numpy as np
import procs
import pytest
from helpers import raw_spec, settle
from mmwire.transport import Consumer, CurveKeys, GlobalIndex, Item, LostRequest, Producer
from mmwire.transport._control import ENCODER, Release
from mmwire.transport._handover import receive_arena, socket_address
from mmwire.transport.errors import (
    ArenaFull,
    ConfigurationError,
    EnvelopeError,
    FrameError,
    HandoverRefused,
    ImageDecodeError,
    InvalidRequest,
    MaterializeError,
    MmwireError,
    PeerGone,
    WaitTimeout,
)
from mmwire.transport.wire import CpuRef
from PIL import Image
from procs import CHILDREN
from test_cpu_backend import _Inbox


def _item(data: Any, owners: tuple[int, ...] = (0,)) -> Item:
    return Item(data=data, consumers=owners, preprocess=raw_spec)


def _bytes_item(i: int, owners: tuple[int, ...] = (0,)) -> Item:
    pixels = np.frombuffer(procs.pattern(i), np.uint8).reshape(32, 32, 4)
    return Item(data=pixels, consumers=owners, preprocess=raw_spec)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_diff(before: list[str]) -> tuple[list[str], list[str]]:
    """What this process's descriptors point at now and not before (a leak), and the
    reverse (an earlier test's objects collected meanwhile)."""
    now = collections.Counter(_fd_targets())
    then = collections.Counter(before)
    return sorted((now - then).elements()), sorted((then - now).elements())


def _fd_targets() -> list[str]:
    # the children's server holds a pipe to this process for good once started: start it
    # now, so a test's first child does not count as its leak
    forkserver.ensure_running()
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


# -- no silent loss -----------------------------------------------------------------------


def test_a_rank_that_stops_reading_then_resumes_gets_every_request_in_order() -> None:
    """A full queue makes publish wait (back-pressure) instead of dropping batches."""
    n = 400
    p = Producer(arena_size=16 << 20, max_backlog=8, slow_consumer_timeout=60)
    inbox = _Inbox()
    kid = CHILDREN.Process(
        target=procs.stall_then_consume,
        args=(0, p.endpoint, p.handover_path, n, 2.0, 8, inbox.q),
    )
    kid.start()
    try:
        inbox.get("joined")
        p.wait_for_consumers([0], 30)
        t0 = time.monotonic()
        for i in range(n):
            p.publish(str(i), [_bytes_item(i)])
        waited = time.monotonic() - t0
        _, _, got, bad = inbox.get("received")
        assert got == list(range(n)) and bad == 0
        assert waited > 1.0, "publish should have waited for the stalled rank"
        assert p.statistics().evictions == 0
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert p.statistics().arena.bytes_in_use == 0
    finally:
        kid.join(20)
        p.close()


def test_a_rank_stuck_past_the_bound_is_evicted_and_the_others_keep_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = Producer(arena_size=16 << 20, max_backlog=2, slow_consumer_timeout=1.0)
    inbox = _Inbox()
    kid = CHILDREN.Process(target=procs.stuck, args=(0, p.endpoint, p.handover_path, 6.0, inbox.q))
    kid.start()
    c1 = Consumer(1, p.endpoint, handover=p.handover_path)
    delivered: list[str] = []
    received: list[str] = []
    done = threading.Event()

    def read_rank1() -> None:
        while not done.is_set() or len(received) < len(delivered):
            try:
                with c1.recv(timeout=0.2) as b:
                    received.append(b.envelopes[GlobalIndex(0)].request_id)
                    assert b.open(GlobalIndex(1)).tobytes() == procs.pattern(len(received) - 1)
            except TimeoutError:
                continue

    reader = threading.Thread(target=read_rank1)
    try:
        inbox.get("joined")
        p.wait_for_consumers([0, 1], 30)
        reader.start()
        errors: list[MmwireError] = []
        with caplog.at_level(logging.WARNING, logger="mmwire.transport"):
            for i in range(200):
                try:
                    p.publish(str(i), [_bytes_item(10_000 + i, (0,)), _bytes_item(i, (1,))])
                    delivered.append(str(i))
                except PeerGone as e:
                    errors.append(e)
                    # rank 1 got the request that found rank 0 gone; only rank 0 missed it
                    delivered.append(str(i))
                    break
        assert errors and "declared gone" in str(errors[0])
        assert "is gone: its queue stayed full" in caplog.text
        assert p.statistics().evictions == 1 and p.statistics().consumers == (1,)
        with pytest.raises(PeerGone, match=r"ranks \[0\]"):
            p.publish("after", [_bytes_item(0, (0,))])
        for i in range(len(delivered), len(delivered) + 20):  # rank 1 is unaffected
            p.publish(str(i), [_bytes_item(10_000 + i, (1,)), _bytes_item(i, (1,))])
            delivered.append(str(i))
        done.set()
        reader.join(30)
        assert received == delivered
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert p.statistics().arena.bytes_in_use == 0  # rank 0's leases were freed for it
        assert inbox.get("peer-gone")[1] == 0  # the stuck process learns it was cut off
    finally:
        done.set()
        kid.kill()
        kid.join(10)
        c1.close()
        p.close()


# -- a rank is a member --------------------------------------------------------------------


def test_a_second_process_for_a_live_rank_is_refused_and_replace_fences_the_old_one() -> None:
    p = Producer(arena_size=1 << 20)
    inbox = _Inbox()
    old = CHILDREN.Process(target=procs.hold_rank, args=(0, p.endpoint, p.handover_path, inbox.q))
    old.start()
    try:
        inbox.get("joined")
        p.wait_for_consumers([0], 30)
        os.kill(old.pid, signal.SIGSTOP)  # hung, not dead
        with pytest.raises(HandoverRefused, match="rank 0 is held by"):
            Consumer(0, p.endpoint, handover=p.handover_path)
        new = Consumer(0, p.endpoint, handover=p.handover_path, replace=True)
        try:
            p.wait_for_consumers([0], 10)
            first = np.full((40, 50, 3), 61, np.uint8)
            p.publish("a", [_item(first)])
            batch = new.recv(10)
            view = batch.open(GlobalIndex(0))
            os.kill(old.pid, signal.SIGKILL)  # the old process's end releases nothing of ours
            old.join(10)
            time.sleep(0.5)
            for _ in range(5):  # space that a wrong release would have freed gets reused
                p.publish("b", [_item(np.full((40, 50, 3), 62, np.uint8))])
                new.recv(10).release()
            assert (view == 61).all()
            assert p.statistics().consumers == (0,)
            batch.release()
            assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        finally:
            new.close()
    finally:
        if old.is_alive():
            os.kill(old.pid, signal.SIGKILL)
        old.join(10)
        p.close()


def test_tcp_needs_curve_and_a_remote_rank_is_bound_to_its_key() -> None:
    with pytest.raises(ConfigurationError, match="tcp without CURVE"):
        Producer("tcp://127.0.0.1:*", arena_size=1 << 20)
    server, alice, mallory = CurveKeys.generate(), CurveKeys.generate(), CurveKeys.generate()
    p = Producer(
        "tcp://127.0.0.1:*",
        arena_size=1 << 20,
        curve=server,
        curve_clients=[alice.public, mallory.public],
    )
    real = Consumer(1, p.endpoint, curve_server_key=server.public, curve=alice)
    try:
        p.wait_for_consumers([1], 10)
        thief = Consumer(1, p.endpoint, curve_server_key=server.public, curve=mallory)
        with pytest.raises(HandoverRefused, match="rank 1 is held by"):
            thief.recv(5)
        thief.close()
        p.publish("x", [_item(np.full((8, 9, 3), 5, np.uint8), (1,))])
        with real.recv(5) as b:
            assert (b.open(GlobalIndex(0)) == 5).all()
        assert p.statistics().joins_refused == 1
    finally:
        real.close()
        p.close()


# -- the handover and the release path survive anything ------------------------------------


def _hello(rank: object) -> bytes:
    body = msgspec.msgpack.encode({"type": "Hello", "rank": rank, "pid": 1})
    return struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("rank", [-1, 2**63, 2**64, True, "0", 1 << 16])
def test_ranks_are_validated_where_a_consumer_is_made(rank: Any, pair: Any) -> None:
    p, _ = pair
    with pytest.raises(ConfigurationError, match="`rank` must be an int"):
        Consumer(rank, p.endpoint, handover=p.handover_path)


def test_the_handover_survives_empty_garbage_silent_and_absurd_connections(
    pair: tuple[Producer, Consumer],
) -> None:
    p, c = pair
    before = _fd_targets()
    silent = []
    for payload in [
        b"",
        b"\x01\x00",
        struct.pack("<I", 100) + b"half",
        struct.pack("<I", 1 << 31),
        struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1",
        _hello(-1),
        _hello(2**63),
        _hello(2**64 - 1),
        _hello(0),  # a live rank: refused
    ]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(socket_address(p.handover_path))
        s.sendall(payload)
        s.close()
    for _ in range(5):  # silent connections stay open while others are served
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(socket_address(p.handover_path))
        silent.append(s)
    t0 = time.monotonic()
    c2 = Consumer(2, p.endpoint, handover=p.handover_path)
    assert time.monotonic() - t0 < 2.0, "a silent connection delayed a join"
    try:
        p.wait_for_consumers([0, 2], 10)
        p.publish("r", [_item(np.full((6, 7, 3), 9, np.uint8), (2,))])
        with c2.recv(5) as b:
            assert (b.open(GlobalIndex(0)) == 9).all()
        c.recv(5).release()
    finally:
        c2.close()
        for s in silent:
            s.close()
    assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    assert settle(p, lambda: p.statistics().handovers_refused >= 8)
    assert p.statistics().handovers_refused >= 8
    # the refused connections' descriptors are closed (an earlier test's may close too)
    assert settle(p, lambda: not _fd_diff(before)[0]), _fd_diff(before)


def test_a_consumer_that_dies_holding_a_lease_is_cleaned_after_a_hostile_handover() -> None:
    p = Producer(arena_size=1 << 22)
    inbox = _Inbox()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(socket_address(p.handover_path))
        s.close()  # the empty connection that used to kill the handover thread
        kid = CHILDREN.Process(
            target=procs.consume, args=(0, p.endpoint, p.handover_path, 1, inbox.q, True)
        )
        kid.start()
        inbox.get("joined")
        p.wait_for_consumers([0], 30)
        p.publish("held", [_item(np.zeros((30, 30, 3), np.uint8))])
        inbox.get("batch")
        assert p.statistics().arena.leases_outstanding == 1
        kid.kill()
        kid.join(10)
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert p.statistics().arena.leases_outstanding == 0
    finally:
        p.close()


def test_a_release_on_the_way_when_its_member_ended_is_ignored_quietly(
    pair: tuple[Producer, Consumer], caplog: pytest.LogCaptureFixture
) -> None:
    # a consumer's handover connection can close before its channel's last release is
    # read: its leases went back when it ended, and that release is no stranger's
    p, _ = pair
    c1 = Consumer(1, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0, 1], 10)
        envs = p.publish("r", [_item(np.zeros((20, 30, 3), np.uint8), owners=(1,))])
        ref = envs[0].payload
        assert isinstance(ref, CpuRef)
        c1.recv(5)
        c1._handover_conn.close()  # the member ends; its lease goes back
        assert settle(p, lambda: p.statistics().members_ended >= 1)
        before = p.statistics()
        c1._sock.send(ENCODER.encode(Release(lease=ref.lease, generation=ref.generation)))
        assert settle(p, lambda: p.statistics().releases_ignored > before.releases_ignored)
        after = p.statistics()
        assert after.messages_dropped == before.messages_dropped
        assert after.arena.leases_outstanding == 0
        assert "no joined member" not in caplog.text
    finally:
        c1.close()


def test_forged_repeated_stale_and_foreign_releases_change_nothing(
    pair: tuple[Producer, Consumer],
) -> None:
    import zmq

    p, c = pair
    c1 = Consumer(1, p.endpoint, handover=p.handover_path)
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(p.endpoint)
    try:
        p.wait_for_consumers([0, 1], 10)
        img = np.full((30, 40, 3), 55, np.uint8)
        envs = p.publish("r", [_item(img)])
        ref = envs[0].payload
        assert isinstance(ref, CpuRef)
        batch = c.recv(5)
        view = batch.open(GlobalIndex(0))
        c1.recv(5).release()
        forged = [
            Release(lease=ref.lease, generation=ref.generation),  # another rank's lease
            Release(lease=ref.lease, generation=ref.generation),  # twice
            Release(lease=ref.lease, generation=ref.generation + 1),  # a stale generation
            Release(lease=1 << 40, generation=1),  # an unknown lease
        ]
        for msg in forged:
            c1._sock.send(ENCODER.encode(msg))
            stranger.send(ENCODER.encode(msg))  # from no member at all
        stranger.send(b"\xc1 not msgpack")
        stranger.send_multipart([b"a", b"b", b"c"])
        assert settle(
            p, lambda: p.statistics().releases_ignored >= 4 and p.statistics().messages_dropped >= 6
        )
        st = p.statistics()
        assert st.releases_ignored == 4 and st.messages_dropped == 6
        assert st.arena.leases_outstanding == 1 and (view == 55).all()
        batch.release()
        batch.release()  # idempotent on the consumer side too
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert p.statistics().arena.bytes_in_use == 0
    finally:
        stranger.close(0)
        ctx.term()
        c1.close()


# -- failed publishes leak nothing and raise typed errors -----------------------------------


def _bomb_png() -> bytes:
    """A valid 1x1 PNG whose header claims 30000x30000."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    png = bytearray(buf.getvalue())
    ihdr = png.index(b"IHDR")
    png[ihdr + 4 : ihdr + 12] = struct.pack(">II", 30000, 30000)
    crc = zlib.crc32(bytes(png[ihdr : ihdr + 17]))
    png[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    return bytes(png)


def _jpeg(w: int = 64, h: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 120, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _bad_requests() -> list[tuple[str, Any, Any, type[MmwireError]]]:
    """(what, request_id, items, the error publish must raise)."""

    def boom(w: int, h: int) -> Any:
        raise RuntimeError("a buggy preprocess callable")

    i16 = Image.fromarray(np.full((8, 8), 40000, np.uint16))
    return [
        ("int request id", 17, [_item(np.zeros((4, 4, 3), np.uint8))], InvalidRequest),
        ("lone surrogate", "r\udc80", [_item(np.zeros((4, 4, 3), np.uint8))], InvalidRequest),
        ("no items", "r", [], InvalidRequest),
        ("5000 items", "r", [_item(np.zeros((2, 2, 3), np.uint8))] * 5000, InvalidRequest),
        (
            "unknown modality",
            "r",
            [Item(data=np.zeros((4, 4, 3), np.uint8), consumers=(0,), modality="smell")],  # type: ignore[arg-type]
            InvalidRequest,
        ),
        (
            "unknown kind",
            "r",
            [Item(data=np.zeros((4, 4, 3), np.uint8), consumers=(0,), kind="weird")],  # type: ignore[arg-type]
            InvalidRequest,
        ),
        ("negative rank", "r", [_item(np.zeros((4, 4, 3), np.uint8), (-1,))], InvalidRequest),
        ("truncated jpeg", "r", [_item(_jpeg()[:200])], ImageDecodeError),
        ("random bytes", "r", [_item(bytes(range(256)) * 4)], ImageDecodeError),
        ("bomb png", "r", [_item(_bomb_png())], MaterializeError),
        ("0x0 image", "r", [_item(Image.new("RGB", (0, 0)))], MaterializeError),
        ("16-bit image", "r", [_item(i16)], MaterializeError),
        ("float pixels", "r", [_item(np.zeros((4, 4, 3), np.float32))], MaterializeError),
        (
            "raising preprocess",
            "r",
            [Item(data=np.zeros((4, 4, 3), np.uint8), consumers=(0,), preprocess=boom)],
            InvalidRequest,
        ),
        (
            "non-contiguous memoryview",
            "r",
            [_item(memoryview(_jpeg() * 2)[::2])],
            ImageDecodeError,
        ),
        (
            "embedding without a grid",
            "r",
            [Item(data=np.zeros((4, 8), np.float32), consumers=(0,), kind="embedding")],
            EnvelopeError,
        ),
        ("unjoined rank", "r", [_item(np.zeros((4, 4, 3), np.uint8), (5,))], PeerGone),
        ("larger than the arena", "r", [_item(np.zeros((400, 400, 3), np.uint8))], ArenaFull),
    ]


def test_a_thousand_bad_publishes_leak_nothing_then_a_good_one_reaches_every_owner() -> None:
    p = Producer(arena_size=256 << 10, full_timeout=30)
    c0 = Consumer(0, p.endpoint, handover=p.handover_path)
    c1 = Consumer(1, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0, 1], 10)
        cases = _bad_requests()
        t0 = time.monotonic()
        for n in range(1000):
            what, rid, items, exc = cases[n % len(cases)]
            with pytest.raises(exc) as info:
                p.publish(rid, items)
            assert isinstance(info.value, MmwireError), what
        assert time.monotonic() - t0 < 60, "a refused publish waited for space"
        st = p.statistics().arena
        assert (st.leases_outstanding, st.bytes_in_use, st.leases_total) == (0, 0, 0)
        a, b = np.full((20, 30, 3), 1, np.uint8), np.full((31, 17, 4), 2, np.uint8)
        p.publish("good", [_item(a, (0,)), _item(b, (1,))])
        with c0.recv(5) as b0, c1.recv(5) as b1:
            assert np.array_equal(b0.open(GlobalIndex(0)), a)
            assert np.array_equal(b1.open(GlobalIndex(1)), b)
        with pytest.raises(TimeoutError):  # and nothing else was queued for them
            c0.recv(0.3)
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    finally:
        c0.close()
        c1.close()
        p.close()


@pytest.mark.producer(full_timeout=30)
def test_an_item_that_can_never_fit_fails_at_once(pair: tuple[Producer, Consumer]) -> None:
    p, _ = pair
    t0 = time.monotonic()
    with pytest.raises(ArenaFull, match="holds at most"):
        p.publish("huge", [_item(np.zeros((2000, 2000, 3), np.uint8))])
    assert time.monotonic() - t0 < 5


# -- the arena cannot be written or truncated by a consumer ----------------------------------

_DENIED = "Operation not permitted|Bad file descriptor|Invalid argument"


def test_a_consumer_can_neither_write_nor_truncate_the_arena(
    pair: tuple[Producer, Consumer],
) -> None:
    p, c = pair
    h = receive_arena(p.handover_path, 3)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(h.fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError, match=_DENIED):
            os.ftruncate(h.fd, 0)
        with pytest.raises(OSError, match=_DENIED):
            os.write(h.fd, b"x")
        if p.arena.write_sealed:  # a kernel >= 5.1: reopening it for writing does not help
            rw = os.open(f"/proc/self/fd/{h.fd}", os.O_RDWR)
            try:
                with pytest.raises(OSError, match=_DENIED):
                    os.write(rw, b"x")
                with pytest.raises(OSError, match=_DENIED):
                    os.ftruncate(rw, 0)
                with pytest.raises(PermissionError):
                    mmap.mmap(rw, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
            finally:
                os.close(rw)
        p.publish("still", [_item(np.full((5, 5, 3), 3, np.uint8))])
        with c.recv(5) as b:
            assert (b.open(GlobalIndex(0)) == 3).all()
    finally:
        os.close(h.fd)
        h.conn.close()


# -- timeouts and the control thread ----------------------------------------------------------


def test_a_lease_held_past_lease_timeout_evicts_its_hung_consumer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = Producer(arena_size=1 << 22, lease_timeout=1.0)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0], 10)
        with caplog.at_level(logging.WARNING, logger="mmwire.transport"):
            p.publish("req-hung", [_item(np.zeros((10, 10, 3), np.uint8))])
            batch = c.recv(5)  # received and never released
            deadline = time.monotonic() + 10
            while p.statistics().arena.leases_outstanding and time.monotonic() < deadline:
                time.sleep(0.1)
        assert p.statistics().arena.leases_outstanding == 0
        assert "rank 0" in caplog.text and "'req-hung'" in caplog.text
        assert "lease_timeout" in caplog.text
        with pytest.raises(PeerGone):
            batch.open(GlobalIndex(0))
    finally:
        c.close()
        p.close()


def test_releases_are_served_without_poll_and_release_never_blocks() -> None:
    n = 3000
    p = Producer(arena_size=64 << 20, max_backlog=n + 10)
    c = Consumer(0, p.endpoint, handover=p.handover_path, max_backlog=n + 10)
    try:
        p.wait_for_consumers([0], 10)
        for i in range(n):
            distinct = np.frombuffer(i.to_bytes(48, "little"), np.uint8).reshape(4, 4, 3)
            p.publish(str(i), [_item(distinct)])  # distinct: none is reused by digest
        assert p.statistics().arena.leases_outstanding == n
        finished = threading.Event()

        def drain() -> None:
            for _ in range(n):
                c.recv(10).release()
            finished.set()

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        assert finished.wait(60), "a consumer blocked in release()"
        deadline = time.monotonic() + 30  # the producer's thread alone, no poll() here
        while p.statistics().arena.leases_outstanding and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.statistics().arena.leases_outstanding == 0
    finally:
        c.close()
        p.close()


# -- one input contract ---------------------------------------------------------------------


def _contract_inputs() -> list[tuple[str, Any]]:
    rgb = np.arange(9 * 11 * 3, dtype=np.uint8).reshape(9, 11, 3)
    return [
        ("HWC", rgb),
        ("CHW", np.ascontiguousarray(rgb.transpose(2, 0, 1))),
        ("HW", rgb[:, :, 0].copy()),
        ("PIL P", Image.fromarray(rgb).convert("P")),
        ("PNG bytes", _png(rgb)),
        ("I;16", Image.fromarray(np.full((8, 8), 40000, np.uint16))),
        ("F", Image.fromarray(np.full((8, 8), 0.5, np.float32))),
        ("float", rgb.astype(np.float32)),
        ("0x0", Image.new("RGB", (0, 0))),
        ("truncated", _jpeg()[:100]),
        ("5 channels", np.zeros((4, 4, 5), np.uint8)),
    ]


def _png(rgb: np.ndarray) -> bytes:  # type: ignore[type-arg]
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(("what", "image"), _contract_inputs(), ids=lambda v: str(v)[:12])
def test_publish_and_preprocess_images_take_the_same_inputs_the_same_way(
    what: str, image: Any, pair: tuple[Producer, Consumer]
) -> None:
    from mmwire.materialize import preprocess_images

    p, c = pair
    refusal: MmwireError | None = None
    try:
        expected = preprocess_images([image])
    except MmwireError as e:
        refusal = e
    if refusal is not None:
        with pytest.raises(type(refusal)) as info:
            p.publish("r", [_item(image)])
        # the same reason, with the item named in front
        assert str(refusal).split(":")[-1] in str(info.value)
        return
    p.publish("r", [_item(image)])
    with c.recv(5) as b:
        from mmwire.materialize import Materializer, assign_owners

        grids = [e.grid.patches for e in b.envelopes.values()]
        out = Materializer(0).materialize(b, assign_owners(grids, 1)[0])
        assert torch_equal(out.pixel_values, expected[0]) and torch_equal(out.grid_thw, expected[1])


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_an_empty_request_is_refused(pair: tuple[Producer, Consumer]) -> None:
    p, c = pair
    with pytest.raises(InvalidRequest, match="no items"):
        p.publish("empty", [])
    with pytest.raises(TimeoutError):
        c.recv(0.3)


# -- the hostile peer -------------------------------------------------------------------------


def test_two_honest_ranks_get_every_byte_while_a_hostile_peer_attacks() -> None:
    n = 1000
    p = Producer(arena_size=8 << 20)
    c0 = Consumer(0, p.endpoint, handover=p.handover_path)
    c1 = Consumer(1, p.endpoint, handover=p.handover_path)
    inbox = _Inbox()
    stop = CHILDREN.Event()  # set however the test ends: the attack has no deadline of its own
    try:
        p.wait_for_consumers([0, 1], 10)
        start_free = p.statistics().arena.bytes_in_use
        before = _fd_targets()
        kid = CHILDREN.Process(
            target=procs.hostile, args=(p.endpoint, p.handover_path, stop, 1234, inbox.q)
        )
        kid.start()
        inbox.get("hostile-spying", timeout=60)
        p.wait_for_consumers([7], 10)  # its spy sees every batch from the first one
        rng = np.random.default_rng(7)
        for i in range(n):
            a = rng.integers(0, 256, (8 + i % 13, 9 + i % 7, 3), dtype=np.uint8)
            b = rng.integers(0, 256, (5 + i % 11, 6 + i % 5, 4), dtype=np.uint8)
            owners = ((0,), (1,)) if i % 2 else ((1,), (0,))
            p.publish(f"r{i}", [_item(a, owners[0]), _item(b, owners[1])])
            for c in (c0, c1):
                with c.recv(10) as batch:
                    assert batch.envelopes[GlobalIndex(0)].request_id == f"r{i}"
                    for g in batch.owned:
                        assert np.array_equal(batch.open(g), (a, b)[g.value])
            if i == n // 2:  # the second half streams under the attack at full speed
                inbox.get("hostile-attacking", timeout=60)
        stop.set()
        _, sent, forged = inbox.get("hostile-done", timeout=60)
        kid.join(10)
        kid.close()  # its sentinel fd is the test's, not the producer's
        assert sent > 50 and forged > 0
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert settle(p, lambda: p.statistics().consumers == (0, 1), timeout=10)
        assert settle(p, lambda: not _fd_diff(before)[0], timeout=10), _fd_diff(before)
        st = p.statistics()
        assert st.arena.bytes_in_use == start_free
        assert st.consumers == (0, 1)
        assert not _fd_diff(before)[0], _fd_diff(before)
    finally:
        stop.set()
        c0.close()
        c1.close()
        p.close()


# -- the owner trusts nothing it can recompute -------------------------------------------------


def _tree_frames(pixels: np.ndarray, change: Any) -> list[bytes]:  # type: ignore[type-arg]
    """Frames of one raw inline item whose header tree ``change`` edits before encoding."""
    from helpers import raw_envelope
    from mmwire.transport.wire import encode_batch

    frames = encode_batch([raw_envelope(0, pixels)], [pixels.tobytes()])
    tree = msgspec.msgpack.decode(frames[0])
    change(tree["envelopes"][0])
    return [msgspec.msgpack.encode(tree), frames[1]]


def _owner_output(frames: list[bytes], **materializer: Any) -> Any:
    from mmwire.materialize import Materializer
    from mmwire.transport import IndexMap

    owner = Consumer(0, "ipc:///nonexistent/mmwire-owner")
    try:
        batch = owner.decode(frames)
        return Materializer(0, **materializer).materialize(batch, IndexMap(0, [GlobalIndex(0)]))
    finally:
        owner.close()


def test_an_owner_refuses_a_plan_the_image_would_not_get() -> None:
    """A 1x1 image whose plan asks for a 6300x6300 canvas: refused before any work."""
    from mmwire.transport.errors import GridMismatch

    def blow_up(env: dict) -> None:  # type: ignore[type-arg]
        plan = env["preprocess"]["plan"]
        side, p = 6300, 14
        plan.update(new_width=side, new_height=side, pad_width=0, pad_height=0)
        plan["grid"] = [[1, side // p, side // p]]  # Grid is array-like: [dims]
        plan["tokens"] = (side // 28) ** 2
        env["grid"] = plan["grid"]

    frames = _tree_frames(np.zeros((1, 1, 3), np.uint8), blow_up)
    t0 = time.monotonic()
    with pytest.raises(GridMismatch, match="not the one a 1x1 image gets"):
        _owner_output(frames)
    assert time.monotonic() - t0 < 1.0


def test_an_owner_refuses_inconsistent_tokens() -> None:
    from mmwire.transport.errors import GridMismatch

    def tokens(env: dict) -> None:  # type: ignore[type-arg]
        env["preprocess"]["plan"]["tokens"] = 999

    with pytest.raises(GridMismatch, match="999 tokens"):
        _owner_output(_tree_frames(np.zeros((30, 40, 3), np.uint8), tokens))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("image_mean", [float("nan"), 0.5, 0.5]),
        ("image_mean", [1e9, 0.5, 0.5]),
        ("image_std", [0.5, float("inf"), 0.5]),
        ("image_std", [0.5, 0.0, 0.5]),
        ("patch_size", 10_000),
        ("merge_kernel", [2, 100]),
        ("in_patch_limit", 0),
    ],
)
def test_the_decoder_refuses_absurd_preprocessing_values(field: str, value: Any) -> None:
    def change(env: dict) -> None:  # type: ignore[type-arg]
        env["preprocess"][field] = value

    with pytest.raises(EnvelopeError, match=field):
        _owner_output(_tree_frames(np.zeros((30, 40, 3), np.uint8), change))


def test_an_owner_caps_a_batchs_output() -> None:
    frames = _tree_frames(np.zeros((300, 400, 3), np.uint8), lambda env: None)
    with pytest.raises(MaterializeError, match="over `max_output_bytes` 1000000"):
        _owner_output(frames, max_output_bytes=1_000_000)
    out = _owner_output(frames)
    assert out.pixel_values.shape[0] == 22 * 30  # a 400x300 image on a 420x308 canvas


def test_a_process_that_takes_the_arena_but_never_joins_expires() -> None:
    p = Producer(arena_size=1 << 20, join_timeout=0.5)
    try:
        h = receive_arena(p.handover_path, 3)  # handed over, never joins the channel
        h.conn.settimeout(10)
        assert h.conn.recv(1) == b""  # the producer ended the member and closed it
        os.close(h.fd)
        h.conn.close()
        c = Consumer(3, p.endpoint, handover=p.handover_path)  # the rank is free again
        try:
            p.wait_for_consumers([3], 10)
        finally:
            c.close()
        assert p.statistics().members_ended >= 1
    finally:
        p.close()


def test_a_remote_rank_can_rejoin_once_its_old_connection_is_gone() -> None:
    with pytest.warns(RuntimeWarning, match="without CURVE"):
        p = Producer("tcp://127.0.0.1:*", arena_size=1 << 20, allow_insecure_tcp=True)
    first = Consumer(1, p.endpoint)
    try:
        p.wait_for_consumers([1], 10)
        second = Consumer(1, p.endpoint)  # the first is still connected: refused
        with pytest.raises(HandoverRefused, match="still connected"):
            second.recv(5)
        second.close()
        first.close()  # a restart: the old connection goes away
        assert settle(p, lambda: p.statistics().members_ended >= 1)
        again = Consumer(1, p.endpoint)
        try:
            p.wait_for_consumers([1], 10)
            p.publish("x", [_item(np.full((4, 5, 3), 8, np.uint8), (1,))])
            with again.recv(5) as b:
                assert (b.open(GlobalIndex(0)) == 8).all()
        finally:
            again.close()
    finally:
        first.close()
        p.close()


def test_every_request_a_killed_remote_rank_never_finished_is_reported() -> None:
    """Kill -9 a remote rank holding two batches, then keep publishing to it: each publish
    either raises ``PeerGone`` or its request is reported lost, with the two it held."""
    server, client = CurveKeys.generate(), CurveKeys.generate()
    lost: list[LostRequest] = []
    p = Producer(
        "tcp://127.0.0.1:*",
        arena_size=1 << 22,
        curve=server,
        curve_clients=[client.public],
        on_lost=lost.append,
    )
    local = Consumer(
        0, p.endpoint, handover=p.handover_path, curve_server_key=server.public, curve=client
    )
    q = CHILDREN.Queue()
    kid = CHILDREN.Process(target=procs.remote_hold, args=(1, p.endpoint, server.public, client, q))
    kid.start()
    try:
        _, _, pid = q.get(timeout=60)
        p.wait_for_consumers([0, 1], 30)
        for name in ("finished", "held-1", "held-2"):
            p.publish(name, [_item(np.full((4, 4, 3), 1, np.uint8), (0, 1))])
            local.recv(10).release()
        assert q.get(timeout=30) == ("finished", "finished")
        assert q.get(timeout=30) == ("holding", "held-1")
        assert q.get(timeout=30) == ("holding", "held-2")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        returned = []
        while True:
            name = f"after-{len(returned)}"
            try:
                p.publish(name, [_item(np.full((4, 4, 3), 2, np.uint8), (0, 1))])
            except PeerGone:
                break
            returned.append(name)
            local.recv(10).release()
            assert time.monotonic() - killed < 15, "the rank's death went unnoticed"
        want = {"held-1", "held-2", *returned}
        assert settle(p, lambda: {x.request_id for x in lost} == want), (lost, want)
        assert all(x.rank == 1 for x in lost) and len(lost) == len(want)
        assert p.statistics().consumers == (0,)
    finally:
        kid.join(10)
        if kid.is_alive():
            kid.kill()
        local.close()
        p.close()


def _mmwire_dirs() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("mmwire")}


def test_failing_constructors_leave_no_fds_threads_or_folders_behind() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    dirs, fds, threads = _mmwire_dirs(), _fds() - 1, threading.active_count()  # less `busy`
    try:
        for _ in range(20):  # the arena, handover, CURVE thread and context exist; bind fails
            with pytest.raises(MmwireError):
                Producer(f"tcp://127.0.0.1:{port}", arena_size=1 << 20, curve=CurveKeys.generate())
            with pytest.raises(ConfigurationError):
                Producer(arena_size=0)
    finally:
        busy.close()
    assert _fds() == fds and threading.active_count() == threads
    assert _mmwire_dirs() == dirs


def test_a_closed_or_killed_producer_leaves_no_files() -> None:
    dirs = _mmwire_dirs()
    with Producer(arena_size=1 << 20) as p:
        assert p.handover_path.startswith("@") and p.endpoint.startswith("ipc://@")
        assert _mmwire_dirs() == dirs
    q = CHILDREN.Queue()
    kid = CHILDREN.Process(target=procs.producer_then_die, args=(q,))
    kid.start()
    _, handover = q.get(timeout=60)
    kid.kill()
    kid.join(10)
    assert _mmwire_dirs() == dirs
    with pytest.raises(PeerGone):  # its abstract socket went with it
        receive_arena(handover, rank=0, timeout=2)


def test_errors_are_typed_and_a_wait_names_what_it_waited_for() -> None:
    import numpy as np

    with Producer(arena_size=1 << 20) as p:
        with pytest.raises(WaitTimeout, match=r"never saw ranks \[3\]"):
            p.wait_for_consumers([3], timeout=0.2)
        with (
            Consumer(0, p.endpoint, handover=p.handover_path) as c,
            pytest.raises(FrameError, match="contiguous"),
        ):
            c.decode([memoryview(np.arange(64, dtype=np.uint8)[::2])])
    with Producer(arena_size=1 << 20) as p:
        # a rank handed the arena that joins a channel nobody serves: nothing ever comes
        c = Consumer(0, "ipc://@mmwire-test-nobody", handover=p.handover_path)
        try:
            with pytest.raises(WaitTimeout, match="may never have seen this rank") as info:
                c.recv(timeout=0.3)
            assert isinstance(info.value, TimeoutError)
        finally:
            c.close()
