"""A rank on the producer's host gets its batches on a lane of its own (``_lane.py``).

Real producers and consumers, real socket pairs: the tests check that batches keep their
order when one has to take the channel, that neither end of a lane trusts the other, and
that a lane closing at the rank's end is a rank leaving, not a loss.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import numpy as np
import pytest
from helpers import settle
from mmwire.transport import AsyncConsumer, Consumer, GlobalIndex, Grid, Item, Producer
from mmwire.transport.errors import FrameError, MalformedEnvelope, PeerGone
from mmwire.transport.wire import CpuRef, InlineRef


def _item(n: int, fill: int, owners: tuple[int, ...] = (0,)) -> Item:
    return Item(
        data=np.full(n, fill, np.uint8), consumers=owners, kind="embedding", grid=Grid((1, 1))
    )


def _lane_of(p: Producer, rank: int) -> object:
    member = p._roster.members.of_rank(rank)
    assert member is not None and member.lane is not None
    return member.lane


def test_batches_take_the_lane_and_one_on_the_channel_keeps_its_place() -> None:
    """The arena is full for the middle request, which falls back to inline frames on the
    channel: the lane announces it, and the rank receives the three in publish order."""
    p = Producer(arena_size=1 << 20, on_full="inline", full_timeout=0.05)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0], 10)
        p.publish("a", [_item(600_000, 1)])
        with pytest.warns(RuntimeWarning, match="arena full"):
            envs = p.publish("b", [_item(700_000, 2)])  # a's lease is still held
        assert isinstance(envs[0].payload, InlineRef)
        p.publish("c", [_item(1000, 3)])  # a small one fits beside a
        lane = _lane_of(p, 0)
        assert lane.sent == 3  # type: ignore[attr-defined]  # a, b's announcement, c
        got = []
        for fill, n in ((1, 600_000), (2, 700_000), (3, 1000)):
            with c.recv(5) as batch:
                env = batch.envelopes[GlobalIndex(0)]
                got.append(env.request_id)
                data = batch.open(GlobalIndex(0))
                assert data.shape == (n,) and int(data[0]) == fill and int(data[-1]) == fill
        assert got == ["a", "b", "c"]
    finally:
        c.close()
        p.close()


def test_a_hostile_producer_on_the_lane_gets_typed_errors_and_the_rank_serves_on(
    pair: tuple[Producer, Consumer],
) -> None:
    p, c = pair
    end = _lane_of(p, 0).sock  # type: ignore[attr-defined]
    end.send(b"Zsomething else")  # an unknown kind
    end.send(b"B" + b"\x00" * 70_000)  # over the largest packet
    end.send(b"B\xc1 not msgpack")  # a batch that is not one
    end.send(b"C" + b"x")  # an announcement with a body
    p.publish("real", [_item(4096, 9)])
    with pytest.raises(FrameError, match="unknown kind"):
        c.recv(5)
    with pytest.raises(FrameError, match="over"):
        c.recv(5)
    with pytest.raises(MalformedEnvelope):
        c.recv(5)
    with pytest.raises(FrameError, match="unknown kind"):
        c.recv(5)
    with c.recv(5) as batch:
        assert batch.envelopes[GlobalIndex(0)].request_id == "real"
        assert batch.open(GlobalIndex(0)).tobytes() == bytes([9]) * 4096


@pytest.mark.producer(max_backlog=4, slow_consumer_timeout=0.3)
def test_false_acknowledgements_do_not_let_a_rank_queue_past_its_backlog(
    pair: tuple[Producer, Consumer],
) -> None:
    """A rank that reads nothing and acknowledges everything (and garbage) is still held to
    the backlog: the producer ignores the lies, waits, then evicts it."""
    p, c = pair
    lane = c._lane
    assert lane is not None
    for lie in (2**63, 10**6):  # past anything sent
        lane.sock.send(struct.pack("<cQ", b"A", lie))
    lane.sock.send(b"garbage")
    for i in range(4):
        p.publish(f"r{i}", [_item(1024, i)])
    with pytest.raises(PeerGone, match="not delivered to ranks \\[0\\]"):
        p.publish("r4", [_item(1024, 4)])
    st = p.statistics()
    assert st.evictions == 1 and st.messages_dropped >= 2


def test_a_rank_that_closes_its_lane_is_missed_and_ends_without_a_loss() -> None:
    p = Producer(arena_size=1 << 22)
    c0 = Consumer(0, p.endpoint, handover=p.handover_path)
    c1 = Consumer(1, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0, 1], 10)
        envs = p.publish("done", [_item(2048, 1, (0,))])
        assert isinstance(envs[0].payload, CpuRef)
        c0.recv(5).release()  # finished before its lane closes: not a loss
        c1.recv(5).release()
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert c0._lane is not None
        c0._lane.close()  # its process is on its way out
        with pytest.raises(PeerGone, match="not delivered to ranks \\[0\\]"):
            p.publish("late", [_item(2048, 2, (0,)), _item(2048, 3, (1,))])
        with c1.recv(5) as batch:  # the other rank got it
            assert batch.envelopes[GlobalIndex(1)].request_id == "late"
        assert settle(p, lambda: p._roster.members.of_rank(0) is None)
        assert p.take_lost() == []
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
    finally:
        c0.close()
        c1.close()
        p.close()


def test_releases_a_full_lane_refused_leave_once_it_drains_without_another_call() -> None:
    """A rank gives back a burst of batches while the producer reads nothing, more releases
    than its end of the lane holds, and then stops calling in: what the lane refused leaves
    as soon as the producer reads again, and every lease comes back."""
    n = 200
    p = Producer(arena_size=1 << 24, max_backlog=n + 10)
    c = Consumer(0, p.endpoint, handover=p.handover_path, max_backlog=n + 10)
    try:
        p.wait_for_consumers([0], 10)
        assert c._lane is not None
        c._lane.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # a few packets
        for i in range(n):
            p.publish(f"r{i}", [_item(1024, i % 256)])
        batches = [c.recv(5) for _ in range(n)]
        with p._lock:  # the producer's threads serve nothing meanwhile
            for batch in batches:
                batch.release()  # never blocks
            assert c._unsent, "the lane took every release: the burst did not fill it"
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        assert not c._unsent
    finally:
        c.close()
        p.close()


def test_under_an_event_loop_the_loop_sends_what_a_full_lane_refused() -> None:
    """The same burst from an ``AsyncConsumer``: its loop owns the sockets, so the helper
    hands the sending to the loop, which keeps running other work meanwhile."""
    n = 200

    async def main() -> None:
        p = Producer(arena_size=1 << 24, max_backlog=n + 10)
        c = AsyncConsumer(0, p.address, max_backlog=n + 10)
        try:
            p.wait_for_consumers([0], 10)
            (member,) = c.group.members
            assert member._lane is not None
            member._lane.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            for i in range(n):
                p.publish(f"r{i}", [_item(1024, i % 256)])
            batches = [await c.recv(5) for _ in range(n)]
            with p._lock:
                for batch in batches:
                    batch.release()
                assert member._unsent, "the lane took every release: the burst did not fill it"
            deadline = time.monotonic() + 20
            while p.statistics().arena.leases_outstanding and time.monotonic() < deadline:
                p.poll(0)
                await asyncio.sleep(0.01)  # the loop runs: the helper's sends are its work
            assert p.statistics().arena.leases_outstanding == 0
            assert not member._unsent
        finally:
            c.close()
            p.close()

    asyncio.run(main())
