"""The control channel's messages and the producer's table of the consumers it serves.

A rank's identity is a *member*, not a number. A consumer on the producer's host gets a
member from the handover (a random 16-byte token, tied to its handover connection) and
joins the zmq channel with that token as its routing id; a consumer on another host joins
with a fresh routing id and, under CURVE, is bound to its public key. Leases are held by
members, so the end of one process (death, eviction, replacement) releases only what that
process received, never what a newer process of the same rank holds.

Messages
--------
Control plane, one zmq ROUTER (producer) and one DEALER per consumer process::

    consumer -> producer   msgpack Join{rank, shared, member, replace}   once
    producer -> consumer   [header, inline frames...]                     one batch per request
    producer -> consumer   [NOTICE, reason]                               a refusal, an end, a ping
    consumer -> producer   msgpack Release{lease, generation, window, done}  once per lease
    consumer -> producer   msgpack Done{seq}        once per owned batch that held no lease

Data plane: the arena (``_arena.py``), handed over once per consumer process by
``_handover.py``. A remote consumer receives the same envelopes with ``InlineRef`` payloads
whose frames are the arena slices themselves, sent without copying.

Rules
-----
* A rank has at most one live member. A second claim is refused, unless it asks to
  ``replace`` (a local process of an allowed uid, or a remote one on a channel without
  keys) or comes from the same CURVE key (the same principal reconnecting); the old
  member is ended first, so its leases are fenced off before the new one gets any.
* A join must name a member the handover made, on the rank it was made for, or be a
  remote join where the producer accepts those (``tcp://``).
* A member handed over but not joined within ``join_timeout`` expires.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import zmq

from ._handover import MAX_RANKS
from ._lane import Lane

__all__ = [
    "NOTICE",
    "CurveKeys",
    "Done",
    "Join",
    "Member",
    "Members",
    "Release",
    "decode_control",
]

_log = logging.getLogger("mmwire.transport")

_U63 = msgspec.Meta(ge=0, le=(1 << 63) - 1)


class Join(msgspec.Struct, frozen=True, tag=True):
    """consumer -> producer, once: this routing id is rank ``rank`` of member ``member``."""

    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
    shared: bool
    member: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    replace: bool = False
    pull: bool = False
    """A remote consumer that reads its payloads through the producer's transfer engine."""
    backlog: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The batches it queues before the producer waits for it (0: the producer's bound)."""


class Release(msgspec.Struct, frozen=True, tag=True):
    """consumer -> producer, once per lease: this member is done with it."""

    lease: Annotated[int, _U63]
    generation: Annotated[int, _U63]
    window: bool = False
    """A lease of the producer's transfer window (a remote rank that pulls), not its arena."""
    done: Annotated[int, _U63] = 0
    """A batch this member finished with this release, as ``Done`` would say (0: none): a
    batch's last release carries it, so finishing a batch is one message."""


class Done(msgspec.Struct, frozen=True, tag=True):
    """consumer -> producer, once per batch it owned items of: it released batch number
    ``seq`` (counted from 1 over the batches this member received), or could not take it."""

    seq: Annotated[int, _U63]
    refused: Annotated[str, msgspec.Meta(max_length=160)] = ""
    """Why the rank could not take the batch (a malformed batch, pulled bytes that fail
    their digest), or ``""``: it finished it."""


NOTICE = b"\x00mmwire-notice"
"""First frame of a producer -> consumer notice: ``[NOTICE, reason]`` (never a batch header)."""

_DECODER = msgspec.msgpack.Decoder(Join | Release | Done)
ENCODER = msgspec.msgpack.Encoder()


def decode_control(body: bytes) -> Join | Release | Done | None:
    """A control message, or ``None`` for anything that is not one (dropped by the caller)."""
    if len(body) > 256:
        return None
    try:
        msg: Join | Release | Done = _DECODER.decode(body)
    except msgspec.MsgspecError:
        return None
    return msg


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair (z85 bytes), for ``tcp://`` between hosts. See :meth:`generate`."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh key pair from libzmq."""
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)


@dataclass
class Member:
    """One consumer process's claim on a rank."""

    id: int
    """The holder id its leases carry in the arena."""
    rank: int
    token: bytes
    local: bool
    """It received the arena over the handover socket."""
    pid: int | None
    key: bytes | None
    """Its CURVE public key (z85), for a remote member under CURVE."""
    since: float
    ident: bytes | None = None
    """Its zmq routing id, once joined."""
    shared: bool = False
    """It reads payloads from the arena (else they travel to it as frames)."""
    pulls: bool = False
    """A remote member that reads its payloads through the transfer engine."""
    lane: Lane | None = None
    """Its own lane for batches (a local member; ``_lane.py``)."""
    announced: bool = False
    """Its lane announced a batch that is still to go on the channel (its queue was full)."""
    closing: bool = False
    """Its lane broke (its process is closing): it misses batches until it ends."""
    gone: bool = False
    sent: int = 0
    """Batches sent to it."""
    outstanding: dict[int, str] = field(default_factory=dict)
    """Request ids of the batches sent to it that it owns items of and has not released
    (``Done``), by batch number: what is reported lost if it ends."""

    def __str__(self) -> str:
        who = f"pid {self.pid}" if self.pid is not None else "a remote process"
        return f"rank {self.rank} ({who}, member {self.id})"


