"""The GPU backends' CPU-side parts: the ``auto`` rule, the pool offer in the handover (real
sockets, real fds), and the refusals a process without a pool or a GPU gets."""

from __future__ import annotations

import os

import msgspec
import pytest
from mmwire.transport import (
    Consumer,
    FeatureEnvelope,
    GlobalIndex,
    Grid,
    Producer,
    TensorSpec,
    choose_backend,
)
from mmwire.transport._device_pool import PoolOffer
from mmwire.transport._handover import HandoverServer, Offer, receive_arena
from mmwire.transport.errors import BackendUnavailable
from mmwire.transport.wire import SCHEMA_VERSION, CudaIpcRef, encode_batch


def _never() -> bool:
    raise AssertionError("the FABRIC probe must not run when it cannot change the choice")


def test_auto_rule() -> None:
    assert (
        choose_backend(
            gpu_tensors=False, consumers_span_hosts=True, fabric_permitted=_never
        ).backend
        == "cpu"
    )
    local = choose_backend(gpu_tensors=True, consumers_span_hosts=False, fabric_permitted=_never)
    assert local.backend == "cuda_ipc" and "this host" in local.reason
    remote = choose_backend(
        gpu_tensors=True, consumers_span_hosts=True, fabric_permitted=lambda: True
    )
    assert remote.backend == "fabric"
    refused = choose_backend(
        gpu_tensors=True, consumers_span_hosts=True, fabric_permitted=lambda: False
    )
    assert refused.backend == "cpu" and "refuses FABRIC" in refused.reason


@pytest.mark.parametrize("kind", ["cuda_ipc", "posix_fd"])
def test_pool_offer_travels_in_the_handover(tmp_path: object, kind: str) -> None:
    offer = PoolOffer(
        pool_id="p" * 32,
        kind=kind,  # type: ignore[arg-type]
        size=6 << 20,
        slots=1024,
        max_ranks=64,
        data_offset=2 << 20,
        handle=bytes(range(64)) if kind == "cuda_ipc" else None,
    )
    arena_r, arena_w = os.pipe()
    pool_r, pool_w = os.pipe()
    gone: list[bytes] = []
    server = HandoverServer(
        f"{tmp_path}/h.sock",
        [arena_r, pool_r] if kind == "posix_fd" else [arena_r],
        lambda hello, pid: (
            Offer(arena_id="arena-id", size=4096, member=b"s" * 16, pool=offer),
            [],
        ),
        gone.append,
    )
    try:
        h = receive_arena(server.path, rank=3)
        assert h.pool == offer and h.arena_id == "arena-id" and h.size == 4096
        assert h.member == b"s" * 16
        if kind == "posix_fd":
            assert h.pool_fd is not None
            os.write(pool_w, b"fd!")
            assert os.read(h.pool_fd, 3) == b"fd!"  # the very pipe, through SCM_RIGHTS
            os.close(h.pool_fd)
        else:
            assert h.pool_fd is None
        os.close(h.fd)
        h.conn.close()
    finally:
        server.close()
        for fd in (arena_r, arena_w, pool_r, pool_w):
            os.close(fd)


def test_pool_offer_rejects_a_short_or_wrong_handle() -> None:
    enc = msgspec.msgpack.encode(
        {"pool_id": "x", "kind": "nvlink", "size": 1, "slots": 1, "max_ranks": 1, "data_offset": 0}
    )
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(enc, type=PoolOffer)


def test_device_pool_needs_a_cuda_device() -> None:
    with pytest.raises(BackendUnavailable, match="needs a CUDA `device`"):
        Producer(device_pool="cuda_ipc")
    p = Producer(arena_size=1 << 20)
    try:
        assert p.backend_choice.backend == "cpu"
        assert p.statistics().device_pool is None
    finally:
        p.close()


def test_a_device_reference_without_a_pool_is_refused_and_the_consumer_keeps_serving() -> None:
    p = Producer(arena_size=1 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0], 10)
        env = FeatureEnvelope(
            version=SCHEMA_VERSION,
            request_id="forged",
            index=GlobalIndex(0),
            modality="image",
            kind="embedding",
            grid=Grid((1, 1)),
            tensor=TensorSpec(dtype="float32", shape=(4,), nbytes=16),
            payload=CudaIpcRef(pool_id="nope", slot=0, offset=0, length=16, generation=1),
            consumers=(0,),
        )
        batch = c.decode(encode_batch([env]))
        with pytest.raises(BackendUnavailable, match="device pool"):
            batch.open_tensor(GlobalIndex(0))
        with pytest.raises(BackendUnavailable, match="open_tensor"):
            batch.open(GlobalIndex(0))
        batch.release()  # nothing to acknowledge without a pool: no error
        import numpy as np
        from mmwire.transport import Item

        p.publish(
            "ok",
            [
                Item(
                    data=np.arange(4, dtype=np.float32),
                    consumers=(0,),
                    kind="embedding",
                    grid=Grid((1, 1)),
                )
            ],
        )
        with c.recv(10) as b:
            assert b.open(GlobalIndex(0)).tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        c.close()
        p.close()
