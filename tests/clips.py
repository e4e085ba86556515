"""Video clips for the tests, made with PyAV (the library the owner decodes with): moving
content, any size the codec takes, constant or variable frame rate."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

# (frames, height, width, fps): distinct sizes, odd sides, frame counts that are not a
# multiple of the temporal patch, one shorter than min_frames, one frame, long and thin
RAW_CASES = [
    (5, 181, 247, 30.0),
    (9, 97, 163, 25.0),
    (16, 180, 320, 30.0),
    (3, 60, 61, 24.0),
    (31, 240, 320, 29.97),
    (1, 50, 70, 30.0),
    (120, 64, 96, 30.0),
    (7, 30, 900, 12.0),
]

SETTINGS: list[dict[str, Any]] = [
    {},
    {"do_sample_frames": True, "fps": 2},
    {"do_sample_frames": True, "fps": 2, "cap_pixels_per_frame": True},
    {"do_sample_frames": True, "num_frames": 4},
]


def planned_cases(family: str) -> Iterator[tuple[Any, Any, tuple[int, int, int, float]]]:
    """``(config, plan, case)`` for every setting and raw case the family's processor
    takes (the others raise in transformers too: they are tested as refusals)."""
    from mmwire.materialize.video import video_spec_for
    from mmwire.transport.errors import ConfigurationError, MaterializeError

    for params in SETTINGS:
        try:
            config = video_spec_for(family, params)
        except ConfigurationError:  # Qwen3-VL's fps beside num_frames
            continue
        for t, h, w, fps in RAW_CASES:
            try:
                yield config, config.plan_frames(t, fps, h, w), (t, h, w, fps)
            except MaterializeError:
                continue


def frame_pixels(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i``: a bright bar sweeping right over a gradient that shifts with ``i``, so
    every frame differs from its neighbours."""
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[..., 0] = (x * 255 // max(width - 1, 1) + 7 * i) % 256
    out[..., 1] = (y * 255 // max(height - 1, 1) + 3 * i) % 256
    out[..., 2] = (x + y + 11 * i) % 256
    bar = (i * 5) % width
    out[:, bar : bar + max(2, width // 8)] = 255
    return out


def make_clip(
    width: int,
    height: int,
    frames: int,
    *,
    container: str = "mp4",
    codec: str = "libx264",
    rate: int = 30,
    times: Sequence[float] | None = None,
    options: dict[str, str] | None = None,
    container_options: dict[str, str] | None = None,
) -> bytes:
    """An encoded clip of ``frames`` frames. ``times`` (seconds, ascending) gives each
    frame its own presentation time: a variable frame rate. x264 runs with B-frames.
    ``options`` go to the encoder, ``container_options`` to the muxer."""
    opts = {"bf": "2", "g": "12"} if codec == "libx264" else {}
    opts.update(options or {})
    with tempfile.TemporaryDirectory() as tmp:  # a muxer that rewrites its output (faststart)
        path = Path(tmp) / f"clip.{container}"
        _encode(path, width, height, frames, container, codec, rate, times, opts, container_options)
        return path.read_bytes()


def _encode(
    path: Path,
    width: int,
    height: int,
    frames: int,
    container: str,
    codec: str,
    rate: int,
    times: Sequence[float] | None,
    opts: dict[str, str],
    container_options: dict[str, str] | None,
) -> None:
    with av.open(str(path), "w", format=container, options=container_options or {}) as out:
        stream = out.add_stream(codec, rate=rate, options=opts)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if times is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = round(times[i] * 1000), Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
