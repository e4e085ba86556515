"""Video items from the producer to their owners: containers and frames published to owner
ranks in their own processes, decoded and materialised there, equal (``==``) to
transformers' processors given the frames PyAV decodes; the producer's refusals of bad
video items, and the owner's refusals of forged video envelopes."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import av
import msgspec
import numpy as np
import procs
import pytest
import torch
from clips import frame_pixels, make_clip
from mmwire.materialize import Materializer, assign_owners, spec_for
from mmwire.materialize.video import video_spec_for
from mmwire.transport import (
    Consumer,
    FeatureEnvelope,
    GlobalIndex,
    GlobalTable,
    IndexMap,
    Item,
    Producer,
)
from mmwire.transport.errors import (
    GridMismatch,
    InvalidRequest,
    MaterializeError,
    MmwireError,
    VideoDecodeError,
)
from mmwire.transport.videos import probe_video
from mmwire.transport.wire import BatchDecoder, encode_batch
from test_encoded import _publish

oracle = pytest.importorskip("oracle")
hf = oracle.video_oracle()

QWEN3 = video_spec_for("qwen3-vl")  # the checkpoint's default: 2 fps
QWEN3_ALL = video_spec_for("qwen3-vl", {"do_sample_frames": False})

# (container, codec, width, height, frames, rate): distinct sizes and lengths, odd sides,
# B-frames (x264), both kinds of frame count (MP4/MOV store one, Matroska/WebM do not)
CLIPS = [
    ("mp4", "libx264", 162, 98, 61, 30),
    ("matroska", "libx264", 130, 74, 45, 25),
    ("webm", "libvpx-vp9", 97, 67, 40, 24),
    ("mov", "libx264", 200, 120, 83, 30),
]


def _clip(k: int) -> bytes:
    container, codec, width, height, frames, rate = CLIPS[k]
    return make_clip(width, height, frames, container=container, codec=codec, rate=rate)


def _decoded(data: bytes) -> tuple[np.ndarray, float]:  # type: ignore[type-arg]
    """Every frame of a container as PyAV gives them (transformers' loader's frames), and
    its average frame rate."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def _reference(video: np.ndarray, fps: float, params: dict[str, Any]) -> tuple[bytes, list[int]]:  # type: ignore[type-arg]
    """transformers' ``pixel_values_videos`` bytes and grid for one video."""
    t, h, w = video.shape[:3]
    meta = hf.VideoMetadata(total_num_frames=t, fps=fps, duration=t / fps, height=h, width=w)
    processor = hf.Qwen3VLVideoProcessor(**params)
    got = processor(videos=[video], video_metadata=[meta], return_tensors="pt")
    return got["pixel_values_videos"].numpy().tobytes(), got["video_grid_thw"][0].tolist()


def test_videos_reach_their_owners_and_equal_transformers() -> None:
    """Four containers, frames given decoded and an image, to three owner ranks in their
    own processes under a permuted assignment: each rank's ``pixel_values_videos`` (its
    videos in its local order) and ``pixel_values`` equal transformers'."""
    clips = [_clip(k) for k in range(len(CLIPS))]
    raw = np.stack([frame_pixels(i, 90, 70) for i in range(6)])
    image = np.stack([frame_pixels(3, 77, 51)])[0]
    items = [Item(data, consumers=(0,), modality="video", preprocess=QWEN3) for data in clips]
    items.append(Item(raw, consumers=(0,), modality="video", preprocess=QWEN3_ALL))
    items.append(Item(image, consumers=(0,), preprocess=spec_for("qwen3-vl")))
    want: list[tuple[bytes, list[int]]] = []
    for data in clips:
        want.append(_reference(*_decoded(data), {}))
    want.append(_reference(raw, 24.0, {"do_sample_frames": False}))
    image_pv, image_grid = oracle.qwen_reference(
        [image], oracle.QWEN_PARAMS["qwen3-vl"], family="qwen3-vl"
    )

    ranks = 3
    q = procs.CHILDREN.Queue()
    p = Producer(arena_size=1 << 24)
    kids = [
        procs.CHILDREN.Process(
            target=procs.materialize_videos, args=(r, ranks, p.endpoint, p.handover_path, q)
        )
        for r in range(ranks)
    ]
    try:
        for k in kids:
            k.start()
        p.wait_for_consumers(list(range(ranks)), 60)
        # every rank assigns owners from the envelopes' grids; the producer plans the same
        grids = [QWEN3(probe_video(data)).plan.grid.patches for data in clips]
        grids += [QWEN3_ALL((6, 70, 90)).plan.grid.patches]
        grids += [spec_for("qwen3-vl")(77, 51).plan.grid.patches]
        maps = assign_owners(grids, ranks)
        assert any(list(m.globals) != sorted(m.globals) for m in maps), "want a permutation"
        owners = [next(m.rank for m in maps if m.owns(GlobalIndex(i))) for i in range(len(items))]
        envs = p.publish("videos", [_owned(it, o) for it, o in zip(items, owners)])
        assert [e.kind for e in envs] == ["encoded"] * 4 + ["raw", "raw"]
        assert sum(e.tensor.nbytes for e in envs[:4]) == sum(map(len, clips))  # containers ship
        results = {}
        for _ in range(ranks):
            got = q.get(timeout=120)
            assert got[0] == "result", got
            results[got[1]] = got[2:]
    finally:
        for k in kids:
            k.join(30)
        p.close()
    for rank, (order, videos, video_grids, pixel_values, image_grids, shapes) in results.items():
        assert order == [g.value for g in maps[rank].globals]
        mine = [i for i in order if i < 5]
        if mine:
            assert videos == b"".join(want[i][0] for i in mine), rank
            assert video_grids == [want[i][1] for i in mine]
        else:
            assert videos is None
        if 5 in order:
            assert pixel_values == image_pv.numpy().tobytes()
            assert image_grids == image_grid.tolist()
        rows = {i: (int(np.prod(want[i][1])), 3 * 2 * 16 * 16) for i in mine}
        assert [shapes[order.index(i)] for i in mine] == [rows[i] for i in mine]


