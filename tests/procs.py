"""Child-process bodies for the multi-process tests (importable by name, as a forkserver
needs them), and ``CHILDREN``, the context that starts them."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mmwire.transport import Consumer, GlobalIndex
from mmwire.transport.errors import PeerGone

# Children fork from a server that imported torch, mmwire and this module once: a spawned
# child spent 0.5-3 s of CPU on those imports, about a tenth of the suite on two cores.
# The server never touches CUDA, so a child may use it as a spawned one would.
CHILDREN = mp.get_context("forkserver")
CHILDREN.set_forkserver_preload(["torch", "mmwire.transport", "mmwire.materialize", "procs"])


def arena_rss_kib() -> int:
    """Resident KiB of this process's arena mapping(s) (memfd 'mmwire-arena-*')."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split()[0] and len(line.split()) >= 5:
                inside = "mmwire-arena" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@contextmanager
def _reporting(c: Consumer, q: Any, rank: int, *, reraise: bool = True) -> Iterator[None]:
    """Report how a consumer's member ended ("peer-gone" or "error", so the test can show
    it; an error is raised again unless ``reraise`` is off) and close the consumer."""
    try:
        yield
    except PeerGone as e:
        q.put(("peer-gone", rank, str(e)))
    except Exception as e:
        q.put(("error", rank, repr(e)))
        if reraise:
            raise
    finally:
        c.close()


def consume(
    rank: int, endpoint: str, handover: str | None, n_batches: int, q: Any, hold: bool = False
) -> None:
    """Receive batches; report sha256 of owned payloads, counters and arena RSS."""
    c = Consumer(rank, endpoint, handover=handover)
    q.put(("joined", rank))
    with _reporting(c, q, rank):
        for _ in range(n_batches):
            b = c.recv(timeout=30)
            digests = {g.value: hashlib.sha256(b.open(g).tobytes()).hexdigest() for g in b.owned}
            st = c.statistics()
            q.put(("batch", rank, digests, st.items_opened, arena_rss_kib(), os.getpid()))
            if hold:
                time.sleep(3600)  # keep the lease until killed
            b.release()
        q.put(("done", rank))


def wait_then_recv(rank: int, endpoint: str, handover: str, q: Any) -> None:
    """Join, then wait for a batch that never comes: reports PeerGone when the producer dies."""
    c = Consumer(rank, endpoint, handover=handover)
    q.put(("joined", rank))
    with _reporting(c, q, rank, reraise=False):
        c.recv(timeout=60)
        q.put(("unexpected-batch", rank))


def intruder(handover: str, q: Any) -> None:
    """Drop to uid 65534 and try to take the arena."""
    os.setgid(65534)
    os.setuid(65534)
    from mmwire.transport._handover import receive_arena

    try:
        receive_arena(handover, rank=9, timeout=5)
        q.put("accepted")
    except Exception as e:
        q.put(f"{type(e).__name__}: {e}")


def producer_then_die(q: Any) -> None:
    """A producer that reports its endpoints and then waits to be killed."""
    from mmwire.transport import Producer

    p = Producer(arena_size=1 << 22)
    q.put((p.endpoint, p.handover_path))
    time.sleep(3600)


__all__ = ["GlobalIndex"]


def materialize_videos(rank: int, ranks: int, endpoint: str, handover: str, q: Any) -> None:
    """A scheduler rank of a batch with videos: owners by patches, as every rank computes
    them; reports its order, both outputs' bytes and grids."""
    from mmwire.materialize import Materializer, assign_owners

    c = Consumer(rank, endpoint, handover=handover)
    try:
        with c.recv(timeout=60) as b:
            envs = [b.envelopes[g] for g in b.envelopes.indices()]
            my_map = assign_owners([e.grid.patches for e in envs], ranks)[rank]
            out = Materializer(rank).materialize(b, my_map)
            videos = out.pixel_values_videos
            q.put(
                (
                    "result",
                    rank,
                    [g.value for g in my_map.globals],
                    None if videos is None else videos.numpy().tobytes(),
                    None if out.video_grid_thw is None else out.video_grid_thw.tolist(),
                    out.pixel_values.numpy().tobytes(),
                    out.grid_thw.tolist(),
                    [tuple(out.features[local].shape) for local, _ in my_map.items()],
                )
            )
    except Exception as e:
        q.put(("error", rank, repr(e)))
        raise
    finally:
        c.close()


