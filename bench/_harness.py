"""Spawning scheduler ranks and collecting their reports, shared by every benchmark."""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

__all__ = ["Ranks"]

# Ranks fork from a server that imported torch and mmwire once (a spawned rank spent about
# 3 s importing them on a 2-core host, for each rank of each way). The server never touches
# CUDA, so a rank may use it after the fork, as a spawned one would.
_RANKS = mp.get_context("forkserver")
_PRELOAD = ["numpy", "torch", "zmq", "msgspec", "mmwire.transport", "mmwire.materialize"]
_RANKS.set_forkserver_preload([*_PRELOAD, "mmwire.bench._workers"])


class Ranks:
    """N rank processes running ``target(rank, *args, report)``, and their reports."""

    def __init__(
        self, target: Callable[..., None], n: int, args: Callable[[int], Sequence[Any]]
    ) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.report = f"ipc://@mmwire-bench-{secrets.token_hex(8)}-report"  # abstract: no file
        self.sock.bind(self.report)
        self.procs = [
            _RANKS.Process(target=target, args=(r, *args(r), self.report), daemon=True)
            for r in range(n)
        ]
        for p in self.procs:
            p.start()
        self.wait("ready", n, timeout=120)

    def wait(self, kind: str, count: int, timeout: float = 300) -> list[list[Any]]:
        """``count`` reports of ``kind`` (``TimeoutError`` if a rank falls silent)."""
        got: list[list[Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            if not self.sock.poll(200):
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a benchmark rank died (exit codes {dead})")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout} s for {count} '{kind}' reports, got {len(got)}"
                    )
                continue
            msg = msgspec.msgpack.decode(self.sock.recv())
            if msg[0] == kind:
                got.append(msg)
        return got

    def close(self) -> None:
        """Join the ranks (they stop on a 'stop' request) and clean up."""
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        self.sock.close(0)
        self.ctx.term()
