"""The README's demo: a tokenizer and two scheduler ranks; mmwire (deferred) vs pickle (eager)."""

from __future__ import annotations

import pickle  # the peers' way, reproduced for comparison only
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from mmwire.materialize import ProcessorConfig, assign_owners, owners_of, preprocess_images
from mmwire.transport import Grid, Item, Producer
from PIL import Image
from rich.console import Console
from rich.table import Table

from . import _workers
from ._harness import Ranks
from ._report import bar_plot, write_run

DATA = Path(__file__).resolve().parent / "data"

# (photo, width, height) per image; every size distinct. Upscaled photos are real content.
REQUESTS: list[list[tuple[str, int, int]]] = [
    [("coffee.png", 600, 400)],
    [("chelsea.png", 451, 300), ("astronaut.png", 512, 512)],
    [("coffee.png", 1203, 802), ("astronaut.png", 333, 517), ("chelsea.png", 902, 600)],
    [("astronaut.png", 1024, 1024), ("coffee.png", 1501, 1000)],
    [("chelsea.png", 1804, 1200), ("coffee.png", 640, 427), ("astronaut.png", 257, 255)],
    [("coffee.png", 2000, 1333)],
]


def _images() -> list[list[Image.Image]]:
    photos = {
        n: Image.open(DATA / n).convert("RGB") for n in {p for r in REQUESTS for p, _, _ in r}
    }
    return [[photos[n].resize((w, h), Image.Resampling.BICUBIC) for n, w, h in r] for r in REQUESTS]


def run_demo(ranks: int = 2, out_dir: Path | None = None, console: Console | None = None) -> Path:
    """Run both paths over the same requests and topology; print and save the table."""
    console = console or Console()
    cfg = ProcessorConfig()
    requests = _images()
    producer = Producer(arena_size=256 << 20)
    mm = Ranks(
        _workers.mmwire_rank,
        ranks,
        lambda r: (ranks, producer.endpoint, producer.handover_path, True),
    )
    rows: list[dict[str, Any]] = [
        {"request": i, "images": [f"{im.width}x{im.height}" for im in imgs]}
        for i, imgs in enumerate(requests)
    ]
    try:
        producer.wait_for_consumers(range(ranks), 60)

        def deferred(rid: str, imgs: list[Image.Image]) -> tuple[float, int]:
            specs = [cfg.spec_for(im.width, im.height) for im in imgs]
            maps = assign_owners([s.plan.grid.patches for s in specs], ranks)
            items = [
                Item(data=im, consumers=o, preprocess=cfg.spec_for)
                for im, o in zip(imgs, owners_of(maps, len(imgs)))
            ]
            t0 = time.perf_counter()
            envs = producer.publish(rid, items)
            done = mm.wait("done", ranks)
            return (max(d[3] for d in done) - t0) * 1e3, sum(e.tensor.nbytes for e in envs)

        _measure(rows, requests, deferred, "mmwire")
        producer.publish(
            "stop",
            [Item(data=np.zeros(1, np.uint8), consumers=(0,), kind="embedding", grid=Grid((1, 1)))],
        )
    finally:
        mm.close()
        producer.close()

    ctx: zmq.Context[Any] = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="mmwire-demo-")
    endpoints = [f"ipc://{tmp}/pickle{r}" for r in range(ranks)]
    pushes = [ctx.socket(zmq.PUSH) for _ in range(ranks)]
    for s, ep in zip(pushes, endpoints):
        s.bind(ep)
    pk = Ranks(_workers.pickle_rank, ranks, lambda r: (endpoints[r],))
    try:

        def eager(rid: str, imgs: list[Image.Image]) -> tuple[float, int]:
            t0 = time.perf_counter()
            pixel_values, grids = preprocess_images(imgs, cfg)  # on the producer
            blob = pickle.dumps({"rid": rid, "tensor": pixel_values, "grids": grids})
            for s in pushes:
                s.send(blob)
            done = pk.wait("done", ranks)
            return (max(d[3] for d in done) - t0) * 1e3, len(blob) * ranks

        _measure(rows, requests, eager, "pickle")
        for s in pushes:
            s.send(pickle.dumps({"rid": "stop"}))
    finally:
        pk.close()
        for s in pushes:
            s.close(0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)

    table = Table(
        title=f"mmwire demo: 1 tokenizer -> {ranks} ranks, cpu backend, "
        "owner-side CPU materialisation"
    )
    for col in (
        "req",
        "images",
        "mmwire ms",
        "pickle+eager ms",
        "speed-up",
        "mmwire bytes",
        "pickle bytes",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["request"]),
            " ".join(row["images"]),
            f"{row['mmwire_ms']:.1f}",
            f"{row['pickle_ms']:.1f}",
            f"{row['pickle_ms'] / row['mmwire_ms']:.1f}x",
            _mib(row["mmwire_bytes"]),
            _mib(row["pickle_bytes"]),
        )
    console.print(table)
    folder = write_run(
        "demo",
        {
            "kind": "demo",
            "ranks": ranks,
            "rows": rows,
            "notes": [
                "latency = publish (or eager preprocess) -> every owner holds its pixel_values",
                "pickle path: producer preprocesses to fp32 and pickles the batch to every rank "
                "over zmq",
            ],
        },
        table,
        bar_plot(
            [f"r{r['request']}" for r in rows],
            {
                "mmwire (deferred)": [r["mmwire_ms"] for r in rows],
                "pickle + eager": [r["pickle_ms"] for r in rows],
            },
            "ms until every owner holds pixel_values",
        ),
        out_dir=out_dir,
    )
    console.print(f"results written to {folder}")
    return folder


def _measure(
    rows: list[dict[str, Any]],
    requests: list[list[Image.Image]],
    run: Callable[[str, list[Image.Image]], tuple[float, int]],
    path: str,
) -> None:
    """One unrecorded warm-up request, then every request once: ``<path>_ms``/``_bytes``."""
    run("warm-up", requests[0])
    for row, imgs in zip(rows, requests):
        row[f"{path}_ms"], row[f"{path}_bytes"] = run(f"r{row['request']}", imgs)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
