"""The read paths of ``run_read_plan`` against each other, on real files: memory-mapped local files
(what ``ckpt.load`` uses for local storage), buffered ``readv`` of the planned ranges (the previous default, and
the fallback where a file cannot be mapped) and plain ``read_into`` (a storage without either).

Random box and flat reshardings with several dtypes, gaps, op sizes and worker counts: every path
must give the same bytes as the tensor that was saved. End to end through ``ckpt.load`` for
destinations that are not contiguous (staged, then copied into place), and the failure modes of the
map: a truncated file, a filesystem that cannot map, a wrapper that must see every byte read.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import tempfile
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt._dtypes import dtype_name
from ckpt._io import MAP_GAP, _mapper, byte_view, default_workers, entry_source, read_gap, run_read_plan
from ckpt._load_plan import LoadRequest, ReadPlan, plan_load
from ckpt._save_plan import PieceDecl, RankDecl, plan_save
from ckpt._source_checks import SourceChecks, VerifyingReads
from ckpt.errors import StorageError
from ckpt.load import fetch_manifest
from ckpt.shards import Box, Flat, Region
from ckpt.storage.base import Storage
from ckpt.storage.local import LocalStorage

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class ReadOnlyLocal(LocalStorage):
    """Local storage whose files cannot be mapped: ``run_read_plan`` falls back to ``readv``."""

    def map_range(self, path: str, offset: int, length: int) -> tuple[mmap.mmap, int] | None:
        return None


class PlainReads(Storage):
    """A storage with ``read_into`` only (no map, no readv): one read per planned range."""

    def __init__(self, inner: LocalStorage):
        self.inner, self.url = inner, inner.url

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        self.inner.read_into(path, offset, buf)


class CountingMaps(LocalStorage):
    """Local storage that records the maps it hands out (to check they are used, and closed)."""

    def __init__(self, root: str):
        super().__init__(root)
        self.maps: list[mmap.mmap] = []

    def map_range(self, path: str, offset: int, length: int) -> tuple[mmap.mmap, int] | None:
        m = super().map_range(path, offset, length)
        assert m is not None
        self.maps.append(m[0])
        return m


def _cuts(draw: Any, n: int, max_parts: int) -> list[tuple[int, int]]:
    k = draw(st.integers(1, max_parts))
    pts = sorted(set(draw(st.lists(st.integers(0, n), min_size=k - 1, max_size=k - 1))))
    bounds = [0, *pts, n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False) if b > a] or [(0, n)]


@st.composite
def sharding(draw: Any, shape: tuple[int, ...]) -> list[Region]:
    """A random exact tiling of ``shape``: a grid of boxes, flat ranges, or flat ranges of boxes."""
    kind = draw(st.sampled_from(["box", "box", "flat", "flat-in-box"]))
    if kind == "flat":
        return [Flat(s, s + n) for s, n in _cuts(draw, math.prod(shape), 4)]
    boxes = [Box((), ())]
    for n in shape:
        boxes = [Box(b.offsets + (o,), b.lengths + (k,)) for b in boxes for o, k in _cuts(draw, n, 3)]
    if kind == "flat-in-box":
        return [Flat(s, s + n, b) for b in boxes for s, n in _cuts(draw, b.numel, 2)]
    return list(boxes)


@st.composite
def case(draw: Any) -> tuple[Any, ...]:
    # Big enough that the files span several pages and the ops start at arbitrary offsets within a
    # map's granularity; rows of 1-, 2- and 8-byte elements give runs and gaps of every alignment.
    shape = tuple(draw(st.lists(st.integers(1, 48), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
    return shape, draw(sharding(shape)), draw(sharding(shape)), dtype, draw(st.integers(1, 4))


def _local(g: torch.Tensor, r: Region) -> torch.Tensor:
    if isinstance(r, Flat):
        block = g if r.box is None else _local(g, r.box)
        return block.reshape(-1)[r.start : r.stop].clone()
    return g[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))].clone()


def _write(root: str, g: torch.Tensor, src: list[Region], ranks: int) -> Any:
    """Save ``g`` as ``src``'s pieces spread over ``ranks`` data files under ``root``; the manifest."""
    decls = [RankDecl() for _ in range(ranks)]
    sources: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for i, region in enumerate(src):
        decls[i % ranks].pieces.append(PieceDecl("t", dtype_name(g.dtype), tuple(g.shape), region))
        sources[i % ranks].append(_local(g, region))
    plan = plan_save(decls, save_id="x")
    for r, a in enumerate(plan.assignments):
        if a.file is None:
            continue
        os.makedirs(os.path.dirname(os.path.join(root, a.file)), exist_ok=True)
        with open(os.path.join(root, a.file), "wb") as f:
            f.write(a.header)
            for e in a.entries:
                f.write(bytes(byte_view(entry_source(sources[r][e.piece], e.start, e.count).contiguous())))
    return plan.manifest


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _run(storage: Any, plan: ReadPlan, like: torch.Tensor, workers: int) -> torch.Tensor:
    out = torch.full_like(like, 7)  # not zeros: a byte left unwritten shows
    run_read_plan(storage, plan, [out], [dtype_name(like.dtype)], workers=workers, map_files=True)
    return out


