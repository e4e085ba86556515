"""The README's demo: a tokenizer and scheduler ranks on this host, mmwire beside every peer.

mmwire ships each image's uint8 pixels once into the shared arena and only the rank that
owns an item materialises it (deferred, owner-side). Every peer of ``mmwire-bench
transport`` takes the engines' way instead: the tokenizer preprocesses the request to fp32
``pixel_values`` and sends them to every rank its way. Each request is timed several times
on each path (median and spread), until every owner holds its ``pixel_values``, after
one unrecorded pass over the requests. Every path's processes stay up for the whole run,
and the paths take turns, request by request, starting each round with the next path: a
2-core machine's speed drifts over a run, and timing one path after another handed that
drift to whichever came last.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from mmwire.materialize import KimiConfig, assign_owners, owners_of, preprocess_images
from mmwire.transport import Grid, Item, Producer
from PIL import Image
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import _workers
from ._harness import Ranks
from ._report import write_run
from ._transport import LABELS, PEERS, make_method

__all__ = ["REQUESTS", "run_demo"]

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

Send = Callable[[str, list[Image.Image]], int]
"""Sends one request's images on one path, waits until every owner holds its
``pixel_values``, and returns the bytes it moved."""


def _images() -> list[list[Image.Image]]:
    photos = {
        n: Image.open(DATA / n).convert("RGB") for n in {p for r in REQUESTS for p, _, _ in r}
    }
    return [[photos[n].resize((w, h), Image.Resampling.BICUBIC) for n, w, h in r] for r in REQUESTS]


def run_demo(
    ranks: int = 2, reps: int = 9, out_dir: Path | None = None, console: Console | None = None
) -> Path:
    """Time every request ``reps`` times on mmwire and on each peer; print and save the
    tables (results under ``out_dir``)."""
    console = console or Console()
    requests = _images()
    paths = ["mmwire", *PEERS]
    progress = Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    console.print(
        f"mmwire demo: {len(requests)} requests x {reps} runs on each of {len(paths)} paths, "
        f"1 tokenizer -> {ranks} ranks on this host"
    )
    for peer in PEERS:
        console.print(f"  {peer:<10} {LABELS[peer]}")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with progress, ExitStack() as paths_up:
        senders = {
            path: paths_up.enter_context(
                _mmwire_path(ranks) if path == "mmwire" else _peer_path(path, ranks)
            )
            for path in paths
        }
        tasks = {path: progress.add_task(path, total=len(requests) * reps) for path in paths}
        times, moved = _timed(requests, reps, senders, lambda p: progress.advance(tasks[p]))
    if not console.is_terminal:  # no live display: one line for the run
        console.print(f"  every path, in turn: done in {time.perf_counter() - started:.1f} s")
    rows = [
        {
            "request": i,
            "images": [f"{im.width}x{im.height}" for im in imgs],
            **{f"{p}_ms": times[p][i] for p in paths},
            **{f"{p}_bytes": moved[p][i] for p in paths},
        }
        for i, imgs in enumerate(requests)
    ]
    per_request, summary = _tables(rows, paths, reps)
    console.print(per_request)
    console.print(summary)
    busy = _busy(load_before, os.getloadavg()[0])
    if busy:
        console.print(busy)
    folder = write_run(
        "demo",
        {
            "kind": "demo",
            "ranks": ranks,
            "reps": reps,
            "paths": paths,
            "rows": rows,
            "notes": [
                "ms: publish (or the producer's preprocessing) -> every owner holds its "
                "pixel_values; median of the runs, +- half their range",
                "mmwire: uint8 pixels once into the arena, the owner materialises; the peers: "
                "the producer preprocesses to fp32 and sends to every rank their way",
            ],
        },
        summary,
        out_dir=out_dir,
    )
    console.print(f"results: {folder}")
    return folder


def _busy(before: float, after: float) -> str:
    """A line saying the machine was busy, if its 1-minute load average before the run was
    half its cores or more (other work was running beside the ranks); ``""`` otherwise."""
    cores = os.cpu_count() or 1
    if before < 0.5 * cores:
        return ""
    return (
        f"note: this machine was busy before the run (load {before:.1f} on {cores} cores, "
        f"{after:.1f} after): the timings are noisier than usual"
    )


@contextmanager
def _mmwire_path(ranks: int) -> Iterator[Send]:
    cfg = KimiConfig()
    producer = Producer(arena_size=256 << 20)
    workers = Ranks(
        _workers.mmwire_rank,
        ranks,
        lambda r: (ranks, producer.endpoint, producer.handover_path, True),
    )
    try:
        producer.wait_for_consumers(range(ranks), 60)

        def send(rid: str, imgs: list[Image.Image]) -> int:
            specs = [cfg(im.width, im.height) for im in imgs]
            maps = assign_owners([s.plan.grid.patches for s in specs], ranks)
            items = [
                Item(data=im, consumers=o, preprocess=cfg)
                for im, o in zip(imgs, owners_of(maps, len(imgs)))
            ]
            envs = producer.publish(rid, items)
            workers.wait("done", ranks)
            return sum(e.tensor.nbytes for e in envs)

        yield send
    finally:
        producer.publish(
            "stop",
            [Item(data=np.zeros(1, np.uint8), consumers=(0,), kind="embedding", grid=Grid((1, 1)))],
        )
        workers.close()
        producer.close()


@contextmanager
def _peer_path(name: str, ranks: int) -> Iterator[Send]:
    cfg = KimiConfig()
    method = make_method(name, ranks)
    try:

        def send(rid: str, imgs: list[Image.Image]) -> int:
            pixel_values, _ = preprocess_images(imgs, cfg)  # on the producer, eagerly
            method.send(rid, pixel_values)
            method.ranks.wait("done", ranks)
            method.round_done()
            return method.copies(pixel_values.numel() * pixel_values.element_size())

        yield send
    finally:
        method.close()


def _timed(
    requests: list[list[Image.Image]],
    reps: int,
    senders: dict[str, Send],
    tick: Callable[[str], None],
) -> tuple[dict[str, list[list[float]]], dict[str, list[int]]]:
    """Each request once unrecorded on every path (a fresh process's first large request
    pays its allocator's and libraries' start-up, which a serving process pays once), then
    ``reps`` rounds in which the paths take turns at each request, each round starting with
    the next path. Per path: each request's times (ms), and the bytes its last run moved."""
    paths = list(senders)
    for send in senders.values():
        for i, imgs in enumerate(requests):
            send(f"warm-up{i}", imgs)
    times: dict[str, list[list[float]]] = {p: [[] for _ in requests] for p in paths}
    moved: dict[str, list[int]] = {p: [0] * len(requests) for p in paths}
    for k in range(reps):
        turn = paths[k % len(paths) :] + paths[: k % len(paths)]
        for i, imgs in enumerate(requests):
            for path in turn:
                t0 = time.perf_counter()
                moved[path][i] = senders[path](f"r{i}.{k}", imgs)
                times[path][i].append((time.perf_counter() - t0) * 1e3)
                tick(path)
    return times, moved


