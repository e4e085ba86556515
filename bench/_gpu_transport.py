"""``mmwire-bench gpu-transport``: a CUDA tensor from a producer process to a consumer process.

Latency = producer calls publish (the feature tensor already exists on its GPU) until the
consumer holds a usable CUDA tensor (its stream has passed the wait and is synchronised),
both read from ``CLOCK_MONOTONIC``, which is system-wide. Two stages are reported beside it,
to show where the time goes: the producer's call (``publish``, or the queue's ``put``) and
the moment the consumer's receive returned (for ``torch_mp`` that includes rebuilding the
tensor from its handles). Methods:

* ``cuda_ipc`` / ``fabric``: mmwire device pools (one D2D copy into the pool, stream-ordered
  ready flag; the consumer's stream waits on the GPU; it acknowledges on release);
* ``cpu``: mmwire without a device pool, the fallback for a full pool or a consumer on
  another host: the tensor is copied D2H straight into the producer's registered arena and
  the consumer uploads it from its registered mapping, both by DMA;
* ``torch_mp``: ``torch.multiprocessing`` queue with CUDA tensor sharing (cudaIpcMemHandle
  of the allocator block, pickled; the consumer opens it, cached per block), the way
  engines that pass CUDA tensors between processes do it;
* ``floor``: no handover at all: one byte through a pipe, then the consumer touches and
  synchronises a tensor it allocated itself. What every method pays on top of moving the
  tensor: a wake-up and the consumer's first GPU work after the producer's (two processes
  take turns on one GPU).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ._report import bar_plot, percentile, write_run

SPAWN = mp.get_context("spawn")
METHODS = ("cuda_ipc", "fabric", "cpu", "torch_mp", "floor")


def _touch_and_report(t: torch.Tensor, t_received: float, out: Any) -> None:
    """Touch ``t`` on this process's stream, synchronise, and report when it was usable."""
    t.view(-1)[-1:].sum()
    torch.cuda.current_stream().synchronize()
    out.put(("ready", t_received, time.monotonic(), int(t.numel())))


def _consumer(
    method: str, endpoint: str, handover: str, n: int, tq: Any, out: Any, size: int
) -> None:
    """Receive ``n`` tensors; report the monotonic time each became usable on this GPU."""
    torch.cuda.init()  # type: ignore[no-untyped-call]
    if method == "floor":  # ``tq``: the pipe's reading end
        mine = torch.zeros(size, dtype=torch.uint8, device="cuda")
        out.put(("joined",))
        for _ in range(n):
            tq.recv_bytes()
            _touch_and_report(mine, time.monotonic(), out)
        return
    if method == "torch_mp":
        out.put(("joined",))
        for _ in range(n):
            t = tq.get()
            _touch_and_report(t, time.monotonic(), out)
            del t
        return
    from mmwire.transport import Consumer, GlobalIndex

    c = Consumer(0, endpoint, handover=handover, device="cuda")
    if method == "cpu":
        c.register_with_cuda()
    out.put(("joined",))
    try:
        for _ in range(n):
            with c.recv(60) as b:
                t_received = time.monotonic()
                t = b.open_tensor(GlobalIndex(0))
                if not t.is_cuda:
                    t = t.to("cuda", non_blocking=True)
                _touch_and_report(t, t_received, out)
        torch.cuda.synchronize()
        time.sleep(0.5)
    finally:
        c.close()


def _run_method(method: str, size: int, reps: int) -> dict[str, list[float]]:
    """Per handover: ``seconds`` until usable, ``call`` (the producer's call) and
    ``received`` (until the consumer's receive returned), in seconds."""
    from mmwire.transport import Grid, Item, Producer

    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    out: Any = SPAWN.Queue()
    tq: Any = None
    producer = None
    endpoint = handover = ""
    if method == "floor":
        tq, wake = SPAWN.Pipe(duplex=False)
    elif method == "torch_mp":
        import torch.multiprocessing as tmp

        tq = tmp.get_context("spawn").Queue()
    else:
        pool = "none" if method == "cpu" else method
        producer = Producer(
            device_pool=pool,  # type: ignore[arg-type]
            device="cuda",
            device_pool_size=max(2 * size, 64 << 20),
            arena_size=max(2 * size, 64 << 20),
            on_pool_full="wait",
        )
        endpoint, handover = producer.endpoint, producer.handover_path
    proc = SPAWN.Process(
        target=_consumer, args=(method, endpoint, handover, reps + 2, tq, out, size)
    )
    proc.start()
    samples: dict[str, list[float]] = {"seconds": [], "call": [], "received": []}
    try:
        if out.get(timeout=120)[0] != "joined":
            raise RuntimeError(f"{method}: the consumer did not join")
        if producer is not None:
            producer.wait_for_consumers([0], 60)
        for i in range(reps + 2):
            feature = src.clone()  # the encoder's fresh output of this request
            torch.cuda.synchronize()
            t0 = time.monotonic()
            if method == "floor":
                wake.send_bytes(b"\0")
            elif producer is None:
                tq.put(feature)
            else:
                producer.publish(
                    f"r{i}",
                    [Item(data=feature, consumers=(0,), kind="embedding", grid=Grid((1, 1)))],
                )
            t_called = time.monotonic()
            kind, t_received, t_ready, numel = out.get(timeout=120)
            if kind != "ready" or numel != size:
                raise RuntimeError(f"{method}: consumer reported {kind} {numel}")
            if i >= 2:  # two warm-ups: imports, handle opens, first allocations
                samples["seconds"].append(t_ready - t0)
                samples["call"].append(t_called - t0)
                samples["received"].append(t_received - t0)
            if producer is not None:
                producer.poll(0)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        if producer is not None:
            producer.close()
    return samples


