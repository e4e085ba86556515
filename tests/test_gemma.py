"""Gemma 3 against transformers' own ``Gemma3ImageProcessorPil``, with ``==``.

Every image is resized whole (BILINEAR) to one fixed size and becomes one ``(3, H, W)``
entry. The CPU path and owners in other processes here; a CUDA owner computes Gemma on the
host (``test_gpu.py``), as the kernels do not run it yet.
"""

from __future__ import annotations

import io
from typing import Any

import msgspec
import numpy as np
import procs
import pytest
import torch
from mmwire.materialize import (
    FAMILIES,
    Gemma3Config,
    Materializer,
    assign_owners,
    gemma3_image_prompt,
    preprocess_images,
    should_defer,
    spec_for,
)
from mmwire.transport import GlobalIndex, Grid, Item, PanAndScan, Producer
from mmwire.transport.errors import ConfigurationError, DimensionError, GridMismatch
from mmwire.transport.wire import InlineRef
from oracle import GEMMA_PARAMS, gemma_reference
from PIL import Image
from test_families import _bits, _modes

GEMMA = tuple(GEMMA_PARAMS)


def _assert_exact(images: list[Any], params: dict[str, Any], dtype: torch.dtype) -> None:
    want, crops = gemma_reference(images, params, dtype)
    spec = spec_for("gemma-3", params)
    got, grids = preprocess_images(images, spec, dtype=dtype)
    assert crops == [0] * len(images)
    assert grids.tolist() == [[1, 1, 1]] * len(images)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert int((_bits(got) != _bits(want)).sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", GEMMA)
def test_every_mode_and_size_equals_transformers(
    rng: np.random.Generator, family: str, dtype: torch.dtype
) -> None:
    images: list[Any] = _modes(rng)
    images += [Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8))]
    images += [Image.fromarray(rng.integers(0, 256, (5, 2999, 3), dtype=np.uint8))]  # 600:1
    images += [Image.fromarray(rng.integers(0, 256, (896, 896, 3), dtype=np.uint8))]  # as is
    images += [rng.integers(0, 256, (45, 77, 4), dtype=np.uint8)]  # an RGBA array
    _assert_exact(images, GEMMA_PARAMS[family], dtype)


def test_photos_and_encoded_bytes_equal_transformers() -> None:
    from conftest import photo_path

    photos = [Image.open(photo_path(n)).convert("RGB") for n in ("astronaut.png", "coffee.png")]
    images: list[Any] = [*photos, photos[0].resize((1601, 1203)), photos[1].resize((97, 411))]
    _assert_exact(images, GEMMA_PARAMS["gemma-3"], torch.float32)
    encoded = []
    for k, im in enumerate(images):
        buf = io.BytesIO()
        im.save(buf, "JPEG" if k % 2 else "PNG", quality=90)
        encoded.append(buf.getvalue())
    want, _ = gemma_reference([Image.open(io.BytesIO(b)) for b in encoded], GEMMA_PARAMS["gemma-3"])
    got, _ = preprocess_images(encoded, spec_for("gemma-3", GEMMA_PARAMS["gemma-3"]))
    assert got.numpy().tobytes() == want.numpy().tobytes()


