"""The streaming copy engine (ckpt._stream) on its own: random element ranges of sharded
sources copied under tiny budgets equal the reference bitwise; failures leave nothing of the engine's
but the finished files it reports (which the caller's clean-up removes), and never touch other files."""

from __future__ import annotations

import os
import tempfile
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt._io import byte_view
from ckpt._stream import Item, OutFile, copy_files, read_items
from ckpt.errors import StorageError
from ckpt.manifest import Manifest, ShardEntry, TensorEntry
from ckpt.shards import Box, Flat
from ckpt.storage.local import LocalStorage

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "uint8": torch.uint8}
CASTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _values(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in ("int64", "uint8"):
        return torch.randint(0, 200, shape, generator=g).to(DTYPES[dtype])
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def _source(root: str, tensors: dict[str, torch.Tensor], splits: dict[str, tuple[str, int]]) -> Manifest:
    """A source over one raw file: each tensor stored as ``k`` box shards (rows) or flat ranges, in
    shuffled order, each with its CRC32."""
    blobs: list[tuple[str, Any, bytes]] = []
    for key, t in tensors.items():
        kind, k = splits[key]
        flat = t.reshape(-1)
        if kind == "box" and t.dim():
            rows = t.shape[0]
            cuts = sorted({0, rows, *(rows * i // k for i in range(1, k))})
            for a, b in zip(cuts, cuts[1:], strict=False):
                blobs.append((key, Box((a, *[0] * (t.dim() - 1)), (b - a, *t.shape[1:])),
                              bytes(byte_view(t[a:b].contiguous()))))
        else:
            n = flat.numel()
            cuts = sorted({0, n, *(n * i // k for i in range(1, k))})
            for a, b in zip(cuts, cuts[1:], strict=False):
                blobs.append((key, Flat(a, b), bytes(byte_view(flat[a:b].contiguous()))))
    blobs.reverse()  # file order differs from element order
    data = bytearray(b"junk")
    shards: dict[str, list[ShardEntry]] = {k: [] for k in tensors}
    for key, region, blob in blobs:
        shards[key].append(ShardEntry(region, "src.bin", len(data), len(blob), zlib.crc32(blob)))
        data += blob + b"pad"
    with open(os.path.join(root, "src.bin"), "wb") as f:
        f.write(data)
    return Manifest(tensors={k: TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape), shards[k])
                             for k, t in tensors.items()}, files={"src.bin": len(data)})


def _expected(t: torch.Tensor, it: Item) -> bytes:
    r = it.region
    part = t[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))] if isinstance(r, Box) \
        else t.reshape(-1)[r.start:r.stop]
    return bytes(byte_view(part.to(it.dst_dtype).contiguous()))


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    tensors: dict[str, torch.Tensor] = {}
    splits: dict[str, tuple[str, int]] = {}
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0 if i else 1, 9), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        tensors[f"t{i}"] = _values(shape, dtype, i)
        splits[f"t{i}"] = (draw(st.sampled_from(["box", "flat"])), draw(st.integers(1, 4)))
    items: list[Item] = []
    for n in range(draw(st.integers(1, 8))):
        key = draw(st.sampled_from(sorted(tensors)))
        t = tensors[key]
        if t.dim() and draw(st.booleans()):
            offs = [draw(st.integers(0, s)) for s in t.shape]
            region: Any = Box(tuple(offs), tuple(draw(st.integers(0, s - o)) for s, o in zip(t.shape, offs,
                                                                                               strict=True)))
        else:
            a = draw(st.integers(0, t.numel()))
            region = Flat(a, draw(st.integers(a, t.numel())))
        out = draw(st.sampled_from(CASTS)) if t.is_floating_point() and draw(st.booleans()) else None
        items.append(Item(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), region, out, f"item{n}"))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(items)), max_size=3))) | {0, len(items)})
    groups = [items[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    if draw(st.booleans()):
        groups.append([])  # a file with a header only
    files = [OutFile(f"out/f{k}.bin", b"H" * draw(st.integers(0, 70)), g) for k, g in enumerate(groups)]
    return {"tensors": tensors, "splits": splits, "files": files, "budget": draw(st.integers(1024, 1 << 15)),
            "lanes": draw(st.integers(1, 3)), "readers": draw(st.integers(1, 2)),
            "max_part": draw(st.sampled_from([None, 256, 1000])), "verify": draw(st.booleans())}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_ranges_copy_bitwise_under_tiny_budgets(case: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as root:
        manifest = _source(root, case["tensors"], case["splits"])
        src, dst = LocalStorage(root), LocalStorage(os.path.join(root, "dst"))
        files: list[OutFile] = case["files"]
        seen: list[tuple[int, int]] = []
        done: list[int] = []
        written: list[str] = []
        res = copy_files(src, manifest, dst, files, budget=case["budget"], lanes=case["lanes"],
                         readers=case["readers"], max_part=case["max_part"], checksums=True,
                         verify=set(case["tensors"]) if case["verify"] else None,
                         progress=lambda d, t: seen.append((d, t)), file_done=lambda i, _s, _c: done.append(i),
                         written=written)
        total = sum(it.out_bytes for f in files for it in f.items)
        for k, f in enumerate(files):
            parts = [_expected(case["tensors"][it.key], it) for it in f.items]
            with open(os.path.join(root, "dst", f.path), "rb") as fh:
                assert fh.read() == f.header + b"".join(parts), f.path
            assert res.sizes[k] == f.size and res.checksums[k] == [zlib.crc32(p) for p in parts]
        assert sorted(done) == list(range(len(files))) and sorted(written) == sorted(f.path for f in files)
        assert seen[0] == (0, total) and seen[-1] == (total, total)
        assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:], strict=False))
        assert res.buffer_bytes <= case["budget"]
        stored = sum(s.length for t in manifest.tensors.values() for s in t.shards)
        assert res.verified_bytes == (stored if case["verify"] else 0)
        # read_items: the same bytes, part by part, through one buffer
        items = [it for f in files for it in f.items]
        got: dict[int, bytes] = {}
        for i, _region, values in read_items(src, manifest, items, buffer=512, readers=case["readers"]):
            got[i] = got.get(i, b"") + bytes(byte_view(values.contiguous()))
        assert [got.get(i, b"") for i in range(len(items))] == [_expected(case["tensors"][it.key], it)
                                                                for it in items]


