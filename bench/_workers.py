"""Scheduler-rank bodies for the benchmarks, one per way of moving features.

Each runs in its own spawned process, receives requests its way, makes the tensor usable
(and, in the demo, materialises it), and reports ``(tag, rank, request, perf_counter)`` to
the harness over a zmq PUSH socket (``perf_counter`` is CLOCK_MONOTONIC: comparable across
processes on one host). The peers' wire formats are reproduced here on purpose, pickle
included; the library itself never uses pickle.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle  # the peers' way, reproduced for comparison only
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

_ENC = msgspec.msgpack.Encoder()
_TORCH_DTYPES = {"|u1": torch.uint8, "<f4": torch.float32, "<f2": torch.float16, "<i8": torch.int64}


# Loggers through which torch warns of deprecations that vLLM's modules trip on import.
_VLLM_IMPORT_NOISE = ("torch._opaque_base", "torch._library.opaque_object")


def before_vllm_import() -> None:
    """Ready this process to import vLLM's pure-Python peers: its CPU target (no GPU
    probing), and without the deprecation warnings it makes torch print in every process."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    for name in _VLLM_IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)


# The ranks fork from a server that imported this module, and a vLLM rank unpickles the
# queue's handle, importing vLLM, before its body runs: so this is done at import.
before_vllm_import()


def _exit_with_parent() -> None:
    """End this rank when the harness dies: a zmq PULL or queue never notices on its own."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="mmwire-bench-parent-watch", daemon=True).start()


def _reporter(report: str) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    _exit_with_parent()  # every rank body starts by making its reporter
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(report)
    return ctx, sock


def _say(sock: zmq.Socket[Any], *fields: Any) -> None:
    sock.send(_ENC.encode(list(fields)))


def _requests(consumer: Any) -> Iterator[tuple[str, Any]]:
    """A mmwire rank's ``(request_id, batch)`` until the 'stop' request; each batch is
    released when the caller asks for the next one."""
    while True:
        try:
            batch = consumer.recv(timeout=0.5)
        except TimeoutError:
            continue
        with batch:
            rid = batch.envelopes.values()[0].request_id
            if rid == "stop":
                return
            yield rid, batch


@contextmanager
def _mmwire_session(
    rank: int, endpoint: str, handover: str | None, report: str, **options: Any
) -> Iterator[tuple[zmq.Socket[Any], Any]]:
    """A mmwire rank's reporter and consumer (``Consumer`` ``options``); the producer going
    away ends the session, and both are closed however it ends."""
    from mmwire.transport import Consumer
    from mmwire.transport.errors import PeerGone

    ctx, out = _reporter(report)
    consumer = Consumer(rank, endpoint, handover=handover, **options)
    try:
        yield out, consumer
    except PeerGone:
        pass
    finally:
        consumer.close()
        out.close(0)
        ctx.term()


@contextmanager
def _group_session(
    rank: int, producers: list[tuple[str, str]], report: str
) -> Iterator[tuple[zmq.Socket[Any], Any]]:
    """A rank's reporter and its ``ConsumerGroup`` of ``producers``; the producers going
    away ends the session, and both are closed however it ends."""
    from mmwire.transport import ConsumerGroup, ProducerAddress
    from mmwire.transport.errors import PeerGone

    ctx, out = _reporter(report)
    group = ConsumerGroup(rank, [ProducerAddress(e, h) for e, h in producers])
    try:
        yield out, group
    except PeerGone:
        pass
    finally:
        group.close()
        out.close(0)
        ctx.term()


def mmwire_rank(
    rank: int, ranks: int, endpoint: str, handover: str, materialize: bool, report: str
) -> None:
    """mmwire cpu: every rank gets the envelopes; the owner opens (and materialises) its items."""
    from mmwire.materialize import Materializer, assign_owners

    torch.set_num_threads(1)  # as in pipeline_rank: ranks share the host's cores
    with _mmwire_session(rank, endpoint, handover, report) as (out, consumer):
        mat = Materializer(rank)
        _say(out, "ready", rank, "", 0.0)
        for rid, batch in _requests(consumer):
            if materialize:
                counts = [e.grid.patches for e in batch.envelopes.values()]
                mine = assign_owners(counts, ranks)[rank]
                result = mat.materialize(batch, mine)
                nbytes = result.pixel_values.numel() * result.pixel_values.element_size()
            else:
                nbytes = sum(batch.open_tensor(g).numel() for g in batch.owned)
            _say(out, "done", rank, rid, time.perf_counter(), nbytes)


def remote_rank(rank: int, endpoint: str, pull: bool, pool: int, report: str) -> None:
    """A mmwire rank on "another host": no handover; its items arrive as zmq frames, or it
    pulls them through Mooncake's Transfer Engine (``pull``)."""
    from mmwire.transport import MooncakeTransfer

    transfer = MooncakeTransfer() if pull else None
    options = {"transfer": transfer, "receive_pool_size": pool}
    with _mmwire_session(rank, endpoint, None, report, **options) as (out, consumer):
        _say(out, "ready", rank, "", 0.0)
        for rid, batch in _requests(consumer):
            nbytes = sum(batch.open_tensor(g).numel() for g in batch.owned)
            _say(out, "done", rank, rid, time.perf_counter(), nbytes)


