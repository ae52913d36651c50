"""Tools that read checkpoint data verify what they read by default: a corrupted source must stop them
with IntegrityError, not be copied (and, for reshard, re-checksummed into a checkpoint that verifies).
"""

from __future__ import annotations

import os

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.manifest import MANIFEST_NAME

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def corrupted(tmp_path) -> str:
    """A tiny MoE checkpoint (the format the resharders and the exporter understand) with one tensor byte
    flipped."""
    from tests.resharders.moe_states import save_single

    src = str(tmp_path / "src")
    save_single(src, dtype=torch.bfloat16)
    t = ckpt.inspect(src).tensors["model.model.embed_tokens.weight"]
    s = t.shards[0]
    with open(os.path.join(src, s.file), "r+b") as f:
        f.seek(s.offset + 3)
        b = f.read(1)
        f.seek(s.offset + 3)
        f.write(bytes([b[0] ^ 0x40]))
    rep = ckpt.verify(src, deep=True)
    assert [p.kind for p in rep.problems] == ["checksum"]
    return src


def test_verified_load_refuses_the_corrupted_source(corrupted: str):
    m = ckpt.inspect(corrupted)
    state = {k: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for k, t in m.tensors.items()}
    with pytest.raises(ckpt.IntegrityError, match="model.model.embed_tokens.weight"):
        ckpt.load(state, corrupted, verify=True, strict=False)


def test_reshard_refuses_a_corrupted_source(corrupted: str, tmp_path):
    # Found while writing these tests (reshard copied the corrupted bytes and wrote fresh checksums
    # over them: the result verified deep); fixed since (verify_source=True by default).
    from ckpt.layout import Layout
    from ckpt.resharders.reshard import reshard

    dst = str(tmp_path / "dst")
    try:
        reshard(corrupted, dst, Layout.parse("tp=2,ep=2"))
    except ckpt.IntegrityError:
        pass
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME)), \
        "reshard committed a checkpoint from corrupted bytes (and it verifies deep)"
    r = runner.invoke(app, ["reshard", corrupted, str(tmp_path / "dst2"), "--to", "tp=2,ep=2"])
    assert r.exit_code == 3, r.output  # IntegrityError's exit code


def test_export_hf_refuses_a_corrupted_source(corrupted: str, tmp_path):
    # Found while writing these tests (export-hf copied the corrupted bytes into the model); fixed
    # since (verify_source=True by default).
    from ckpt.hf.convert import export_hf

    out = tmp_path / "hf"
    with pytest.raises(ckpt.IntegrityError, match=r"model\.model\.embed_tokens\.weight.*verify --deep"):
        export_hf(corrupted, str(out))
    assert not out.exists(), "export-hf left files of a model made from corrupted bytes"
    r = runner.invoke(app, ["export-hf", corrupted, str(tmp_path / "hf2")])
    assert r.exit_code == 3, r.output  # IntegrityError's exit code
    assert "model.model.embed_tokens.weight" in r.output and "checksum mismatch" in r.output, r.output
    assert not (tmp_path / "hf2").exists()


def test_diff_refuses_a_corrupted_side_unless_told_not_to(corrupted: str, tmp_path):
    from ckpt.resharders.diff import diff
    from tests.resharders.moe_states import save_single

    clean = str(tmp_path / "clean")
    save_single(clean, dtype=torch.bfloat16)
    assert diff(clean, clean).ok and diff(clean, clean).bytes_verified == 2 * ckpt.inspect(clean).total_bytes
    with pytest.raises(ckpt.IntegrityError, match=r"src: tensor 'model.model.embed_tokens.weight' shard 0: "
                                                  "checksum mismatch"):
        diff(clean, corrupted)
    r = runner.invoke(app, ["diff", clean, corrupted])
    assert r.exit_code == 3 and "embed_tokens" in r.output and "--no-verify" in r.output, r.output
    # without verification the flipped byte is just a difference in values
    rep = diff(clean, corrupted, verify=False)
    assert [t.key for t in rep.problems] == ["model.model.embed_tokens.weight"] and rep.bytes_verified == 0
    r = runner.invoke(app, ["diff", clean, corrupted, "--no-verify"])
    assert r.exit_code == 1 and "DIFFERENT" in r.output
