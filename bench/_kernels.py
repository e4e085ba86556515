"""``mmwire-bench kernels``: the CUDA pixel pipeline against the peers' torch way and Pillow.

(a) mmwire: ``mmwire.kernels.preprocess_packed`` (one launch for the whole batch; two when an
    image's tile intermediate does not fit in shared memory);
(b) the torch path peer engines use on the GPU (vLLM/SGLang processors through torchvision
    v2): per image ``F.interpolate(bicubic, antialias=True)`` on float32, ``round``/``clamp``,
    pad, affine normalise, ``view``/``permute`` patchify, cast;
(c) Pillow on the CPU (``mmwire.materialize.preprocess_images``, the exact reference);
(d) transformers' own image processor with its torchvision backend on the GPU
    (``Qwen2VLImageProcessor(device="cuda")``, ``Glm4vImageProcessor``,
    ``Gemma3ImageProcessor``, ``GotOcr2ImageProcessor`` for InternVL), the way engines run
    these families, where transformers and torchvision are installed.
Gemma 3 and InternVL rows go through ``mmwire.kernels.preprocess_regions`` (their rows are
whole tiles of regions of each image).
Also the owner's end-to-end time with the H2D upload from registered vs pageable memory,
and the kernel time against the HBM floor (bytes read + written at the device's datasheet
HBM bandwidth, and at the device-to-device copy rate measured in the same run).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mmwire.kernels import KINDS, preprocess_packed, preprocess_regions
from mmwire.kernels.reference import resample_filter, rows_are_tiles
from mmwire.materialize import (
    Gemma3Config,
    Glm4vConfig,
    InternVLConfig,
    KimiConfig,
    ModelSpec,
    QwenVLConfig,
    preprocess_images,
    regions_of,
    spec_for,
)
from mmwire.transport import PanAndScan, PreprocessSpec
from PIL import Image
from rich.console import Console
from rich.table import Table

from ._report import bar_plot, percentile, write_run

DATA = Path(__file__).resolve().parent / "data"
_HBM_BYTES_PER_S = (  # datasheets, the first name found in the device's
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM, HBM3
)


def hbm_bytes_per_s(device_name: str, measured: float) -> tuple[float, str]:
    """The HBM floor's bandwidth for a device: its datasheet's where the name is known,
    else ``measured`` (a device-to-device copy's rate); and where the number comes from."""
    for part, rate in _HBM_BYTES_PER_S:
        if part in device_name:
            return rate, f"{part} datasheet"
    return measured, "device-to-device copy"


_MIXED = [
    (640, 480),
    (1920, 1080),
    (1024, 768),
    (800, 1200),
    (3000, 2000),
    (512, 512),
    (1280, 720),
    (4000, 3000),
]  # (width, height); the two largest get resized


def _photos(sizes: list[tuple[int, int]]) -> list[np.ndarray[Any, Any]]:
    names = ("coffee.png", "astronaut.png", "chelsea.png")
    out = []
    for i, size in enumerate(sizes):
        im = Image.open(DATA / names[i % len(names)]).convert("RGB").resize(size)
        out.append(np.array(im))  # writable: torch.from_numpy warns on read-only arrays
    return out


def _device_times(fn: Any, reps: int) -> list[float]:
    """Device seconds per call, between CUDA events (after 3 warm-ups).

    A spin kernel runs first, so the host has queued the events and the launches before
    the GPU reaches them: the time is the work's, not the Python launch overhead's (that is
    in the call latency, measured separately).
    """
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        _SPIN(20_000_000)  # about 10 ms at 2 GHz
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def kernel_label(name: str) -> str:
    """A short label for one of mmwire's kernels as the profiler names it: the fused
    kernel's kind and channels (``fused mma, 3 ch``), or the resize pass."""
    m = re.search(r"fused<[^,<>]+, (\d+), (\d+)>", name)
    if m is not None:
        kinds = {v: k for k, v in KINDS.items()}
        return f"fused {kinds.get(int(m.group(2)), m.group(2))}, {m.group(1)} ch"
    m = re.search(r"resize_pass\d", name)
    return m.group(0) if m is not None else name[:40]


def _kernel_time(fn: Any, reps: int) -> tuple[float, dict[str, float]]:
    """Mean device seconds per call while mmwire's own kernels (fused, resize passes) run,
    timed by CUPTI through ``torch.profiler``: the kernel time the HBM floor is about,
    without the grid copy and the gaps between launches that the call's device time also
    holds. Launches that overlap would count once: it is the union of their intervals.
    Also each kernel's own mean seconds per call (``kernel_label``), which may overlap."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ours = [
        e
        for e in prof.events()
        if str(e.device_type).endswith("CUDA") and ("fused<" in e.name or "resize_pass" in e.name)
    ]
    if not ours:
        raise RuntimeError("the profiler saw none of mmwire's kernels")
    each: dict[str, float] = {}
    for e in ours:
        label = kernel_label(e.name)
        each[label] = each.get(label, 0.0) + (e.time_range.end - e.time_range.start) / 1e6 / reps
    union = _covered([(e.time_range.start, e.time_range.end) for e in ours]) / 1e6 / reps
    return union, each


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


_SPIN: Any = getattr(torch.cuda, "_sleep")  # noqa: B009  (private but stable: torch's own tests use it)


def _wall_times(fn: Any, reps: int, warm: int = 2) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def torch_way(
    images: list[torch.Tensor], specs: list[PreprocessSpec], dtype: torch.dtype
) -> torch.Tensor:
    """The peers' GPU path: float32 bicubic with antialias, round, pad, normalise, patchify
    (Qwen-VL's rows: by merge window, each plane twice; Gemma 3's and InternVL's: each
    region resized, bilinear or bicubic, and cut into tiles)."""
    outs = []
    for img, spec in zip(images, specs):
        if rows_are_tiles(spec):
            outs.append(_torch_tiles(img, spec, dtype))
            continue
        plan = spec.plan
        x = img.permute(2, 0, 1).unsqueeze(0).float()
        if (plan.new_width, plan.new_height) != (plan.width, plan.height):
            x = F.interpolate(
                x,
                size=(plan.new_height, plan.new_width),
                mode="bicubic",
                antialias=True,
                align_corners=False,
            )
            x = x.round().clamp(0, 255)
        x = F.pad(x, (0, plan.pad_width, 0, plan.pad_height), value=0.0)
        mean = torch.tensor(spec.image_mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(spec.image_std, device=x.device).view(1, 3, 1, 1)
        x = (x / 255.0 - mean) / std
        p = spec.patch_size
        gh, gw = plan.grid.h, plan.grid.w
        if spec.windowed:
            m, t = spec.merge_kernel[0], spec.temporal_patch_size
            x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
            x = x.reshape(-1, 3, 1, p * p).expand(-1, 3, t, p * p).reshape(-1, 3 * t * p * p)
        else:
            x = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
        outs.append(x.to(dtype))
    return torch.cat(outs)


def _torch_tiles(img: torch.Tensor, spec: PreprocessSpec, dtype: torch.dtype) -> torch.Tensor:
    """The torch way for rows that are whole tiles: each region of the image resized
    (antialiased, float32), rounded, normalised and cut into ``(3, h, w)`` tiles."""
    x = img.permute(2, 0, 1).unsqueeze(0).float()
    th, tw = spec.row_shape[1:]
    mode = resample_filter(spec)
    mean = torch.tensor(spec.image_mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(spec.image_std, device=x.device).view(1, 3, 1, 1)
    outs = []
    for r in regions_of(spec):
        y = F.interpolate(
            x[:, :, r.y : r.y + r.height, r.x : r.x + r.width],
            size=(r.out_height, r.out_width),
            mode=mode,
            antialias=True,
            align_corners=False,
        )
        y = (y.round().clamp(0, 255) * spec.rescale_factor - mean) / std
        rows, cols = r.out_height // th, r.out_width // tw
        outs.append(y.reshape(3, rows, th, cols, tw).permute(1, 3, 0, 2, 4).reshape(-1, 3, th, tw))
    return torch.cat(outs).to(dtype)


def _transformers_way(cfg: ModelSpec) -> Any:
    """transformers' torchvision-backend processor for a spec, on the GPU: a function of CHW
    uint8 device images returning ``pixel_values``; None where it is not installed."""
    if not isinstance(cfg, (QwenVLConfig, Gemma3Config, InternVLConfig)):
        return None
    try:
        import torchvision  # noqa: F401  (the backend; without it transformers falls back to Pillow)
        import transformers
    except ImportError:
        return None
    if isinstance(cfg, Gemma3Config):
        proc = transformers.Gemma3ImageProcessor(
            size={"height": cfg.height, "width": cfg.width},
            image_mean=list(cfg.image_mean),
            image_std=list(cfg.image_std),
            do_pan_and_scan=cfg.pan_and_scan is not None,
            **(
                {}
                if cfg.pan_and_scan is None
                else {
                    "pan_and_scan_min_crop_size": cfg.pan_and_scan.min_crop,
                    "pan_and_scan_max_num_crops": cfg.pan_and_scan.max_crops,
                    "pan_and_scan_min_ratio_to_activate": cfg.pan_and_scan.min_ratio,
                }
            ),
        )
    elif isinstance(cfg, InternVLConfig):
        proc = transformers.GotOcr2ImageProcessor(
            size={"height": cfg.tile_height, "width": cfg.tile_width},
            crop_to_patches=True,
            min_patches=cfg.min_tiles,
            max_patches=cfg.max_tiles,
            image_mean=list(cfg.image_mean),
            image_std=list(cfg.image_std),
        )
    else:
        qwen = transformers.Glm4vImageProcessor
        if not isinstance(cfg, Glm4vConfig):
            qwen = transformers.Qwen2VLImageProcessor
        proc = qwen(
            patch_size=cfg.patch_size,
            merge_size=cfg.merge_kernel[0],
            size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
            image_mean=list(cfg.image_mean),
            image_std=list(cfg.image_std),
        )

    def run(images: list[torch.Tensor]) -> torch.Tensor:
        out = proc(images, return_tensors="pt", device="cuda")
        pixel_values: torch.Tensor = out["pixel_values"]
        return pixel_values

    return run


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (-1: the shapes differ)."""
    if a.shape != b.shape:
        return -1
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return int((a.contiguous().view(bits) != b.contiguous().view(bits)).sum())


def _d2d_bytes_per_s() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n / percentile(_device_times(lambda: dst.copy_(src), 10), 50)


def _register(arr: np.ndarray[Any, Any]) -> None:
    err = torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, 0)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with {int(err)}")


