"""Cut a region into consecutive parts of bounded size, in the order of its bytes. Pure.

A piece's bytes are its elements in row-major order of its box (a flat piece: in flat order), so a
streaming rewrite can fill a piece part by part, each part one contiguous run of the piece's bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from ckpt._regions import strides
from ckpt.shards import Box, Flat, Region


def split_region(region: Region, max_elems: int) -> Iterator[Region]:
    """Consecutive parts of ``region`` of at most ``max_elems`` elements each (at least one element
    per part), in the order of the region's bytes. Box parts are sub-boxes (so that reads stay
    strided block copies); flat parts are sub-ranges of the same flattening.

    Example::

        list(split_region(Box((0, 0), (4, 3)), 6))  # [Box((0, 0), (2, 3)), Box((2, 0), (2, 3))]
    """
    max_elems = max(1, int(max_elems))
    if isinstance(region, Flat):
        for s in range(region.start, region.stop, max_elems):
            yield Flat(s, min(s + max_elems, region.stop), region.box)
        if region.numel == 0:
            yield region
        return
    n = len(region.lengths)
    if region.numel <= max_elems or n == 0:
        yield region
        return
    st = strides(region.lengths)
    # The outermost dim whose single index fits: parts are runs of `per` indices along it, with the
    # dims after it whole, iterated over every index of the dims before it.
    d = next(i for i in range(n) if st[i] <= max_elems)
    per = max(1, max_elems // st[d])
    outer = [range(region.lengths[i]) for i in range(d)]
    for idx in itertools.product(*outer):
        for a in range(0, region.lengths[d], per):
            k = min(per, region.lengths[d] - a)
            offs = tuple(region.offsets[i] + idx[i] for i in range(d)) + (region.offsets[d] + a,) + \
                region.offsets[d + 1:]
            lens = (1,) * d + (k,) + region.lengths[d + 1:]
            yield Box(offs, lens)
