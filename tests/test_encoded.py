"""Encoded items: the client's bytes travel as they are and the owner decodes them.

The owner runs the same Pillow the producer would have, so every format and mode must give
the same ``pixel_values`` as shipping the decoded pixels (``Item(decode=True)``), with
``==``; what the owner cannot trust (a header that disagrees with its envelope, a body cut
short) is a typed error that leaves the materializer serving.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import photo_path
from hypothesis import given, settings
from hypothesis import strategies as st
from mmwire.materialize import FAMILIES, K3_BACKGROUND, KimiConfig, Materializer, preprocess_images
from mmwire.transport import Consumer, EncodedImage, IndexMap, Item, Producer
from mmwire.transport._pixels import _check_jpeg_body
from mmwire.transport.errors import (
    ConfigurationError,
    GridMismatch,
    ImageDecodeError,
    InvalidRequest,
    MaterializeError,
    MmwireError,
)
from mmwire.transport.images import ENCODED_FORMATS, encoded_image, to_pixels
from mmwire.transport.wire import InlineRef
from PIL import Image

K3 = KimiConfig(in_patch_limit=400, background=K3_BACKGROUND)
QWEN = FAMILIES["qwen2.5-vl"]


def _photo(size: tuple[int, int]) -> Image.Image:
    return Image.open(photo_path("coffee.png")).convert("RGB").resize(size)


def _save(image: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _rgba(size: tuple[int, int]) -> Image.Image:
    im = _photo(size).convert("RGBA")
    alpha = np.asarray(im).copy()
    alpha[::3, :, 3] = 0
    alpha[1::3, :, 3] = 128
    return Image.fromarray(alpha, "RGBA")


def _palette_transparent(size: tuple[int, int]) -> Image.Image:
    im = _photo(size).quantize(32)
    im.info["transparency"] = 5
    return im


# every format and mode an encoded item may carry; distinct, odd sizes
SAMPLES: dict[str, Callable[[], bytes]] = {
    "jpeg-420": lambda: _save(_photo((301, 203)), "JPEG", quality=90),
    "jpeg-444": lambda: _save(_photo((203, 301)), "JPEG", quality=90, subsampling=0),
    "jpeg-progressive": lambda: _save(_photo((257, 129)), "JPEG", progressive=True),
    "jpeg-gray": lambda: _save(_photo((151, 99)).convert("L"), "JPEG"),
    "jpeg-cmyk": lambda: _save(_photo((97, 143)).convert("CMYK"), "JPEG"),
    "png-rgb": lambda: _save(_photo((123, 77)), "PNG"),
    "png-rgba": lambda: _save(_rgba((111, 91)), "PNG"),
    "png-palette-transparent": lambda: _save(_palette_transparent((89, 67)), "PNG"),
    "png-la": lambda: _save(_rgba((71, 53)).convert("LA"), "PNG"),
    "webp-lossy": lambda: _save(_photo((199, 131)), "WEBP", quality=80),
    "webp-rgba-lossless": lambda: _save(_rgba((93, 61)), "WEBP", lossless=True),
    "gif": lambda: _save(_photo((81, 57)).quantize(64), "GIF"),
    "bmp": lambda: _save(_photo((63, 45)), "BMP"),
}


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG declaring ``width x height`` RGB whose image data is empty."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def _publish(items: list[Item]) -> tuple[Producer, Consumer]:
    p = Producer(arena_size=16 << 20)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    p.wait_for_consumers([0], 10)
    p.publish("r", items)
    return p, c


def _materialize(items: list[Item], **kw: Any) -> tuple[torch.Tensor, list[str], int]:
    """Publish to one rank and materialise: pixel_values, each envelope's kind, bytes."""
    p, c = _publish(items)
    try:
        with c.recv(10) as b:
            envs = [b.envelopes[g] for g in b.envelopes.indices()]
            m = IndexMap(0, list(b.envelopes.indices()))  # local order = global order
            out = Materializer(0, **kw).materialize(b, m)
            return out.pixel_values, [e.kind for e in envs], sum(e.tensor.nbytes for e in envs)
    finally:
        c.close()
        p.close()