def _pull_rank(
    rank: int,
    endpoint: str,
    report: str,
    receive: Callable[[zmq.Socket[Any]], tuple[str, torch.Tensor | None]],
) -> None:
    """The loop every zmq-fed peer shares: receive its way until 'stop', report each tensor."""
    ctx, out = _reporter(report)
    sock = ctx.socket(zmq.PULL)
    sock.connect(endpoint)
    _say(out, "ready", rank, "", 0.0)
    while True:
        rid, tensor = receive(sock)
        if tensor is None:
            break
        _say(out, "done", rank, rid, time.perf_counter(), tensor.numel() * tensor.element_size())
    sock.close(0)
    out.close(0)
    ctx.term()


def _unpickle(sock: zmq.Socket[Any]) -> tuple[str, torch.Tensor | None]:
    obj = pickle.loads(sock.recv(copy=False).buffer)
    return obj["rid"], obj.get("tensor")


def _oob(sock: zmq.Socket[Any]) -> tuple[str, torch.Tensor | None]:
    header, frame = sock.recv_multipart(copy=False)
    rid, dtype, shape = msgspec.msgpack.decode(header.buffer)
    if rid == "stop":
        return rid, None
    with warnings.catch_warnings():  # the frame is read-only; vLLM wraps it without a copy
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(frame.buffer, dtype=torch.uint8)
    return rid, tensor.view(_TORCH_DTYPES[dtype]).reshape(shape)


def _clone_segment(sock: zmq.Socket[Any]) -> tuple[str, torch.Tensor | None]:
    rid, name, dtype, shape, nbytes = msgspec.msgpack.decode(sock.recv())
    if rid == "stop":
        return rid, None
    fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as m:
        arr = np.frombuffer(m, dtype=np.dtype(dtype)).reshape(shape).copy()  # every rank clones
    os.close(fd)
    return rid, torch.from_numpy(arr)


def pickle_rank(rank: int, endpoint: str, report: str) -> None:
    """Pickle over zmq (what engines did first): every rank unpickles the whole request."""
    _pull_rank(rank, endpoint, report, _unpickle)


def oob_rank(rank: int, endpoint: str, report: str) -> None:
    """msgpack header + out-of-band frames without copying (vLLM's serial_utils way)."""
    _pull_rank(rank, endpoint, report, _oob)


def segment_rank(rank: int, endpoint: str, report: str) -> None:
    """One /dev/shm segment per tensor, cloned by every rank (SGLang's cpu feature transport)."""
    _pull_rank(rank, endpoint, report, _clone_segment)


def _serve_queue(
    rank: int,
    report: str,
    get: Callable[[], tuple[str, Any]],
    ready: Callable[[], None] = lambda: None,
) -> None:
    """The loop of a rank fed by a queue: say ready, then ``ready()`` (a handshake after
    the harness knows the rank is up), then take ``(request, tensor)`` until 'stop'."""
    ctx, out = _reporter(report)
    _say(out, "ready", rank, "", 0.0)
    ready()
    while True:
        rid, tensor = get()
        if rid == "stop":
            break
        _say(out, "done", rank, rid, time.perf_counter(), tensor.numel() * tensor.element_size())
        del tensor
    out.close(0)
    ctx.term()


def tmp_queue_rank(rank: int, queue: Any, report: str) -> None:
    """torch.multiprocessing queue: the tensor arrives as a shared-memory fd per put."""
    _serve_queue(rank, report, queue.get)