class _FailingStorage(LocalStorage):
    """Local storage whose writer fails at the ``fail_at``-th write of the file ``fail_path``."""

    def __init__(self, root: str, fail_path: str, fail_at: int):
        super().__init__(root)
        self.fail_path, self.fail_at = fail_path, fail_at

    def open_writer(self, path: str) -> Any:
        w = super().open_writer(path)
        if path != self.fail_path:
            return w
        count = [0]
        real = w.write

        def write(data: Any) -> None:
            count[0] += 1
            if count[0] == self.fail_at:
                raise StorageError(f"injected: disk full writing {path}")
            real(data)

        w.write = write
        return w


@pytest.mark.parametrize("lanes", [1, 3])
def test_failure_mid_copy_leaves_only_finished_files_the_caller_removes(tmp_path: Any, lanes: int) -> None:
    tensors = {f"t{i}": _values((64, 16), "float32", i) for i in range(6)}
    root = str(tmp_path)
    manifest = _source(root, tensors, {k: ("box", 3) for k in tensors})
    files = [OutFile(f"data/f{k}.bin", b"header", [Item(k, "float32", (64, 16), Box((0, 0), (64, 16)))])
             for k in tensors]
    os.makedirs(tmp_path / "dst" / "data")
    (tmp_path / "dst" / "keep.txt").write_text("not ours")
    (tmp_path / "dst" / "data" / "other.bin").write_text("not ours either")
    dst = _FailingStorage(str(tmp_path / "dst"), "data/ft3.bin", 3)  # the header, one part, then fails
    written: list[str] = []
    with pytest.raises(StorageError, match="injected"):
        copy_files(LocalStorage(root), manifest, dst, files, budget=8192, lanes=lanes, written=written)
    present = {str(p.relative_to(tmp_path / "dst")) for p in (tmp_path / "dst").rglob("*") if p.is_file()}
    assert "data/ft3.bin" in written and "data/ft3.bin" not in present  # the failed file was aborted
    assert present - set(written) == {"keep.txt", "data/other.bin"}
    assert set(written) <= {f.path for f in files}
    for p in present & set(written):  # what is left is complete
        k = p.removeprefix("data/f").removesuffix(".bin")
        assert (tmp_path / "dst" / p).read_bytes() == b"header" + bytes(byte_view(tensors[k]))
    for p in written:  # the caller's clean-up
        dst.delete(p) if dst.size(p) is not None else None
    assert {str(p.relative_to(tmp_path / "dst")) for p in (tmp_path / "dst").rglob("*") if p.is_file()} == \
        {"keep.txt", "data/other.bin"}


def test_corrupted_source_is_found_before_its_batch_is_written(tmp_path: Any) -> None:
    tensors = {"a": _values((32, 8), "float32", 1), "b": _values((100,), "bfloat16", 2)}
    manifest = _source(str(tmp_path), tensors, {"a": ("box", 2), "b": ("flat", 3)})
    s = manifest.tensors["b"].shards[1]
    with open(tmp_path / "src.bin", "r+b") as f:
        f.seek(s.offset + 3)
        f.write(b"\x99")
    # only rows 0-3 of "a" and a slice of "b" are wanted: the rest of their shards is read to check them
    files = [OutFile("x.bin", b"", [Item("a", "float32", (32, 8), Box((0, 0), (4, 8))),
                                    Item("b", "bfloat16", (100,), Flat(10, 20))])]
    written: list[str] = []
    with pytest.raises(ckpt.IntegrityError, match=r"tensor 'b' shard 1: checksum mismatch"):
        copy_files(LocalStorage(str(tmp_path)), manifest, LocalStorage(str(tmp_path / "dst")), files,
                   budget=1 << 20, verify={"a", "b"}, written=written)
    assert written == [] and not (tmp_path / "dst").exists()
