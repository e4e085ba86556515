"""``mmwire-bench video``: a video item's bytes and its owner's time, against the frontend's
way today (decode every frame on the producer, ship the sampled frames or eager fp32 rows).

Clips are made here with PyAV (libx264, 30 fps, yuv420p, moving content: a textured scene
panning under a sweeping bar), 10 and 30 seconds at 480p, 720p and 1080p. For each:

* bytes: the container (what mmwire ships), the sampled frames as uint8 RGB (what a
  frontend that decodes ships), the eager ``pixel_values_videos`` in fp32;
* the owner's time: the header read (on the producer), the decode of only the sampled
  frames (FFmpeg threads, one per core), and ``pixel_values_videos`` from them on the CPU
  and, where there is a GPU, by the CUDA kernels (upload included);
* the frontend's time: every frame decoded and converted to RGB, as a frontend that
  decodes the clip and then samples does; and the library's own full decode (every
  frame, no conversion) beside it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ._report import write_run

HEIGHTS = {480: 854, 720: 1280, 1080: 1920}


def make_clip(seconds: float, height: int, rate: int = 30) -> bytes:
    """An H.264 MP4 of ``seconds`` at ``height`` p: a textured scene panning by 4 pixels a
    frame under a white bar sweeping across it."""
    import av

    width = HEIGHTS.get(height, height * 16 // 9 // 2 * 2)
    rng = np.random.default_rng(height)
    tile = rng.integers(0, 256, (height // 8 + 1, width // 8 + 2, 3), dtype=np.uint8)
    scene = np.repeat(np.repeat(tile, 8, axis=0), 8, axis=1)[:height]
    y = np.linspace(0, 96, height, dtype=np.float32)[:, None, None]
    scene = np.clip(scene.astype(np.float32) * 0.5 + y, 0, 255).astype(np.uint8)
    wide = np.concatenate([scene, scene], axis=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        with av.open(str(path), "w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=rate, options={"preset": "veryfast"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for i in range(round(seconds * rate)):
                x = (4 * i) % wide.shape[1] // 2
                frame = np.ascontiguousarray(wide[:, x : x + width])
                bar = (13 * i) % width
                frame[:, bar : bar + width // 20] = 255
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        return path.read_bytes()


def _full_decode(data: bytes, rgb: bool) -> int:
    """Decode every frame (and convert each to RGB if ``rgb``), as a frontend does."""
    import io

    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        n = 0
        for frame in container.decode(stream):
            if rgb:
                frame.to_ndarray(format="rgb24")
            n += 1
        return n


def _median_s(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_clip(data: bytes, family: str, fps: float, reps: int) -> dict[str, Any]:
    """One clip's bytes and times (median of ``reps``)."""
    from mmwire.materialize.video import video_pixel_values, video_spec_for
    from mmwire.transport.videos import decode_frames, probe_video

    config = video_spec_for(family, {"do_sample_frames": True, "fps": fps})
    header = probe_video(data)
    plan = config.plan(header)
    frames = decode_frames(data, header, plan.indices)
    rows = video_pixel_values(frames, plan, config)
    return {
        "width": header.width,
        "height": header.height,
        "seconds": header.duration,
        "frames": header.frames,
        "sampled": len(plan.indices),
        "bytes_container": len(data),
        "bytes_frames": plan.decoded_bytes,
        "bytes_fp32": rows.numel() * 4,
        "probe_s": _median_s(lambda: probe_video(data), reps),
        "decode_s": _median_s(lambda: decode_frames(data, header, plan.indices), reps),
        "pixels_s": _median_s(lambda: video_pixel_values(frames, plan, config), reps),
        "full_rgb_s": _median_s(lambda: _full_decode(data, True), reps),
        "full_s": _median_s(lambda: _full_decode(data, False), reps),
        "pixels_cuda_s": _cuda_pixels_s(frames, plan, config, reps),
    }