def test_spec_for_reads_the_published_config() -> None:
    spec = spec_for("gemma-3", GEMMA_PARAMS["gemma-3"])
    assert spec == FAMILIES["gemma-3"] and isinstance(spec, Gemma3Config)
    assert spec.row_shape == (3, 896, 896) and spec.tokens(4000, 3000) == 256
    small = spec_for("gemma3", GEMMA_PARAMS["gemma3"])
    assert (small.height, small.width, small.image_seq_length) == (224, 320, 64)
    assert small.image_mean == (0.485, 0.456, 0.406)
    one = small(1000, 10)
    assert one.processor == "gemma3" and one.row_shape == (3, 224, 320)
    assert one.plan.grid.thw == (1, 1, 1) and one.plan.tokens == 64


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"resample": 3}, "BILINEAR"),
        ({"do_pan_and_scan": "yes"}, "do_pan_and_scan"),
        ({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 99}, "max_crops"),
        ({"do_normalize": False}, "every step"),
        ({"do_convert_rgb": False}, "RGB"),
        ({"size": {"shortest_edge": 896}}, "height"),
        ({"min_pixels": 3136}, "not read by this family"),
    ],
)
def test_spec_for_refuses_what_it_cannot_reproduce(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        spec_for("gemma-3", params)


def test_the_prompt_is_the_processors_expansion() -> None:
    one = "\n\n<start_of_image>" + "<image_soft_token>" * 3 + "<end_of_image>\n\n"
    assert gemma3_image_prompt(3) == one
    assert gemma3_image_prompt(3, crops=2) == (
        f"Here is the original image {one} and here are some crops to help you see better "
        f"{one} {one}"
    )


PAN = {
    # the published config with pan-and-scan turned on: the processor's defaults fill in
    "defaults": {**GEMMA_PARAMS["gemma-3"], "do_pan_and_scan": True},
    # every parameter set, crops as narrow as 64 pixels, up to 7 of them, from 1.01:1
    "wide-open": {
        **GEMMA_PARAMS["gemma3"],
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 64,
        "pan_and_scan_max_num_crops": 7,
        "pan_and_scan_min_ratio_to_activate": 1.01,
    },
}


@pytest.mark.parametrize("name", PAN)
def test_pan_and_scan_crops_equal_transformers(rng: np.random.Generator, name: str) -> None:
    # wide, tall, square, just under and over the ratio, crops cut short at the edge
    sizes = [(301, 203), (1500, 1000), (896, 896), (999, 37), (300, 2000), (1800, 900)]
    sizes += [(100, 600), (1000, 257), (256, 513), (1000, 1300), (1000, 5000), (1201, 1000)]
    images: list[Any] = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes
    ]
    if name == "wide-open":  # small outputs: every mode too
        images += _modes(rng)
    else:  # 896 x 896 rows: the wide, tall and edge cases only
        images = [images[k] for k in (1, 3, 4, 7, 10)]
    params = PAN[name]
    want, crops = gemma_reference(images, params)
    spec = spec_for("gemma-3", params)
    got, grids = preprocess_images(images, spec)
    assert [t - 1 for t, _, _ in grids.tolist()] == crops and sum(crops) >= 8
    assert [spec.tokens(*im.size) for im in images] == [
        spec.image_seq_length * (1 + n) for n in crops
    ]
    assert got.shape == want.shape and int((_bits(got) != _bits(want)).sum()) == 0


def test_deferral_weighs_the_fixed_output_against_the_input() -> None:
    gemma = FAMILIES["gemma-3"]
    small = Image.new("RGB", (300, 200))  # 180 KB of pixels against 9.6 MB of fp32
    big = Image.new("RGB", (4000, 3000))  # 36 MB against 9.6 MB
    assert should_defer([small], transport="cpu", consumer_has_gpu=True, preprocess=gemma)
    assert not should_defer([big], transport="cpu", consumer_has_gpu=True, preprocess=gemma)


