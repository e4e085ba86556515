from __future__ import annotations

import pytest
from mmwire.transport import GlobalIndex, GlobalTable, Grid, IndexMap, LocalIndex, LocalSlots


class TestDistinctTypes:
    def test_not_equal_to_each_other_or_ints(self) -> None:
        assert GlobalIndex(1) != LocalIndex(1)
        assert GlobalIndex(1) != 1
        assert LocalIndex(0) != 0
        assert GlobalIndex(3) == GlobalIndex(3)
        assert hash(GlobalIndex(3)) == hash(GlobalIndex(3))

    def test_not_a_list_index(self) -> None:
        with pytest.raises(TypeError):
            [10, 20][GlobalIndex(0)]  # type: ignore[call-overload]
        with pytest.raises(TypeError):
            [10, 20][LocalIndex(0)]  # type: ignore[call-overload]

    def test_rejects_bad_values(self) -> None:
        with pytest.raises(TypeError, match="takes an int"):
            GlobalIndex(1.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="takes an int"):
            LocalIndex(True)
        with pytest.raises(ValueError, match=">= 0"):
            GlobalIndex(-1)


class TestTables:
    def test_global_table_rejects_local_and_int(self) -> None:
        table = GlobalTable(["a", "b"])
        assert table[GlobalIndex(1)] == "b"
        with pytest.raises(TypeError, match="indexed by GlobalIndex, got LocalIndex"):
            table[LocalIndex(1)]  # type: ignore[index]
        with pytest.raises(TypeError, match="got int"):
            table[1]  # type: ignore[index]
        with pytest.raises(IndexError, match="outside a batch of 2"):
            table[GlobalIndex(2)]

    def test_local_slots_reject_global(self) -> None:
        slots: LocalSlots[str] = LocalSlots(2)
        slots[LocalIndex(0)] = "x"
        with pytest.raises(TypeError, match="indexed by LocalIndex, got GlobalIndex"):
            slots[GlobalIndex(1)] = "y"  # type: ignore[index]
        with pytest.raises(LookupError, match="never written"):
            slots.values()
        slots[LocalIndex(1)] = "y"
        assert slots.values() == ["x", "y"]

    def test_index_map(self) -> None:
        m = IndexMap(0, [GlobalIndex(2), GlobalIndex(1)])
        assert m.to_global(LocalIndex(0)) == GlobalIndex(2)
        assert m.to_local(GlobalIndex(1)) == LocalIndex(1)
        assert m.owns(GlobalIndex(2)) and not m.owns(GlobalIndex(0))
        with pytest.raises(KeyError, match="does not own"):
            m.to_local(GlobalIndex(0))
        with pytest.raises(TypeError):
            m.to_global(GlobalIndex(0))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            IndexMap(0, [2, 1])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="twice"):
            IndexMap(0, [GlobalIndex(1), GlobalIndex(1)])


def test_seed_bug_is_impossible() -> None:
    """The engine bug: a global grid table read with local slots under assignment [2, 1]."""
    grids = GlobalTable([Grid((1, 4, 4)), Grid((1, 6, 8)), Grid((1, 10, 2))])
    rank = IndexMap(0, [GlobalIndex(2), GlobalIndex(1)])
    with pytest.raises(TypeError):
        grids[LocalIndex(0)]  # type: ignore[index]
    got = [grids[rank.to_global(local)] for local, _ in rank.items()]
    assert got == [Grid((1, 10, 2)), Grid((1, 6, 8))]
