"""materialize: plan, grids, placeholders, deferral, owners, and exactness with ==."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from conftest import photo_path
from mmwire.kernels.reference import bicubic_coefficients, pass_order, resize_reference
from mmwire.materialize import (
    K3_BACKGROUND,
    KimiConfig,
    Materializer,
    OwnerAffinity,
    assign_owners,
    expand_placeholders,
    patches_per_item,
    plan_resize,
    preprocess_images,
    should_defer,
    split_by_tokens,
    tokens_per_item,
)
from mmwire.transport import (
    FeatureEnvelope,
    GlobalIndex,
    GlobalTable,
    Grid,
    IndexMap,
    LocalIndex,
    TensorSpec,
)
from mmwire.transport.errors import GridMismatch, MaterializeError
from mmwire.transport.wire import SCHEMA_VERSION, InlineRef, numpy_view, torch_view
from PIL import Image

# ---------------------------------------------------------------- plan, grids, owners


@pytest.mark.parametrize(
    ("w", "h", "limit", "new", "pad", "grid", "tokens"),
    [
        (1920, 1080, 16384, (1920, 1080), (12, 12), (78, 138), 2691),
        (1024, 1024, 16384, (1024, 1024), (12, 12), (74, 74), 1369),
        (1024, 1024, 65536, (1024, 1024), (12, 12), (74, 74), 1369),
        (4000, 3000, 16384, (2073, 1554), (27, 14), (112, 150), 4200),
        (4000, 3000, 65536, (4000, 3000), (4, 24), (216, 286), 15444),
        (1, 1, 16384, (1, 1), (27, 27), (2, 2), 1),
    ],
)
def test_plan_worked_examples(
    w: int,
    h: int,
    limit: int,
    new: tuple[int, int],
    pad: tuple[int, int],
    grid: tuple[int, int],
    tokens: int,
) -> None:
    p = plan_resize(w, h, in_patch_limit=limit)
    assert (p.new_width, p.new_height) == new
    assert (p.pad_width, p.pad_height) == pad
    assert p.grid == Grid((1, *grid))
    assert p.tokens == tokens


def test_plan_corners() -> None:
    assert plan_resize(4000, 3000).grid.patches == 16800  # padded count may exceed the limit
    tall = plan_resize(20, 100_000)
    assert tall.new_height <= 7168 and tall.new_width >= 1  # one side capped at L·p
    assert plan_resize(4000, 3000, fixed_output_tokens=7).tokens == 7
    assert plan_resize(4000, 3000, fixed_output_tokens=7).grid == plan_resize(4000, 3000).grid
    assert plan_resize(5, 9).grid == Grid((1, 2, 2))  # smaller than a patch: a 28x28 canvas


def test_grid_arithmetic() -> None:
    assert patches_per_item([[2, 12, 16], [40, 60]]) == [384, 2400]
    assert tokens_per_item([[2, 12, 16], [40, 60]]) == [48, 600]
    out = torch.arange(648).reshape(648, 1)
    a, b = split_by_tokens(out, [Grid((2, 12, 16)), Grid((40, 60))])
    assert a.shape[0] == 48 and b[0, 0] == 48
    with pytest.raises(ValueError, match="need 648 tokens"):
        split_by_tokens(out[:10], [Grid((2, 12, 16)), Grid((40, 60))])


def test_placeholders() -> None:
    assert expand_placeholders([1, 7, 2, 7, 3], 7, [3, 2]).tolist() == [1, 7, 7, 7, 2, 7, 7, 3]
    with pytest.raises(MaterializeError, match="2 placeholders `7` but 3 images"):
        expand_placeholders([1, 7, 2, 7, 3], 7, [3, 2, 1])


def test_should_defer_cases() -> None:
    small = torch.zeros((3, 32, 32), dtype=torch.uint8)
    big = torch.zeros((3, 1024, 1024), dtype=torch.uint8)
    k3 = KimiConfig(in_patch_limit=65536)
    assert should_defer([small], transport="cpu", consumer_has_gpu=True, preprocess=k3)
    tiny = KimiConfig(in_patch_limit=1)
    assert not should_defer([big], transport="cpu", consumer_has_gpu=True, preprocess=tiny)
    assert not should_defer([small.float()], transport="cpu", consumer_has_gpu=True)
    assert not should_defer([], transport="cpu", consumer_has_gpu=True)
    assert not should_defer([small], transport="cuda_ipc", consumer_has_gpu=True)
    assert not should_defer([small], transport="cpu", consumer_has_gpu=False)
    assert should_defer([Image.new("RGBA", (40, 30))], transport="cpu", consumer_has_gpu=True)


def test_assign_owners_reference_example_and_determinism() -> None:
    maps = assign_owners([1000, 100, 200, 50], 2)
    assert maps[0].globals == (GlobalIndex(0),)
    assert maps[1].globals == (GlobalIndex(2), GlobalIndex(1), GlobalIndex(3))
    assert assign_owners([5, 5, 5], 2) == assign_owners([5, 5, 5], 2)
    assert [m.globals for m in assign_owners([5, 5, 5], 2)] == [
        (GlobalIndex(0), GlobalIndex(2)),
        (GlobalIndex(1),),
    ]


def test_owners_balance_around_the_work_ranks_already_have() -> None:
    # one-image requests, assigned one at a time, spread over the ranks with their loads
    assert assign_owners([5], 3, loads=[10, 0, 3])[1].globals == (GlobalIndex(0),)
    maps = assign_owners([7, 6, 5], 2, loads=[0, 12])
    assert [m.globals for m in maps] == [(GlobalIndex(0), GlobalIndex(1)), (GlobalIndex(2),)]
    with pytest.raises(ValueError, match="1 loads for 2 ranks"):
        assign_owners([1], 2, loads=[0])


def test_preferred_owners_go_first_and_the_rest_balance_around_them() -> None:
    maps = assign_owners([1000, 100, 200, 50], 2, preferred=[None, 0, None, 0])
    # 1 and 3 where their cache is; then LPT: 1000 to the lighter rank, 200 to rank 0
    assert maps[0].globals == (GlobalIndex(1), GlobalIndex(3), GlobalIndex(2))
    assert maps[1].globals == (GlobalIndex(0),)
    both = assign_owners([1000, 100, 200, 50], 2, preferred=[None, 0, None, 0])
    assert [m.globals for m in both] == [m.globals for m in maps]
    assert assign_owners([3, 4], 2, preferred=[None, None]) == assign_owners([3, 4], 2)
    assert assign_owners([3, 4], 2, preferred=[7, -1]) == assign_owners([3, 4], 2)  # gone
    with pytest.raises(ValueError, match="2 preferred ranks for 3 items"):
        assign_owners([1, 2, 3], 2, preferred=[0, 1])
    affinity = OwnerAffinity(capacity=2)
    assert affinity.preferred(["a", "b"]) == [None, None]
    affinity.remember(["a", "b"], [1, 0])
    affinity.remember(["c"], [1])  # over capacity: "a" was the least recently used
    assert affinity.preferred(["a", "b", "c"]) == [None, 0, 1]
    affinity.forget_rank(1)
    assert affinity.preferred(["b", "c"]) == [0, None]


# ---------------------------------------------------------------- Pillow exactness


def _pil(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:  # type: ignore[type-arg]
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[arr.shape[2]]
    im = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr, mode)
    out = np.asarray(im.resize(size, Image.Resampling.BICUBIC))
    return out[:, :, None] if out.ndim == 2 else out


def test_golden_values() -> None:
    a = (np.arange(8 * 6 * 3).reshape(6, 8, 3) * 37 % 256).astype(np.uint8)
    assert resize_reference(a, 3, 4)[:, :, 0].tolist() == [
        [122, 135, 81],
        [167, 115, 122],
        [150, 103, 97],
        [137, 95, 151],
    ]
    assert resize_reference(a, 13, 9)[0, :, 0].tolist() == [
        0,
        28,
        107,
        208,
        201,
        77,
        134,
        189,
        65,
        70,
        163,
        68,
        0,
    ]


def test_coefficient_vectors() -> None:
    c = bicubic_coefficients(1536, 1344)
    assert c.k[0, :3].tolist() == [3739072, 581941, -126709]
    assert c.k[2, :4].tolist() == [-226417, 2932708, 1741226, -253212]
    assert (c.xmin[-1], c.n[-1]) == (1533, 3)
    assert bicubic_coefficients(3, 8).k[0, :2].tolist() == [4619925, -425621]


def _pillow_coefficients_loop(
    in_size: int, out_size: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """Pillow's ``precompute_coeffs`` and ``normalize_coeffs_8bpc`` transcribed output by
    output, tap by tap, in Python floats (IEEE double, as the C code)."""

    def cubic(x: float) -> float:
        a = -0.5
        x = abs(x)
        if x < 1.0:
            return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        if x < 2.0:
            return (((x - 5.0) * x + 8.0) * x - 4.0) * a
        return 0.0

    scale = float(np.float32(in_size)) / out_size  # Pillow's box is float32
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    xmins, counts, rows = [], [], []
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        lo = max(0, int(center - support + 0.5))
        hi = min(in_size, int(center + support + 0.5))
        w = [cubic((x + lo - center + 0.5) * (1.0 / filterscale)) for x in range(hi - lo)]
        total = 0.0
        for v in w:
            total += v
        if total != 0.0:
            w = [v / total for v in w]
        rows.append([int(v * (1 << 22) - 0.5) if v < 0 else int(v * (1 << 22) + 0.5) for v in w])
        xmins.append(lo)
        counts.append(hi - lo)
    return xmins, counts, rows


def test_vectorised_coefficients_equal_pillows_loop(rng: np.random.Generator) -> None:
    # bicubic_coefficients computes all outputs at once; the bytes must be the loop's
    pairs = [(1, 1), (1, 5), (5, 1), (2, 1), (3, 8), (7, 3), (30, 56), (97, 1000), (1000, 17)]
    pairs += [(4000, 2073), (3000, 1460), (1536, 1344), (65535, 3), (5, 4096)]
    pairs += [(int(a), int(b)) for a, b in rng.integers(1, 3000, (60, 2))]
    for in_size, out_size in pairs:
        c = bicubic_coefficients(in_size, out_size)
        xmins, counts, rows = _pillow_coefficients_loop(in_size, out_size)
        assert c.xmin.tolist() == xmins and c.n.tolist() == counts, (in_size, out_size)
        for o, row in enumerate(rows):
            assert c.k[o, : len(row)].tolist() == row, (in_size, out_size, o)
            assert not c.k[o, len(row) :].any()


def test_pass_order_rules() -> None:
    assert pass_order(1536, 1024, 1344, 896, (13, 0)) == "h_first"
    assert pass_order(1536, 1024, 1400, 600, (13, 0)) == "v_first"
    assert pass_order(97, 53, 1000, 17, (13, 0)) == "v_first"
    assert pass_order(1536, 1024, 1400, 600, (12, 1)) == "h_first"
    assert pass_order(10, 1500, 10, 700, (12, 3)) == "v_first"


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((97, 53), (41, 17)),
        ((60, 45), (59, 44)),
        ((120, 90), (29, 21)),
        ((97, 53), (1000, 17)),
        ((153, 102), (140, 60)),
        ((5, 3), (2, 1)),
        ((1, 1), (3, 2)),
        ((300, 7), (40, 7)),
    ],
)
def test_reference_resize_equals_pillow(
    channels: int, src: tuple[int, int], dst: tuple[int, int], rng: np.random.Generator
) -> None:
    img = rng.integers(0, 256, (src[1], src[0], channels), dtype=np.uint8)
    if channels == 4:
        img[::3, :, 3] = 0
        img[1::5, :, 3] = 255
    assert np.array_equal(resize_reference(img, *dst), _pil(img, dst))


def test_reference_resize_on_a_photo() -> None:
    photo = np.asarray(Image.open(photo_path("chelsea.png")).convert("RGB"))
    for size in ((400, 266), (200, 120), (112, 75)):
        assert np.array_equal(resize_reference(photo, *size), _pil(photo, size))


# ---------------------------------------------------------------- the pipeline, ==


def _obvious(
    images: list[Any], cfg: KimiConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most obvious code: PIL resize -> composite -> np.pad -> float64 -> cast -> patchify."""
    outs, grids = [], []
    p = cfg.patch_size
    for im in images:
        if not isinstance(im, Image.Image):
            arr = np.asarray(im)
            im = Image.fromarray(arr if arr.ndim == 2 or arr.shape[2] > 1 else arr[:, :, 0])
        alpha = im.mode != "RGB" and ("A" in im.getbands() or "transparency" in im.info)
        im = im.convert("RGBA" if alpha else "RGB")
        plan = plan_resize(
            im.width,
            im.height,
            patch_size=p,
            merge_kernel_size=cfg.merge_kernel_size,
            in_patch_limit=cfg.in_patch_limit,
        )
        if im.size != (plan.new_width, plan.new_height):
            im = im.resize((plan.new_width, plan.new_height), Image.Resampling.BICUBIC)
        arr = np.asarray(im)
        if alpha:
            rgb = arr[:, :, :3]
            if cfg.background is not None:
                bg = cfg.background
                ys, xs = np.mgrid[: arr.shape[0], : arr.shape[1]]
                white = ((ys // bg.square + xs // bg.square) % 2 == 0) == bg.top_left_white
                fill = np.where(white, bg.white, bg.gray).astype(np.float32)[:, :, None]
                a = np.clip(arr[:, :, 3:].astype(np.float32) / np.float32(255), 0, 1)
                rgb = np.floor(np.clip(a * rgb.astype(np.float32) + (1 - a) * fill, 0, 255)).astype(
                    np.uint8
                )
            arr = rgb
        arr = np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))
        x = (arr.astype(np.float64) / 255.0 - np.array(cfg.image_mean)) / np.array(cfg.image_std)
        t = torch.from_numpy(x).permute(2, 0, 1).to(dtype)
        gh, gw = t.shape[1] // p, t.shape[2] // p
        outs.append(t.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p))
        grids.append([1, gh, gw])
    return torch.cat(outs), torch.tensor(grids)