@pytest.mark.parametrize("spec", [K3, QWEN], ids=["kimi-k3", "qwen2.5-vl"])
def test_every_format_decodes_at_the_owner_as_at_the_producer(spec: Any) -> None:
    data = [make() for make in SAMPLES.values()]
    encoded, kinds, shipped = _materialize(
        [Item(data=d, consumers=(0,), preprocess=spec) for d in data]
    )
    assert kinds == ["encoded"] * len(data)
    raw, raw_kinds, raw_shipped = _materialize(
        [Item(data=d, consumers=(0,), preprocess=spec, decode=True) for d in data]
    )
    assert raw_kinds == ["raw"] * len(data)
    assert torch.equal(encoded, raw)  # the same Pillow on either side
    want, _ = preprocess_images(data, spec)
    assert torch.equal(encoded, want)
    assert shipped == sum(map(len, data)) and shipped < raw_shipped


def test_an_encoded_image_reads_its_geometry_from_the_header_alone() -> None:
    for name, make in SAMPLES.items():
        data = make()
        with Image.open(io.BytesIO(data)) as im:
            assert im.format in ENCODED_FORMATS, name
        header = encoded_image(data, alpha="keep")
        pixels = to_pixels(data)
        assert header is not None, name
        assert (header.height, header.width, header.channels) == pixels.shape, name
        white = encoded_image(data, alpha="white")
        assert white is not None and white.channels == to_pixels(data, alpha="white").shape[2]
    tiff = _save(_photo((40, 30)), "TIFF")
    assert encoded_image(tiff) is None  # not shipped encoded: the producer decodes it


def test_a_tiff_is_decoded_on_the_producer() -> None:
    data = _save(_photo((60, 44)), "TIFF")
    got, kinds, _ = _materialize([Item(data=data, consumers=(0,), preprocess=K3)])
    assert kinds == ["raw"]
    assert torch.equal(got, preprocess_images([data], K3)[0])


def test_exif_orientation_is_not_applied_on_any_path() -> None:
    # the reference processors do not transpose: the stored 90x40 stays 90x40
    from PIL import ExifTags

    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # "rotate 90 CW to view"
    data = _save(_photo((90, 40)), "JPEG", exif=exif)
    header = encoded_image(data)
    assert header is not None and (header.width, header.height) == (90, 40)
    got, _, _ = _materialize([Item(data=data, consumers=(0,), preprocess=QWEN)])
    assert torch.equal(got, preprocess_images([Image.open(io.BytesIO(data))], QWEN)[0])


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (b"\x00" * 64, ImageDecodeError, "do not decode"),
        (_png_header_only(30, 20)[:20], ImageDecodeError, "do not decode"),
        (_png_header_only(50_000, 50_000), MaterializeError, "pixel ceiling"),
    ],
    ids=["unknown-format", "truncated-header", "decompression-bomb"],
)
def test_the_producer_refuses_what_no_owner_could_decode_before_allocating(
    data: bytes, error: type[MmwireError], match: str
) -> None:
    p = Producer(arena_size=1 << 22)
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    try:
        p.wait_for_consumers([0], 10)
        before = p.statistics().arena
        with pytest.raises(error, match=match):
            p.publish("bad", [Item(data=data, consumers=(0,), preprocess=K3)])
        assert p.statistics().arena == before
        with pytest.raises(InvalidRequest, match="encoded bytes"):
            p.publish("bad", [Item(data=_photo((8, 8)), consumers=(0,), kind="encoded")])
    finally:
        c.close()
        p.close()


