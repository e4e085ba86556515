"""The owner's cache of materialised outputs: a repeated image costs neither upload nor kernels.

Keyed by the payload's content (BLAKE3 of the bytes this rank received -- recomputed here,
never taken from the envelope, so neither a wrong digest nor a client's chosen collision can
make this rank serve another image's features), the item's preprocessing spec and the
output dtype. The
entries are the item's rows of ``pixel_values`` on the device they were made on, kept
within a byte budget, least recently used evicted first.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, final

import blake3
import msgspec
import torch
from mmwire.transport import PreprocessSpec

__all__ = ["CacheStatistics", "OutputCache", "output_key"]

CacheKey = tuple[str, bytes, str]


@dataclass(frozen=True)
class CacheStatistics:
    """A snapshot of an owner's output cache."""

    budget: int
    """The byte budget."""
    bytes: int
    """Bytes held."""
    entries: int
    """Items held."""
    hits: int
    """Items served from the cache."""
    misses: int
    """Items materialised (and then kept, if they fit)."""
    evictions: int
    """Items dropped to stay within the budget."""


def output_key(payload: Any, spec: PreprocessSpec, dtype: torch.dtype) -> CacheKey:
    """The cache key of a raw or encoded item: its payload bytes' digest, spec and dtype."""
    body = memoryview(payload).cast("B")
    threads = blake3.blake3.AUTO if body.nbytes >= 1 << 20 else 1
    digest = blake3.blake3(body, max_threads=threads).hexdigest()
    return digest, msgspec.msgpack.encode(spec), str(dtype)


@final
class OutputCache:
    """Materialised rows by :func:`output_key`, within ``budget`` bytes (LRU)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: collections.OrderedDict[CacheKey, torch.Tensor] = collections.OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def get(self, key: CacheKey) -> torch.Tensor | None:
        """The rows kept for ``key`` (most recently used now), or ``None`` (a miss)."""
        rows = self._entries.get(key)
        if rows is None:
            self._misses += 1
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        return rows

    def put(self, key: CacheKey, rows: torch.Tensor) -> None:
        """Keep a copy of ``rows``; evicts the least recently used to make room. Rows larger
        than the whole budget are not kept."""
        size = rows.numel() * rows.element_size()
        if size > self.budget or key in self._entries:
            return
        while self._bytes + size > self.budget:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
            self._evictions += 1
        self._entries[key] = rows.clone()
        self._bytes += size

    def statistics(self) -> CacheStatistics:
        """A snapshot of the cache's use."""
        return CacheStatistics(
            budget=self.budget,
            bytes=self._bytes,
            entries=len(self._entries),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
        )