def pipeline_rank(
    rank: int,
    ranks: int,
    producers: list[tuple[str, str]],
    mode: str,
    device: str,
    gpu_decode: bool,
    report: str,
) -> None:
    """A rank of ``mmwire-bench pipeline``: reports when it holds its items' pixel_values.

    ``producers``: each frontend's ``(endpoint, handover)``; a rank fed by several reads
    them through one ``ConsumerGroup``. eager: every rank receives every item's fp32
    patches; the item's owner (the ``assign_owners`` rank, as in deferred) holds them once
    opened (uploaded, on a GPU). deferred: only the owner receives the raw uint8 item and
    materialises it.
    """
    from mmwire.materialize import Materializer, assign_owners
    from mmwire.transport import IndexMap

    torch.set_num_threads(1)  # N ranks share the host's cores; spinning OpenMP pools would fight
    on_gpu = device.startswith("cuda")
    with _group_session(rank, producers, report) as (out, consumer):
        if on_gpu:
            for member in consumer.members:
                member.register_with_cuda()
        mat = Materializer(rank, device=device, gpu_decode=gpu_decode)
        _say(out, "ready", rank, "", 0.0)
        for rid, batch in _requests(consumer):
            held = 0
            if mode == "deferred":
                mine = IndexMap(rank, list(batch.owned))
                if len(mine):
                    held = mat.materialize(batch, mine).pixel_values.numel()
            else:
                counts = [e.grid.patches for e in batch.envelopes.values()]
                for _, g in assign_owners(counts, ranks)[rank].items():
                    t = batch.open_tensor(g)
                    if on_gpu:
                        t = t.to(device, non_blocking=True)
                    held += t.numel()
            if on_gpu:
                torch.cuda.synchronize()
            _say(out, "done", rank, rid, time.perf_counter(), held)


def engine_rank(
    rank: int, endpoint: str, handover: str, cache_bytes: int, device: str, report: str
) -> None:
    """A rank of ``mmwire-bench engine``: materialises its items on ``device`` (through its
    output cache when ``cache_bytes``) and reports the time that took and the cache's hits."""
    from mmwire.materialize import Materializer
    from mmwire.transport import IndexMap

    torch.set_num_threads(1)
    on_gpu = device.startswith("cuda")
    with _mmwire_session(rank, endpoint, handover, report) as (out, consumer):
        if on_gpu:
            consumer.register_with_cuda()
        mat = Materializer(rank, device=device, cache_bytes=cache_bytes)
        _say(out, "ready", rank, "", 0.0)
        for rid, batch in _requests(consumer):
            mine = IndexMap(rank, list(batch.owned))
            if not len(mine):
                _say(out, "done", rank, rid, time.perf_counter(), 0.0, 0)
                continue
            before = mat.cache_statistics()
            t0 = time.perf_counter()
            mat.materialize(batch, mine)
            if on_gpu:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            after = mat.cache_statistics()
            hits = after.hits - before.hits if after is not None and before is not None else 0
            _say(out, "done", rank, rid, t1, t1 - t0, hits)


def vllm_mq_rank(rank: int, handle: Any, report: str) -> None:
    """vLLM's own shared-memory broadcast queue (``shm_broadcast.MessageQueue``), as its
    executor's workers read it: every rank dequeues the whole object."""
    torch.set_num_threads(1)
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    _serve_queue(rank, report, lambda: mq.dequeue(indefinite=True), mq.wait_until_ready)


def vllm_store_rank(rank: int, endpoint: str, handle: Any, report: str) -> None:
    """vLLM's multimodal shared-memory object store (``SingleWriterShmObjectStorage``, what
    ``mm_processor_cache_type=shm`` uses): the item's signed address arrives over zmq and
    the rank reads the object from the store."""
    torch.set_num_threads(1)
    from vllm.distributed.device_communicators.shm_object_storage import (
        SingleWriterShmObjectStorage,
    )

    store = SingleWriterShmObjectStorage.create_from_handle(handle)

    def receive(sock: zmq.Socket[Any]) -> tuple[str, torch.Tensor | None]:
        rid, key, address, monotonic_id, signature = msgspec.msgpack.decode(sock.recv())
        if rid == "stop":
            return rid, None
        return rid, store.get(address, monotonic_id, signature, key)

    try:
        _pull_rank(rank, endpoint, report, receive)
    finally:
        store.close()