def _big_photo(name: str, size: tuple[int, int]) -> Image.Image:
    return Image.open(photo_path(name)).convert("RGB").resize(size, Image.Resampling.BICUBIC)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipeline_equals_obvious_reference_on_resized_photos(dtype: torch.dtype) -> None:
    cfg = KimiConfig(in_patch_limit=2048)  # forces real downscales of big photos
    images = [
        _big_photo("coffee.png", (3000, 2000)),
        _big_photo("chelsea.png", (1203, 801)),
        _big_photo("astronaut.png", (700, 699)),
        _big_photo("coffee.png", (2903, 517)),
    ]
    pv, grids = preprocess_images(images, cfg, dtype=dtype)
    ref_pv, ref_grids = _obvious(images, cfg, dtype)
    assert torch.equal(grids, ref_grids)
    assert pv.dtype == dtype and torch.equal(pv, ref_pv)


def test_pipeline_downscale_factors_from_just_below_one_to_below_a_quarter() -> None:
    photo = _big_photo("astronaut.png", (1400, 1400))
    for limit in (9800, 6000, 2500, 600, 300):  # scale ~0.99 ... ~0.17
        cfg = KimiConfig(in_patch_limit=limit)
        pv, _ = preprocess_images([photo], cfg)
        ref, _ = _obvious([photo], cfg, torch.float32)
        assert torch.equal(pv, ref), limit


