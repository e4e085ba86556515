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
from mmwire.transport import Grid, Item, Producer
from mmwire.transport.errors import BackendUnavailable
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from . import _workers
from ._harness import Ranks
from ._report import percentile, write_run


def _cpu_s(ranks: Ranks) -> float:
    """CPU seconds used so far by this process and the method's live rank processes (a
    rank that spins shows here, not in the latency)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    total = r.ru_utime + r.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for p in ranks.procs:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _throughput(method: _Method, tensor: torch.Tensor, n: int, requests: int) -> float:
    """Requests per second one producer sustains to ``n`` ranks, nothing pacing it:
    ``requests`` sends back to back, until every rank has reported every one."""
    t0 = time.perf_counter()
    for k in range(requests):
        method.send(f"t{k}", tensor)
    done = method.ranks.wait("done", n * requests)
    method.round_done()
    return requests / (max(float(d[3]) for d in done) - t0)


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
    def __init__(
        self, n: int, target: Callable[..., None], tcp: bool = False, extra: tuple[Any, ...] = ()
    ) -> None:
        super().__init__(n)
        self.tmp = f"@mmwire-bench-{secrets.token_hex(8)}"  # abstract sockets: no files
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.socks = [self.ctx.socket(zmq.PUSH) for _ in range(n)]
        eps = []
        for r, s in enumerate(self.socks):
            s.bind("tcp://127.0.0.1:*" if tcp else f"ipc://{self.tmp}/{self.name}{r}")
            eps.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
        self.ranks = Ranks(target, n, lambda r: (eps[r], *extra))

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
                transfer=MooncakeTransfer(window_size=max(256 << 20, 2 * max_bytes + (16 << 20)))
                if pull
                else None,
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


class _VllmQueue(_Method):
    """vLLM's ``shm_broadcast.MessageQueue`` with its executor's defaults (16 MiB chunks,
    10 of them; larger objects overflow to zmq): the writer enqueues, every rank dequeues."""

    name = "vllm_mq"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        self.mq = MessageQueue(n, n, max_chunk_bytes=16 << 20, max_chunks=10)
        handle = self.mq.export_handle()
        self.ranks = Ranks(_workers.vllm_mq_rank, n, lambda r: (handle,))
        self.mq.wait_until_ready()

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        self.mq.enqueue((rid, tensor), timeout=60)  # TimeoutError if a reader stops reading

    def copies(self, nbytes: int) -> int:
        return nbytes * (1 + self.n)  # into the ring, then each reader's copy out of it

    def close(self) -> None:
        self.mq.enqueue(("stop", None))
        self.ranks.close()
        self.mq.shutdown()


class _VllmStore(_ZmqFanout):
    """vLLM's multimodal ``SingleWriterShmObjectStorage`` (``mm_processor_cache_type=shm``):
    the writer puts the tensor and sends each rank its signed address over zmq; every rank
    reads it from the store."""

    name = "vllm_store"

    def __init__(self, n: int, max_bytes: int) -> None:
        import multiprocessing as mp

        from vllm.distributed.device_communicators.shm_object_storage import (
            SingleWriterShmObjectStorage,
            SingleWriterShmRingBuffer,
        )

        ring = SingleWriterShmRingBuffer(max(64 << 20, 3 * max_bytes + (16 << 20)), create=True)
        self.store = SingleWriterShmObjectStorage(
            max_object_size=max_bytes + (1 << 20),
            n_readers=n,
            ring_buffer=ring,
            reader_lock=mp.get_context("spawn").Lock(),
        )
        self.puts = 0
        super().__init__(n, _workers.vllm_store_rank, extra=(self.store.handle(),))

    def send(self, rid: str, tensor: torch.Tensor) -> None:
        key = f"{rid}-{self.puts}"
        self.puts += 1
        while True:  # a full store waits for its readers, as vLLM's sender cache would
            try:
                address, monotonic_id = self.store.put(key, tensor)
                break
            except MemoryError:
                time.sleep(0.0005)
        message = msgspec.msgpack.encode(
            [rid, key, address, monotonic_id, self.store.get_signature(key)]
        )
        for s in self.socks:
            s.send(message)

    def copies(self, nbytes: int) -> int:
        return nbytes * (1 + self.n)  # into the store, then each reader's decode copies it

    def stop(self) -> None:
        for s in self.socks:
            s.send(msgspec.msgpack.encode(["stop", "", 0, 0, []]))

    def close(self) -> None:
        super().close()
        self.store.close()


def vllm_missing() -> str:
    """Why vLLM's modules do not import here (``""`` if they do)."""
    try:  # this process is ready to import them: see ``_workers.before_vllm_import``
        from vllm.distributed.device_communicators import (  # noqa: F401
            shm_broadcast,
            shm_object_storage,
        )
        from vllm.multimodal.inputs import MultiModalKwargsItem  # noqa: F401  (the store's serde)
        from vllm.v1.serial_utils import MsgpackEncoder  # noqa: F401
    except Exception as e:  # vLLM is an optional peer; any import failure means "absent"
        return f"{type(e).__name__}: {e}"
    return ""