def _unregister(arr: np.ndarray[Any, Any]) -> None:
    torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)  # type: ignore[no-untyped-call]


def _measure(
    name: str,
    images: list[np.ndarray[Any, Any]],
    cfg: ModelSpec,
    dtype: torch.dtype,
    reps: int,
    d2d: float,
    hbm: float,
) -> dict[str, Any]:
    """One (batch, dtype) row: the ways, the e2e uploads, the floor and exactness."""
    specs = [cfg(im.shape[1], im.shape[0]) for im in images]
    shapes = [(im.shape[0], im.shape[1], im.shape[2]) for im in images]
    flat = np.concatenate([im.reshape(-1) for im in images])
    registered = flat.copy()
    host_page = torch.from_numpy(flat)
    src = host_page.cuda()
    staged = torch.empty_like(src)
    dev_images = [torch.from_numpy(im).cuda() for im in images]

    tiles = rows_are_tiles(specs[0])
    regions = [regions_of(s) for s in specs] if tiles else []
    out_rows = torch.empty(
        (sum(s.plan.grid.patches for s in specs), *specs[0].row_shape) if tiles else (0,),
        dtype=dtype,
        device="cuda",
    )

    def launch(source: torch.Tensor) -> torch.Tensor:
        if tiles:
            return preprocess_regions(source, shapes, specs, regions, out_rows)
        return preprocess_packed(source, shapes, specs, dtype)[0]

    def ours() -> torch.Tensor:
        return launch(src)

    def e2e(host: torch.Tensor) -> None:
        staged.copy_(host, non_blocking=True)
        launch(staged)

    out = ours().clone()
    cpu, _ = preprocess_images(images, cfg, dtype=dtype)
    theirs = torch_way(dev_images, specs, dtype)
    t_ours = _device_times(ours, reps)
    t_kernel, t_each = _kernel_time(ours, reps)
    t_torch = _device_times(lambda: torch_way(dev_images, specs, dtype), reps)
    call_ours = _wall_times(ours, reps)
    call_torch = _wall_times(lambda: torch_way(dev_images, specs, dtype), reps)
    hf = _transformers_way(cfg)
    hf_row: dict[str, Any] = {}
    if hf is not None:
        chw = [im.permute(2, 0, 1).contiguous() for im in dev_images]
        hf_out = hf(chw).to(dtype)
        hf_row = {
            "transformers_device_s": _device_times(lambda: hf(chw), reps),
            "transformers_call_s": _wall_times(lambda: hf(chw), reps),
            "differing_transformers": _differing(hf_out.cpu(), cpu),
        }
    t_pil = _wall_times(lambda: preprocess_images(images, cfg, dtype=dtype), 3, 1)
    t_page = _wall_times(lambda: e2e(host_page), reps)
    _register(registered)
    try:
        host_reg = torch.from_numpy(registered)
        t_reg = _wall_times(lambda: e2e(host_reg), reps)
    finally:
        _unregister(registered)
    moved = flat.nbytes + out.numel() * out.element_size()
    return {
        "case": name,
        "dtype": str(dtype).removeprefix("torch."),
        "images": [list(im.shape) for im in images],
        "resized_to": [
            [s.plan.new_width, s.plan.new_height]
            for s in specs
            if (s.plan.new_width, s.plan.new_height) != (s.plan.width, s.plan.height)
        ],
        "ours_device_s": t_ours,
        "ours_kernel_mean_s": t_kernel,
        "ours_kernels_each_mean_s": t_each,
        "torch_way_device_s": t_torch,
        "ours_call_s": call_ours,
        "torch_way_call_s": call_torch,
        "pillow_cpu_s": t_pil,
        "e2e_registered_s": t_reg,
        "e2e_pageable_s": t_page,
        "bytes_read_written": moved,
        "floor_hbm_s": moved / hbm,
        "floor_d2d_s": moved / d2d,
        "differing_vs_pillow": _differing(out.cpu(), cpu),
        "differing_torch_way": _differing(theirs, out),
        "elements": out.numel(),
        **hf_row,
    }


