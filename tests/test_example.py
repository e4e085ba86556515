"""The engine-shaped example, started with the README's command and driven by a real HTTP
client: concurrent chat requests with repeated images, one rank killed mid-run, every
response checked against the reference pipeline."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from conftest import photo_path
from mmwire.materialize import preprocess_images, spec_for
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SPEC = spec_for("qwen2.5-vl")


def _images() -> list[bytes]:
    """Eight images of distinct sizes: JPEG and PNG, one with transparency."""
    out = []
    sizes = [
        (301, 203),
        (640, 480),
        (97, 411),
        (1024, 683),
        (35, 35),
        (512, 288),
        (233, 377),
        (800, 64),
    ]
    for k, size in enumerate(sizes):
        photo = Image.open(photo_path(["coffee.png", "chelsea.png", "astronaut.png"][k % 3]))
        im = photo.convert("RGBA" if k == 5 else "RGB").resize(size)
        if k == 5:
            im.putalpha(Image.linear_gradient("L").resize(size))
        buf = io.BytesIO()
        im.save(buf, "PNG" if k % 2 else "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _reference(data: bytes) -> tuple[str, list[int], int]:
    """sha256 of the reference pipeline's fp32 rows, the grid, the token count."""
    pixel_values, grid_thw = preprocess_images([data], SPEC)
    w, h = Image.open(io.BytesIO(data)).size
    digest = hashlib.sha256(pixel_values.numpy().tobytes()).hexdigest()
    return digest, grid_thw[0].tolist(), SPEC.tokens(w, h)


def _body(images: list[bytes], words: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": words}]
    for data in images:
        kind = "png" if data[:4] == b"\x89PNG" else "jpeg"
        url = f"data:image/{kind};base64," + base64.b64encode(data).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"model": "any", "messages": [{"role": "user", "content": parts}]}


@pytest.fixture
def server() -> Any:
    proc = subprocess.Popen(
        [
            sys.executable,
            "examples/engine/serve.py",
            "--ranks",
            "3",
            "--port",
            "0",
            "--cache-mib",
            "64",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 180
    url = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"(http://\S+)/v1/chat/completions", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        pytest.fail("the example did not start:\n" + "".join(lines))
    yield url, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    proc.stdout.close()


def test_the_example_serves_every_request_exactly_while_a_rank_dies(server: Any) -> None:
    url, proc = server
    images = _images()
    reference = [_reference(data) for data in images]
    rng = np.random.default_rng(3)
    requests = [
        [int(k) for k in rng.choice(len(images), size=rng.integers(1, 4), replace=False)]
        for _ in range(48)
    ]

    async def drive() -> tuple[list[tuple[list[int], int, Any]], dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            health = await (await http.get(f"{url}/health")).json()
            assert sorted(health["ranks"]) == ["0", "1", "2"]
            victim = int(health["ranks"]["1"])
            limit = asyncio.Semaphore(6)
            done = 0

            async def one(pick: list[int]) -> tuple[list[int], int, Any]:
                nonlocal done
                async with limit:
                    body = _body([images[k] for k in pick], "describe these images please")
                    data = io.BytesIO(json.dumps(body).encode())  # a streamed body
                    headers = {"Content-Type": "application/json"}
                    post = http.post(f"{url}/v1/chat/completions", data=data, headers=headers)
                    async with post as r:
                        answer = (pick, r.status, await r.json())
                done += 1
                if done == 16:
                    os.kill(victim, signal.SIGKILL)  # with requests in flight on it
                return answer

            answers = await asyncio.gather(*(one(p) for p in requests))
            after = await (await http.get(f"{url}/health")).json()
            return answers, after

    answers, after = asyncio.run(drive())
    hits = retried = 0
    owners: set[int] = set()
    for pick, status, answer in answers:
        assert status == 200, answer
        text = answer["choices"][0]["message"]["content"]
        assert text.startswith(f"I saw {len(pick)} image{'' if len(pick) == 1 else 's'}. ")
        owners.update(answer["mmwire"]["ranks"])
        seen = answer["mmwire"]["images"]
        assert [i["index"] for i in seen] == list(range(len(pick)))
        for item, k in zip(seen, pick):
            digest, grid, _ = reference[k]
            assert item["sha256"] == digest, f"image {k} differs from the reference pipeline"
            assert item["grid_thw"] == grid
        words = 4  # "describe these images please"
        assert answer["usage"]["prompt_tokens"] == words + sum(reference[k][2] for k in pick)
        hits += answer["mmwire"]["cache_hits"]
        retried += answer["mmwire"]["attempts"] > 1
    assert sorted(after["ranks"]) == ["0", "2"]
    assert owners == {0, 1, 2}, "a rank never owned an image: owners are not balanced by load"
    print(f"cache hits {hits}, requests published again after the kill {retried}")
    assert hits > 0, "repeated images never hit an owner's cache"
    assert after["arena"]["payloads_reused"] > 0, "repeated images were copied again"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
