"""Which requests are light enough to publish on the caller's own thread.

``AsyncProducer`` publishes a request on its event loop when nothing has to wait and the
work is small: copying and hashing at most ``NOW_MAX_BYTES``, nothing to decode, no CUDA
copy. Anything else goes to its worker thread, where milliseconds stall no other request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._items import Item
from ._prepare import PreparedItem
from ._torch import is_tensor

__all__ = ["NOW_MAX_BYTES", "heavy", "plainly_large"]

NOW_MAX_BYTES = 1 << 20
"""The most bytes ``publish_now`` copies or hashes on the caller's thread (about 0.1 ms
to copy on a server core; more, and the event loop it runs on would stall)."""


def plainly_large(items: Sequence[Item]) -> bool:
    """Whether a request is plainly too much for ``publish_now`` before anything is read
    (so a ``preprocess`` callable is never called twice): a CUDA tensor, an image object or
    bytes to decode, or over ``NOW_MAX_BYTES`` of data."""
    total = 0
    for item in items:
        data = item.data
        if item.decode:
            return True
        if is_tensor(data):
            if data.is_cuda:
                return True
            total += data.numel() * data.element_size()
        elif isinstance(data, np.ndarray):
            total += data.nbytes
        elif isinstance(data, (bytes, bytearray, memoryview)):
            total += memoryview(data).nbytes
        else:
            return True
    return total > NOW_MAX_BYTES


def heavy(prepared: list[PreparedItem]) -> bool:
    """Whether writing these items takes more than copying a little memory: an image to
    decode or convert, a CUDA tensor to copy down, or over ``NOW_MAX_BYTES`` in all."""
    if any(p.cuda is not None for p in prepared):
        return True
    if any(p.image is not None and not isinstance(p.image, np.ndarray) for p in prepared):
        return True
    return sum(p.nbytes for p in prepared) > NOW_MAX_BYTES
