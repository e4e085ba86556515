"""The producer's members and their leases: who may join, what each holds, and what
happens when one ends.

A member ends when its process closes the handover connection, its remote connection
drops, it is replaced, it never joins, or the producer evicts it (a queue full past
``slow_consumer_timeout``, a lease held past ``lease_timeout``). Then every lease pending on
it is released, and each request it owned items of and never finished (``Done``) is
reported once as a :class:`LostRequest`.

Everything here runs under the producer's lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._arena import Arena
from ._channel import Channel, Message
from ._control import Done, Join, Member, Members, Release, decode_control
from ._gpu import ProducerDevice
from ._handover import Hello, Offer, Refusal
from ._lane import Lane
from ._mooncake import TransferSource

__all__ = ["LostRequest", "Roster"]

# How long a member whose process closed its handover connection stays joined, so that the
# releases and ``Done`` it sent just before closing reach the producer first.
_END_GRACE_S = 0.1

_log = logging.getLogger("mmwire.transport")


@dataclass(frozen=True)
class LostRequest:
    """A request a rank that owned items of it never finished: the rank's member ended (it
    died, was evicted or replaced, or its connection went) before it released the batch, or
    the rank could not take the batch (it raised a typed error there: pulled bytes that
    failed their digest, a malformed batch). Retry it or fail it; mmwire will not deliver
    it again."""

    request_id: str
    rank: int
    reason: str
    """Why the member ended."""


class Roster:
    """The members of one producer, the leases they hold and the requests they owe."""

    def __init__(
        self,
        *,
        activity: threading.Condition,
        channel: Channel,
        arena: Arena,
        device: ProducerDevice,
        transfer: TransferSource | None,
        drop_local: Callable[[bytes], None],
        on_lost: Callable[[LostRequest], None] | None,
        remote_ok: bool,
        max_backlog: int,
    ) -> None:
        self.activity = activity
        self.channel = channel
        self.arena = arena
        self.device = device
        self.transfer = transfer
        self.members = Members(self._ended)
        self.closed = False
        self.counts = {"ended": 0, "evicted": 0, "joins": 0, "dropped": 0, "ignored": 0}
        self._drop_local = drop_local
        self._on_lost = on_lost
        self._lost: list[LostRequest] = []
        self._remote_ok = remote_ok
        self.max_backlog = max_backlog
        self.lanes_changed = False
        """A lane was made or closed since the control thread last looked."""
        self._noted: set[str] = set()
        self._ending: list[tuple[float, Member]] = []  # (when, member) of closed handovers

    # -- arrivals ---------------------------------------------------------------------

    def admit(self, hello: Hello, pid: int) -> tuple[Offer, list[int]] | Refusal:
        """The handover thread's question: may process ``pid`` take ``hello.rank``? If so,
        its offer and its lane's end."""
        if self.closed:
            return Refusal(reason="the producer is closing")
        got = self.members.offer(hello.rank, pid, hello.replace)
        if isinstance(got, str):
            return Refusal(reason=got)
        member = got

        def dropped(what: str) -> None:
            self.drop(what, f"the lane of {member}")

        def served(body: bytes) -> None:
            self._on_lane_message(member, body)

        try:
            got.lane = Lane(self.max_backlog, served, dropped)
        except OSError as e:  # out of fds: the member is refused, the producer serves on
            self.members.end(got, f"no lane for it ({e})")
            return Refusal(reason=f"the producer cannot make a lane: {e}")
        _log.info("mmwire: %s received the arena", got)
        self.lanes_changed = True
        offer = Offer(
            arena_id=self.arena.id,
            size=self.arena.size,
            member=got.token,
            pool=self.device.offer,
            lane=self.max_backlog,
        )
        return offer, [got.lane.peer.fileno()]

    def lanes(self) -> list[Lane]:
        """Every live member's open lane."""
        return [s.lane for s in self.members.all() if s.lane is not None and not s.lane.closed]

    def close(self) -> None:
        """Refuse new members and close every lane (the ranks read EOF)."""
        self.closed = True
        for lane in self.lanes():
            lane.close()

    def handover_closed(self, token: bytes) -> None:
        """A local member's process closed its handover connection (it exited or died): it
        ends after ``_END_GRACE_S``, once the releases it sent just before are served."""
        s = self.members.by_token(token)
        if s is not None and not s.gone:
            self._ending.append((time.monotonic() + _END_GRACE_S, s))
        self.activity.notify_all()

    def lane_broke(self, s: Member, error: OSError) -> None:
        """A local member's lane is closed at its end: its process is closing. It misses
        batches from now on, and ends once the releases it sent just before are served."""
        if not s.closing:
            s.closing = True
            _log.info("mmwire: %s closed its lane (%s)", s, error)
            self._ending.append((time.monotonic() + _END_GRACE_S, s))

    def finish_ends(self) -> float | None:
        """End the members whose grace has run out; when the next one is due, if any."""
        if not self._ending:
            return None
        now = time.monotonic()
        due = [s for t, s in self._ending if t <= now]
        self._ending = [(t, s) for t, s in self._ending if t > now]
        for s in due:
            if not s.gone:
                self.members.end(s, "its process closed the handover connection")
        return min((t for t, _ in self._ending), default=None)

    def on_message(self, message: Message) -> None:
        """One message from the channel: a join, a release or a ``Done``; anything else is
        dropped and counted."""
        frames = message.frames
        if len(frames) != 2:
            self.drop(f"a message of {len(frames)} frames")
            return
        ident, body = frames
        msg = decode_control(body)
        if msg is None:
            self.drop("a message that is not a control message")
            return
        if isinstance(msg, Join):
            self._on_join(ident, msg, message.key)
            return
        s = self.members.by_ident(ident)
        if s is None and self.members.ended(ident):
            # its leases went back when it ended; this release was on the way
            self.counts["ignored"] += 1
        elif s is None:
            if isinstance(msg, Release):
                self.drop("a release from no joined member")
        else:
            self._on_member_message(s, msg)

    def serve_channel(self) -> bool:
        """Serve every message waiting on the channel; whether there was any."""
        served = False
        for message in self.channel.messages():
            self.on_message(message)
            served = True
        return served

    def end_after_its_messages(self, s: Member, why: str) -> None:
        """End a member, after serving what waits on the channel: what it sent before
        going (a release of a request it finished) is not reported lost."""
        self.serve_channel()
        self.members.end(s, why)

    def _on_lane_message(self, s: Member, body: bytes) -> None:
        msg = decode_control(body)
        if msg is None or isinstance(msg, Join):
            self.drop("a lane packet that is not a release or Done", f"the lane of {s}")
        else:  # also as it ends: what it sent before going
            self._on_member_message(s, msg)

    def _on_member_message(self, s: Member, msg: Release | Done) -> None:
        """A member's release or ``Done``, from the channel or its lane."""
        if isinstance(msg, Done):
            request_id = s.outstanding.pop(msg.seq, None)
            if request_id is not None and msg.refused:
                why = f"the rank could not take it ({msg.refused})"
                self._report_lost(LostRequest(request_id, s.rank, why))
            return
        if msg.done:
            s.outstanding.pop(msg.done, None)
        if not self.arena_of(msg.window).release(msg.lease, msg.generation, s.id):
            self.counts["ignored"] += 1
            self.note("release", f"{s} released a lease it does not hold (ignored)")

    def _on_join(self, ident: bytes, msg: Join, key: bytes | None) -> None:
        got: Member | str = "it asked to pull payloads, and this producer has no `transfer`"
        if not msg.pull or self.transfer is not None:
            got = self.members.join(ident, msg, key, self._remote_ok, self._connected)
        if not isinstance(got, str) and got.lane is not None:
            got.lane.handed_over()  # it joined, so it has its end
            if msg.backlog:
                got.lane.backlog = min(got.lane.backlog, msg.backlog)
        if isinstance(got, str):
            self.counts["joins"] += 1
            self.note("join", f"refused a join: {got}")
            self.channel.notice(ident, f"refused: {got}")
            return
        if got.pulls and self.transfer is not None:  # before any batch: zmq keeps order
            with contextlib.suppress(Exception):
                self.channel.send(ident, self.transfer.frames)
        _log.info("mmwire: %s joined the channel", got)
        self.activity.notify_all()

    def _connected(self, s: Member) -> bool:
        return s.ident is not None and self.channel.connected(s.ident)

    # -- ends -------------------------------------------------------------------------

    def _ended(self, s: Member, why: str) -> None:
        """Release what an ended member held (from ``Members.end``), after what it sent
        on its lane before going."""
        if s.lane is not None:
            s.lane.read()
            s.lane.close()
            self.lanes_changed = True
        held = self.arena.release_holder(s.id)
        if self.transfer is not None:
            held += self.transfer.window.release_holder(s.id)
        if self.members.of_rank(s.rank) is None:
            self.device.rank_gone(s.rank)
        if s.local:
            self._drop_local(s.token)
        elif s.ident is not None and not self.closed:
            self.channel.notice(s.ident, f"ended: {why}")
        self.counts["ended"] += 1
        level = logging.INFO if why.startswith("its process closed") else logging.WARNING
        _log.log(level, "mmwire: %s is gone: %s; %d leases released", s, why, held)
        for request_id in s.outstanding.values():
            self._report_lost(LostRequest(request_id, s.rank, why))
        s.outstanding.clear()

    def evict(self, s: Member, why: str) -> None:
        self.counts["evicted"] += 1
        self.members.end(s, why)

    def _report_lost(self, lost: LostRequest) -> None:
        _log.warning(
            "mmwire: request %r was lost: rank %d never finished it (%s)",
            lost.request_id,
            lost.rank,
            lost.reason,
        )
        if self._on_lost is None:
            self._lost.append(lost)
            return
        try:
            self._on_lost(lost)
        except Exception as e:  # the application's callback must not stop the producer
            self.note("on_lost", f"`on_lost` raised {e!r}")

    def take_lost(self) -> list[LostRequest]:
        lost, self._lost = self._lost, []
        return lost

    def check_remote(self) -> None:
        """End the remote members whose connection is gone (a process that died, a host
        whose heartbeat lapsed): what they owned and never released is reported lost, and
        a publish naming their rank raises ``PeerGone``. Local members end with their
        handover connection."""
        for s in list(self.members.joined()):
            if not s.local and not self._connected(s):
                self.members.end(s, "its channel connection is gone")

    def arena_of(self, window: bool) -> Arena:
        """The arena a release names: the transfer window's, or the one local ranks map."""
        return self.transfer.window if window and self.transfer is not None else self.arena

    def expire_leases(self, timeout: float) -> None:
        """Evict the members that hold a lease past ``timeout`` s."""
        overdue = self.arena.overdue(timeout)
        if self.transfer is not None:
            overdue += self.transfer.window.overdue(timeout)
        for lease in overdue:
            for s in [s for s in self.members.all() if s.id in lease.pending]:
                self.evict(
                    s,
                    f"it held the lease of request {lease.tag!r} for more than "
                    f"`lease_timeout` {timeout} s (hung?)",
                )

    # -- what is counted, and logged once ---------------------------------------------

    def drop(self, what: str, where: str = "the channel") -> None:
        self.counts["dropped"] += 1
        self.note(what, f"dropped {what} on {where}")

    def note(self, kind: str, message: str) -> None:
        """Log the first event of each kind; ``statistics()`` counts them all."""
        if kind not in self._noted:
            self._noted.add(kind)
            _log.warning("mmwire: %s (further ones are counted, not logged)", message)