def _cuda_pixels_s(frames: Any, plan: Any, config: Any, reps: int) -> float | None:
    """The CUDA owner's ``pixel_values_videos``: the sampled frames uploaded, then the
    kernels, synchronised; ``None`` without CUDA and CuPy."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        import cupy  # noqa: F401
    except ImportError:
        return None
    from mmwire.kernels import video_rows

    scale = 1.0 / config.rescale_factor
    mean = (torch.tensor(config.image_mean) * scale).tolist()
    std = (torch.tensor(config.image_std) * scale).tolist()
    host = torch.from_numpy(frames).pin_memory()
    out = torch.empty(plan.grid.patches, *config.row_shape, device="cuda")

    def run() -> None:
        video_rows(
            host.to("cuda", non_blocking=True),
            (plan.new_height, plan.new_width),
            patch=config.patch_size,
            merge=config.merge_size,
            temporal=config.temporal_patch_size,
            mean=(mean[0], mean[1], mean[2]),
            std=(std[0], std[1], std[2]),
            out=out,
        )
        torch.cuda.synchronize()

    run()  # compile and warm up
    return _median_s(run, reps)


def render_table(rows: list[dict[str, Any]]) -> Table:
    """The run's table (also used to re-render a saved ``results.json``)."""
    table = Table(title="video: what ships and what the owner spends, per clip (median)")
    for col in (
        "clip\n(sampled/all)",
        "container",
        "frames\n(x)",
        "fp32",
        "owner\ndecode",
        "+ pixels",
        "cuda\npixels",
        "frontend\n(x)",
        "full\ndecode",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    mib = 1 << 20
    for r in rows:
        table.add_row(
            f"{r['seconds']:.0f} s {r['height']}p {r['sampled']}/{r['frames']}",
            f"{r['bytes_container'] / mib:.1f} MiB",
            f"{r['bytes_frames'] / mib:.0f} MiB ({r['bytes_frames'] / r['bytes_container']:.0f}x)",
            f"{r['bytes_fp32'] / mib:.0f} MiB",
            f"{r['decode_s'] * 1e3:.0f} ms",
            f"{r['pixels_s'] * 1e3:.0f} ms",
            "-" if r.get("pixels_cuda_s") is None else f"{r['pixels_cuda_s'] * 1e3:.1f} ms",
            f"{r['full_rgb_s'] * 1e3:.0f} ms ({r['full_rgb_s'] / r['decode_s']:.1f}x)",
            f"{r['full_s'] * 1e3:.0f} ms",
        )
    return table


def run_video(
    seconds: list[float],
    heights: list[int],
    family: str = "qwen2.5-vl",
    fps: float = 2.0,
    reps: int = 3,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> Path:
    """Make the clips, measure each, print and write the run."""
    import os

    console = console or Console()
    rows = []
    for s in seconds:
        for h in heights:
            console.print(f"video: {s:g} s at {h}p")
            rows.append(measure_clip(make_clip(s, h), family, fps, reps))
    table = render_table(rows)
    console.print(table)
    folder = write_run(
        "video",
        {
            "kind": "video",
            "family": family,
            "fps": fps,
            "cores": os.cpu_count(),
            "rows": rows,
            "notes": [
                "clips: libx264 veryfast, 30 fps, yuv420p, a panning textured scene",
                "owner: only the sampled frames decoded (FFmpeg threads, one per core) and "
                "converted, then pixel_values_videos on the CPU; cuda pixels: the sampled "
                "frames uploaded and the CUDA kernels' rows, where there is a GPU",
                "frames: the sampled frames as uint8 RGB, what a decoding frontend ships; "
                "fp32: eager pixel_values_videos",
                "frontend: every frame decoded and converted to RGB before sampling",
                "(x) after the frames: times the container's bytes; after the frontend: "
                "times the owner's decode",
            ],
        },
        table,
        out_dir=out_dir,
    )
    console.print(f"results written to {folder}")
    return folder
