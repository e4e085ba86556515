"""One scheduler rank of the example: receives batches, materialises the images it owns,
runs the stand-in model, reports to the frontend."""

from __future__ import annotations

import hashlib
import signal

import msgspec
import torch
import zmq
from mmwire.materialize import Materializer
from mmwire.transport import Consumer, IndexMap, ProducerAddress
from mmwire.transport.errors import MmwireError, PeerGone
from protocol import ItemReport, Report


def serve_rank(rank: int, producer: ProducerAddress, reports: str, cache_bytes: int) -> None:
    """The rank's scheduler loop, until the producer goes away or SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend's Ctrl-C is for it alone
    torch.set_num_threads(1)
    consumer = Consumer(rank, producer.endpoint, handover=producer.handover)
    materializer = Materializer(rank, cache_bytes=cache_bytes)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(reports)
    encoder = msgspec.msgpack.Encoder()
    try:
        while True:
            try:
                batch = consumer.recv(timeout=1.0)
            except TimeoutError:
                continue  # an engine's loop would run its decode steps here
            except PeerGone:
                return
            except MmwireError:
                continue  # a malformed batch: dropped, the rank keeps serving
            with batch:
                if not batch.owned:
                    continue  # every rank sees every request; only owners materialise
                index_map = IndexMap(rank, list(batch.owned))
                request_id = batch.envelopes[index_map.globals[0]].request_id
                before = materializer.cache_statistics()
                try:
                    features = materializer.materialize(batch, index_map)
                except MmwireError as e:  # the owner refuses what it cannot make exactly
                    error = f"{type(e).__name__}: {e}"
                    out.send(encoder.encode(Report(request_id, rank, [], 0, error)))
                    continue
                after = materializer.cache_statistics()
                hits = 0 if before is None or after is None else after.hits - before.hits
                items = []
                for local, g in index_map.items():
                    rows = features.features[local]
                    env = batch.envelopes[g]
                    items.append(
                        ItemReport(
                            index=g.value,
                            digest=env.digest,
                            grid_thw=list(env.grid.thw),
                            rows=int(rows.shape[0]),
                            sha256=hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest(),
                        )
                    )
                out.send(encoder.encode(Report(request_id, rank, items, hits)))
    finally:
        consumer.close()
        out.close()
        ctx.term()
