"""Video on the GPU (``pytest -m gpu``): the CUDA kernels' ``pixel_values_videos`` equal the
CPU path's (itself equal to transformers'), with ``==``, in float32 and bfloat16."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from clips import RAW_CASES, SETTINGS, make_clip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_kernel_rows_equal_the_cpu_path(family: str, dtype: torch.dtype) -> None:
    """Every case and setting of the CPU tests, with frames of noise (so the two frames of
    a temporal patch differ everywhere): the kernels' rows equal the CPU path's."""
    pytest.importorskip("cupy")
    from mmwire.kernels import video_rows
    from mmwire.materialize.video import video_pixel_values, video_spec_for
    from mmwire.transport.errors import ConfigurationError, MaterializeError

    rng = np.random.default_rng(11)
    checked = 0
    for params in SETTINGS:
        try:
            config = video_spec_for(family, params)
        except ConfigurationError:
            continue
        for t, h, w, fps in RAW_CASES:
            try:
                plan = config.plan_frames(t, fps, h, w)
            except MaterializeError:
                continue
            frames = rng.integers(0, 256, (len(plan.indices), h, w, 3), dtype=np.uint8)
            want = video_pixel_values(frames, plan, config, dtype)
            scale = 1.0 / config.rescale_factor
            mean = (torch.tensor(config.image_mean) * scale).tolist()
            std = (torch.tensor(config.image_std) * scale).tolist()
            got = torch.empty(want.shape, dtype=dtype, device="cuda")
            video_rows(
                torch.from_numpy(frames).cuda(),
                (plan.new_height, plan.new_width),
                patch=config.patch_size,
                merge=config.merge_size,
                temporal=config.temporal_patch_size,
                mean=(mean[0], mean[1], mean[2]),
                std=(std[0], std[1], std[2]),
                out=got,
            )
            assert torch.equal(got.cpu(), want), (params, t, h, w)
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_cuda_owner_materialises_videos_as_the_cpu_owner(dtype: torch.dtype) -> None:
    """Containers of distinct sizes and frames given decoded, published and materialised by
    a CUDA owner (decode on the host, rows by the kernels) and by a CPU owner: equal."""
    pytest.importorskip("cupy")
    from mmwire.materialize import Materializer
    from mmwire.materialize.video import video_spec_for
    from mmwire.transport import Consumer, GlobalIndex, IndexMap, Item, Producer

    qwen3, qwen25 = (
        video_spec_for("qwen3-vl"),
        video_spec_for("qwen2.5-vl", {"fps": 2.0, "do_sample_frames": True}),
    )
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (5, 97, 163, 3), dtype=np.uint8)
    clip = make_clip(163, 97, 47, container="webm", codec="libvpx-vp9", rate=24)  # odd sides
    for config in (qwen3, qwen25):  # both samplers, patch 16 and 14
        items: list[Any] = [
            Item(make_clip(162, 98, 61), (0,), modality="video", preprocess=config),
            Item(clip, (0,), modality="video", preprocess=config),
            Item(raw, (0,), modality="video", preprocess=video_spec_for(config.family)),
        ]
        p = Producer(arena_size=32 << 20)
        c = Consumer(0, p.endpoint, handover=p.handover_path)
        try:
            p.wait_for_consumers([0], 10)
            p.publish("v", items)
            with c.recv(10) as b:
                m = IndexMap(0, [GlobalIndex(2), GlobalIndex(0), GlobalIndex(1)])
                on_cpu = Materializer(0, dtype=dtype).materialize(b, m)
                on_gpu = Materializer(0, "cuda", dtype, compute="cuda").materialize(b, m)
        finally:
            c.close()
            p.close()
        assert on_gpu.pixel_values_videos is not None and on_cpu.pixel_values_videos is not None
        assert on_gpu.pixel_values_videos.is_cuda
        assert torch.equal(on_gpu.pixel_values_videos.cpu(), on_cpu.pixel_values_videos)
        assert on_gpu.video_grid_thw is not None and on_cpu.video_grid_thw is not None
        assert torch.equal(on_gpu.video_grid_thw.cpu(), on_cpu.video_grid_thw)
