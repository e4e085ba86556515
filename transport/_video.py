"""The video input contract: which containers a video item may be, what the producer reads
of them (the header only) and how the owner decodes the frames its plan samples.

Decoding is PyAV's (FFmpeg's own bindings, a wheel with FFmpeg inside, the ``video`` extra).
PyAV rather than torchcodec: it needs no particular torch build, and it is the backend of
transformers' ``read_video_pyav``, which defines here which frame is "frame i": the i-th
frame FFmpeg outputs from the start of the first video stream, converted to RGB by
``to_ndarray(format="rgb24")``. The owner decodes exactly so, on FFmpeg's threads, converts
only the frames its plan names, and stops after the last of them.

The header gives the size, the codec, the frame count (the container's; for Matroska and
WebM, which store none, the count of the stream's packets, read without decoding) and the
average frame rate, as ``read_video_pyav`` reads them.

What decoding an untrusted container may cost is bounded before it starts: the frame size
against ``max_frame_pixels`` (FFmpeg's decoder is opened with that ceiling too, so a
bitstream declaring a larger size is refused before it allocates), the frame count against
``max_frames``, and the owner writes frames only into the array its plan sized. A frame of
another size than the header's, or a stream that ends before a planned frame, is a
:class:`VideoDecodeError`.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._schema import VIDEO_CODECS, EncodedVideo, VideoFormat
from .errors import BackendUnavailable, DimensionError, VideoDecodeError

__all__ = [
    "MAX_FRAME_PIXELS",
    "MAX_VIDEO_FRAMES",
    "decode_frames",
    "probe_video",
    "video_format",
]

MAX_FRAME_PIXELS = 4096 * 4096
"""The default ceiling on a video frame's ``W·H`` (4K DCI and every phone fit)."""

MAX_VIDEO_FRAMES = 216_000
"""The default ceiling on a container's frame count (two hours at 30 fps)."""

_BLOCK = 128  # the largest coding block of the codecs decoded (AV1's superblock)
_FTYP_QUICKTIME = b"qt  "
_EBML = b"\x1a\x45\xdf\xa3"


def _av() -> Any:
    try:
        import av
    except ImportError as e:
        raise BackendUnavailable("video items need PyAV: install mmwire[video]") from e
    return av


def video_format(data: bytes | bytearray | memoryview) -> VideoFormat | None:
    """The container of ``data`` from its first bytes (``None`` if it is none of
    MP4/MOV/WebM/Matroska): an ISO-BMFF ``ftyp`` box (QuickTime's brand means MOV), or an
    EBML header whose DocType is ``webm`` or ``matroska``."""
    head = bytes(data[:64])
    if head[4:8] == b"ftyp":
        return "mov" if head[8:12] == _FTYP_QUICKTIME else "mp4"
    if head.startswith(_EBML):
        if b"webm" in head:
            return "webm"
        if b"matroska" in head:
            return "mkv"
    return None


_MALFORMED = (ValueError, TypeError, AttributeError, OverflowError, IndexError)
"""What PyAV raises besides ``FFmpegError`` on a malformed container: undecodable
metadata text, a stream without a codec context, values out of range."""


def _open(data: bytes | bytearray | memoryview) -> Any:
    av = _av()
    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, *_MALFORMED) as e:
        raise VideoDecodeError(f"not a readable video container: {e!r}") from e


