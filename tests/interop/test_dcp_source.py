"""DCP checkpoints (made by torch.distributed.checkpoint itself) as ckpt sources: loaded resharded
by ckpt.load on other layouts, bitwise; bytes items as objects; hostile pickles refused without
running anything; truncated data files named."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

import ckpt
from ckpt.errors import IntegrityError, ManifestError
from tests.dist_utils import run_ranks
from tests.frameworks import fsdp_tp as F

# dcp.save in one process (no group) warns that it assumes a single process: that is the intent here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LAYOUTS = {
    "dp2_tp2": ((2, 2), ("dp", "tp")),
    "dp2": ((2,), ("dp",)),
    "dp3": ((3,), ("dp",)),
    "tp2": ((2,), ("tp",)),
    "single": ((), ()),
}


def _dcp_save(rank: int, world: int, out: str, layout: str, fmt: str = "torch_save") -> None:
    model, opt = F.build(*LAYOUTS[layout])
    sd = F.state(model, opt, flatten_optimizer_state_dict=True)
    # torchtitan's shape: model / optimizer (flattened) / lr_scheduler / dataloader (per rank) / train_state
    sd["lr_scheduler"] = {"last_epoch": 3, "base_lrs": [0.01]}
    sd["dataloader"] = {f"dp_rank_{rank}": pickle.dumps({"position": 17 + rank})}
    sd["train_state"] = {"step": 3, "ntokens_seen": 1234}
    writer = FileSystemWriter(os.path.join(out, "dcp"), serialization_format=SerializationFormat(fmt))
    dcp.save(sd, storage_writer=writer)
    ref = F.full(sd)
    if rank == 0:
        torch.save({"model": ref["model"], "optim": ref["optim"]}, os.path.join(out, "ref.pt"))


def _ckpt_load(rank: int, world: int, out: str, layout: str, saved_by: int = 4) -> None:
    model, opt = F.build(*LAYOUTS[layout], train=False)
    sd = F.state(model, opt, flatten_optimizer_state_dict=True)
    sd["lr_scheduler"] = None
    sd["train_state"] = None
    sd["dataloader"] = {f"dp_rank_{rank}": None} if rank < saved_by else {}
    got = ckpt.load(sd, os.path.join(out, "dcp"))
    ref = torch.load(os.path.join(out, "ref.pt"))
    F.equal(F.full({"model": got["model"], "optim": got["optim"]}), ref)
    assert got["lr_scheduler"] == {"last_epoch": 3, "base_lrs": [0.01]}
    assert got["train_state"] == {"step": 3, "ntokens_seen": 1234}
    if rank < saved_by:  # the per-rank bytes come back as bytes (ckpt never unpickles them)
        assert pickle.loads(got["dataloader"][f"dp_rank_{rank}"]) == {"position": 17 + rank}


@pytest.mark.parametrize(("src", "dst", "fmt"), [
    ("dp2_tp2", "dp3", "torch_save"), ("dp2_tp2", "single", "torch_save"), ("dp2_tp2", "tp2", "torch_save"),
    ("dp2", "dp3", "torch_save"),
    # DCP's safetensors serialization: per data file the bytes items, then one safetensors file
    ("dp2_tp2", "dp3", "safetensors"),
])
@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp_tp_dcp_checkpoint_loads_resharded_by_ckpt(tmp_path, src, dst, fmt):
    out = str(tmp_path)
    saved_by = 4 if src == "dp2_tp2" else 2
    run_ranks(saved_by, _dcp_save, out, src, fmt)
    m = ckpt.inspect(os.path.join(out, "dcp"))
    assert m.source_format == "dcp" and "model.up.weight" in m.tensors
    assert all(s.checksum is None for t in m.tensors.values() for s in t.shards)
    run_ranks(LAYOUTS[dst][0][0] if LAYOUTS[dst][0] else 1, _ckpt_load, out, dst, saved_by)


def _plain_dcp(tmp_path: Path) -> tuple[str, dict[str, object]]:
    sd: dict[str, object] = {"w": torch.randn(9, 4), "h": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                             "i": torch.tensor([1, 2, 3], dtype=torch.int64), "e": torch.zeros(0, 2),
                             "meta": {"name": "x", "epochs": (1, 2)}}
    url = str(tmp_path / "plain")
    dcp.save(sd, checkpoint_id=url)
    return url, sd


def test_plain_dcp_round_trips_through_ckpt_load_and_reads_only_what_it_needs(tmp_path):
    url, sd = _plain_dcp(tmp_path)
    out = ckpt.load({"w": ckpt.Shard(torch.zeros(3, 4), (9, 4), (3, 0)), "h": torch.zeros(2, 3, dtype=torch.bfloat16),
                     "i": torch.zeros(3, dtype=torch.int64), "e": torch.zeros(0, 2), "meta": None}, url)
    assert torch.equal(out["w"].local, sd["w"][3:6])  # type: ignore[index]
    assert torch.equal(out["h"], sd["h"]) and torch.equal(out["i"], sd["i"])  # type: ignore[arg-type]
    assert out["meta"] == {"name": "x", "epochs": (1, 2)}
    r = ckpt.verify(url, deep=True)
    assert r.ok and "no checksums" in r.note


def test_truncated_dcp_data_file_is_named(tmp_path):
    url, _ = _plain_dcp(tmp_path)
    data = next(p for p in Path(url).iterdir() if p.suffix == ".distcp")
    raw = data.read_bytes()
    data.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(IntegrityError, match=rf"{data.name}.*beyond the file's .* bytes \(truncated\?\)"):
        ckpt.load({"w": torch.zeros(9, 4)}, url)
    r = ckpt.verify(url)
    assert not r.ok and data.name in r.problems[0].message


class _Boom:
    def __reduce__(self):  # what a hostile checkpoint would do: run a shell command on unpickling
        return (os.system, (f"touch {self.marker}",))

    marker = ""


def test_hostile_dcp_metadata_runs_nothing(tmp_path):
    url, _ = _plain_dcp(tmp_path)
    marker = tmp_path / "pwned"
    _Boom.marker = str(marker)
    meta = Path(url) / ".metadata"
    md = pickle.loads(meta.read_bytes())  # our own, trusted file: the test builds the hostile one from it
    md.storage_meta = _Boom()
    meta.write_bytes(pickle.dumps(md))
    refused = r"refusing to unpickle global '(posix|os)\.system'.*nothing from the file"
    with pytest.raises(IntegrityError, match=refused):
        ckpt.inspect(url)
    assert not marker.exists()
    r = ckpt.verify(url)
    assert not r.ok and ("posix.system" in r.problems[0].message or "os.system" in r.problems[0].message)
    assert not marker.exists()


def test_hostile_bytes_item_is_kept_raw_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    _Boom.marker = str(marker)
    buf = io.BytesIO()
    torch.save(_Boom(), buf)  # torch.save pickles the reduce: loading it would run os.system
    sd = {"w": torch.ones(2), "evil": buf.getvalue()}  # a bytes value holding a hostile torch.save blob
    url = str(tmp_path / "c")
    dcp.save(sd, checkpoint_id=url)
    out = ckpt.load({"w": torch.zeros(2), "evil": None}, url)
    assert out["evil"] == buf.getvalue() and not marker.exists()


def test_not_a_checkpoint_lists_what_was_looked_for(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("hi")
    with pytest.raises(ManifestError, match=r"looked for manifest.msgpack .* \.metadata .*DeepSpeed"):
        ckpt.load({"w": torch.zeros(1)}, str(tmp_path / "x"))


def test_misaligned_tensor_bytes_load_bitwise_through_every_copy_path(tmp_path):
    """DCP does not align tensor data within its files: loads of blocks, columns and flat ranges
    copy misaligned bytes exactly (they used to clone the rest of the read buffer per copy)."""
    g = torch.Generator().manual_seed(3)
    sd: dict[str, object] = {"pad": b"xyz"}
    for i in range(6):
        sd[f"f{i}"] = torch.randn(37, 11, generator=g)
        sd[f"d{i}"] = torch.randn(5, 13, generator=g).double()
        sd[f"h{i}"] = torch.randn(9, 3, generator=g).bfloat16()
    url = str(tmp_path / "m")
    dcp.save(sd, checkpoint_id=url)
    m = ckpt.inspect(url)
    offsets = [(s.offset, torch.empty((), dtype=getattr(torch, t.dtype)).element_size())
               for t in m.tensors.values() for s in t.shards]
    assert any(off % isz for off, isz in offsets)  # the case under test really occurs
    for i in range(6):
        f, d, h = sd[f"f{i}"], sd[f"d{i}"], sd[f"h{i}"]
        assert isinstance(f, torch.Tensor) and isinstance(d, torch.Tensor) and isinstance(h, torch.Tensor)
        got = ckpt.load({f"f{i}": ckpt.Shard(torch.zeros(37, 4), (37, 11), (0, 5)),        # columns: strided
                         f"d{i}": ckpt.FlatShard(torch.zeros(40, dtype=torch.float64), (5, 13), 7),  # flat
                         f"h{i}": torch.zeros(9, 3, dtype=torch.bfloat16)}, url)
        assert torch.equal(got[f"f{i}"].local, f[:, 5:9])
        assert torch.equal(got[f"d{i}"].local, d.reshape(-1)[7:47])
        assert torch.equal(got[f"h{i}"], h)


def test_dcp_transforms_are_named_in_a_clear_error(tmp_path):
    url, _ = _plain_dcp(tmp_path)
    meta = Path(url) / ".metadata"
    md = pickle.loads(meta.read_bytes())  # our own file: the test edits it as a compressing writer would
    info = next(iter(md.storage_data.values()))
    info.transform_descriptors = ["zstd"]
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(ManifestError, match=r"DCP transform\(s\) \['zstd'\].*save it again without transforms"):
        ckpt.inspect(url)


def test_cli_readers_take_a_dcp_directory(tmp_path):
    import json

    from typer.testing import CliRunner

    from ckpt.cli.app import app

    url, _ = _plain_dcp(tmp_path)
    runner = CliRunner()
    r = runner.invoke(app, ["inspect", url, "--json"])
    assert r.exit_code == 0, r.output
    assert {"w", "h", "i"} <= set(json.loads(r.output)["tensors"])
    r = runner.invoke(app, ["verify", url, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["source_format"] == "dcp"
    ckpt.save({"w": torch.zeros(9, 4)}, str(tmp_path / "other"))
    r = runner.invoke(app, ["diff", url, str(tmp_path / "other")])
    assert r.exit_code != 0 and "Traceback" not in r.output  # they differ; the DCP side was read


def test_metadata_of_allowed_classes_but_wrong_shape_is_a_manifest_error(tmp_path):
    url, _ = _plain_dcp(tmp_path)
    meta = Path(url) / ".metadata"
    md = pickle.loads(meta.read_bytes())
    md.state_dict_metadata["w"] = {"not": "metadata"}  # plain data where a TensorStorageMetadata belongs
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(ManifestError, match="malformed checkpoint metadata"):
        ckpt.inspect(url)
    assert not ckpt.verify(url).ok


def test_safetensors_dcp_with_a_wrong_or_damaged_header_is_refused(tmp_path):
    sd = {"w": torch.randn(4, 3), "v": torch.arange(5, dtype=torch.int32)}
    url = tmp_path / "st"
    dcp.save(sd, storage_writer=FileSystemWriter(url, serialization_format=SerializationFormat.SAFETENSORS))
    got = ckpt.load({"w": torch.zeros(4, 3), "v": torch.zeros(5, dtype=torch.int32)}, str(url))
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["v"], sd["v"])
    data = next(p for p in url.iterdir() if p.suffix == ".distcp")
    raw = data.read_bytes()
    # the header renames the tensor: the metadata's key is no longer in the file
    data.write_bytes(raw.replace(b'"w"', b'"x"', 1))
    with pytest.raises(ManifestError, match=rf"{data.name}: 'w': the safetensors header has it absent"):
        ckpt.inspect(str(url))
    # the header's length prefix is garbage: neither format
    data.write_bytes(b"\xff" * 8 + raw[8:])
    with pytest.raises(ManifestError, match="neither a torch.save blob nor a safetensors file"):
        ckpt.inspect(str(url))