def test_the_owner_refuses_bytes_that_disagree_with_their_envelope_and_keeps_serving() -> None:
    import msgspec
    from test_materialize import _Frames

    good = SAMPLES["jpeg-420"]()
    p, c = _publish([Item(data=good, consumers=(0,), preprocess=K3)])
    try:
        with c.recv(10) as b:
            env = b.envelopes[next(iter(b.envelopes.indices()))]
            payload = bytes(b.open(env.index))
    finally:
        c.close()
        p.close()
    assert env.kind == "encoded" and env.encoding == EncodedImage(
        format="JPEG", width=301, height=203, channels=3
    )
    m = IndexMap(0, [env.index])
    mat = Materializer(0)
    # another image's bytes under this envelope: the header disagrees
    other = _save(_photo((301, 203)).convert("L"), "JPEG")

    def carrying(data: bytes) -> Any:  # the envelope over other bytes, inline
        tensor = msgspec.structs.replace(env.tensor, shape=(len(data),), nbytes=len(data))
        return msgspec.structs.replace(env, tensor=tensor, payload=InlineRef(frame=0))

    forged = carrying(other)
    with pytest.raises(GridMismatch, match="declared a 301x203 JPEG of 3 channels"):
        mat.materialize(_Frames([forged], [other]), m)
    # the body cut short: the header reads, the pixels do not
    cut = payload[: len(payload) // 2]
    with pytest.raises(ImageDecodeError, match=r"do not decode|truncated"):
        mat.materialize(_Frames([carrying(cut)], [cut]), m)
    out = mat.materialize(
        _Frames([carrying(payload)], [payload]), m
    )  # and the next batch is served
    assert torch.equal(out.pixel_values, preprocess_images([good], K3)[0])


def test_a_request_of_several_images_decodes_into_the_arena_in_parallel(
    rng: np.random.Generator,
) -> None:
    # raw items the producer decodes (PIL images of several modes, a large one in several
    # of Pillow's blocks, arrays) land in the arena as to_pixels gives them
    images: list[Any] = [
        _photo((2900, 1700)),  # 19.7 MB as RGBX: more than one Pillow block
        _rgba((333, 211)),
        _photo((120, 80)).convert("L"),
        rng.integers(0, 256, (45, 61, 3), dtype=np.uint8),
        Image.open(io.BytesIO(SAMPLES["png-palette-transparent"]())),
    ]
    p, c = _publish([Item(data=im, consumers=(0,), preprocess=K3) for im in images])
    try:
        with c.recv(10) as b:
            for g, im in zip(b.envelopes.indices(), images):
                assert np.array_equal(b.open(g), to_pixels(im))
    finally:
        c.close()
        p.close()


def test_bytearray_and_memoryview_payloads_ship_encoded_too() -> None:
    data = SAMPLES["png-rgb"]()
    padded = bytearray(b"\0" + data)
    items = [
        Item(data=bytearray(data), consumers=(0,), preprocess=K3),
        Item(data=memoryview(padded)[1:], consumers=(0,), preprocess=K3),
    ]
    got, kinds, shipped = _materialize(items)
    assert kinds == ["encoded", "encoded"] and shipped == 2 * len(data)
    assert torch.equal(got, preprocess_images([data, data], K3)[0])


def test_the_deferral_gate_counts_encoded_bytes_as_shipped() -> None:
    from mmwire.materialize import should_defer

    # a 4000x3000 photo under a tiny patch limit: its pixels (36 MB) are more than its
    # processed patches, its JPEG (about 1 MB) is not
    tiny = KimiConfig(in_patch_limit=1024)  # about 2.4 MB of fp32 patches
    photo = _photo((4000, 3000))
    jpeg = _save(photo, "JPEG", quality=90)
    gate = {"transport": "cpu", "consumer_has_gpu": True, "preprocess": tiny}
    assert should_defer([jpeg], **gate)
    assert not should_defer([photo], **gate)
    assert not should_defer([np.asarray(photo).transpose(2, 0, 1).copy()], **gate)
    assert not should_defer([b"not an image"], **gate)


def test_the_owner_checks_headers_and_the_decoded_total_before_allocating() -> None:
    import msgspec
    from helpers import encoded_envelope
    from test_materialize import _Frames

    png = SAMPLES["png-rgb"]()  # 123x77
    honest = encoded_envelope(0, png, frame=0, spec=K3(123, 77))
    # an envelope that claims 13,000 x 13,000 (0.68 GB of pixels) for the same small bytes:
    # refused from the header, before any buffer for the claim exists
    spec = K3(13_000, 13_000)
    liar = msgspec.structs.replace(
        honest,
        grid=spec.plan.grid,
        preprocess=spec,
        encoding=EncodedImage(format="PNG", width=13_000, height=13_000, channels=3),
    )
    m = IndexMap(0, [liar.index])
    with pytest.raises(MaterializeError, match="pixel ceiling"):  # over the default 40 MP
        Materializer(0).materialize(_Frames([liar], [png]), m)
    with pytest.raises(GridMismatch, match="declared a 13000x13000 PNG"):  # under a larger one
        Materializer(0, max_pixels=200_000_000).materialize(_Frames([liar], [png]), m)
    # honest headers past the batch's decode ceiling: refused, then served under a larger one
    with pytest.raises(MaterializeError, match="max_decoded_bytes"):
        Materializer(0, max_decoded_bytes=1000).materialize(_Frames([honest], [png]), m)
    out = Materializer(0).materialize(_Frames([honest], [png]), m)
    assert torch.equal(out.pixel_values, preprocess_images([png], K3)[0])


@pytest.mark.parametrize("name", list(SAMPLES))
def test_decoding_into_the_arena_equals_pillows_own_conversion(name: str) -> None:
    # the in-place path (one block, read through Pillow's Arrow export) against plain
    # Image.open + convert + np.asarray, for each format and both alpha rules
    data = SAMPLES[name]()
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if "A" in im.getbands() or "transparency" in im.info:
            rgba = np.asarray(im.convert("RGBA")).astype(np.float64)
            a = rgba[..., 3:4] / 255
            white = np.round(a * rgba[..., :3] + (1 - a) * 255).astype(np.uint8)
        else:
            white = np.asarray(im if im.mode == "L" else im.convert("RGB"))
        keep_mode = (
            "RGBA"
            if im.mode != "RGB" and ("A" in im.getbands() or "transparency" in im.info)
            else "L"
            if im.mode == "L"
            else "RGB"
        )
        keep = np.asarray(im if im.mode == keep_mode else im.convert(keep_mode))
    for alpha, want in (("keep", keep), ("white", white)):
        got = to_pixels(data, alpha=alpha)
        assert np.array_equal(got, want.reshape(got.shape)), (name, alpha)


def test_gpu_decode_is_refused_without_cuda_compute() -> None:
    with pytest.raises(ConfigurationError, match='compute="cuda"'):
        Materializer(0, gpu_decode=True)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("spec", [K3, QWEN], ids=["kimi-k3", "qwen2.5-vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cuda_owner_decodes_every_format_as_the_cpu_owner(
    spec: Any, dtype: torch.dtype
) -> None:
    data = [make() for make in SAMPLES.values()]
    items = [Item(data=d, consumers=(0,), preprocess=spec) for d in data]
    on_cpu, _, _ = _materialize(items, dtype=dtype)
    on_gpu, _, _ = _materialize(items, device="cuda", dtype=dtype)  # pinned decode + kernels
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_is_approximate_and_only_takes_rgb_and_gray_jpegs() -> None:
    pytest.importorskip("torchvision")
    data = [make() for make in SAMPLES.values()]
    items = [Item(data=d, consumers=(0,), preprocess=K3) for d in data]
    exact, _, _ = _materialize(items, device="cuda")
    approx, _, _ = _materialize(items, device="cuda", gpu_decode=True)
    _, grids = preprocess_images(data, K3)
    rows = [int(n) for n in grids.prod(dim=1).tolist()]
    at = 0
    for name, n in zip(SAMPLES, rows):
        want, got = exact[at : at + n], approx[at : at + n]
        at += n
        if name in ("jpeg-420", "jpeg-444", "jpeg-progressive", "jpeg-gray"):
            # nvJPEG's pixels are a few levels off Pillow's: close, not equal (one level
            # is 1/255/std, about 0.017 after normalising)
            assert (got - want).abs().mean() < 0.05, name
        else:  # CMYK JPEGs and every other format stay with Pillow: exact
            assert torch.equal(got, want), name
    assert not torch.equal(exact, approx)  # the GPU decoded something


def _byte_search_verdict(raw: bytes) -> str | None:
    """The JPEG body rule stated with byte searches (slow, plain): too many scans, or no end
    of image at or after the last start of scan."""
    if raw.count(b"\xff\xda") > 100:
        return "scans"
    if raw.find(b"\xff\xd9", max(raw.rfind(b"\xff\xda"), 0)) < 0:
        return "truncated"
    return None


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=6),
            st.sampled_from([b"\xff", b"\xff\xda", b"\xff\xd9", b"\xff\xff", b"\xda", b"\xd9"]),
        ),
        max_size=60,
    ),
    st.integers(0, 120),
)
def test_the_jpeg_body_check_finds_the_markers_the_byte_search_finds(
    parts: list[bytes], extra_scans: int
) -> None:
    raw = b"".join(parts) + b"\xff\xda" * (extra_scans if extra_scans > 95 else 0)
    want = _byte_search_verdict(raw)
    try:
        _check_jpeg_body(raw)
        got = None
    except ImageDecodeError as e:
        got = "scans" if "scans" in str(e) else "truncated"
    assert got == want, raw
