"""Random and mutated-valid bytes: the decoder yields a batch or an EnvelopeError, nothing else;
and the owner, given every batch that decodes, materialises it or raises an MmwireError,
within a bounded time and output. Images and videos (a container's bytes and its
envelope's fields) both.

CI runs a share; ``MMWIRE_FUZZ_EXAMPLES=100000`` runs the full 100k of each strategy
(about 15, 10 and 3 minutes on 2 cores). Add ``-o faulthandler_timeout=0``: the watchdog's
traceback dump at 120 s is not async-safe and once crashed the interpreter mid-run.
"""

from __future__ import annotations

import io
import os
import time
from typing import Any

import msgspec
import numpy as np
from clips import make_clip
from helpers import cpu_ref, encoded_envelope, processed_envelope, raw_envelope
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mmwire.materialize import FAMILIES, Materializer
from mmwire.materialize.video import QwenVideoConfig
from mmwire.transport import Consumer, IndexMap
from mmwire.transport.errors import EnvelopeError, MmwireError
from mmwire.transport.videos import VideoSpec, probe_video
from mmwire.transport.wire import BatchDecoder, encode_batch
from PIL import Image

EXAMPLES = int(os.environ.get("MMWIRE_FUZZ_EXAMPLES", "1000"))
DECODER = BatchDecoder()
MAX_OUT = 16 << 20
MATERIALIZER = Materializer(0, max_output_bytes=MAX_OUT)
MAX_SECONDS = 2.0

_img = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
_proc = processed_envelope(2, (1, 2, 2), frame=1)
_png = io.BytesIO()
Image.fromarray(np.arange(9 * 11 * 3, dtype=np.uint8).reshape(9, 11, 3)).save(_png, "PNG")
PNG = _png.getvalue()
_qwen_img = np.arange(6 * 4 * 3, dtype=np.uint8).reshape(6, 4, 3)
VALID = encode_batch(
    [
        raw_envelope(0, _img),
        raw_envelope(1, np.zeros((3, 2, 4), np.uint8), payload=cpu_ref(64, 24)),
        _proc,
        encoded_envelope(3, PNG, frame=2),
        raw_envelope(4, _qwen_img, frame=3, spec=FAMILIES["qwen2.5-vl"](4, 6)),
    ],
    [_img.tobytes(), bytes(_proc.tensor.nbytes), PNG, _qwen_img.tobytes()],
)
VALID_HEADER: bytes = VALID[0]
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class _Owner:
    """A real consumer's decode and open, made on first use (inline frames need no producer;
    its socket stays idle) and closed with the module."""

    consumer: Consumer | None = None

    @classmethod
    def get(cls) -> Consumer:
        if cls.consumer is None:
            cls.consumer = Consumer(0, "ipc:///nonexistent/mmwire-fuzz")
        return cls.consumer


def _decode(frames: list[bytes]) -> None:
    try:
        DECODER.decode(frames)
    except EnvelopeError:
        return
    _materialize(frames)


def _materialize(frames: list[bytes]) -> None:
    """Every batch that decodes goes to the owner: features or an MmwireError, bounded."""
    batch = _Owner.get().decode(frames)
    mine = [g for g, env in batch.envelopes.items() if 0 in env.consumers]
    t0 = time.monotonic()
    try:
        out = MATERIALIZER.materialize(batch, IndexMap(0, mine))
    except MmwireError:
        pass
    else:
        assert out.pixel_values.nbytes <= MAX_OUT
        videos = out.pixel_values_videos
        assert videos is None or videos.nbytes <= MAX_OUT
    finally:
        batch.release()
    assert time.monotonic() - t0 < MAX_SECONDS


@FUZZ
@given(st.binary(max_size=512), st.lists(st.binary(max_size=64), max_size=3))
def test_random_bytes(header: bytes, rest: list[bytes]) -> None:
    _decode([header, *rest])


def test_the_valid_batch_materialises() -> None:
    """The fuzz's seed batch is accepted whole, so the mutations start from a working case:
    Kimi's raw and encoded items in one batch, Qwen's in another (their rows differ)."""
    batch = _Owner.get().decode(VALID)
    envs = batch.envelopes.values()
    kimi = IndexMap(0, [envs[0].index, envs[3].index])
    out = MATERIALIZER.materialize(batch, kimi)
    assert out.pixel_values.shape[0] == envs[0].grid.patches + envs[3].grid.patches
    qwen = MATERIALIZER.materialize(batch, IndexMap(0, [envs[4].index]))
    assert qwen.pixel_values.shape == (envs[4].grid.patches, 1176)


def _mutated(data: st.DataObject, original: bytes) -> bytearray:
    """``original`` with 1 to 6 bytes flipped, overwritten or cut off."""
    buf = bytearray(original)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        op = data.draw(st.sampled_from(["flip", "set", "cut"]))
        if op == "flip":
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            buf[pos] = data.draw(st.integers(0, 255))
        elif pos > 0:
            del buf[pos:]
    return buf


