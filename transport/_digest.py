"""Content digests of payloads: what the arena reuses, owners cache by, and engines' prefix
caches tell images apart with.

A digest is ``"xxh3-128:"`` and 32 hex digits: XXH3's 128-bit hash (the ``xxhash``
library) of a short header -- the payload's kind, dtype, shape and, for images, how alpha
is treated -- followed by its bytes as shipped: an encoded image's compressed bytes, raw
pixels, a processed or embedding tensor's elements. Two payloads with the same digest
make the same model inputs under the same spec; the spec itself is not part of it.
XXH3 is not a cryptographic hash: an owner that caches by digest recomputes it from the
bytes it received rather than trusting the envelope's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import xxhash

__all__ = ["DIGEST_PREFIX", "digest_of"]

DIGEST_PREFIX = "xxh3-128:"


def digest_of(kind: str, dtype: str, shape: tuple[int, ...], alpha: str, data: Any) -> str:
    """The digest of a payload: ``data`` is its bytes (any buffer; C-contiguous)."""
    h = xxhash.xxh3_128(msgspec.msgpack.encode((kind, dtype, shape, alpha)))
    h.update(memoryview(data).cast("B"))
    return DIGEST_PREFIX + h.hexdigest()