def _owned(item: Item, owner: int) -> Item:
    return dataclasses.replace(item, consumers=(owner,))


def test_the_producer_refuses_bad_video_items_before_allocating() -> None:
    """Bytes that are no container, a corrupt one, a missing or foreign spec, frames of the
    wrong type: each a typed error, nothing held, and the producer publishes the next."""
    good = _clip(0)
    other = QWEN3(probe_video(_clip(2)))
    raw = np.stack([frame_pixels(i, 40, 30) for i in range(4)])
    p = Producer(arena_size=16 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0], 10)
        bad: list[tuple[Item, type[MmwireError]]] = [
            (Item(b"\x00" * 64, (0,), modality="video", preprocess=QWEN3), InvalidRequest),
            (
                Item(good[: len(good) // 3], (0,), modality="video", preprocess=QWEN3),
                VideoDecodeError,
            ),
            (Item(good, (0,), modality="video"), InvalidRequest),
            (Item(good, (0,), modality="video", preprocess=other), InvalidRequest),
            (Item(good, (0,), modality="video", preprocess=QWEN3, decode=True), InvalidRequest),
            (
                Item(raw.astype(np.float32), (0,), modality="video", preprocess=QWEN3_ALL),
                InvalidRequest,
            ),
            (Item(raw[..., :2], (0,), modality="video", preprocess=QWEN3_ALL), InvalidRequest),
            (
                Item([raw[0], raw[1, :20]], (0,), modality="video", preprocess=QWEN3_ALL),
                InvalidRequest,
            ),
            (
                Item(
                    torch.from_numpy(raw).bfloat16(), (0,), modality="video", preprocess=QWEN3_ALL
                ),
                InvalidRequest,
            ),
            (Item(raw, (0,), modality="video", preprocess=other), InvalidRequest),
            (
                Item(raw, (0,), kind="encoded", modality="video", preprocess=QWEN3_ALL),
                InvalidRequest,
            ),
            # one frame: fewer than Qwen3-VL's temporal patch, which its processor refuses
            (Item(raw[:1], (0,), modality="video", preprocess=QWEN3), InvalidRequest),
        ]
        for item, error in bad:
            with pytest.raises(error):
                p.publish("bad", [item])
            assert p.statistics().arena.leases_total == 0
        # the spec as a callable, or the VideoSpec it gives for this container
        spec = QWEN3(probe_video(good))
        items = [Item(good, (0,), modality="video", preprocess=way) for way in (QWEN3, spec)]
        envs = p.publish("ok", items)
        assert envs[0].video == envs[1].video == spec
        with c.recv(10) as b:
            out = Materializer(0).materialize(b, IndexMap(0, [GlobalIndex(1), GlobalIndex(0)]))
        assert out.video_grid_thw is not None and out.pixel_values_videos is not None
        assert out.video_grid_thw.tolist() == [list(spec.plan.grid.thw)] * 2
        first, second = out.pixel_values_videos.chunk(2)
        assert torch.equal(first, second)
    finally:
        c.close()
        p.close()


class _Forged:
    """A received batch whose envelopes were replaced (as a hostile producer would send
    them), with the payloads as they arrived."""

    def __init__(self, batch: Any, envelopes: list[FeatureEnvelope]) -> None:
        self._batch = batch
        self.envelopes = GlobalTable(envelopes)

    def open(self, index: GlobalIndex) -> np.ndarray:  # type: ignore[type-arg]
        return self._batch.open(index)

    def open_tensor(self, index: GlobalIndex) -> torch.Tensor:
        return self._batch.open_tensor(index)


def test_the_owner_refuses_forged_video_envelopes_and_keeps_serving() -> None:
    """An envelope that lies about its container, a plan its config does not give, frames
    over the owner's ceilings, and a container cut short: each a typed error before (or
    instead of) decoding, and the honest batch materialises after every one."""
    data, other = _clip(0), _clip(3)
    p, c = _publish([Item(data, (0,), modality="video", preprocess=QWEN3)])
    try:
        with c.recv(10) as b:
            [env] = [b.envelopes[g] for g in b.envelopes.indices()]
            spec = env.video
            assert spec is not None and spec.header is not None
            one = IndexMap(0, [GlobalIndex(0)])
            honest = Materializer(0).materialize(b, one).pixel_values_videos
            assert honest is not None

            def refused(forged: FeatureEnvelope, error: type[Exception], **kw: Any) -> None:
                with pytest.raises(error):
                    Materializer(0, **kw).materialize(_Forged(b, [forged]), one)
                again = Materializer(0).materialize(b, one).pixel_values_videos
                assert again is not None and torch.equal(again, honest)

            # another container's header: the bytes' own header disagrees
            liar = QWEN3(probe_video(other))
            refused(msgspec.structs.replace(env, video=liar, grid=liar.plan.grid), GridMismatch)
            # a plan sampling every frame, consistent in itself, not its config's
            every = QWEN3_ALL(spec.header)
            forged = msgspec.structs.replace(spec, plan=every.plan)
            refused(msgspec.structs.replace(env, video=forged, grid=every.plan.grid), GridMismatch)
            # the frames over the owner's ceilings, checked before anything is decoded
            refused(env, MaterializeError, max_pixels=160 * 90)
            refused(env, MaterializeError, max_decoded_bytes=spec.plan.decoded_bytes - 1)
            refused(env, MaterializeError, max_output_bytes=1000)
    finally:
        c.close()
        p.close()
    # an index (moov first) that claims every frame over media data cut short: the
    # producer reads a valid header, the owner's decode refuses the missing frames
    cut = make_clip(64, 48, 60, container_options={"movflags": "faststart"})
    cut = cut[: len(cut) * 2 // 3]
    pc, cc = _publish([Item(cut, (0,), modality="video", preprocess=QWEN3_ALL)])
    try:
        with cc.recv(10) as b, pytest.raises(VideoDecodeError, match="item 0"):
            Materializer(0).materialize(b, IndexMap(0, [GlobalIndex(0)]))
    finally:
        cc.close()
        pc.close()


def test_video_envelopes_round_trip_and_hostile_fields_are_refused() -> None:
    """A video envelope survives the wire; a decoded one whose plan or tensor contradicts
    its spec is a typed envelope error, never anything else."""
    data = _clip(1)
    p, c = _publish([Item(data, (0,), modality="video", preprocess=QWEN3)])
    try:
        with c.recv(10) as b:
            [env] = [b.envelopes[g] for g in b.envelopes.indices()]
    finally:
        c.close()
        p.close()
    decode = BatchDecoder()
    [back] = decode.decode(encode_batch([env])).envelopes.values()
    assert back == env and back.video is not None
    spec = env.video
    assert spec is not None
    plan = msgspec.to_builtins(spec.plan)

    def with_plan(**change: Any) -> dict[str, Any]:
        return {"video": {**msgspec.to_builtins(spec), "plan": {**plan, **change}}}

    hostile = [
        with_plan(indices=plan["indices"][::-1]),
        with_plan(indices=[]),
        with_plan(tokens=plan["tokens"] + 1),
        with_plan(timestamps=None),
        with_plan(new_width=plan["new_width"] + 1),
        with_plan(grid=[[1, 1, 1]]),
        with_plan(width=plan["width"] + 2),  # not the header's size
        with_plan(indices=[*plan["indices"][:-1], 10_000]),  # past the header's frames
        {"video": {**msgspec.to_builtins(spec), "header": None}},
        {"video": None},
        {"preprocess": msgspec.to_builtins(spec_for("qwen3-vl")(64, 64))},
        {"modality": "image"},
        {"kind": "raw"},
    ]
    raw = msgspec.msgpack.decode(encode_batch([env])[0])
    for change in hostile:
        forged = dict(raw["envelopes"][0])
        forged.update(change)
        frame = msgspec.msgpack.encode({**raw, "envelopes": [forged]})
        with pytest.raises(MmwireError):
            decode.decode([frame])
