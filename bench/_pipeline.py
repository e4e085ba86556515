"""``mmwire-bench pipeline``: Poisson arrivals of encoded photos into a tokenizer and N ranks.

Requests are what clients send: 1-8 JPEG or PNG photos of mixed sizes (up to 12 MP), as
bytes. The ways, each through mmwire's cpu transport:

* eager: the tokenizer decodes and preprocesses each request on arrival (the CPU pipeline,
  one process, as engines do) and ships fp32 patches to every rank;
* raw: the tokenizer decodes (``Item(decode=True)``) and ships uint8 pixels; each item's
  owner rank materialises it;
* encoded: the tokenizer reads the headers only and ships the bytes; the owner decodes and
  materialises.

raw and encoded run once per owner device (``--device cpu,cuda``: the CPU pipeline, or the
CUDA kernels); on CUDA with torchvision, encoded also runs with the approximate nvJPEG
decode (``gpu_decode=True``), and the run reports how its pixels differ from Pillow's.

TTFT-proxy = arrival -> the last owner of the request's items holds its pixel_values. Rates
are multiples of eager's capacity (1 / its mean service time per request, measured first),
so the top rate saturates eager. The tokenizer's CPU time per request is its process's.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from mmwire.materialize import KimiConfig, assign_owners, preprocess_images
from mmwire.transport import Grid, Item, Producer
from mmwire.transport.images import image_size
from PIL import Image
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from . import _workers
from ._harness import Ranks
from ._report import percentile, write_run

DATA = Path(__file__).resolve().parent / "data"
SIZES = [
    (640, 480),
    (1024, 768),
    (1280, 720),
    (1600, 1200),
    (1920, 1080),
    (2048, 1536),
    (3000, 2000),
    (4000, 3000),
]
MODES = ("eager", "raw", "encoded")


def _requests(n: int, seed: int, max_megapixels: float = 12.0) -> list[list[bytes]]:
    """``n`` requests of 1-8 photos at sizes drawn from ``SIZES`` (those of at most
    ``max_megapixels``), each re-encoded as JPEG (quality 90, three in four) or PNG: the
    bytes a client sends."""
    return [list(request) for request in _encoded(n, seed, max_megapixels)]


@functools.lru_cache(maxsize=8)
def _encoded(n: int, seed: int, max_megapixels: float) -> tuple[tuple[bytes, ...], ...]:
    """``_requests``' bytes, encoded once per process (a 12 MP PNG takes a second)."""
    sizes = [s for s in SIZES if s[0] * s[1] <= max_megapixels * 1e6]
    if not sizes:
        raise ValueError(f"no photo size within {max_megapixels} megapixels")
    rng = np.random.default_rng(seed)
    photos = [
        Image.open(DATA / f).convert("RGB") for f in ("coffee.png", "astronaut.png", "chelsea.png")
    ]
    cache: dict[tuple[int, int, int, bool], bytes] = {}
    out = []
    for _ in range(n):
        request = []
        for _ in range(int(rng.integers(1, 9))):
            size = sizes[int(rng.integers(len(sizes)))]
            key = (int(rng.integers(len(photos))), *size, bool(rng.random() < 0.75))
            if key not in cache:
                buf = io.BytesIO()
                image = photos[key[0]].resize(size)
                if key[3]:
                    image.save(buf, "JPEG", quality=90)
                else:
                    image.save(buf, "PNG")
                cache[key] = buf.getvalue()
            request.append(cache[key])
        out.append(tuple(request))
    return tuple(out)


