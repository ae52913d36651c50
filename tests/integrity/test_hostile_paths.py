"""Paths from a manifest that are absolute, contain ``..``, or resolve through a symlink outside the
checkpoint are rejected before any I/O on them; symlinks that stay inside keep working.

(test_core.py covers the basic escapes through ``load``; this file covers every entry point, the
"before any I/O" part with a spy on the storage, and the symlink variants.)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ckpt
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage.local import LocalStorage

BAD_PATHS = ["/etc/passwd", "../x.safetensors", "data/../../x", "data/./x", "./data/x", "data//x", "data/x/",
             "c:/x", "s3://bucket/x", "data\\..\\x", "data/x\x00.safetensors", "", "..", "data/.."]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path the local storage backend is asked to touch."""
    touched: list[str] = []
    for name in ("read_into", "read_file", "size", "exists", "open_writer", "delete"):
        real = getattr(LocalStorage, name)

        def wrapper(self: LocalStorage, path: str, *a: Any, _real: Any = real, **k: Any) -> Any:
            touched.append(path)
            return _real(self, path, *a, **k)

        monkeypatch.setattr(LocalStorage, name, wrapper)
    return touched


def _edit_manifest(url: str, edit: Any) -> None:
    from tests.manifest_edit import edit_manifest

    edit_manifest(url, edit)


def _save(url: str) -> tuple[str, dict[str, torch.Tensor]]:
    state = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.int32)}
    m = ckpt.save(state, url)
    (f,) = m.files
    return f, state


def _dst() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int32)}


@pytest.mark.parametrize("bad", BAD_PATHS)
@pytest.mark.parametrize("where", ["files-and-shard", "files-only"])
def test_bad_manifest_path_is_rejected_before_any_io(tmp_path, spy: list[str], bad: str, where: str):
    url = str(tmp_path / "c")
    f, _ = _save(url)

    def edit(d: dict) -> None:
        if where == "files-only":
            d["files"][bad] = {"size": 0}  # listed, referenced by nothing: still refused
        else:
            d["files"] = {bad: d["files"][f]}
            for t in d["tensors"].values():
                t["shards"][0]["file"] = bad

    _edit_manifest(url, edit)
    spy.clear()
    for call in (lambda: ckpt.load(_dst(), url), lambda: ckpt.load(_dst(), url, verify=True),
                 lambda: ckpt.inspect(url)):
        with pytest.raises(ckpt.ManifestError, match="escapes|not a non-empty"):
            call()
    rep = ckpt.verify(url, deep=True)
    assert [p.kind for p in rep.problems] == ["manifest"]
    assert "escapes" in rep.problems[0].message or "not a non-empty" in rep.problems[0].message
    assert set(spy) == {MANIFEST_NAME}, f"touched {sorted(set(spy))} before refusing the manifest"


def _escape_through_file_symlink(url: str, f: str, outside: str) -> None:
    os.replace(os.path.join(url, f), outside)
    os.symlink(outside, os.path.join(url, f))


def _escape_through_dir_symlink(url: str, f: str, outside: str) -> None:
    os.makedirs(outside)
    os.replace(os.path.join(url, f), os.path.join(outside, os.path.basename(f)))
    os.rmdir(os.path.join(url, "data"))
    os.symlink(outside, os.path.join(url, "data"))


def _escape_through_relative_symlink(url: str, f: str, outside: str) -> None:
    os.replace(os.path.join(url, f), outside)
    os.symlink(os.path.relpath(outside, os.path.dirname(os.path.join(url, f))), os.path.join(url, f))


@pytest.mark.parametrize("escape", [_escape_through_file_symlink, _escape_through_dir_symlink,
                                    _escape_through_relative_symlink], ids=["file", "data-dir", "relative"])
