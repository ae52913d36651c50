"""Issue 30 (5): an HF round trip keeps the tokenizer. ``import-hf`` keeps the side files of the Hugging
Face directory (tokenizer*, generation_config.json, special_tokens_map.json, chat templates) inside the
checkpoint, committed and checksummed with it; ``export-hf`` writes them back by default, byte for byte,
through ``reshard`` too; ``--tokenizer DIR`` still wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.hf.convert import export_hf, import_hf
from ckpt.hf.files import PREFIX, SIDE_FILES

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
WEIGHTS = {"config.json", "model.safetensors", "model.safetensors.index.json"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL)).save_pretrained(d)
    for name in SIDE_FILES:
        (d / name).unlink(missing_ok=True)
    return d


def _with_side_files(hf_dir: Path, dst: Path, files: dict[str, bytes]) -> Path:
    dst.mkdir(parents=True)
    for p in hf_dir.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    for name, data in files.items():
        (dst / name).write_bytes(data)
    return dst


def _side(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.name in SIDE_FILES}


def test_cli_round_trip_keeps_tokenizer_and_generation_config(hf_dir: Path, tmp_path: Path) -> None:
    files = {"tokenizer.json": json.dumps({"model": {"type": "BPE"}}).encode(),
             "tokenizer_config.json": b'{"chat_template": "{{ x }}"}',
             "generation_config.json": b'{"do_sample": true, "temperature": 0.6}',
             "special_tokens_map.json": b'{"eos_token": "</s>"}', "chat_template.jinja": b"{{ messages }}\n"}
    src = _with_side_files(hf_dir, tmp_path / "hf", files)
    runner = CliRunner()
    r = runner.invoke(app, ["import-hf", str(src), str(tmp_path / "ck"), "-q"])
    assert r.exit_code == 0, r.output
    m = ckpt.inspect(str(tmp_path / "ck"))
    assert {k for k in m.objects if k.startswith(PREFIX)} == {PREFIX + n for n in files}
    assert ckpt.verify(str(tmp_path / "ck"), deep=True).ok
    r = runner.invoke(app, ["export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "-q", "--json"])
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(r.output)["side_files"]) == sorted(files)
    assert _side(tmp_path / "out") == files  # byte for byte, and nothing else


def test_round_trip_through_a_parallel_layout_keeps_side_files(hf_dir: Path, tmp_path: Path) -> None:
    files = {"tokenizer.json": b'{"v": 1}', "generation_config.json": b'{"top_p": 0.9}'}
    src = _with_side_files(hf_dir, tmp_path / "hf", files)
    import_hf(str(src), str(tmp_path / "ck"), to="tp=2")  # through a temporary checkpoint and reshard
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert _side(tmp_path / "out") == files


def test_tokenizer_dir_wins_over_the_kept_files(hf_dir: Path, tmp_path: Path) -> None:
    src = _with_side_files(hf_dir, tmp_path / "hf", {"tokenizer.json": b"old", "generation_config.json": b"{}"})
    import_hf(str(src), str(tmp_path / "ck"))
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_bytes(b"new")
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), tokenizer=str(other))
    assert _side(tmp_path / "out") == {"tokenizer.json": b"new", "generation_config.json": b"{}"}


names = st.sampled_from(SIDE_FILES)
contents = st.binary(min_size=0, max_size=64)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.dictionaries(names, contents, max_size=len(SIDE_FILES)))
def test_any_set_of_side_files_round_trips_exactly(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                                   files: dict[str, bytes]) -> None:
    """Whatever subset of side files (any bytes, empty ones too) the directory has, the export has exactly it."""
    tmp = tmp_path_factory.mktemp("rt")
    src = _with_side_files(hf_dir, tmp / "hf", files)
    import_hf(str(src), str(tmp / "ck"))
    r = export_hf(str(tmp / "ck"), str(tmp / "out"))
    assert _side(tmp / "out") == files
    assert sorted(r.side_files) == sorted(files)
    assert {p.name for p in (tmp / "out").iterdir()} - set(files) <= WEIGHTS | {"model-00001-of-00001.safetensors"}
