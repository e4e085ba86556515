"""``mmwire-bench h2d``: host-to-device copy from the arena, registered vs not (needs CUDA).

The owner uploads each raw item once; from a ``cudaHostRegister``ed arena that copy is a
direct DMA at pinned speed, from the plain mapping it is staged through pageable memory.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mmwire.transport import Consumer, GlobalIndex, Grid, Item, Producer
from rich.console import Console
from rich.table import Table

from ._report import percentile, write_run


def _h2d(src: torch.Tensor, reps: int) -> list[float]:
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def render_table(payload: dict[str, Any]) -> Table:
    """GB/s per source and size (also re-renders a saved ``results.json``)."""
    table = Table(
        title="H2D from the mmwire arena (GB/s, p50; register took "
        f"{payload['register_seconds'] * 1e3:.0f} ms)"
    )
    for col in ("source", "size", "GB/s p50", "GB/s min", "bytes equal"):
        table.add_column(col, justify="right")
    for r in payload["rows"]:
        gbps = [r["bytes"] / s / 1e9 for s in r["seconds"]]
        table.add_row(
            r["source"],
            f"{r['bytes'] >> 20} MiB",
            f"{percentile(gbps, 50):.1f}",
            f"{min(gbps):.1f}",
            str(r["exact"]),
        )
    return table


def run_h2d(
    sizes: list[int] | None = None,
    reps: int = 10,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> Path:
    """GB/s of H2D copies from the arena unregistered, registered, and from a pinned tensor."""
    console = console or Console()
    if not torch.cuda.is_available():
        raise SystemExit("mmwire-bench h2d needs a CUDA device")
    sizes = sizes or [1 << 20, 16 << 20, 256 << 20]
    producer = Producer(arena_size=2 * max(sizes) + (64 << 20))
    consumer = Consumer(0, producer.endpoint, handover=producer.handover_path)
    producer.wait_for_consumers([0])
    rows: list[dict[str, Any]] = []
    t_register = float("nan")
    try:
        for registered in (False, True):
            if registered:
                t0 = time.perf_counter()
                consumer.register_with_cuda()
                t_register = time.perf_counter() - t0
            for size in sizes:
                data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
                producer.publish(
                    "h2d", [Item(data=data, consumers=(0,), kind="embedding", grid=Grid((1, 1)))]
                )
                with consumer.recv(10) as batch:
                    view = batch.open_tensor(GlobalIndex(0))
                    times = _h2d(view, reps)
                    back = torch.empty_like(view)
                    back.copy_(view.cuda())
                    exact = bool(torch.equal(back, view))
                rows.append(
                    {
                        "source": "arena registered" if registered else "arena pageable",
                        "bytes": size,
                        "seconds": times,
                        "exact": exact,
                    }
                )
                producer.poll(0.05)
        for size in sizes:
            pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
            rows.append(
                {
                    "source": "pinned tensor",
                    "bytes": size,
                    "seconds": _h2d(pinned, reps),
                    "exact": True,
                }
            )
    finally:
        consumer.close()
        producer.close()
    table = render_table({"rows": rows, "register_seconds": t_register})
    console.print(table)
    folder = write_run(
        "h2d",
        {
            "kind": "h2d",
            "rows": rows,
            "register_seconds": t_register,
            "notes": [
                "cudaHostRegister(Portable|ReadOnly) of the consumer's read-only arena mapping"
            ],
        },
        table,
        out_dir=out_dir,
    )
    console.print(f"results written to {folder}")
    return folder


if __name__ == "__main__":
    run_h2d()