_ENDED_KEPT = 4096
"""How many ended members' routing ids ``Members`` remembers."""


class Members:
    """The producer's members; every method runs under the producer's lock.

    ``on_end(member, why)`` runs once per ended member, for the producer to release its
    leases, close its handover connection and log why.
    """

    def __init__(self, on_end: Callable[[Member, str], None]) -> None:
        self._on_end = on_end
        self._next_id = 1
        self._by_rank: dict[int, Member] = {}
        self._by_token: dict[bytes, Member] = {}
        self._by_ident: dict[bytes, Member] = {}
        # routing ids of members ended lately: their last releases may still be on the way
        # (a consumer's handover connection can close before its channel's queue drains)
        self._ended: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def _new(self, rank: int, *, local: bool, pid: int | None, key: bytes | None) -> Member:
        s = Member(
            id=self._next_id,
            rank=rank,
            token=secrets.token_bytes(16),
            local=local,
            pid=pid,
            key=key,
            since=time.monotonic(),
        )
        self._next_id += 1
        self._by_rank[rank] = s
        self._by_token[s.token] = s
        return s

    def offer(self, rank: int, pid: int, replace: bool) -> Member | str:
        """A new local member for ``rank`` (the handover's Hello), or why not."""
        live = self._by_rank.get(rank)
        if live is not None:
            if not replace:
                return (
                    f"rank {rank} is held by {live}; a second process is refused "
                    "(pass replace=True to take it over)"
                )
            self.end(live, f"replaced by pid {pid}")
        return self._new(rank, local=True, pid=pid, key=None)

    def join(
        self,
        ident: bytes,
        msg: Join,
        key: bytes | None,
        remote_ok: bool,
        connected: Callable[[Member], bool],
    ) -> Member | str:
        """Bind a routing id to a member (the channel's Join), or why not.

        ``connected(member)`` says whether a remote member's connection is still up; a
        remote rank whose holder has disconnected can be joined again.
        """
        if ident in self._by_ident:
            return f"routing id {ident.hex()} already joined as {self._by_ident[ident]}"
        if msg.member:
            s = self._by_token.get(msg.member)
            if s is None or s.gone or s.ident is not None or s.rank != msg.rank:
                return f"a join for rank {msg.rank} names no member handed over for it"
        else:
            if not remote_ok:
                return (
                    f"a join for rank {msg.rank} without a handover member (this producer "
                    "takes remote consumers only on tcp://)"
                )
            live = self._by_rank.get(msg.rank)
            if live is not None:
                same_key = key is not None and live.key == key
                asked = msg.replace and key is None and not live.local
                if not (same_key or asked):
                    if live.local or (live.key is not None and live.key != key):
                        return f"rank {msg.rank} is held by {live}"
                    if connected(live):
                        return f"rank {msg.rank} is held by {live}, which is still connected"
                self.end(live, "replaced by a new remote member")
            s = self._new(msg.rank, local=False, pid=None, key=key)
        s.ident = ident
        s.shared = msg.shared and s.local
        s.pulls = msg.pull and not s.local
        self._by_ident[ident] = s
        return s

    def end(self, s: Member, why: str) -> None:
        """End a member once: forget it and let the producer release what it held."""
        if s.gone:
            return
        s.gone = True
        if self._by_rank.get(s.rank) is s:
            del self._by_rank[s.rank]
        self._by_token.pop(s.token, None)
        if s.ident is not None and self._by_ident.get(s.ident) is s:
            del self._by_ident[s.ident]
            self._ended[s.ident] = None
            if len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)
        self._on_end(s, why)

    def ended(self, ident: bytes) -> bool:
        """Whether this routing id belonged to a member that ended lately."""
        return ident in self._ended

    def by_token(self, token: bytes) -> Member | None:
        """The live member with this handover token."""
        return self._by_token.get(token)

    def by_ident(self, ident: bytes) -> Member | None:
        """The joined member with this routing id."""
        return self._by_ident.get(ident)

    def of_rank(self, rank: int) -> Member | None:
        """The live member holding ``rank`` (joined or not)."""
        return self._by_rank.get(rank)

    def joined(self) -> Iterator[Member]:
        """Every joined member, by rank (not those whose process is closing)."""
        for rank in sorted(self._by_rank):
            s = self._by_rank[rank]
            if s.ident is not None and not s.closing:
                yield s

    def expire(self, join_timeout: float) -> None:
        """End members handed over more than ``join_timeout`` s ago that never joined."""
        cutoff = time.monotonic() - join_timeout
        for s in list(self._by_rank.values()):
            if s.ident is None and s.since < cutoff:
                self.end(s, f"it did not join the channel within {join_timeout} s")

    def all(self) -> list[Member]:
        """Every live member."""
        return list(self._by_rank.values())
