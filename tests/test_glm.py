"""GLM-4.1V/4.5V/4.6V against transformers' own ``Glm4vImageProcessorPil``, with ``==``.

GLM's rows are Qwen-VL's; its plan is its own ``smart_resize`` (a side under one merge
window enlarges the image first, and two frames' area is bounded). The CPU path here; the
kernels' host build in ``test_kernels_host.py`` and the GPU in ``test_gpu.py``; owners in
other processes in ``test_families.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from mmwire.materialize import FAMILIES, Glm4vConfig, preprocess_images, should_defer, spec_for
from mmwire.transport.errors import ConfigurationError, GridMismatch, MaterializeError
from oracle import GLM_PARAMS, Glm4vImageProcessorPil, qwen_reference, reference_processor
from PIL import Image
from test_families import _assert_exact as assert_exact
from test_families import _modes

GLM = tuple(GLM_PARAMS)


def _assert_exact(images: list[Any], params: dict[str, Any], dtype: torch.dtype) -> None:
    assert_exact(images, "glm-4v", params, dtype)


def _with_pixels(family: str, lo: int, hi: int) -> dict[str, Any]:
    return {**GLM_PARAMS[family], "size": {"shortest_edge": lo, "longest_edge": hi}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", GLM)
def test_every_mode_and_size_equals_transformers(
    rng: np.random.Generator, family: str, dtype: torch.dtype
) -> None:
    images: list[Any] = _modes(rng)
    images += [Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8))]
    images += [rng.integers(0, 256, (45, 77, 4), dtype=np.uint8)]  # an RGBA array
    images += [rng.integers(0, 256, (3, 50, 38), dtype=np.uint8)]  # CHW
    _assert_exact(images, GLM_PARAMS[family], dtype)


@pytest.mark.parametrize(
    ("size", "limits"),
    [
        ((13, 40), (112 * 112, 28 * 28 * 15000)),  # a side under 28: enlarged first
        ((27, 27), (112 * 112, 28 * 28 * 15000)),
        ((5, 999), (112 * 112, 28 * 28 * 15000)),  # enlarged to 28 x 5594: ratio past 199
        ((28 * 10, 28 * 8), (1, 2 * 28 * 28 * 80)),  # two frames' area exactly max: kept
        ((28 * 10, 28 * 8), (1, 2 * 28 * 28 * 80 - 1)),  # just past: shrinks
        ((28 * 10 + 14, 28 * 8), (1, 2 * 28 * 28 * 90)),  # half: round to even
        ((56, 56), (2 * 56 * 56, 1 << 30)),  # two frames' area exactly min: kept
        ((55, 41), (2 * 56 * 56, 1 << 30)),  # under it: grows
        ((640, 480), (12544, 9633792)),
        ((4000, 3000), (12544, 9633792)),  # over a GLM-4.1V-style budget: shrinks
    ],
)
def test_sizes_at_and_past_each_limit_equal_transformers(
    rng: np.random.Generator, size: tuple[int, int], limits: tuple[int, int]
) -> None:
    w, h = size
    image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    _assert_exact([image], _with_pixels("glm-4v", *limits), torch.float32)


@pytest.mark.parametrize("size", [(2, 401), (9999, 13), (3, 700)])
def test_an_aspect_ratio_past_200_is_refused_as_transformers_refuses_it(
    size: tuple[int, int],
) -> None:
    image = Image.new("RGB", size)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        qwen_reference([image], GLM_PARAMS["glm-4v"], family="glm-4v")
    with pytest.raises(MaterializeError, match="aspect ratio must be smaller than 200"):
        preprocess_images([image], spec_for("glm-4v"))
    assert not should_defer(
        [image], transport="cpu", consumer_has_gpu=True, preprocess=FAMILIES["glm-4v"]
    )


def test_photos_equal_transformers(rng: np.random.Generator) -> None:
    from conftest import photo_path

    photos = [Image.open(photo_path(n)).convert("RGB") for n in ("astronaut.png", "coffee.png")]
    images = [*photos, photos[0].resize((4200, 3200)), photos[1].convert("L").resize((90, 47))]
    _assert_exact(images, GLM_PARAMS["glm-4.1v"], torch.bfloat16)
    _assert_exact(images, _with_pixels("glm-4v", 12544, 28 * 28 * 60), torch.float32)


def test_grid_and_token_counts_are_transformers_counts() -> None:
    for family, params in GLM_PARAMS.items():
        spec = spec_for(family, params)
        ref = reference_processor(family, params)
        for w, h in ((1, 1), (13, 40), (640, 480), (4000, 3000), (13, 2000), (8000, 8000)):
            patches = ref.get_number_of_image_patches(h, w)
            assert spec.plan(w, h).grid.patches == patches, (family, w, h)
            assert spec.tokens(w, h) == patches // 4


def test_spec_for_reads_a_checkpoint_config_as_transformers_does() -> None:
    for name in ("glm-4v", "glm-4.1v", "glm-4.5v", "glm-4.6v"):
        spec = spec_for(name, GLM_PARAMS["glm-4.1v"])
        assert isinstance(spec, Glm4vConfig) and spec.family == name
        assert (spec.min_pixels, spec.max_pixels) == (12544, 9633792)
        assert spec(640, 480).processor == "glm4v" and spec.row_shape == (1176,)
    assert spec_for("glm-4v", GLM_PARAMS["glm-4v"]) == FAMILIES["glm-4v"]
    ref = Glm4vImageProcessorPil()
    loaded = {k: v for k, v in ref.to_dict().items() if v is not None}
    got = spec_for("glm-4v", loaded)
    assert (got.min_pixels, got.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"resample": 2}, "BICUBIC"),
        ({"do_normalize": False}, "every step"),
        ({"min_pixels": 3136}, "not read by this family"),  # GLM reads limits from `size`
        ({"size": {"height": 448, "width": 448}}, "shortest_edge"),
        ({"size": {"shortest_edge": 10, "longest_edge": 5}}, "min_pixels <= max_pixels"),
    ],
)
def test_spec_for_refuses_what_it_cannot_reproduce(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        spec_for("glm-4v", params)


def test_an_owner_refuses_a_qwen_plan_sent_as_glm_and_back(rng: np.random.Generator) -> None:
    from mmwire.materialize import Materializer, assign_owners
    from test_families import _qwen_envelope
    from test_materialize import _Frames

    img = rng.integers(0, 256, (20, 90, 3), dtype=np.uint8)  # GLM enlarges it, Qwen doesn't
    glm = FAMILIES["glm-4v"](90, 20)
    qwen = FAMILIES["qwen2.5-vl"](90, 20)
    assert glm.plan != qwen.plan
    [index_map] = assign_owners([glm.plan.grid.patches], 1)
    for forged in (
        msgspec.structs.replace(glm, processor="qwen2_vl"),
        msgspec.structs.replace(qwen, processor="glm4v"),
    ):
        with pytest.raises(GridMismatch, match="not the one"):
            Materializer(0).materialize(
                _Frames([_qwen_envelope(img, forged)], [img.tobytes()]), index_map
            )
    out = Materializer(0).materialize(
        _Frames([_qwen_envelope(img, glm)], [img.tobytes()]), index_map
    )
    want, grid = qwen_reference([img], GLM_PARAMS["glm-4v"], family="glm-4v")
    assert out.pixel_values.numpy().tobytes() == want.numpy().tobytes()
    assert out.grid_thw.tolist() == grid.tolist()
