"""``mmwire-bench engine``: what an engine's frontend sees of reuse, caching and asyncio.

Two parts, in one run:

* **A multi-turn chat trace.** Conversations resend their earlier images with every turn
  (as chat APIs do), so most images of the trace are repeats. Each request goes as encoded
  bytes to N ranks (owners by vision DP; with the cache, a resent image goes back to the
  rank that owned it: ``OwnerAffinity``), one at a time; measured per request: the bytes
  copied into the arena, the owners' materialise time, and the TTFT proxy (publish ->
  the last owner holds its ``pixel_values``). Once with nothing reused (``reuse=False``,
  no owner cache), once with the arena's reuse and each owner's output cache.
* **The async producer's overhead.** ``await AsyncProducer.publish`` against
  ``Producer.publish`` for the same payloads, in one process with a consumer draining.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from mmwire.materialize import OwnerAffinity, assign_owners, owners_of, spec_for
from mmwire.transport import AsyncProducer, Consumer, Grid, Item, Producer
from mmwire.transport.images import encoded_image
from PIL import Image
from rich import box
from rich.console import Console
from rich.table import Table

from . import _workers
from ._harness import Ranks
from ._report import percentile, write_run

DATA = Path(__file__).resolve().parent / "data"
FAMILY = "qwen2.5-vl"
SIZES = [(640, 480), (1024, 768), (1280, 720), (1600, 1200), (1920, 1080), (2048, 1536)]
WAYS = ("no reuse", "reuse + cache")
PAYLOADS = {"64 KiB": 64 << 10, "4 MiB": 4 << 20}


def trace(
    conversations: int, turns: int, seed: int = 7, max_megapixels: float = 3.2
) -> list[list[bytes]]:
    """Requests of a multi-turn trace, turn by turn across conversations: turn ``t`` of a
    conversation sends its ``t`` images so far (JPEG, sizes of at most ``max_megapixels``),
    the newest last."""
    sizes = [s for s in SIZES if s[0] * s[1] <= max_megapixels * 1e6]
    if not sizes:
        raise ValueError(f"no photo size within {max_megapixels} megapixels")
    rng = np.random.default_rng(seed)
    photos = [
        Image.open(DATA / f).convert("RGB") for f in ("coffee.png", "astronaut.png", "chelsea.png")
    ]
    history: list[list[bytes]] = [[] for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for conv in history:
            w, h = sizes[int(rng.integers(len(sizes)))]
            photo = photos[int(rng.integers(len(photos)))]
            buf = io.BytesIO()
            photo.resize((w, h)).save(buf, "JPEG", quality=int(rng.integers(80, 95)))
            conv.append(buf.getvalue())
            out.append(list(conv))
    return out


def _trace_cell(way: str, requests: list[list[bytes]], ranks: int, device: str) -> dict[str, Any]:
    reuse = way != "no reuse"
    spec = spec_for(FAMILY)
    producer = Producer(arena_size=1 << 30, reuse=reuse, full_timeout=60)
    pool = Ranks(
        _workers.engine_rank,
        ranks,
        lambda r: (producer.endpoint, producer.handover_path, (1 << 30) if reuse else 0, device),
    )
    try:
        producer.wait_for_consumers(range(ranks), 120)
        ttft, copied, owner_s, hits, shipped = [], 0, 0.0, 0, 0
        affinity = OwnerAffinity()
        for i, images in enumerate(requests):
            headers = [encoded_image(data) for data in images]
            patches = [spec(h.width, h.height).plan.grid.patches for h in headers if h]
            # with the cache, a resent image goes back to the rank that holds its output
            preferred = affinity.preferred(images) if reuse else None
            owners = owners_of(assign_owners(patches, ranks, preferred=preferred), len(images))
            affinity.remember(images, [o[0] for o in owners])
            items = [Item(data, consumers=o, preprocess=spec) for data, o in zip(images, owners)]
            reused0 = producer.statistics().arena.bytes_reused
            t0 = time.perf_counter()
            envs = producer.publish(f"r{i}", items)
            reports = pool.wait("done", ranks, timeout=300)
            done = max(t for _, _, _, t, _, _ in reports)
            ttft.append(done - t0)
            nbytes = sum(e.tensor.nbytes for e in envs)
            shipped += nbytes
            copied += nbytes - (producer.statistics().arena.bytes_reused - reused0)
            owner_s += sum(s for *_, s, _ in reports)
            hits += sum(h for *_, h in reports)
        stop = Item(np.zeros(1, np.uint8), consumers=(0,), kind="embedding", grid=Grid((1, 1)))
        producer.publish("stop", [stop])
    finally:
        pool.close()
        producer.close()
    return {
        "way": way,
        "ttft_s": ttft,
        "bytes_copied": copied,
        "bytes_named": shipped,
        "owner_s": owner_s,
        "cache_hits": hits,
    }


def _overhead(reps: int) -> list[dict[str, Any]]:
    """p50/p99 of one publish call, sync and async, for each payload size."""
    rows = []
    for label, size in PAYLOADS.items():
        payloads = [
            np.frombuffer(np.random.default_rng(k).bytes(size), np.uint8) for k in range(reps)
        ]
        item_of = [Item(p, consumers=(0,), kind="embedding", grid=Grid((1, 1))) for p in payloads]
        for mode in ("sync", "async"):
            rows.append({"payload": label, "mode": mode, "seconds": _publish_times(mode, item_of)})
    return rows


def _publish_times(mode: str, items: list[Item]) -> list[float]:
    times: list[float] = []

    def drain(consumer: Consumer, n: int) -> None:
        for _ in range(n):
            consumer.recv(30).release()

    async def run_async() -> None:
        async with AsyncProducer(arena_size=256 << 20, reuse=False) as ap:
            consumer = Consumer(0, ap.producer.endpoint, handover=ap.producer.handover_path)
            await ap.wait_for_consumers([0], 30)
            t = threading.Thread(target=drain, args=(consumer, len(items)))
            t.start()
            for k, item in enumerate(items):
                t0 = time.perf_counter()
                await ap.publish(f"r{k}", [item])
                times.append(time.perf_counter() - t0)
            t.join()
            consumer.close()

    if mode == "async":
        asyncio.run(run_async())
        return times
    with Producer(arena_size=256 << 20, reuse=False) as p:
        consumer = Consumer(0, p.endpoint, handover=p.handover_path)
        p.wait_for_consumers([0], 30)
        t = threading.Thread(target=drain, args=(consumer, len(items)))
        t.start()
        for k, item in enumerate(items):
            t0 = time.perf_counter()
            p.publish(f"r{k}", [item])
            times.append(time.perf_counter() - t0)
        t.join()
        consumer.close()
    return times


def run_engine(
    ranks: int = 2,
    conversations: int = 6,
    turns: int = 4,
    reps: int = 300,
    device: str = "cpu",
    out_dir: Path | None = None,
    console: Console | None = None,
    max_megapixels: float = 3.2,
) -> Path:
    """The trace with and without reuse and caching (owners on ``device``), then the async
    overhead."""
    console = console or Console()
    requests = trace(conversations, turns, max_megapixels=max_megapixels)
    images = sum(len(r) for r in requests)
    cells = [_trace_cell(way, requests, ranks, device) for way in WAYS]
    overhead = _overhead(reps)
    payload = {
        "kind": "engine",
        "ranks": ranks,
        "device": device,
        "family": FAMILY,
        "max_megapixels": max_megapixels,
        "requests": len(requests),
        "images": images,
        "repeats": images - len({data for r in requests for data in r}),
        "trace": cells,
        "overhead": overhead,
        "notes": [
            "trace: each turn resends the conversation's earlier images; encoded JPEG bytes, "
            "owners by vision DP, one request at a time",
            "MiB in: payload bytes copied into the arena; owner ms: the ranks' "
            "materialise time per request, summed over ranks; TTFT proxy: publish -> the "
            "last owner holds pixel_values",
            "async: one await of publish, a consumer thread draining; its p50 x is the sync "
            "call's p50 over it (< 1: what the hop to the worker thread costs)",
        ],
    }
    table = render_table(payload)
    console.print(table)
    folder = write_run("engine", payload, table, None, out_dir=out_dir)
    console.print(f"results written to {folder}")
    return folder


def render_table(payload: dict[str, Any]) -> Table:
    """The run's table (also re-renders a saved ``results.json``)."""
    n = payload["requests"]
    table = Table(
        title=f"{payload['requests']} chat turns, {payload['images']} images, "
        f"{payload['repeats']} repeats; {payload['ranks']} ranks on "
        f"{payload.get('device', 'cpu')}, {payload['family']}",
        box=box.SIMPLE_HEAD,
    )
    for col in ("way", "MiB in", "owner ms", "p50", "p90", "hits", "p50 ×"):
        table.add_column(col, justify="right", no_wrap=True)
    base = next(c for c in payload["trace"] if c["way"] == "no reuse")
    for c in payload["trace"]:
        table.add_row(
            c["way"],
            f"{c['bytes_copied'] / 2**20:.1f}",
            f"{c['owner_s'] / n * 1e3:.1f}",
            f"{percentile(c['ttft_s'], 50) * 1e3:.1f} ms",
            f"{percentile(c['ttft_s'], 90) * 1e3:.1f} ms",
            str(c["cache_hits"]),
            f"{percentile(base['ttft_s'], 50) / percentile(c['ttft_s'], 50):.1f}x",
        )
    sync = {r["payload"]: r for r in payload["overhead"] if r["mode"] == "sync"}
    for r in payload["overhead"]:
        if r["mode"] != "async":
            continue
        s = sync[r["payload"]]["seconds"]
        a = r["seconds"]
        table.add_row(
            f"async {r['payload']}",
            "",
            "",
            f"{percentile(a, 50) * 1e6:.0f} µs",
            f"{percentile(a, 90) * 1e6:.0f} µs",
            "",
            f"{percentile(s, 50) / percentile(a, 50):.2f}x",
        )
    return table
