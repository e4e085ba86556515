"""Encode a batch of envelopes into zmq frames and decode untrusted frames back.

Frames: ``[header, inline_0, inline_1, ...]``. The header is msgpack of ``_Header``
(version, envelopes, frame count); inline payload ``k`` is frame ``k + 1`` and is
referenced by exactly one ``InlineRef(frame=k)``. Frames are handed to zmq as buffers, so
payloads at or above pyzmq's copy threshold (64 KiB) go out without a copy; the caller
keeps them unchanged until the send tracker is done.

Decoding treats every byte as hostile: it yields a :class:`DecodedBatch` or raises an
:class:`EnvelopeError` subclass, never anything else, and never reads past a frame.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, final

import msgspec

from ._index import GlobalIndex, GlobalTable
from ._pixels import MAX_IMAGE_PIXELS
from ._schema import (
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    FeatureEnvelope,
    Grid,
    InlineRef,
    PreprocessSpec,
    VideoSpec,
    _Header,
    _VersionProbe,
)
from .errors import (
    EnvelopeError,
    FrameError,
    LimitExceeded,
    MalformedEnvelope,
    SchemaVersionError,
)

__all__ = [
    "BatchDecoder",
    "DecodedBatch",
    "Limits",
    "check_envelopes",
    "encode_batch",
    "encode_checked",
]


@dataclass(frozen=True)
class Limits:
    """Ceilings applied to decoded envelopes (they stop decompression bombs and floods).

    Attributes:
        max_pixels: largest ``W·H`` of a raw image, of its resize target and of its canvas,
            and of a video's frames and their resize target.
        max_bytes: largest payload (``tensor.nbytes``) of one item.
        max_items: most envelopes in one batch.
        max_header_bytes: largest header frame.
    """

    max_pixels: int = MAX_IMAGE_PIXELS
    max_bytes: int = 2 << 30
    max_items: int = 4096
    max_header_bytes: int = 16 << 20


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(envelopes: Sequence[FeatureEnvelope], inline: Sequence[Any] = ()) -> list[Any]:
    """Frames for one batch: the header, then ``inline`` buffers in ``InlineRef.frame`` order.

    Envelopes must sit at their own ``GlobalIndex`` and inline frames must match their
    ``tensor.nbytes``; the same checks the decoder applies are run here so a producer bug is
    caught on the producer.
    """
    header = _Header(version=SCHEMA_VERSION, envelopes=tuple(envelopes), frames=len(inline))
    _check_batch(header, [memoryview(b).nbytes for b in inline], Limits())
    return [_ENCODER.encode(header), *inline]


def encode_checked(envelopes: Sequence[FeatureEnvelope]) -> bytes:
    """The header of a batch of envelopes ``check_envelopes`` passed (with this side's own
    payload references since), without checking them again: a publish's one encode."""
    return _ENCODER.encode(_Header(version=SCHEMA_VERSION, envelopes=tuple(envelopes), frames=0))


def check_envelopes(envelopes: Sequence[FeatureEnvelope]) -> None:
    """Refuse, as a consumer's decoder would, envelopes built on this side: the batch's
    rules, and the field types of the structs a caller hands in (a ``Grid``, a
    ``PreprocessSpec``), which msgspec checks when it decodes but not when it constructs.
    The rest of an envelope is built from checked values and validated as it is built, so
    this costs a fraction of an encode-and-decode round trip."""
    for env in envelopes:
        grid = env.grid
        # a Grid checks its values as it is made; only a container msgspec would not encode
        # (or decode as a tuple) could slip by
        if type(grid) is not Grid or type(grid.dims) is not tuple:
            _recheck(grid, Grid)
        if env.preprocess is not None:
            _recheck(env.preprocess, PreprocessSpec)
        if env.video is not None:
            _recheck(env.video, VideoSpec)
    header = _Header(version=SCHEMA_VERSION, envelopes=tuple(envelopes), frames=0)
    _check_batch(header, [], Limits())


_PART_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {
    Grid: msgspec.msgpack.Decoder(Grid),
    PreprocessSpec: msgspec.msgpack.Decoder(PreprocessSpec),
    VideoSpec: msgspec.msgpack.Decoder(VideoSpec),
}


def _recheck(part: object, kind: type[Grid] | type[PreprocessSpec] | type[VideoSpec]) -> None:
    if type(part) is not kind:
        raise MalformedEnvelope(f"a `{kind.__name__}` is needed, got {type(part).__name__}")
    try:
        buf = _ENCODER.encode(part)
    except (msgspec.MsgspecError, TypeError, ValueError, OverflowError) as e:
        raise MalformedEnvelope(f"a `{kind.__name__}` that does not encode: {e}") from e
    _as_envelope_error(lambda: _PART_DECODERS[kind].decode(buf))


@final
@dataclass(frozen=True)
class DecodedBatch:
    """A validated batch: envelopes by :class:`GlobalIndex`, plus the inline payload frames."""

    envelopes: GlobalTable[FeatureEnvelope]
    frames: tuple[Any, ...]

    def inline(self, index: GlobalIndex) -> memoryview:
        """The inline payload bytes of item ``index`` (zero-copy; alive as long as the frame)."""
        env = self.envelopes[index]
        if not isinstance(env.payload, InlineRef):
            raise TypeError(f"item {index.value} is carried by `{env.payload.__class__.__name__}`")
        return memoryview(self.frames[env.payload.frame])


