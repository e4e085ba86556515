"""Qwen-VL video on the CPU: the container's header, the plan, the frames the owner decodes
and ``pixel_values_videos``, each against transformers (its video processors and its PyAV
loader) with ``==``, and the refusals of corrupt and hostile containers."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import av
import msgspec
import numpy as np
import pytest
import torch
from clips import RAW_CASES, SETTINGS, frame_pixels, make_clip, planned_cases
from mmwire.kernels import video_resize_reference
from mmwire.materialize.video import QwenVideoConfig, video_pixel_values, video_spec_for
from mmwire.transport.errors import ConfigurationError, MaterializeError, VideoDecodeError
from mmwire.transport.videos import decode_frames, probe_video, video_format

oracle = pytest.importorskip("oracle")
hf = oracle.video_oracle()

FAMILIES = {"qwen2.5-vl": hf.Qwen2VLVideoProcessor, "qwen3-vl": hf.Qwen3VLVideoProcessor}


def _reference(family: str, params: dict[str, Any], video: np.ndarray, fps: float) -> Any:
    """transformers' output for one video, or the exception it raises."""
    t, h, w = video.shape[:3]
    processor = FAMILIES[family](**params)
    meta = hf.VideoMetadata(total_num_frames=t, fps=fps, duration=t / fps, height=h, width=w)
    try:
        return processor(
            videos=[video],
            video_metadata=[meta],
            return_tensors="pt",
            return_metadata=True,
            cap_pixels_per_frame=bool(params.get("cap_pixels_per_frame", False)),
        )
    except (ValueError, ZeroDivisionError) as e:
        return e


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("settings", range(len(SETTINGS)))
def test_pixel_values_equal_transformers(family: str, settings: int) -> None:
    """Plan (sampled frames, grid, timestamps) and ``pixel_values_videos`` in fp32 and bf16
    equal the video processor's for every case; where it refuses a video, so does mmwire."""
    params = SETTINGS[settings]
    rng = np.random.default_rng(settings)
    if family == "qwen3-vl" and "num_frames" in params:
        # its default fps and a num_frames: the processor refuses every video, the spec
        # refuses the settings
        video = rng.integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
        assert isinstance(_reference(family, params, video, 30.0), ValueError)
        with pytest.raises(ConfigurationError, match="mutually exclusive"):
            video_spec_for(family, params)
        return
    config = video_spec_for(family, params)
    checked = 0
    for t, h, w, fps in RAW_CASES:
        video = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
        ref = _reference(family, params, video, fps)
        if isinstance(ref, Exception):
            with pytest.raises(MaterializeError):
                config.plan_frames(t, fps, h, w)
            continue
        plan = config.plan_frames(t, fps, h, w)
        meta = ref["video_metadata"][0]
        if meta.frames_indices is not None:
            assert list(plan.indices) == [int(i) for i in meta.frames_indices], (t, h, w)
        else:
            assert plan.indices == tuple(range(t))
        assert plan.grid.thw == tuple(ref["video_grid_thw"][0].tolist()), (t, h, w)
        frames = video[list(plan.indices)]
        got = video_pixel_values(frames, plan, config)
        want = ref["pixel_values_videos"]
        assert got.shape == want.shape and torch.equal(got, want), (family, params, t, h, w)
        got16 = video_pixel_values(frames, plan, config, torch.bfloat16)
        assert torch.equal(got16, want.to(torch.bfloat16))
        gt, gh, gw = plan.grid.thw
        assert plan.tokens == gt * gh * gw // 4
        if family == "qwen3-vl":
            stamps = hf.Qwen3VLProcessor._calculate_timestamps(None, list(plan.indices), fps, 2)
            assert plan.timestamps == tuple(stamps)
        else:
            assert plan.timestamps is None
        checked += 1
    assert checked >= len(RAW_CASES) - 2  # the refusals are the exception, not the rule


def test_a_perturbed_frame_changes_the_output() -> None:
    """The comparison above sees single levels: one pixel off by one changes the rows."""
    config = video_spec_for("qwen3-vl")
    video = np.random.default_rng(5).integers(0, 256, (8, 64, 80, 3), dtype=np.uint8)
    plan = config.plan_frames(8, 30.0, 64, 80)
    base = video_pixel_values(video[list(plan.indices)], plan, config)
    video[plan.indices[-1], 31, 40, 1] ^= 1
    assert not torch.equal(video_pixel_values(video[list(plan.indices)], plan, config), base)


