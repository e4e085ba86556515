"""The GPU backends (``pytest -m gpu``): device pools with stream-ordered ready/ack, real
processes on one GPU. They skip cleanly without CUDA."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import warnings
from typing import Any

import procs
import pytest
import torch
from mmwire.transport import Consumer, CurveKeys, GlobalIndex, Grid, Item, Producer
from mmwire.transport.errors import PeerGone
from mmwire.transport.wire import CpuRef, CudaIpcRef, FabricRef
from procs import CHILDREN
from test_cpu_backend import _Inbox

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KINDS = ["cuda_ipc", "fabric"]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _item(t: torch.Tensor, rank: int = 0) -> Item:
    return Item(data=t, consumers=(rank,), kind="embedding", grid=Grid((1, 1)))


def _settle(p: Producer, cond: Any, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        p.poll(0.02)
        p.reclaim()
    return True


@pytest.mark.parametrize("kind", KINDS)
def test_round_trips_are_byte_exact_across_processes(kind: str) -> None:
    p = Producer(device_pool=kind, device="cuda", device_pool_size=160 << 20)  # type: ignore[arg-type]
    inbox = _Inbox()
    cons = CHILDREN.Process(
        target=procs.gpu_consume, args=(0, p.endpoint, p.handover_path, 4, inbox.q)
    )
    try:
        cons.start()
        p.wait_for_consumers([0], 60)
        g = torch.Generator(device="cuda").manual_seed(7)
        batches = [
            [torch.randint(0, 256, (1 << 10,), dtype=torch.uint8, device="cuda", generator=g)],
            [torch.randn(1 << 18, device="cuda", generator=g)],
            [
                torch.randn(333, 777, device="cuda", generator=g).to(torch.bfloat16),
                torch.randn(64 << 20 >> 1, device="cuda", generator=g).to(torch.float16),
            ],
            [torch.randn(5, 3, 14, 14, device="cuda", generator=g)],
        ]
        for i, tensors in enumerate(batches):
            envs = p.publish(f"r{i}", [_item(t) for t in tensors])
            assert all(isinstance(e.payload, (CudaIpcRef, FabricRef)) for e in envs)
            got = inbox.get("batch", 120) if i == 0 else None
            if got is not None:
                assert got[3] == {k: _sha(t) for k, t in enumerate(tensors)}
        last = inbox.get("last", 120)  # batches 1..2 are not reported
        assert last[3] == {k: _sha(t) for k, t in enumerate(batches[-1])}
        inbox.get("done", 120)
        assert _settle(p, lambda: p.statistics().device_pool.items_in_use == 0)  # type: ignore[union-attr]
        st = p.statistics().device_pool
        assert (
            st is not None
            and st.host_fallbacks == 0
            and st.backend in ("cuda_ipc", "fabric", "posix_fd")
        )
    finally:
        cons.join(30)
        p.close()


@pytest.mark.parametrize("kind", KINDS)
def test_ten_thousand_requests_recycle_a_small_pool(kind: str) -> None:
    p = Producer(
        device_pool=kind,  # type: ignore[arg-type]
        device="cuda",
        device_pool_size=2 << 20,
        on_pool_full="wait",
        full_timeout=30,
    )
    inbox = _Inbox()
    n = 10_000
    cons = CHILDREN.Process(
        target=procs.gpu_consume, args=(0, p.endpoint, p.handover_path, n, inbox.q)
    )
    try:
        cons.start()
        p.wait_for_consumers([0], 60)
        base = torch.cuda.memory_allocated()
        data = torch.arange(16 << 10, dtype=torch.int32, device="cuda")  # 64 KiB per request
        for i in range(n):
            p.publish(f"r{i}", [_item(data + i)])
        last = inbox.get("last", 300)
        assert last[2] == n - 1 and last[3] == {0: _sha(data + n - 1)}
        inbox.get("done", 120)
        assert _settle(p, lambda: p.statistics().device_pool.items_in_use == 0)  # type: ignore[union-attr]
        st = p.statistics().device_pool
        assert st is not None and st.host_fallbacks == 0 and st.reclaims > 0
        assert torch.cuda.memory_allocated() - base < 1 << 20  # flat: the pool is reused
    finally:
        cons.join(30)
        p.close()


@pytest.mark.parametrize("kind", KINDS)
def test_killed_consumer_mid_read_gives_its_slots_back(kind: str) -> None:
    p = Producer(device_pool=kind, device="cuda", device_pool_size=8 << 20)  # type: ignore[arg-type]
    holder_inbox, survivor_inbox = _Inbox(), _Inbox()
    holder = CHILDREN.Process(
        target=procs.gpu_consume, args=(0, p.endpoint, p.handover_path, 1, holder_inbox.q, True)
    )
    survivor = CHILDREN.Process(
        target=procs.gpu_consume, args=(1, p.endpoint, p.handover_path, 2, survivor_inbox.q)
    )
    try:
        holder.start()
        survivor.start()
        p.wait_for_consumers([0, 1], 60)
        a = torch.full((1 << 20,), 3, dtype=torch.uint8, device="cuda")
        b = torch.full((1 << 19,), 5, dtype=torch.uint8, device="cuda")
        p.publish("r1", [_item(a, 0), _item(b, 1)])
        assert holder_inbox.get("holding", 120)[2] == {0: _sha(a)}
        assert survivor_inbox.get("batch", 120)[3] == {1: _sha(b)}
        assert _settle(p, lambda: p.statistics().device_pool.items_in_use == 1)  # type: ignore[union-attr]
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)  # mid-read: its slot was never acknowledged
        assert _settle(p, lambda: p.statistics().device_pool.items_in_use == 0)  # type: ignore[union-attr]
        p.publish("r2", [_item(b, 1)])  # the survivor keeps being served
        assert survivor_inbox.get("done", 120)[1] == 1
    finally:
        holder.join(10)
        survivor.join(30)
        p.close()


@pytest.mark.parametrize("kind", KINDS)
def test_killed_producer_gives_consumers_a_clear_error(kind: str) -> None:
    prod_q = CHILDREN.Queue()
    prod = CHILDREN.Process(target=procs.gpu_produce_then_hang, args=(prod_q, kind))
    prod.start()
    try:
        _, endpoint, handover = prod_q.get(timeout=120)
        c = Consumer(0, endpoint, handover=handover, device="cuda")
        try:
            prod_q.get(timeout=120)  # ("published",)
            first = c.recv(60)
            second = c.recv(60)
            assert int(first.open_tensor(GlobalIndex(0))[-1]) == (1 << 16) - 1
            os.kill(prod.pid, signal.SIGKILL)  # type: ignore[arg-type]
            prod.join(30)
            with pytest.raises(PeerGone, match="producer"):
                second.open_tensor(GlobalIndex(0))
            with pytest.raises(PeerGone):
                c.recv(5)
            first.release()  # no ack is attempted on a dead producer's pool: no error
        finally:
            c.close()
    finally:
        if prod.is_alive():
            prod.kill()
        prod.join(10)


def test_full_pool_falls_back_to_the_cpu_arena_with_one_warning() -> None:
    p = Producer(device_pool="cuda_ipc", device="cuda", device_pool_size=2 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path, device="cuda")  # same process
    try:
        p.wait_for_consumers([0], 30)
        small = torch.arange(1000, dtype=torch.float32, device="cuda")
        big = torch.arange(1 << 20, dtype=torch.float32, device="cuda")  # 4 MiB > the pool
        with pytest.warns(RuntimeWarning, match="device pool full"):
            envs = p.publish("r1", [_item(small), _item(big)])
        assert isinstance(envs[0].payload, CudaIpcRef) and isinstance(envs[1].payload, CpuRef)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the warning comes once
            p.publish("r2", [_item(big)])
        with c.recv(10) as b:
            assert torch.equal(b.open_tensor(GlobalIndex(0)), small)  # short-circuit mapping
            assert torch.equal(b.open_tensor(GlobalIndex(1)), big.cpu())
        with c.recv(10) as b:
            assert torch.equal(b.open_tensor(GlobalIndex(0)), big.cpu())
        assert p.statistics().device_pool.host_fallbacks == 2  # type: ignore[union-attr]
        torch.cuda.synchronize()
        assert _settle(p, lambda: p.statistics().device_pool.items_in_use == 0)  # type: ignore[union-attr]
    finally:
        c.close()
        p.close()


def test_fabric_refused_takes_the_posix_fd_path_and_auto_says_why() -> None:
    from mmwire.transport._device_pool import fabric_permitted

    permitted = fabric_permitted(torch.device("cuda"))
    p = Producer(device_pool="fabric", device="cuda", device_pool_size=4 << 20)
    try:
        st = p.statistics().device_pool
        assert st is not None
        assert st.backend == ("fabric" if permitted else "posix_fd")
        if not permitted:
            assert "refused" in st.reason
    finally:
        p.close()
    auto_local = Producer(device_pool="auto", device="cuda", device_pool_size=4 << 20)
    try:
        assert auto_local.backend_choice.backend == "cuda_ipc"
    finally:
        auto_local.close()
    auto_remote = Producer(
        "tcp://127.0.0.1:*",
        curve=CurveKeys.generate(),
        device_pool="auto",
        device="cuda",
        device_pool_size=4 << 20,
    )
    try:
        choice = auto_remote.backend_choice
        assert choice.backend == ("fabric" if permitted else "cpu")
        assert ("FABRIC" in choice.reason) and choice.reason
    finally:
        auto_remote.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kind", KINDS)
def test_consumer_on_another_gpu_opens_the_pool_on_its_own_device(kind: str) -> None:
    p = Producer(device_pool=kind, device="cuda:0", device_pool_size=32 << 20)  # type: ignore[arg-type]
    inbox = _Inbox()
    cons = CHILDREN.Process(
        target=procs.gpu_consume,
        args=(0, p.endpoint, p.handover_path, 2, inbox.q, False, "cuda:1"),
    )
    try:
        cons.start()
        p.wait_for_consumers([0], 60)
        g = torch.Generator(device="cuda:0").manual_seed(3)
        first = torch.randn(1 << 20, device="cuda:0", generator=g)
        last = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, device="cuda:0", generator=g)
        p.publish("a", [_item(first)])
        p.publish("b", [_item(last)])
        assert inbox.get("batch", 120)[3] == {0: _sha(first)}
        assert inbox.get("last", 120)[3] == {0: _sha(last)}
        inbox.get("done", 120)
        assert _settle(p, lambda: p.statistics().device_pool.items_in_use == 0)  # type: ignore[union-attr]
    finally:
        cons.join(30)
        p.close()


def test_cuda_items_through_the_host_are_copied_into_the_registered_arena() -> None:
    """Without a device pool, a CUDA tensor goes D2H straight into the arena, which a CUDA
    ``device`` registers at start; what arrives, and its digest, equal the host path's."""
    p = Producer(device="cuda", digests="all")
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        assert p.statistics().arena_registered
        p.wait_for_consumers([0], 30)
        c.register_with_cuda()
        g = torch.Generator(device="cuda").manual_seed(3)
        fp32 = torch.randn(333, 257, device="cuda", generator=g)
        bf16 = torch.randn(77, 129, device="cuda", generator=g).to(torch.bfloat16).t()  # strided
        envs = p.publish("r1", [_item(fp32), _item(bf16)])
        host = p.publish("r2", [_item(fp32.cpu()), _item(bf16.cpu())])
        assert all(isinstance(e.payload, CpuRef) for e in envs)
        assert [e.digest for e in envs] == [e.digest for e in host]
        assert envs[1].tensor.dtype == "bfloat16" and envs[1].tensor.shape == (129, 77)
        for want in (envs, host):
            with c.recv(10) as b:
                assert [e.digest for e in b.envelopes.values()] == [e.digest for e in want]
                got = [b.open_tensor(GlobalIndex(k)).to("cuda", non_blocking=True) for k in (0, 1)]
                torch.cuda.synchronize()
                assert torch.equal(got[0], fp32) and torch.equal(got[1], bf16)
    finally:
        c.close()
        p.close()
