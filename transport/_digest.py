"""Content digests of payloads: what the arena reuses, pulled bytes are checked against, and
engines' prefix caches tell images apart with.

A digest is ``"blake3:"`` and 64 hex digits: BLAKE3 (the ``blake3`` library) of a short
header -- the payload's kind, dtype, shape and, for images, how alpha is treated -- followed
by its bytes exactly as shipped: an encoded image's compressed bytes, raw pixels as written
into the arena, a processed or embedding tensor's elements. Two payloads with the same digest
make the same model inputs under the same spec; the spec itself is not part of it.

The hash is cryptographic because clients choose the bytes: with a fast non-cryptographic
hash (XXH3 and its public secret) a client can build two images with one digest in well
under a second, and a cache or arena keyed by it would serve one request another's image.
On this project's 2-core reference machine BLAKE3 hashes 1.4 GiB/s on one thread (SHA-256:
1.1), so payloads of 1 MiB or more are hashed on BLAKE3's own threads.

Only the producer computes digests; a caller's own id travels as ``caller_key`` and never
selects a payload.
"""

from __future__ import annotations

from typing import Any

import blake3
import msgspec

__all__ = ["DIGEST_PREFIX", "digest_of", "envelope_alpha"]

DIGEST_PREFIX = "blake3:"

_THREADED = 1 << 20
"""From this many bytes up, BLAKE3 splits the input over its threads."""


def digest_of(kind: str, dtype: str, shape: tuple[int, ...], alpha: str, data: Any) -> str:
    """The digest of a payload: ``data`` is its bytes as shipped (any C-contiguous buffer)."""
    body = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if body.nbytes >= _THREADED else 1
    h = blake3.blake3(msgspec.msgpack.encode((kind, dtype, shape, alpha)), max_threads=threads)
    h.update(body)
    return DIGEST_PREFIX + h.hexdigest()


def envelope_alpha(kind: str, alpha: str | None) -> str:
    """The alpha rule a digest's header names: the spec's for raw and encoded images, ``""``
    for tensors."""
    return (alpha or "keep") if kind in ("raw", "encoded") else ""