LABELS = {
    "mmwire": "mmwire",
    "pickle": "pickle over zmq",
    "oob": "msgpack + out-of-band frames",
    "segment": "a segment per tensor",
    "tmp_queue": "torch.multiprocessing",
    "vllm_mq": "vLLM MessageQueue",
    "vllm_store": "vLLM shm object store",
}
"""What the README calls each method."""

PEERS = ("pickle", "oob", "segment", "tmp_queue")
"""The engines' ways of moving a tensor to every rank that the benchmarks set beside mmwire."""

VLLM = ("vllm_mq", "vllm_store")
"""vLLM's own modules, run when vLLM imports (``pip install .[peers]``)."""

CROSS_HOST = ("zmq_frames", "mooncake_tcp", "pickle_tcp")
"""The ways to a rank on another host, run with one rank over loopback TCP."""


def make_method(name: str, n: int, max_bytes: int = 64 << 20) -> _Method:
    """Method ``name`` (mmwire, one of ``PEERS`` or ``CROSS_HOST``) with ``n`` ranks started
    and ready."""
    if name == "mmwire":
        return _Mmwire(n, max_bytes)
    if name in ("zmq_frames", "mooncake_tcp"):
        return _Remote(n, max_bytes, pull=name == "mooncake_tcp")
    if name == "vllm_mq":
        return _VllmQueue(n)
    if name == "vllm_store":
        return _VllmStore(n, max_bytes)
    peers = {
        "pickle": _Pickle,
        "oob": _Oob,
        "segment": _Segment,
        "tmp_queue": _TmpQueue,
        "pickle_tcp": _PickleTcp,
    }
    return peers[name](n)


def _measure(
    method: _Method,
    name: str,
    n: int,
    size: int,
    seconds: float,
    throughput_size: int,
    throughput_requests: int,
) -> dict[str, Any] | None:
    """One method x rank count x size: latencies, CPU, and the unpaced rate at
    ``throughput_size``; ``None`` if a rank stopped answering."""
    tensor = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8))
    lat: list[float] = []
    try:
        cpu0, wall0 = _cpu_s(method.ranks), time.perf_counter()
        reps = 0
        while reps < 3 or (time.perf_counter() - wall0 < seconds and reps < 1000):
            t0 = time.perf_counter()
            method.send(f"{reps}", tensor)
            done = method.ranks.wait("done", n)
            lat.append(max(d[3] for d in done) - t0)
            method.round_done()
            reps += 1
        wall = time.perf_counter() - wall0
        sample = {
            "method": name,
            "consumers": n,
            "bytes": size,
            "latency_s": lat,
            "throughput_GBps": size * reps / wall / 1e9,
            "copied_bytes": method.copies(size),
            "cpu_s_per_1000": (_cpu_s(method.ranks) - cpu0) / reps * 1000,
        }
        if size == throughput_size and name not in CROSS_HOST:
            sample["requests_per_s"] = _throughput(method, tensor, n, throughput_requests)
    except TimeoutError:
        return None
    return sample


