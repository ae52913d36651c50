"""``ckpt._transfer_net.wide``: the two sides of a transfer's copies seen as the widest integer type
their layouts allow. Generated sub-boxes of generated tensors (dtypes of 1, 2 and 4 bytes, any
offsets and widths): the widened copy writes exactly the bits the plain copy writes, and nothing
else; a pair that cannot be widened (a cast, a misaligned row) is left as it is."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt._transfer_net import wide

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]


@st.composite
def boxes(draw: st.DrawFn) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=3)))
    offs = tuple(draw(st.integers(0, n - 1)) for n in shape)
    lens = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offs, strict=True))
    return dtype, shape, offs, lens


def _sub(t: torch.Tensor, offs: tuple[int, ...], lens: tuple[int, ...]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offs, lens, strict=True)):
        t = t.narrow(d, o, n)
    return t


def _bytes_sub(t: torch.Tensor, offs: tuple[int, ...], lens: tuple[int, ...]) -> torch.Tensor:
    """The same sub-box of ``t`` seen as bytes (the last dimension in bytes): the reference copy."""
    isz = t.element_size()
    return _sub(t.view(torch.uint8), (*offs[:-1], offs[-1] * isz), (*lens[:-1], lens[-1] * isz))


@settings(max_examples=300, deadline=None)
@given(boxes(), st.booleans(), st.integers(0, 2**31 - 1))
def test_a_widened_copy_writes_the_same_bits(case: tuple, into_box: bool, seed: int) -> None:
    dtype, shape, offs, lens = case
    isz = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    # any bit patterns (NaN payloads too), viewed as the dtype
    top = 2 if dtype == torch.bool else 256  # (a bool byte other than 0 or 1 is no bool: copies normalise it)
    big = torch.randint(0, top, (*shape[:-1], shape[-1] * isz), dtype=torch.uint8, generator=g).view(dtype)
    small = torch.randint(0, top, (*lens[:-1], lens[-1] * isz), dtype=torch.uint8, generator=g).view(dtype)
    ref_big, ref_small = big.clone(), small.clone()
    # the reference: the copy done byte by byte
    if into_box:  # unpack: contiguous buffer -> sub-box
        _bytes_sub(ref_big, offs, lens).copy_(ref_small.view(torch.uint8))
        out, data = _sub(big, offs, lens), small
    else:  # pack: sub-box -> contiguous buffer
        ref_small.view(torch.uint8).copy_(_bytes_sub(ref_big, offs, lens))
        out, data = small, _sub(big, offs, lens)
    w_out, w_data = wide(out, data)
    assert w_out.shape[:-1] == out.shape[:-1] and w_out.element_size() >= isz
    w_out.copy_(w_data)
    assert torch.equal(big.view(torch.uint8), ref_big.view(torch.uint8))
    assert torch.equal(small.view(torch.uint8), ref_small.view(torch.uint8))


def test_wide_takes_the_widest_type_the_layout_allows() -> None:
    x = torch.zeros(6, 16, dtype=torch.bfloat16)
    buf = torch.zeros(6, 8, dtype=torch.bfloat16)
    assert wide(buf, x[:, 4:12])[0].dtype == torch.int64  # rows of 16 bytes at 8-byte offsets
    assert wide(buf[:, :4], x[:, 2:6])[0].dtype == torch.int32  # rows of 8 bytes at 4-byte offsets
    assert wide(buf[:, :4], x[:, 1:5])[0].dtype == torch.bfloat16  # a 2-byte offset: as it is
    assert wide(buf[:, :3], x[:, 0:3])[0].dtype == torch.bfloat16  # rows of 6 bytes: int16 is no wider
    assert wide(buf.float(), x[:, 4:12])[0].dtype == torch.float32  # a cast: as it is
    assert wide(x[:, ::2], buf)[0].dtype == torch.bfloat16  # strided rows: as they are
    f = torch.zeros(4, 4)
    assert wide(f, f.clone())[0].dtype == torch.int64
    d = torch.zeros(2, 2, dtype=torch.float64)
    assert wide(d, d.clone())[0].dtype == torch.float64  # 8 bytes already
