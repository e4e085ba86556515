# mypy must reject each line marked "E:"; tests/test_typing.py checks that it does.
from mmwire.transport import GlobalIndex, GlobalTable, IndexMap, LocalIndex, LocalSlots

table: GlobalTable[int] = GlobalTable([1, 2])
slots: LocalSlots[int] = LocalSlots(2)
m = IndexMap(0, [GlobalIndex(1)])

table[LocalIndex(0)]  # E: index
slots[GlobalIndex(0)] = 1  # E: index
m.to_global(GlobalIndex(0))  # E: arg-type
m.to_local(LocalIndex(0))  # E: arg-type
local: LocalIndex = GlobalIndex(0)  # E: assignment
table[m.to_global(LocalIndex(0))]  # fine
