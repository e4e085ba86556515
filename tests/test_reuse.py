"""Content digests, payloads referenced again instead of copied, and the owner's output
cache: real producers and consumers over real shared memory, outputs compared with ``==``."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from conftest import photo_path
from helpers import settle
from mmwire.materialize import FAMILIES, KimiConfig, Materializer, preprocess_images
from mmwire.transport import Consumer, GlobalIndex, Grid, IndexMap, Item, Producer
from mmwire.transport.errors import ConfigurationError, InvalidRequest
from mmwire.transport.wire import CpuRef, encode_batch
from PIL import Image

KIMI = KimiConfig(in_patch_limit=400)
QWEN = FAMILIES["qwen2.5-vl"]


def _jpeg(size: tuple[int, int], quality: int = 90) -> bytes:
    out = io.BytesIO()
    Image.open(photo_path("coffee.png")).convert("RGB").resize(size).save(
        out, "JPEG", quality=quality
    )
    return out.getvalue()


def _pixels(seed: int, h: int, w: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)


@contextlib.contextmanager
def _two_ranks() -> Iterator[tuple[Producer, Consumer, Consumer]]:
    """A producer with ranks 0 and 1 joined, all closed afterwards."""
    with Producer(arena_size=16 << 20) as p:
        r0 = Consumer(0, p.endpoint, handover=p.handover_path)
        r1 = Consumer(1, p.endpoint, handover=p.handover_path)
        try:
            p.wait_for_consumers([0, 1], 10)
            yield p, r0, r1
        finally:
            r0.close()
            r1.close()


def test_digests_name_the_content_whatever_form_carried_it() -> None:
    jpeg = _jpeg((120, 80))
    arr = _pixels(1, 37, 53)
    pil = Image.fromarray(arr)
    embedding = torch.arange(32, dtype=torch.float32).reshape(4, 8)

    def publish(p: Producer) -> list[str | None]:
        with Consumer(0, p.endpoint, handover=p.handover_path):
            p.wait_for_consumers([0], 10)
            envs = p.publish(
                "r",
                [
                    Item(jpeg, consumers=(0,), preprocess=KIMI),
                    Item(bytearray(jpeg), consumers=(0,), preprocess=KIMI),
                    Item(arr, consumers=(0,), preprocess=KIMI),
                    Item(pil, consumers=(0,), preprocess=KIMI),  # digested in the arena
                    Item(_pixels(2, 37, 53), consumers=(0,), preprocess=KIMI),
                    Item(jpeg, consumers=(0,), preprocess=KIMI, decode=True),
                    Item(embedding, consumers=(0,), kind="embedding", grid=Grid((1, 2, 2))),
                    Item(
                        embedding,
                        consumers=(0,),
                        kind="embedding",
                        grid=Grid((1, 2, 2)),
                        caller_key="mm:7",
                    ),
                ],
            )
            assert [e.caller_key for e in envs] == [None] * 7 + ["mm:7"]
            return [e.digest for e in envs]

    with Producer(arena_size=16 << 20) as p:
        d = publish(p)
    images = d[:6]
    assert all(x is not None and x.startswith("blake3:") and len(x) == 71 for x in images)
    assert d[0] == d[1]  # the same bytes, as bytes or bytearray
    assert d[2] == d[3]  # pixels as an array or as the PIL image holding them
    assert len({d[0], d[2], d[4], d[5]}) == 4  # other content, or shipped otherwise
    assert d[6] is None and d[7] is None  # tensors: only with digests="all"; never the caller's
    with Producer(arena_size=16 << 20, digests="all") as p:
        every = publish(p)
    assert every[:6] == images and every[6] is not None and every[6].startswith("blake3:")
    assert every[7] == every[6]  # the caller's key does not enter the digest
    with Producer(arena_size=16 << 20, digests="none") as p:
        assert publish(p) == [None] * 8
    with pytest.raises(ConfigurationError, match="`digests` must be"):
        Producer(arena_size=1 << 20, digests="yes")  # type: ignore[arg-type]


def test_a_callers_key_travels_beside_the_digest_and_never_selects_a_payload() -> None:
    """Another request's digest (or any key) given as ``caller_key`` with other bytes of the
    same length: each owner reads its own request's bytes."""
    a, b = _pixels(5, 40, 50), _pixels(6, 40, 50)
    with _two_ranks() as (p, r0, r1):
        first = p.publish("victim", [Item(a, consumers=(0,), preprocess=KIMI)])
        victims = first[0].digest
        assert victims is not None
        for key in (victims, "vllm:ab12"):
            got = p.publish(
                f"attacker-{key}", [Item(b, consumers=(1,), preprocess=KIMI, caller_key=key)]
            )
            assert got[0].caller_key == key and got[0].digest != victims
            assert got[0].payload != first[0].payload
        for rank, want in ((r0, [a]), (r1, [b, b])):  # every rank gets all three envelopes
            opened = []
            for _ in range(3):
                with rank.recv(10) as batch:
                    opened += [np.array(batch.open(g)) for g in batch.owned]
            assert len(opened) == len(want)
            assert all(np.array_equal(x, y) for x, y in zip(opened, want))
        assert p.statistics().arena.payloads_reused == 1  # b, by its own digest, the 2nd time
        with pytest.raises(InvalidRequest, match="`caller_key` must be"):
            p.publish("z", [Item(a, consumers=(0,), preprocess=KIMI, caller_key="")])