@final
class BatchDecoder:
    """Decodes header+frames into a :class:`DecodedBatch`; create once and reuse."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._probe = msgspec.msgpack.Decoder(_VersionProbe)
        self._header = msgspec.msgpack.Decoder(_Header)

    def decode(self, frames: Sequence[Any]) -> DecodedBatch:
        """Validate and decode; raises an :class:`EnvelopeError` subclass on any defect."""
        if len(frames) == 0:
            raise FrameError("a batch needs a header frame, got no frames")
        header_buf = _as_bytes(frames[0], "header")
        if len(header_buf) > self.limits.max_header_bytes:
            raise LimitExceeded(
                f"header frame is {len(header_buf)} bytes, over `max_header_bytes` "
                f"{self.limits.max_header_bytes}"
            )
        header = self._decode_header(header_buf)
        payload_frames = tuple(frames[1:])
        sizes = [len(_as_bytes(f, f"frame {i + 1}")) for i, f in enumerate(payload_frames)]
        _check_batch(header, sizes, self.limits)
        return DecodedBatch(envelopes=GlobalTable(header.envelopes), frames=payload_frames)

    def _decode_header(self, buf: memoryview) -> _Header:
        # one decode for a good batch; the version alone is probed only when it fails, so a
        # batch of a version this side cannot read says so rather than what did not parse
        try:
            header = self._header.decode(buf)
        except msgspec.MsgspecError:
            self._check_version(buf)
            # the same bytes again, their defect raised as the EnvelopeError behind it
            header = _as_envelope_error(lambda: self._header.decode(buf))
        if header.version not in READABLE_VERSIONS:
            self._refuse_version(header.version)
        return header

    def _check_version(self, buf: memoryview) -> None:
        try:
            probe = self._probe.decode(buf)
        except msgspec.MsgspecError as e:
            raise MalformedEnvelope(f"header is not an envelope batch: {e}") from e
        if probe.version not in READABLE_VERSIONS:
            self._refuse_version(probe.version)

    @staticmethod
    def _refuse_version(version: int) -> NoReturn:
        raise SchemaVersionError(
            f"batch `version` {version} is not readable (versions {list(READABLE_VERSIONS)})"
        )


_T = TypeVar("_T")


def _as_envelope_error(decode: Callable[[], _T]) -> _T:
    """``decode()``, msgspec's errors turned into the ``EnvelopeError`` behind them."""
    try:
        return decode()
    except msgspec.ValidationError as e:
        cause = e.__cause__
        if isinstance(cause, EnvelopeError):
            raise type(cause)(str(e)) from e
        raise MalformedEnvelope(str(e)) from e
    except msgspec.MsgspecError as e:
        raise MalformedEnvelope(f"header is not an envelope batch: {e}") from e


def _as_bytes(frame: Any, what: str) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        mv = memoryview(buf)
        if not mv.c_contiguous:
            raise BufferError("the buffer is not C-contiguous")
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    except TypeError:
        raise FrameError(f"{what} is not a bytes-like frame: {type(frame).__name__}") from None
    except BufferError as e:  # a strided (non-contiguous) buffer
        raise FrameError(f"{what} is not a contiguous bytes-like frame: {e}") from None


def _sizes(env: FeatureEnvelope) -> list[tuple[str, int, int]]:
    """The pixel sizes an envelope asks its owner to hold: a raw image's, its resize
    target's and canvas's; a video's frames' and their resize target's."""
    if env.preprocess is not None:
        plan = env.preprocess.plan
        return [
            ("image", plan.width, plan.height),
            ("resize target", plan.new_width, plan.new_height),
            ("canvas", plan.padded_width, plan.padded_height),
        ]
    if env.video is not None:
        vplan = env.video.plan
        return [
            ("video frame", vplan.width, vplan.height),
            ("video resize target", vplan.new_width, vplan.new_height),
        ]
    return []


def _check_batch(header: _Header, frame_sizes: Sequence[int], limits: Limits) -> None:
    envs = header.envelopes
    if len(envs) > limits.max_items:
        raise LimitExceeded(f"batch has {len(envs)} items, over `max_items` {limits.max_items}")
    if header.frames != len(frame_sizes):
        raise FrameError(
            f"header announces {header.frames} inline frames, {len(frame_sizes)} arrived"
        )
    used: set[int] = set()
    for position, env in enumerate(envs):
        # (every batch passes here on both sides: a message's text is made when it is raised,
        # by the envelope, whose index is its position from here on)
        if env.index.value != position:
            raise MalformedEnvelope(
                f"`index` of the envelope at position {position} is {env.index!r}; "
                f"a batch lists items in GlobalIndex order"
            )
        if env.tensor.nbytes > limits.max_bytes:
            raise LimitExceeded(
                f"`tensor.nbytes` {env.tensor.nbytes} of {env._where()} is over `max_bytes` "
                f"{limits.max_bytes}"
            )
        for label, w, h in _sizes(env):
            if w * h > limits.max_pixels:
                raise LimitExceeded(
                    f"{label} {w}x{h} of {env._where()} is {w * h} pixels, over `max_pixels` "
                    f"{limits.max_pixels}"
                )
        ref = env.payload
        if isinstance(ref, InlineRef):
            if ref.frame >= len(frame_sizes):
                raise FrameError(
                    f"`payload.frame` {ref.frame} of {env._where()} is beyond the "
                    f"{len(frame_sizes)} inline frames"
                )
            if ref.frame in used:
                raise FrameError(
                    f"`payload.frame` {ref.frame} of {env._where()} is referenced twice"
                )
            used.add(ref.frame)
            if frame_sizes[ref.frame] != env.tensor.nbytes:
                raise FrameError(
                    f"inline frame {ref.frame} of {env._where()} has "
                    f"{frame_sizes[ref.frame]} bytes, `tensor.nbytes` says {env.tensor.nbytes}"
                )
    if len(used) != len(frame_sizes):
        raise FrameError(
            f"{len(frame_sizes) - len(used)} inline frames are referenced by no envelope"
        )
