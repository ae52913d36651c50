"""`ckpt import` (DCP / torch.save -> ckpt) and `ckpt export --format dcp` (-> DCP), checked bitwise
against the original tensors, with DCP's own loader on the way back."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.convert import export_dcp, import_checkpoint
from ckpt.errors import CheckpointExistsError, IntegrityError, ManifestError, StateError
from ckpt.layout import Layout
from tests.dist_utils import run_ranks
from tests.frameworks import fsdp_tp as F

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
runner = CliRunner()


def _state() -> dict[str, object]:
    emb = torch.randn(10, 6)
    return {"model": {"emb": emb, "head": emb, "norm": torch.ones(6, dtype=torch.bfloat16),
                      "layers": {"0": {"w": torch.randn(6, 6)}}},
            "step": 7, "config": {"name": "tiny", "dims": [6, 10]}}


def test_torch_save_file_imports_bitwise(tmp_path):
    sd = _state()
    src = tmp_path / "model.pt"
    torch.save(sd, src)
    m = import_checkpoint(str(src), str(tmp_path / "c"))
    assert m.user_metadata["source"]["format"] == "torch.save"
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok  # a ckpt checkpoint now: checksums everywhere
    got = ckpt.load({"model": {"emb": torch.zeros(10, 6), "head": torch.zeros(10, 6),
                               "norm": torch.zeros(6, dtype=torch.bfloat16), "layers": {"0": {"w": torch.zeros(6, 6)}}},
                     "step": None, "config": None}, str(tmp_path / "c"))
    model = sd["model"]
    assert isinstance(model, dict)
    for k in ("emb", "head", "norm"):
        assert torch.equal(got["model"][k], model[k])
    assert torch.equal(got["model"]["layers"]["0"]["w"], model["layers"]["0"]["w"])
    assert got["step"] == 7 and got["config"] == {"name": "tiny", "dims": [6, 10]}


def test_torch_save_bad_input(tmp_path):
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.ones(2), "evil": Boom()}, tmp_path / "evil.pt")
    with pytest.raises(IntegrityError, match="evil.pt.*refusing to unpickle global '(posix|os).system'"):
        import_checkpoint(str(tmp_path / "evil.pt"), str(tmp_path / "c"))
    assert not marker.exists() and not (tmp_path / "c" / "manifest.msgpack").exists()
    torch.save({"w": torch.randn(4, 3).t()}, tmp_path / "strided.pt")
    with pytest.raises(ManifestError, match="'w' is stored non-contiguous"):
        import_checkpoint(str(tmp_path / "strided.pt"), str(tmp_path / "c"))
    (tmp_path / "trunc.pt").write_bytes((tmp_path / "strided.pt").read_bytes()[:100])
    with pytest.raises(IntegrityError, match="trunc.pt.*not a torch.save zip"):
        import_checkpoint(str(tmp_path / "trunc.pt"), str(tmp_path / "c"))
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(IntegrityError, match="legacy"):
        import_checkpoint(str(tmp_path / "legacy.pt"), str(tmp_path / "c"))
    ckpt.save({"w": torch.ones(1)}, str(tmp_path / "ours"))
    with pytest.raises(ManifestError, match="already a ckpt checkpoint; use `ckpt reshard`"):
        import_checkpoint(str(tmp_path / "ours"), str(tmp_path / "c2"))


def _dcp_save(rank: int, world: int, out: str) -> None:
    model, opt = F.build((2, 2), ("dp", "tp"))
    sd = F.state(model, opt)
    dcp.save(sd, checkpoint_id=os.path.join(out, "dcp"))
    ref = F.full(sd)
    if rank == 0:
        torch.save(ref, os.path.join(out, "ref.pt"))


def _dcp_load_back(rank: int, world: int, out: str, src: str) -> None:
    model, opt = F.build((world,), ("dp",), train=False)
    sd = F.state(model, opt)
    dcp.load(sd, checkpoint_id=os.path.join(out, src))  # DCP's own loader, on another layout
    F.equal(F.full(sd), torch.load(os.path.join(out, "ref.pt")))


@pytest.mark.slow
@pytest.mark.multiproc
def test_dcp_import_then_export_back_to_dcp_is_bitwise(tmp_path):
    out = str(tmp_path)
    run_ranks(4, _dcp_save, out)
    m = import_checkpoint(os.path.join(out, "dcp"), os.path.join(out, "imported"))
    assert m.user_metadata["source"]["format"] == "dcp" and len(m.files) == 1  # whole tensors, one file
    assert ckpt.verify(os.path.join(out, "imported"), deep=True).ok
    ref = torch.load(os.path.join(out, "ref.pt"))
    got = ckpt.load({"model": {k: torch.zeros_like(v) for k, v in ref["model"].items()}},
                    os.path.join(out, "imported"))
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    # back to DCP from the ckpt checkpoint, with small chunks (the budget splits big pieces)
    summary = export_dcp(os.path.join(out, "imported"), os.path.join(out, "back"), memory_budget=1 << 20)
    assert summary["tensors"] == len(m.tensors)
    run_ranks(2, _dcp_load_back, out, "back")
    with pytest.raises(CheckpointExistsError, match="--overwrite"):
        export_dcp(os.path.join(out, "imported"), os.path.join(out, "back"))
    # straight from the DCP source to DCP again, one file per rank of a layout
    export_dcp(os.path.join(out, "dcp"), os.path.join(out, "again"), overwrite=True)
    run_ranks(3, _dcp_load_back, out, "again")


def test_export_dcp_of_a_multi_file_ckpt_checkpoint_and_its_bad_input(tmp_path):
    src = str(tmp_path / "src")
    w = torch.arange(40.0).reshape(8, 5)
    ckpt.save({"w": w, "z": ckpt.FlatShard(torch.arange(6.0), (2, 3), 0), "note": "x",
               "rng": ckpt.PerRank(b"\x01")}, src)
    out = export_dcp(src, str(tmp_path / "d"))
    assert out["tensors"] == 2 and out["objects"] == 2
    sd = {"w": torch.zeros(8, 5), "z": torch.zeros(2, 3), "note": "", "rng": None}
    dcp.load(sd, checkpoint_id=str(tmp_path / "d"))
    assert torch.equal(sd["w"], w) and torch.equal(sd["z"], torch.arange(6.0).reshape(2, 3))
    assert sd["note"] == "x" and sd["rng"] == {0: b"\x01"}
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(StateError, match="holds other files"):
        export_dcp(src, str(tmp_path / "busy"))
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_cli_import_and_export(tmp_path):
    torch.save({"w": torch.arange(12.0).reshape(3, 4)}, tmp_path / "m.pt")
    r = runner.invoke(app, ["import", str(tmp_path / "m.pt"), str(tmp_path / "c"), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["source_format"] == "torch.save" and info["tensors"] == 1
    r = runner.invoke(app, ["export", str(tmp_path / "c"), str(tmp_path / "d"), "--format", "dcp", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["files"] == 1
    r = runner.invoke(app, ["verify", str(tmp_path / "d")])
    assert r.exit_code == 0 and "no checksums" in r.output
    r = runner.invoke(app, ["export", str(tmp_path / "c"), str(tmp_path / "e"), "--format", "hf"])
    assert r.exit_code == 5 and r.output.startswith("error:") and "export-hf" in r.output
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["import", str(tmp_path / "empty"), str(tmp_path / "f")])
    assert r.exit_code == 2 and "looked for" in r.output and "Traceback" not in r.output


def test_import_to_a_layout(tmp_path):
    torch.save({"w": torch.arange(12.0).reshape(3, 4)}, tmp_path / "m.pt")
    m = import_checkpoint(str(tmp_path / "m.pt"), str(tmp_path / "c"), to=Layout(dp=2))
    assert m.user_metadata["layout"] == Layout(dp=2).to_dict()
    assert torch.equal(ckpt.load({"w": torch.zeros(3, 4)}, str(tmp_path / "c"))["w"], torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize("objects", [{"step": 5}, {"step": 7, "sched": {"lr": 0.1, "milestones": [1, 2]}}])
def test_export_dcp_of_a_checkpoint_without_tensors_keeps_its_objects(tmp_path, objects) -> None:
    """A checkpoint holding only objects (a scheduler, a step) exports them (they were dropped: no
    tensor, no data file, nowhere to put them), and DCP's own load reads them back."""
    ckpt.save(objects, str(tmp_path / "c"))
    export_dcp(str(tmp_path / "c"), str(tmp_path / "d"))
    got: dict = {"step": 0, **({"sched": {"lr": 0.0, "milestones": [0]}} if "sched" in objects else {})}
    dcp.load(got, checkpoint_id=str(tmp_path / "d"))
    assert got == objects