def materialize_rank(
    rank: int,
    ranks: int,
    endpoint: str,
    handover: str,
    limit: int,
    q: Any,
    batches: int = 1,
    by_pixels: bool = False,
) -> None:
    """A scheduler rank: receive ``batches`` batches, materialise its own items of each
    (owners assigned by patches, or ``by_pixels`` by input pixels), report the bytes
    (closing sends the last release before the process ends)."""
    from mmwire.materialize import Materializer, assign_owners

    c = Consumer(rank, endpoint, handover=handover)
    try:
        for _ in range(batches):
            with c.recv(timeout=60) as b:
                envs = [b.envelopes[g] for g in b.envelopes.indices()]
                counts = [
                    e.preprocess.plan.width * e.preprocess.plan.height
                    if by_pixels and e.preprocess is not None
                    else e.grid.patches
                    for e in envs
                ]
                my_map = assign_owners(counts, ranks)[rank]  # every rank computes it alone
                out = Materializer(rank).materialize(b, my_map)
                q.put(
                    (
                        "result",
                        rank,
                        [g.value for g in my_map.globals],
                        out.pixel_values.numpy().tobytes(),
                        out.grid_thw.tolist(),
                    )
                )
    finally:
        c.close()


def gpu_consume(
    rank: int,
    endpoint: str,
    handover: str,
    n_batches: int,
    q: Any,
    hold: bool = False,
    device: str = "cuda",
) -> None:
    """Receive device-pool batches; report sha256 of each owned item's bytes (read on the GPU
    stream, then copied out), or hold the first batch until killed."""
    import torch

    c = Consumer(rank, endpoint, handover=handover, device=device)
    q.put(("joined", rank))
    with _reporting(c, q, rank):
        for i in range(n_batches):
            b = c.recv(timeout=60)
            digests = {}
            for g in b.owned:
                t = b.open_tensor(g)
                host = t.reshape(-1).view(torch.uint8).cpu()  # stream-ordered after the wait
                digests[g.value] = hashlib.sha256(host.numpy().tobytes()).hexdigest()
            if hold:
                q.put(("holding", rank, digests))
                time.sleep(3600)
            b.release()
            if i == 0 or i == n_batches - 1:
                q.put(("batch" if i == 0 else "last", rank, i, digests))
        torch.cuda.synchronize()
        q.put(("done", rank))
        time.sleep(1.0)  # the stream-ordered acks reach the producer before the pool closes


def gpu_produce_then_hang(q: Any, kind: str) -> None:
    """A producer with a device pool that publishes one item to rank 0, then waits to be killed."""
    import torch
    from mmwire.transport import Grid, Item, Producer

    p = Producer(device_pool=kind, device="cuda", device_pool_size=8 << 20)  # type: ignore[arg-type]
    q.put(("ready", p.endpoint, p.handover_path))
    p.wait_for_consumers([0], timeout=60)
    data = torch.arange(1 << 16, dtype=torch.int32, device="cuda")
    p.publish("r0", [Item(data=data, consumers=(0,), kind="embedding", grid=Grid((1, 1)))])
    p.publish("r1", [Item(data=data, consumers=(0,), kind="embedding", grid=Grid((1, 1)))])
    torch.cuda.synchronize()
    q.put(("published",))
    time.sleep(3600)