def test_pipeline_modes_rgba_chessboard_l_p_and_tiny(rng: np.random.Generator) -> None:
    cfg = KimiConfig(in_patch_limit=200, background=K3_BACKGROUND)
    rgba = rng.integers(0, 256, (301, 203, 4), dtype=np.uint8)
    rgba[:50, :, 3] = 0
    rgba[50:90, :, 3] = 255
    p_img = Image.fromarray(rng.integers(0, 256, (77, 311, 3), dtype=np.uint8)).convert("P")
    p_alpha = p_img.copy()
    p_alpha.info["transparency"] = 3
    images = [
        Image.fromarray(rgba, "RGBA"),
        Image.fromarray(rng.integers(0, 256, (120, 333), dtype=np.uint8), "L"),
        p_img,
        p_alpha,
        Image.new("RGB", (1, 1), (9, 200, 31)),
        Image.fromarray(rgba[:13, :9], "RGBA"),
    ]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pv, grids = preprocess_images(images, cfg, dtype=dtype)
        ref, ref_grids = _obvious(images, cfg, dtype)
        assert torch.equal(grids, ref_grids) and torch.equal(pv, ref)
    no_bg = KimiConfig(in_patch_limit=200)
    assert torch.equal(
        preprocess_images(images[:1], no_bg)[0], _obvious(images[:1], no_bg, torch.float32)[0]
    )