def probe_video(
    data: bytes | bytearray | memoryview,
    *,
    max_frame_pixels: int = MAX_FRAME_PIXELS,
    max_frames: int = MAX_VIDEO_FRAMES,
) -> EncodedVideo:
    """The header of a video item (no frame is decoded). Raises ``VideoDecodeError`` for
    bytes that are no supported container, a container without a video stream, a codec
    outside ``VIDEO_CODECS``, or a size, frame count or frame rate out of bounds."""
    fmt = video_format(data)
    if fmt is None:
        raise VideoDecodeError("not an MP4, MOV, WebM or Matroska container")
    av = _av()
    container = _open(data)
    try:
        if not container.streams.video:
            raise VideoDecodeError(f"the {fmt} container holds no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        if codec not in VIDEO_CODECS:
            raise VideoDecodeError(
                f"video codec {codec!r} is not decoded here; one of {sorted(VIDEO_CODECS)}"
            )
        width, height = int(stream.width), int(stream.height)
        if width <= 0 or height <= 0 or width * height > max_frame_pixels:
            raise VideoDecodeError(
                f"video frames of {width}x{height} are outside (0, {max_frame_pixels}] pixels"
            )
        frames = int(stream.frames) or _count_packets(container, stream, max_frames)
        if frames > max_frames:
            raise VideoDecodeError(f"the video has {frames} frames, over the {max_frames} allowed")
        rate = stream.average_rate
        if rate is None or rate <= 0:
            raise VideoDecodeError("the video stream declares no frame rate")
        return EncodedVideo(
            format=fmt, codec=codec, width=width, height=height, frames=frames, fps=float(rate)
        )
    except VideoDecodeError:
        raise
    except DimensionError as e:
        raise VideoDecodeError(str(e)) from e
    except (av.FFmpegError, *_MALFORMED) as e:
        raise VideoDecodeError(f"unreadable {fmt} container: {e!r}") from e
    finally:
        container.close()


def _count_packets(container: Any, stream: Any, limit: int) -> int:
    """Frames of a container that stores no count: its stream's packets with data (one
    frame each), demuxed, not decoded; stops once past ``limit``."""
    n = 0
    for packet in container.demux(stream):
        if packet.size:
            n += 1
            if n > limit:
                break
    return n


def decode_frames(
    data: bytes | bytearray | memoryview,
    video: EncodedVideo,
    indices: Sequence[int],
    *,
    threads: int = 0,
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Frames ``indices`` (frame numbers in order, as the plan samples them; a number may
    repeat where the processor's sampling repeats it) of a video
    whose header is ``video``, as uint8 ``(len(indices), H, W, 3)`` RGB.

    Decodes from the start on ``threads`` FFmpeg threads (0: one per core), converts only
    the named frames, and stops after the last. Raises ``VideoDecodeError`` if a frame's
    size differs from the header's, or the stream ends before a named frame.
    """
    if not indices:
        raise VideoDecodeError("no frames to decode")
    if any(b < a for a, b in itertools.pairwise(indices)) or indices[0] < 0:
        raise VideoDecodeError("frame numbers must not descend, from 0")
    last = indices[-1]
    if last >= video.frames:
        raise VideoDecodeError(f"frame {last} of a {video.frames}-frame video")
    w, h = video.width, video.height
    out = np.empty((len(indices), h, w, 3), dtype=np.uint8)
    where: dict[int, list[int]] = {}
    for k, i in enumerate(indices):
        where.setdefault(i, []).append(k)
    av = _av()
    container = _open(data)
    filled = 0
    try:
        stream = container.streams.video[0]
        if stream.codec_context.name != video.codec:
            raise VideoDecodeError(
                f"the stream is {stream.codec_context.name}, its header said {video.codec}"
            )
        # the decoder refuses a bitstream whose frames are larger, before allocating them
        # (its coded size is the frame's rounded up to whole blocks, at most 128 a side)
        coded = -(-w // _BLOCK) * _BLOCK * (-(-h // _BLOCK) * _BLOCK)
        stream.codec_context.options = {"max_pixels": str(coded)}
        stream.thread_type = "AUTO"
        stream.thread_count = threads
        for i, frame in enumerate(container.decode(stream)):
            if frame.width != w or frame.height != h:
                raise VideoDecodeError(
                    f"frame {i} is {frame.width}x{frame.height}, the header said {w}x{h}"
                )
            at = where.get(i)
            if at is not None:
                rgb = frame.to_ndarray(format="rgb24")
                for k in at:
                    out[k] = rgb
                filled += len(at)
            if i >= last:
                break
    except VideoDecodeError:
        raise
    except (av.FFmpegError, *_MALFORMED) as e:
        raise VideoDecodeError(f"the {video.format} stream does not decode: {e!r}") from e
    finally:
        container.close()
    if filled != len(indices):
        raise VideoDecodeError(
            f"the stream ended after {filled} of the {len(indices)} planned frames; its "
            f"header claims {video.frames}"
        )
    return out