def pattern(i: int, n: int = 4096) -> bytes:
    """The payload of request ``i`` in the ordering tests: distinct per request."""
    return hashlib.sha256(i.to_bytes(8, "little")).digest() * (n // 32)


def stall_then_consume(
    rank: int, endpoint: str, handover: str, n: int, stall: float, backlog: int, q: Any
) -> None:
    """Join, read nothing for ``stall`` s, then receive ``n`` batches; report what arrived."""
    c = Consumer(rank, endpoint, handover=handover, max_backlog=backlog)
    q.put(("joined", rank))
    with _reporting(c, q, rank):
        time.sleep(stall)
        got, bad = [], 0
        for _ in range(n):
            with c.recv(timeout=30) as b:
                env = b.envelopes[GlobalIndex(0)]
                i = int(env.request_id)
                got.append(i)
                bad += b.open(GlobalIndex(0)).tobytes() != pattern(i)
        q.put(("received", rank, got, bad))


def stuck(rank: int, endpoint: str, handover: str, seconds: float, q: Any) -> None:
    """Join with a tiny queue, read nothing for ``seconds``, then try to use a batch."""
    c = Consumer(rank, endpoint, handover=handover, max_backlog=2)
    q.put(("joined", rank))
    with _reporting(c, q, rank, reraise=False):
        time.sleep(seconds)
        while True:
            b = c.recv(timeout=10)
            for g in b.owned:
                b.open(g)
            b.release()


def hold_rank(rank: int, endpoint: str, handover: str, q: Any) -> None:
    """Join and wait to be stopped or killed."""
    c = Consumer(rank, endpoint, handover=handover)
    q.put(("joined", rank, os.getpid()))
    time.sleep(3600)
    c.close()


def hostile(endpoint: str, handover: str, stop: Any, seed: int, q: Any) -> None:
    """Until ``stop`` is set, send random and forged traffic to both of a producer's sockets;
    say "hostile-attacking" once 100 rounds have gone out.

    Runs as the producer's uid (the strongest attacker the handover lets in): random bytes,
    empty, half-written, silent and oversized handover connections, hellos for live and
    absurd ranks; on the channel garbage, joins without members, joins naming random
    tokens and forged releases of guessed and observed leases.
    """
    import errno
    import random
    import socket
    import struct

    import msgspec
    import zmq
    from mmwire.transport.wire import CpuRef

    rnd = random.Random(seed)
    ctx = zmq.Context()
    sent = forged = rounds = 0
    silent: list[socket.socket] = []
    spy = Consumer(7, endpoint, handover=handover)  # a legitimate, free rank
    q.put(("hostile-spying",))

    def forge_from_spy() -> int:
        """Release, from rank 7's own member, the leases it sees in other ranks' items;
        answer its lane with false acknowledgements and garbage."""
        n = 0
        lane = spy._lane
        assert lane is not None
        while (frames := spy._from_lane()) is not None:
            batch = spy.decode(frames)
            with contextlib.suppress(OSError):
                lane.sock.send(struct.pack("<cQ", b"A", rnd.choice([0, 2**63, 2**64 - 1])))
                lane.sock.send(rnd.randbytes(rnd.randrange(1, 64)))
            for env in batch.envelopes.values():
                if isinstance(env.payload, CpuRef):
                    body = msgspec.msgpack.encode(
                        {
                            "type": "Release",
                            "lease": env.payload.lease,
                            "generation": env.payload.generation,
                        }
                    )
                    spy._sock.send(body)
                    spy._sock.send(body)
                    n += 2
        return n

    def frame(obj: object) -> bytes:
        body = msgspec.msgpack.encode(obj)
        return struct.pack("<I", len(body)) + body

    while not stop.is_set():
        forged += forge_from_spy()
        rounds += 1
        if rounds == 100:
            q.put(("hostile-attacking",))
        what = rnd.randrange(9)
        try:
            if what < 4:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(1.0)
                s.connect(handover)
                choice = rnd.randrange(6)
                if choice == 0:
                    s.sendall(rnd.randbytes(rnd.randrange(1, 300)))
                elif choice == 1:
                    s.sendall(struct.pack("<I", 1 << 30))  # an absurd length
                elif choice == 2:
                    s.sendall(frame({"type": "Hello", "rank": rnd.choice([0, 1]), "pid": 1}))
                elif choice == 3:
                    bad = rnd.choice([-1, 2**63, 2**64 - 1, "x"])
                    s.sendall(frame({"type": "Hello", "rank": bad, "pid": 1}))
                elif choice == 4 and len(silent) < 20:
                    silent.append(s)  # say nothing, keep it open
                    continue
                s.close()
            else:
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.connect(endpoint)
                for _ in range(rnd.randrange(1, 20)):
                    kind = rnd.randrange(5)
                    if kind == 0:
                        d.send(rnd.randbytes(rnd.randrange(0, 200)))
                    elif kind == 1:
                        d.send_multipart([rnd.randbytes(8), rnd.randbytes(8)])
                    elif kind == 2:
                        join = {"type": "Join", "rank": rnd.randrange(4), "shared": True}
                        if rnd.random() < 0.5:
                            join["member"] = rnd.randbytes(16)
                        d.send(msgspec.msgpack.encode(join))
                    else:
                        lease = 4096 * rnd.randrange(1, 64)
                        gen = rnd.randrange(1, 3000)
                        d.send(
                            msgspec.msgpack.encode(
                                {"type": "Release", "lease": lease, "generation": gen}
                            )
                        )
                    sent += 1
                d.close(0)
        except OSError:
            pass
        except zmq.ZMQError as e:
            # libzmq reaps closed sockets on its own thread; on a loaded machine the
            # attacker can reach ZMQ_MAX_SOCKETS (1023) before the reaper catches up.
            if e.errno != errno.EMFILE:
                raise
            time.sleep(0.01)
        sent += 1
    for s in silent:
        s.close()
    forged += forge_from_spy()
    spy.close()
    ctx.term()
    q.put(("hostile-done", sent, forged))


def produce_forever(name: str, q: Any) -> None:
    """A producer in its own process: publishes ``{name}-{i}`` for rank 0 every 5 ms, each
    holding a payload derived from ``i``, until it is killed."""
    import numpy as np
    from helpers import raw_spec
    from mmwire.transport import Item, Producer

    p = Producer(arena_size=8 << 20)
    q.put(("address", name, p.endpoint, p.handover_path))
    p.wait_for_consumers([0], 30)
    i = 0
    while True:
        pixels = np.frombuffer(pattern(i, 16 * 16 * 3), np.uint8).reshape(16, 16, 3)
        p.publish(f"{name}-{i}", [Item(pixels, consumers=(0,), preprocess=raw_spec(16, 16))])
        i += 1
        time.sleep(0.005)


def _pulling_consumer(rank: int, endpoint: str, server: bytes, client: Any, pool: int) -> Consumer:
    """A remote rank (tcp + CURVE) that pulls its items through the transfer engine."""
    from mmwire.transport import MooncakeTransfer

    return Consumer(
        rank,
        endpoint,
        curve_server_key=server,
        curve=client,
        transfer=MooncakeTransfer(),
        receive_pool_size=pool,
    )


def mooncake_consume(
    rank: int, endpoint: str, server: bytes, client: Any, n: int, q: Any, go: Any
) -> None:
    """A remote rank pulling through the transfer engine: per batch it reports its owned
    items' sha256 and payload kinds, then holds the batch until ``go`` says release."""
    c = _pulling_consumer(rank, endpoint, server, client, 32 << 20)
    q.put(("joined", rank, os.getpid()))
    with _reporting(c, q, rank):
        for _ in range(n):
            with c.recv(timeout=30) as b:
                digests = {
                    g.value: hashlib.sha256(b.open(g).tobytes()).hexdigest() for g in b.owned
                }
                kinds = [type(e.payload).__name__ for e in b.envelopes.values()]
                q.put(("batch", rank, digests, kinds))
                go.get(timeout=60)
        q.put(("done", rank))
        time.sleep(0.5)


def mooncake_produce_then_hang(client: bytes, q: Any) -> None:
    """A producer with the transfer engine that publishes one batch to remote rank 0 and
    then waits to be killed."""
    import numpy as np
    from mmwire.transport import CurveKeys, Grid, Item, MooncakeTransfer, Producer

    keys = CurveKeys.generate()
    p = Producer(
        "tcp://127.0.0.1:*",
        arena_size=1 << 24,
        curve=keys,
        curve_clients=[client],
        transfer=MooncakeTransfer(),
    )
    q.put((p.endpoint, keys.public))
    p.wait_for_consumers([0], 30)
    data = np.arange(1 << 20, dtype=np.uint8)
    p.publish("r", [Item(data, consumers=(0,), kind="embedding", grid=Grid((1, 1)))])
    time.sleep(0.5)  # the batch's frames reach the consumer's socket
    q.put("sent")
    time.sleep(3600)


def mooncake_pull_on_go(
    rank: int, endpoint: str, server: bytes, client: Any, n: int, q: Any, go: Any
) -> None:
    """A remote rank that pulls one batch each time ``go`` says so, reporting its owned
    items' sha256, or the type of the ``MmwireError`` the batch raised."""
    from mmwire.transport.errors import MmwireError

    c = _pulling_consumer(rank, endpoint, server, client, 32 << 20)
    q.put(("joined", rank, os.getpid()))
    with _reporting(c, q, rank):
        for _ in range(n):
            go.get(timeout=120)
            try:
                with c.recv(timeout=30) as b:
                    q.put(
                        ("batch", {g.value: hashlib.sha256(b.open(g)).hexdigest() for g in b.owned})
                    )
            except MmwireError as e:
                q.put(("error", type(e).__name__))
        q.put(("done", rank))


def mooncake_stranger(session: str, size: int, secret: bytes, target: bytes, q: Any) -> None:
    """A process that never joined anything: through the engine's own Python API it asks the
    producer's engine for its first registered buffer, reads ``size`` bytes of it, says
    whether ``secret`` (a local rank's payload) was there and where ``target`` (a remote
    rank's payload) was, and overwrites that copy of ``target`` with 0xEE."""
    import ctypes
    import mmap

    from mooncake.engine import TransferEngine

    e = TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    e.register_memory(addr, size)
    base = e.get_first_buffer_address(session)
    read = e.transfer_sync_read(session, addr, base, size)
    data = bytes(buf)
    found = data.find(target)
    wrote = -1
    if found >= 0:
        buf[: len(target)] = b"\xee" * len(target)
        wrote = e.transfer_sync_write(session, addr, base + found, len(target))
    q.put((read, secret in data, found, wrote))
    e.unregister_memory(addr)


def remote_hold(rank: int, endpoint: str, server: bytes, client: Any, q: Any) -> None:
    """A remote rank (tcp + CURVE) that finishes its first batch, then receives batches
    without ever releasing them, reporting each one's request id, until it is killed."""
    c = Consumer(rank, endpoint, curve_server_key=server, curve=client)
    q.put(("joined", rank, os.getpid()))
    with _reporting(c, q, rank):
        with c.recv(timeout=30) as b:
            q.put(("finished", b.envelopes[GlobalIndex(0)].request_id))
        held = []
        while True:
            b = c.recv(timeout=60)
            held.append(b)
            q.put(("holding", b.envelopes[GlobalIndex(0)].request_id))


def decode_costs(corpus: dict[str, bytes], q: Any) -> None:
    """Decode each file as an owner does (``to_pixels``, the default ceiling) and report
    ``{name: (outcome, seconds)}`` and how much the peak RSS grew over all of them, in MiB
    (a high-water mark: no one file's peak exceeds it)."""
    import resource

    from mmwire.transport.errors import MmwireError
    from mmwire.transport.images import to_pixels

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = {}
    for name, data in corpus.items():
        start = time.perf_counter()
        try:
            outcome = f"decoded {list(to_pixels(data).shape)}"
        except MmwireError as e:
            outcome = type(e).__name__
        except Exception as e:  # an untyped escape is a failure the test reports
            outcome = f"untyped {type(e).__name__}: {e}"
        report[name] = (outcome, time.perf_counter() - start)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    q.put((report, grown))


def hammer_payload(request: int, index: int) -> bytes:
    """The bytes of item ``index`` of request ``r{request}`` in the hammer test: distinct
    sizes, so that an index or offset slip shows."""
    import numpy as np

    size = 1_000 + (request * 7_919 + index * 104_729) % 60_000
    return np.random.default_rng([request, index]).integers(0, 256, size, np.uint8).tobytes()


def mooncake_checker(rank: int, endpoint: str, server: bytes, client: Any, q: Any) -> None:
    """A remote rank pulling through the engine until request ``stop``: checks every byte
    of every item it owns against ``hammer_payload`` and reports
    ``("checked", rank, exact, wrong, {error type: count})``."""
    from mmwire.transport.errors import MmwireError

    c = _pulling_consumer(rank, endpoint, server, client, 16 << 20)
    q.put(("joined", rank, os.getpid()))
    exact, wrong, errors = 0, 0, {}
    with _reporting(c, q, rank):
        while True:
            try:
                with c.recv(timeout=60) as b:
                    request_id = b.envelopes[GlobalIndex(0)].request_id
                    if request_id == "stop":
                        break
                    for g in b.owned:
                        got = bytes(b.open(g))
                        if got == hammer_payload(int(request_id[1:]), g.value):
                            exact += 1
                        else:
                            wrong += 1
            except MmwireError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
        q.put(("checked", rank, exact, wrong, errors))


def mooncake_hammer(session: str, size: int, stop: Any, q: Any) -> None:
    """A stranger on the producer's engine until ``stop`` is set: it floods the engine's
    handshake port with junk connections, reads the whole window it can reach, and writes
    0xEE over random spans of it. Says ``("hammering",)`` once under way, and reports
    ``("hammered", junk, reads, writes)`` at the end."""
    import ctypes
    import mmap
    import random
    import socket

    from mooncake.engine import TransferEngine

    host, port = session.rsplit(":", 1)
    e = TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    e.register_memory(addr, size)
    base = e.get_first_buffer_address(session)
    junk = reads = writes = 0
    rnd = random.Random(7)
    while not stop.is_set():
        if junk == 1:
            q.put(("hammering",))
        try:
            with socket.create_connection((host, int(port)), timeout=1) as s:
                s.sendall(rnd.randbytes(rnd.choice((1, 8, 64, 4096))))
                junk += 1
        except OSError:
            pass
        if e.transfer_sync_read(session, addr, base, size) == 0:
            reads += 1
        span = rnd.randrange(1, 4096)
        at = rnd.randrange(0, size - span)
        buf[:span] = b"\xee" * span
        if e.transfer_sync_write(session, addr, base + at, span) == 0:
            writes += 1
    q.put(("hammered", junk, reads, writes))
    e.unregister_memory(addr)
