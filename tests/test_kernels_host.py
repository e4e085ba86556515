"""The kernels' own code, built as C++ and run on the CPU, against Pillow and the CPU path.

The CUDA launch path is the same code on the device (``test_gpu.py`` repeats these cases
with ``pytest -m gpu``); here CI checks the descriptors, the pass planning and every index
and rounding rule of ``pixels.cu`` with ``==``.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from host_kernels import HostLauncher, build_root, shared_build
from kernel_cases import (
    CASES,
    DTYPES,
    QWEN_CASES,
    QWEN_SMALL,
    SMALL,
    TILE_LAYOUT,
    TILED_CASES,
    case,
    differing,
    kernels,
    kernels_into,
    reference,
)
from mmwire.kernels import (
    FIELDS,
    RECORD_FIELDS,
    SOURCE,
    ImageJob,
    _ops,
    compile_options,
    kernel_source,
    layout_of,
    pack,
    preprocess_packed,
    resize_packed,
)
from mmwire.kernels._abi import FUSED_THREADS, NORM_VALUES, OutputLayout
from mmwire.kernels._descriptors import (
    _RAW,
    MIXED_PLAIN_GAMMA,
    MIXED_PLAIN_TILE,
    MIXED_TAIL,
)
from mmwire.kernels._regions import region_layout
from mmwire.kernels.reference import Normalisation, bicubic_coefficients, resize_reference
from mmwire.materialize import KimiConfig
from PIL import Image


@pytest.fixture(scope="module")
def host_lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_build(build_root(request, tmp_path_factory))


@pytest.fixture(scope="module")
def host(host_lib: Path) -> HostLauncher:
    return HostLauncher(host_lib)


@pytest.fixture(scope="module")
def host_qwen(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> HostLauncher:
    """The build for Qwen-VL's rows: (3, 2, p, p) by 2 x 2 merge window, any patch size."""
    layout = OutputLayout(merge=2, temporal=2)
    root = build_root(request, tmp_path_factory)
    return HostLauncher(shared_build(root, layout=layout), layout=layout)


