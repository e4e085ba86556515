"""The Qwen-VL families against transformers' own Pillow-backend processor, with ``==``.

The oracle is ``Qwen2VLImageProcessorPil`` (``tests/oracle.py``), run on the same images
with each checkpoint's published ``preprocessor_config.json``; mmwire's CPU path must give
the same ``pixel_values`` (fp32 and bf16, every bit) and ``image_grid_thw``. The kernels'
host build is held to the CPU path in ``test_kernels_host.py`` (and on the GPU in
``test_gpu.py``); owners in other processes here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import procs
import pytest
import torch
from conftest import photo_path
from mmwire.materialize import (
    FAMILIES,
    KimiConfig,
    Materializer,
    QwenVLConfig,
    assign_owners,
    expand_placeholders,
    preprocess_images,
    should_defer,
    smart_resize,
    spec_for,
)
from mmwire.transport import FeatureEnvelope, GlobalIndex, Item, Producer, TensorSpec
from mmwire.transport.errors import (
    ConfigurationError,
    DimensionError,
    GridMismatch,
    MalformedEnvelope,
    MaterializeError,
)
from mmwire.transport.images import image_size, to_pixels
from mmwire.transport.wire import SCHEMA_VERSION, InlineRef
from oracle import GLM_PARAMS, QWEN_PARAMS, Qwen2VLImageProcessorPil, qwen_reference
from PIL import Image

QWEN = tuple(QWEN_PARAMS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _assert_exact(
    images: list[Any], family: str, params: dict[str, Any], dtype: torch.dtype
) -> None:
    want_pv, want_grid = qwen_reference(images, params, dtype, family=family)
    got_pv, got_grid = preprocess_images(images, spec_for(family, params), dtype=dtype)
    assert torch.equal(got_grid, want_grid)
    assert got_pv.shape == want_pv.shape and got_pv.dtype == want_pv.dtype
    assert int((_bits(got_pv) != _bits(want_pv)).sum()) == 0


def _modes(rng: np.random.Generator) -> list[Image.Image]:
    """RGB, L, RGBA (alpha 0, 255 and partial), P, P with a transparent index, LA, RGB with a
    transparent colour, and 1-bit: every size distinct, odd ones among them."""

    def rgb(h: int, w: int) -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    rgba = rng.integers(0, 256, (67, 45, 4), dtype=np.uint8)
    rgba[::3, :, 3] = 0
    rgba[1::3, :, 3] = 255
    p_transparent = rgb(33, 71).quantize(16)
    p_transparent.info["transparency"] = 3
    rgb_keyed = rgb(40, 52)
    px = np.asarray(rgb_keyed).copy()
    px[:10] = (10, 20, 30)
    rgb_keyed = Image.fromarray(px)
    rgb_keyed.info["transparency"] = (10, 20, 30)
    return [
        rgb(131, 97),
        Image.fromarray(rng.integers(0, 256, (59, 83), dtype=np.uint8), "L"),
        Image.fromarray(rgba, "RGBA"),
        rgb(90, 61).quantize(64),
        p_transparent,
        Image.fromarray(rng.integers(0, 256, (29, 113, 2), dtype=np.uint8), "LA"),
        rgb_keyed,
        Image.fromarray(rng.integers(0, 2, (37, 23), dtype=np.uint8) * 255).convert("1"),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", QWEN)
def test_every_mode_and_size_equals_transformers(
    rng: np.random.Generator, family: str, dtype: torch.dtype
) -> None:
    images: list[Any] = _modes(rng)
    images += [Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8))]  # min_pixels
    images += [rng.integers(0, 256, (45, 77, 4), dtype=np.uint8)]  # an RGBA array
    images += [rng.integers(0, 256, (3, 50, 38), dtype=np.uint8)]  # CHW
    _assert_exact(images, family, QWEN_PARAMS[family], dtype)


@pytest.mark.parametrize("family", QWEN)
def test_photos_at_the_checkpoint_limits_equal_transformers(family: str) -> None:
    # the bench photos as they are (resized by rounding to the factor), one at 13 MP (past
    # Qwen2's max_pixels, within Qwen3's) and shrunk ones; then a small max_pixels, so the
    # max branch runs for every image
    photos = [Image.open(photo_path(n)).convert("RGB") for n in ("astronaut.png", "coffee.png")]
    photos.append(photos[0].resize((4200, 3200)))
    images = [*photos, photos[0].resize((333, 517)), photos[1].convert("L").resize((90, 47))]
    _assert_exact(images, family, QWEN_PARAMS[family], torch.bfloat16)
    small = {**QWEN_PARAMS[family], "max_pixels": 28 * 28 * 50, "min_pixels": 28 * 28 * 2}
    small.pop("size", None)
    _assert_exact(images, family, small, torch.float32)


@pytest.mark.parametrize(
    ("size", "params"),
    [
        ((28 * 10, 28 * 8), {"max_pixels": 28 * 28 * 80}),  # area exactly max_pixels: kept
        ((28 * 10 + 1, 28 * 8), {"max_pixels": 28 * 28 * 80}),  # rounds back to it
        ((28 * 10 + 14, 28 * 8), {"max_pixels": 28 * 28 * 80}),  # half: round to even (10)
        ((28 * 11 + 14, 28 * 8), {"max_pixels": 28 * 28 * 80}),  # half: to 12, past max
        ((28 * 10, 28 * 8), {"max_pixels": 28 * 28 * 80 - 1}),  # just past max: shrinks
        ((56, 56), {"min_pixels": 56 * 56}),  # exactly min_pixels: kept
        ((56, 55), {"min_pixels": 56 * 56}),  # rounds up to it
        ((55, 41), {"min_pixels": 56 * 56}),  # under it: grows
        ((2, 400), {}),  # aspect ratio exactly 200: allowed
        ((400, 2), {}),
    ],
)
def test_sizes_at_and_just_past_each_limit_equal_transformers(
    rng: np.random.Generator, size: tuple[int, int], params: dict[str, int]
) -> None:
    w, h = size
    image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    full = {**QWEN_PARAMS["qwen2.5-vl"], **params}
    _assert_exact([image], "qwen2.5-vl", full, torch.float32)


@pytest.mark.parametrize("size", [(13, 9999), (9999, 13), (2, 401)])
def test_an_aspect_ratio_past_200_is_refused_as_transformers_refuses_it(
    size: tuple[int, int],
) -> None:
    w, h = size
    image = Image.new("RGB", (w, h))
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        qwen_reference([image], QWEN_PARAMS["qwen2-vl"])
    with pytest.raises(MaterializeError, match="aspect ratio must be smaller than 200"):
        preprocess_images([image], spec_for("qwen2-vl"))
    assert not should_defer(
        [image], transport="cpu", consumer_has_gpu=True, preprocess=FAMILIES["qwen2-vl"]
    )
    with pytest.raises(MaterializeError):
        smart_resize(h, w, factor=28, min_pixels=1, max_pixels=1 << 30)


def test_grid_and_token_counts_are_transformers_counts() -> None:
    # vLLM sizes placeholders with get_number_of_image_patches; tokens are patches / m²
    for family, params in QWEN_PARAMS.items():
        spec = spec_for(family, params)
        kwargs = {
            k: v for k, v in params.items() if k not in ("image_processor_type", "processor_class")
        }
        ref = Qwen2VLImageProcessorPil(**kwargs)
        for w, h in ((1, 1), (640, 480), (4000, 3000), (13, 2000), (8000, 8000)):
            patches = ref.get_number_of_image_patches(h, w)
            assert spec.plan(w, h).grid.patches == patches, (family, w, h)
            assert spec.tokens(w, h) == patches // 4
    ids = expand_placeholders([5, 9, 6], 9, [FAMILIES["qwen3-vl"].tokens(640, 480)])
    assert len(ids) == 2 + 300  # 640x480 -> 640x480 at factor 32: 20 x 15 merged tokens


def test_spec_for_reads_a_checkpoint_config_as_transformers_does() -> None:
    q3 = spec_for("qwen3-vl", QWEN_PARAMS["qwen3-vl"])
    assert (q3.patch_size, q3.min_pixels, q3.max_pixels) == (16, 65536, 16777216)
    assert q3.image_mean == (0.5, 0.5, 0.5) and q3.row_shape == (1536,)
    # top-level min/max_pixels win over `size`, as in the processor's __init__
    mixed = {"size": {"shortest_edge": 100, "longest_edge": 200_000}, "max_pixels": 300_000}
    ref = Qwen2VLImageProcessorPil(**mixed)
    got = spec_for("qwen2-vl", mixed)
    assert (got.min_pixels, got.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)
    assert spec_for("qwen2.5-vl", {"do_resize": True, "resample": 3}) == FAMILIES["qwen2.5-vl"]
    # a processor's own to_dict() reads back as the same spec
    loaded = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056).to_dict()
    assert spec_for("qwen2.5-vl", loaded) == FAMILIES["qwen2.5-vl"]
    k3 = spec_for("kimi-k3", {"merge_kernel_size": [2, 2], "image_mean": [0.5, 0.5, 0.5]})
    assert k3 == FAMILIES["kimi-k3"] and k3.in_patch_limit == 65536
    assert spec_for("kimi-k2.5") == KimiConfig()


@pytest.mark.parametrize(
    ("family", "params", "match"),
    [
        ("qwen4-vl", {}, "unknown family"),
        ("qwen2-vl", {"resample": 2}, "BICUBIC"),
        ("qwen2-vl", {"do_normalize": False}, "every step"),
        ("qwen2-vl", {"crop_size": 224}, "not read by this family"),
        ("qwen2-vl", {"size": {"height": 224, "width": 224}}, "shortest_edge"),
        ("qwen2-vl", {"min_pixels": 10, "max_pixels": 5}, "min_pixels <= max_pixels"),
        ("qwen2-vl", {"image_mean": [0.5, 0.5]}, "bad processor parameters"),
        ("kimi-k2.5", {"merge_kernel_size": [2, 3]}, "square merge kernel"),
        ("kimi-k2.5", {"max_pixels": 4}, "not read by this family"),
    ],
)
def test_spec_for_refuses_what_it_cannot_reproduce(
    family: str, params: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        spec_for(family, params)


def test_alpha_rules_differ_by_family(rng: np.random.Generator) -> None:
    rgba = Image.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8), "RGBA")
    assert to_pixels(rgba).shape == (20, 30, 4)  # Kimi: kept for the owner
    white = to_pixels(rgba, alpha="white")  # Qwen: over white, as Pillow's alpha_composite
    canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    assert np.array_equal(white, np.asarray(Image.alpha_composite(canvas, rgba).convert("RGB")))
    assert image_size(rgba) == (30, 20)
    qwen = FAMILIES["qwen2.5-vl"]
    # the gate counts what would ship: 3 channels for Qwen's RGBA, 4 for Kimi's
    big_rgba = Image.new("RGBA", (56 * 20, 56 * 20))
    kimi = KimiConfig(in_patch_limit=400)
    assert should_defer([big_rgba], transport="cpu", consumer_has_gpu=True, preprocess=qwen)
    assert not should_defer([big_rgba], transport="cpu", consumer_has_gpu=True, preprocess=kimi)


def _qwen_envelope(img: np.ndarray[Any, Any], spec: Any, **changes: Any) -> FeatureEnvelope:
    fields = {
        "version": SCHEMA_VERSION,
        "request_id": "r",
        "index": GlobalIndex(0),
        "modality": "image",
        "kind": "raw",
        "grid": spec.plan.grid,
        "tensor": TensorSpec(dtype="uint8", shape=img.shape, nbytes=img.nbytes),
        "payload": InlineRef(frame=0),
        "consumers": (0,),
        "preprocess": spec,
    }
    return FeatureEnvelope(**{**fields, **changes})


def test_envelopes_refuse_what_a_qwen_owner_cannot_run() -> None:
    qwen = QwenVLConfig(max_pixels=28 * 28 * 20)
    spec = qwen(90, 60)
    assert spec.processor == "qwen2_vl" and spec.plan.pad_width == 0
    with pytest.raises(DimensionError, match="composites transparency over white"):
        _qwen_envelope(np.zeros((60, 90, 4), np.uint8), spec)
    import msgspec

    with pytest.raises(MalformedEnvelope, match="no `background`"):
        msgspec.structs.replace(spec, background=FAMILIES["kimi-k3"].background)
    with pytest.raises(DimensionError, match="min_pixels"):
        msgspec.structs.replace(spec, min_pixels=None)
    with pytest.raises(MalformedEnvelope, match="belong to the qwen2_vl and glm4v processors"):
        msgspec.structs.replace(spec, processor="kimi_vl")
    with pytest.raises(GridMismatch, match="without padding"):
        msgspec.structs.replace(spec, plan=KimiConfig()(90, 61).plan)


def test_owner_refuses_a_qwen_plan_other_than_its_limits_give(rng: np.random.Generator) -> None:
    import msgspec
    from test_materialize import _Frames

    img = rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)
    honest = QwenVLConfig(max_pixels=28 * 28 * 4)(90, 60)
    # the same plan claimed under a max_pixels that would give a larger one
    forged = msgspec.structs.replace(honest, max_pixels=28 * 28 * 400)
    batch = _Frames([_qwen_envelope(img, forged)], [img.tobytes()])
    [index_map] = assign_owners([honest.plan.grid.patches], 1)
    with pytest.raises(GridMismatch, match="not the one"):
        Materializer(0).materialize(batch, index_map)
    ok = Materializer(0).materialize(
        _Frames([_qwen_envelope(img, honest)], [img.tobytes()]), index_map
    )
    assert ok.pixel_values.shape == (honest.plan.grid.patches, 1176)


def test_one_batch_cannot_mix_kimi_and_qwen_rows(rng: np.random.Generator) -> None:
    from test_materialize import _Frames

    img = rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)
    kimi = KimiConfig()(90, 60)
    qwen = FAMILIES["qwen2.5-vl"](90, 60)
    envs = [
        _qwen_envelope(img, qwen),
        _qwen_envelope(img, kimi, index=GlobalIndex(1), payload=InlineRef(frame=1)),
    ]
    [index_map] = assign_owners([4, 4], 1)
    with pytest.raises(MaterializeError, match="different processors"):
        Materializer(0).materialize(_Frames(envs, [img.tobytes()] * 2), index_map)


def test_owner_ranks_in_other_processes_equal_transformers(rng: np.random.Generator) -> None:
    # a real producer ships PIL images of every mode raw (alpha composited on the producer)
    # to 3 ranks in their own processes, owners permuted, one request per family; each
    # rank's rows are the transformers processor's rows of its items
    requests = [
        ("qwen2.5-vl", {**QWEN_PARAMS["qwen2.5-vl"], "max_pixels": 28 * 28 * 64}),
        (
            "glm-4v",
            {
                **GLM_PARAMS["glm-4v"],
                "size": {"shortest_edge": 12544, "longest_edge": 28 * 28 * 128},
            },
        ),
    ]
    images = _modes(rng)
    ranks = 3
    ctx = procs.CHILDREN
    q = ctx.Queue()
    p = Producer(arena_size=1 << 24)
    kids = [
        ctx.Process(
            target=procs.materialize_rank,
            args=(r, ranks, p.endpoint, p.handover_path, 0, q, len(requests)),
        )
        for r in range(ranks)
    ]
    try:
        for k in kids:
            k.start()
        p.wait_for_consumers(list(range(ranks)), 60)
        for name, params in requests:
            family = spec_for(name, params)
            maps = assign_owners([family(*im.size).plan.grid.patches for im in images], ranks)
            assert any(list(m.globals) != sorted(m.globals) for m in maps), "want a permutation"
            owners = [
                next((m.rank,) for m in maps if m.owns(GlobalIndex(i))) for i in range(len(images))
            ]
            items = [Item(data=im, consumers=o, preprocess=family) for im, o in zip(images, owners)]
            p.publish(name, items)
            results = {}
            for _ in range(ranks):
                _, rank, order, pv, grids = q.get(timeout=120)
                results[rank] = (order, pv, grids)
            want = [qwen_reference([im], params, family=name) for im in images]
            for rank, (order, pv, grids) in results.items():
                assert order == [g.value for g in maps[rank].globals]
                assert pv == torch.cat([want[i][0] for i in order]).numpy().tobytes(), (name, rank)
                assert grids == [want[i][1][0].tolist() for i in order]
    finally:
        for k in kids:
            k.join(20)
        p.close()