def render_table(payload: dict[str, Any]) -> Table:
    """The run's table, p50s (also re-renders a saved ``results.json``)."""
    table = Table(title="GPU pixel pipeline: kernel and device time, p50")
    for col in (
        "case",
        "dtype",
        "kernels µs",
        "x floor",
        "device µs",
        "torch µs",
        "x",
        "HF µs",
        "x",
        "≠ Pillow",
        "e2e ms",
    ):
        table.add_column(col, justify="right", no_wrap=col == "case")
    for r in payload["rows"]:
        ours = percentile(r["ours_device_s"], 50)
        tw = percentile(r["torch_way_device_s"], 50)
        hf = r.get("transformers_device_s")
        hf_cells = ("—", "—")
        if hf:
            hf50 = percentile(hf, 50)
            hf_cells = (f"{hf50 * 1e6:.0f}", f"{hf50 / ours:.1f}")
        table.add_row(
            r["case"],
            {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(r["dtype"], r["dtype"]),
            f"{r['ours_kernel_mean_s'] * 1e6:.1f}",
            f"{r['ours_kernel_mean_s'] / r['floor_hbm_s']:.2f}",
            f"{ours * 1e6:.1f}",
            f"{tw * 1e6:.0f}",
            f"{tw / ours:.1f}",
            *hf_cells,
            str(r["differing_vs_pillow"]),
            f"{percentile(r['e2e_registered_s'], 50) * 1e3:.2f}",
        )
    return table


def kernel_cases() -> dict[str, tuple[list[tuple[int, int]], ModelSpec]]:
    """The benchmark's cases: name -> (photo sizes, the family's spec). The seed batch
    4x1536x1024 (K2.5: unresized, and a resizing limit) and 8 mixed sizes, under Kimi-K2.5,
    Qwen2.5-VL, Qwen3-VL, GLM-4.1V, InternVL3 and Gemma 3 (the families' default limits;
    Gemma 3 also with pan-and-scan at Gemma3Processor's defaults)."""
    seed = [(1536, 1024)] * 4
    return {
        "4x1536x1024": (seed, KimiConfig()),
        "4x1536x1024 resized": (seed, KimiConfig(in_patch_limit=6144)),
        "8 mixed sizes": (_MIXED, KimiConfig()),
        "Qwen2.5-VL 8 mixed": (_MIXED, spec_for("qwen2.5-vl")),
        "Qwen3-VL 8 mixed": (_MIXED, spec_for("qwen3-vl")),
        "GLM-4.1V 8 mixed": (_MIXED, spec_for("glm-4.1v")),
        "InternVL3 8 mixed": (_MIXED, spec_for("internvl3")),
        "Gemma 3 8 mixed": (_MIXED, spec_for("gemma-3")),
        "Gemma 3 pan-and-scan": (_MIXED, Gemma3Config(pan_and_scan=PanAndScan(256, 4, 1.2))),
    }


def select_cases(wanted: str | None) -> list[str]:
    """The names of the cases that contain one of the comma-separated parts of ``wanted``
    (any case), in the benchmark's order; every case for None. ``SystemExit`` naming the
    cases where a part matches none."""
    names = list(kernel_cases())
    if wanted is None:
        return names
    parts = [p.strip().lower() for p in wanted.split(",") if p.strip()]
    unmatched = [p for p in parts if not any(p in n.lower() for n in names)]
    if unmatched or not parts:
        raise SystemExit(
            f"no kernels case matches {', '.join(map(repr, unmatched)) or repr(wanted)}; "
            f"the cases: {', '.join(names)}"
        )
    return [n for n in names if any(p in n.lower() for p in parts)]


def run_kernels(
    reps: int = 20,
    out_dir: Path | None = None,
    console: Console | None = None,
    cases: str | None = None,
) -> Path:
    """The cases of ``kernel_cases`` (those ``select_cases(cases)`` names), in fp32 and
    bf16."""
    console = console or Console()
    chosen = select_cases(cases)
    if not torch.cuda.is_available():
        raise SystemExit("mmwire-bench kernels needs a CUDA device")
    d2d = _d2d_bytes_per_s()
    hbm, hbm_source = hbm_bytes_per_s(torch.cuda.get_device_name(), d2d)
    table_of = kernel_cases()
    rows: list[dict[str, Any]] = []
    for name in chosen:
        sizes, cfg = table_of[name]
        images = _photos(sizes)
        for dtype in (torch.float32, torch.bfloat16):
            rows.append(_measure(name, images, cfg, dtype, reps, d2d, hbm))
    payload: dict[str, Any] = {
        "kind": "kernels",
        "rows": rows,
        "d2d_copy_bytes_per_s": d2d,
        "hbm_bytes_per_s": hbm,
    }
    table = render_table(payload)
    console.print(table)

    plot = bar_plot(
        [f"{r['case']}\n{r['dtype']}" for r in rows],
        {
            label: [percentile(r[key], 50) * 1e3 for r in rows]
            for key, label in (
                ("ours_device_s", "mmwire kernels"),
                ("torch_way_device_s", "torch way (GPU)"),
                ("e2e_registered_s", "mmwire e2e, registered H2D"),
                ("pillow_cpu_s", "Pillow (CPU)"),
            )
        },
        "ms (p50)",
    )
    folder = write_run(
        "kernels",
        {
            **payload,
            "notes": [
                "≠ Pillow: output elements whose bits differ from Pillow's (must be 0); "
                "the torch way's differ in most fp32 values (results.json)",
                "kernels: mean device time of mmwire's kernels alone per call (CUPTI); x floor: "
                "against the uint8 input read once and the output written once at "
                f"{hbm / 1e12:.2f} TB/s ({hbm_source}; a device-to-device copy ran at "
                f"{d2d / 1e12:.2f} TB/s here); each kernel's own mean time (the fused kernel "
                "by kind and channels, the resize passes) is results.json's "
                "ours_kernels_each_mean_s",
                "device: CUDA events around a call (with the grid_thw copy and the gaps between "
                "launches); x: the torch way's (or transformers') device time over it",
                "torch: the torch way; HF: transformers' own processor (Qwen2VL, Glm4v, "
                "GotOcr2 for InternVL, Gemma3), torchvision backend, device='cuda' (its bytes "
                "differing from Pillow's are in results.json)",
                "e2e: H2D of the packed uint8 pixels from registered memory plus the kernels, "
                "host wall clock",
            ],
        },
        table,
        plot,
        out_dir=out_dir,
    )
    console.print(f"results written to {folder}")
    return folder
