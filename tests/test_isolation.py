"""Isolation between requests: nothing one request sends selects, reads or changes another
request's bytes. Real producers and consumers over real shared memory; the colliding pairs
are built here (``collide.py``) as a client would build them."""

from __future__ import annotations

import io
from typing import Any

import bombs
import msgspec
import numpy as np
import procs
import pytest
import xxhash
from collide import xxh3_twins
from helpers import settle
from mmwire.materialize import KimiConfig, Materializer, preprocess_images
from mmwire.transport import Consumer, GlobalIndex, IndexMap, Item, Producer
from mmwire.transport.errors import ImageDecodeError, MaterializeError, MmwireError
from mmwire.transport.images import to_pixels
from PIL import Image
from procs import CHILDREN

KIMI = KimiConfig(in_patch_limit=400)


def _twin_pixels(shape: tuple[int, int, int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Two different pixel arrays whose XXH3-128 over a digest header and the pixels (the
    content key mmwire used to take) is one."""
    header = msgspec.msgpack.encode(("raw", "uint8", shape, "keep"))
    body = np.random.default_rng(3).integers(0, 256, shape, np.uint8).tobytes()
    a, b = xxh3_twins(header + body, len(header))
    twins = [np.frombuffer(m[len(header) :], np.uint8).reshape(shape) for m in (a, b)]
    keys = []
    for t in twins:
        h = xxhash.xxh3_128(header)
        h.update(t.tobytes())
        keys.append(h.hexdigest())
    assert keys[0] == keys[1] and not np.array_equal(*twins)  # the pair really collides
    return twins[0], twins[1]


def _twin_bmps(width: int, height: int) -> tuple[bytes, bytes]:
    """Two BMP files a client could send, with other pixels and one XXH3-128 of their bytes."""
    pixels = np.random.default_rng(4).integers(0, 256, (height, width, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "BMP")
    a, b = xxh3_twins(out.getvalue(), 54)  # past the file and info headers
    assert xxhash.xxh3_128_digest(a) == xxhash.xxh3_128_digest(b)
    decoded = [np.asarray(Image.open(io.BytesIO(m)).convert("RGB")) for m in (a, b)]
    assert not np.array_equal(*decoded)  # the images themselves differ
    return a, b


def test_xxh3_twins_are_not_reused_for_each_other() -> None:
    a, b = _twin_pixels((40, 52, 3))
    with Producer(arena_size=16 << 20) as p:
        r0 = Consumer(0, p.endpoint, handover=p.handover_path)
        r1 = Consumer(1, p.endpoint, handover=p.handover_path)
        try:
            p.wait_for_consumers([0, 1], 10)
            first = p.publish("victim", [Item(a, consumers=(0,), preprocess=KIMI)])
            second = p.publish("attacker", [Item(b, consumers=(1,), preprocess=KIMI)])
            assert first[0].digest != second[0].digest
            assert first[0].payload != second[0].payload
            assert p.statistics().arena.payloads_reused == 0
            for rank, want in ((r0, a), (r1, b)):  # every rank gets both envelopes
                got = []
                for _ in range(2):
                    with rank.recv(10) as batch:
                        got += [np.array(batch.open(g)) for g in batch.owned]
                assert len(got) == 1 and np.array_equal(got[0], want)
            assert settle(p, lambda: p.statistics().arena.leases_outstanding == 0)
        finally:
            r0.close()
            r1.close()


def test_xxh3_twin_images_each_get_their_own_features_from_the_owner_cache() -> None:
    a, b = _twin_bmps(52, 40)
    with Producer(arena_size=16 << 20, reuse=False) as p:
        c = Consumer(0, p.endpoint, handover=p.handover_path)
        mat = Materializer(0, cache_bytes=64 << 20)
        try:
            p.wait_for_consumers([0], 10)
            for k, data in enumerate((a, b, a)):
                env = p.publish(f"r{k}", [Item(data, consumers=(0,), preprocess=KIMI)])[0]
                assert env.kind == "encoded"
                with c.recv(10) as batch:
                    out = mat.materialize(batch, IndexMap(0, [GlobalIndex(0)]))
                want = preprocess_images([np.asarray(Image.open(io.BytesIO(data)))], KIMI)[0]
                assert np.array_equal(out.pixel_values.numpy(), want.numpy()), k
            st = mat.cache_statistics()
            assert st is not None and st.misses == 2 and st.hits == 1  # a again, not b
        finally:
            c.close()


def test_the_bomb_corpus_is_refused_before_allocation_or_decodes_within_bounds() -> None:
    """Each file of the corpus is refused by publish without anything allocated, or ships and
    decodes at the owner in < 2 s and < 512 MiB; the owner refuses what publish refused."""
    corpus = bombs.corpus()
    q = CHILDREN.Queue()
    owner = CHILDREN.Process(target=procs.decode_costs, args=(corpus, q))
    owner.start()
    with Producer(arena_size=64 << 20) as p, Consumer(0, p.endpoint, handover=p.handover_path):
        p.wait_for_consumers([0], 10)
        refused = {}
        for name, data in corpus.items():
            held = p.statistics().arena.bytes_in_use
            try:
                p.publish(name, [Item(data, consumers=(0,), preprocess=KIMI)])
                refused[name] = False
            except MmwireError:
                refused[name] = True
                assert p.statistics().arena.bytes_in_use == held, name
        # two huge-canvas WebPs in one 280-byte request: refused whole, nothing allocated
        webp = bombs.animated_webp()
        with pytest.raises(MaterializeError, match="pixel ceiling"):
            p.publish("two", [Item(webp, consumers=(0,), preprocess=KIMI)] * 2)
        assert p.statistics().arena.leases_total == 1  # only the bomb under the ceiling
    report, grown = q.get(timeout=120)
    owner.join(30)
    assert grown < 512, report
    for name, (outcome, seconds) in report.items():
        assert not outcome.startswith("untyped"), (name, outcome)
        assert refused[name] == (not outcome.startswith("decoded")), (name, outcome)
        assert seconds < 2, (name, outcome, seconds)


def test_an_animated_image_decodes_its_first_frame_only() -> None:
    frames = [Image.fromarray(np.full((8, 10, 3), v, np.uint8)) for v in (10, 200, 90)]
    for fmt, options in (("GIF", {}), ("WEBP", {"lossless": True}), ("PNG", {})):
        out = io.BytesIO()
        frames[0].save(out, fmt, save_all=True, append_images=frames[1:], **options)
        pixels = to_pixels(out.getvalue())
        assert pixels.shape == (8, 10, 3) and int(pixels.max()) == int(pixels.min()) == 10, fmt


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "BMP"])
def test_a_truncated_body_is_a_typed_error_never_padded(fmt: str) -> None:
    pixels = np.random.default_rng(9).integers(0, 256, (120, 160, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    cut = out.getvalue()[: len(out.getvalue()) * 3 // 4]
    with pytest.raises(ImageDecodeError):
        to_pixels(cut)