def run_transport(
    sizes: list[int],
    consumers: list[int],
    methods: list[str],
    seconds: float,
    out_dir: Path | None = None,
    console: Console | None = None,
    throughput_size: int = 64 << 10,
    throughput_requests: int = 2000,
) -> Path:
    """Every method x size x rank count: latency p50/p99, copies, CPU per 1,000 requests;
    and each method's sustained rate at ``throughput_size``."""
    console = console or Console()
    if any(m in VLLM for m in methods):
        why = vllm_missing()
        if why:
            # not markup: rich would take "[peers]" (and brackets in the reason) for a tag
            console.print(
                f"transport: vLLM's peers skipped (pip install '.[peers]'): {why}", markup=False
            )
            methods = [m for m in methods if m not in VLLM]
    samples: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as bar:
        cells = [(n, name) for n in consumers for name in methods if name not in CROSS_HOST]
        cells += [(1, name) for name in methods if name in CROSS_HOST]  # one remote rank
        task = bar.add_task("transport", total=len(cells) * len(sizes))
        for n, name in cells:
            try:
                method = make_method(name, n, max(sizes))
            except BackendUnavailable as e:  # the transfer engine is an optional extra
                console.print(f"transport: {name} skipped: {e}", markup=False)
                bar.advance(task, len(sizes))
                continue
            try:
                for size in sizes:
                    bar.update(task, description=f"{name} x{n} {size >> 10} KiB")
                    sample = _measure(
                        method, name, n, size, seconds, throughput_size, throughput_requests
                    )
                    if sample is None:
                        console.print(
                            f"transport: {name} x{n} stopped at {_size(size)}: a rank hung"
                        )
                        break
                    samples.append(sample)
                    bar.advance(task)
            finally:
                method.close()
    table = render_table({"samples": samples})
    rates = render_rate_table({"samples": samples})
    cross = render_cross_host_table({"samples": samples})
    extra = [t for t in (rates, cross) if t is not None]
    console.print(table)
    for t in extra:
        console.print(t)
    folder = write_run(
        "transport",
        {
            "kind": "transport",
            "samples": samples,
            "notes": [
                "owner = rank 0; mmwire's other ranks receive the envelope only, peers send the "
                "payload to every rank",
                "copied_bytes is the model of each path's copies per publish, not a measurement",
                "cpu_s_per_1000: CPU seconds of the producer and every rank per 1,000 requests "
                "of the latency loop (a peer whose readers spin pays here)",
                "requests_per_s: requests sent back to back, nothing pacing them, until every "
                "rank reported every one",
                "cross-host ways: one rank on loopback TCP (no RDMA here); zmq_frames sends the "
                "arena's bytes as zmq frames, mooncake_tcp lets the rank pull them through "
                "Mooncake's Transfer Engine, pickle_tcp pickles over zmq",
            ],
        },
        table,
        extra_tables=extra,
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


def render_rate_table(payload: dict[str, Any]) -> Table | None:
    """Per rank count, each method's sustained requests/s at the throughput size (x
    mmwire's) and CPU seconds per 1,000 requests (``None`` if the run measured no rate)."""
    samples = [s for s in payload["samples"] if "requests_per_s" in s]
    if not samples:
        return None
    methods = list(dict.fromkeys(s["method"] for s in samples))
    size = _size(samples[0]["bytes"])
    table = Table(title=f"{size} requests, unpaced: requests/s (x mmwire's); CPU s per 1,000")
    for col in ("ranks", *methods):
        table.add_column(col, justify="right")
    for n in sorted({s["consumers"] for s in samples}):
        cells = {s["method"]: s for s in samples if s["consumers"] == n}
        base = cells.get("mmwire")
        row = []
        for m in methods:
            c = cells.get(m)
            if c is None:
                row.append("-")
                continue
            ratio = (
                ""
                if base is None or m == "mmwire"
                else (f" ({c['requests_per_s'] / base['requests_per_s']:.2f}x)")
            )
            row.append(f"{c['requests_per_s']:,.0f}{ratio}; {c['cpu_s_per_1000']:.2f}")
        table.add_row(str(n), *row)
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