@pytest.fixture(scope="module")
def host14(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> HostLauncher:
    """The build the launcher compiles for p = 14 (``MMWIRE_PATCH``)."""
    return HostLauncher(shared_build(build_root(request, tmp_path_factory), patch=14))


def test_tile_records_are_whole_16_byte_loads() -> None:
    assert len(RECORD_FIELDS) % 4 == 0  # the kernel loads a record as uint4s


def test_kinds_are_numbered_as_the_cuda_enum_numbers_them() -> None:
    # enum Kind takes the names in order from 0; the launcher names kernels by KINDS' values
    from mmwire.kernels._abi import KINDS

    assert list(KINDS.values()) == list(range(len(KINDS)))


@pytest.mark.parametrize(
    ("width", "fits"), [(30_000_000 // 14 * 14, True), (40_000_000 // 14 * 14, False)]
)
def test_a_tile_window_past_4_gib_of_the_source_is_refused(width: int, fits: bool) -> None:
    # copy_rows stages a window's rows with 32-bit offsets: 28 rows of RGBA 4 * width bytes
    # span 3.4 GB (fits) or 4.5 GB (refused, before anything is launched)
    job = ImageJob(
        in_w=width, in_h=28, ch=4, out_w=width, out_h=28, grid_w=width // 14, patches=width // 7
    )
    if fits:
        assert layout_of((job,), None, 14).tile_records.shape[0] > 0
    else:
        with pytest.raises(ValueError, match="do not fit 32 bits"):
            layout_of((job,), None, 14)


def test_tile_records_say_where_each_mma_and_plain_tile_reads_and_writes() -> None:
    from mmwire.kernels._descriptors import _mma_axis

    # odd widths (rows not on a word) and one of whole words, RGBA (rows on words, its
    # last groups past the image), a tall image passed vertically first, downscales of
    # 0.4 (narrow blocks of one 32-input step), 0.36 (two steps a block, narrow or not) and
    # 0.9 (one), after an unresized image; the first, RGB with rows on words, is staged
    # raw; last an unresized image smaller than its canvas (its tile partly padding)
    jobs = (
        ImageJob(in_w=200, in_h=120, ch=3, out_w=90, out_h=56, patches=28, grid_w=7),
        ImageJob(in_w=397, in_h=112, ch=4, out_w=159, out_h=40, patches=36, grid_w=12),
        ImageJob(in_w=140, in_h=352, ch=1, out_w=56, out_h=140, patches=40, grid_w=4, row=500),
        ImageJob(in_w=56, in_h=28, ch=3, out_w=56, out_h=28, patches=8, grid_w=4),
        ImageJob(in_w=301, in_h=203, ch=3, out_w=271, out_h=183, patches=280, grid_w=20),
        ImageJob(in_w=50, in_h=30, ch=3, out_w=50, out_h=30, patches=12, grid_w=4),
    )
    layout = layout_of(jobs, (13, 0), 14, tensor_cores=True)
    assert [g[:2] for g in layout.tile_groups] == [(1, "mma"), (3, "plain"), (3, "mma"), (4, "mma")]
    recorded = [
        (t, kind)
        for _, kind, first, n in layout.tile_groups
        if kind != "general"
        for t in range(first, first + n)
    ]
    assert len(layout.tile_records) == len(recorded)
    f, tab, seen, plain_used = FIELDS.index, layout.tables, set(), []
    for (t, kind), rec in zip(recorded, layout.tile_records.astype(np.int64)):
        r = dict(zip(RECORD_FIELDS, rec))
        image = int(layout.tile_image[t])
        d, job = layout.desc[image], jobs[image]
        tile = t - d[f("TILE_START")]
        trow, tcol = divmod(int(tile), int(d[f("TILES_W")]))
        gy0, gx0 = trow * d[f("TILE_PH")], tcol * d[f("TILE_PW")]
        assert (r["R_IMAGE"], r["R_GY0"], r["R_GX0"]) == (image, gy0, gx0)
        assert r["R_PATCH"] == d[f("ROW")] + gy0 * job.grid_w + gx0
        assert (r["R_TABLE"], r["R_GRID_W"]) == (d[f("TABLE")], job.grid_w)
        assert r["R_TILE_H"] == min(d[f("TILE_PH")], d[f("GRID_H")] - gy0)
        assert r["R_TILE_W"] == min(d[f("TILE_PW")], job.grid_w - gx0)
        # the window: inside the image, from each axis's first M-block's first tap
        at = ((r["R_SRC_HI"] << 32) | (r["R_SRC_LO"] & 0xFFFFFFFF)) - d[f("SRC_OFF")]
        if kind == "plain":  # its first pixel and the part of it inside the image
            assert at == (gy0 * job.in_w + gx0) * 14 * job.ch
            assert r["R_ROW_BYTES"] == job.in_w * job.ch
            assert r["R_USED_W"] == min(r["R_TILE_W"] * 14, job.out_w - gx0 * 14)
            assert r["R_USED_H"] == min(r["R_TILE_H"] * 14, job.out_h - gy0 * 14)
            assert r["R_X_SPANS"] == r["R_Y_WORDS"] == 0 and r["R_FLAGS"] == 16  # R_PLAIN
            plain_used.append((int(r["R_USED_H"]), int(r["R_USED_W"])))
            continue
        wy, wx = divmod(int(at) // job.ch, job.in_w)
        assert at % job.ch == 0 and r["R_ROW_BYTES"] == job.in_w * job.ch
        assert wx >= 0 and wx + r["R_USED_W"] <= job.in_w
        assert wy >= 0 and wy + r["R_USED_H"] <= job.in_h
        steps, origin, narrows = [], [], []
        for axis, o0, size, n_in in (
            ("X", gx0, job.out_w, job.in_w),
            ("Y", gy0, job.out_h, job.in_h),
        ):
            c = bicubic_coefficients(n_in, size)
            side = "W" if axis == "X" else "H"
            tile_px, index = int(d[f(f"TILE_P{side}")]) * 14, tcol if axis == "X" else trow
            # narrow (R_X_NARROW 32, R_Y_NARROW 64): where some 16-output block of the axis
            # takes two 32-input steps and every 8-output one fits one
            narrow = bool(r["R_FLAGS"] & (32 if axis == "X" else 64))
            most = {}
            for b in (8, 16):
                o = np.arange(size)
                blk = o // tile_px * tile_px + (o % tile_px) // b * b  # each output's block
                starts = np.flatnonzero(np.diff(blk, prepend=-1))
                first_of = np.minimum.reduceat(c.xmin, starts)
                ends = np.maximum.reduceat(c.xmin + c.n, starts)
                most[b] = int((-(-(ends - (first_of & ~3)) // 32)).max())
            assert narrow == (most[16] > 1 and most[8] == 1)
            bs = 8 if narrow else 16
            blocks = -(-int(r[f"R_TILE_{side}"]) * 14 // bs)  # the M-blocks the tile uses
            spans = tab[r[f"R_{axis}_SPANS"] :][: 2 * blocks].reshape(blocks, 2)
            first = np.minimum(o0 * 14 + bs * np.arange(blocks), size - 1)
            assert (spans[:, 0] == c.xmin[first] & ~3).all()  # each block's first tap
            if narrow:
                assert (spans[:, 1] == 1).all()
            else:
                steps += spans[:, 1].tolist()
            origin.append(int(spans[0, 0]))
            narrows.append(narrow)
            # the fragments of the tile column's (row's) blocks, as _mma_axis lays them out
            # (an RGB image's x axis in its raw first pass's order)
            tiles = -(-(d[f("GRID_W")] if axis == "X" else d[f("GRID_H")]) // (tile_px // 14))
            rgb = axis == "X" and job.ch == 3 and bool(r["R_FLAGS"] & _RAW)
            frags = _mma_axis(n_in, size, tile_px, int(tiles), narrow, rgb)[1][index, :blocks]
            frags = frags.reshape(-1)
            assert (tab[r[f"R_{axis}_WORDS"] :][: frags.size] == frags).all()
        assert (wx, wy) == tuple(origin)
        two = bool(r["R_FLAGS"] & 1)
        assert two == (max(steps, default=1) > 1) and not r["R_FLAGS"] & 16
        assert bool(r["R_FLAGS"] & 2) == (d[f("PASS1")] == 2)
        groups = -(-int(r["R_USED_W"]) // 4)  # staged 4 pixels at a time
        aligned = (at + d[f("SRC_OFF")]) % 4 == 0 and job.in_w * job.ch % 4 == 0
        whole = aligned and wx + 4 * groups <= job.in_w
        assert bool(r["R_FLAGS"] & 4) == whole
        raw = job.ch != 4 and d[f("PASS1")] == 1 and (d[f("SRC_OFF")] | job.in_w * job.ch) % 4 == 0
        assert bool(r["R_FLAGS"] & _RAW) == raw
        seen.add((two, bool(r["R_FLAGS"] & 2), whole, raw, *narrows))
    # every flag is seen both ways; the plain tiles, whole and partly padding
    for k in range(6):
        assert {s[k] for s in seen} == {False, True}
    assert plain_used == [(28, 56), (30, 50)]


def test_a_mixed_layout_interleaves_a_channel_counts_plain_and_mma_records() -> None:
    # RGB: two unresized images (plain; 110 patches, 11 x 10) and two resized on both axes
    # (MMA); gray only MMA
    jobs = (
        ImageJob(in_w=56, in_h=28, ch=3, out_w=56, out_h=28, patches=8, grid_w=4),
        ImageJob(in_w=200, in_h=120, ch=3, out_w=90, out_h=56, patches=28, grid_w=7),
        ImageJob(in_w=140, in_h=352, ch=1, out_w=56, out_h=140, patches=40, grid_w=4),
        ImageJob(in_w=150, in_h=130, ch=3, out_w=150, out_h=130, patches=110, grid_w=11),
        ImageJob(in_w=301, in_h=203, ch=3, out_w=271, out_h=183, patches=280, grid_w=20),
    )
    apart = layout_of(jobs, (13, 0), 14, tensor_cores=True)
    mixed = layout_of(jobs, (13, 0), 14, tensor_cores=True, mixed=True)
    # cached by value: device copies are kept per layout object
    assert layout_of(jobs, (13, 0), 14, tensor_cores=True, mixed=True) is mixed
    assert [g[:2] for g in apart.tile_groups] == [(1, "mma"), (3, "plain"), (3, "mma")]
    (_, _, _, n_gray), (_, _, first, n_plain), (_, _, _, n_mma) = apart.tile_groups
    # beside MMA tiles the plain tiles are MIXED_PLAIN_TILE, not 4 x 4: 1 + 2 x 3, not 1 + 3 x 3
    shape = [FIELDS.index("TILE_PH"), FIELDS.index("TILE_PW")]
    assert MIXED_PLAIN_TILE == (8, 4)
    assert apart.desc[3, shape].tolist() == [4, 4] and n_plain == 1 + 3 * 3
    assert mixed.desc[3, shape].tolist() == [8, 4] and mixed.desc[0, shape].tolist() == [8, 4]
    alone = layout_of(jobs[3:4], (13, 0), 14, tensor_cores=True, mixed=True)  # a plain launch
    assert alone.desc[0, shape].tolist() == [4, 4] and alone.tile_groups == ((3, "plain", 0, 9),)
    n_mixed = 1 + 2 * 3
    assert mixed.tile_groups == ((1, "mma", 0, n_gray), (3, "mixed", first, n_mixed + n_mma))
    flags = mixed.tile_records[:, RECORD_FIELDS.index("R_FLAGS")]
    assert (mixed.tile_records[:n_gray] == apart.tile_records[:n_gray]).all()
    merged, plain = mixed.tile_records[n_gray:], (flags[n_gray:] & 16) != 0
    # the plain tiles cover each patch once, at its place in the output
    r = {name: merged[plain][:, i] for i, name in enumerate(RECORD_FIELDS)}
    assert (r["R_TILE_H"] * r["R_TILE_W"]).sum() == 8 + 110
    assert r["R_PATCH"].tolist() == [0, 76, 80, 84, 164, 168, 172]
    # the MMA records as apart, in the same order, interleaved with the plain ones in
    # theirs: plain tile j after as many MMA tiles as sort before ((j + 1/2) / n) ** gamma,
    # the first before the last MMA one, those past 1 - MIXED_TAIL after it
    assert (merged[~plain] == apart.tile_records[n_gray + n_plain :]).all()
    mma_keys = (np.arange(n_mma) + 0.5) / n_mma * (1 - MIXED_TAIL)
    plain_keys = ((np.arange(n_mixed) + 0.5) / n_mixed) ** MIXED_PLAIN_GAMMA
    mma_before = np.cumsum(~plain)[plain]  # MMA tiles ahead of each plain tile
    assert mma_before.tolist() == [int((mma_keys < k).sum()) for k in plain_keys]
    last_mma = np.flatnonzero(~plain)[-1]
    assert np.flatnonzero(plain)[0] < last_mma
    after = int((plain_keys > mma_keys[-1]).sum())
    assert 0 < after < n_mixed and plain[last_mma + 1 :].sum() == after


def test_host_mixes_plain_and_mma_tiles_in_one_launch(
    host_lib: Path, rng: np.random.Generator
) -> None:
    # every type: a channel count's unresized and tensor-core tiles share one
    # launch of whole warps (the plain tiles' threads laid out by their index, their gray
    # and RGB rows staged) that asks for the larger shared memory. Gray and RGB
    launched: list[tuple[int, int, str, int]] = []

    class Recording(HostLauncher):
        def fused(self, bits: int, channels: int, kind: Any, *rest: Any, **kw: Any) -> None:
            launched.append((bits, channels, kind, rest[2]))
            super().fused(bits, channels, kind, *rest, **kw)

    u8 = lambda *s: rng.integers(0, 256, s, dtype=np.uint8)  # noqa: E731
    shapes = ((60, 90, 3), (45, 70, 1), (200, 260, 3), (230, 170, 1))
    items = [(u8(h, w, c), SMALL) for h, w, c in shapes]
    for warps in (1, 8):
        for dtype in (torch.float32, torch.bfloat16):
            run = Recording(host_lib)
            run.mma_block = (32, warps)
            want_pv, _ = reference(items, dtype)
            got_pv, _ = kernels(items, dtype, "cpu", run)
            assert differing(got_pv, want_pv) == 0
    kinds = {(bits, channels, kind) for bits, channels, kind, _ in launched}
    assert kinds == {(32, 1, "mixed"), (32, 3, "mixed"), (16, 1, "mixed"), (16, 3, "mixed")}
    smem = {(bits, ch, kind): asked for bits, ch, kind, asked in launched}
    for ch in (1, 3):  # (the host build fails a tile that outgrows what its launch asked)
        assert smem[32, ch, "mixed"] == smem[16, ch, "mixed"] > 0


def test_fused_blocks_stay_within_the_launch_bounds() -> None:
    for p in (1, 2, 7, 14, 15, 16, 28, 256):
        across, down = _ops._fused_block(p)
        assert across * down <= FUSED_THREADS and down >= 1
        assert across == (p // 2 if p % 2 == 0 else p)  # a pixel pair a thread when p is even


def test_the_kernels_refuse_to_compile_without_the_hosts_values(tmp_path: Path) -> None:
    # the sources set none of what they share with the host: a build without
    # compile_options stops, naming them, instead of disagreeing with the host
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx is not None
    probe = tmp_path / "probe.cpp"
    probe.write_text(f'#include "{SOURCE.parent / "abi.cuh"}"\n')
    bare = subprocess.run(
        [cxx, "-std=c++20", "-fsyntax-only", str(probe)], capture_output=True, text=True
    )
    assert bare.returncode != 0 and "compile_options" in bare.stderr
    flags = list(compile_options(14))
    built = subprocess.run(
        [cxx, "-std=c++20", "-fsyntax-only", *flags, str(probe)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr


def test_kernel_source_inlines_every_header_once() -> None:
    text = kernel_source()
    assert '#include "' not in text and "#pragma once" not in text
    for header in SOURCE.parent.glob("*.cuh"):
        first = header.read_text().splitlines()[0]
        assert text.count(first) == 1, header.name


def _row(job: ImageJob, pillow: tuple[int, int] = (13, 0)) -> dict[str, int]:
    layout = layout_of((job,), pillow)
    return {name: int(v) for name, v in zip(FIELDS, layout.desc[0])}


def test_layout_skips_passes_pillow_skips() -> None:
    same = _row(ImageJob(in_w=40, in_h=30, ch=4, out_w=40, out_h=30))
    assert (same["PASS1"], same["PASS2"], same["PREMUL"]) == (0, 0, 0)  # Pillow copies
    width_only = _row(ImageJob(in_w=40, in_h=30, ch=4, out_w=20, out_h=30))
    assert (width_only["PASS1"], width_only["PASS2"], width_only["PREMUL"]) == (0, 1, 1)
    height_only = _row(ImageJob(in_w=40, in_h=30, ch=3, out_w=40, out_h=10))
    assert (height_only["PASS1"], height_only["PASS2"], height_only["PREMUL"]) == (0, 2, 0)
    assert layout_of((ImageJob(in_w=40, in_h=30, ch=3, out_w=40, out_h=10),)).mid_bytes == 0


def test_layout_pass_order_follows_the_pillow_version() -> None:
    tall = ImageJob(in_w=45, in_h=400, ch=3, out_w=30, out_h=266)
    new, old = _row(tall, (13, 0)), _row(tall, (12, 3))
    assert (new["PASS1"], new["PASS2"], new["MID_W"], new["MID_H"]) == (2, 1, 45, 266)
    assert (old["PASS1"], old["PASS2"], old["MID_W"], old["MID_H"]) == (1, 2, 30, 400)


def test_layout_shares_tables_and_offsets_accumulate() -> None:
    a = ImageJob(in_w=50, in_h=40, ch=3, out_w=25, out_h=20, patches=4, grid_w=2)
    b = ImageJob(in_w=50, in_h=40, ch=1, out_w=25, out_h=20, patches=4, grid_w=2)
    layout = layout_of((a, b))
    first = dict(zip(FIELDS, layout.desc[0]))
    second = dict(zip(FIELDS, layout.desc[1]))
    assert first["X_K"] == second["X_K"] and first["Y_K"] == second["Y_K"]
    assert second["SRC_OFF"] == 50 * 40 * 3 and layout.src_bytes == 50 * 40 * 4
    assert second["PATCH_START"] == 4 and layout.patches == 8
    assert second["MID_ROW"] == 40 and second["MID_OFF"] == 25 * 40 * 3
    assert layout.mid_rows == 80 and layout.mid_width == 25 and layout.out_rows == 40


def test_layout_tiles_canvases_and_sizes_each_tiles_shared_memory() -> None:
    # 14-pixel patches: tiles of 4 x 4 patches (56 x 56 pixels) where they fit
    down = ImageJob(in_w=300, in_h=200, ch=3, out_w=280, out_h=168, patches=240, grid_w=20)
    same = ImageJob(in_w=56, in_h=28, ch=3, out_w=56, out_h=28, patches=8, grid_w=4)
    layout = layout_of((down, same), (13, 0), 14)
    first, second = (dict(zip(FIELDS, row)) for row in layout.desc)
    assert (first["TILE_PH"], first["TILE_PW"], second["TILE_PH"], second["TILE_PW"]) == (4, 4) * 2
    assert (first["GRID_H"], first["TILES_W"], first["TILE_START"]) == (12, 5, 0)
    assert second["TILE_START"] == 15 and layout.tiles == 16
    assert layout.tile_image.tolist() == [0] * 15 + [1]
    assert (first["TILED"], second["TILED"]) == (1, 1) and layout.mid_bytes == 0
    # horizontal first: the window (rows and columns the 56 x 56 outputs read, halo
    # included) and the horizontal pass of its rows at the 56 output columns
    cy, cx = bicubic_coefficients(200, 168), bicubic_coefficients(300, 280)

    def span(c: Any, size: int, step: int) -> int:
        return max(
            int(c.xmin[min(a + step, size) - 1] + c.n[min(a + step, size) - 1] - c.xmin[a])
            for a in range(0, size, step)
        )

    rows, cols = span(cy, 168, 56), span(cx, 280, 56)
    assert layout.smem_bytes == 4 * (rows * cols + rows * 56)
    # less room: 8-patch tiles, the taller of the two (its first pass, along rows, makes
    # fewer halo rows); then global memory and pass 1
    smaller = layout_of((down, same), (13, 0), 14, layout.smem_bytes - 1)
    row = dict(zip(FIELDS, smaller.desc[0]))
    assert (row["TILED"], row["TILE_PH"], row["TILE_PW"]) == (1, 4, 2)
    assert smaller.tiles == 3 * 10 + 1 and smaller.mid_bytes == 0
    spilled = layout_of((down, same), (13, 0), 14, 4 * 14 * 14 - 1)
    assert [int(r[FIELDS.index("TILED")]) for r in spilled.desc] == [0, 0]
    assert spilled.mid_bytes == 280 * 200 * 3  # pass 1 writes the global intermediate
    assert layout_of((down,), (13, 0)).tiles == 0  # resize-only launches have no tiles


def test_layout_gives_columns_first_images_wide_tiles() -> None:
    # the same image turned: a vertical first pass makes halo columns, so where 4 x 4 does
    # not fit the wide 8-patch tile wins, and the tall one for rows first
    tall = ImageJob(in_w=300, in_h=900, ch=3, out_w=280, out_h=840, patches=1200, grid_w=20)
    wide = ImageJob(in_w=900, in_h=300, ch=3, out_w=840, out_h=280, patches=1200, grid_w=60)
    got = []
    for job in (tall, wide):
        full = layout_of((job,), (13, 0), 14)
        row = dict(zip(FIELDS, layout_of((job,), (13, 0), 14, full.smem_bytes - 1).desc[0]))
        got.append(tuple(int(row[f]) for f in ("PASS1", "TILE_PH", "TILE_PW")))
        assert (
            int(full.desc[0][FIELDS.index("TILE_PH")]),
            int(full.desc[0][FIELDS.index("TILE_PW")]),
        ) == (4, 4)
    assert got == [(2, 2, 4), (1, 4, 2)]


def test_layout_groups_tiles_by_channels_for_one_launch_each() -> None:
    rgb = ImageJob(in_w=56, in_h=28, ch=3, out_w=56, out_h=28, patches=8, grid_w=4)
    gray = ImageJob(in_w=112, in_h=56, ch=1, out_w=112, out_h=56, patches=32, grid_w=8)
    rgba = ImageJob(in_w=56, in_h=56, ch=4, out_w=56, out_h=56, patches=16, grid_w=4)
    layout = layout_of((rgb, gray, rgba, rgb), (13, 0), 14)
    starts = [int(r[FIELDS.index("TILE_START")]) for r in layout.desc]
    # gray first (2 tiles), then both RGB images (1 each), then RGBA (1); all unresized and
    # tiled, so each goes to the plain kernel
    assert layout.tile_groups == ((1, "plain", 0, 2), (3, "plain", 2, 2), (4, "plain", 4, 1))
    assert starts == [2, 0, 4, 3] and layout.tile_image.tolist() == [1, 1, 0, 3, 2]
    # a resized RGB image: its own launch of the general kernel, before the plain one
    down = ImageJob(in_w=80, in_h=40, ch=3, out_w=56, out_h=28, patches=8, grid_w=4)
    mixed = layout_of((rgb, down, rgb), (13, 0), 14)
    assert mixed.tile_groups == ((3, "general", 0, 1), (3, "plain", 1, 2))
    assert mixed.tile_image.tolist() == [1, 0, 2]
    # with tensor cores the resized RGB images take the MMA kernel (the tall one passes
    # vertically first), and so does RGBA, in a launch of its own; an odd patch still takes
    # the general one
    tall = ImageJob(in_w=30, in_h=100, ch=3, out_w=28, out_h=56, patches=8, grid_w=2)
    rgba_down = ImageJob(in_w=80, in_h=40, ch=4, out_w=56, out_h=28, patches=8, grid_w=4)
    cores = layout_of((rgb, down, tall, rgba_down), (13, 0), 14, tensor_cores=True)
    assert [r[FIELDS.index("PASS1")] for r in cores.desc[1:3]] == [1, 2]
    assert [g[:2] for g in cores.tile_groups] == [(3, "plain"), (3, "mma"), (4, "mma")]
    _, _, first, count = cores.tile_groups[1]
    assert set(cores.tile_image[first : first + count].tolist()) == {1, 2}
    assert cores.mma_smem_bytes > 0
    odd = ImageJob(in_w=80, in_h=40, ch=3, out_w=60, out_h=30, patches=8, grid_w=4)
    assert layout_of((odd,), (13, 0), 15, tensor_cores=True).tile_groups[0][1] == "general"
    # untiled (no shared memory): the general kernel reads global memory, a patch a tile
    assert layout_of((rgb,), (13, 0), 14, 0).tile_groups == ((3, "general", 0, 8),)


@pytest.mark.parametrize(("in_size", "out_size"), [(4000, 2073), (1536, 1349), (30, 56), (7, 1)])
def test_weight_words_hold_the_q22_weights_by_bytes(in_size: int, out_size: int) -> None:
    # the MMA passes' A words: byte q of input i's weight at word (i - (xmin & ~3)) // 4
    from mmwire.kernels._descriptors import _weight_words

    c = bicubic_coefficients(in_size, out_size)
    words = _weight_words(in_size, out_size)
    raw = words.view(np.uint32).astype(np.int64)
    planes = (raw[..., None] >> (8 * np.arange(4))) & 255  # (o, 3, m, 4) bytes
    rows = planes.reshape(out_size, 3, -1)  # (o, 3, 4 m): inputs from xmin & ~3
    b2 = np.where(rows[:, 2] >= 128, rows[:, 2] - 256, rows[:, 2])  # the signed plane
    weights = rows[:, 0] + (rows[:, 1] << 8) + (b2 << 16)
    for o in range(out_size):
        at = c.xmin[o] & 3
        assert weights[o, at : at + c.n[o]].tolist() == c.k[o, : c.n[o]].tolist()
        rest = np.delete(weights[o], np.arange(at, at + c.n[o]))
        assert not rest.any()  # nothing outside the taps
    assert words.shape == (out_size, 3, (c.k.shape[1] + 6) // 4)


def _dense_weights(c: Any, in_size: int, out_size: int) -> np.ndarray[Any, Any]:
    """An axis's Q22 weights as a dense (outputs, inputs) matrix."""
    dense = np.zeros((out_size, in_size), np.int64)
    for o in range(out_size):
        dense[o, c.xmin[o] : c.xmin[o] + c.n[o]] = c.k[o, : c.n[o]]
    return dense


def _from_planes(planes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Weights from their three byte planes (the first axis), the high one signed."""
    high = np.where(planes[2] >= 128, planes[2] - 256, planes[2])
    out: np.ndarray[Any, Any] = planes[0] + (planes[1] << 8) + (high << 16)
    return out


def _word_inputs(half: int, lt: int, rgb: bool) -> list[int]:
    """The inputs of a lane's word of k in a 32-input step (its half 0 or 1, the lane's
    place t = lt in its group): 16 half + 4 t + byte, or for a raw RGB first pass (rgb)
    4 t + (0, 1, 16, 17), then 4 t + (2, 3, 18, 19)."""
    if rgb:
        return [4 * lt + 2 * half + e for e in (0, 1, 16, 17)]
    return [16 * half + 4 * lt + e for e in range(4)]


def _block_weights(
    dense: np.ndarray[Any, Any], o0: int, outputs: int, tile_end: int, at: int, k: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """What a block of ``outputs`` outputs from ``o0`` should hold over inputs ``at`` ..
    ``at + k`` (0 past the tile and the axis), and its live outputs' whole rows."""
    out_size, in_size = dense.shape
    want = np.zeros((outputs, k), np.int64)
    live = dense[o0 : min(o0 + outputs, tile_end, out_size)]
    want[: live.shape[0], : max(0, min(k, in_size - at))] = live[:, at : at + k]
    return want, live


@pytest.mark.parametrize("rgb", [False, True])
@pytest.mark.parametrize(
    ("in_size", "out_size", "patch", "tile"),
    [(4000, 2073, 14, 4), (3000, 1460, 14, 5), (30, 56, 14, 1)],
)
def test_mma_fragments_hold_each_blocks_weights_in_lane_order(
    in_size: int, out_size: int, patch: int, tile: int, rgb: bool
) -> None:
    # the A fragments of each tile's M-blocks, read back through the PTX layout of mma
    # m16n8k32 (lane 4 g + t, word r: row g + 8 (r & 1), k 16 (r >> 1) + 4 t + byte, or
    # for a raw RGB first pass the inputs _word_inputs says), are the Q22 weights of the
    # block's 16 outputs over its span; past the tile (the next tile's outputs, in its
    # last block) and past the axis they are 0
    from mmwire.kernels._abi import MMA_KS
    from mmwire.kernels._descriptors import _mma_axis

    c = bicubic_coefficients(in_size, out_size)
    dense = _dense_weights(c, in_size, out_size)
    grid = -(-out_size // patch)
    tiles = -(-grid // tile)
    spans, frags = _mma_axis(in_size, out_size, tile * patch, tiles, False, rgb)
    mb = -(-tile * patch // 16)
    assert spans.shape == (tiles, 1 + 2 * mb)
    assert frags.shape == (tiles, mb, 3, MMA_KS, 32, 4)
    raw = frags.view(np.uint32).astype(np.int64)
    planes = (raw[..., None] >> (8 * np.arange(4))) & 255  # (tiles, mb, q, s, lane, r, byte)
    k32 = 32 * MMA_KS
    for t in range(tiles):
        for j in range(mb):
            at, steps = spans[t, 1 + 2 * j : 3 + 2 * j]
            a = np.zeros((3, 16, k32), np.int64)
            for lane in range(32):
                g, lt = divmod(lane, 4)
                for r in range(4):
                    row, ks = g + 8 * (r & 1), np.array(_word_inputs(r >> 1, lt, rgb))
                    for st in range(MMA_KS):
                        a[:, row, 32 * st + ks] = planes[t, j, :, st, lane, r]
            o0, tile_end = t * tile * patch + 16 * j, (t + 1) * tile * patch
            want, live = _block_weights(dense, o0, 16, tile_end, at, k32)
            assert (_from_planes(a) == want).all(), (t, j)
            assert at % 4 == 0 and 1 <= steps <= MMA_KS
            assert not live[:, :at].any() and not live[:, at + 32 * steps :].any()  # the span
        # the inputs the tile uses: to the last tap of its last output in the axis
        end = min((t + 1) * tile * patch, out_size) - 1
        assert spans[t, 0] == c.xmin[end] + c.n[end] - spans[t, 1]


@pytest.mark.parametrize("rgb", [False, True])
@pytest.mark.parametrize(
    ("in_size", "out_size", "patch", "tile"),
    [(4000, 2073, 14, 5), (3000, 1554, 14, 3), (140, 56, 14, 1)],
)
def test_narrow_fragments_hold_each_blocks_weights_in_lane_order(
    in_size: int, out_size: int, patch: int, tile: int, rgb: bool
) -> None:
    # the B fragments of each tile's narrow blocks, read back through the PTX layout of mma
    # m16n8k32 (lane 4 g + t, word r: column g, k 16 r + 4 t + byte, or _word_inputs' for
    # a raw RGB first pass), are the Q22 weights of the block's 8 outputs over its one
    # 32-input step; past the tile and the axis 0
    from mmwire.kernels._descriptors import _mma_axis, _narrow_fits

    dense = _dense_weights(bicubic_coefficients(in_size, out_size), in_size, out_size)
    grid = -(-out_size // patch)
    tiles = -(-grid // tile)
    assert _narrow_fits(in_size, out_size, tile * patch, tiles)
    spans, frags = _mma_axis(in_size, out_size, tile * patch, tiles, True, rgb)
    mb = -(-tile * patch // 8)
    assert spans.shape == (tiles, 1 + 2 * mb) and frags.shape == (tiles, mb, 3, 32, 2)
    raw = frags.view(np.uint32).astype(np.int64)
    planes = (raw[..., None] >> (8 * np.arange(4))) & 255  # (tiles, mb, q, lane, r, byte)
    for t in range(tiles):
        for j in range(mb):
            at, steps = spans[t, 1 + 2 * j : 3 + 2 * j]
            b = np.zeros((3, 8, 32), np.int64)
            for lane in range(32):
                g, lt = divmod(lane, 4)
                for r in range(2):
                    b[:, g, _word_inputs(r, lt, rgb)] = planes[t, j, :, lane, r]
            o0, tile_end = t * tile * patch + 8 * j, (t + 1) * tile * patch
            want, live = _block_weights(dense, o0, 8, tile_end, at, 32)
            assert (_from_planes(b) == want).all(), (t, j)
            assert at % 4 == 0 and steps == 1
            assert not live[:, :at].any() and not live[:, at + 32 :].any()  # the span


def test_mma_tiles_of_the_mixed_batchs_photos_are_the_shapes_measured_fastest() -> None:
    # the fastest shapes on the mixed batch: 2 x 8 for the 4000 x 3000 photo (71.3 KiB,
    # which the 71.5 KiB budget lets in) and 3 x 8 for the 3000 x 2000 one; a larger
    # budget gives fewer, larger tiles
    from mmwire.kernels._descriptors import MMA_SMEM_BYTES

    shapes = []
    for (w, h), (ow, oh, gw, gh) in {
        (4000, 3000): (2073, 1554, 150, 112),
        (3000, 2000): (2202, 1468, 158, 106),
    }.items():
        job = ImageJob(w, h, 3, ow, oh, grid_w=gw, patches=gw * gh)
        layout = layout_of((job,), (13, 0), 14, tensor_cores=True)
        row = layout.desc[0]
        shapes.append((int(row[FIELDS.index("TILE_PH")]), int(row[FIELDS.index("TILE_PW")])))
        assert 0 < layout.mma_smem_bytes <= MMA_SMEM_BYTES
        big = layout_of((job,), (13, 0), 14, tensor_cores=True, mma_smem=MMA_SMEM_BYTES * 2)
        assert big.mma_smem_bytes > MMA_SMEM_BYTES and big.tiles < layout.tiles
    assert shapes == [(2, 8), (3, 8)]


@pytest.mark.parametrize(
    ("size", "out", "ch"),
    [
        ((4000, 3000), (2073, 1554), 3),
        ((4000, 3000), (2073, 1554), 4),
        ((4000, 3000), (2073, 1554), 1),
        ((800, 2400), (518, 1555), 3),  # Pillow resizes it vertically first
        ((1536, 1024), (1349, 899), 3),
        ((3000, 600), (1432, 286), 4),
        ((700, 500), (267, 191), 3),  # shrunk 2.6x: most shapes need two steps
        ((611, 300), (190, 150), 3),  # 2 to 4 patches wide need three steps, 5 do not
        ((90, 60), (150, 100), 1),  # enlarged, a grid of 8 x 11 patches
    ],
)
def test_mma_tile_search_finds_the_least_work_of_all_allowed_shapes(
    size: tuple[int, int], out: tuple[int, int], ch: int
) -> None:
    # _mma_tile_for stops a row of shapes at the first that does not fit and the search at a
    # height whose narrowest shape does not; every shape, tried, gives the same answer
    from mmwire.kernels import _descriptors as D

    p = 14
    gw, gh = -(-out[0] // p), -(-out[1] // p)
    job = ImageJob(*size, ch, *out, grid_w=gw, patches=gw * gh)
    v_first = D._passes(job, (13, 0))[0] == D._VERTICAL
    measure = D._mma_measure(job, p, v_first, D._mma_raw(job, v_first, 0))
    best = None
    for a in range(1, gh + 1):
        for b in range(1, gw + 1):
            m = measure((a, b))
            if m is None or m[0] > D.MMA_SMEM_BYTES:
                continue
            if a > D.MMA_TILE_TALL * b or b > D.MMA_TILE_WIDE * a:
                continue
            if max(a, b) > D.MMA_TILE_SIDE // p:
                continue
            tiles = -(-gh // a) * -(-gw // b)
            work = tiles * (ch * m[1] * a * b * p * p / 128 + D.MMA_TILE_OVERHEAD)
            key = (work, -b, a)
            if best is None or key < best[0]:
                best = (key, (a, b, m[0]))
    assert best is not None
    assert D._mma_tile_for(job, p, D.MMA_SMEM_BYTES, measure) == best[1]


def test_layout_rejects_impossible_jobs() -> None:
    with pytest.raises(ValueError, match="ch 1, 3 or 4"):
        layout_of((ImageJob(in_w=4, in_h=4, ch=2, out_w=2, out_h=2),))
    with pytest.raises(ValueError, match="positive"):
        layout_of((ImageJob(in_w=4, in_h=0, ch=3, out_w=2, out_h=2),))


# the geometry cases' index logic is one 16-bit kernel for bf16 and fp16 (only the table
# differs, and every other case checks fp16's): bf16 stands for both there
_GEOMETRY = ("tensor_core_scales", "narrow_blocks", "tiny_and_extreme")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        (name, dtype)
        for name in CASES
        for dtype in DTYPES
        if not (dtype == torch.float16 and name in _GEOMETRY)
    ],
    ids=str,
)
def test_host_kernels_equal_the_cpu_path(
    host: HostLauncher, rng: np.random.Generator, name: str, dtype: torch.dtype
) -> None:
    items = case(name, rng)
    want_pv, want_grid = reference(items, dtype)
    got_pv, got_grid = kernels(items, dtype, "cpu", host)
    assert torch.equal(got_grid, want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.fixture(scope="module")
def host_tiles(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> HostLauncher:
    """The build whose rows are whole 32 x 48 tiles (TILE_LAYOUT)."""
    root = build_root(request, tmp_path_factory)
    return HostLauncher(shared_build(root, layout=TILE_LAYOUT), layout=TILE_LAYOUT)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", TILED_CASES)
def test_host_tiled_rows_equal_the_cpu_path(
    request: pytest.FixtureRequest, rng: np.random.Generator, name: str, dtype: torch.dtype
) -> None:
    # InternVL's tiles and thumbnail and Gemma 3's image and crops: regions of one upload,
    # resized BICUBIC or BILINEAR, each (3, h, w) row equal to the CPU path's (itself == to
    # transformers' processors); written as tiles by the tile's build, or through Kimi's
    items = case(name, rng)
    tile = items[0][1](64, 64).row_shape[1:]
    direct = region_layout(tile) == TILE_LAYOUT
    assert direct == (name in ("internvl", "gemma")), tile
    launcher = request.getfixturevalue("host_tiles" if direct else "host")
    want_pv, want_grid = reference(items, dtype)
    got_pv, got_grid = kernels(items, dtype, "cpu", launcher)
    assert torch.equal(got_grid, want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("name", ["internvl", "gemma"])
def test_tiled_cases_hold_tiles_of_three_steps(rng: np.random.Generator, name: str) -> None:
    # the tile build's MMA blocks may take three 32-input steps (mma_steps), which large
    # downscales to a tile need (InternVL's thumbnails, Gemma 3's images); the cases that
    # test_host_tiled_rows_equal_the_cpu_path holds equal have such tiles, beside tiles of
    # one and two steps; other builds keep two
    from mmwire.kernels._abi import RECORD_FLAGS, mma_steps
    from mmwire.kernels._descriptors import _R, MMA_SMEM_BYTES
    from mmwire.kernels._regions import _plan
    from mmwire.materialize import regions_of

    items = case(name, rng)
    shapes = tuple((im.shape[0], im.shape[1], im.shape[2]) for im, _ in items)
    specs = tuple(cfg(im.shape[1], im.shape[0]) for im, cfg in items)
    regions = tuple(tuple(regions_of(s)) for s in specs)
    plan = _plan(shapes, specs, regions, None, None, True, MMA_SMEM_BYTES)
    assert plan.output == TILE_LAYOUT
    flags = plan.layout.tile_records[:, _R["R_FLAGS"]]
    mma = flags[(flags & RECORD_FLAGS["R_PLAIN"]) == 0]
    three = (mma & RECORD_FLAGS["R_THREE_STEPS"]) != 0
    assert three.any() and (~three).any(), np.unique(flags)
    assert (three <= ((mma & RECORD_FLAGS["R_TWO_STEPS"]) != 0)).all()  # three implies two
    # an RGB image with blocks of three steps is staged as planes, not raw (the raw RGB
    # pass is compiled for two at most)
    records = plan.layout.tile_records
    jobs = np.repeat([s[2] for s in shapes], [len(r) for r in regions])  # a job a region
    channels = jobs[records[:, _R["R_IMAGE"]]]
    raw = (flags & RECORD_FLAGS["R_RAW"]) != 0
    assert not (raw & ((flags & RECORD_FLAGS["R_THREE_STEPS"]) != 0) & (channels == 3)).any()
    assert mma_steps(TILE_LAYOUT) == 3 and mma_steps(OutputLayout()) == 2


@pytest.mark.parametrize(
    ("family", "size"), [("gemma-3", (4000, 3000)), ("internvl3", (1920, 1080))]
)
def test_large_photos_take_the_tensor_cores_in_tile_modules(
    family: str, size: tuple[int, int]
) -> None:
    # Gemma 3 brings a 4000 x 3000 photo to 896 x 896 (BILINEAR), InternVL a 1920 x 1080
    # one to its 448 x 448 thumbnail (BICUBIC): blocks of three steps, which the tile
    # modules take on the tensor cores rather than in the general kernel
    from mmwire.kernels._descriptors import MMA_SMEM_BYTES
    from mmwire.kernels._regions import _plan
    from mmwire.materialize import regions_of, spec_for

    spec = spec_for(family)(*size)
    regions = tuple(regions_of(spec))
    plan = _plan(((size[1], size[0], 3),), (spec,), (regions,), None, None, True, MMA_SMEM_BYTES)
    assert [kind for _, kind, _, _ in plan.layout.tile_groups] == ["mma"]


def test_regions_that_do_not_fit_are_refused_before_any_launch() -> None:
    from mmwire.kernels import Region, preprocess_regions
    from mmwire.materialize import InternVLConfig

    cfg = InternVLConfig(tile_height=32, tile_width=48, max_tiles=4)
    src = torch.zeros(2 * 40 * 50 * 3, dtype=torch.uint8)
    shapes, specs = [(40, 50, 3)] * 2, [cfg(50, 40)] * 2
    whole = Region(0, 0, 50, 40, 48, 32)
    out = torch.empty((4, 3, 32, 48))
    cases = [
        ([[Region(10, 0, 50, 40, 48, 32)], [whole]], out, None, "not a box"),  # past the edge
        ([[Region(0, 0, 50, 40, 40, 32)], [whole]], out, None, "whole 48x32"),  # not a tile
        ([[whole], [whole]], torch.empty((4, 3, 48, 32)), None, "contiguous"),
        ([[whole], [whole]], out.double(), None, "float32"),
        ([[whole], [whole]], out, [0, 0], "overlap"),
        ([[whole], [whole]], out, [0, 4], "do not fit"),
    ]
    for regions, dst, rows, message in cases:
        with pytest.raises(ValueError, match=message):
            preprocess_regions(src, shapes, specs, regions, dst, rows=rows)
    rgba = torch.zeros(2 * 40 * 50 * 4, dtype=torch.uint8)  # composited on the producer
    with pytest.raises(ValueError, match="RGBA"):
        preprocess_regions(rgba, [(40, 50, 4)] * 2, specs, [[whole], [whole]], out)


def test_host_pitches_mirror_the_kernels(host_lib: Path) -> None:
    # the host sizes each tile's shared memory with _plain_pitch and _mma_pitch: a pitch
    # the kernel lays out wider would overflow it, a narrower one waste it
    from mmwire.kernels._descriptors import _mma_pitch, _plain_pitch

    lib = ctypes.CDLL(str(host_lib))
    for n in range(1, 2000):
        assert lib.host_plain_pitch(n) == _plain_pitch(n), n
        assert lib.host_mma_pitch(n) == _mma_pitch(n), n
    # the plain rows' pitch keeps room for a skew of 15 and lies 80 or 112 past 128
    assert all(
        _plain_pitch(n) >= n + 15 and _plain_pitch(n) % 128 in (80, 112) for n in range(1, 2000)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_launches_compute_the_normalise_step_where_it_was_proved(
    dtype: torch.dtype,
) -> None:
    # so the cases above run the affine path in the 16-bit types (and the test below the
    # tables)
    stats = (Normalisation((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),)
    mode = {torch.bfloat16: 1, torch.float16: 2}[dtype]
    for affine, want in ((True, mode), (False, 0)):
        rows = _ops._device_tables(stats, dtype, torch.device("cpu"), affine)
        assert int(rows[0, NORM_VALUES : NORM_VALUES + 2].view(torch.int32)[0]) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "name", ["rgb_distinct", "rgba_chessboard", "gray", "odd_patch", "plain_and_mma"]
)
def test_host_16_bit_kernels_through_the_tables_equal_the_cpu_path(
    host_lib: Path,
    rng: np.random.Generator,
    name: str,
    dtype: torch.dtype,
) -> None:
    # with no affine form claimed the 16-bit kernels read the tables, as fp32 always does
    tables = HostLauncher(host_lib, affine_normalise=False)
    items = case(name, rng)
    want_pv, _ = reference(items, dtype)
    got_pv, _ = kernels(items, dtype, "cpu", tables)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_host_kernels_compiled_for_the_patch_size_equal_the_cpu_path(
    host14: HostLauncher, rng: np.random.Generator, dtype: torch.dtype
) -> None:
    # p a constant: plain, MMA and mixed launches, both pass orders, RGBA, gray
    for name in ("rgb_distinct", "rgba_chessboard", "pass_order_flip", "plain_and_mma"):
        items = case(name, rng)
        assert {cfg.patch_size for _, cfg in items} == {14}
        want_pv, _ = reference(items, dtype)
        got_pv, _ = kernels(items, dtype, "cpu", host14)
        assert differing(got_pv, want_pv) == 0, name


@pytest.mark.parametrize("block", [(1, 1), (14, 14), (32, 1), (3, 11)])
@pytest.mark.parametrize("name", ["rgb_distinct", "pass_order_flip", "mixed_configs"])
def test_host_fused_kernel_gives_the_same_bytes_for_any_block_shape(
    host: HostLauncher, rng: np.random.Generator, name: str, block: tuple[int, int]
) -> None:
    items = case(name, rng)
    want_pv, _ = reference(items, torch.float32)
    host.block = block
    try:
        got_pv, _ = kernels(items, torch.float32, "cpu", host)
    finally:
        host.block = (5, 3)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("warps", [1, 3, 8])
def test_host_mma_kernel_gives_the_same_bytes_for_any_number_of_warps(
    host: HostLauncher, rng: np.random.Generator, warps: int
) -> None:
    items = case("tensor_core_scales", rng)
    want_pv, _ = reference(items, torch.bfloat16)
    host.mma_block = (32, warps)
    try:
        got_pv, _ = kernels(items, torch.bfloat16, "cpu", host)
    finally:
        host.mma_block = (32, 2)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("warps", [1, 8])
def test_host_mma_kernel_stages_rows_of_up_to_twice_a_warps_granules(
    host: HostLauncher, rng: np.random.Generator, warps: int
) -> None:
    # raw windows whose rows take 33 to 64 16-byte granules: copy_rows gives each thread
    # two predicated copies a row, a warp a row (one row a step at one warp, eight at 8)
    items = [
        (rng.integers(0, 256, (150, 700, 3), dtype=np.uint8), KimiConfig(in_patch_limit=128)),
        (rng.integers(0, 256, (240, 600, 3), dtype=np.uint8), KimiConfig(in_patch_limit=160)),
    ]
    specs = [cfg(im.shape[1], im.shape[0]) for im, cfg in items]
    shapes = tuple(im.shape for im, _ in items)
    plan = _ops._plan(
        shapes, tuple(specs), None, None, _ops.TILE_SMEM_BYTES, True, _ops.MMA_SMEM_BYTES
    )
    rec = plan.layout.tile_records
    raw = (rec[:, RECORD_FIELDS.index("R_FLAGS")] & _RAW) != 0
    granules = (3 * rec[raw, RECORD_FIELDS.index("R_USED_W")] + 12 + 15) // 16
    assert ((granules > 32) & (granules <= 64)).sum() >= 20
    want_pv, _ = reference(items, torch.bfloat16)
    host.mma_block = (32, warps)
    try:
        got_pv, _ = kernels(items, torch.bfloat16, "cpu", host)
    finally:
        host.mma_block = (32, 2)
    assert differing(got_pv, want_pv) == 0


def test_host_mma_kernel_takes_a_source_off_a_word(
    host: HostLauncher, rng: np.random.Generator
) -> None:
    # tiles planned raw (R_RAW) need the source on a word (a raw RGB first pass's weights
    # are in split_rgb8's order, which planes staged from it could not give): one byte
    # off, preprocess_packed copies it onto one, and the bytes are the same
    items = case("tensor_core_scales", rng)
    want_pv, _ = reference(items, torch.bfloat16)
    src, shapes = pack([torch.from_numpy(im) for im, _ in items])
    off = torch.empty(src.numel() + 1, dtype=torch.uint8)[1:]
    off.copy_(src)
    specs = [cfg(im.shape[1], im.shape[0]) for im, cfg in items]
    plan = _ops._plan(
        tuple(shapes),
        tuple(specs),
        None,
        None,
        _ops.TILE_SMEM_BYTES,
        True,
        _ops.mma_smem(src.device),
    )
    assert (plan.layout.tile_records[:, RECORD_FIELDS.index("R_FLAGS")] & _RAW).any()
    for source in (src, off):
        got_pv, _ = preprocess_packed(source, shapes, specs, torch.bfloat16, launcher=host)
        assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_plain_launches_ask_for_shared_memory_only_where_they_stage(
    host_lib: Path, rng: np.random.Generator, dtype: torch.dtype
) -> None:
    # fp32 gray and RGB stage their tiles' pixels, so their launch must ask for them (the
    # host build fails a tile that outgrows what its launch asked); RGBA and the 16-bit
    # types read the source and ask for none
    asked: dict[tuple[str, int], int] = {}

    class Recording(HostLauncher):
        def fused(self, bits: int, channels: int, kind: Any, *rest: Any, **kw: Any) -> None:
            asked[kind, channels] = rest[2]  # after grid and block: the dynamic shared memory
            super().fused(bits, channels, kind, *rest, **kw)

    u8 = lambda *s: rng.integers(0, 256, s, dtype=np.uint8)  # noqa: E731
    items = [(u8(h, w, c), SMALL) for h, w, c in ((60, 90, 3), (45, 70, 1), (50, 66, 4))]
    want_pv, _ = reference(items, dtype)
    got_pv, _ = kernels(items, dtype, "cpu", Recording(host_lib))
    assert differing(got_pv, want_pv) == 0
    stages = dtype == torch.float32
    staged = {key: smem > 0 for key, smem in asked.items()}
    assert staged == {("plain", 1): stages, ("plain", 3): stages, ("plain", 4): False}


@pytest.mark.parametrize("skew", [0, 2], ids=["out-on-16-bytes", "out-on-8-bytes"])
def test_host_fp32_patches_are_the_same_bytes_for_either_store_width(
    host: HostLauncher, rng: np.random.Generator, skew: int
) -> None:
    # fp32 units of four values (16-byte stores) need `out` on 16 bytes; on 8, the pairs.
    # The host launcher fails any launch that stores off its width's alignment
    items = case("plain_and_mma", rng)
    want_pv, _ = reference(items, torch.float32)
    got_pv = kernels_into(items, torch.float32, "cpu", skew, host)
    assert got_pv.data_ptr() % 16 == (0 if skew == 0 else 8)
    assert differing(got_pv, want_pv) == 0


def test_host_kernels_without_tensor_cores_take_the_general_kernel(
    host_lib: Path, rng: np.random.Generator
) -> None:
    items = case("tensor_core_scales", rng)
    want_pv, _ = reference(items, torch.float32)
    got_pv, _ = kernels(items, torch.float32, "cpu", HostLauncher(host_lib, tensor_cores=False))
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("name", ["rgb_distinct", "rgba_chessboard", "pass_order_flip"])
def test_host_kernels_through_the_global_intermediate_equal_the_cpu_path(
    host: HostLauncher, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # no tile fits in 0 bytes: every two-pass image takes pass 1 and the global intermediate
    monkeypatch.setattr(_ops, "TILE_SMEM_BYTES", 0)
    items = case(name, rng)
    want_pv, want_grid = reference(items, torch.bfloat16)
    got_pv, got_grid = kernels(items, torch.bfloat16, "cpu", host)
    assert torch.equal(got_grid, want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize(
    ("shape", "size"),
    [
        ((48, 64, 3), (56, 42)),  # down both
        ((23, 17, 3), (90, 61)),  # up both
        ((40, 300, 4), (71, 40)),  # width only, RGBA: one pass, premultiplied
        ((300, 40, 1), (40, 77)),  # height only, gray
        ((500, 30, 3), (20, 170)),  # tall: vertical first under 13.0
        ((33, 44, 4), (44, 33)),  # no-op: a copy, no premultiply
        ((1, 1, 3), (5, 3)),
    ],
)
def test_host_resize_equals_pillow(
    host: HostLauncher,
    rng: np.random.Generator,
    shape: tuple[int, int, int],
    size: tuple[int, int],
) -> None:
    img = rng.integers(0, 256, shape, dtype=np.uint8)
    if shape[2] == 4:
        img[::3, :, 3] = 0
        img[1::3, :, 3] = 255
    src, shapes = pack([torch.from_numpy(img)])
    (got,) = resize_packed(src, shapes, [size], launcher=host)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[shape[2]]
    want = np.asarray(Image.fromarray(img[..., 0] if shape[2] == 1 else img, mode).resize(size))
    assert np.array_equal(got.numpy(), want.reshape(got.shape))


@pytest.mark.parametrize("pillow", [(12, 3), (13, 0)])
def test_host_resize_follows_a_pinned_pillow_version(
    host: HostLauncher, rng: np.random.Generator, pillow: tuple[int, int]
) -> None:
    img = rng.integers(0, 256, (600, 200, 3), dtype=np.uint8)  # 600x200 -> 190x100 flips
    src, shapes = pack([torch.from_numpy(img)])
    (got,) = resize_packed(src, shapes, [(190, 100)], pillow=pillow, launcher=host)
    assert np.array_equal(got.numpy(), resize_reference(img, 190, 100, pillow=pillow))


def test_both_kernel_modules_say_which_extra_installs_cupy() -> None:
    import importlib.util

    from mmwire.kernels import _launch, _video
    from mmwire.transport.errors import BackendUnavailable

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    for module in (_launch._module, _video._module):
        with pytest.raises(BackendUnavailable, match=r"install mmwire\[cuda12\]"):
            module(0)


def test_kernel_entry_points_reject_bad_input(host: HostLauncher) -> None:
    img = torch.zeros((20, 30, 3), dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        pack([img.float()])
    with pytest.raises(ValueError, match="1/3/4"):
        pack([torch.zeros((4, 4, 2), dtype=torch.uint8)])
    src, shapes = pack([img])
    spec = SMALL(31, 20)  # a plan for another size
    with pytest.raises(ValueError, match="plan says"):
        preprocess_packed(src, shapes, [spec], launcher=host)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        preprocess_packed(src, shapes, [SMALL(30, 20)], torch.int32, launcher=host)
    with pytest.raises(ValueError, match="bytes"):
        preprocess_packed(src[:100], shapes, [SMALL(30, 20)], launcher=host)
    # the launcher still serves after the refusals
    pv, _ = preprocess_packed(src, shapes, [SMALL(30, 20)], launcher=host)
    assert pv.shape[0] == SMALL(30, 20).plan.grid.patches


def test_host_build_is_warning_free(host_lib: Path) -> None:
    # every build is -Wall -Werror: an unused variable or sign mix-up fails the fixture
    assert host_lib.stat().st_size > 0


def test_patches_land_at_the_given_rows_and_overlaps_are_refused(
    host: HostLauncher, rng: np.random.Generator
) -> None:
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((150, 97), (61, 40))]
    specs = [SMALL(im.shape[1], im.shape[0]) for im in images]
    n0, n1 = (s.plan.grid.patches for s in specs)
    src, shapes = pack([torch.from_numpy(im) for im in images])
    out = torch.full((n0 + n1 + 5, 3, 14, 14), 7.0)
    preprocess_packed(src, shapes, specs, out=out, rows=[n1 + 5, 0], launcher=host)
    want, _ = kernels([(im, SMALL) for im in images], torch.float32, "cpu", host)
    assert torch.equal(out[n1 + 5 :], want[:n0]) and torch.equal(out[:n1], want[n0:])
    assert bool((out[n1 : n1 + 5] == 7.0).all())  # the gap is untouched
    with pytest.raises(ValueError, match="overlap"):
        preprocess_packed(src, shapes, specs, out=out, rows=[0, 1], launcher=host)
    with pytest.raises(ValueError, match="do not fit"):
        preprocess_packed(src, shapes, specs, out=out, rows=[n1 + 6, 0], launcher=host)
    skewed = torch.empty((n0 + n1) * 3 * 14 * 14 + 1)[1:].view(n0 + n1, 3, 14, 14)
    with pytest.raises(ValueError, match="multiple of 8 bytes"):  # a store would fault
        preprocess_packed(src, shapes, specs, out=skewed, launcher=host)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", QWEN_CASES)
def test_host_kernels_write_qwen_rows_equal_to_the_cpu_path(
    host_qwen: HostLauncher, rng: np.random.Generator, name: str, dtype: torch.dtype
) -> None:
    # the CPU path is itself checked == against transformers' processor (test_families.py)
    items = case(name, rng)
    want_pv, want_grid = reference(items, dtype)
    got_pv, got_grid = kernels(items, dtype, "cpu", host_qwen)
    assert got_pv.shape == want_pv.shape and got_pv.ndim == 2
    assert torch.equal(got_grid, want_grid)
    assert differing(got_pv, want_pv) == 0


@pytest.mark.parametrize("skew", [0, 2], ids=["16-byte", "8-byte"])
def test_host_qwen_rows_are_the_same_for_either_store_width(
    host_qwen: HostLauncher, rng: np.random.Generator, skew: int
) -> None:
    items = case("qwen_plain_and_mma", rng)
    want_pv, _ = reference(items, torch.float32)
    got = kernels_into(items, torch.float32, "cpu", skew, host_qwen)
    assert differing(got, want_pv) == 0


def test_one_launch_refuses_two_output_layouts(host: HostLauncher) -> None:
    image = np.zeros((60, 80, 3), np.uint8)
    items = [(image, SMALL), (image, QWEN_SMALL)]
    with pytest.raises(ValueError, match="different output layouts"):
        kernels(items, torch.float32, "cpu", host)


def test_merge_window_order_is_transformers_order() -> None:
    # patch_index (and PatchOrder in patches.cuh) against Qwen2-VL's own reshape/transpose
    from mmwire.kernels._descriptors import patch_index

    gh, gw, m = 6, 10, 2
    grid = np.arange(gh * gw).reshape(gh, gw)
    ref = grid.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)
    gy, gx = np.divmod(np.arange(gh * gw), gw)
    order = np.empty(gh * gw, np.int64)
    order[patch_index(gy, gx, gw, m)] = grid.reshape(-1)
    assert np.array_equal(order, ref)