def _run(
    mode: str,
    requests: list[list[bytes]],
    rate: float,
    ranks: Ranks,
    producers: Sequence[Producer],
    n_ranks: int,
    cfg: KimiConfig,
    seed: int,
) -> dict[str, Any]:
    """One cell: ``requests`` arrive as a Poisson process at ``rate``, taken in turn by the
    ``producers`` (frontends, each on a thread of its own); the TTFT proxy of each."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(requests))
    start = time.perf_counter() + 0.05
    arrivals = start + np.cumsum(gaps)
    payload = [0] * len(producers)
    owners_per_request: list[set[int]] = [set() for _ in requests]

    def frontend(k: int) -> None:
        for i in range(k, len(requests), len(producers)):
            images = requests[i]
            now = time.perf_counter()
            if now < arrivals[i]:
                time.sleep(arrivals[i] - now)
            specs = [cfg(*image_size(im)) for im in images]
            owners = assign_owners([s.plan.grid.patches for s in specs], n_ranks)
            owner_of = {g.value: m.rank for m in owners for _, g in m.items()}
            owners_per_request[i] = {m.rank for m in owners if len(m)}
            if mode == "eager":
                pv, grids = preprocess_images(images, cfg)
                items, row = [], 0
                for s, thw in zip(specs, grids.tolist()):
                    n = s.plan.grid.patches
                    items.append(
                        Item(
                            data=pv[row : row + n],
                            consumers=tuple(range(n_ranks)),
                            kind="processed",
                            grid=Grid(tuple(thw)),
                        )
                    )
                    row += n
                payload[k] += pv.numel() * pv.element_size()
            else:
                items = [
                    Item(data=im, consumers=(owner_of[j],), preprocess=s, decode=mode == "raw")
                    for j, (im, s) in enumerate(zip(images, specs))
                ]
            envs = producers[k].publish(f"r{i}", items)
            if mode != "eager":
                payload[k] += sum(e.tensor.nbytes for e in envs)

    cpu0 = time.process_time()
    if len(producers) == 1:
        frontend(0)
    else:
        with ThreadPoolExecutor(len(producers)) as pool:
            for done_ in [pool.submit(frontend, k) for k in range(len(producers))]:
                done_.result()  # a frontend's error is the cell's
    cpu = time.process_time() - cpu0
    reports = ranks.wait("done", n_ranks * len(requests), timeout=600)
    done: dict[str, dict[int, float]] = {}
    for _, rank, rid, t, held in reports:
        if held:
            done.setdefault(rid, {})[rank] = t
    ttft = []
    for i, t_arrive in enumerate(arrivals):
        got = done.get(f"r{i}", {})
        if set(got) != owners_per_request[i]:
            raise RuntimeError(f"request r{i}: owners {owners_per_request[i]} reported {set(got)}")
        ttft.append(max(got.values()) - t_arrive)
    last = max(max(v.values()) for v in done.values())
    return {
        "mode": mode,
        "rate": rate,
        "ttft_s": ttft,
        "throughput_rps": len(requests) / (last - arrivals[0]),
        "payload_bytes": sum(payload),
        "producer_cpu_s_per_request": cpu / len(requests),
        "images": sum(len(r) for r in requests),
    }


def _ways(devices: list[str]) -> list[tuple[str, str, bool]]:
    """``(mode, owner device, gpu_decode)`` of every way a run measures."""
    ways = [("eager", devices[-1], False)]
    for device in devices:
        ways += [("raw", device, False), ("encoded", device, False)]
        if device.startswith("cuda") and _has_gpu_decoder():
            ways.append(("encoded", device, True))
    return ways


def _has_gpu_decoder() -> bool:
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError:
        return False
    return True


def run_pipeline(
    ranks: int = 2,
    requests: int = 30,
    rates: tuple[float, ...] = (0.5, 1.0, 2.0),
    devices: tuple[str, ...] = ("cpu",),
    out_dir: Path | None = None,
    console: Console | None = None,
    max_megapixels: float = 12.0,
) -> Path:
    """Eager, raw and encoded at ``rates`` x eager's capacity; TTFT-proxy percentiles."""
    console = console or Console()
    cfg = KimiConfig()
    reqs = _requests(requests, seed=11, max_megapixels=max_megapixels)
    for request in reqs[:3]:  # warm the caches, then measure eager's service time
        preprocess_images(request, cfg)
    t0 = time.perf_counter()
    for request in reqs:
        preprocess_images(request, cfg)
    service = (time.perf_counter() - t0) / len(reqs)
    capacity = 1.0 / service
    ways = _ways(list(devices))
    rows: list[dict[str, Any]] = []
    # every rate replays the same requests: without reuse off, the later rates would find
    # the raw pixels still resident in the arena and skip the very decode being measured
    producer = Producer(arena_size=2 << 30, full_timeout=60, reuse=False)
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("pipeline", total=len(ways) * len(rates))
            for mode, device, gpu_decode in ways:
                side = "eager" if mode == "eager" else "deferred"
                pool = Ranks(
                    _workers.pipeline_rank,
                    ranks,
                    lambda r, side=side, device=device, gpu_decode=gpu_decode: (
                        ranks,
                        [(producer.endpoint, producer.handover_path)],
                        side,
                        device,
                        gpu_decode,
                    ),  # type: ignore[misc]
                )
                try:
                    producer.wait_for_consumers(range(ranks), 120)
                    warm = _requests(2, seed=5, max_megapixels=max_megapixels)
                    _run(mode, warm, capacity, pool, [producer], ranks, cfg, seed=1)
                    for k, x in enumerate(rates):
                        row = _run(
                            mode, reqs, x * capacity, pool, [producer], ranks, cfg, seed=100 + k
                        )
                        row.update(rate_x_capacity=x, device=device, gpu_decode=gpu_decode)
                        rows.append(row)
                        progress.advance(task)
                    stop_ranks(producer)
                finally:
                    pool.close()
                    _drop_ranks(producer, ranks)
    finally:
        producer.close()
    payload: dict[str, Any] = {
        "kind": "pipeline",
        "rows": rows,
        "ranks": ranks,
        "max_megapixels": max_megapixels,
        "devices": list(devices),
        "eager_service_s": service,
        "notes": [
            "TTFT proxy: scheduled Poisson arrival -> the last owner of the request's items "
            "holds pixel_values (on the device for a cuda owner); queueing included",
            "requests are JPEG/PNG bytes; eager decodes and preprocesses on the tokenizer "
            "(one process) and ships fp32 patches to every rank; raw decodes there and "
            "ships uint8 pixels to the owner; encoded ships the bytes and the owner decodes",
            "owner: the owner's materializer (cpu, or the cuda kernels); +nvJPEG: JPEGs "
            "decoded on the GPU, approximate (see gpu_decode)",
            "CPU ms: the tokenizer process's CPU time per request",
            "rates are multiples of eager's measured capacity (1 / mean preprocessing time)",
        ],
    }
    cuda = next((d for d in devices if d.startswith("cuda")), None)
    if cuda is not None and _has_gpu_decoder():
        payload["gpu_decode"] = gpu_decode_accuracy(reqs, cuda)
    table = render_table(payload)
    console.print(table)
    folder = write_run("pipeline", payload, table, out_dir=out_dir)
    console.print(f"results written to {folder}")
    return folder


