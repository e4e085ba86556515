"""Vision-DP owner assignment: greedy longest-processing-time over patch counts."""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

from mmwire.transport import GlobalIndex, IndexMap

__all__ = ["OwnerAffinity", "assign_owners", "owners_of"]


def assign_owners(
    patch_counts: Sequence[int],
    num_ranks: int,
    *,
    preferred: Sequence[int | None] | None = None,
    loads: Sequence[int] | None = None,
) -> list[IndexMap]:
    """One :class:`IndexMap` per rank; every rank computes the same answer on its own.

    Items are taken by patch count, descending (stable: equal sizes keep index order), each
    to the least-loaded rank (ties to the lowest rank). Sizes ``[1000, 100, 200, 50]`` on 2
    ranks give rank 0 ``[0]`` and rank 1 ``[2, 1, 3]``.

    ``preferred`` (one rank or ``None`` per item, e.g. from :class:`OwnerAffinity`) places
    those items on their rank first, where its output cache holds them; the others then
    balance the load around them. ``loads`` (patches per rank) is work the ranks already
    have, e.g. requests still in flight: a frontend that assigns request by request passes
    it, or every one-image request would go to rank 0.
    """
    if num_ranks <= 0:
        raise ValueError(f"`num_ranks` must be positive, got {num_ranks}")
    if preferred is not None and len(preferred) != len(patch_counts):
        raise ValueError(f"{len(preferred)} preferred ranks for {len(patch_counts)} items")
    if loads is not None and len(loads) != num_ranks:
        raise ValueError(f"{len(loads)} loads for {num_ranks} ranks")
    loads = [0] * num_ranks if loads is None else list(loads)
    buckets: list[list[GlobalIndex]] = [[] for _ in range(num_ranks)]
    free = list(range(len(patch_counts)))
    if preferred is not None:
        free = []
        for i, r in enumerate(preferred):
            if r is not None and 0 <= r < num_ranks:
                buckets[r].append(GlobalIndex(i))
                loads[r] += patch_counts[i]
            else:
                free.append(i)
    for i in sorted(free, key=lambda i: -patch_counts[i]):
        r = min(range(num_ranks), key=lambda k: (loads[k], k))
        buckets[r].append(GlobalIndex(i))
        loads[r] += patch_counts[i]
    return [IndexMap(r, b) for r, b in enumerate(buckets)]


class OwnerAffinity:
    """Remembers which rank last owned an image (by its digest, or any content key), so a
    resent image goes back to the rank whose output cache holds it.

    ``preferred(keys)`` gives ``assign_owners(preferred=)`` its list; ``remember(keys,
    owners)`` records a request's owners once published. At most ``capacity`` keys are
    kept (least recently used dropped); ``forget_rank`` drops a rank that went away.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._rank_of: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def preferred(self, keys: Sequence[Hashable]) -> list[int | None]:
        """Each key's last owner, or ``None``."""
        return [self._rank_of.get(k) for k in keys]

    def remember(self, keys: Sequence[Hashable], owners: Sequence[int]) -> None:
        """Record that ``owners[i]`` now owns the image of ``keys[i]``."""
        for key, rank in zip(keys, owners):
            self._rank_of[key] = rank
            self._rank_of.move_to_end(key)
        while len(self._rank_of) > self.capacity:
            self._rank_of.popitem(last=False)

    def forget_rank(self, rank: int) -> None:
        """Drop every image that ``rank`` owned (its process, and its cache, are gone)."""
        for key in [k for k, r in self._rank_of.items() if r == rank]:
            del self._rank_of[key]


def owners_of(maps: Sequence[IndexMap], num_items: int) -> list[tuple[int, ...]]:
    """For each global item, the rank that owns it (as an envelope's ``consumers``)."""
    owners: list[tuple[int, ...]] = [()] * num_items
    for m in maps:
        for g in m.globals:
            owners[g.value] = (m.rank,)
    return owners
