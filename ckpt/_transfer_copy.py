"""The copies of :func:`ckpt.transfer` inside one rank: views of a plan's boxes and segment runs in
the pieces, reading a copy's elements out of a source, writing them into a target (recorded for a
replay where they are box views), the deferred writes of the commit, and the direct views a bucket of
one copy is sent from or received into. The executor (:mod:`ckpt._transfer_exec`) drives them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ckpt._dtypes import dtype_from_name
from ckpt._transfer_net import Program, Views, wide
from ckpt._transfer_plan import Copy, run_start
from ckpt.shards import Box, Region

SMALL = 32  # up to this many segments a copy loops over slices; beyond, one index_select / index_copy_


def box_view(local: torch.Tensor, region: Region, sub: Box) -> torch.Tensor:
    """The view of ``sub`` (global coordinates) inside ``local``, which holds box ``region``."""
    assert isinstance(region, Box)
    v = local
    for d, (o, n) in enumerate(zip(sub.offsets, sub.lengths, strict=True)):
        v = v.narrow(d, o - region.offsets[d], n)
    return v


def seg_index(off: np.ndarray, ln: np.ndarray) -> torch.Tensor:
    """Element indices of segments ``off[i] .. off[i] + ln[i]``, concatenated."""
    total = int(ln.sum())
    base = np.repeat(off - (np.cumsum(ln) - ln), ln)
    return torch.from_numpy(base + np.arange(total, dtype=np.int64))


def flat_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def read_copy(c: Copy, local: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements copy ``c`` takes from the sender's piece ``local``: a view (boxes) or a new 1-D
    tensor (segments)."""
    if c.geo.box is not None:
        return box_view(local, region, c.geo.box)
    so, ln = c.geo.so, c.geo.ln
    assert so is not None and ln is not None
    flat = flat_of(local)
    if len(ln) == 1:
        return flat[int(so[0]): int(so[0] + ln[0])]
    if len(ln) <= SMALL:
        return torch.cat([flat[int(a): int(a + n)] for a, n in zip(so, ln, strict=True)])
    return flat.index_select(0, seg_index(so, ln).to(flat.device))


def write_copy(c: Copy, target: torch.Tensor, region: Region, data: torch.Tensor) -> None:
    """Put ``data`` (the copy's elements, in its order) into ``target`` (contiguous when ``c`` has
    segments), which holds the receiver's piece ``region``; casts to ``target``'s dtype."""
    if c.geo.box is not None:
        box_view(target, region, c.geo.box).copy_(data.view(c.geo.box.lengths))
        return
    do, ln = c.geo.do, c.geo.ln
    assert do is not None and ln is not None
    flat = target.view(-1)
    data = data.reshape(-1)
    if len(ln) <= SMALL:
        pos = 0
        for a, n in zip(do.tolist(), ln.tolist(), strict=True):
            flat[a: a + n].copy_(data[pos: pos + n])
            pos += n
        return
    flat.index_copy_(0, seg_index(do, ln).to(flat.device), data.to(device=flat.device, dtype=flat.dtype))


def local_copy(c: Copy, sources: list[torch.Tensor], src_regions: list[Region], targets: list[torch.Tensor],
               dst_regions: list[Region], rec: Program | None = None, into: list[list[torch.Tensor]] | None = None
               ) -> None:
    """A copy between two pieces of this rank (it holds what it wants)."""
    write_rec(c, targets[c.dst], dst_regions[c.dst], read_copy(c, sources[c.src], src_regions[c.src]), rec, into)


def write_rec(c: Copy, target: torch.Tensor, region: Region, data: torch.Tensor, rec: Program | None,
           into: list[list[torch.Tensor]] | None) -> None:
    """:func:`write_copy`, recorded into ``into`` (``[outs, datas]`` of a batch) for a replay: a box
    copy is a view of both sides; any other makes ``rec`` not replayable."""
    box = c.geo.box
    if rec is None or into is None or box is None:
        if rec is not None and box is None:
            rec.ok = False
        write_copy(c, target, region, data)
        return
    out, src = wide(box_view(target, region, box), data.view(box.lengths))
    out.copy_(src)
    into[0].append(out)
    into[1].append(src)


def read_kept(c: Copy, local: torch.Tensor, region: Region, views: Views | None) -> torch.Tensor:
    """:func:`read_copy`, its box views taken from ``views`` when given (segments are gathered anew)."""
    if views is None or c.geo.box is None:
        return read_copy(c, local, region)
    return views.get("src", c, local, lambda: read_copy(c, local, region))


def payload_view(c: Copy, payload: torch.Tensor, shape: Any, views: Views | None) -> torch.Tensor:
    """Copy ``c``'s bytes in ``payload`` (a bucket's buffer), typed and shaped ``shape``."""
    def make() -> torch.Tensor:
        return payload[c.offset: c.offset + c.nbytes].view(dtype_from_name(c.dtype)).view(shape)

    if views is None or c.geo.box is None:
        return make()
    whole = payload._base if payload._base is not None else payload  # the kept buffer, not this call's slice
    return views.get("buf", c, whole, make, at=payload.data_ptr())


def commit_writes(writes: list[tuple[Copy, torch.Tensor]], targets: list[torch.Tensor],
                  dst_regions: list[Region], views: Views | None = None, rec: Program | None = None) -> None:
    """Apply deferred writes to the destination pieces (the commit, once every rank agreed). A piece
    that is not contiguous and gets segment runs is written through one contiguous copy of it. Box
    copies go in one batch (``views``: their views, kept for the next run of the plan; ``rec``: the
    batch is recorded for a replay, whose :func:`commit` runs it instead)."""
    bounce: dict[int, torch.Tensor] = {}
    outs, datas = [], []
    for c, data in writes:
        t = targets[c.dst]
        box = c.geo.box
        if box is not None:
            if views is None:
                outs.append(box_view(t, dst_regions[c.dst], box))
                datas.append(data.view(box.lengths))
            else:
                outs.append(views.get("dst", c, t, functools.partial(box_view, t, dst_regions[c.dst], box)))
                # (data is itself a kept view when the plan's views were hit: then so is this one)
                datas.append(views.get("data", c, data, functools.partial(data.view, box.lengths)))
            continue
        if rec is not None:
            rec.ok = False  # (segment writes are not one batch)
        if not t.is_contiguous():
            if c.dst not in bounce:
                bounce[c.dst] = t.contiguous()
            t = bounce[c.dst]
        write_copy(c, t, dst_regions[c.dst], data)
    if outs:
        outs, datas = map(list, zip(*(wide(o, d) for o, d in zip(outs, datas, strict=True)), strict=True))
        torch._foreach_copy_(outs, datas)  # (casts where a target's dtype differs, as copy_ does)
    for j, t in bounce.items():
        targets[j].copy_(t)
    if rec is not None:
        rec.commit_outs, rec.commit_datas = outs, datas


def direct_view(t: torch.Tensor, region: Region, c: Copy, src: bool, device: torch.device) -> torch.Tensor | None:
    """The bytes of copy ``c`` inside piece ``t`` as a uint8 view, when a bucket holding only ``c`` can
    be sent from (``src``) or received into ``t`` itself; else None."""
    if t.device != device or not t.is_contiguous() or (not src and t.dtype != dtype_from_name(c.dtype)):
        return None
    at = run_start(region, c.geo, src)
    if at is None:
        return None
    return t.reshape(-1)[at: at + c.geo.numel].view(torch.uint8)


__all__ = ["SMALL", "box_view", "read_copy", "write_copy", "local_copy", "write_rec", "read_kept", "payload_view",
           "commit_writes", "direct_view", "seg_index"]
