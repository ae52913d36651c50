"""ckpt._digest: the digests ``delta`` transfers compare. The fingerprint is the same integer
arithmetic on every device, so its properties are checked on the host (small row chunks, so that
chunk folds and partial rows are crossed, and tensors large enough for the int8 matrix product):
every one-byte change changes all 8 sums, equal bytes give equal sums whatever the view, swaps are
seen, the int8 product and the plain int64 sums agree. On a GPU (``gpu`` marker, in a process of its
own so that later forked GPU tests are not disturbed) the device gives the host's sums."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt import _digest
from ckpt._digest import ROW, digests, fingerprint_sums

DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.int64]
ROOT = Path(__file__).resolve().parents[2]


def _tensor(dtype: torch.dtype, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = torch.tensor([], dtype=dtype).element_size()
    top = 2 if dtype == torch.bool else 256  # (a bool's byte is 0 or 1: a clone makes any other 1)
    return torch.randint(0, top, (max(1, nbytes // size) * size,), generator=g, dtype=torch.uint8).view(dtype)


SIZES = st.one_of(st.integers(1, 3 * ROW + 9), st.integers(32 * ROW - 8, 40 * ROW + 9))  # both products


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(DTYPES), nbytes=SIZES, seed=st.integers(0, 2**16), at=st.integers(0, 10**7),
       chunk=st.sampled_from([1, 2, 5, 1 << 20]))
def test_every_one_byte_change_changes_all_sums(dtype: torch.dtype, nbytes: int, seed: int, at: int,
                                               chunk: int) -> None:
    t = _tensor(dtype, nbytes, seed)
    before = fingerprint_sums(t, chunk)
    assert torch.equal(before, fingerprint_sums(t.clone(), chunk))  # the bytes decide, not the object
    b = t.view(torch.uint8)
    i = at % b.numel()
    b[i] ^= 1 if dtype == torch.bool else 1 + at % 255  # a different byte (the xor mask is never 0)
    assert (before != fingerprint_sums(t, chunk)).all(), (dtype, nbytes, i)


@settings(max_examples=40, deadline=None)
@given(nbytes=SIZES, seed=st.integers(0, 2**16), a=st.integers(0, 10**7), b=st.integers(0, 10**7))
def test_swapping_two_different_bytes_is_seen(nbytes: int, seed: int, a: int, b: int) -> None:
    t = _tensor(torch.uint8, max(nbytes, 2), seed)
    i, j = a % t.numel(), b % t.numel()
    if i == j:
        j = (i + 1) % t.numel()
    if t[i] == t[j]:
        t[j] ^= 0x21
    swapped = t.clone()
    swapped[i], swapped[j] = t[j], t[i]
    assert (fingerprint_sums(t) != fingerprint_sums(swapped)).any()


def test_the_int8_product_and_the_plain_sums_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    for nbytes in (32 * ROW, 33 * ROW + 7, 100 * ROW + 1000):
        t = _tensor(torch.uint8, nbytes, nbytes)
        product = fingerprint_sums(t, chunk=7)
        monkeypatch.setattr(_digest, "MIN_MM_ROWS", 1 << 40)  # the plain int64 sums for every row
        assert torch.equal(product, fingerprint_sums(t, chunk=7)), nbytes
        monkeypatch.undo()


def test_views_byte_counts_and_the_public_helper() -> None:
    base = torch.arange(6000, dtype=torch.float32).view(60, 100)
    view = base[:, 20:70]  # not contiguous: its bytes in row-major order, as a copy would hold them
    assert torch.equal(fingerprint_sums(view), fingerprint_sums(view.contiguous()))
    assert torch.equal(fingerprint_sums(torch.empty(0)), torch.zeros(8, dtype=torch.int64))
    # zeros add nothing to the sums: the byte count is hashed with them
    assert torch.equal(fingerprint_sums(torch.zeros(3)), fingerprint_sums(torch.zeros(4)))
    assert digests([torch.zeros(3)]) != digests([torch.zeros(4)])
    t = torch.arange(10, dtype=torch.int32)
    assert importlib.import_module("ckpt.transfer").digest(t) == digests([t])[0] == digests([t.clone()])[0]
    assert len(digests([t])[0]) == 16 and digests([]) == []


GPU_CHECK = """
import torch
from ckpt._digest import digests, fingerprint_sums
g = torch.Generator().manual_seed(3)
for n in (13, 5 * 1024 + 3, 40 * 1024, (1 << 24) + 77):
    t = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    d = t.cuda()
    assert torch.equal(fingerprint_sums(d).cpu(), fingerprint_sums(t)), n
    assert digests([d]) == digests([t])
    assert torch.equal(fingerprint_sums(d[3:]).cpu(), fingerprint_sums(t[3:])), n  # (rows not 16-byte aligned)
    before = digests([d])[0]
    d[n // 2] ^= 0x40
    assert digests([d])[0] != before, n
print("ok")
"""


@pytest.mark.gpu
def test_on_a_gpu_the_fingerprint_is_the_hosts_and_sees_every_change() -> None:
    proc = subprocess.run([sys.executable, "-c", GPU_CHECK], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_rows_swapped_across_chunks_are_seen(chunk: int) -> None:
    """Each chunk of rows reuses the same weights: the chunks must be folded in order (Horner's rule),
    or two rows at the same place of two chunks could trade places unseen."""
    t = _tensor(torch.uint8, 40 * ROW, 5).view(40, ROW)
    swapped = t.clone()
    swapped[[0, chunk]] = t[[chunk, 0]]
    assert not torch.equal(t, swapped)
    assert (fingerprint_sums(t, chunk) != fingerprint_sums(swapped, chunk)).any()


def test_where_the_int8_product_is_refused_the_float64_blocks_give_the_same_sums(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLASLt refuses some int8 products (unaligned rows, some shapes): the fallback's sums are
    the product's, exactly (here forced on the host, and over a view at an odd byte offset)."""
    t = _tensor(torch.uint8, 70 * ROW + 333, 9)
    for piece in (t, t[3:]):
        want = fingerprint_sums(piece, chunk=5)

        def refuse(*_: object) -> torch.Tensor:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED (test)")

        monkeypatch.setattr(torch, "_int_mm", refuse)
        assert torch.equal(fingerprint_sums(piece, chunk=5), want)
        monkeypatch.undo()
