from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from helpers import cpu_ref, processed_envelope, raw_envelope
from mmwire.materialize import QwenVLConfig
from mmwire.transport import GlobalIndex, Grid, TensorSpec
from mmwire.transport.errors import (
    ByteLengthMismatch,
    DimensionError,
    FrameError,
    GridMismatch,
    LimitExceeded,
    MalformedEnvelope,
    OffsetError,
    SchemaVersionError,
    UnknownDtype,
)
from mmwire.transport.wire import SCHEMA_VERSION, BatchDecoder, Limits, encode_batch, numpy_view

GOLDEN = Path(__file__).parent / "data" / "golden_v1.bin"
GOLDEN_V2 = Path(__file__).parent / "data" / "golden_v2.bin"


def _batch(images: list[np.ndarray]) -> list:  # type: ignore[type-arg]
    envs = [raw_envelope(i, img) for i, img in enumerate(images)]
    return encode_batch(envs, [img.tobytes() for img in images])


class TestRoundTrip:
    def test_raw_items_round_trip(self, distinct_images: list[np.ndarray]) -> None:  # type: ignore[type-arg]
        batch = BatchDecoder().decode(_batch(distinct_images))
        assert len(batch.envelopes) == 3
        for i, img in enumerate(distinct_images):
            env = batch.envelopes[GlobalIndex(i)]
            view = numpy_view(env.tensor, batch.inline(GlobalIndex(i)))
            assert np.array_equal(view, img)
            assert not view.flags.writeable

    def test_over_real_zmq(self, distinct_images: list[np.ndarray]) -> None:  # type: ignore[type-arg]
        ctx = zmq.Context()
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        try:
            a.bind("inproc://codec")
            b.connect("inproc://codec")
            big = np.arange(300 * 400 * 3, dtype=np.uint8).reshape(300, 400, 3)  # > copy threshold
            images = [*distinct_images, big]
            tracker = a.send_multipart(_batch(images), copy=False, track=True)
            frames = b.recv_multipart(copy=False)
            batch = BatchDecoder().decode(frames)
            got = numpy_view(batch.envelopes[GlobalIndex(3)].tensor, batch.inline(GlobalIndex(3)))
            assert np.array_equal(got, big)
            del got, batch, frames  # inproc shares the buffer: zmq is done once we let go
            tracker.wait(5)
        finally:
            a.close(0)
            b.close(0)
            ctx.term()

    def test_mixed_kinds_and_grids(self) -> None:
        img = np.zeros((20, 30, 3), np.uint8)
        proc = processed_envelope(1, (2, 4), frame=1)
        feats = np.zeros(proc.tensor.shape, np.float32)
        frames = encode_batch([raw_envelope(0, img), proc], [img, feats])
        batch = BatchDecoder().decode(frames)
        assert batch.envelopes[GlobalIndex(1)].grid == Grid((2, 4))
        assert batch.envelopes[GlobalIndex(1)].grid.ndim == 2

    def test_golden_v1_still_decodes(self) -> None:
        frames = _golden_frames()
        if not GOLDEN.exists():  # pragma: no cover - written once, then committed
            GOLDEN.write_bytes(frames[0])
        batch = BatchDecoder().decode([GOLDEN.read_bytes(), *frames[1:]])
        env = batch.envelopes[GlobalIndex(0)]
        assert env.tensor.shape == (5, 7, 3)
        assert env.preprocess is not None and env.preprocess.plan.grid == Grid((1, 2, 2))
        assert batch.envelopes[GlobalIndex(1)].payload == cpu_ref(4096, 12)


def test_golden_v2_decodes_a_qwen_item_with_its_processor() -> None:
    # schema 2: the spec names its processor and carries Qwen-VL's parameters
    img = (np.arange(30 * 41 * 3) % 253).astype(np.uint8).reshape(30, 41, 3)
    spec = QwenVLConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 16)(41, 30)
    env = raw_envelope(0, img, frame=0, spec=spec)
    frames = encode_batch([env], [img.tobytes()])
    if not GOLDEN_V2.exists():  # pragma: no cover - written once, then committed
        GOLDEN_V2.write_bytes(frames[0])
    batch = BatchDecoder().decode([GOLDEN_V2.read_bytes(), *frames[1:]])
    got = batch.envelopes[GlobalIndex(0)].preprocess
    assert got is not None and got.processor == "qwen2_vl"
    assert (got.min_pixels, got.max_pixels, got.temporal_patch_size) == (3136, 12544, 2)
    assert got.plan.grid == Grid((1, 4, 6)) and got.row_shape == (1176,)  # upscaled to 84x56
    # and a version-1 envelope is read with Kimi's defaults for the fields it lacks
    old = BatchDecoder().decode([GOLDEN.read_bytes(), *_golden_frames()[1:]])
    v1 = old.envelopes[GlobalIndex(0)]
    assert v1.version == 1 and v1.preprocess is not None
    assert v1.preprocess.processor == "kimi_vl" and v1.preprocess.row_shape == (3, 14, 14)


