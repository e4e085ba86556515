"""GPU cases (``pytest -m gpu``): they skip cleanly without CUDA."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from kernel_cases import CASES, TILED_CASES
from mmwire.transport import Consumer, GlobalIndex, Grid, Item, Producer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_registered_arena_uploads_byte_exact() -> None:
    p = Producer(arena_size=64 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
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
    from mmwire.materialize import KimiConfig, Materializer, preprocess_images
    from mmwire.transport import IndexMap, LocalIndex

    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((60, 90), (41, 33))]
    cfg = KimiConfig()
    p = Producer(arena_size=16 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0])
        p.publish("m", [Item(data=im, consumers=(0,), preprocess=cfg) for im in images])
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


# --- kernels (#6): the same cases as test_kernels_host.py, on the device -------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", CASES + TILED_CASES)
def test_cuda_kernels_equal_the_cpu_path(rng: np.random.Generator, name: str, dtype: str) -> None:
    from kernel_cases import case, differing, kernels, reference

    items = case(name, rng)
    want_pv, want_grid = reference(items, getattr(torch, dtype))
    got_pv, got_grid = kernels(items, getattr(torch, dtype), "cuda")
    assert got_pv.is_cuda and got_grid.is_cuda
    assert torch.equal(got_grid.cpu(), want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize(
    ("patch_modules", "affine", "dtype"),
    [
        (False, True, "float32"),
        (False, True, "bfloat16"),
        (True, False, "bfloat16"),
        (True, False, "float16"),
    ],
    ids=["any-patch-fp32", "any-patch-bf16", "tables-bf16", "tables-fp16"],
)
def test_cuda_kernels_of_either_module_and_normalise_equal_the_cpu_path(
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    patch_modules: bool,
    affine: bool,
    dtype: str,
) -> None:
    # the cases above run the module compiled for their patch size and, in the 16-bit
    # types, the affine normalise; here the module that takes the size as an argument, and
    # the 16-bit tables
    from kernel_cases import case, differing, kernels, reference
    from mmwire.kernels import CupyLauncher

    launcher = CupyLauncher(
        torch.device("cuda"), patch_modules=patch_modules, affine_normalise=affine
    )
    for name in ("rgb_distinct", "rgba_chessboard", "narrow_blocks", "plain_and_mma"):
        items = case(name, rng)
        want_pv, _ = reference(items, getattr(torch, dtype))
        got_pv, _ = kernels(items, getattr(torch, dtype), "cuda", launcher)
        assert differing(got_pv, want_pv) == 0, name


def test_cuda_mma_kernel_takes_a_source_off_a_word(rng: np.random.Generator) -> None:
    # tiles planned raw (R_RAW: cp.async of 16-byte granules, word loads of the rows) need
    # the source on a word; one byte off, preprocess_packed copies it onto one
    from kernel_cases import case, differing, reference
    from mmwire.kernels import pack, preprocess_packed

    items = case("tensor_core_scales", rng)
    want_pv, _ = reference(items, torch.bfloat16)
    src, shapes = pack([torch.from_numpy(im).cuda() for im, _ in items])
    off = torch.empty(src.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
    off.copy_(src)
    specs = [cfg(im.shape[1], im.shape[0]) for im, cfg in items]
    for source in (src, off):
        got_pv, _ = preprocess_packed(source, shapes, specs, torch.bfloat16)
        assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("skew", [0, 2], ids=["out-on-16-bytes", "out-on-8-bytes"])
def test_cuda_fp32_patches_are_the_same_bytes_for_either_store_width(
    rng: np.random.Generator, skew: int
) -> None:
    # a 16-byte store off 16 bytes faults: on 8 bytes the kernels must write pairs
    from kernel_cases import case, differing, kernels_into, reference

    items = case("plain_and_mma", rng)
    want_pv, _ = reference(items, torch.float32)
    got_pv = kernels_into(items, torch.float32, "cuda", skew)
    assert got_pv.data_ptr() % 16 == (0 if skew == 0 else 8)
    assert differing(got_pv, want_pv) == 0


def test_cuda_tensor_cores_equal_the_general_kernel_in_both_pass_orders(
    rng: np.random.Generator,
) -> None:
    # pinned to Pillow 13's pass order (the device may have an older Pillow, so the CPU path
    # cannot judge): the tall images pass vertically first, the others horizontally; the MMA
    # kernel must give the general kernel's bytes, which CI checks against Pillow 13
    from kernel_cases import differing
    from mmwire.kernels import FIELDS, CupyLauncher, layout_of, pack, preprocess_packed
    from mmwire.kernels._descriptors import ImageJob
    from mmwire.materialize import KimiConfig

    class NoTensorCores(CupyLauncher):
        @property
        def tensor_cores(self) -> bool:
            return False

    cfg = KimiConfig(in_patch_limit=1024)
    shapes = ((2400, 800, 3), (1800, 650, 1), (1000, 1500, 3), (777, 513, 3))
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in shapes]
    specs = [cfg(im.shape[1], im.shape[0]) for im in images]
    jobs = tuple(
        ImageJob(
            w,
            h,
            c,
            sp.plan.new_width,
            sp.plan.new_height,
            None,
            sp.plan.grid.w,
            sp.plan.grid.patches,
        )
        for (h, w, c), sp in zip(shapes, specs)
    )
    layout = layout_of(jobs, (13, 0), 14, tensor_cores=True)
    assert [int(r[FIELDS.index("PASS1")]) for r in layout.desc] == [2, 2, 1, 1]
    assert {kind for _, kind, _, _ in layout.tile_groups} == {"mma"}
    src, packed = pack([torch.from_numpy(im).cuda() for im in images])
    general = NoTensorCores(src.device)
    for dtype in (torch.float32, torch.bfloat16):
        got, _ = preprocess_packed(src, packed, specs, dtype, pillow=(13, 0))
        want, _ = preprocess_packed(src, packed, specs, dtype, pillow=(13, 0), launcher=general)
        assert differing(got, want) == 0


def test_cuda_launcher_opts_in_when_the_kernels_own_arrays_pass_48_kib(
    rng: np.random.Generator,
) -> None:
    # 48 KiB of dynamic shared memory plus the kernel's static arrays is more than a block
    # gets without opting in: the launcher must opt in although the dynamic part alone is
    # not over 48 KiB (it did not, and such a launch failed with CUDA_ERROR_INVALID_VALUE).
    # The general kernel: nothing else asks it for more than 40 KiB, so no earlier launch
    # of this process has opted in for it
    from kernel_cases import differing
    from mmwire.kernels import CupyLauncher, pack, preprocess_packed
    from mmwire.kernels._descriptors import Kind
    from mmwire.materialize import KimiConfig

    class GeneralAtTheLimit(CupyLauncher):
        tensor_cores = False  # type: ignore[assignment]

        def fused(
            self,
            bits: int,
            channels: int,
            kind: Kind,
            grid: Any,
            block: Any,
            smem: int,
            *rest: Any,
            **kw: Any,
        ) -> None:
            assert kind != "mma"
            more = 48 * 1024 if kind == "general" else smem  # the kernel uses what it needs
            super().fused(bits, channels, kind, grid, block, more, *rest, **kw)

    cfg = KimiConfig(in_patch_limit=1024)
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in ((700, 900, 3), (333, 517, 3))]
    specs = [cfg(im.shape[1], im.shape[0]) for im in images]
    src, packed = pack([torch.from_numpy(im).cuda() for im in images])
    want, _ = preprocess_packed(src, packed, specs, launcher=CupyLauncher(src.device))
    got, _ = preprocess_packed(src, packed, specs, launcher=GeneralAtTheLimit(src.device))
    assert differing(got, want) == 0


def test_cuda_overlapping_launches_end_before_the_streams_next_work(
    rng: np.random.Generator,
) -> None:
    # the gray plain launch may start while the (long) RGB mixed launch before it
    # finishes; what the stream runs next must still see every patch: read `out`, filled
    # with NaN first, on the GPU right after each call (a host copy would be too slow to
    # catch it). The order a caller relies on; the driver may keep it even without the
    # kernel's wait, so this guards the order, not that line
    from kernel_cases import differing
    from mmwire.kernels import pack, preprocess_packed
    from mmwire.materialize import KimiConfig, preprocess_images

    cfg = KimiConfig()
    shapes = ((3000, 4000, 3), (2000, 3000, 3), (480, 640, 3), (512, 512, 1))
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in shapes]
    specs = [cfg(im.shape[1], im.shape[0]) for im in images]
    src, packed = pack([torch.from_numpy(im).cuda() for im in images])
    for dtype in (torch.bfloat16, torch.float32):
        want, _ = preprocess_images(images, cfg, dtype=dtype)
        out = torch.empty(want.shape, dtype=dtype, device="cuda")
        for _ in range(5):
            out.fill_(float("nan"))
            preprocess_packed(src, packed, specs, dtype, out=out)
            assert not bool(torch.isnan(out).any())  # on the stream, right after the launches
        assert differing(out, want) == 0


@pytest.mark.parametrize("resizing", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_seed_case_4x1536x1024(rng: np.random.Generator, resizing: bool, dtype: str) -> None:
    from conftest import photo_path
    from kernel_cases import differing, kernels, reference
    from mmwire.materialize import KimiConfig
    from PIL import Image

    cfg = KimiConfig(in_patch_limit=6144) if resizing else KimiConfig()
    # np.array, not np.asarray: a read-only array makes torch.from_numpy warn (an error here)
    photo = np.array(Image.open(photo_path("astronaut.png")).convert("RGB").resize((1536, 1024)))
    images = [photo] + [rng.integers(0, 256, (1024, 1536, 3), dtype=np.uint8) for _ in range(3)]
    items = [(im, cfg) for im in images]
    want_pv, want_grid = reference(items, getattr(torch, dtype))
    got_pv, got_grid = kernels(items, getattr(torch, dtype), "cuda")
    assert torch.equal(got_grid.cpu(), want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("name", CASES)
def test_cuda_kernels_through_the_global_intermediate_equal_the_cpu_path(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    from kernel_cases import case, differing, kernels, reference
    from mmwire.kernels import _ops

    monkeypatch.setattr(_ops, "TILE_SMEM_BYTES", 0)  # no tile keeps its intermediate on chip
    items = case(name, rng)
    want_pv, want_grid = reference(items, torch.float16)
    got_pv, got_grid = kernels(items, torch.float16, "cuda")
    assert torch.equal(got_grid.cpu(), want_grid)
    assert differing(got_pv, want_pv) == 0


def test_cuda_kernels_on_large_downscales_and_mixed_orders(rng: np.random.Generator) -> None:
    # one call: 4000x3000 shrunk ~1.9x (4x2-patch tiles) and ~7.7x (its window does not
    # fit in shared memory even for one patch, so it takes pass 1), 3000x4000 RGBA ~5.5x
    # (one-patch tiles) and 6000x300 ~3x (2x1), 200x9000 (vertical first under Pillow 13),
    # 640x480 as it is; three channel counts, resized and not: four fused launches after
    # pass 1
    from kernel_cases import differing, kernels, reference
    from mmwire.kernels import FIELDS, ImageJob, layout_of
    from mmwire.materialize import KimiConfig

    default, small = KimiConfig(), KimiConfig(in_patch_limit=1024)
    big = KimiConfig(in_patch_limit=2048)
    shapes = (
        ((3000, 4000, 3), default),
        ((3000, 4000, 3), small),
        ((4000, 3000, 4), big),
        ((300, 6000, 3), small),
        ((9000, 200, 1), default),
        ((480, 640, 3), default),
    )
    items = [(rng.integers(0, 256, s, dtype=np.uint8), cfg) for s, cfg in shapes]
    jobs = []
    for im, cfg in items:
        plan = cfg(im.shape[1], im.shape[0]).plan
        h, w, c = im.shape
        jobs.append(
            ImageJob(w, h, c, plan.new_width, plan.new_height, None, plan.grid.w, plan.grid.patches)
        )
    desc = layout_of(tuple(jobs), None, 14).desc
    tiles = [tuple(int(r[FIELDS.index(f)]) for f in ("TILED", "TILE_PH", "TILE_PW")) for r in desc]
    assert tiles == [(1, 4, 2), (0, 1, 1), (1, 1, 1), (1, 2, 1), (1, 4, 4), (1, 4, 4)]
    want_pv, want_grid = reference(items, torch.bfloat16)
    got_pv, got_grid = kernels(items, torch.bfloat16, "cuda")
    assert torch.equal(got_grid.cpu(), want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize(
    ("shape", "size"),
    [
        ((48, 64, 3), (56, 42)),
        ((23, 17, 3), (90, 61)),
        ((40, 300, 4), (71, 40)),
        ((300, 40, 1), (40, 77)),
        ((500, 30, 3), (20, 170)),
        ((1024, 1536, 4), (1344, 896)),
        ((1, 1, 3), (5, 3)),
        ((7, 3000, 3), (1000, 2)),
    ],
)
def test_cuda_resize_equals_pillow(
    rng: np.random.Generator, shape: tuple[int, int, int], size: tuple[int, int]
) -> None:
    from mmwire.kernels import resize
    from PIL import Image

    img = rng.integers(0, 256, shape, dtype=np.uint8)
    if shape[2] == 4:
        img[::3, :, 3] = 0
        img[1::3, :, 3] = 255
    (got,) = resize([torch.from_numpy(img).cuda()], [size])
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[shape[2]]
    want = np.asarray(Image.fromarray(img[..., 0] if shape[2] == 1 else img, mode).resize(size))
    assert np.array_equal(got.cpu().numpy(), want.reshape(got.shape))


def test_cuda_kernels_take_cupy_arrays_and_run_on_the_current_stream(
    rng: np.random.Generator,
) -> None:
    import cupy
    from kernel_cases import SMALL, differing, reference
    from mmwire.kernels import preprocess

    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((150, 97), (61, 222))]
    specs = [SMALL(im.shape[1], im.shape[0]) for im in images]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        arrays = [cupy.asarray(im) for im in images]
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())  # type: ignore[no-untyped-call]
        pv, grids = preprocess(arrays, specs, torch.bfloat16)
    side.synchronize()  # type: ignore[no-untyped-call]
    want_pv, want_grid = reference([(im, SMALL) for im in images], torch.bfloat16)
    assert differing(pv, want_pv) == 0 and torch.equal(grids.cpu(), want_grid)


def test_preprocess_images_on_cuda_uses_the_kernels(rng: np.random.Generator) -> None:
    from mmwire.materialize import K3_BACKGROUND, KimiConfig, preprocess_images

    cfg = KimiConfig(in_patch_limit=100, background=K3_BACKGROUND)
    images = [rng.integers(0, 256, (h, w, 4), dtype=np.uint8) for h, w in ((210, 130), (99, 301))]
    got = preprocess_images(images, cfg, device="cuda", dtype=torch.float16, compute="cuda")
    want = preprocess_images(images, cfg, dtype=torch.float16)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_cuda_materializer_equals_the_cpu_one_over_a_registered_arena(
    rng: np.random.Generator,
) -> None:
    from mmwire.materialize import K3_BACKGROUND, KimiConfig, Materializer
    from mmwire.transport import IndexMap, LocalIndex

    cfg = KimiConfig(in_patch_limit=200, background=K3_BACKGROUND)
    images: list[Any] = [
        rng.integers(0, 256, (h, w, c), dtype=np.uint8)
        for h, w, c in ((300, 211, 3), (97, 350, 4), (64, 64, 1), (33, 17, 3))
    ]
    processed = torch.randn(8, 3, 14, 14)
    emb = torch.randn(5, 32)
    p = Producer(arena_size=64 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0])
        c.register_with_cuda()
        items = [Item(data=im, consumers=(0,), preprocess=cfg) for im in images]
        items.append(Item(data=processed, consumers=(0,), kind="processed", grid=Grid((1, 2, 4))))
        items.append(Item(data=emb, consumers=(0,), kind="embedding", grid=Grid((1, 5))))
        p.publish("m", items)
        order = [GlobalIndex(i) for i in (4, 2, 0, 5, 3, 1)]  # permuted, mixed kinds
        with c.recv(10) as b:
            m = IndexMap(0, order)
            cuda = Materializer(0, device="cuda", dtype=torch.bfloat16).materialize(b, m)
            cpu = Materializer(0, dtype=torch.bfloat16).materialize(b, m)
            assert torch.equal(cuda.features[LocalIndex(3)], emb)
        assert cuda.pixel_values.is_cuda
        assert torch.equal(cuda.pixel_values.cpu(), cpu.pixel_values)
        assert torch.equal(cuda.grid_thw.cpu(), cpu.grid_thw)
        for k in (0, 1, 2, 4, 5):
            assert torch.equal(cuda.features[LocalIndex(k)].cpu(), cpu.features[LocalIndex(k)])
    finally:
        c.close()
        p.close()


def test_cuda_materializer_errors_name_the_item_and_keep_serving(
    rng: np.random.Generator,
) -> None:
    import msgspec
    from mmwire.materialize import KimiConfig, Materializer
    from mmwire.transport import IndexMap, LocalIndex
    from mmwire.transport.errors import GridMismatch, MaterializeError
    from test_materialize import _Frames, _raw_batch

    cfg = KimiConfig()
    images = [
        rng.integers(0, 256, (40, 60, 3), dtype=np.uint8),
        rng.integers(0, 256, (33, 20, 3), dtype=np.uint8),
    ]
    good = _raw_batch(images, cfg, [(0,), (0,)])
    forged = msgspec.structs.replace(good.envelopes[GlobalIndex(1)])
    msgspec.structs.force_setattr(forged, "grid", Grid((1, 9, 9)))
    bad = _Frames(
        [good.envelopes[GlobalIndex(0)], forged], [images[0].tobytes(), images[1].tobytes()]
    )
    mat = Materializer(0, device="cuda", compute="cuda")
    m = IndexMap(0, [GlobalIndex(1), GlobalIndex(0)])
    with pytest.raises(GridMismatch, match=r"item 1 \(local slot 0\).*declared \[1, 9, 9\]"):
        mat.materialize(bad, m)
    with pytest.raises(MaterializeError, match="over the pixel ceiling 100"):
        Materializer(0, device="cuda", compute="cuda", max_pixels=100).materialize(good, m)
    out = mat.materialize(good, m)
    want = Materializer(0).materialize(good, m)
    assert torch.equal(out.features[LocalIndex(1)].cpu(), want.features[LocalIndex(1)])


# --- Qwen-VL rows (#45): the same kernels compiled for the merge-window layout -------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["qwen_distinct", "qwen_plain_and_mma", "qwen3", "glm"])
def test_cuda_kernels_write_qwen_rows_equal_to_the_cpu_path(
    rng: np.random.Generator, name: str, dtype: str
) -> None:
    from kernel_cases import case, differing, kernels, reference

    items = case(name, rng)
    want_pv, want_grid = reference(items, getattr(torch, dtype))
    got_pv, got_grid = kernels(items, getattr(torch, dtype), "cuda")
    assert torch.equal(got_grid.cpu(), want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "glm-4.1v"])
def test_cuda_qwen_photos_equal_transformers(family: str) -> None:
    # the checkpoint's own config over photos of every size class, straight against
    # transformers' Pillow processor (where the machine has it)
    from conftest import photo_path
    from mmwire.materialize import preprocess_images, spec_for
    from PIL import Image

    oracle = pytest.importorskip("oracle")  # imports transformers
    photos = [Image.open(photo_path(n)).convert("RGB") for n in ("astronaut.png", "coffee.png")]
    images = [*photos, photos[0].resize((4200, 3200)), photos[1].resize((1001, 377))]
    images.append(Image.fromarray(np.asarray(photos[1].convert("L").resize((90, 47)))))
    params = {**oracle.QWEN_PARAMS, **oracle.GLM_PARAMS}[family]
    for dtype in (torch.float32, torch.bfloat16):
        want = oracle.qwen_reference(images, params, dtype, family=family)
        got = preprocess_images(
            images, spec_for(family, params), device="cuda", dtype=dtype, compute="cuda"
        )
        assert torch.equal(got[1].cpu(), want[1])
        assert torch.equal(got[0].cpu().view(torch.int16), want[0].view(torch.int16))


def test_cuda_materializer_serves_qwen_items_over_a_registered_arena(
    rng: np.random.Generator,
) -> None:
    from mmwire.materialize import Materializer, QwenVLConfig
    from mmwire.transport import IndexMap

    qwen = QwenVLConfig(max_pixels=28 * 28 * 60)
    images: list[Any] = [
        rng.integers(0, 256, (h, w, c), dtype=np.uint8)
        for h, w, c in ((300, 211, 3), (97, 350, 4), (56, 84, 1), (33, 17, 3))
    ]
    p = Producer(arena_size=64 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0])
        c.register_with_cuda()
        p.publish("q", [Item(data=im, consumers=(0,), preprocess=qwen) for im in images])
        with c.recv(10) as b:
            m = IndexMap(0, [GlobalIndex(i) for i in (2, 0, 3, 1)])
            cuda = Materializer(0, device="cuda", dtype=torch.bfloat16, preprocess=[qwen])
            got = cuda.materialize(b, m)
            want = Materializer(0, dtype=torch.bfloat16).materialize(b, m)
        assert (
            got.pixel_values.shape == want.pixel_values.shape == (want.pixel_values.shape[0], 1176)
        )
        assert torch.equal(
            got.pixel_values.cpu().view(torch.int16), want.pixel_values.view(torch.int16)
        )
        assert torch.equal(got.grid_thw.cpu(), want.grid_thw)
    finally:
        c.close()
        p.close()


@pytest.mark.parametrize("family", ["gemma-3", "gemma-3-pan", "internvl3"])
def test_cuda_owner_kernels_compute_gemma_and_internvl_equal_to_transformers(
    rng: np.random.Generator, family: str
) -> None:
    # the kernels cut these families' regions (tiles and thumbnail; the image and its
    # pan-and-scan crops) out of one upload, with the same bytes as transformers' processor
    from mmwire.materialize import Materializer, preprocess_images, spec_for
    from mmwire.transport import IndexMap
    from PIL import Image

    oracle = pytest.importorskip("oracle")  # imports transformers
    if family.startswith("gemma-3"):
        params = {**oracle.GEMMA_PARAMS["gemma-3"], "do_pan_and_scan": family.endswith("pan")}
        reference = oracle.gemma_reference
    else:
        params, reference = oracle.INTERNVL_PARAMS[family], oracle.internvl_reference
    spec = spec_for(family.removesuffix("-pan"), params)
    images: list[Any] = [
        rng.integers(0, 256, (h, w, c), dtype=np.uint8)
        for h, w, c in ((300, 211, 3), (97, 350, 4), (56, 84, 1), (1033, 1700, 3))
    ]
    want, counts = reference([Image.fromarray(im.squeeze()) for im in images], params)
    got, grids = preprocess_images(images, spec, device="cuda")
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    rows = [n if family == "internvl3" else 1 + n for n in counts]  # gemma: crops
    assert grids.cpu().tolist() == [[n, 1, 1] for n in rows]
    p = Producer(arena_size=64 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0])
        c.register_with_cuda()
        p.publish("g", [Item(data=im, consumers=(0,), preprocess=spec) for im in images])
        with c.recv(10) as b:
            order = (2, 0, 3, 1)
            m = IndexMap(0, [GlobalIndex(i) for i in order])
            out = Materializer(0, device="cuda", preprocess=[spec]).materialize(b, m)
        starts = np.cumsum([0, *rows])
        expect = torch.cat([want[starts[i] : starts[i + 1]] for i in order])
        assert out.pixel_values.device.type == "cuda"
        assert torch.equal(out.pixel_values.cpu(), expect)
        assert out.grid_thw.cpu().tolist() == [[rows[i], 1, 1] for i in order]
    finally:
        c.close()
        p.close()


def test_cuda_materializer_decodes_encoded_items_into_pinned_memory() -> None:
    # encoded JPEG/PNG/WebP items, decoded on the owner's threads into one pinned buffer and
    # uploaded from it, beside a raw item from the registered arena: the CPU path's bytes
    from mmwire.materialize import K3_BACKGROUND, KimiConfig, Materializer
    from mmwire.transport import IndexMap
    from test_encoded import SAMPLES

    cfg = KimiConfig(in_patch_limit=300, background=K3_BACKGROUND)
    data: list[Any] = [SAMPLES[n]() for n in ("jpeg-420", "png-rgba", "webp-lossy", "gif")]
    data.append(np.zeros((40, 70, 3), np.uint8))  # raw
    p = Producer(arena_size=64 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0])
        c.register_with_cuda()
        p.publish("e", [Item(data=d, consumers=(0,), preprocess=cfg) for d in data])
        with c.recv(10) as b:
            assert [b.envelopes[GlobalIndex(i)].kind for i in range(5)] == ["encoded"] * 4 + ["raw"]
            m = IndexMap(0, [GlobalIndex(i) for i in (3, 4, 0, 2, 1)])
            got = Materializer(0, device="cuda", dtype=torch.bfloat16).materialize(b, m)
            want = Materializer(0, dtype=torch.bfloat16).materialize(b, m)
        assert torch.equal(got.pixel_values.cpu(), want.pixel_values)
        assert torch.equal(got.grid_thw.cpu(), want.grid_thw)
    finally:
        c.close()
        p.close()
