"""Builders shared by the tests: real envelopes over real payloads, and waiting on a producer."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mmwire.materialize import KimiConfig
from mmwire.transport import FeatureEnvelope, GlobalIndex, Grid, PreprocessSpec, TensorSpec
from mmwire.transport.wire import SCHEMA_VERSION, CpuRef, InlineRef


def raw_spec(width: int, height: int) -> PreprocessSpec:
    """The default spec of a ``width x height`` image (the test images are never resized)."""
    return KimiConfig()(width, height)


def raw_envelope(
    index: int,
    pixels: np.ndarray[Any, Any],
    *,
    frame: int | None = None,
    payload: Any = None,
    consumers: tuple[int, ...] = (0,),
    request_id: str = "req-0",
    spec: PreprocessSpec | None = None,
) -> FeatureEnvelope:
    """An envelope for raw uint8 ``(H, W, C)`` pixels, inline by default (spec: the
    default one of their size)."""
    h, w, _ = pixels.shape
    spec = spec or raw_spec(w, h)
    ref = payload if payload is not None else InlineRef(frame=index if frame is None else frame)
    return FeatureEnvelope(
        version=SCHEMA_VERSION,
        request_id=request_id,
        index=GlobalIndex(index),
        modality="image",
        kind="raw",
        grid=spec.plan.grid,
        tensor=TensorSpec(dtype="uint8", shape=pixels.shape, nbytes=pixels.nbytes),
        payload=ref,
        consumers=consumers,
        preprocess=spec,
    )


def encoded_envelope(
    index: int, data: bytes, *, frame: int, spec: PreprocessSpec | None = None
) -> FeatureEnvelope:
    """An envelope for an encoded image's bytes, inline (spec: the default one of its size)."""
    from mmwire.transport import EncodedImage
    from mmwire.transport.images import encoded_image

    header = encoded_image(data)
    assert isinstance(header, EncodedImage)
    spec = spec or raw_spec(header.width, header.height)
    return FeatureEnvelope(
        version=SCHEMA_VERSION,
        request_id="req-e",
        index=GlobalIndex(index),
        modality="image",
        kind="encoded",
        grid=spec.plan.grid,
        tensor=TensorSpec(dtype="uint8", shape=(len(data),), nbytes=len(data)),
        payload=InlineRef(frame=frame),
        consumers=(0,),
        preprocess=spec,
        encoding=header,
    )


def processed_envelope(index: int, grid: tuple[int, ...], frame: int) -> FeatureEnvelope:
    """An envelope for a processed fp32 ``(patches, 3, 14, 14)`` tensor, inline."""
    g = Grid(grid)
    shape = (g.patches, 3, 14, 14)
    nbytes = int(np.prod(shape)) * 4
    return FeatureEnvelope(
        version=SCHEMA_VERSION,
        request_id="req-p",
        index=GlobalIndex(index),
        modality="image",
        kind="processed",
        grid=g,
        tensor=TensorSpec(dtype="float32", shape=shape, nbytes=nbytes),
        payload=InlineRef(frame=frame),
        consumers=(1,),
    )


def cpu_ref(offset: int = 4096, length: int = 12) -> CpuRef:
    """A syntactically valid arena reference."""
    return CpuRef(arena_id="0" * 32, lease=0, offset=offset, length=length, generation=1)


def settle(p: Any, cond: Any, timeout: float = 20) -> bool:
    """Serve producer ``p``'s channel until ``cond()`` holds or ``timeout`` s pass; ``cond()``."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        p.poll(0.05)
    return bool(cond())
