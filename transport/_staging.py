"""What remote pulling ranks read: copies of their payloads in the transfer window.

The transfer engine's data plane has no authentication, so it never reaches the arena.
The payloads that remote ranks pulling through it own are copied into a window of their
own, each with a digest their puller checks against the envelope from the CURVE channel;
the pullers' references to the arena are given back at once. Also here: the references
one publish gives out (``Holds``), which a failed publish takes back.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ._arena import Arena
from ._control import Member
from ._delivery import Holds as HoldsByMember
from ._delivery import Staged
from ._prepare import PreparedItem, payload_digest
from ._schema import CpuRef, FeatureEnvelope

__all__ = ["Holds", "stage_for_pullers"]


def stage_for_pullers(
    window: Arena,
    request_id: str,
    prepared: list[PreparedItem],
    envs: list[FeatureEnvelope],
    members: dict[int, Member],
    holds: Holds,
    *,
    slice_of: Callable[[FeatureEnvelope], memoryview],
    release: Callable[[int, int, int], bool],
    timeout: float | None,
    drain: Callable[[float], None],
) -> tuple[list[FeatureEnvelope], Staged | None] | None:
    """Copy the host payloads that remote pulling ranks own into the window, each with a
    digest; the envelopes with those digests and the window's references, or ``None`` if
    ``timeout`` is ``None`` and the window has no room now. The pullers' references to the
    arena are given back: they read the window, never the arena."""
    pullers = {r: s for r, s in members.items() if s.pulls}
    staged = [
        k
        for k, e in enumerate(envs)
        if isinstance(e.payload, CpuRef) and any(r in pullers for r in e.consumers)
    ]
    if not staged:
        return envs, None
    holders = {pullers[r].id for k in staged for r in envs[k].consumers if r in pullers}
    sizes = [envs[k].tensor.nbytes for k in staged]
    if timeout is None:
        got = window.try_allocate(sizes, holders, tag=request_id)
        if got is None:
            return None
        lease = got
    else:
        lease = window.allocate(sizes, holders, timeout, drain=drain, tag=request_id)
    out = list(envs)
    refs: dict[int, CpuRef] = {}
    for k, (off, n) in zip(staged, lease.slots):
        source = slice_of(envs[k])
        window.view[off : off + n] = source
        if envs[k].digest is None:  # the puller checks every item's bytes against one
            # taken from the arena's bytes, never the window's: anyone who reaches the
            # engine may write the window between the copy and the hash
            out[k] = msgspec.structs.replace(envs[k], digest=payload_digest(prepared[k], source))
        refs[k] = CpuRef(
            arena_id=window.id,
            lease=lease.start,
            offset=off,
            length=n,
            generation=lease.generation,
        )
    window.publish(lease)
    for p in pullers.values():
        for start, gen in holds.by_member.pop(p.id, []):
            release(start, gen, p.id)
        holds.claimed = [c for c in holds.claimed if c[0] != p.id]
    return out, Staged(lease, refs)


class Holds:
    """The references one publish gives: per member, the leases it must release."""

    def __init__(self) -> None:
        self.by_member: HoldsByMember = {}
        self.claimed: list[tuple[int, int, int]] = []
        """(member, lease, generation) references added to resident leases (undone if
        the publish fails)."""
        self.reused: set[int] = set()
        """Items pointed at resident payloads."""

    def holds(self, member: int, start: int) -> bool:
        return any(st == start for st, _ in self.by_member.get(member, ()))

    def add(self, member: int, start: int, gen: int, *, claimed: bool = False) -> None:
        self.by_member.setdefault(member, []).append((start, gen))
        if claimed:
            self.claimed.append((member, start, gen))
