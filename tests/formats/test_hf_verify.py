"""export-hf checks the CRC32 of every source shard it reads (verify_source=True, the default): a
corrupted source stops the export with IntegrityError (CLI exit 3) and leaves no complete model;
the CRCs come from the bytes the export reads anyway (each hashed once, in whatever order the reads
land), plus a read of the parts of a shard the export skips (vocab padding)."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import ckpt
import ckpt.hf.convert as hf
from ckpt import _checksum as checksum
from ckpt import _source_checks as source_checks
from ckpt.cli.app import app
from ckpt.hf.convert import export_hf
from ckpt.layout import Layout
from ckpt.manifest import Manifest, ShardEntry, TensorEntry
from ckpt.resharders.reshard import reshard
from ckpt.shards import full_box
from ckpt.storage.base import Storage
from ckpt.storage.local import LocalStorage
from tests.resharders.moe_states import TINY, metadata, save_single

runner = CliRunner(env={"COLUMNS": "200"})
EXPERTS = "model.model.layers.1.mlp.experts.down_proj"
HEAD = "model.lm_head.weight"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny MoE (fp32, with fake optimizer state) under tp=2 x ep=2: expert tensors in 4 boxes."""
    base = tmp_path_factory.mktemp("verify")
    save_single(str(base / "single"))
    reshard(str(base / "single"), str(base / "sharded"), Layout.parse("tp=2,ep=2"))
    assert len(ckpt.inspect(str(base / "sharded")).tensors[EXPERTS].shards) == 4
    return str(base / "sharded")


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A single-layout checkpoint whose embedding and head carry 8 rows of vocab padding."""
    state = {k: v for k, v in save_single(str(tmp_path_factory.mktemp("unpadded") / "c")).items()
             if k.startswith("model.")}
    for k in ("model.model.embed_tokens.weight", HEAD):
        state[k] = torch.cat([state[k], torch.full((8, TINY.hidden_size), 7.0)])
    url = str(tmp_path_factory.mktemp("padded") / "c")
    ckpt.save(state, url, user_metadata=metadata(TINY, Layout()))
    return url


def _corrupt(src: str, dst: Path, key: str, shard: int, where: int) -> tuple[str, ShardEntry]:
    """A copy of ``src`` with one byte of ``key``'s shard ``shard`` flipped (``where`` < 0: from its end)."""
    shutil.copytree(src, dst)
    s = ckpt.inspect(str(dst)).tensors[key].shards[shard]
    pos = s.offset + (where % s.length)
    with open(dst / s.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    return str(dst), s


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _complete(d: Path) -> bool:
    """What transformers would load as a finished export: config, index, and every file it names."""
    if not (d / "config.json").exists() or not (d / "model.safetensors.index.json").exists():
        return False
    index = json.loads((d / "model.safetensors.index.json").read_text())
    return all((d / f).exists() for f in set(index["weight_map"].values()))


def test_clean_source_exports_exactly_as_without_verification(sharded: str, tmp_path: Path) -> None:
    plain = export_hf(sharded, str(tmp_path / "plain"), max_shard_size="300KB", verify_source=False)
    for name, kwargs in [("small", {"memory_budget": 16 * 1024, "workers": 4}), ("default", {}),
                         ("bf16", {"dtype": "bf16"})]:
        r = export_hf(sharded, str(tmp_path / name), max_shard_size="300KB", **kwargs)
        if name != "bf16":
            assert r.files == plain.files and _files(tmp_path / name) == _files(tmp_path / "plain"), name
        assert _complete(tmp_path / name)


def test_each_source_byte_is_hashed_once_and_read_once(sharded: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRCs cost one hashing pass over the shards and, with nothing skipped, no extra read."""
    hashed = [0]
    read = [0]
    lock = threading.Lock()
    real_crc, real_read, real_readv = source_checks.crc32, LocalStorage.read_into, LocalStorage.readv

    def counting_crc(data: Any, value: int = 0) -> int:
        with lock:
            hashed[0] += len(memoryview(data).cast("B"))
        return real_crc(data, value)

    def counting_read(self: LocalStorage, path: str, offset: int, buf: memoryview) -> None:
        with lock:
            read[0] += len(memoryview(buf).cast("B"))
        real_read(self, path, offset, buf)

    def counting_readv(self: LocalStorage, path: str, ranges: list[tuple[int, int]], buf: memoryview,
                       base: int) -> None:
        with lock:
            read[0] += sum(n for _, n in ranges)
        real_readv(self, path, ranges, buf, base)

    monkeypatch.setattr(source_checks, "crc32", counting_crc)
    monkeypatch.setattr(LocalStorage, "read_into", counting_read)
    monkeypatch.setattr(LocalStorage, "readv", counting_readv)
    m = ckpt.inspect(sharded)
    model_bytes = sum(s.length for k, t in m.tensors.items() if k.startswith("model.") for s in t.shards)
    export_hf(sharded, str(tmp_path / "off"), memory_budget=64 * 1024, workers=4, verify_source=False)
    assert hashed[0] == 0
    read_off, read[0] = read[0], 0
    export_hf(sharded, str(tmp_path / "on"), memory_budget=64 * 1024, workers=4)
    assert hashed[0] == model_bytes
    assert read[0] == read_off


@pytest.mark.parametrize("shard,where,workers,budget", [(0, 0, 4, hf.DEFAULT_MEMORY_BUDGET), (3, -1, 4, 16 * 1024),
                                                        (2, 1000, 1, 16 * 1024)])
def test_corrupted_expert_shard_stops_the_export(sharded: str, tmp_path: Path, shard: int, where: int, workers: int,
                                                 budget: int) -> None:
    src, s = _corrupt(sharded, tmp_path / "src", EXPERTS, shard, where)
    out = tmp_path / "hf"
    with pytest.raises(ckpt.IntegrityError) as e:
        export_hf(src, str(out), max_shard_size="200KB", memory_budget=budget, workers=workers)
    msg = str(e.value)
    assert f"tensor {EXPERTS!r} shard {shard}" in msg and f"{src}/{s.file}" in msg, msg
    assert f"bytes [{s.offset}, {s.offset + s.length})" in msg and "--no-verify-source" in msg, msg
    assert not out.exists(), sorted(os.listdir(out))


def test_corruption_in_skipped_vocab_padding_is_found(padded: str, tmp_path: Path) -> None:
    """The export never reads the padding rows, but the shard holding them is verified whole."""
    rows = TINY.vocab_size  # the first padding row
    src, s = _corrupt(padded, tmp_path / "src", HEAD, 0, rows * TINY.hidden_size * 4 + 5)
    with pytest.raises(ckpt.IntegrityError, match=r"model\.lm_head\.weight"):
        export_hf(src, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    # Without the check the export succeeds: the corrupted byte is in padding, which is dropped.
    export_hf(src, str(tmp_path / "anyway"), verify_source=False)
    export_hf(padded, str(tmp_path / "clean"))
    assert _files(tmp_path / "anyway") == _files(tmp_path / "clean")


def test_no_verify_source_exports_the_corrupted_bytes(sharded: str, tmp_path: Path) -> None:
    src, _ = _corrupt(sharded, tmp_path / "src", EXPERTS, 1, 77)
    export_hf(sharded, str(tmp_path / "clean"))
    r = export_hf(src, str(tmp_path / "api"), verify_source=False)
    assert _complete(tmp_path / "api") and r.files == ["model-00001-of-00001.safetensors"]
    res = runner.invoke(app, ["export-hf", src, str(tmp_path / "cli"), "--no-verify-source", "--quiet"])
    assert res.exit_code == 0, res.output
    assert _files(tmp_path / "cli") == _files(tmp_path / "api")
    clean = load_file(str(tmp_path / "clean" / r.files[0]))
    bad = load_file(str(tmp_path / "api" / r.files[0]))
    differ = [k for k in clean if not torch.equal(clean[k], bad[k])]
    assert len(differ) == 1 and ".mlp.experts." in differ[0] and "down_proj" in differ[0], differ


def test_cli_corrupted_source_exits_3(sharded: str, tmp_path: Path) -> None:
    src, s = _corrupt(sharded, tmp_path / "src", EXPERTS, 3, 12)
    res = runner.invoke(app, ["export-hf", src, str(tmp_path / "hf"), "--json"])
    assert res.exit_code == 3, res.output
    assert "error:" in res.output and EXPERTS in res.output and s.file in res.output, res.output
    assert "Traceback" not in res.output and "ckpt verify --deep" in res.output
    assert not (tmp_path / "hf").exists()


def test_failed_overwrite_leaves_the_previous_export(sharded: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    first = export_hf(sharded, str(out), max_shard_size="200KB")
    assert len(first.files) >= 3 and _complete(out)
    before = _files(out)
    src, _ = _corrupt(sharded, tmp_path / "src", HEAD, 1, -3)  # the last tensor
    # Found in the first batch (one batch holds everything): nothing was written, the old model stays.
    with pytest.raises(ckpt.IntegrityError, match=r"model\.lm_head\.weight"):
        export_hf(src, str(out), max_shard_size="200KB", overwrite=True)
    assert _files(out) == before
    # Found in the last batch, after the other files were written (under the export's own staging names,
    # ckpt.hf.publish): they are removed, and the previous export is there as it was, bit for bit.
    with pytest.raises(ckpt.IntegrityError, match=r"model\.lm_head\.weight"):
        export_hf(src, str(out), max_shard_size="200KB", overwrite=True, memory_budget=16 * 1024)
    assert _files(out) == before and _complete(out), sorted(os.listdir(out))


def test_fsspec_source_is_verified(sharded: str, tmp_path: Path) -> None:
    """Object-store style reads (parallel ranged reads) go through the same check."""
    import fsspec

    src, _ = _corrupt(sharded, tmp_path / "src", EXPERTS, 2, 3)
    fs = fsspec.filesystem("memory")
    name = f"/verify-{tmp_path.name}"
    fs.put(src, name, recursive=True)
    try:
        assert ckpt.inspect(f"memory://{name}").tensors
        with pytest.raises(ckpt.IntegrityError, match=EXPERTS):
            export_hf(f"memory://{name}", str(tmp_path / "hf"))
        assert not (tmp_path / "hf").exists()
    finally:
        fs.rm(name, recursive=True)


def test_crc32_combine() -> None:
    rng = random.Random(0)
    for n1, n2 in [(0, 0), (1, 0), (0, 5), (7, 9), (1000, 1 << 16), (3, 100_003)]:
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        want = zlib.crc32(a + b)
        assert checksum.crc32_combine_py(zlib.crc32(a), zlib.crc32(b), n2) == want
        assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == want


class _Bytes(Storage):
    """A storage of one in-memory file, counting the bytes read from it."""

    url = "mem"

    def __init__(self, data: bytes):
        self.data, self.read = data, 0

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        buf[:] = self.data[offset : offset + len(buf)]
        self.read += len(buf)


@pytest.mark.parametrize("seed", range(6))
def test_shard_crc_from_reads_in_any_order(seed: int) -> None:
    """Overlapping, out-of-order ranges from several threads, some reaching past the shard: the CRC
    is the shard's, each byte hashed once; ``finish`` reads only what no range covered."""
    rng = random.Random(seed)
    data = rng.randbytes(5000)
    off, n = 300, 4000  # the shard: bytes [300, 4300) of the file
    good = zlib.crc32(data[off : off + n])
    for stored, ok in [(good, True), (good ^ 1, False)]:
        m = Manifest(tensors={"t": TensorEntry("uint8", (n,), [ShardEntry(full_box((n,)), "f", off, n, stored)])})
        checks = source_checks.SourceChecks(m, ["t"], "mem", 64)
        (c,) = checks.by_key["t"]
        ranges = [(a, rng.randrange(1, 600)) for a in (rng.randrange(0, 4900) for _ in range(8 if seed % 2 else 40))]
        errors: list[BaseException] = []

        def feed(part: list[tuple[int, int]], checks: source_checks.SourceChecks = checks,
                 errors: list[BaseException] = errors) -> None:
            for a, k in part:
                k = min(k, len(data) - a)
                try:
                    checks.saw("f", a, memoryview(data)[a : a + k])
                except ckpt.IntegrityError as e:
                    errors.append(e)

        threads = [threading.Thread(target=feed, args=(ranges[i::3],)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        checks.saw("g", 0, memoryview(data))  # another file: ignored
        seen = c.covered
        storage = _Bytes(data)
        try:
            checks.finish(["t"], storage)  # type: ignore[arg-type]
        except ckpt.IntegrityError as e:
            errors.append(e)
        assert c.done and c.covered == n and storage.read == n - seen
        assert (not errors) == ok, errors
        if not ok:
            assert len(errors) == 1 and "bytes [300, 4300)" in str(errors[0])


def test_a_shard_without_checksum_is_refused_unless_verification_is_off(sharded: str, tmp_path: Path) -> None:
    from tests.manifest_edit import edit_manifest

    src = str(tmp_path / "src")
    shutil.copytree(sharded, src)

    def drop(d: dict) -> None:
        key = next(k for k in d["tensors"] if k.startswith("model."))
        d["tensors"][key]["shards"][0].pop("checksum")

    edit_manifest(src, drop)
    with pytest.raises(ckpt.IntegrityError, match="no checksum in the manifest"):
        export_hf(src, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf" / "config.json")
    export_hf(src, str(tmp_path / "hf2"), verify_source=False)
    assert os.path.exists(tmp_path / "hf2" / "config.json")