def test_pipeline_takes_uint8_tensors_chw_and_hw(rng: np.random.Generator) -> None:
    hwc = rng.integers(0, 256, (45, 67, 3), dtype=np.uint8)
    chw = torch.from_numpy(hwc).permute(2, 0, 1).contiguous()
    gray = torch.from_numpy(hwc[:, :, 0].copy())
    a, _ = preprocess_images([chw, gray])
    b, _ = preprocess_images([Image.fromarray(hwc), Image.fromarray(hwc[:, :, 0], "L")])
    assert torch.equal(a, b)


def test_pipeline_rejects_bad_inputs() -> None:
    with pytest.raises(MaterializeError, match=r"uint8, got a torch\.float32"):
        preprocess_images([torch.zeros((3, 8, 8))])
    with pytest.raises(MaterializeError, match="mode `I;16` is not supported"):
        preprocess_images([Image.new("I;16", (8, 8))])
    with pytest.raises(MaterializeError, match="over the pixel ceiling 100"):
        preprocess_images([Image.new("RGB", (20, 20))], KimiConfig(max_pixels=100))


# ---------------------------------------------------------------- the materializer


class _Frames:
    """A batch's envelopes with inline payloads: a real PayloadSource without a socket."""

    def __init__(self, envelopes: list[FeatureEnvelope], payloads: list[Any]) -> None:
        self.envelopes = GlobalTable(envelopes)
        self._payloads = payloads

    def open(self, index: GlobalIndex) -> np.ndarray:  # type: ignore[type-arg]
        env = self.envelopes[index]
        return numpy_view(env.tensor, self._payloads[index.value])

    def open_tensor(self, index: GlobalIndex) -> torch.Tensor:
        env = self.envelopes[index]
        return torch_view(env.tensor, self._payloads[index.value])


