"""The example's asyncio frontend: OpenAI-shaped chat completions in, mmwire out.

Per request: parse the images (base64 ``data:`` URLs), read each header for its token
count (the producer never decodes), expand the placeholders, assign owners among the live
ranks (vision DP, by patch count), ``await publish`` the encoded bytes, and wait for the
owners' reports. A rank that dies with requests in flight is noticed by the producer; its
requests are published again to the ranks still alive.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import blake3
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from mmwire.materialize import (
    ModelSpec,
    OwnerAffinity,
    assign_owners,
    expand_placeholders,
    owners_of,
)
from mmwire.transport import AsyncProducer, Item
from mmwire.transport.errors import MmwireError
from mmwire.transport.images import encoded_image
from protocol import PLACEHOLDER_ID, BadRequest, Report, parse_chat, tokenize

ATTEMPTS = 3  # one publish, and two more if owners die before answering


@dataclass
class _Pending:
    """A published attempt, waiting for its owners' reports."""

    owners: set[int]
    reports: list[Report] = field(default_factory=list)
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Frontend:
    """The HTTP app and what it owns: the producer, the report socket, the pending table."""

    def __init__(self, producer: AsyncProducer, reports: str, spec: ModelSpec, ranks: int) -> None:
        self.producer = producer
        self.spec = spec
        self.ranks = ranks
        self.rank_pids: dict[int, int] = {}
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(reports)
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._decoder = msgspec.msgpack.Decoder(Report)
        self._tasks: list[asyncio.Task[None]] = []
        self._affinity = OwnerAffinity()  # resent images go back to the rank caching them
        self._load: dict[int, int] = {}  # patches each rank owns in requests not yet done

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def _stop(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        self._pull.close(0)
        self._ctx.term()

    async def health(self, request: web.Request) -> web.Response:
        live = self.producer.statistics().consumers
        arena = self.producer.statistics().arena
        return web.json_response(
            {
                "ranks": {str(r): self.rank_pids.get(r) for r in live},
                "arena": {
                    "payloads_reused": arena.payloads_reused,
                    "bytes_reused": arena.bytes_reused,
                },
            }
        )

    async def chat(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        try:
            texts, images = parse_chat(await request.json())
            headers = [encoded_image(data) for data in images]
        except (BadRequest, ValueError, MmwireError) as e:
            return _error(400, "invalid_request_error", str(e))
        if any(h is None for h in headers):
            return _error(
                400, "invalid_request_error", "images must be JPEG, PNG, WebP, GIF or BMP"
            )
        sizes = [(h.width, h.height) for h in headers if h is not None]
        tokens = [self.spec.tokens(w, h) for w, h in sizes]
        patches = [self.spec(w, h).plan.grid.patches for w, h in sizes]
        prompt = expand_placeholders(tokenize(texts, len(images)), PLACEHOLDER_ID, tokens)
        request_id = f"chatcmpl-{next(self._ids)}"
        reports: list[Report] = []
        if images:
            try:
                reports = await self._run(request_id, images, patches)
            except MmwireError as e:
                return _error(503, type(e).__name__, str(e))
        seen = sorted((item for r in reports for item in r.items), key=lambda i: i.index)
        summary = ", ".join(f"image {i.index}: {i.rows} patches {i.grid_thw}" for i in seen)
        return web.json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "mmwire-stand-in",
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": f"I saw {_count(len(seen), 'image')}. {summary}",
                        },
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": int(prompt.size),
                    "completion_tokens": 0,
                    "total_tokens": int(prompt.size),
                },
                "mmwire": {
                    "images": [msgspec.to_builtins(i) for i in seen],
                    "ranks": sorted({r.rank for r in reports}),
                    "cache_hits": sum(r.cache_hits for r in reports),
                    "attempts": 1
                    + max((int(r.request_id.rsplit("/", 1)[1]) for r in reports), default=0),
                    "seconds": round(time.monotonic() - started, 4),
                },
            }
        )

    async def _run(self, request_id: str, images: list[bytes], patches: list[int]) -> list[Report]:
        """Publish to the live ranks and wait for every owner; again if an owner dies."""
        last: Exception | None = None
        for attempt in range(ATTEMPTS):
            live = sorted(self.producer.statistics().consumers)
            if not live:
                raise MmwireError("no scheduler rank is alive")
            keys = [blake3.blake3(data).hexdigest() for data in images]
            slot = {rank: k for k, rank in enumerate(live)}
            preferred = [
                slot.get(r) if r is not None else None for r in self._affinity.preferred(keys)
            ]
            loads = [self._load.get(r, 0) for r in live]  # patches still in flight per rank
            maps = assign_owners(patches, len(live), preferred=preferred, loads=loads)
            owners = [(live[o[0]],) for o in owners_of(maps, len(images))]
            for (rank,), n in zip(owners, patches):
                self._load[rank] = self._load.get(rank, 0) + n
            self._affinity.remember(keys, [o[0] for o in owners])
            name = f"{request_id}/{attempt}"
            pending = _Pending({o[0] for o in owners})
            self._pending[name] = pending
            try:
                items = [
                    Item(data, consumers=o, preprocess=self.spec) for data, o in zip(images, owners)
                ]
                await self.producer.publish(name, items)
                await pending.done
            except MmwireError as e:  # PeerGone: an owner died before or while receiving it
                last = e
                continue
            finally:
                self._pending.pop(name, None)
                for (rank,), n in zip(owners, patches):
                    self._load[rank] -= n
            errors = [r.error for r in pending.reports if r.error]
            if errors:
                raise MmwireError(errors[0])
            return pending.reports
        raise MmwireError(f"request {request_id} failed {ATTEMPTS} times; last: {last}")

    async def _receive(self) -> None:
        while True:
            try:
                report = self._decoder.decode(await self._pull.recv())
            except msgspec.DecodeError:
                continue  # not a report: dropped
            pending = self._pending.get(report.request_id)
            if pending is None or pending.done.done():
                continue
            pending.reports.append(report)
            if {r.rank for r in pending.reports} >= pending.owners:
                pending.done.set_result(None)

    async def _watch(self) -> None:
        """Fail the attempts whose owners the producer has seen go away."""
        while True:
            await asyncio.sleep(0.1)
            live = set(self.producer.statistics().consumers)
            for name, pending in list(self._pending.items()):
                answered = {r.rank for r in pending.reports}
                lost = pending.owners - answered - live
                for rank in lost:
                    self._affinity.forget_rank(rank)
                if lost and not pending.done.done():
                    pending.done.set_exception(
                        MmwireError(f"{name}: ranks {sorted(lost)} went away")
                    )


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


def _count(n: int, noun: str) -> str:
    """``1 image``, ``2 images``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
