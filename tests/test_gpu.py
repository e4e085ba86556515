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


def test_materializer_on_cuda_returns_views_of_the_device_batch() -> None:
    from mmwire.materialize import Materializer, ProcessorConfig, preprocess_images
    from mmwire.transport import IndexMap, LocalIndex

    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((60, 90), (41, 33))]
    cfg = ProcessorConfig()
    p = CpuProducer(arena_size=16 << 20)
    c = CpuConsumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0])
        p.publish("m", [Item(data=im, consumers=(0,), preprocess=cfg.spec_for) for im in images])
        with c.recv(10) as b:
            m = IndexMap(0, [GlobalIndex(1), GlobalIndex(0)])
            out = Materializer(0, device="cuda").materialize(b, m)
        assert out.pixel_values.is_cuda and out.grid_thw.is_cuda
        first = out.features[LocalIndex(0)]
        assert first.is_cuda and first.data_ptr() == out.pixel_values.data_ptr()
        assert torch.equal(first.cpu(), preprocess_images([images[1]], cfg)[0])
    finally:
        c.close()
        p.close()
