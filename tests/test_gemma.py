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
from mmwire.transport import GlobalIndex, Item, Producer
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
    images: list[Any] = [*photos, photos[0].resize((4000, 3000)), photos[1].resize((97, 411))]
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
        ({"do_pan_and_scan": True}, "pan-and-scan"),
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
    text = gemma3_image_prompt(3)
    assert text == "\n\n<start_of_image>" + "<image_soft_token>" * 3 + "<end_of_image>\n\n"


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
    # PIL images of every mode, raw, to 3 ranks in their own processes; owners balanced by
    # input pixels, so each rank's items come in a permuted order
    params = GEMMA_PARAMS["gemma3"]
    family = spec_for("gemma3", params)
    images = _modes(rng)
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
        want = [gemma_reference([im], params)[0] for im in images]
        for rank, (order, pv, grids) in results.items():
            assert order == [g.value for g in maps[rank].globals]
            assert pv == torch.cat([want[i] for i in order]).numpy().tobytes(), rank
            assert grids == [[1, 1, 1]] * len(order)
    finally:
        for k in kids:
            k.join(20)
        p.close()
