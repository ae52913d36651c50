"""Offline reshard: bitwise round trips through chains of layouts, bounded memory, crash and resume."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
import torch

import ckpt
from ckpt._transaction import data_file_rank
from ckpt.errors import CheckpointExistsError, LayoutError, StateError, StorageError
from ckpt.layout import Layout
from ckpt.manifest import DATA_DIR
from ckpt.resharders import reshard as reshard_mod
from ckpt.resharders.diff import diff
from ckpt.resharders.placement import local_piece, rank_state
from ckpt.resharders.plan import plan
from ckpt.resharders.reshard import MARKER_DIR, reshard
from ckpt.resharders.rules import MOE_RULES
from ckpt.shards import FlatShard, Shard
from ckpt.storage.local import LocalStorage
from tests.layouts import assert_bitwise
from tests.resharders.moe_states import TINY, config, objects, save_single


def load_full(url: str, like: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    targets = {k: torch.zeros_like(v) for k, v in like.items()}
    out = ckpt.load({**targets, "step": None, "data": None, "rng": None}, url)
    return targets, out


def check_rank_views(url: str, full: dict[str, torch.Tensor], layout: Layout) -> None:
    """Every rank of ``layout`` loads exactly its regions (simulated one rank at a time)."""
    m = ckpt.inspect(url)
    for rank in range(layout.world_size):
        state = rank_state(m, layout, rank, MOE_RULES)
        assert state, f"rank {rank} holds nothing"
        ckpt.load(state, url, strict=False)
        for key, piece in state.items():
            region = piece.region
            assert_bitwise(piece.local, local_piece(full[key], region), f"rank {rank} {key}")


def test_chain_of_layouts_is_bitwise(tmp_path):
    full = save_single(str(tmp_path / "orig"), dtype=torch.bfloat16)
    chain = ["tp=2,ep=2", "tp=1,ep=4,pp=2", "dp=2,zero=1", "single"]  # the chain
    prev = str(tmp_path / "orig")
    for i, text in enumerate(chain):
        lay = Layout.parse(text)
        dst = str(tmp_path / f"c{i}")
        m = reshard(prev, dst, lay, workers=1 + i % 3)
        assert m.world_size == lay.world_size and m.user_metadata["layout"] == lay.to_dict()
        assert m.user_metadata["model_config"] == TINY.to_dict() and m.step == 10
        assert sorted(os.listdir(os.path.join(dst, DATA_DIR))) == sorted(p.rsplit("/", 1)[1] for p in m.files)
        assert not os.path.exists(os.path.join(dst, MARKER_DIR))
        report = ckpt.verify(dst, deep=True)
        assert report.ok, report.problems
        assert diff(str(tmp_path / "orig"), dst).ok
        prev = dst
    got, out = load_full(prev, full)
    for k, v in full.items():
        assert_bitwise(got[k], v, k)
    assert out["step"] == 10 and out["data"] == objects()["data"] and out["rng"] == [0, "state"]


def test_each_target_rank_reads_its_regions(tmp_path):
    full = save_single(str(tmp_path / "orig"))
    for text in ("tp=2,ep=2,pp=2", "dp=2,ep=2,zero=1"):
        lay = Layout.parse(text)
        dst = str(tmp_path / text.replace(",", "_").replace("=", ""))
        m = reshard(str(tmp_path / "orig"), dst, lay)
        check_rank_views(dst, full, lay)
        # a piece held by one rank only sits in that rank's own file
        p = plan(ckpt.inspect(str(tmp_path / "orig")), lay)
        for mv in p.moves:
            if len(mv.holders) == 1:
                assert mv.file == p.ranks[mv.holders[0]].file
        # one file per writing rank, under a fresh random name (never the plan's placeholder)
        assert sorted(map(data_file_rank, m.files)) == sorted(map(data_file_rank, p.target_files))
        assert not set(m.files) & set(p.target_files)


def test_vocab_padding_round_trip(tmp_path):
    cfg = config(vocab_size=255, num_key_value_heads=4)
    full = save_single(str(tmp_path / "orig"), cfg)
    reshard(str(tmp_path / "orig"), str(tmp_path / "tp2"), Layout.parse("tp=2"))  # 255 rows: 128 + 127
    reshard(str(tmp_path / "tp2"), str(tmp_path / "tp4"), Layout.parse("tp=4,zero=1"))  # 64, 64, 64, 63
    check_rank_views(str(tmp_path / "tp4"), full, Layout.parse("tp=4,zero=1"))
    assert diff(str(tmp_path / "orig"), str(tmp_path / "tp4")).ok


def test_tiny_buffers_stream_every_piece_in_parts(tmp_path, monkeypatch):
    full = save_single(str(tmp_path / "orig"))
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(reshard_mod, "MAX_CHUNK", 4096)  # every piece of more than 4 KiB goes in parts
    reshard(str(tmp_path / "orig"), str(tmp_path / "a"), Layout.parse("tp=2,ep=2,dp=2,zero=1"),
            progress=lambda done, total: seen.append((done, total)))
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout.parse("tp=2,pp=2"), workers=3)
    assert diff(str(tmp_path / "orig"), str(tmp_path / "b")).ok
    total = sum(v.numel() * v.element_size() for v in full.values())
    assert len(seen) > 200 and seen[-1] == (total, total)
    assert all(b[0] >= a[0] for a, b in zip(seen, seen[1:], strict=False))


def test_same_bytes_whatever_the_workers(tmp_path):
    save_single(str(tmp_path / "orig"))
    files = []
    for w in (1, 3):
        m = reshard(str(tmp_path / "orig"), str(tmp_path / f"w{w}"), Layout.parse("ep=4,pp=2"), workers=w)
        files.append({data_file_rank(f): (tmp_path / f"w{w}" / f).read_bytes() for f in m.files})  # names: random
    assert files[0] == files[1]


def _fail_on(path_to_fail: str):
    original = LocalStorage.open_writer

    def open_writer(self, path):  # the same rank's file, whatever its random name
        if data_file_rank(path) == data_file_rank(path_to_fail):
            raise StorageError(f"injected failure writing {path}")
        return original(self, path)

    return open_writer


def test_failed_run_leaves_no_checkpoint_and_resumes(tmp_path, monkeypatch):
    save_single(str(tmp_path / "orig"))
    src, dst, lay = str(tmp_path / "orig"), str(tmp_path / "dst"), Layout.parse("ep=4")
    p = plan(ckpt.inspect(src), lay)
    biggest_last = sorted(range(4), key=lambda r: (p.save.assignments[r].nbytes, -r))[0]
    monkeypatch.setattr(LocalStorage, "open_writer", _fail_on(p.target_files[biggest_last]))
    with pytest.raises(StorageError, match="injected"):
        reshard(src, dst, lay, workers=1)
    monkeypatch.undo()
    with pytest.raises(ckpt.ManifestError):
        ckpt.inspect(dst)  # not a checkpoint
    markers = os.listdir(os.path.join(dst, MARKER_DIR))
    assert len(markers) == 3 and all(x.startswith(p.plan_id) for x in markers)
    # Corrupt one finished file: the resume must notice (checksums) and rewrite it.
    done_file = next(f"{DATA_DIR}/{f}" for f in sorted(os.listdir(os.path.join(dst, DATA_DIR)))
                     if data_file_rank(f"{DATA_DIR}/{f}") != biggest_last)
    with open(os.path.join(dst, done_file), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    # A stray file of some other writer is not the re-run's to delete (gc reports leftovers).
    with open(os.path.join(dst, DATA_DIR, "00009-000000000000.safetensors"), "wb") as f:
        f.write(b"junk")
    m = reshard(src, dst, lay, workers=2)
    assert m.stats is not None and m.stats["resumed_files"] == 2
    assert sorted(os.listdir(os.path.join(dst, DATA_DIR))) == sorted(
        [x.rsplit("/", 1)[1] for x in m.files] + ["00009-000000000000.safetensors", done_file.rsplit("/", 1)[1]])
    assert ckpt.verify(dst, deep=True).ok and diff(src, dst).ok


def _crash_midway(src: str, dst: str, text: str) -> None:
    def progress(done: int, total: int) -> None:
        if done > total // 2:
            os._exit(17)  # a hard crash: no cleanup, no abort of half-written files

    reshard_mod.MAX_CHUNK = 8192
    reshard(src, dst, Layout.parse(text), progress=progress, workers=2)


@pytest.mark.multiproc
def test_hard_crash_then_restart(tmp_path):
    save_single(str(tmp_path / "orig"))
    src, dst = str(tmp_path / "orig"), str(tmp_path / "dst")
    proc = mp.get_context("fork").Process(target=_crash_midway, args=(src, dst, "tp=2,ep=2"))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 17
    assert not os.path.exists(os.path.join(dst, "manifest.msgpack"))
    assert os.listdir(os.path.join(dst, DATA_DIR))  # half-written leftovers
    m = reshard(src, dst, Layout.parse("tp=2,ep=2"))
    assert ckpt.verify(dst, deep=True).ok and diff(src, dst).ok
    assert len(m.files) == 4


def test_committed_destination_and_overwrite(tmp_path):
    save_single(str(tmp_path / "orig"))
    src, dst = str(tmp_path / "orig"), str(tmp_path / "dst")
    first = reshard(src, dst, Layout.parse("tp=2"))
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        reshard(src, dst, Layout.parse("ep=2"))
    second = reshard(src, dst, Layout.parse("tp=2"), overwrite=True)  # same plan: new names, old files go
    assert not set(first.files) & set(second.files)
    assert sorted(os.listdir(os.path.join(dst, DATA_DIR))) == sorted(x.rsplit("/", 1)[1] for x in second.files)
    third = reshard(src, dst, Layout.parse("ep=4"), overwrite=True)
    assert third.world_size == 4 and ckpt.verify(dst, deep=True).ok and diff(src, dst).ok


def test_bad_arguments(tmp_path):
    save_single(str(tmp_path / "orig"))
    src = str(tmp_path / "orig")
    with pytest.raises(StateError, match="destination is the source"):
        reshard(src, src + "/", Layout.parse("tp=2"))
    with pytest.raises(StateError, match="memory budget"):
        reshard(src, str(tmp_path / "x"), Layout.parse("tp=2"), memory_budget=1000)
    with pytest.raises(StateError, match="workers"):
        reshard(src, str(tmp_path / "x"), Layout.parse("tp=2"), workers=0)
    with pytest.raises(LayoutError, match="ep=3"):
        reshard(src, str(tmp_path / "x"), Layout.parse("ep=3"))
    assert not os.path.exists(str(tmp_path / "x" / "manifest.msgpack"))
    with pytest.raises(ckpt.ManifestError, match="no committed checkpoint"):
        reshard(str(tmp_path / "nothing"), str(tmp_path / "y"), Layout())


def test_fsspec_memory_storage(tmp_path):
    full = save_single(str(tmp_path / "orig"))
    url = f"memory://reshard-{uuid.uuid4().hex[:8]}"
    reshard(str(tmp_path / "orig"), url + "/a", Layout.parse("ep=2,tp=2,zero=1,dp=2"))
    reshard(url + "/a", str(tmp_path / "back"), Layout())
    assert ckpt.verify(url + "/a", deep=True).ok and diff(str(tmp_path / "orig"), url + "/a").ok
    got, _ = load_full(str(tmp_path / "back"), full)
    for k, v in full.items():
        assert_bitwise(got[k], v, k)


def test_other_dtypes_and_global_tensors(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {
        "model.model.layers.0.mlp.experts.gate_proj": torch.randn(4, 6, 8, generator=g).to(torch.float8_e4m3fn),
        "model.model.layers.1.self_attn.o_proj.weight": torch.randn(8, 6, generator=g).to(torch.float16),
        "model.lm_head.weight": torch.randint(0, 1000, (7, 8), generator=g),
        "optim.exp_avg.lm_head.weight": torch.randn(7, 8, generator=g, dtype=torch.float64),
        "extra.mask": torch.rand(5, 3, generator=g) > 0.5,
        "extra.scalar": torch.tensor(3.5),
        "extra.empty": torch.zeros(0, 4),
    }
    ckpt.save({**state, "step": 1}, str(tmp_path / "a"))
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout.parse("tp=2,ep=2,pp=2,dp=2,zero=1"))
    m = ckpt.inspect(str(tmp_path / "b"))
    assert len(m.tensors["model.model.layers.0.mlp.experts.gate_proj"].shards) == 4
    assert len(m.tensors["extra.mask"].shards) == 1  # global: stored once
    reshard(str(tmp_path / "b"), str(tmp_path / "c"), Layout())
    assert diff(str(tmp_path / "a"), str(tmp_path / "c")).ok
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.load({**back, "step": None}, str(tmp_path / "c"))
    for k, v in state.items():
        assert_bitwise(back[k], v, k)
    # pieces under the target layout load as Shard / FlatShard
    st = rank_state(m, Layout.parse("tp=2,ep=2,pp=2,dp=2,zero=1"), 13, MOE_RULES)  # last stage
    assert isinstance(st["model.lm_head.weight"], Shard) and isinstance(st["optim.exp_avg.lm_head.weight"], FlatShard)


def _flip_byte(url: str, key: str, at: int = 5) -> None:
    s = ckpt.inspect(url).tensors[key].shards[0]
    with open(os.path.join(url, s.file), "r+b") as f:
        f.seek(s.offset + at)
        b = f.read(1)
        f.seek(s.offset + at)
        f.write(bytes([b[0] ^ 0x20]))


def test_corrupted_source_commits_nothing(tmp_path):
    save_single(str(tmp_path / "orig"))
    src, dst = str(tmp_path / "orig"), str(tmp_path / "dst")
    _flip_byte(src, "optim.exp_avg.model.layers.2.mlp.experts.up_proj")
    with pytest.raises(ckpt.IntegrityError, match=r"tensor 'optim\.exp_avg\.model\.layers\.2\.mlp\.experts\.up_proj' "
                                                  r"shard 0: .*checksum mismatch"):
        reshard(src, dst, Layout.parse("tp=2,ep=2"))
    assert not os.path.exists(os.path.join(dst, "manifest.msgpack"))
    left = [f for d in (DATA_DIR, MARKER_DIR) if os.path.isdir(os.path.join(dst, d))
            for f in os.listdir(os.path.join(dst, d))]
    assert left == []  # nothing made from the corrupted bytes may be resumed later
    # Opting out copies the bytes as they are (and gives them fresh checksums): for a source just verified.
    m = reshard(src, dst, Layout.parse("tp=2,ep=2"), verify_source=False)
    assert m.stats is not None and m.stats["source_bytes_verified"] == 0
    assert not diff(str(tmp_path / "orig"), dst, verify=False).problems  # same (corrupted) values on both sides