def test_symlink_out_of_the_checkpoint_is_rejected(tmp_path, monkeypatch: pytest.MonkeyPatch, escape: Any):
    url = str(tmp_path / "c")
    f, _ = _save(url)
    outside = str(tmp_path / "outside")
    escape(url, f, outside)
    opened: list[str] = []
    real_open = os.open

    def spy_open(path: Any, *a: Any, **k: Any) -> int:
        opened.append(os.path.realpath(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", spy_open)
    for verify in (False, True):
        with pytest.raises(ckpt.ManifestError, match="outside the checkpoint"):
            ckpt.load(_dst(), url, verify=verify)
    assert not [p for p in opened if p.startswith(outside)], "a file outside the checkpoint was opened"


def test_save_refuses_to_write_through_a_symlink_out_of_the_checkpoint(tmp_path):
    url = tmp_path / "c"
    url.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, url / "data")
    with pytest.raises(ckpt.CheckpointError, match="outside the checkpoint"):
        ckpt.save({"a": torch.ones(3)}, str(url))
    assert list(outside.iterdir()) == [] and not (url / MANIFEST_NAME).exists()


def test_manifest_symlinked_from_outside_is_refused(tmp_path):
    url = str(tmp_path / "c")
    _save(url)
    other = str(tmp_path / "other")
    _save(other)
    os.unlink(os.path.join(url, MANIFEST_NAME))
    os.symlink(os.path.join(other, MANIFEST_NAME), os.path.join(url, MANIFEST_NAME))
    with pytest.raises(ckpt.ManifestError, match="outside the checkpoint"):
        ckpt.load(_dst(), url)


def test_symlinks_that_stay_inside_work(tmp_path):
    root = tmp_path / "run"
    url = str(root / "step-1")
    f, state = _save(url)
    # a data file that is a (relative) symlink to another file of the same checkpoint
    os.replace(os.path.join(url, f), os.path.join(url, "data", "real.bin"))
    os.symlink("real.bin", os.path.join(url, f))
    # and the checkpoint reached through a symlinked root ("latest" -> step-1)
    os.symlink("step-1", root / "latest")
    for u in (url, str(root / "latest")):
        dst = _dst()
        ckpt.load(dst, u, verify=True)
        assert torch.equal(dst["a"], state["a"]) and torch.equal(dst["b"], state["b"])
        assert ckpt.verify(u, deep=True).ok


def test_symlink_loop_is_an_error_not_a_hang(tmp_path):
    url = str(tmp_path / "c")
    f, _ = _save(url)
    os.unlink(os.path.join(url, f))
    os.symlink(os.path.basename(f), os.path.join(url, f))  # points at itself
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(_dst(), url)


def test_verify_reports_a_symlink_escape(tmp_path):
    # Found by these tests: verify raised ManifestError for a symlink escape instead of reporting it; fixed since.
    url = str(tmp_path / "c")
    f, _ = _save(url)
    _escape_through_file_symlink(url, f, str(tmp_path / "outside"))
    rep = ckpt.verify(url, deep=True)
    assert not rep.ok and "outside the checkpoint" in rep.problems[0].message


# ------------------------------------------------------------------------------------------------
# the Hugging Face index (import-hf reads file names from model.safetensors.index.json)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ckpt.hf.convert import INDEX_NAME, export_hf
    from tests.resharders.moe_states import save_single

    base = tmp_path_factory.mktemp("hf")
    save_single(str(base / "src"))
    export_hf(str(base / "src"), str(base / "model"), max_shard_size=200_000)  # several files + index
    assert (base / "model" / INDEX_NAME).exists()
    return str(base / "model")


def _edit_index(model: str, edit: Any) -> None:
    import json

    from ckpt.hf.convert import INDEX_NAME

    p = os.path.join(model, INDEX_NAME)
    with open(p) as f:
        d = json.load(f)
    edit(d)
    with open(p, "w") as f:
        json.dump(d, f)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "a/../../x.safetensors", "c:/x",
                                 "./model.safetensors", "x\\..\\y"])
def test_hf_index_paths_are_rejected_before_io(hf_model: str, tmp_path, spy: list[str], bad: str):
    import shutil

    from ckpt.hf.convert import import_hf

    model = str(tmp_path / "model")
    shutil.copytree(hf_model, model)
    _edit_index(model, lambda d: d["weight_map"].update({k: bad for k in list(d["weight_map"])[:1]}))
    spy.clear()
    with pytest.raises(ckpt.ManifestError, match="escapes|not normalized"):
        import_hf(model, str(tmp_path / "dst"))
    assert bad not in spy, f"import-hf touched {bad!r} before refusing it"
    assert not os.path.exists(tmp_path / "dst" / MANIFEST_NAME)


def test_hf_weights_symlinked_out_of_the_model_dir_are_rejected(hf_model: str, tmp_path):
    import json
    import shutil

    from ckpt.hf.convert import INDEX_NAME, import_hf

    model = str(tmp_path / "model")
    shutil.copytree(hf_model, model)
    with open(os.path.join(model, INDEX_NAME)) as f:
        name = sorted(set(json.load(f)["weight_map"].values()))[0]
    os.replace(os.path.join(model, name), tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", os.path.join(model, name))
    with pytest.raises(ckpt.ManifestError, match="outside"):
        import_hf(model, str(tmp_path / "dst"))
