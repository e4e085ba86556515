"""Sending one request's batch to every joined member.

Each member gets the shared frames (its items are in memory it maps), on its lane when it
is on this host (``_lane.py``; a batch with frames of its own is announced there and sent
on the channel), or its own frames: a
remote rank's owned payloads as zero-copy frames of the arena (the lease stays pending
for it until zmq reports them sent), or a pulling rank's references into the transfer
window. A member whose queue is full is waited for, up to ``slow_consumer_timeout``, and
then evicted; a batch is counted as owed by each member that owns items of it until the
member's ``Done`` comes back.

Called under the producer's lock; one thread publishes, so each member gets batches in
the order they were published.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from ._arena import Arena, Lease
from ._codec import encode_batch, encode_checked
from ._control import Member
from ._lane import MAX_PACKET
from ._membership import Roster
from ._schema import CpuRef, FeatureEnvelope, InlineRef
from .errors import PeerGone

__all__ = ["Delivery", "Sending", "Staged", "raise_if_lost"]

Holds = dict[int, list[tuple[int, int]]]
"""Per member id, the ``(lease, generation)`` references it must release."""


@dataclass
class Staged:
    """A request's payloads in the transfer window: its lease, and each item's reference."""

    lease: Lease
    refs: dict[int, CpuRef]


@dataclass
class Sending:
    """A batch on its way: the members whose queues were full, and those it missed."""

    holds: Holds
    waiting: list[tuple[Member, list[Any], bool, str | None]] = field(default_factory=list)
    missed: list[Member] = field(default_factory=list)


@dataclass
class _Send:
    """Frames zmq has not finished sending yet, and the lease references they hold."""

    tracker: zmq.MessageTracker
    start: int
    generation: int
    member: Member


class Delivery:
    """Sends batches and tracks the zero-copy frames still in flight."""

    def __init__(
        self,
        *,
        roster: Roster,
        arena: Arena,
        activity: threading.Condition,
        max_backlog: int,
        slow_consumer_timeout: float,
        check_open: Callable[[], None],
    ) -> None:
        self.roster = roster
        self.arena = arena
        self.activity = activity
        self.max_backlog = max_backlog
        self.slow_consumer_timeout = slow_consumer_timeout
        self._check_open = check_open
        self._sending: list[_Send] = []
        self.last_start = 0.0
        """When the last batch started out (``time.monotonic()``)."""

    def deliver(
        self,
        envs: list[FeatureEnvelope],
        holds: Holds,
        frames: list[Any] | None = None,
        staged: Staged | None = None,
    ) -> list[Member]:
        """Send a batch to every joined member, waiting for full queues; the members that
        did not get it (evicted, or gone while it waited). Releases the lock only while it
        waits, so the control thread keeps serving releases."""
        return self.wait_out(self.start(envs, holds, frames, staged))

    def start(
        self,
        envs: list[FeatureEnvelope],
        holds: Holds,
        frames: list[Any] | None = None,
        staged: Staged | None = None,
    ) -> Sending:
        """Send a batch to every joined member whose queue has room, without waiting.
        ``envs`` passed ``check_envelopes`` (the publisher's); ``frames``: the batch's own,
        already encoded."""
        self.last_start = time.monotonic()
        shared_frames = [encode_checked(envs)] if frames is None else frames
        owners = {r for e in envs for r in e.consumers}
        request_id = envs[0].request_id
        # owners first: a lane's wake-up may hand a core to its rank at once, and the
        # owners have the work to do (every member still gets batches in publish order)
        targets = sorted(self.roster.members.joined(), key=lambda s: s.rank not in owners)
        sending = Sending(holds)
        for s in targets:
            frames, track = self._frames_for(s, envs, shared_frames, staged)
            owned = request_id if s.rank in owners else None
            if not self._try_send(s, frames, track, holds, owned):
                sending.waiting.append((s, frames, track, owned))
        # its connection was gone when sent to, or its process is closing
        sending.missed = [s for s in targets if s.gone or s.closing]
        return sending

    def wait_out(self, sending: Sending) -> list[Member]:
        """Wait for the members whose queues were full, up to ``slow_consumer_timeout``, then
        evict them; the members that did not get the batch."""
        waiting, missed, holds = sending.waiting, sending.missed, sending.holds
        deadline = time.monotonic() + self.slow_consumer_timeout
        pause = 0.0005
        while waiting:
            self.activity.wait(pause)  # releases the lock while it waits
            self._check_open()
            pause = min(pause * 2, 0.02)
            missed += [w[0] for w in waiting if w[0].gone]  # died while we waited
            waiting = [
                w
                for w in waiting
                if not w[0].gone and not self._try_send(w[0], *w[1:3], holds, w[3])
            ]
            if waiting and time.monotonic() > deadline:
                for s, *_ in waiting:
                    self.roster.evict(
                        s,
                        f"its queue stayed full ({self.max_backlog} batches) "
                        f"for `slow_consumer_timeout` {self.slow_consumer_timeout} s",
                    )
                    missed.append(s)
                break
        # those whose lane broke while they were retried (a closing member is not sent to)
        missed += [w[0] for w in sending.waiting if w[0].closing and w[0] not in missed]
        return missed

    def _frames_for(
        self,
        s: Member,
        envs: list[FeatureEnvelope],
        shared_frames: list[Any],
        staged: Staged | None,
    ) -> tuple[list[Any], bool]:
        if s.pulls:  # its own items point into the transfer window, where it reads them
            refs = {} if staged is None else staged.refs
            mine = {k for k, e in enumerate(envs) if s.rank in e.consumers and k in refs}
            if not mine:
                return shared_frames, False
            pulled = [
                msgspec.structs.replace(e, payload=refs[k]) if k in mine else e
                for k, e in enumerate(envs)
            ]
            return encode_batch(pulled), False
        remote = not s.shared
        owned = [k for k, e in enumerate(envs) if s.rank in e.consumers] if remote else []
        owned = [k for k in owned if isinstance(envs[k].payload, CpuRef)]
        if not owned:  # same host, or a remote rank that only needs the metadata
            return shared_frames, False
        # Another host: the slices of the items it owns go out as frames, zero-copy, and
        # the lease stays pending for this member until zmq says the frames are sent.
        frame_of = {k: n for n, k in enumerate(owned)}
        remote_envs = [
            msgspec.structs.replace(e, payload=InlineRef(frame=frame_of[k])) if k in frame_of else e
            for k, e in enumerate(envs)
        ]
        slices = [self.arena_slice(envs[k]) for k in owned]
        return encode_batch(remote_envs, slices), True

    def _try_send(
        self, s: Member, frames: list[Any], track: bool, holds: Holds, owned: str | None
    ) -> bool:
        """Queue a batch for a member; False if its queue is full (nothing was sent). A
        member whose connection is gone is ended, and one whose lane broke is closing (the
        batch is not sent to either). ``owned``: the request id, if the member owns items
        of it (it stays outstanding until ``Done``)."""
        if s.closing:
            return True  # missed: its process is closing
        tracker = None
        try:
            if s.lane is None or not s.shared:
                tracker = self.roster.channel.send(s.ident or b"", frames, track=track)
            elif len(frames) == 1 and len(frames[0]) < MAX_PACKET:
                if not s.lane.send(frames[0]):
                    return False
            else:  # frames of its own, or a huge header: on the channel, in its turn
                if not s.announced and not s.lane.announce():
                    return False
                s.announced = True
                tracker = self.roster.channel.send(s.ident or b"", frames, track=track)
                s.announced = False
        except zmq.Again:
            return False
        except zmq.ZMQError as e:  # EHOSTUNREACH: its connection is gone
            self.roster.end_after_its_messages(s, f"its channel connection is gone ({e})")
            return True
        except OSError as e:  # its end of the lane is closed
            self.roster.lane_broke(s, e)
            return True
        s.sent += 1
        if owned is not None:
            s.outstanding[s.sent] = owned
        if track and tracker is not None:
            for start, gen in holds.get(s.id, ()):
                self._sending.append(_Send(tracker, start, gen, s))
        return True

    def finish_sends(self) -> bool:
        """Release the leases of frames zmq has finished sending; whether any were. A
        member that ended has had its leases released already."""
        if not self._sending:
            return False
        done = False
        still = []
        for t in self._sending:
            if t.member.gone:
                continue
            if t.tracker.done:
                self.arena.release(t.start, t.generation, t.member.id)
                done = True
            else:
                still.append(t)
        self._sending = still
        return done

    def in_flight(self) -> int:
        """Zero-copy sends to live remote members not yet done."""
        return sum(not t.member.gone for t in self._sending)

    def arena_slice(self, env: FeatureEnvelope) -> memoryview:
        """The arena bytes an envelope's ``CpuRef`` names."""
        ref = env.payload
        if not isinstance(ref, CpuRef):
            raise TypeError(f"item {env.index.value} is not in the arena")
        return self.arena.view[ref.offset : ref.offset + ref.length]


def raise_if_lost(request_id: str, missed: list[Member], owners: set[int]) -> None:
    """``PeerGone`` if a member that owns items of the request did not receive it."""
    lost = sorted(s.rank for s in missed if s.rank in owners)
    if lost:
        raise PeerGone(
            f"request {request_id!r} was not delivered to ranks {lost}: they were declared "
            "gone while it waited for them (the other ranks received it)"
        )
