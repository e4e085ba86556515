"""``mmwire-bench transport``: publish -> every owner holds a usable tensor, per method.

Methods (each reproduces one engine's path; see ``_workers.py``):

* ``mmwire``: cpu arena, one write by the producer, only the owner (rank 0) opens a view;
  the other ranks receive the envelope only.
* ``pickle``: ``pickle.dumps`` of the tensor sent to every rank over zmq (engines' first way).
* ``oob``: msgpack header + the tensor as an out-of-band zmq frame, ``copy=False`` (vLLM).
* ``segment``: one ``/dev/shm`` segment per tensor, every rank clones it (SGLang cpu transport).
* ``tmp_queue``: ``torch.multiprocessing`` queue per rank (shared-memory fd per put).
"""

from __future__ import annotations

import mmap
import os
import pickle  # the peers' way, reproduced for comparison only
import resource
import secrets
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.multiprocessing as tmp
import zmq
from mmwire.transport import BackendUnavailable, Grid, Item, Producer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from . import _workers
from ._harness import Ranks
from ._report import percentile, write_run


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


class _Method:
    """Start ranks, send one payload, stop. ``copies`` = bytes copied per publish."""

    name = ""
    ranks: Ranks

    def __init__(self, n: int) -> None:
        self.n = n

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def copies(self, nbytes: int) -> int:
        raise NotImplementedError

    def round_done(self) -> None:
        """Called once every rank reported the payload usable."""

    def close(self) -> None:
        raise NotImplementedError


class _Mmwire(_Method):
    name = "mmwire"

    def __init__(self, n: int, max_bytes: int) -> None:
        super().__init__(n)
        self.p = Producer(arena_size=max(64 << 20, 3 * max_bytes + (16 << 20)), full_timeout=30)
        self.ranks = Ranks(
            _workers.mmwire_rank, n, lambda r: (n, self.p.endpoint, self.p.handover_path, False)
        )
        self.p.wait_for_consumers(range(n), 60)

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        self.p.publish(
            rid, [Item(data=tensor, consumers=(0,), kind="embedding", grid=Grid((1, 1)))]
        )

    def copies(self, nbytes: int) -> int:
        return nbytes  # the producer's one write into the arena; the owner reads in place

    def close(self) -> None:
        self.p.publish(
            "stop",
            [Item(data=np.zeros(1, np.uint8), consumers=(0,), kind="embedding", grid=Grid((1, 1)))],
        )
        self.ranks.close()
        self.p.close()


class _ZmqFanout(_Method):
    def __init__(self, n: int, target: Callable[..., None], tcp: bool = False) -> None:
        super().__init__(n)
        self.tmp = f"@mmwire-bench-{secrets.token_hex(8)}"  # abstract sockets: no files
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.socks = [self.ctx.socket(zmq.PUSH) for _ in range(n)]
        eps = []
        for r, s in enumerate(self.socks):
            s.bind("tcp://127.0.0.1:*" if tcp else f"ipc://{self.tmp}/{self.name}{r}")
            eps.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
        self.ranks = Ranks(target, n, lambda r: (eps[r],))

    def close(self) -> None:
        self.stop()
        self.ranks.close()
        for s in self.socks:
            s.close(0)
        self.ctx.term()

    def stop(self) -> None:
        raise NotImplementedError


class _Pickle(_ZmqFanout):
    name = "pickle"

    def __init__(self, n: int) -> None:
        super().__init__(n, _workers.pickle_rank)

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        blob = pickle.dumps({"rid": rid, "tensor": tensor})
        for s in self.socks:
            s.send(blob)

    def copies(self, nbytes: int) -> int:
        return nbytes + 2 * nbytes * self.n  # dumps, then zmq copy + loads per rank

    def stop(self) -> None:
        for s in self.socks:
            s.send(pickle.dumps({"rid": "stop"}))


class _PickleTcp(_Pickle):
    """Pickle over zmq on TCP: how the peers reach a rank on another host."""

    name = "pickle_tcp"

    def __init__(self, n: int) -> None:
        _ZmqFanout.__init__(self, n, _workers.pickle_rank, tcp=True)


class _Remote(_Mmwire):
    """mmwire to a rank on another host (here over loopback): the payload as zmq frames
    from the arena (``zmq_frames``), or pulled by the rank through Mooncake's Transfer
    Engine over TCP (``mooncake_tcp``)."""

    def __init__(self, n: int, max_bytes: int, pull: bool) -> None:
        _Method.__init__(self, n)
        from mmwire.transport import MooncakeTransfer

        self.name = "mooncake_tcp" if pull else "zmq_frames"
        with warnings.catch_warnings():  # loopback: the channel needs no CURVE here
            warnings.simplefilter("ignore", RuntimeWarning)
            self.p = Producer(
                "tcp://127.0.0.1:*",
                arena_size=max(64 << 20, 3 * max_bytes + (16 << 20)),
                full_timeout=30,
                allow_insecure_tcp=True,
                transfer=MooncakeTransfer() if pull else None,
            )
        pool = max(64 << 20, 2 * max_bytes + (16 << 20))
        self.ranks = Ranks(_workers.remote_rank, n, lambda r: (self.p.endpoint, pull, pool))
        self.p.wait_for_consumers(range(n), 60)

    def copies(self, nbytes: int) -> int:
        return 2 * nbytes  # the write into the arena, then the network's copy to the rank


