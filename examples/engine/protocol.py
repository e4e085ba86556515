"""What the example's processes say to each other, and the chat request's parsing.

The ranks report to the frontend over zmq as msgpack ``Report`` structs (msgspec, typed;
never pickle). The frontend reads OpenAI chat-completions requests whose images are
``image_url`` parts with base64 ``data:`` URLs.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from typing import Any

import msgspec

PLACEHOLDER_ID = 151655  # the id an image placeholder has in the stand-in tokenizer


class ItemReport(msgspec.Struct, frozen=True):
    """What a rank's stand-in model saw of one image."""

    index: int
    """The image's position in its request (GlobalIndex)."""
    digest: str | None
    """The envelope's content digest (what a prefix cache keys the image by)."""
    grid_thw: list[int]
    rows: int
    """Rows of ``pixel_values`` the image filled."""
    sha256: str
    """SHA-256 of those rows' bytes (fp32): what the test compares with the reference."""


class Report(msgspec.Struct, frozen=True):
    """A rank's answer for one delivered request."""

    request_id: str
    rank: int
    items: list[ItemReport]
    cache_hits: int
    """Of the rank's items in this request, how many its output cache served."""
    error: str | None = None
    """The typed error that stopped the rank materialising them (``MmwireError``)."""


class BadRequest(Exception):
    """A chat request the frontend refuses (HTTP 400)."""


def parse_chat(body: Any) -> tuple[list[str], list[bytes]]:
    """The request's text parts and its images' bytes, in order."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise BadRequest("the body must be a JSON object with a `messages` list")
    texts: list[str] = []
    images: list[bytes] = []
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise BadRequest("each message needs a `content` string or list of parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text", "")))
            elif kind == "image_url":
                url = (part.get("image_url") or {}).get("url", "")
                images.append(_data_url(url))
            else:
                raise BadRequest(f"unsupported content part {kind!r}")
    return texts, images


def _data_url(url: str) -> bytes:
    head, sep, data = url.partition(",")
    if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
        raise BadRequest("image_url must be a base64 `data:image/...;base64,` URL")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise BadRequest(f"image_url's base64 does not decode: {e}") from None


def tokenize(texts: list[str], images: int) -> list[int]:
    """A stand-in tokenizer: one id per word, then one placeholder per image."""
    ids = [zlib.crc32(word.encode()) % 100_000 for text in texts for word in text.split()]
    return ids + [PLACEHOLDER_ID] * images