@pytest.mark.slow
@SETTINGS
@given(case(), st.sampled_from([0, 4096, MAP_GAP]), st.sampled_from([64, 4096, 1 << 20]), st.sampled_from([1, 3]))
def test_mapped_buffered_and_plain_reads_agree_bitwise(c, gap, max_read, workers):
    shape, src, dst, dtype, ranks = c
    g = torch.randn(shape, dtype=torch.float64).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 250, shape, dtype=dtype)
    with tempfile.TemporaryDirectory() as root:
        manifest = _write(root, g, src, ranks)
        mapped, readv, plain = CountingMaps(root), ReadOnlyLocal(root), PlainReads(LocalStorage(root))
        try:
            for region in dst:
                want = _local(g, region)
                req = [LoadRequest("t", dtype_name(dtype), tuple(shape), region)]
                # contiguous_targets False: every op is buffered (the mapped path), none direct
                for direct in (False, True):
                    plan = plan_load(manifest, req, contiguous_targets=[direct], max_read=max_read, max_gap=gap)
                    before = len(mapped.maps)
                    got = _run(mapped, plan, want, workers)
                    buffered = sum(op.direct is None for op in plan.ops)
                    assert len(mapped.maps) - before == buffered  # the map served every buffered op
                    assert all(m.closed for m in mapped.maps)  # and was released
                    assert torch.equal(_bits(got), _bits(want))
                    assert torch.equal(_bits(_run(readv, plan, want, workers)), _bits(want))
                    assert torch.equal(_bits(_run(plain, plan, want, workers)), _bits(want))
        finally:
            for s in (mapped, readv, plain.inner):
                s.close()