class _Oob(_ZmqFanout):
    name = "oob"

    def __init__(self, n: int) -> None:
        super().__init__(n, _workers.oob_rank)

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        arr = tensor.numpy()
        header = msgspec.msgpack.encode([rid, arr.dtype.str, list(arr.shape)])
        for s in self.socks:
            s.send_multipart([header, arr.data], copy=False)

    def copies(self, nbytes: int) -> int:
        return nbytes * self.n  # ipc transport: kernel copy into each rank's buffer

    def stop(self) -> None:
        for s in self.socks:
            s.send_multipart([msgspec.msgpack.encode(["stop", "|u1", [1]]), b"\0"])


class _Segment(_ZmqFanout):
    name = "segment"

    def __init__(self, n: int) -> None:
        super().__init__(n, _workers.segment_rank)
        self.live: list[str] = []

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        arr = tensor.numpy()
        name = f"mmwire_bench_{os.getpid()}_{secrets.token_hex(4)}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, arr.nbytes)
        os.posix_fallocate(fd, 0, arr.nbytes)
        with mmap.mmap(fd, arr.nbytes) as m:
            np.frombuffer(m, dtype=arr.dtype).reshape(arr.shape)[...] = arr
        os.close(fd)
        msg = msgspec.msgpack.encode([rid, name, arr.dtype.str, list(arr.shape), arr.nbytes])
        for s in self.socks:
            s.send(msg)
        self.live.append(name)

    def round_done(self) -> None:
        for name in self.live:  # after every rank cloned it ("first reader unlinks")
            os.unlink(f"/dev/shm/{name}")
        self.live.clear()

    def copies(self, nbytes: int) -> int:
        return nbytes * (1 + self.n)

    def stop(self) -> None:
        for s in self.socks:
            s.send(msgspec.msgpack.encode(["stop", "", "", [], 0]))


class _TmpQueue(_Method):
    name = "tmp_queue"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        ctx = tmp.get_context("spawn")
        self.queues = [ctx.Queue() for _ in range(n)]
        self.ranks = Ranks(_workers.tmp_queue_rank, n, lambda r: (self.queues[r],))

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        shared = tensor.clone().share_memory_()  # type: ignore[no-untyped-call]  # one shm copy
        for q in self.queues:
            q.put((rid, shared))

    def copies(self, nbytes: int) -> int:
        return nbytes

    def close(self) -> None:
        for q in self.queues:
            q.put(("stop", None))
        self.ranks.close()


PEERS = ("pickle", "oob", "segment", "tmp_queue")
"""The engines' ways of moving a tensor to every rank that the benchmarks set beside mmwire."""

CROSS_HOST = ("zmq_frames", "mooncake_tcp", "pickle_tcp")
"""The ways to a rank on another host, run with one rank over loopback TCP."""


def make_method(name: str, n: int, max_bytes: int = 64 << 20) -> _Method:
    """Method ``name`` (mmwire, one of ``PEERS`` or ``CROSS_HOST``) with ``n`` ranks started
    and ready."""
    if name == "mmwire":
        return _Mmwire(n, max_bytes)
    if name in ("zmq_frames", "mooncake_tcp"):
        return _Remote(n, max_bytes, pull=name == "mooncake_tcp")
    peers = {
        "pickle": _Pickle,
        "oob": _Oob,
        "segment": _Segment,
        "tmp_queue": _TmpQueue,
        "pickle_tcp": _PickleTcp,
    }
    return peers[name](n)


