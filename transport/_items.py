"""What a producer accepts in ``publish``: the :class:`Item`, and the request's checks that
need no payload.

A request is checked whole first (``check_request``: its id, every item's consumers,
modality and kind), then each item is turned into what gets copied (``_prepare.py``): its
payload made an array (images by the contract of ``_pixels.py``), each raw item's spec
computed, and the envelopes it will produce checked as the consumers' own decoder would.
Only a request that passes all of it gets arena space, so a refused request costs nothing
and every error is an ``MmwireError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from ._handover import MAX_RANKS
from ._schema import (
    EncodedVideo,
    Grid,
    Kind,
    Modality,
    PreprocessSpec,
    VideoSpec,
)
from .errors import InvalidRequest

__all__ = ["MAX_REQUEST_ID", "Item", "check_request"]

MAX_REQUEST_ID = 1024
"""Longest ``request_id``, in UTF-8 bytes."""

_MODALITIES = frozenset(get_args(Modality))
_KINDS = frozenset(get_args(Kind))


@dataclass(frozen=True)
class Item:
    """One payload of a request, as the producer hands it to :meth:`Producer.publish`.

    Attributes:
        data: a numpy array, a torch tensor, a PIL image or encoded image bytes. For raw
            items, encoded bytes (JPEG, PNG, WebP, GIF, BMP: ``ENCODED_FORMATS``) travel as
            they are, as an ``encoded`` envelope the owner decodes; the rest become uint8
            ``(H, W, C)`` pixels by the same rules as ``preprocess_images``
            (``mmwire.transport.images.to_pixels``), decoded straight into the arena. A CUDA
            tensor goes into the producer's device pool when it has one (else it is copied
            to the host once).
        consumers: the rank(s) that own the item and will read its payload.
        kind: ``raw`` (preprocessing deferred), ``processed`` or ``embedding``.
        grid: the item's patch grid; for raw items it may be left to ``preprocess``.
        preprocess: the spec of a raw item, or a callable ``(width, height) -> spec`` (such
            as a family's spec from ``mmwire.materialize.spec_for``). For a video, its
            ``VideoSpec`` or a callable from the container's header (or the frames'
            ``(frames, height, width)``) to it, such as
            ``mmwire.materialize.video.video_spec_for(...)``.
        modality: ``image``, or ``video`` for a video container's bytes (MP4, MOV, WebM,
            Matroska: they travel as they are and the owner decodes the frames its plan
            samples) or its frames, uint8 ``(T, H, W, 3)`` or a list of ``(H, W, 3)``
            (only the sampled ones travel).
        decode: decode a raw item's encoded bytes on the producer and ship pixels (for
            owners that should not decode).
        caller_key: the caller's own id for the item (an engine's multimodal hash, up to
            128 characters): the envelope carries it as ``caller_key`` for the engine's
            prefix cache. It never selects a payload: reuse and caches match only the
            digests the producer computes itself.
    """

    data: Any
    consumers: tuple[int, ...]
    kind: Kind = "raw"
    grid: Grid | None = None
    preprocess: (
        PreprocessSpec
        | Callable[[int, int], PreprocessSpec]
        | VideoSpec
        | Callable[[EncodedVideo | tuple[int, int, int]], VideoSpec]
        | None
    ) = None
    modality: Modality = "image"
    decode: bool = False
    caller_key: str | None = None


def check_request(request_id: object, items: object, max_items: int) -> Sequence[Item]:
    """The request's items after the checks that need no payload; ``InvalidRequest`` else."""
    if type(request_id) is not str:
        raise InvalidRequest(f"`request_id` must be a str, got {type(request_id).__name__}")
    try:
        n = len(request_id.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"`request_id` {request_id!r} is not encodable as UTF-8") from e
    if n > MAX_REQUEST_ID:
        raise InvalidRequest(f"`request_id` is {n} bytes, over {MAX_REQUEST_ID}")
    # a list or tuple first: the Sequence check goes through the ABC machinery
    if not isinstance(items, (list, tuple)) and (
        not isinstance(items, Sequence) or isinstance(items, (str, bytes))
    ):
        raise InvalidRequest(f"`items` must be a sequence of Item, got {type(items).__name__}")
    if not items:
        raise InvalidRequest(f"request {request_id!r} has no items")
    if len(items) > max_items:
        raise InvalidRequest(
            f"request {request_id!r} has {len(items)} items, over `max_items` {max_items}"
        )
    for k, item in enumerate(items):
        where = f"item {k} of request {request_id!r}"
        if not isinstance(item, Item):
            raise InvalidRequest(f"{where} is a {type(item).__name__}, not an Item")
        consumers = item.consumers
        if not isinstance(consumers, (tuple, list)) or not consumers:
            raise InvalidRequest(f"{where} must name its consumers as a non-empty tuple of ranks")
        for r in consumers:
            if type(r) is not int or not 0 <= r < MAX_RANKS:
                raise InvalidRequest(
                    f"{where} names consumer {r!r}; ranks are ints in [0, {MAX_RANKS})"
                )
        if len(set(consumers)) != len(consumers):
            raise InvalidRequest(f"{where} names a consumer twice: {list(consumers)}")
        if item.modality not in _MODALITIES:
            raise InvalidRequest(
                f"{where} has `modality` {item.modality!r}; one of {sorted(_MODALITIES)}"
            )
        if item.kind not in _KINDS:
            raise InvalidRequest(f"{where} has `kind` {item.kind!r}; one of {sorted(_KINDS)}")
    return items
