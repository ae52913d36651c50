"""``ckpt verify``: every kind of problem it promises to find, in the library report, in ``--json`` and
in the human summary; all problems at once, not only the first; exit codes.

(tests/cli/test_cli.py covers the basics: a good checkpoint, a flipped byte, truncation, deletion, overlap.)
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.manifest import MANIFEST_NAME
from tests.integrity.sample import save_two_rank_sample

pytestmark = pytest.mark.multiproc

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def two(tmp_path) -> str:
    url = str(tmp_path / "c")
    save_two_rank_sample(url)
    return url


def _manifest(url: str) -> dict:
    from tests.manifest_edit import read_manifest

    return read_manifest(url)


def _write_manifest(url: str, d: dict) -> None:
    from tests.manifest_edit import write_manifest

    write_manifest(url, d)


def _files(url: str) -> list[str]:
    return sorted(ckpt.inspect(url).files)


def _flip(path: str, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


def _garbage_manifest(url: str) -> None:
    with open(os.path.join(url, MANIFEST_NAME), "wb") as f:
        f.write(b"\xc1 not msgpack")


def _gap(url: str) -> None:
    d = _manifest(url)
    d["tensors"]["w"]["shards"].pop()  # rows 5..9 of w are no longer covered
    _write_manifest(url, d)


def _renamed_header_entry(url: str) -> None:
    path = os.path.join(url, _files(url)[0])
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(raw.replace(b'"w@0"', b'"v@0"', 1))


def _broken_header_json(url: str) -> None:
    path = os.path.join(url, _files(url)[1])
    _flip(path, 8)  # the '{' opening the JSON header


def _object_checksum(url: str) -> None:
    d = _manifest(url)
    d["objects"]["step"]["checksum"] ^= 1
    _write_manifest(url, d)


def _undecodable_object(url: str) -> None:
    d = _manifest(url)
    d["objects"]["rng"]["per_rank"][1] = b"\xc1"
    _write_manifest(url, d)


def _tensor_byte(url: str) -> None:
    s = ckpt.inspect(url).tensors["z"].shards[1]
    _flip(os.path.join(url, s.file), s.offset + s.length - 1)


def _size(url: str) -> None:
    with open(os.path.join(url, _files(url)[1]), "ab") as f:
        f.write(b"\0" * 8)


def _missing(url: str) -> None:
    os.unlink(os.path.join(url, _files(url)[1]))


DAMAGE: dict[str, tuple[Callable[[str], None], str, bool]] = {
    # name: (damage, expected problem kind, found by a shallow verify too)
    "garbage-manifest": (_garbage_manifest, "manifest", True),
    "missing-file": (_missing, "missing-file", True),
    "size": (_size, "size", True),
    "header-json": (_broken_header_json, "header", True),
    "header-entry": (_renamed_header_entry, "header", True),
    "coverage-gap": (_gap, "coverage", True),
    "object-checksum": (_object_checksum, "object", True),
    "object-undecodable": (_undecodable_object, "object", True),
    "tensor-byte": (_tensor_byte, "checksum", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DAMAGE))
def test_each_kind_of_problem_is_reported(two: str, name: str):
    damage, kind, shallow = DAMAGE[name]
    damage(two)
    deep = ckpt.verify(two, deep=True)
    assert not deep.ok and kind in {p.kind for p in deep.problems}, deep.to_dict()
    assert ckpt.verify(two).ok is not shallow
    r = runner.invoke(app, ["verify", two, "--deep", "--json"])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.output)
    assert rep["ok"] is False and rep["deep"] is True and rep["url"] == two
    assert {p["kind"] for p in rep["problems"]} == {p.kind for p in deep.problems}
    for p in rep["problems"]:
        assert set(p) == {"kind", "message", "tensor", "file"} and p["message"]
        if p["kind"] in ("checksum", "coverage"):
            assert p["tensor"] and p["tensor"] in p["message"]
        if p["kind"] in ("missing-file", "size", "header"):
            assert p["file"] and os.path.basename(p["file"]) in p["message"]
    r = runner.invoke(app, ["verify", two, "--deep"])
    assert r.exit_code == 1 and "FAILED" in r.output and kind in r.output and "Traceback" not in r.output


def test_all_problems_are_reported_not_only_the_first(two: str):
    for name in ("size", "coverage-gap", "object-checksum", "tensor-byte", "header-entry"):
        DAMAGE[name][0](two)
    kinds = [p.kind for p in ckpt.verify(two, deep=True).problems]
    assert {"size", "coverage", "object", "header"} <= set(kinds), kinds


def test_good_report_counts_everything(two: str):
    m = ckpt.inspect(two)
    rep = ckpt.verify(two, deep=True)
    assert rep.ok and rep.tensors == len(m.tensors) == 4 and rep.files == 2
    assert rep.shards == sum(len(t.shards) for t in m.tensors.values()) == 7
    assert rep.bytes_hashed == m.total_bytes
    assert ckpt.verify(two).bytes_hashed == 0  # shallow reads headers only
    r = runner.invoke(app, ["verify", two, "--deep"])
    assert r.exit_code == 0 and "ok" in r.output and "4 tensors, 7 shards, 2 files" in r.output
    assert "hashed" in r.output


def test_shard_without_checksum_is_refused_by_verified_load(two: str):
    d = _manifest(two)
    del d["tensors"]["w"]["shards"][0]["checksum"]
    _write_manifest(two, d)
    with pytest.raises(ckpt.IntegrityError, match="no checksum"):
        ckpt.load({"w": torch.zeros(10, 6)}, two, verify=True, strict=False)
    # verify --deep says so too, instead of passing a shard it could not check
    rep = ckpt.verify(two, deep=True)
    assert [(p.kind, p.tensor) for p in rep.problems] == [("checksum", "w")]
    assert "shard 0: no checksum in the manifest" in rep.problems[0].message
    assert ckpt.verify(two).ok  # the shallow check has nothing to say about checksums


def test_header_prefix_pointing_past_the_file_is_a_header_problem(two: str):
    path = os.path.join(two, _files(two)[0])
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path)))
    rep = ckpt.verify(two)
    assert [p.kind for p in rep.problems] == ["header"] and "exceeds the file" in rep.problems[0].message
