"""XXH3 collisions built on purpose: what a client could send to make a non-cryptographic
content key name two different images.

On inputs over 240 bytes XXH3 accumulates each 64-byte stripe lane by lane,
``acc[i ^ 1] += lane`` and ``acc[i] += lo32(lane ^ key) * hi32(lane ^ key)``, with the public
default secret as the key, and scrambles the accumulators only at the end of each 1024-byte
block. A lane whose low 32 bits equal the key's adds only itself; two such lanes of the same
index in one block add only their sum, so moving ``d`` from one lane's high half to the
other's keeps every accumulator, and the hash, whatever the seedless variant (64 or 128 bit).
"""

from __future__ import annotations

import struct

# XXH3's default secret (``XXH3_kSecret``): only the first 128 bytes key the first block.
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
)


def xxh3_twins(message: bytes, start: int) -> tuple[bytes, bytes]:
    """Two messages that differ from each other (and, at 16 bytes, from ``message``) yet
    have one XXH3 hash. ``start``: the first byte of ``message`` that may change; lanes are
    picked in its first 1024 bytes, past ``start``, and the message must be long enough that
    they are not in its last 64 bytes."""
    stripe = -(-start // 64)
    lanes = (stripe * 64, (stripe + 1) * 64)  # lane 0 of two consecutive stripes
    if lanes[1] + 8 > 1024 or len(message) < 1024 + 64:
        raise ValueError("the message is too short, or `start` too late, for a twin")
    a, b = bytearray(message), bytearray(message)
    delta = 0x1234567
    for n, (at, sign) in enumerate(zip(lanes, (1, -1))):
        key_lo = struct.unpack_from("<I", _SECRET, 8 * (stripe + n))[0]
        hi = struct.unpack_from("<I", message, at + 4)[0]
        struct.pack_into("<II", a, at, key_lo, hi)
        struct.pack_into("<II", b, at, key_lo, (hi + sign * delta) % (1 << 32))
    return bytes(a), bytes(b)