@pytest.mark.parametrize(
    ("container", "codec", "width", "height", "frames"),
    [
        ("mp4", "libx264", 162, 98, 75),
        ("mov", "libx264", 96, 64, 17),
        ("matroska", "libx264", 130, 74, 33),
        ("webm", "libvpx-vp9", 163, 97, 41),
    ],
)
def test_decoded_frames_equal_transformers_loader(
    tmp_path: Path, container: str, codec: str, width: int, height: int, frames: int
) -> None:
    """The header reads as transformers' PyAV loader reads it (MP4 and MOV store a count;
    Matroska and WebM get their packets counted), and the frames decoded for a sampled
    plan equal the loader's, B-frames and odd sizes included."""
    data = make_clip(width, height, frames, container=container, codec=codec)
    header = probe_video(data)
    assert (header.width, header.height, header.frames, header.fps) == (
        width,
        height,
        frames,
        30.0,
    )
    path = tmp_path / f"clip.{container}"
    path.write_bytes(data)
    plan = video_spec_for("qwen3-vl", {"fps": 4}).plan(header)
    indices = np.array(plan.indices)
    want, meta = hf.read_video_pyav(str(path), sample_indices_fn=lambda metadata, **_: indices)
    if container in ("mp4", "mov"):
        assert (meta.total_num_frames, meta.fps) == (header.frames, header.fps)
    got = decode_frames(data, header, plan.indices, threads=2)
    assert got.shape == want.shape and np.array_equal(got, want)
    # the content moves: sampled frames differ from each other
    assert not np.array_equal(got[0], got[-1])


def test_variable_frame_rate_clip_decodes_as_the_loader_does(tmp_path: Path) -> None:
    """Frames at uneven times: frame i is still the i-th frame decoded, as the loader
    counts them, and the plan's frame rate is the container's average rate."""
    times = [0.0, 0.05, 0.07, 0.3, 0.31, 0.6, 0.9, 0.95, 1.4, 1.5, 1.9, 2.0, 2.6]
    data = make_clip(64, 48, len(times), times=times)
    header = probe_video(data)
    assert header.frames == len(times)
    path = tmp_path / "vfr.mp4"
    path.write_bytes(data)
    indices = [0, 2, 3, 7, 12]
    want, meta = hf.read_video_pyav(
        str(path), sample_indices_fn=lambda metadata, **_: np.array(indices)
    )
    assert meta.fps == header.fps
    assert np.array_equal(decode_frames(data, header, indices), want)


def test_raw_frames_go_through_the_same_processing() -> None:
    """A ``(T, H, W, 3)`` array is a video whose frames are all given: with sampling off
    the plan takes every frame, and the rows equal the processor's for that array."""
    video = np.stack([frame_pixels(i, 90, 70) for i in range(6)])
    config = video_spec_for("qwen2.5-vl")
    plan = config.plan_frames(6, 24.0, 70, 90)
    assert plan.indices == tuple(range(6))
    ref = _reference("qwen2.5-vl", {}, video, 24.0)
    assert torch.equal(video_pixel_values(video, plan, config), ref["pixel_values_videos"])
    as_list = [frame_pixels(i, 90, 70) for i in range(6)]
    assert torch.equal(video_pixel_values(as_list, plan, config), ref["pixel_values_videos"])
    for wrong in (as_list[:5], video.astype(np.float32), video[..., :2]):
        with pytest.raises(MaterializeError):
            video_pixel_values(wrong, plan, config)


def test_spec_reads_published_configs_and_refuses_the_rest() -> None:
    qwen25 = video_spec_for("qwen2.5-vl", oracle.VIDEO_PARAMS["qwen2.5-vl"])
    assert (qwen25.min_pixels, qwen25.max_pixels, qwen25.patch_size) == (3136, 12845056, 14)
    qwen3 = video_spec_for("qwen3-vl", oracle.VIDEO_PARAMS["qwen3-vl"])
    assert (qwen3.min_pixels, qwen3.max_pixels, qwen3.patch_size) == (4096, 25165824, 16)
    assert qwen3.do_sample_frames and qwen3.fps == 2
    for bad in (
        {"resample": 2},
        {"do_normalize": False},
        {"frames_per_second": 2},
        {"fps": 2, "num_frames": 8},
        {"size": {"height": 10, "width": 10}},
    ):
        with pytest.raises(ConfigurationError):
            video_spec_for("qwen3-vl", bad)
    with pytest.raises(ConfigurationError):
        video_spec_for("kimi-k2.5")


def test_plans_are_bounded_by_the_spec() -> None:
    """More frames than ``max_frames`` unsampled, or sampled frames over the decoded-bytes
    ceiling, are refused from the header alone."""
    every = video_spec_for("qwen2.5-vl", {"max_frames": 64})
    with pytest.raises(MaterializeError, match="max_frames"):
        every.plan_frames(65, 30.0, 64, 64)
    small = QwenVideoConfig(do_sample_frames=True, fps=2, max_decoded_bytes=10 * 1920 * 1080 * 3)
    assert len(small.plan_frames(150, 30.0, 1080, 1920).indices) == 10
    with pytest.raises(MaterializeError, match="max_decoded_bytes"):
        small.plan_frames(180, 30.0, 1080, 1920)