def run_transport(
    sizes: list[int],
    consumers: list[int],
    methods: list[str],
    seconds: float,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> Path:
    """Every method x size x rank count; latency p50/p99, throughput, copies, CPU time."""
    console = console or Console()
    samples: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as bar:
        cells = [(n, name) for n in consumers for name in methods if name not in CROSS_HOST]
        cells += [(1, name) for name in methods if name in CROSS_HOST]  # one remote rank
        task = bar.add_task("transport", total=len(cells) * len(sizes))
        for n, name in cells:
            try:
                method = make_method(name, n, max(sizes))
            except BackendUnavailable as e:  # the transfer engine is an optional extra
                console.print(f"transport: {name} skipped: {e}")
                bar.advance(task, len(sizes))
                continue
            try:
                for size in sizes:
                    bar.update(task, description=f"{name} x{n} {size >> 10} KiB")
                    tensor = torch.from_numpy(
                        np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
                    )
                    lat: list[float] = []
                    cpu0, wall0 = _cpu_s(), time.perf_counter()
                    reps = 0
                    while reps < 3 or (time.perf_counter() - wall0 < seconds and reps < 200):
                        t0 = time.perf_counter()
                        method.send(f"{reps}", tensor)
                        done = method.ranks.wait("done", n)
                        lat.append(max(d[3] for d in done) - t0)
                        method.round_done()
                        reps += 1
                    wall = time.perf_counter() - wall0
                    samples.append(
                        {
                            "method": name,
                            "consumers": n,
                            "bytes": size,
                            "latency_s": lat,
                            "throughput_GBps": size * reps / wall / 1e9,
                            "copied_bytes": method.copies(size),
                            "cpu_s_per_publish": (_cpu_s() - cpu0) / reps,
                        }
                    )
                    bar.advance(task)
            finally:
                method.close()
    table = render_table({"samples": samples})
    cross = render_cross_host_table({"samples": samples})
    console.print(table)
    if cross is not None:
        console.print(cross)
    folder = write_run(
        "transport",
        {
            "kind": "transport",
            "samples": samples,
            "notes": [
                "owner = rank 0; mmwire's other ranks receive the envelope only, peers send the "
                "payload to every rank",
                "copied_bytes is the model of each path's copies per publish, not a measurement",
                "cross-host ways: one rank on loopback TCP (no RDMA here); zmq_frames sends the "
                "arena's bytes as zmq frames, mooncake_tcp lets the rank pull them through "
                "Mooncake's Transfer Engine, pickle_tcp pickles over zmq",
            ],
        },
        table,
        extra_tables=[] if cross is None else [cross],
        plot=lambda path: _plot(samples, methods, path),
        out_dir=out_dir,
    )
    console.print(f"results written to {folder}")
    return folder


def render_table(payload: dict[str, Any]) -> Table:
    """p50 ms per rank count and size, each peer's with its ratio to mmwire's (also
    re-renders a saved ``results.json``)."""
    samples = [s for s in payload["samples"] if s["method"] not in CROSS_HOST]
    methods = list(dict.fromkeys(s["method"] for s in samples))
    table = Table(title="publish -> every owner holds a usable tensor: p50 ms (x mmwire's)")
    for col in ("ranks", "size", *methods):
        table.add_column(col, justify="right")
    for n in sorted({s["consumers"] for s in samples}):
        for size in sorted({s["bytes"] for s in samples}):
            cells = {s["method"]: s for s in samples if s["consumers"] == n and s["bytes"] == size}
            p50 = {m: percentile(c["latency_s"], 50) * 1e3 for m, c in cells.items()}
            table.add_row(str(n), _size(size), *(_cell(p50, m) for m in methods))
    return table


def render_cross_host_table(payload: dict[str, Any]) -> Table | None:
    """p50 ms per size of the ways to a rank on another host, against zmq frames (``None``
    if the run had none)."""
    samples = [s for s in payload["samples"] if s["method"] in CROSS_HOST]
    if not samples:
        return None
    methods = [m for m in CROSS_HOST if any(s["method"] == m for s in samples)]
    table = Table(
        title="to a rank on another host (loopback TCP, 1 rank): p50 ms (x zmq_frames'), GB/s"
    )
    for col in ("size", *methods):
        table.add_column(col, justify="right")
    for size in sorted({s["bytes"] for s in samples}):
        cells = {s["method"]: s for s in samples if s["bytes"] == size}
        p50 = {m: percentile(c["latency_s"], 50) * 1e3 for m, c in cells.items()}
        table.add_row(
            _size(size),
            *(
                f"{_cell(p50, m, 'zmq_frames')}, {size / p50[m] / 1e6:.2f}" if m in p50 else "-"
                for m in methods
            ),
        )
    return table


def _cell(p50: dict[str, float], method: str, base_method: str = "mmwire") -> str:
    if method not in p50:
        return "-"
    value = f"{p50[method]:.1f}" if p50[method] >= 10 else f"{p50[method]:.2f}"
    base = p50.get(base_method)
    if method == base_method or base is None:
        return value
    return f"{value} ({p50[method] / base:.1f}x)"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _plot(samples: list[dict[str, Any]], methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({s["consumers"] for s in samples})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5 * len(ranks), 4), squeeze=False)
    for ax, n in zip(axes[0], ranks):
        for m in methods:
            pts = sorted(
                (s["bytes"], percentile(s["latency_s"], 50) * 1e3)
                for s in samples
                if s["method"] == m and s["consumers"] == n
            )
            if pts:
                ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_title(f"{n} ranks")
        ax.set_xlabel("payload bytes")
        ax.set_ylabel("p50 ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
