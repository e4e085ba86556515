"""Global and local item positions as distinct types, and the tables keyed by each.

A batch has items at global positions (``GlobalIndex``); a vision-DP rank processes some
of them in its own order, at local slots (``LocalIndex``). A serving engine once read a
globally indexed grid table with local slots and crashed on every batch whose assignment
came out permuted. Here the two are different types: never equal to each other or to a
plain ``int``, not usable as a list index, and rejected with ``TypeError`` by every table.
Crossing from one to the other goes through an :class:`IndexMap` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar, final

import msgspec

__all__ = ["GlobalIndex", "GlobalTable", "IndexMap", "LocalIndex", "LocalSlots"]

T = TypeVar("T")


def _check_position(kind: str, value: object) -> None:
    if type(value) is not int:
        raise TypeError(f"`{kind}` takes an int position, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"`{kind}` must be >= 0, got {value}")


@final
class GlobalIndex(msgspec.Struct, frozen=True, array_like=True, order=True):
    """Position of an item in its batch (the order the producer wrote it)."""

    value: int

    def __post_init__(self) -> None:
        _check_position("GlobalIndex", self.value)

    def __repr__(self) -> str:
        return f"GlobalIndex({self.value})"


@final
class LocalIndex(msgspec.Struct, frozen=True, array_like=True, order=True):
    """Slot of an item on one rank (the order that rank processes its items)."""

    value: int

    def __post_init__(self) -> None:
        _check_position("LocalIndex", self.value)

    def __repr__(self) -> str:
        return f"LocalIndex({self.value})"


def _require(key: object, kind: type[GlobalIndex] | type[LocalIndex], table: str) -> int:
    if type(key) is not kind:
        raise TypeError(
            f"`{table}` is indexed by {kind.__name__}, got {type(key).__name__} ({key!r}); "
            "go through IndexMap to convert between global and local positions"
        )
    value: int = key.value
    return value


@final
class GlobalTable(Generic[T]):
    """Read-only per-batch table (grids, envelopes) readable only with :class:`GlobalIndex`."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterable[T]) -> None:
        self._items: tuple[T, ...] = tuple(items)

    def __getitem__(self, key: GlobalIndex) -> T:
        i = _require(key, GlobalIndex, "GlobalTable")
        if i >= len(self._items):
            raise IndexError(f"{key!r} is outside a batch of {len(self._items)} items")
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def indices(self) -> Iterator[GlobalIndex]:
        """Every global position of the batch, in order."""
        return (GlobalIndex(i) for i in range(len(self._items)))

    def items(self) -> Iterator[tuple[GlobalIndex, T]]:
        """``(GlobalIndex, value)`` pairs in global order."""
        return ((GlobalIndex(i), v) for i, v in enumerate(self._items))

    def values(self) -> tuple[T, ...]:
        """The values in global order."""
        return self._items

    def __repr__(self) -> str:
        return f"GlobalTable({list(self._items)!r})"


@final
class LocalSlots(Generic[T]):
    """Per-rank slots, written and read only with :class:`LocalIndex`; all must be filled."""

    __slots__ = ("_filled", "_items")

    def __init__(self, size: int) -> None:
        if type(size) is not int or size < 0:
            raise ValueError(f"`size` must be an int >= 0, got {size!r}")
        self._items: list[T | None] = [None] * size
        self._filled = [False] * size

    def __setitem__(self, key: LocalIndex, value: T) -> None:
        i = _require(key, LocalIndex, "LocalSlots")
        if i >= len(self._items):
            raise IndexError(f"{key!r} is outside {len(self._items)} local slots")
        self._items[i] = value
        self._filled[i] = True

    def __getitem__(self, key: LocalIndex) -> T:
        i = _require(key, LocalIndex, "LocalSlots")
        if i >= len(self._items):
            raise IndexError(f"{key!r} is outside {len(self._items)} local slots")
        if not self._filled[i]:
            raise LookupError(f"local slot {key!r} was never written")
        value = self._items[i]
        return value  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[T]:
        """The values in local order; raises ``LookupError`` if a slot is empty."""
        return [self[LocalIndex(i)] for i in range(len(self._items))]


@final
class IndexMap:
    """One rank's items: local slot ``k`` processes global item ``globals[k]``.

    Built from an owner assignment (``mmwire.materialize.assign_owners``) or directly from
    a sequence of :class:`GlobalIndex`. Plain ints are refused.
    """

    __slots__ = ("_globals", "_locals", "rank")

    def __init__(self, rank: int, globals_: Sequence[GlobalIndex]) -> None:
        if type(rank) is not int or rank < 0:
            raise ValueError(f"`rank` must be an int >= 0, got {rank!r}")
        for g in globals_:
            _require(g, GlobalIndex, "IndexMap")
        gl = tuple(globals_)
        if len(set(gl)) != len(gl):
            raise ValueError(f"`IndexMap` for rank {rank} lists an item twice: {list(gl)}")
        self.rank = rank
        self._globals: tuple[GlobalIndex, ...] = gl
        self._locals: dict[GlobalIndex, LocalIndex] = {g: LocalIndex(k) for k, g in enumerate(gl)}

    def to_global(self, local: LocalIndex) -> GlobalIndex:
        """Global position of this rank's local slot."""
        k = _require(local, LocalIndex, "IndexMap.to_global")
        if k >= len(self._globals):
            raise IndexError(f"{local!r} is outside rank {self.rank}'s {len(self._globals)} slots")
        return self._globals[k]

    def to_local(self, global_: GlobalIndex) -> LocalIndex:
        """Local slot of a global item this rank owns; ``KeyError`` if it does not own it."""
        _require(global_, GlobalIndex, "IndexMap.to_local")
        try:
            return self._locals[global_]
        except KeyError:
            raise KeyError(f"rank {self.rank} does not own {global_!r}") from None

    def owns(self, global_: GlobalIndex) -> bool:
        """Whether this rank processes the given global item."""
        _require(global_, GlobalIndex, "IndexMap.owns")
        return global_ in self._locals

    @property
    def globals(self) -> tuple[GlobalIndex, ...]:
        """The owned global positions, in local (processing) order."""
        return self._globals

    def items(self) -> Iterator[tuple[LocalIndex, GlobalIndex]]:
        """``(LocalIndex, GlobalIndex)`` pairs in local order."""
        return ((LocalIndex(k), g) for k, g in enumerate(self._globals))

    def __len__(self) -> int:
        return len(self._globals)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexMap):
            return NotImplemented
        return self.rank == other.rank and self._globals == other._globals

    def __hash__(self) -> int:
        return hash((self.rank, self._globals))

    def __repr__(self) -> str:
        return f"IndexMap(rank={self.rank}, globals={[g.value for g in self._globals]})"