def _raw_batch(images: list[np.ndarray], cfg: KimiConfig, owners: list[tuple[int, ...]]) -> _Frames:  # type: ignore[type-arg]
    envs = []
    for i, img in enumerate(images):
        spec = cfg(img.shape[1], img.shape[0])
        envs.append(
            FeatureEnvelope(
                version=SCHEMA_VERSION,
                request_id="r",
                index=GlobalIndex(i),
                modality="image",
                kind="raw",
                grid=spec.plan.grid,
                tensor=TensorSpec(dtype="uint8", shape=img.shape, nbytes=img.nbytes),
                payload=InlineRef(frame=i),
                consumers=owners[i],
                preprocess=spec,
            )
        )
    return _Frames(envs, [img.tobytes() for img in images])


@pytest.mark.parametrize("ranks", [2, 3])
def test_owner_side_union_equals_whole_batch(ranks: int, rng: np.random.Generator) -> None:
    cfg = KimiConfig(in_patch_limit=300)
    sizes = [(90, 130), (200, 61), (33, 47), (150, 151), (64, 300)]
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    plans = [cfg(img.shape[1], img.shape[0]) for img in images]
    maps = assign_owners([s.plan.grid.patches for s in plans], ranks)
    assert any(list(m.globals) != sorted(m.globals) for m in maps), "want a permuted assignment"
    owners = [next((m.rank,) for m in maps if m.owns(GlobalIndex(i))) for i in range(len(images))]
    batch = _raw_batch(images, cfg, owners)
    whole, whole_grids = preprocess_images(images, cfg)
    rows = np.cumsum([0, *[s.plan.grid.patches for s in plans]])
    gathered: dict[int, torch.Tensor] = {}
    for m in maps:
        out = Materializer(m.rank).materialize(batch, m)
        for local, g in m.items():
            gathered[g.value] = out.features[local]
            assert torch.equal(out.grid_thw[local.value], whole_grids[g.value])
    for i in range(len(images)):
        assert torch.equal(gathered[i], whole[rows[i] : rows[i + 1]])