def render_table(rows: list[dict[str, Any]]) -> Table:
    """The p50/p99 table of a run's rows (also used to re-render a saved ``results.json``)."""
    table = Table(title="CUDA tensor, producer process -> consumer process (one GPU), p50")
    columns = ("size", "method", "p50", "p99", "call p50", "received p50", "GB/s at p50")
    for col in (*columns, "vs torch_mp"):
        table.add_column(col, justify="right")
    base = {r["bytes"]: percentile(r["seconds"], 50) for r in rows if r["method"] == "torch_mp"}
    for r in rows:
        p50 = percentile(r["seconds"], 50)
        ref = base.get(r["bytes"])
        table.add_row(
            f"{r['bytes'] >> 20} MiB",
            r["method"],
            f"{p50 * 1e3:.3f} ms",
            f"{percentile(r['seconds'], 99) * 1e3:.3f} ms",
            *(_stage(r, stage) for stage in ("call", "received")),
            f"{r['bytes'] / p50 / 1e9:.1f}",
            f"{ref / p50:.2f}x" if ref else "-",
        )
    return table


def _stage(row: dict[str, Any], stage: str) -> str:
    """A stage's p50 in ms (``-`` in a run saved before stages were reported)."""
    return f"{percentile(row[stage], 50) * 1e3:.3f} ms" if row.get(stage) else "-"


def render_plot(rows: list[dict[str, Any]]) -> Any:
    """p50 latency per size, one bar per method (a ``write_run`` plot writer)."""
    sizes = sorted({r["bytes"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    p50 = {(r["method"], r["bytes"]): percentile(r["seconds"], 50) * 1e3 for r in rows}
    return bar_plot(
        [f"{s >> 20} MiB" for s in sizes],
        {m: [p50.get((m, s), float("nan")) for s in sizes] for m in methods},
        "publish -> consumer-ready, ms (p50)",
    )


def run_gpu_transport(
    sizes: list[int] | None = None,
    reps: int = 50,
    methods: tuple[str, ...] = METHODS,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> Path:
    """Publish -> consumer-ready latency and throughput per method and size (needs CUDA)."""
    console = console or Console()
    if not torch.cuda.is_available():
        raise SystemExit("mmwire-bench gpu-transport needs a CUDA device")
    sizes = sizes or [1 << 20, 16 << 20, 64 << 20, 256 << 20]
    rows: list[dict[str, Any]] = []
    for size in sizes:
        for method in methods:
            console.print(f"gpu-transport: {method} {size >> 20} MiB")
            rows.append({"method": method, "bytes": size, **_run_method(method, size, reps)})
    table = render_table(rows)
    console.print(table)
    folder = write_run(
        "gpu-transport",
        {
            "kind": "gpu-transport",
            "rows": rows,
            "notes": [
                "latency: publish call until the consumer's stream is past the ready wait and "
                "synchronised (CLOCK_MONOTONIC in both processes); one consumer process, same GPU",
                "call: until publish (or the queue's put) returned; received: until the "
                "consumer's receive returned (torch_mp: the tensor rebuilt from its handles)",
                "fabric runs as posix_fd where the driver refuses FABRIC allocations",
                "cpu: D2H into the producer's registered arena, H2D from the consumer's "
                "registered mapping (the host fallback)",
                "floor: one byte through a pipe, then the same touch and synchronise on a tensor "
                "the consumer holds already: what every method pays beside the handover",
                "vs torch_mp > 1 means faster than torch.multiprocessing CUDA sharing",
            ],
        },
        table,
        render_plot(rows),
        out_dir=out_dir,
    )
    console.print(f"results written to {folder}")
    return folder
