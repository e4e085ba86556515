"""Scheduler-rank bodies for the benchmarks, one per way of moving features.

Each runs in its own spawned process, receives requests its way, makes the tensor usable
(and, in the demo, materialises it), and reports ``(tag, rank, request, perf_counter)`` to
the harness over a zmq PUSH socket (``perf_counter`` is CLOCK_MONOTONIC: comparable across
processes on one host). The peers' wire formats are reproduced here on purpose, pickle
included; the library itself never uses pickle.
"""

from __future__ import annotations

import mmap
import os
import pickle  # the peers' way, reproduced for comparison only
import time
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

_ENC = msgspec.msgpack.Encoder()


def _reporter(report: str) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(report)
    return ctx, sock


def _say(sock: zmq.Socket[Any], *fields: Any) -> None:
    sock.send(_ENC.encode(list(fields)))


def mmwire_rank(
    rank: int, ranks: int, endpoint: str, handover: str, materialize: bool, report: str
) -> None:
    """mmwire cpu: every rank gets the envelopes; the owner opens (and materialises) its items."""
    from mmwire.materialize import Materializer, assign_owners
    from mmwire.transport import CpuConsumer, PeerGone

    ctx, out = _reporter(report)
    consumer = CpuConsumer(rank, endpoint, handover=handover)
    mat = Materializer(rank)
    _say(out, "ready", rank, "", 0.0)
    try:
        while True:
            try:
                batch = consumer.recv(timeout=0.5)
            except TimeoutError:
                continue
            with batch:
                rid = batch.envelopes.values()[0].request_id
                if rid == "stop":
                    break
                if materialize:
                    counts = [e.grid.patches for e in batch.envelopes.values()]
                    mine = assign_owners(counts, ranks)[rank]
                    result = mat.materialize(batch, mine)
                    nbytes = result.pixel_values.numel() * result.pixel_values.element_size()
                else:
                    nbytes = sum(batch.open_tensor(g).numel() for g in batch.owned)
                _say(out, "done", rank, rid, time.perf_counter(), nbytes)
    except PeerGone:
        pass
    finally:
        consumer.close()
        out.close(0)
        ctx.term()


def pickle_rank(rank: int, endpoint: str, report: str) -> None:
    """Pickle over zmq (what engines did first): every rank unpickles the whole request."""
    ctx, out = _reporter(report)
    sock = ctx.socket(zmq.PULL)
    sock.connect(endpoint)
    _say(out, "ready", rank, "", 0.0)
    while True:
        obj = pickle.loads(sock.recv(copy=False).buffer)  # noqa: S301 - the peer path
        if obj["rid"] == "stop":
            break
        tensor = obj["tensor"]
        _say(
            out,
            "done",
            rank,
            obj["rid"],
            time.perf_counter(),
            tensor.numel() * tensor.element_size(),
        )
    sock.close(0)
    out.close(0)
    ctx.term()


def oob_rank(rank: int, endpoint: str, report: str) -> None:
    """msgpack header + out-of-band frames without copying (vLLM's serial_utils way)."""
    ctx, out = _reporter(report)
    sock = ctx.socket(zmq.PULL)
    sock.connect(endpoint)
    _say(out, "ready", rank, "", 0.0)
    while True:
        header, frame = sock.recv_multipart(copy=False)
        rid, dtype, shape = msgspec.msgpack.decode(header.buffer)
        if rid == "stop":
            break
        arr = np.frombuffer(frame.buffer, dtype=np.dtype(dtype)).reshape(shape)
        tensor = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        _say(out, "done", rank, rid, time.perf_counter(), tensor.numel() * tensor.element_size())
    sock.close(0)
    out.close(0)
    ctx.term()


def segment_rank(rank: int, endpoint: str, report: str) -> None:
    """One /dev/shm segment per tensor, cloned by every rank (SGLang's cpu feature transport)."""
    ctx, out = _reporter(report)
    sock = ctx.socket(zmq.PULL)
    sock.connect(endpoint)
    _say(out, "ready", rank, "", 0.0)
    while True:
        rid, name, dtype, shape, nbytes = msgspec.msgpack.decode(sock.recv())
        if rid == "stop":
            break
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as m:
            arr = np.frombuffer(m, dtype=np.dtype(dtype)).reshape(shape).copy()  # every rank clones
        os.close(fd)
        tensor = torch.from_numpy(arr)
        _say(out, "done", rank, rid, time.perf_counter(), tensor.numel() * tensor.element_size())
    sock.close(0)
    out.close(0)
    ctx.term()


def tmp_queue_rank(rank: int, queue: Any, report: str) -> None:
    """torch.multiprocessing queue: the tensor arrives as a shared-memory fd per put."""
    ctx, out = _reporter(report)
    _say(out, "ready", rank, "", 0.0)
    while True:
        rid, tensor = queue.get()
        if rid == "stop":
            break
        _say(out, "done", rank, rid, time.perf_counter(), tensor.numel() * tensor.element_size())
        del tensor
    out.close(0)
    ctx.term()