def _cell(runs: list[float]) -> str:
    """Median +- half the range (the time alone for one run), to the precision that matters
    at that size."""
    mid, half = statistics.median(runs), (max(runs) - min(runs)) / 2
    digits = 1 if mid < 100 else 0
    return f"{mid:.{digits}f}" + (f"±{half:.{digits}f}" if len(runs) > 1 else "")


def _tables(rows: list[dict[str, Any]], paths: list[str], reps: int) -> tuple[Table, Table]:
    per_request = Table(
        title="ms until every owner holds pixel_values "
        + (f"(median of {reps} ± half the range)" if reps > 1 else "(one run)"),
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    per_request.add_column("req", justify="right")
    per_request.add_column("MP", justify="right")
    for p in paths:
        per_request.add_column(p, justify="right")
    for r in rows:
        megapixels = sum(int(w) * int(h) for w, h in (s.split("x") for s in r["images"])) / 1e6
        per_request.add_row(
            str(r["request"]), f"{megapixels:.1f}", *(_cell(r[f"{p}_ms"]) for p in paths)
        )
    summary = Table(
        title="all requests (sum of medians)",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for col in ("rank", "path", "ms", "x mmwire", "MiB moved"):
        summary.add_column(col, justify="left" if col == "path" else "right")
    total = {p: sum(statistics.median(r[f"{p}_ms"]) for r in rows) for p in paths}
    rank = ranking(total)
    for p in sorted(paths, key=lambda p: total[p]):
        summary.add_row(
            rank[p],
            p,
            f"{total[p]:.1f}",
            f"{total[p] / total['mmwire']:.1f}x",
            f"{sum(r[f'{p}_bytes'] for r in rows) / 2**20:.1f}",
        )
    return per_request, summary


TIE = 0.10
"""Paths whose totals are within 10 % of the next faster one share its rank: closer than
that, a 2-core machine's noise orders them differently from run to run (by up to 9 % over
nine runs of each request)."""


def ranking(total: dict[str, float]) -> dict[str, str]:
    """Each path's place, fastest first; ``"2="`` for a place shared within ``TIE``."""
    order = sorted(total, key=lambda p: total[p])
    place = {order[0]: 1}
    for before, p in itertools.pairwise(order):
        tied = total[p] <= total[before] * (1 + TIE)
        place[p] = place[before] if tied else order.index(p) + 1
    shared = {n for n in place.values() if list(place.values()).count(n) > 1}
    return {p: f"{n}=" if n in shared else str(n) for p, n in place.items()}
