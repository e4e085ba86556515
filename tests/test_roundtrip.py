"""Producer -> real cpu transport -> two spawned ranks that materialise their own items."""

from __future__ import annotations

import numpy as np
import procs
import torch
from mmwire.materialize import KimiConfig, assign_owners, owners_of, preprocess_images
from mmwire.transport import Item, Producer
from PIL import Image


def test_deferred_items_materialised_by_their_owners_equal_eager(rng: np.random.Generator) -> None:
    cfg = KimiConfig(in_patch_limit=400)
    sizes = [(310, 200), (90, 411), (256, 257), (45, 33)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    rgba = rng.integers(0, 256, (120, 77, 4), dtype=np.uint8)
    images.append(Image.fromarray(rgba, "RGBA"))
    specs = [cfg(im.width, im.height) for im in images]
    maps = assign_owners([s.plan.grid.patches for s in specs], 2)
    owners = owners_of(maps, len(images))
    ctx = procs.CHILDREN
    q = ctx.Queue()
    p = Producer(arena_size=1 << 24)
    kids = [
        ctx.Process(
            target=procs.materialize_rank,
            args=(r, 2, p.endpoint, p.handover_path, cfg.in_patch_limit, q),
        )
        for r in range(2)
    ]
    try:
        for k in kids:
            k.start()
        p.wait_for_consumers([0, 1], 60)
        p.publish(
            "req",
            [Item(data=im, consumers=o, preprocess=cfg) for im, o in zip(images, owners)],
        )
        results = {}
        for _ in range(2):
            _, rank, order, pv, grids = q.get(timeout=120)
            results[rank] = (order, pv, grids)
    finally:
        for k in kids:
            k.join(20)
        p.close()
    eager = [preprocess_images([im], cfg) for im in images]
    for rank, (order, pv, grids) in results.items():
        assert order == [g.value for g in maps[rank].globals]
        want = torch.cat([eager[i][0] for i in order])
        assert pv == want.numpy().tobytes(), f"rank {rank} differs from the eager path"
        assert grids == [eager[i][1][0].tolist() for i in order]
