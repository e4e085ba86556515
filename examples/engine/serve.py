"""The engine-shaped example: an HTTP frontend feeding N scheduler ranks through mmwire.

    python examples/engine/serve.py --ranks 4 --port 8000

then POST OpenAI chat-completions requests with base64 ``image_url`` parts to
``http://127.0.0.1:8000/v1/chat/completions``. Each rank runs the exact materializer (with
its output cache) and a stand-in model that reports the tensors it got.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import secrets
from collections.abc import Callable
from typing import Any

from aiohttp import web
from frontend import Frontend
from mmwire.materialize import FAMILIES, spec_for
from mmwire.transport import AsyncProducer
from rank import serve_rank

# Ranks fork from a server that imported torch, mmwire and the rank's module once: a
# spawned rank spends seconds importing them, each. The server never touches CUDA, so a
# rank may use it after the fork, as a spawned one would.
RANKS = mp.get_context("forkserver")
RANKS.set_forkserver_preload(["torch", "mmwire.transport", "mmwire.materialize", "rank"])


async def main(args: argparse.Namespace) -> None:
    spec = spec_for(args.family)
    reports = f"ipc://@mmwire-example-{secrets.token_hex(8)}-reports"  # abstract: no file
    async with AsyncProducer(arena_size=args.arena_mib << 20) as producer:
        frontend = Frontend(producer, reports, spec, args.ranks)
        ranks = [
            RANKS.Process(
                target=serve_rank,
                args=(r, producer.address, reports, args.cache_mib << 20),
                name=f"rank-{r}",
            )
            for r in range(args.ranks)
        ]
        for p in ranks:
            p.start()
            # a rank that dies is reaped at once, not left a zombie until the frontend exits
            asyncio.get_running_loop().add_reader(p.sentinel, _reaper(p))
        frontend.rank_pids = {r: p.pid or 0 for r, p in enumerate(ranks)}
        await producer.wait_for_consumers(range(args.ranks), 120)
        runner = web.AppRunner(frontend.app())
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = runner.addresses[0][:2]  # the port the system gave, for --port 0
        print(
            f"mmwire example: http://{host}:{port}/v1/chat/completions, "
            f"{args.ranks} ranks, {args.family}",
            flush=True,
        )
        try:
            await asyncio.Event().wait()  # until cancelled (Ctrl-C, SIGTERM)
        finally:
            await runner.cleanup()
            for p in ranks:
                p.terminate()
            for p in ranks:
                p.join(5)


def _reaper(p: Any) -> Callable[[], None]:
    def reap() -> None:
        asyncio.get_running_loop().remove_reader(p.sentinel)
        p.join(0)

    return reap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2, help="scheduler ranks (processes)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--family", default="qwen2.5-vl", choices=sorted(FAMILIES))
    ap.add_argument("--arena-mib", type=int, default=512, help="the producer's arena")
    ap.add_argument("--cache-mib", type=int, default=256, help="each rank's output cache")
    return ap.parse_args(argv)


if __name__ == "__main__":
    import signal

    args = parse()
    loop = asyncio.new_event_loop()
    task = loop.create_task(main(args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    finally:
        loop.close()