def test_corrupt_containers_are_refused_with_a_typed_error() -> None:
    data = make_clip(64, 48, 30)
    assert video_format(data) == "mp4" and video_format(b"\x89PNG\r\n\x1a\n") is None
    for bad in (b"", b"not a video at all" * 10, b"\x00\x00\x00\x18ftypmp42" + bytes(200)):
        with pytest.raises(VideoDecodeError):
            probe_video(bad)
    # the index is at the end (no faststart): cut off, nothing is readable
    with pytest.raises(VideoDecodeError):
        probe_video(data[: len(data) // 2])
    # cut inside the stream's description: PyAV gives a stream without a codec context
    small = make_clip(48, 32, 10)
    for cut in range(16, len(small), 7):
        try:
            probe_video(small[:cut])
        except VideoDecodeError:
            pass
    # garbage in the middle of the stream: the header reads, decoding refuses or the
    # frames come out, never anything else
    header = probe_video(data)
    mangled = bytearray(data)
    mangled[len(data) // 3 : len(data) // 3 + 400] = bytes(400)
    try:
        decode_frames(bytes(mangled), header, list(range(30)))
    except VideoDecodeError:
        pass


def test_a_header_that_claims_more_frames_than_the_stream_holds() -> None:
    """The index (moov first) claims every frame but the media data is cut: the owner
    decodes what there is and refuses, rather than return fewer frames than planned."""
    data = make_clip(64, 48, 60, container_options={"movflags": "faststart"})
    header = probe_video(data[: len(data) * 2 // 3])
    assert header.frames == 60
    with pytest.raises(VideoDecodeError):
        decode_frames(data[: len(data) * 2 // 3], header, [0, 30, 59])


def test_a_hostile_stream_cannot_enlarge_what_the_owner_decodes() -> None:
    """A Matroska stream whose first 40 frames are 64x48 (what the header reads) and whose
    last 4 switch to 640x480 with a new in-band SPS: the decoder, opened with the header's
    size as its ceiling, refuses them, so no 640x480 frame is allocated."""
    opts = {"x264-params": "repeat-headers=1", "bf": "0"}
    small = make_clip(64, 48, 40, container="matroska", options=opts)
    big = make_clip(640, 480, 4, container="matroska", options=opts)
    buf = io.BytesIO()
    with (
        av.open(io.BytesIO(small)) as first,
        av.open(io.BytesIO(big)) as second,
        av.open(buf, "w", format="matroska") as out,
    ):
        stream = out.add_stream_from_template(first.streams.video[0])
        k = 0
        for src in (first, second):
            for packet in src.demux(src.streams.video[0]):
                if packet.size:
                    packet.stream = stream
                    packet.pts = packet.dts = k * 33
                    out.mux(packet)
                    k += 1
    forged = buf.getvalue()
    header = probe_video(forged)
    assert (header.width, header.height, header.frames) == (64, 48, 44)
    assert decode_frames(forged, header, [0, 39]).shape == (2, 48, 64, 3)
    with pytest.raises(VideoDecodeError) as refused:
        decode_frames(forged, header, [0, 41])
    assert isinstance(refused.value.__cause__, av.FFmpegError)  # FFmpeg's, not a frame's size


def test_sizes_counts_and_codecs_outside_the_bounds_are_refused() -> None:
    data = make_clip(160, 120, 40)
    with pytest.raises(VideoDecodeError, match="pixels"):
        probe_video(data, max_frame_pixels=160 * 120 - 1)
    with pytest.raises(VideoDecodeError, match="frames"):
        probe_video(data, max_frames=39)
    mpeg4 = make_clip(64, 48, 5, codec="mpeg4")
    with pytest.raises(VideoDecodeError, match="codec"):
        probe_video(mpeg4)
    header = probe_video(data)
    with pytest.raises(VideoDecodeError):
        decode_frames(data, header, [5, 3])
    with pytest.raises(VideoDecodeError):
        decode_frames(data, header, [40])
    with pytest.raises(VideoDecodeError):  # a header that is not this stream's
        decode_frames(data, msgspec.structs.replace(header, codec="vp9"), [0])


def test_the_kernels_resize_arithmetic_equals_torch() -> None:
    """The CUDA kernels' tables and integer passes (here in numpy) equal torch's own uint8
    antialiased bicubic, for every plan of the cases above under both families (shrinking
    and enlarging, odd sizes, one axis unchanged) and for sizes far apart."""
    rng = np.random.default_rng(7)
    sizes = {
        (h, w, plan.new_height, plan.new_width)
        for family in FAMILIES
        for _, plan, (_, h, w, _) in planned_cases(family)
    }
    sizes |= {(1080, 1920, 448, 784), (720, 1280, 336, 588), (61, 60, 64, 64), (7, 5, 64, 32)}
    sizes |= {(64, 90, 64, 96), (56, 84, 112, 84)}  # one axis as it is
    assert any(h2 == h for h, _, h2, _ in sizes) and any(h2 > h for h, _, h2, _ in sizes)
    for h, w, h2, w2 in sorted(sizes):
        frames = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        want = torch.nn.functional.interpolate(
            torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(),
            size=[h2, w2],
            mode="bicubic",
            align_corners=False,
            antialias=True,
        )
        got = video_resize_reference(frames, h2, w2)
        assert np.array_equal(got, want.permute(0, 2, 3, 1).numpy()), (h, w, h2, w2)
