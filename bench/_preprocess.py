"""``mmwire-bench preprocess``: the CPU pipeline vs the reference processor's plain way."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mmwire.materialize import KimiConfig, plan_resize, preprocess_images
from PIL import Image
from rich.console import Console
from rich.table import Table

from ._report import percentile, write_run

DATA = Path(__file__).resolve().parent / "data"


def _reference_way(im: Image.Image, cfg: KimiConfig) -> torch.Tensor:
    """The plain processor: PIL resize, float64 numpy normalise, pad, reshape/transpose."""
    plan = plan_resize(im.width, im.height, in_patch_limit=cfg.in_patch_limit)
    if im.size != (plan.new_width, plan.new_height):
        im = im.resize((plan.new_width, plan.new_height), Image.Resampling.BICUBIC)
    x = np.asarray(im).astype(np.float64) / 255.0
    x = (x - np.array(cfg.image_mean)) / np.array(cfg.image_std)
    x = np.pad(x, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), constant_values=-1.0)
    p = cfg.patch_size
    gh, gw = x.shape[0] // p, x.shape[1] // p
    t = torch.from_numpy(x.astype(np.float32)).permute(2, 0, 1)
    return t.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p).contiguous()


def _time(fn: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run_preprocess(
    threads: int = 2, out_dir: Path | None = None, console: Console | None = None
) -> Path:
    """4x1536x1024 and 8x2048x2048 RGB, 1 and N threads, the K2.5 limit and a resizing one."""
    console = console or Console()
    photo = Image.open(DATA / "coffee.png").convert("RGB")
    cases = {
        "4x1536x1024": [photo.resize((1536, 1024))] * 4,
        "8x2048x2048": [photo.resize((2048, 2048))] * 8,
    }
    rows: list[dict[str, Any]] = []
    for limit in (16384, 4096):
        cfg = KimiConfig(in_patch_limit=limit)
        for name, images in cases.items():
            for n_threads in (1, threads):
                pool = ThreadPoolExecutor(n_threads)

                def ours(
                    images: list[Image.Image] = images,
                    pool: ThreadPoolExecutor = pool,
                    cfg: KimiConfig = cfg,
                ) -> None:
                    list(pool.map(lambda im: preprocess_images([im], cfg), images))

                def ref(
                    images: list[Image.Image] = images,
                    pool: ThreadPoolExecutor = pool,
                    cfg: KimiConfig = cfg,
                ) -> None:
                    list(pool.map(lambda im: _reference_way(im, cfg), images))

                ours()
                ref()
                t_ours, t_ref = _time(ours, 5), _time(ref, 5)
                pool.shutdown()
                rows.append(
                    {
                        "case": name,
                        "in_patch_limit": limit,
                        "threads": n_threads,
                        "ours_s": t_ours,
                        "reference_s": t_ref,
                    }
                )
    table = Table(title="CPU preprocessing, p50 ms (fp32 output)")
    for col in ("case", "limit", "threads", "mmwire", "reference way", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        a, b = percentile(r["ours_s"], 50) * 1e3, percentile(r["reference_s"], 50) * 1e3
        table.add_row(
            r["case"],
            str(r["in_patch_limit"]),
            str(r["threads"]),
            f"{a:.1f}",
            f"{b:.1f}",
            f"{b / a:.2f}x",
        )
    console.print(table)
    folder = write_run(
        "preprocess",
        {
            "kind": "preprocess",
            "rows": rows,
            "notes": [
                "limit 16384 leaves these sizes unresized (pad + normalise + patchify only); "
                "4096 forces a BICUBIC downscale",
                "the reference way pads normalised values with -1.0, equal to mmwire's raw-0 "
                "padding for mean = std = 0.5",
            ],
        },
        table,
        out_dir=out_dir,
    )
    console.print(f"results written to {folder}")
    return folder