def test_a_repeated_payload_is_referenced_not_copied_and_lives_while_any_batch_names_it() -> None:
    a, b, c = _jpeg((301, 203)), _jpeg((160, 90)), _pixels(3, 40, 50)
    with _two_ranks() as (p, r0, r1):
        first = p.publish(
            "req-a",
            [
                Item(a, consumers=(0,), preprocess=KIMI),
                Item(b, consumers=(1,), preprocess=KIMI),
            ],
        )
        # a later turn resends image a, now owned by rank 1, beside a new image
        second = p.publish(
            "req-b",
            [
                Item(c, consumers=(0,), preprocess=KIMI),
                Item(a, consumers=(1,), preprocess=KIMI),
            ],
        )
        ref_a, again = first[0].payload, second[1].payload
        assert isinstance(ref_a, CpuRef) and isinstance(again, CpuRef)
        assert (again.lease, again.offset, again.generation) == (
            ref_a.lease,
            ref_a.offset,
            ref_a.generation,
        )
        st = p.statistics().arena
        assert st.payloads_reused == 1 and st.bytes_reused == len(a) and st.leases_total == 2
        a0, b0 = r0.recv(10), r0.recv(10)
        a1, b1 = r1.recv(10), r1.recv(10)
        assert bytes(a0.open(GlobalIndex(0))) == a
        a0.release()  # rank 0 is done with req-a's lease; rank 1 still names it twice
        a1.release()
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 2)
        assert bytes(b1.open(GlobalIndex(1))) == a  # still there, generation unchanged
        assert np.array_equal(b0.open(GlobalIndex(0)), c)
        b0.release()
        b1.release()
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        st = p.statistics().arena
        assert st.bytes_in_use == 0 and st.leases_retained == 2 and st.bytes_retained > 0
        assert p.statistics().releases_ignored == 0
        # a third turn: a resident payload whose lease no one holds any more
        third = p.publish("req-c", [Item(b, consumers=(0,), preprocess=KIMI)])
        assert third[0].payload == first[1].payload
        with r0.recv(10) as batch:
            assert bytes(batch.open(GlobalIndex(0))) == b


def test_a_member_that_ends_gives_back_only_its_own_references() -> None:
    a = _jpeg((200, 150))
    with _two_ranks() as (p, r0, r1):
        p.publish("x", [Item(a, consumers=(0, 1), preprocess=KIMI)])
        p.publish("y", [Item(a, consumers=(0, 1), preprocess=KIMI)])
        held = [r0.recv(10), r0.recv(10)]
        r1.recv(10)
        r1.recv(10)
        r1.close()  # ends with two references unreleased: both go back
        assert settle(p, lambda: p.statistics().members_ended == 1)
        assert p.statistics().arena.leases_outstanding == 1  # rank 0's two remain
        held[0].release()
        assert bytes(held[1].open(GlobalIndex(0))) == a
        held[1].release()
        assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)


def test_a_release_from_a_member_holding_nothing_cannot_free_a_payload_in_use() -> None:
    from mmwire.transport._control import ENCODER, Release

    a = _jpeg((200, 150))
    with _two_ranks() as (p, r0, r1):
        env = p.publish("x", [Item(a, consumers=(0,), preprocess=KIMI)])[0]
        ref = env.payload
        assert isinstance(ref, CpuRef)
        batch = r0.recv(10)
        for _ in range(3):  # rank 1 never received it, yet releases it
            r1._sock.send(ENCODER.encode(Release(lease=ref.lease, generation=ref.generation)))
        assert settle(p, lambda: p.statistics().releases_ignored == 3)
        assert p.statistics().arena.leases_outstanding == 1
        assert bytes(batch.open(GlobalIndex(0))) == a
        batch.release()