def test_an_owner_refuses_a_forged_gemma_plan(rng: np.random.Generator) -> None:
    from test_families import _qwen_envelope
    from test_materialize import _Frames

    img = rng.integers(0, 256, (20, 90, 3), dtype=np.uint8)
    spec = FAMILIES["gemma-3"](90, 20)
    [index_map] = assign_owners([1], 1)
    padded = msgspec.structs.replace(spec.plan, pad_width=14)
    with pytest.raises(GridMismatch, match="one unpadded row"):
        msgspec.structs.replace(spec, plan=padded)
    huge = msgspec.structs.replace(spec.plan, new_width=1 << 16)
    with pytest.raises(DimensionError, match="at most 4096"):
        msgspec.structs.replace(spec, plan=huge)
    out = Materializer(0).materialize(
        _Frames([_qwen_envelope(img, spec)], [img.tobytes()]), index_map
    )
    want, _ = gemma_reference([img], GEMMA_PARAMS["gemma-3"])
    assert out.pixel_values.numpy().tobytes() == want.numpy().tobytes()
    assert out.grid_thw.tolist() == [[1, 1, 1]]
    # with pan-and-scan, a crop more than the image gets is refused before any work
    panned = spec_for("gemma-3", {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8})
    spec = panned(90, 20)
    assert spec.plan.grid.t == 1 + 4  # 4.5:1, capped at the default 4 crops
    frames = _Frames([_qwen_envelope(img, spec, grid=spec.plan.grid)], [img.tobytes()])
    [five] = assign_owners([5], 1)
    assert Materializer(0).materialize(frames, five).pixel_values.shape[0] == 5
    fewer = PanAndScan(8, 2, 1.2)
    with pytest.raises(GridMismatch, match="at most 2"):  # more rows than its own limit
        msgspec.structs.replace(spec, pan_and_scan=fewer)
    more = msgspec.structs.replace(spec.plan, grid=Grid((4, 1, 1)))
    forged = msgspec.structs.replace(spec, plan=more)  # 3 crops: valid, not its own
    frames = _Frames([_qwen_envelope(img, forged, grid=more.grid)], [img.tobytes()])
    [four] = assign_owners([4], 1)
    with pytest.raises(GridMismatch, match="not the one"):
        Materializer(0).materialize(frames, four)


def test_a_batch_mixing_gemma_and_qwen_is_refused(rng: np.random.Generator) -> None:
    from mmwire.transport.errors import MaterializeError
    from test_families import _qwen_envelope
    from test_materialize import _Frames

    img = rng.integers(0, 256, (28, 56, 3), dtype=np.uint8)
    gemma, qwen = FAMILIES["gemma-3"](56, 28), FAMILIES["qwen2.5-vl"](56, 28)
    second = {"index": GlobalIndex(1), "payload": InlineRef(frame=1)}
    envs = [_qwen_envelope(img, gemma), _qwen_envelope(img, qwen, **second)]
    [index_map] = assign_owners([1, qwen.plan.grid.patches], 1)
    with pytest.raises(MaterializeError, match="different processors"):
        Materializer(0).materialize(_Frames(envs, [img.tobytes()] * 2), index_map)


def test_owner_ranks_in_other_processes_equal_transformers(rng: np.random.Generator) -> None:
    # PIL images of every mode, raw, pan-and-scan on, to 3 ranks in their own processes;
    # owners balanced by input pixels, so each rank's items come in a permuted order
    params = PAN["wide-open"]
    family = spec_for("gemma3", params)
    images = _modes(rng)
    assert any(family.plan(*im.size).grid.t > 1 for im in images)  # some have crops
    ranks = 3
    q = procs.CHILDREN.Queue()
    p = Producer(arena_size=1 << 24)
    kids = [
        procs.CHILDREN.Process(
            target=procs.materialize_rank,
            args=(r, ranks, p.endpoint, p.handover_path, 0, q, 1, True),
        )
        for r in range(ranks)
    ]
    try:
        for k in kids:
            k.start()
        p.wait_for_consumers(list(range(ranks)), 60)
        maps = assign_owners([im.size[0] * im.size[1] for im in images], ranks)
        assert any(list(m.globals) != sorted(m.globals) for m in maps), "want a permutation"
        owners = [
            next((m.rank,) for m in maps if m.owns(GlobalIndex(i))) for i in range(len(images))
        ]
        p.publish(
            "gemma", [Item(im, consumers=o, preprocess=family) for im, o in zip(images, owners)]
        )
        results = {}
        for _ in range(ranks):
            _, rank, order, pv, grids = q.get(timeout=120)
            results[rank] = (order, pv, grids)
        want = [gemma_reference([im], params) for im in images]
        for rank, (order, pv, grids) in results.items():
            assert order == [g.value for g in maps[rank].globals]
            assert pv == torch.cat([want[i][0] for i in order]).numpy().tobytes(), rank
            assert grids == [[1 + want[i][1][0], 1, 1] for i in order]
    finally:
        for k in kids:
            k.join(20)
        p.close()