def test_mixed_raw_processed_embedding_batch_keeps_order(rng: np.random.Generator) -> None:
    cfg = KimiConfig()
    img = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    raw = _raw_batch([img], cfg, [(0,)])
    processed, _ = preprocess_images([rng.integers(0, 256, (30, 30, 3), dtype=np.uint8)])
    emb = torch.randn(7, 16)
    penv = FeatureEnvelope(
        version=SCHEMA_VERSION,
        request_id="r",
        index=GlobalIndex(1),
        modality="image",
        kind="processed",
        grid=Grid((1, 4, 4)),
        tensor=TensorSpec(
            dtype="float32", shape=tuple(processed.shape), nbytes=processed.numel() * 4
        ),
        payload=InlineRef(frame=1),
        consumers=(0,),
    )
    eenv = FeatureEnvelope(
        version=SCHEMA_VERSION,
        request_id="r",
        index=GlobalIndex(2),
        modality="image",
        kind="embedding",
        grid=Grid((1, 2, 14)),
        tensor=TensorSpec(dtype="float32", shape=(7, 16), nbytes=7 * 16 * 4),
        payload=InlineRef(frame=2),
        consumers=(0,),
    )
    batch = _Frames(
        [raw.envelopes[GlobalIndex(0)], penv, eenv],
        [img.tobytes(), processed.numpy().tobytes(), emb.numpy().tobytes()],
    )
    m = IndexMap(0, [GlobalIndex(2), GlobalIndex(0), GlobalIndex(1)])
    out = Materializer(0).materialize(batch, m)
    assert torch.equal(out.features[LocalIndex(0)], emb)
    assert torch.equal(out.features[LocalIndex(1)], preprocess_images([img])[0])
    assert torch.equal(out.features[LocalIndex(2)], processed)
    assert out.pixel_values.shape[0] == 24 + 16
    assert out.grid_thw.tolist() == [[1, 4, 6], [1, 4, 4]]


def test_materializer_errors_name_the_item_and_keep_serving(rng: np.random.Generator) -> None:
    cfg = KimiConfig()
    images = [
        rng.integers(0, 256, (40, 60, 3), dtype=np.uint8),
        rng.integers(0, 256, (33, 20, 3), dtype=np.uint8),
    ]
    good = _raw_batch(images, cfg, [(0,), (0,)])
    env1 = good.envelopes[GlobalIndex(1)]
    forged = msgspec.structs.replace(env1)
    msgspec.structs.force_setattr(forged, "grid", Grid((1, 9, 9)))  # a producer bypassing checks
    bad = _Frames(
        [good.envelopes[GlobalIndex(0)], forged], [images[0].tobytes(), images[1].tobytes()]
    )
    mat = Materializer(0)
    m = IndexMap(0, [GlobalIndex(1), GlobalIndex(0)])
    with pytest.raises(
        GridMismatch,
        match=r"item 1 \(local slot 0\).*produces grid \[1, 4, 2\].*declared \[1, 9, 9\]",
    ):
        mat.materialize(bad, m)
    with pytest.raises(MaterializeError, match="over the pixel ceiling 100"):
        Materializer(0, max_pixels=100).materialize(good, m)
    with pytest.raises(MaterializeError, match="IndexMap is for rank 1"):
        mat.materialize(good, IndexMap(1, [GlobalIndex(0)]))
    out = mat.materialize(good, m)  # the same materializer keeps serving
    assert torch.equal(out.features[LocalIndex(1)], preprocess_images([images[0]])[0])


def test_materializer_backend_is_chosen_and_refused_clearly() -> None:
    assert Materializer(0).compute == "cpu"
    assert Materializer(0, compute="cpu").compute == "cpu"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Materializer(0, compute="cuda")
    with pytest.raises(ValueError, match="'auto', 'cpu' or 'cuda'"):
        Materializer(0, compute="tpu")  # type: ignore[arg-type]
