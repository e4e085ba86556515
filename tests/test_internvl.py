"""InternVL 2.5/3/3.5 against transformers' own ``GotOcr2ImageProcessorPil`` (InternVL's
image processor), with ``==``.

An image is resized to its grid of whole tiles, cut into tiles, and followed by a thumbnail
when it has more than one. The CPU path and owners in other processes here; a CUDA owner
computes InternVL on the host (``test_gpu.py``), as the kernels do not run it yet.
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
    InternVLConfig,
    Materializer,
    assign_owners,
    internvl_image_prompt,
    preprocess_images,
    spec_for,
)
from mmwire.transport import GlobalIndex, Grid, Item, Producer
from mmwire.transport.errors import ConfigurationError, DimensionError, GridMismatch
from oracle import INTERNVL_PARAMS, internvl_processor, internvl_reference
from PIL import Image
from test_families import _bits, _modes

INTERNVL = tuple(INTERNVL_PARAMS)


def _assert_exact(images: list[Any], params: dict[str, Any], dtype: torch.dtype) -> None:
    want, tiles = internvl_reference(images, params, dtype)
    spec = spec_for("internvl3", params)
    got, grids = preprocess_images(images, spec, dtype=dtype)
    assert grids.tolist() == [[n, 1, 1] for n in tiles]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert int((_bits(got) != _bits(want)).sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", INTERNVL)
def test_every_mode_and_size_equals_transformers(
    rng: np.random.Generator, family: str, dtype: torch.dtype
) -> None:
    images: list[Any] = _modes(rng)
    images += [Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8))]
    images += [Image.fromarray(rng.integers(0, 256, (5, 2999, 3), dtype=np.uint8))]  # 600:1
    images += [Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))]
    images += [Image.fromarray(rng.integers(0, 256, (899, 1801, 3), dtype=np.uint8))]
    images += [rng.integers(0, 256, (45, 77, 4), dtype=np.uint8)]  # an RGBA array
    _assert_exact(images, INTERNVL_PARAMS[family], dtype)


def test_photos_and_encoded_bytes_equal_transformers() -> None:
    from conftest import photo_path

    photos = [Image.open(photo_path(n)).convert("RGB") for n in ("astronaut.png", "coffee.png")]
    images: list[Any] = [*photos, photos[0].resize((1601, 1203)), photos[1].resize((97, 411))]
    _assert_exact(images, INTERNVL_PARAMS["internvl3"], torch.float32)
    encoded = []
    for k, im in enumerate(images):
        buf = io.BytesIO()
        im.save(buf, "JPEG" if k % 2 else "PNG", quality=90)
        encoded.append(buf.getvalue())
    params = INTERNVL_PARAMS["internvl3"]
    want, _ = internvl_reference([Image.open(io.BytesIO(b)) for b in encoded], params)
    got, _ = preprocess_images(encoded, spec_for("internvl3", params))
    assert got.numpy().tobytes() == want.numpy().tobytes()


def test_tile_and_token_counts_are_transformers_counts() -> None:
    # every aspect ratio from 1:40 to 40:1 on both configs, ties included (square images
    # and exact multiples pick between arrangements of the same ratio by area)
    sizes = [(w, h) for w in (1, 7, 100, 447, 448, 449, 896, 1344, 3000) for h in (1, 50, 448, 900)]
    sizes += [(448 * c, 448 * r) for c in range(1, 7) for r in range(1, 7)]
    sizes += [(224 * c, 224 * r) for c in range(1, 7) for r in range(1, 7)]
    for family, params in INTERNVL_PARAMS.items():
        spec = spec_for(family, params)
        ref = internvl_processor(params)
        for w, h in sizes:
            n = ref.get_number_of_image_patches(h, w)
            assert spec.plan(w, h).grid.patches == n, (family, w, h)
            assert spec.tokens(w, h) == 256 * n


def test_spec_for_reads_the_published_config() -> None:
    spec = spec_for("internvl3", INTERNVL_PARAMS["internvl3"])
    assert spec == FAMILIES["internvl3"] and isinstance(spec, InternVLConfig)
    assert spec.row_shape == (3, 448, 448) and (spec.min_tiles, spec.max_tiles) == (1, 12)
    small = spec_for("internvl3.5", INTERNVL_PARAMS["internvl3.5"])
    assert small.family == "internvl3.5" and small.tile == (56, 84)
    assert (small.min_tiles, small.max_tiles) == (2, 6)
    one = small(1000, 10)
    assert one.processor == "internvl" and one.row_shape == (3, 56, 84)
    assert one.tile == (56, 84) and one.tiles == (2, 6)
    off = spec_for("internvl3", {"crop_to_patches": False})
    assert off.plan(3000, 1000).grid.thw == (1, 1, 1)  # one tile, no thumbnail
    assert spec_for("internvl2.5", {"image_seq_length": 64}).tokens(448 * 2, 448) == 3 * 64


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"resample": 2}, "BICUBIC"),
        ({"do_normalize": False}, "every step"),
        ({"do_center_crop": True}, "center-crop"),
        ({"size": {"shortest_edge": 448}}, "height"),
        ({"min_patches": 5, "max_patches": 3}, "min_tiles <= max_tiles"),
        ({"min_pixels": 3136}, "not read by this family"),
    ],
)
def test_spec_for_refuses_what_it_cannot_reproduce(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        spec_for("internvl3", params)


def test_the_prompt_is_the_processors_expansion() -> None:
    assert internvl_image_prompt(2, 3) == "<img>" + "<IMG_CONTEXT>" * 6 + "</img>"


def test_an_owner_refuses_a_forged_internvl_plan(rng: np.random.Generator) -> None:
    from test_families import _qwen_envelope
    from test_materialize import _Frames

    img = rng.integers(0, 256, (300, 900, 3), dtype=np.uint8)
    spec = FAMILIES["internvl3"](900, 300)
    assert spec.plan.grid.thw == (4, 1, 1)  # 3 x 1 tiles and the thumbnail
    [index_map] = assign_owners([spec.plan.grid.patches], 1)
    wide = msgspec.structs.replace(spec.plan, new_width=448 * 40)
    with pytest.raises(GridMismatch, match="whole"):  # a canvas of 40 tiles
        msgspec.structs.replace(spec, plan=wide)
    with pytest.raises(DimensionError, match="tiles"):
        msgspec.structs.replace(spec, tiles=(1, 1000))
    more = msgspec.structs.replace(spec.plan, new_width=448 * 4, grid=Grid((5, 1, 1)))
    forged = msgspec.structs.replace(spec, plan=more)  # 4 x 1 tiles: valid, not its own
    frames = _Frames([_qwen_envelope(img, forged, grid=more.grid)], [img.tobytes()])
    with pytest.raises(GridMismatch, match="not the one"):
        Materializer(0).materialize(frames, index_map)
    out = Materializer(0).materialize(
        _Frames([_qwen_envelope(img, spec)], [img.tobytes()]), index_map
    )
    want, _ = internvl_reference([img], INTERNVL_PARAMS["internvl3"])
    assert out.pixel_values.numpy().tobytes() == want.numpy().tobytes()
    assert out.grid_thw.tolist() == [[4, 1, 1]]


def test_a_batch_mixing_internvl_and_gemma_rows_of_one_shape_is_refused(
    rng: np.random.Generator,
) -> None:
    from mmwire.transport.errors import MaterializeError
    from mmwire.transport.wire import InlineRef
    from test_families import _qwen_envelope
    from test_materialize import _Frames

    img = rng.integers(0, 256, (28, 56, 3), dtype=np.uint8)
    gemma = spec_for("gemma-3", {"size": {"height": 448, "width": 448}})(56, 28)
    internvl = FAMILIES["internvl3"](56, 28)
    assert gemma.row_shape == internvl.row_shape == (3, 448, 448)
    second = {"index": GlobalIndex(1), "payload": InlineRef(frame=1)}
    envs = [_qwen_envelope(img, gemma), _qwen_envelope(img, internvl, **second)]
    [index_map] = assign_owners([1, 1], 1)
    with pytest.raises(MaterializeError, match="different processors"):
        Materializer(0).materialize(_Frames(envs, [img.tobytes()] * 2), index_map)


def test_owner_ranks_in_other_processes_equal_transformers(rng: np.random.Generator) -> None:
    # PIL images of every mode, raw, to 3 ranks in their own processes, owners balanced by
    # rows (tiles), permuted; each rank's rows are transformers' rows of its items
    params = INTERNVL_PARAMS["internvl3.5"]
    family = spec_for("internvl3.5", params)
    images = _modes(rng)
    ranks = 3
    q = procs.CHILDREN.Queue()
    p = Producer(arena_size=1 << 24)
    kids = [
        procs.CHILDREN.Process(
            target=procs.materialize_rank,
            args=(r, ranks, p.endpoint, p.handover_path, 0, q),
        )
        for r in range(ranks)
    ]
    try:
        for k in kids:
            k.start()
        p.wait_for_consumers(list(range(ranks)), 60)
        maps = assign_owners([family(*im.size).plan.grid.patches for im in images], ranks)
        assert any(list(m.globals) != sorted(m.globals) for m in maps), "want a permutation"
        owners = [
            next((m.rank,) for m in maps if m.owns(GlobalIndex(i))) for i in range(len(images))
        ]
        items = [Item(im, consumers=o, preprocess=family) for im, o in zip(images, owners)]
        p.publish("internvl", items)
        results = {}
        for _ in range(ranks):
            _, rank, order, pv, grids = q.get(timeout=120)
            results[rank] = (order, pv, grids)
        want = [internvl_reference([im], params) for im in images]
        for rank, (order, pv, grids) in results.items():
            assert order == [g.value for g in maps[rank].globals]
            assert pv == torch.cat([want[i][0] for i in order]).numpy().tobytes(), rank
            assert grids == [[want[i][1][0], 1, 1] for i in order]
    finally:
        for k in kids:
            k.join(20)
        p.close()
