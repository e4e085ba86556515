"""GPU cases (``pytest -m gpu``): they skip cleanly without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmwire.transport import CpuConsumer, CpuProducer, GlobalIndex, Grid, Item

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_registered_arena_uploads_byte_exact() -> None:
    p = CpuProducer(arena_size=64 << 20)
    c = CpuConsumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0])
        c.register_with_cuda()
        c.register_with_cuda()  # once per mapping: the second call is a no-op
        data = np.random.default_rng(3).integers(0, 256, (1000, 777, 3), dtype=np.uint8)
        p.publish("g", [Item(data=data, consumers=(0,), kind="embedding", grid=Grid((1, 1)))])
        with c.recv(10) as b:
            dev = b.open_tensor(GlobalIndex(0)).to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(dev.cpu(), torch.from_numpy(data))
    finally:
        c.close()
        p.close()