@FUZZ
@given(st.data())
def test_mutated_encoded_bytes(data: st.DataObject) -> None:
    """An encoded item's bytes flipped, cut or overwritten under its honest envelope."""
    buf = _mutated(data, PNG)
    forged = msgspec.structs.replace(
        encoded_envelope(0, PNG, frame=0),
        tensor=msgspec.structs.replace(
            encoded_envelope(0, PNG, frame=0).tensor, shape=(len(buf),), nbytes=len(buf)
        ),
    )
    _decode(encode_batch([forged], [bytes(buf)]))


@FUZZ
@given(st.data())
def test_mutated_valid_header(data: st.DataObject) -> None:
    buf = bytearray(VALID_HEADER)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[pos:]
        else:
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    _decode([bytes(buf), *VALID[1:]])


_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, -1, 1, 2**31, 2**32]))


@FUZZ
@given(st.data())
def test_structurally_mutated_fields(data: st.DataObject) -> None:
    """Replace one leaf of the valid header with a hostile value of another type/size."""
    _mutate_leaf(data, VALID)


def _mutate_leaf(data: st.DataObject, valid: list[Any]) -> None:
    tree = msgspec.msgpack.decode(valid[0])
    leaves: list[tuple[object, object]] = []

    def walk(node: object) -> None:
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for k, v in items:
            leaves.append((node, k))
            walk(v)

    walk(tree)
    parent, key = data.draw(st.sampled_from(leaves))
    value = data.draw(
        st.one_of(
            _ints,
            st.text(max_size=4),
            st.none(),
            st.lists(_ints, max_size=4),
            st.floats(),
            st.binary(max_size=70),
            st.booleans(),
        )
    )
    parent[key] = value  # type: ignore[index]
    _decode([msgspec.msgpack.encode(tree), *valid[1:]])


VIDEO_CONFIG = QwenVideoConfig(family="qwen3-vl", sampler="qwen3_vl", patch_size=16)
CLIP = make_clip(48, 32, 10)
_frames = np.arange(4 * 32 * 48 * 3, dtype=np.uint8).reshape(4, 32, 48, 3)


def _video_envelope(index: int, spec: VideoSpec, nbytes: int, shape: tuple[int, ...]) -> Any:
    from mmwire.transport import FeatureEnvelope, GlobalIndex, TensorSpec
    from mmwire.transport.wire import SCHEMA_VERSION, InlineRef

    return FeatureEnvelope(
        version=SCHEMA_VERSION,
        request_id="req-v",
        index=GlobalIndex(index),
        modality="video",
        kind="encoded" if spec.header is not None else "raw",
        grid=spec.plan.grid,
        tensor=TensorSpec(dtype="uint8", shape=shape, nbytes=nbytes),
        payload=InlineRef(frame=index),
        consumers=(0,),
        video=spec,
    )


VIDEO_SPEC = VIDEO_CONFIG(probe_video(CLIP))
VALID_VIDEO = encode_batch(
    [
        _video_envelope(0, VIDEO_SPEC, len(CLIP), (len(CLIP),)),
        _video_envelope(1, VIDEO_CONFIG((4, 32, 48)), _frames.nbytes, _frames.shape),
    ],
    [CLIP, _frames.tobytes()],
)
VIDEO_FUZZ = settings(FUZZ, max_examples=max(EXAMPLES // 4, 1))


def test_the_valid_video_batch_materialises() -> None:
    """The video seed (a container and frames given decoded) is accepted whole."""
    batch = _Owner.get().decode(VALID_VIDEO)
    out = MATERIALIZER.materialize(batch, IndexMap(0, list(batch.envelopes.indices())))
    batch.release()
    assert out.video_grid_thw is not None
    assert out.video_grid_thw.tolist() == [list(VIDEO_SPEC.plan.grid.thw), [2, 10, 14]]


@VIDEO_FUZZ
@given(st.data())
def test_mutated_video_container(data: st.DataObject) -> None:
    """A video's container flipped, overwritten or cut under its honest envelope: the
    owner decodes it or raises an MmwireError, within the time bound."""
    buf = _mutated(data, CLIP)
    env = _video_envelope(0, VIDEO_SPEC, len(buf), (len(buf),))
    _decode(encode_batch([env], [bytes(buf)]))


@VIDEO_FUZZ
@given(st.data())
def test_structurally_mutated_video_fields(data: st.DataObject) -> None:
    """One leaf of the video batch's header (its config, plan, header or tensor) replaced
    with a hostile value: a typed error, or a batch the owner handles within bounds."""
    _mutate_leaf(data, VALID_VIDEO)


def teardown_module() -> None:
    if _Owner.consumer is not None:
        _Owner.consumer.close()