def gpu_decode_accuracy(requests: list[list[bytes]], device: str) -> dict[str, Any]:
    """How nvJPEG's pixels differ from Pillow's on the trace's distinct JPEGs, and what
    either takes to decode them all (Pillow on one thread, nvJPEG in one batched call)."""
    import torch
    from mmwire.transport.images import to_pixels
    from torchvision.io import ImageReadMode, decode_jpeg

    jpegs = list({data: None for r in requests for data in r if data[:2] == b"\xff\xd8"})
    t0 = time.perf_counter()
    exact = [to_pixels(data) for data in jpegs]
    pillow_s = time.perf_counter() - t0
    tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in jpegs]
    decode_jpeg(tensors[:1], mode=ImageReadMode.RGB, device=device)  # the decoder's start-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    approx = decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - t0
    total = differ = 0
    worst = 0
    abs_sum = 0.0
    for want, got in zip(exact, approx):
        diff = np.abs(got.permute(1, 2, 0).cpu().numpy().astype(np.int16) - want)
        total += diff.size
        differ += int((diff > 0).sum())
        worst = max(worst, int(diff.max()))
        abs_sum += float(diff.sum())
    return {
        "images": len(jpegs),
        "bytes": total,
        "bytes_differing": differ,
        "max_abs_diff": worst,
        "mean_abs_diff": abs_sum / total,
        "pillow_s": pillow_s,
        "nvjpeg_s": gpu_s,
    }


