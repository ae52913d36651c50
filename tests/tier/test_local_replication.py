"""Copies between ranks of one host read the sender's files (ckpt.tier.localcopy), not gloo: bitwise
replicas, every piece's CRC checked against a sender's file damaged, truncated or replaced by a link
after its commit (nothing committed at the receiver), a receiver killed mid-copy (no committed copy,
the restore takes another), and the streamed gloo path when ``CKPT_TIER_LOCAL_COPY=0``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import IntegrityError, ManifestError, StorageError, UnsafePathError
from ckpt.manifest import MANIFEST_NAME, Manifest, ShardEntry, TensorEntry
from ckpt.shards import Box
from ckpt.testing.ranks import RankDied
from ckpt.tier import MemoryTier, TierConfig, localcopy, safefs
from ckpt.tier.nodes import LOCAL_COPY_ENV, host_peers, run_id_for, step_name
from tests.dist_utils import run_ranks
from tests.tier.kill_harness import state_of

ROOT = "/tier-tests/local-copy"


# --- the plan: pure ----------------------------------------------------------------------------


@st.composite
def _layouts(draw: Any) -> tuple[Manifest, list[tuple[str, int]], int]:
    files, tensors = [], {}
    for f in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, 64))  # a header no piece covers
        for p in range(draw(st.integers(0, 5))):
            n = draw(st.integers(0, 300))
            tensors[f"t{f}.{p}"] = TensorEntry("uint8", (n,), [ShardEntry(Box((0,), (n,)), f"data/f{f}", at, n, 0)])
            at += n + draw(st.integers(0, 17))  # padding between pieces
        files.append((f"data/f{f}", at + draw(st.integers(0, 9))))
    return Manifest(tensors=tensors, files=dict(files)), files, draw(st.integers(1, 128))


@settings(max_examples=30, deadline=None)
@given(_layouts())
def test_units_cover_every_byte_once_within_one_piece_or_gap(layout: tuple[Manifest, list[tuple[str, int]], int]
                                                             ) -> None:
    manifest, files, unit = layout
    pieces, units = localcopy.plan_units(manifest, files, unit)
    for i, (_rel, size) in enumerate(files):
        mine = sorted((u.offset, u.length) for u in units if u.file == i)
        assert sum(n for _o, n in mine) == size and (not mine or mine[0][0] == 0)
        assert all(a + n == b for (a, n), (b, _m) in zip(mine, mine[1:], strict=False))  # contiguous from 0
    assert all(0 < u.length <= unit for u in units)
    for p, pc in enumerate(pieces):  # a piece's units: in order, exactly its bytes
        got = [(u.offset, u.length) for u in units if u.piece == p]
        assert got == sorted(got) and got[0][0] == pc.offset and sum(n for _o, n in got) == pc.length
        assert all(u.file == pc.file for u in units if u.piece == p)


def test_pieces_that_do_not_fit_their_files_are_refused() -> None:
    past = Manifest(tensors={"w": TensorEntry("uint8", (8,), [ShardEntry(Box((0,), (8,)), "d", 4, 8, 0)])},
                    files={"d": 10})
    with pytest.raises(ManifestError, match="w: bytes \\[4, 12\\) lie past the end of d"):
        localcopy.plan_units(past, [("d", 10)])
    both = Manifest(tensors={k: TensorEntry("uint8", (8,), [ShardEntry(Box((0,), (8,)), "d", o, 8, 0)])
                             for k, o in (("a", 0), ("b", 4))}, files={"d": 16})
    with pytest.raises(ManifestError, match="overlap another piece"):
        localcopy.plan_units(both, [("d", 16)])


def test_host_peers_are_ranks_with_the_same_host_key() -> None:
    hosts: list[Any] = [["a", 1, 2], ["a", 1, 2], ["b", 1, 2], ["a", 1, 3]]
    assert host_peers(hosts, 0) == {1} and host_peers(hosts, 2) == set() and host_peers(hosts, 3) == set()
    assert host_peers(hosts, 0, enabled=False) == set()


# --- copy_verified on real files ------------------------------------------------------------------


def _committed(run: Path, name: str, seed: int = 0) -> tuple[Manifest, list[tuple[str, int]], Path]:
    g = torch.Generator().manual_seed(seed)
    step = run / name
    ckpt.save({"w": torch.randn(300, 7, generator=g), "b": torch.randn(1000, generator=g).to(torch.bfloat16),
               "e": torch.empty(0), "n": {"step": 3}}, str(step))
    m = ckpt.inspect(str(step))
    return m, sorted(m.files.items()), step


def _copy(m: Manifest, files: list[tuple[str, int]], step: Path, **kw: Any) -> list[bytearray]:
    out = [bytearray(size) for _rel, size in files]
    copies = [localcopy.FileCopy(rel, size, str(step / rel), memoryview(b))
              for (rel, size), b in zip(files, out, strict=True)]
    localcopy.copy_verified(copies, m, **kw)
    return out


@pytest.fixture
def run(shm: str) -> Path:
    return Path(safefs.trust_root(os.path.join(shm, "ckpt-copy"), create=True))


@pytest.mark.parametrize("threads,unit", [(1, localcopy.UNIT), (3, 512)])
def test_a_copy_is_bitwise_and_damage_is_refused_by_type(run: Path, threads: int, unit: int) -> None:
    m, files, step = _committed(run, "step-1")
    got = _copy(m, files, step, threads=threads, unit=unit)  # (unit 512: pieces in many units, CRCs combined)
    assert [bytes(b) for b in got] == [(step / rel).read_bytes() for rel, _ in files]
    rel = next(s.file for t in m.tensors.values() for s in t.shards if s.length)
    s = m.tensors["b"].shards[0]
    data = bytearray((step / rel).read_bytes())
    data[s.offset + s.length // 2] ^= 0x01  # one flipped bit in b's piece, after the commit
    (step / rel).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="b: checksum mismatch"):
        _copy(m, files, step, threads=threads, unit=unit)
    (step / rel).write_bytes(bytes(data[:-100]))  # truncated
    with pytest.raises(IntegrityError, match="bytes, its manifest says"):
        _copy(m, files, step, threads=threads, unit=unit)
    os.unlink(step / rel)
    (run / "elsewhere").write_bytes(bytes(data))
    os.symlink(run / "elsewhere", step / rel)  # a link planted in place of the data file
    with pytest.raises(UnsafePathError, match="symbolic link"):
        _copy(m, files, step, threads=threads, unit=unit)


def test_a_copy_past_its_deadline_is_abandoned(run: Path) -> None:
    m, files, step = _committed(run, "step-2")
    with pytest.raises(StorageError, match="at its deadline"):
        _copy(m, files, step, deadline=0.0)


# --- between forked gloo ranks --------------------------------------------------------------------


def _node(shm: str, node: int) -> Path:
    return Path(shm) / f"ckpt-{run_id_for(ROOT)}" / f"node-{node}"


def _tier(shm: str, **kw: Any) -> MemoryTier:
    return MemoryTier(TierConfig(ROOT, shm_dir=shm, nodes=2, timeout=kw.pop("timeout", 20), **kw))


def _count_local_copies(out: list[int]) -> None:
    """Count the copies made through the same-host path in this rank (the real function still runs)."""
    import ckpt.tier.transfer as transfer

    real = transfer.copy_verified

    def counted(*a: Any, **k: Any) -> int:
        out.append(1)
        return real(*a, **k)

    transfer.copy_verified = counted  # type: ignore[assignment]


def _save_and_compare(rank: int, world: int, shm: str, out: str) -> None:
    calls: list[int] = []
    _count_local_copies(calls)
    tier = _tier(shm)
    tier.reset(None)
    for step in (1, 2, 3):
        assert tier.save(step, state_of(rank, step)).complete
    peer = 1 - rank
    kept = Path(tier.store.replica(peer, 3))
    owner = _node(shm, peer) / f"rank-{peer}" / step_name(3)
    files = sorted(p.relative_to(owner) for p in owner.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(kept) for p in kept.rglob("*") if p.is_file())
    assert all((kept / f).read_bytes() == (owner / f).read_bytes() for f in files)  # bitwise, manifest included
    assert ckpt.verify(str(kept), deep=True).ok
    assert [p.stat().st_nlink for p in (kept / "data").iterdir()] == [2]  # received into a reused slot
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "local": sorted(tier.copy_options["local"]), "calls": len(calls)}) + "\n")


@pytest.mark.multiproc
@pytest.mark.parametrize("local", [True, False])
def test_replicas_are_bitwise_through_either_path(shm: str, tmp_path: Path, local: bool) -> None:
    out = tmp_path / "out.jsonl"
    run_ranks(2, _save_and_compare, shm, str(out), env={} if local else {LOCAL_COPY_ENV: "0"})
    got = sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["rank"])
    if local:  # every step's copy read from the peer's files: 3 steps, one copy each
        assert got == [{"rank": 0, "local": [1], "calls": 3}, {"rank": 1, "local": [0], "calls": 3}]
    else:  # the streamed gloo path, as before
        assert got == [{"rank": 0, "local": [], "calls": 0}, {"rank": 1, "local": [], "calls": 0}]


def _damaged_then_clean(rank: int, world: int, shm: str, out: str) -> None:
    import torch.distributed as dist

    from ckpt._comm import side_group
    from ckpt.tier.fastload import read_manifest
    from ckpt.tier.transfer import exchange, package

    def manifest(step: str) -> Manifest:  # (ckpt.inspect is collective over the world: not here)
        return read_manifest(os.path.join(step, MANIFEST_NAME))

    run = safefs.trust_root(os.path.join(shm, "ckpt-x"), create=True)
    pg = side_group([0, 1], "local-copy-test", timeout=20)
    single = side_group([rank], "local-copy-self", timeout=20)
    results = []
    for kind in ("flip", "truncate", "link", "clean"):
        src = os.path.join(run, "node-0", "rank-0", kind)
        dest = os.path.join(run, "node-1", "replicas", "rank-0", kind)
        pkg = None
        if rank == 0:
            safefs.makedirs(os.path.dirname(src))
            g = torch.Generator().manual_seed(len(kind))
            ckpt.save({"w": torch.randn(256, 64, generator=g), "m": torch.randn(999, generator=g), "n": {"k": kind}},
                      src, group=single)
            pkg = package(src, "test")  # committed and packaged: damaged from here on, before the peer reads
            data = os.path.join(src, sorted(manifest(src).files)[0])
            if kind == "flip":
                s = next(s for t in manifest(src).tensors.values() for s in t.shards if s.length)
                with open(data, "r+b") as f:
                    f.seek(s.offset + 3)
                    b = f.read(1)
                    f.seek(s.offset + 3)
                    f.write(bytes([b[0] ^ 0x40]))
            elif kind == "truncate":
                os.truncate(data, os.path.getsize(data) - 64)
            elif kind == "link":
                shutil.copy(data, os.path.join(run, "planted"))
                os.unlink(data)
                os.symlink(os.path.join(run, "planted"), data)
        got = exchange(pg, {1: pkg} if pkg is not None else {}, {0: dest} if rank == 1 else {}, rank=rank,
                       timeout=20, what="test copy", local={1 - rank}, run_dir=run, threads=2)
        dist.barrier()
        if rank == 1:
            r = got[0]
            results.append({"kind": kind, "ok": r.ok, "err": r.err, "dest": os.path.exists(dest),
                            "same": r.ok and all(Path(dest, f).read_bytes() == Path(src, f).read_bytes()
                                                 for f in [*manifest(dest).files, MANIFEST_NAME])})
    if rank == 1:
        Path(out).write_text(json.dumps(results))


@pytest.mark.multiproc
def test_a_sender_file_damaged_after_its_commit_is_never_kept(shm: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    run_ranks(2, _damaged_then_clean, shm, str(out))
    got = {r["kind"]: r for r in json.loads(out.read_text())}
    for kind, text in (("flip", "checksum mismatch"), ("truncate", "truncated"), ("link", "symbolic link")):
        assert not got[kind]["ok"] and text in got[kind]["err"], got[kind]
        assert not got[kind]["dest"]  # nothing committed, nothing left
    assert got["clean"]["ok"] and got["clean"]["same"] and got["clean"]["dest"]


def _killed_mid_copy(rank: int, world: int, shm: str) -> None:
    tier = _tier(shm, timeout=10)
    tier.reset(None)
    assert tier.save(1, state_of(rank, 1)).complete
    if rank == 1:  # the receiver of rank 0's copy of step 2 dies once part of it landed
        seen = []
        real = localcopy.crc32

        def crc_then_die(data: Any, value: int = 0) -> int:
            seen.append(1)
            if len(seen) == 2:
                os._exit(17)
            return real(data, value)

        localcopy.crc32 = crc_then_die  # type: ignore[assignment]
    tier.save(2, state_of(rank, 2))


def _restore(rank: int, world: int, shm: str, out: str) -> None:
    tier = _tier(shm)
    target = state_of(rank, 0)
    got = tier.restore(target)
    assert got is not None
    assert torch.equal(target["model"]["w"].local, state_of(rank, got.step)["model"]["w"].local)
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "step": got.step, "source": got.source, "holder": got.holder}) + "\n")


@pytest.mark.multiproc
def test_a_receiver_killed_mid_copy_commits_nothing_and_the_restore_takes_another_copy(shm: str,
                                                                                      tmp_path: Path) -> None:
    with pytest.raises(RankDied):
        run_ranks(2, _killed_mid_copy, shm, timeout=60)
    half = _node(shm, 1) / "replicas" / "rank-0" / step_name(2)
    assert not (half / MANIFEST_NAME).exists()  # the copy cut short is no checkpoint
    assert (_node(shm, 1) / "replicas" / "rank-0" / step_name(1) / MANIFEST_NAME).is_file()
    shutil.rmtree(_node(shm, 0))  # node 0 lost too: rank 0's only copies are the ones rank 1 keeps
    out = tmp_path / "restored.jsonl"
    run_ranks(2, _restore, shm, str(out))
    got = sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["rank"])
    assert got == [{"rank": 0, "step": 1, "source": "peer", "holder": 1},
                   {"rank": 1, "step": 1, "source": "local", "holder": 1}]