def test_resident_payloads_give_way_when_room_is_needed() -> None:
    imgs = [_pixels(10 + k, 700, 700) for k in range(8)]  # 1.4 MiB each, 4 MiB arena
    with Producer(arena_size=4 << 20, full_timeout=1) as p:
        c = Consumer(0, p.endpoint, handover=p.handover_path)
        try:
            p.wait_for_consumers([0], 10)
            for k, img in enumerate(imgs):
                p.publish(f"r{k}", [Item(img, consumers=(0,), preprocess=KIMI)])
                with c.recv(10) as batch:
                    assert np.array_equal(batch.open(GlobalIndex(0)), img)
                assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
            st = p.statistics().arena
            assert st.leases_retained == 2 and st.payloads_reused == 0
            p.publish("again", [Item(imgs[-1], consumers=(0,), preprocess=KIMI)])  # resident
            p.publish("first", [Item(imgs[0], consumers=(0,), preprocess=KIMI)])  # evicted
            st = p.statistics().arena
            assert st.payloads_reused == 1 and st.leases_total == 9
            for img in (imgs[-1], imgs[0]):
                with c.recv(10) as batch:
                    assert np.array_equal(batch.open(GlobalIndex(0)), img)
        finally:
            c.close()


def _batches(items_per_request: list[list[Item]], ranks: int = 1) -> tuple[Producer, Consumer]:
    p = Producer(arena_size=64 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    p.wait_for_consumers([0], 10)
    for k, items in enumerate(items_per_request):
        p.publish(f"r{k}", items)
    return p, c


@pytest.mark.parametrize("spec", [KIMI, QWEN], ids=["kimi", "qwen2.5-vl"])
def test_the_owner_cache_serves_a_repeated_image_bit_exact(spec: Any) -> None:
    a, b = _jpeg((301, 203)), _jpeg((203, 301))
    raw = _pixels(5, 61, 47)
    requests = [
        [Item(a, consumers=(0,), preprocess=spec), Item(raw, consumers=(0,), preprocess=spec)],
        [Item(raw, consumers=(0,), preprocess=spec), Item(b, consumers=(0,), preprocess=spec)],
        [Item(b, consumers=(0,), preprocess=spec), Item(a, consumers=(0,), preprocess=spec)],
    ]
    decoded = {
        id(a): np.asarray(Image.open(io.BytesIO(a)).convert("RGB")),
        id(b): np.asarray(Image.open(io.BytesIO(b)).convert("RGB")),
        id(raw): raw,
    }
    p, c = _batches(requests)
    cached = Materializer(0, cache_bytes=64 << 20)
    try:
        for items in requests:
            with c.recv(10) as batch:
                order = list(batch.envelopes.indices())[::-1]  # local order permuted
                out = cached.materialize(batch, IndexMap(0, order))
                pixel_values, grid_thw = preprocess_images(
                    [decoded[id(items[g.value].data)] for g in order], spec
                )
                assert torch.equal(out.pixel_values, pixel_values)
                assert torch.equal(out.grid_thw, grid_thw)
        st = cached.cache_statistics()
        assert st is not None and st.misses == 3 and st.hits == 3 and st.entries == 3
        assert Materializer(0).cache_statistics() is None
    finally:
        c.close()
        p.close()


def test_the_owner_cache_keys_by_the_bytes_received_not_the_envelopes_digest() -> None:
    a, b = _pixels(7, 40, 50), _pixels(8, 40, 50)  # same size and spec, other pixels
    p, c = _batches([[Item(a, consumers=(0,), preprocess=KIMI)]])
    mat = Materializer(0, cache_bytes=64 << 20)
    try:
        with c.recv(10) as batch:
            env = batch.envelopes[GlobalIndex(0)]
            mat.materialize(batch, IndexMap(0, [GlobalIndex(0)]))
            # a producer that stamps a's digest on b: the owner does not believe it
            p.publish("liar", [Item(b, consumers=(0,), preprocess=KIMI)])
        with c.recv(10) as batch:
            forged = msgspec.structs.replace(batch.envelopes[GlobalIndex(0)], digest=env.digest)
            assert forged.digest != batch.envelopes[GlobalIndex(0)].digest
            with c.decode(encode_batch([forged])) as lying:
                out = mat.materialize(lying, IndexMap(0, [GlobalIndex(0)]))
            assert torch.equal(out.pixel_values, preprocess_images([b], KIMI)[0])
        st = mat.cache_statistics()
        assert st is not None and st.hits == 0 and st.misses == 2
    finally:
        c.close()
        p.close()


def test_the_owner_cache_stays_within_its_budget() -> None:
    imgs = [_pixels(20 + k, 56, 56) for k in range(4)]  # 16 patches of 3x14x14 fp32 each
    per_item = 16 * 3 * 14 * 14 * 4
    p, c = _batches([[Item(img, consumers=(0,), preprocess=KIMI)] for img in imgs + imgs[:1]])
    mat = Materializer(0, cache_bytes=2 * per_item)
    try:
        for img in imgs + imgs[:1]:
            with c.recv(10) as batch:
                out = mat.materialize(batch, IndexMap(0, [GlobalIndex(0)]))
                assert torch.equal(out.pixel_values, preprocess_images([img], KIMI)[0])
        st = mat.cache_statistics()
        assert st is not None
        assert st.bytes == 2 * per_item and st.entries == 2 and st.evictions == 3
        assert st.hits == 0  # the first image had been evicted by the time it came back
    finally:
        c.close()
        p.close()