def _saved(tmp_path: Any, shapes: dict[str, tuple[int, ...]]) -> tuple[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    full = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    url = str(tmp_path / "c")
    ckpt.save(full, url)
    return url, full


@pytest.mark.parametrize("layout", ["transposed", "strided-slice", "permuted-3d", "contiguous"])
def test_load_into_non_contiguous_destinations_matches_the_read_path(tmp_path, layout):
    # A column block of a row-major stored tensor: one short run per row, every op mapped. The
    # destinations that are not contiguous go through a staging tensor; the result must be the
    # saved values, and bitwise what the buffered reads give.
    url, full = _saved(tmp_path, {"w": (300, 257), "c": (6, 40, 33)})

    def dest(key: str) -> tuple[Any, torch.Tensor]:
        if key == "w":
            c0, c1 = 60, 190
            want = full["w"][:, c0:c1]
            if layout == "transposed":
                local = torch.zeros(c1 - c0, 300).t()
            elif layout == "strided-slice":
                local = torch.zeros(300, 2 * (c1 - c0))[:, ::2]
            else:
                local = torch.zeros(300, c1 - c0)
            return ckpt.Shard(local, (300, 257), (0, c0)), want
        want = full["c"][1:5, 7:31, 2:20]
        local = torch.zeros(18, 4, 24).permute(1, 2, 0) if layout == "permuted-3d" else torch.zeros(4, 24, 18)
        return ckpt.Shard(local, (6, 40, 33), (1, 7, 2)), want

    results = {}
    storage_seen: list[Any] = []

    def opener(cls: type) -> Any:
        def get(u: str, **_: Any) -> Any:
            storage_seen.append(cls(u))
            return storage_seen[-1]
        return get

    for name, cls in (("mapped", CountingMaps), ("readv", ReadOnlyLocal)):
        state, wants = {}, {}
        for k in full:
            state[k], wants[k] = dest(k)
        if layout != "contiguous":
            assert not all(s.local.is_contiguous() for s in state.values())
        with mock.patch("ckpt.load.get_storage", opener(cls)):
            ckpt.load(state, url)
        for k in full:
            assert torch.equal(state[k].local, wants[k]), (name, k)
        if name == "mapped":
            assert storage_seen and storage_seen[-1].maps  # the copies came from maps
        results[name] = {k: state[k].local.clone() for k in full}
    for k in full:
        assert torch.equal(_bits(results["mapped"][k]), _bits(results["readv"][k]))


def test_load_uses_the_map_with_the_wide_gap(tmp_path):
    url, full = _saved(tmp_path, {"w": (512, 300)})
    st_ = CountingMaps(url)
    assert read_gap(st_) == MAP_GAP and read_gap(ReadOnlyLocal(url)) == MAP_GAP
    assert read_gap(PlainReads(LocalStorage(url))) == 4096
    local = torch.zeros(512, 75)
    stats: dict[str, Any] = {}
    with mock.patch("ckpt.load.get_storage", lambda u, **_: st_):
        ckpt.load({"w": ckpt.Shard(local, (512, 300), (0, 150))}, url, stats=stats)
    assert torch.equal(local, full["w"][:, 150:225])
    # 512 runs of 300 bytes, 900 apart: one op, one range, served by one map
    assert stats["ops"] == 1 and len(st_.maps) == 1 and st_.maps[0].closed


def test_other_callers_of_run_read_plan_read_as_before(tmp_path):
    # Mapping is opt-in (ckpt.load): exports and the like keep their buffered reads.
    url, full = _saved(tmp_path, {"w": (128, 96)})
    storage = CountingMaps(url)
    plan = plan_load(fetch_manifest(storage), [LoadRequest("w", "float32", (128, 96), Box((0, 16), (128, 32)))])
    out = torch.zeros(128, 32)
    run_read_plan(storage, plan, [out], ["float32"], workers=1)
    assert storage.maps == [] and torch.equal(out, full["w"][:, 16:48])
    storage.close()


def test_truncated_file_raises_storage_error_not_sigbus(tmp_path):
    url, _ = _saved(tmp_path, {"w": (400, 300)})
    data = os.path.join(url, "data")
    (f,) = os.listdir(data)
    with open(os.path.join(data, f), "r+b") as fh:
        fh.truncate(os.path.getsize(os.path.join(data, f)) - 4096)
    storage = LocalStorage(url)
    with pytest.raises(StorageError, match="truncated"):
        storage.map_range(f"data/{f}", 8, os.path.getsize(os.path.join(data, f)))
    storage.close()
    with pytest.raises(StorageError, match="truncated"):
        ckpt.load({"w": ckpt.Shard(torch.zeros(400, 100), (400, 300), (0, 100))}, url)


def test_a_file_that_cannot_be_mapped_is_read(tmp_path):
    url, full = _saved(tmp_path, {"w": (256, 130)})
    local = torch.zeros(256, 50)
    with mock.patch("ckpt.storage.local.mmap.mmap", side_effect=OSError(19, "No such device")) as m:
        ckpt.load({"w": ckpt.Shard(local, (256, 130), (0, 40))}, url)
    assert m.called
    assert torch.equal(local, full["w"][:, 40:90])


def test_map_released_when_a_copy_fails(tmp_path):
    url, _ = _saved(tmp_path, {"w": (64, 64)})
    storage = CountingMaps(url)
    manifest = fetch_manifest(storage)
    plan = plan_load(manifest, [LoadRequest("w", "float32", (64, 64), Box((0, 8), (64, 16)))], max_gap=MAP_GAP)
    with pytest.raises(RuntimeError):  # a target of the wrong shape: the copy fails
        run_read_plan(storage, plan, [torch.zeros(8, 8)], ["float32"], workers=1, map_files=True)
    assert len(storage.maps) == 1  # no BufferError from the release hid the copy's error
    storage.close()


def test_wrapper_that_sees_every_read_is_not_bypassed(tmp_path):
    # VerifyingReads forwards unknown attributes to the storage it wraps; a map found through that
    # forwarding would read bytes its checks never see. It must read, and its checks must pass.
    url, full = _saved(tmp_path, {"w": (200, 90)})
    inner = LocalStorage(url)
    manifest = fetch_manifest(inner)
    checks = SourceChecks(manifest, ["w"], url, 1 << 20)
    wrapped = VerifyingReads(inner, checks)
    assert _mapper(wrapped) is None and _mapper(inner) is not None
    assert read_gap(wrapped) == inner.coalesce_gap
    plan = plan_load(manifest, [LoadRequest("w", "float32", (200, 90), Box((0, 30), (200, 30)))],
                     max_gap=read_gap(wrapped))
    out = torch.zeros(200, 30)
    with mock.patch.object(LocalStorage, "map_range", side_effect=AssertionError("mapped under the wrapper")):
        run_read_plan(wrapped, plan, [out], ["float32"], workers=2, map_files=True)
    checks.finish(["w"], inner)
    assert torch.equal(out, full["w"][:, 30:60])
    inner.close()


@pytest.mark.parametrize(("cpus", "world", "env", "want"), [
    (2, 4, None, 1),  # the benchmark's box: 4 ranks on 2 cores
    (2, 1, None, 2),
    (2, 4, "1", 2),  # torchrun says this host runs one rank of the 4
    (64, 8, None, 4),  # never more than 4
    (16, 4, "0", 4),  # a malformed LOCAL_WORLD_SIZE: all ranks counted
    (8, 2, "x", 4),
    (1, 8, None, 1),  # never fewer than 1
])
def test_default_workers_share_the_cores_among_local_ranks(tmp_path, monkeypatch, cpus, world, env, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)), raising=False)
    if env is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
    assert default_workers(LocalStorage(str(tmp_path)), world) == want
    # storages that are not mapped wait on the network, not the cores: 4 as before
    assert default_workers(PlainReads(LocalStorage(str(tmp_path))), world) == 4


def test_load_picks_the_default_workers_unless_given(tmp_path, monkeypatch):
    url, full = _saved(tmp_path, {"w": (64, 64)})
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    seen: list[int] = []

    def spy(storage, plan, targets, dtypes, *, workers, map_files):
        seen.append(workers)
        run_read_plan(storage, plan, targets, dtypes, workers=workers, map_files=map_files)

    monkeypatch.setattr(sys.modules["ckpt.load"], "run_read_plan", spy)  # ckpt.load is also the function
    local = torch.zeros(64, 20)
    ckpt.load({"w": ckpt.Shard(local, (64, 64), (0, 10))}, url)
    ckpt.load({"w": ckpt.Shard(local, (64, 64), (0, 10))}, url, workers=2)
    assert seen == [3, 2] and torch.equal(local, full["w"][:, 10:30])