def _golden_frames() -> list:  # type: ignore[type-arg]
    img = (np.arange(5 * 7 * 3) % 251).astype(np.uint8).reshape(5, 7, 3)
    small = np.zeros((2, 2, 3), np.uint8)
    envs = [raw_envelope(0, img), raw_envelope(1, small, payload=cpu_ref(4096, 12))]
    return encode_batch(envs, [img.tobytes()])


class TestRejects:
    def decode_header(self, header: object, frames: tuple = ()) -> None:  # type: ignore[type-arg]
        BatchDecoder().decode([msgspec.msgpack.encode(header), *frames])

    def header(self, **env_changes: object) -> dict:  # type: ignore[type-arg]
        env = msgspec.to_builtins(raw_envelope(0, np.zeros((5, 7, 3), np.uint8)))
        env.update(env_changes)
        return {"version": SCHEMA_VERSION, "envelopes": [env], "frames": 1}

    def test_wrong_version(self) -> None:
        with pytest.raises(SchemaVersionError, match="version` 4"):
            self.decode_header({"version": 4, "envelopes": [], "frames": 0})
        h = self.header(version=7)
        with pytest.raises(SchemaVersionError, match="`version` 7"):
            self.decode_header(h, (bytes(105),))

    def test_wrong_type(self) -> None:
        with pytest.raises(MalformedEnvelope, match="not an envelope batch"):
            BatchDecoder().decode([b"\xc1garbage"])
        with pytest.raises(MalformedEnvelope, match="Expected `str`"):
            self.decode_header(self.header(request_id=5), (bytes(105),))

    def test_unknown_dtype(self) -> None:
        h = self.header(tensor={"dtype": "complex64", "shape": [5, 7, 3], "nbytes": 105})
        with pytest.raises(UnknownDtype, match="complex64"):
            self.decode_header(h, (bytes(105),))

    def test_non_positive_dims(self) -> None:
        h = self.header(tensor={"dtype": "uint8", "shape": [0, 7, 3], "nbytes": 0})
        with pytest.raises(DimensionError, match="positive"):
            self.decode_header(h, (b"",))
        with pytest.raises(DimensionError, match=r"\[h, w\] or \[t, h, w\]"):
            self.decode_header(self.header(grid=[[1, 1, 2, 2]]), (bytes(105),))

    def test_byte_length_mismatch(self) -> None:
        h = self.header(tensor={"dtype": "uint8", "shape": [5, 7, 3], "nbytes": 104})
        with pytest.raises(ByteLengthMismatch, match="105"):
            self.decode_header(h, (bytes(104),))

    def test_overflowing_shape_is_rejected_without_overflow(self) -> None:
        huge = [2**40, 2**40, 3]
        h = self.header(tensor={"dtype": "uint8", "shape": huge, "nbytes": 2**64 - 1})
        with pytest.raises(ByteLengthMismatch):
            self.decode_header(h, (b"",))

    def test_pixel_ceiling(self) -> None:
        frames = _batch([np.zeros((40, 40, 3), np.uint8)])
        with pytest.raises(LimitExceeded, match="over `max_pixels` 1000"):
            BatchDecoder(Limits(max_pixels=1000)).decode(frames)
        with pytest.raises(LimitExceeded, match="over `max_bytes` 100"):
            BatchDecoder(Limits(max_bytes=100)).decode(frames)

    def test_negative_offset(self) -> None:
        ref = msgspec.to_builtins(cpu_ref(4096, 105))
        ref["offset"] = -8
        h = self.header(payload=ref)
        h["frames"] = 0
        with pytest.raises(OffsetError, match=r"`payload\.offset` must be >= 0"):
            self.decode_header(h)

    def test_processed_rows_disagree_with_grid(self) -> None:
        env = msgspec.to_builtins(processed_envelope(0, (1, 2, 2), frame=0))
        env["grid"] = [[1, 2, 3]]
        h = {"version": SCHEMA_VERSION, "envelopes": [env], "frames": 1}
        with pytest.raises(GridMismatch, match="4 rows but its grid"):
            self.decode_header(h, (bytes(4 * 3 * 14 * 14 * 4),))

    def test_frames(self) -> None:
        with pytest.raises(FrameError, match="announces 1 inline frames, 0 arrived"):
            self.decode_header(self.header())
        with pytest.raises(FrameError, match="has 104 bytes"):
            self.decode_header(self.header(), (bytes(104),))
        with pytest.raises(FrameError, match="no frames"):
            BatchDecoder().decode([])

    def test_index_must_match_position(self) -> None:
        with pytest.raises(MalformedEnvelope, match="GlobalIndex order"):
            self.decode_header(self.header(index=[3]), (bytes(105),))

    def test_encoder_refuses_bad_batches(self) -> None:
        img = np.zeros((5, 7, 3), np.uint8)
        with pytest.raises(FrameError):
            encode_batch([raw_envelope(0, img)], [])
        with pytest.raises(ByteLengthMismatch):
            TensorSpec(dtype="float32", shape=(2, 2), nbytes=8)