def render_table(payload: dict[str, Any]) -> Table:
    """The run's table (also re-renders a saved ``results.json``): per rate and way, the
    TTFT proxy's percentiles, throughput, MiB shipped, the tokenizer's CPU ms a request,
    and p50 against raw's on the same owner device (deferred decoded pixels) and eager's."""
    rows = payload["rows"]
    service = payload["eager_service_s"]
    devices = payload.get("devices") or [payload.get("device", "cpu")]
    table = Table(
        title=f"pipeline from encoded bytes: {payload['ranks']} ranks, owners on "
        f"{' and '.join(devices)}; eager capacity {1 / service:.1f} req/s"
    )
    accuracy = payload.get("gpu_decode")
    if accuracy:
        table.caption = (
            f"+nvJPEG (approximate): {accuracy['bytes_differing'] / accuracy['bytes']:.0%} of "
            f"the decoded bytes differ from Pillow's, by up to {accuracy['max_abs_diff']} "
            f"levels (mean {accuracy['mean_abs_diff']:.2f}); {accuracy['images']} JPEGs decode "
            f"in {accuracy['nvjpeg_s'] * 1e3:.0f} ms on the GPU, {accuracy['pillow_s'] * 1e3:.0f} "
            "ms with Pillow on one thread"
        )
    for col in (
        "rate",
        "way",
        "owner",
        "p50 ms",
        "p90",
        "p99",
        "req/s",
        "MiB",
        "CPU ms",
        "vs raw",
        "vs eager",
    ):
        table.add_column(col, justify="right")

    def owner(r: dict[str, Any]) -> str:
        device = str(r.get("device", devices[-1]))
        return device + ("+nvJPEG" if r.get("gpu_decode") else "")

    p50s = {(r["rate_x_capacity"], r["mode"], owner(r)): percentile(r["ttft_s"], 50) for r in rows}
    order = {m: k for k, m in enumerate(MODES)}

    def place(r: dict[str, Any]) -> tuple[float, int, int, bool]:
        device = str(r.get("device", devices[-1]))
        group = 0 if r["mode"] == "eager" else 1 + devices.index(device)
        return r["rate_x_capacity"], group, order.get(r["mode"], 9), bool(r.get("gpu_decode"))

    for r in sorted(rows, key=place):
        x, p50 = r["rate_x_capacity"], percentile(r["ttft_s"], 50)
        raw = p50s.get((x, "raw", str(r.get("device", devices[-1]))))
        eager = next((v for (rx, m, _), v in p50s.items() if rx == x and m == "eager"), None)
        table.add_row(
            f"{x:.1f}x",
            r["mode"],
            owner(r),
            f"{p50 * 1e3:.0f}",
            f"{percentile(r['ttft_s'], 90) * 1e3:.0f}",
            f"{percentile(r['ttft_s'], 99) * 1e3:.0f}",
            f"{r['throughput_rps']:.1f}",
            f"{r['payload_bytes'] / 2**20:.0f}",
            f"{r.get('producer_cpu_s_per_request', float('nan')) * 1e3:.0f}",
            f"{raw / p50:.1f}x" if raw and r["mode"] == "encoded" else "",
            f"{eager / p50:.1f}x" if eager and r["mode"] != "eager" else "",
        )
    return table


def stop_ranks(producer: Producer) -> None:
    """Publish the 'stop' request: every rank sees it and leaves."""
    stop = Item(data=np.zeros(1, np.uint8), consumers=(0,), kind="embedding", grid=Grid((1, 1)))
    producer.publish("stop", [stop])


def _drop_ranks(producer: Producer, ranks: int) -> None:
    """Let the producer see the ranks' handover connections close before the next mode."""
    deadline = time.monotonic() + 30
    while producer.statistics().consumers and time.monotonic() < deadline:
        producer.poll(0.05)
