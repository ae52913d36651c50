"""Format 2: the checksummed envelope and the shard columns (lazy decode, indexed lookup, validation)."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ckpt
from ckpt._checksum import crc32
from ckpt._columns import decode_column, encode_column
from ckpt._load_plan import LoadRequest, plan_load
from ckpt.cli.app import app
from ckpt.formats.msgpack_codec import decode_manifest, encode_manifest
from ckpt.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, ShardEntry, TensorEntry
from ckpt.shards import Box, Flat


def _manifest() -> Manifest:
    files = {"data/a.safetensors": 10_000, "data/b.safetensors": 10_000}
    t = {
        "box": TensorEntry("float32", (4, 6), [
            ShardEntry(Box((0, 0), (2, 6)), "data/a.safetensors", 8, 48, 123),
            ShardEntry(Box((2, 0), (2, 6)), "data/b.safetensors", 8, 48, None)]),
        "flat": TensorEntry("bfloat16", (3, 5), [
            ShardEntry(Flat(0, 7), "data/a.safetensors", 64, 14, 0xFFFFFFFF),
            ShardEntry(Flat(7, 15), "data/b.safetensors", 64, 16, 0)]),
        "fib": TensorEntry("float32", (4, 4), [
            ShardEntry(Flat(0, 5, Box((0, 0), (2, 4))), "data/a.safetensors", 128, 20, 1),
            ShardEntry(Flat(5, 8, Box((0, 0), (2, 4))), "data/b.safetensors", 128, 12, 2),
            ShardEntry(Box((2, 0), (2, 4)), "data/a.safetensors", 256, 32, 3)]),
        "scalar": TensorEntry("int64", (), [ShardEntry(Box((), ()), "data/b.safetensors", 512, 8, 9)]),
        "empty": TensorEntry("float32", (0, 3), [ShardEntry(Box((0, 0), (0, 3)), "data/a.safetensors", 600, 0, None)]),
    }
    return Manifest(tensors=t, files=files, step=3, user_metadata={"k": "v"})


def _body(raw: bytes) -> dict:
    return msgpack.unpackb(msgpack.unpackb(raw)["body"], strict_map_key=False)


def _wrap(body: dict) -> bytes:
    b = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"format": "ckpt", "version": list(FORMAT_VERSION), "hash": "crc32", "checksum": crc32(b),
                          "body": b}, use_bin_type=True)


def test_round_trip_of_every_region_kind_is_exact():
    m = _manifest()
    raw = encode_manifest(m)
    d = decode_manifest(raw)
    assert d.version == FORMAT_VERSION == (2, 0)
    assert all(t._shards is None for t in d.tensors.values())  # nothing built yet
    assert {k: t.nbytes for k, t in d.tensors.items()} == {k: t.nbytes for k, t in m.tensors.items()}
    assert d.tensors == m.tensors  # builds the rows: regions, files, offsets, lengths, checksums (None kept)
    assert d.files == m.files and d.step == 3 and d.user_metadata == {"k": "v"}


def test_reencoding_a_decoded_manifest_keeps_its_columns_and_bytes():
    raw = encode_manifest(_manifest())
    d = decode_manifest(raw)
    assert encode_manifest(d) == raw
    assert all(t._shards is None for t in d.tensors.values())


def test_columns_use_the_narrowest_width():
    assert encode_column(np.array([0, 255]))[0] == "u1"
    assert encode_column(np.array([256]))[0] == "u2"
    assert encode_column(np.array([2**32]))[0] == "u8"
    w = encode_column(np.array([5, 2**40]))
    assert decode_column(w, 2, "c").tolist() == [5, 2**40]


def test_a_flipped_manifest_byte_is_a_manifest_integrity_error(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"a": torch.arange(6.0), "o": {"x": 1}}, url, step=5)
    path = os.path.join(url, MANIFEST_NAME)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[-3] ^= 0x01  # inside the body
    with open(path, "wb") as f:
        f.write(bytes(raw))
    with pytest.raises(ckpt.ManifestIntegrityError, match="checksum does not match"):
        ckpt.inspect(url)
    with pytest.raises(ckpt.IntegrityError):  # it is both a ManifestError and an IntegrityError
        ckpt.load({"a": torch.zeros(6)}, url)
    rep = ckpt.verify(url)
    assert not rep.ok and [p.kind for p in rep.problems] == ["manifest"]
    r = CliRunner().invoke(app, ["inspect", url])
    assert r.exit_code == 3 and "checksum does not match" in r.output


@pytest.mark.parametrize("edit, match", [
    (lambda e: e.__setitem__("hash", "md5"), "checksum algorithm 'md5' unknown"),
    (lambda e: e.__setitem__("checksum", "x"), "body or checksum malformed"),
    (lambda e: e.__setitem__("version", [3, 0]), "version 3.0 is not supported"),
    (lambda e: e.__setitem__("format", "dcp"), "format is 'dcp'"),
])
def test_bad_envelopes_are_refused(edit, match):
    env = msgpack.unpackb(encode_manifest(_manifest()))
    edit(env)
    with pytest.raises(ckpt.ManifestError, match=match):
        decode_manifest(msgpack.packb(env, use_bin_type=True))


def test_a_format_2_body_without_envelope_is_refused():
    body = _body(encode_manifest(_manifest()))
    body.update(format="ckpt", version=[2, 0])
    with pytest.raises(ckpt.ManifestError, match="without its checksum envelope"):
        decode_manifest(msgpack.packb(body, use_bin_type=True))


def _cols(body: dict, key: str) -> dict:
    return body["tensors"][key]["shards"]


def _set(key: str, col: str, values: list[int], code: str | None = None):
    def edit(body: dict) -> None:
        if code is not None:
            w = [code, np.array(values, dtype="<" + code).tobytes()]
        else:
            w = encode_column(np.array(values, dtype=np.int64))
        _cols(body, key)[col] = w
    return edit


@pytest.mark.parametrize("edit, match", [
    (_set("box", "box", [2, 0, 3, 6, 2, 0, 2, 6]), r"'box' shard 0: box \[\[2, 0\], \[3, 6\]\] exceeds the shape"),
    (_set("box", "box", [0, 0, 2, 6, 3, 0, 2, 6]), r"'box' shard 1: box .* exceeds the shape \[4, 6\]"),
    (_set("flat", "flat", [0, 7, 7, 16]), r"'flat' shard 1: flat range \[7, 16\] is not \[start, stop\) within 15"),
    (_set("flat", "flat", [5, 4, 7, 15]), r"'flat' shard 0: flat range \[5, 4\]"),
    (_set("fib", "flat", [0, 5, 5, 9, 0, 0]), r"'fib' shard 1: flat range \[5, 9\] .* within 8 elements"),
    (_set("box", "length", [48, 44]), r"'box' shard 1: length 44 bytes does not match 12 elements"),
    (_set("flat", "length", [14, 15]), r"'flat' shard 1: length 15 bytes does not match"),
    (_set("box", "file", [0, 2]), r"'box' shard 1: file index 2 is not in the manifest's 2 files"),
    (_set("box", "offset", [8, 9_960]), r"'box' shard 1: bytes \[9960, 10008\) lie beyond the end of"),
    (_set("box", "offset", [8, 2**63 - 1]), r"'box' shard 1: bytes .* lie beyond the end"),
    (_set("box", "offset", [8, 2**63], "u8"), r"'box' column 'offset': a value exceeds 2\*\*63 - 1"),
    (_set("box", "checksum", [1, 2**32]), r"'box' shard 1: checksum is not a 32-bit value"),
    (_set("fib", "kind", [2, 3, 0]), r"'fib' shard 1: region kind unknown"),
    (_set("box", "file", [0, 1, 1]), r"'box' column 'file': column holds 3 bytes, expected 2 values of u1"),
    (lambda b: _cols(b, "box").__setitem__("file", ["i4", b"\0" * 8]), r"column width 'i4' unknown"),
    (lambda b: _cols(b, "box").__setitem__("file", [1, 2]), r"'box' column 'file': column is not \[width, bytes\]"),
    (lambda b: _cols(b, "box").pop("length"), r"'box': shard column 'length' is missing"),
    (lambda b: _cols(b, "fib").pop("flat"), r"'fib': shard column 'flat' is missing"),
    (lambda b: _cols(b, "box").__setitem__("n", -1), r"shard count -1 is not a non-negative integer"),
    (lambda b: _cols(b, "box").__setitem__("n", 10**6), r"column holds 2 bytes, expected 1000000 values"),
    (lambda b: b["tensors"]["box"].__setitem__("shards", []), r"'box': field 'shards' has type list"),
    (lambda b: b.__setitem__("files", [["data/a.safetensors", 1], ["data/a.safetensors", 2]]), "listed twice"),
    (lambda b: b.__setitem__("files", [["../x", 1]]), "escapes"),
    (lambda b: b.__setitem__("files", [["data/a.safetensors"]]), r"files is not a list of \[path, size\]"),
])
def test_bad_columns_are_refused_naming_tensor_and_shard(edit, match):
    body = _body(encode_manifest(_manifest()))
    edit(body)
    with pytest.raises(ckpt.ManifestError, match=match):
        decode_manifest(_wrap(body))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_bodies_with_a_valid_checksum_raise_only_manifest_errors(data):
    b = bytearray(msgpack.packb(_body(encode_manifest(_manifest())), use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(b) - 1))
        b[pos] = data.draw(st.integers(0, 255))
    raw = msgpack.packb({"format": "ckpt", "version": [2, 0], "hash": "crc32", "checksum": crc32(bytes(b)),
                         "body": bytes(b)}, use_bin_type=True)
    try:
        m = decode_manifest(raw)
    except ckpt.ManifestError:
        return
    for t in m.tensors.values():  # whatever passed validation also builds rows without surprises
        assert len(t.shards) == t.num_shards


def _grid_manifest(rows: int, cols: int, bands: int, tiles: int) -> Manifest:
    shards, off = [], 0
    for i in range(bands):
        r0, r1 = i * rows // bands, (i + 1) * rows // bands
        for j in range(tiles):
            c0, c1 = j * cols // tiles, (j + 1) * cols // tiles
            n = (r1 - r0) * (c1 - c0) * 4
            shards.append(ShardEntry(Box((r0, c0), (r1 - r0, c1 - c0)), "data/x.safetensors", off, n, 0))
            off += n
    flat = [ShardEntry(Flat(k * rows * cols // 7, (k + 1) * rows * cols // 7), "data/x.safetensors", off, 0, 0)
            for k in range(7)]
    for s in flat:
        s.length = s.region.numel * 4
        s.offset, off = off, off + s.length
    zero = []  # ZeRO over TP blocks: each band's box split into 3 flat ranges of its own flattening
    for i in range(bands):
        r0, r1 = i * rows // bands, (i + 1) * rows // bands
        band = Box((r0, 0), (r1 - r0, cols))
        for k in range(3):
            a, b = k * band.numel // 3, (k + 1) * band.numel // 3
            zero.append(ShardEntry(Flat(a, b, band), "data/x.safetensors", off, (b - a) * 4, 0))
            off += (b - a) * 4
    return Manifest(tensors={"w": TensorEntry("float32", (rows, cols), shards),
                             "f": TensorEntry("float32", (rows, cols), flat),
                             "z": TensorEntry("float32", (rows, cols), zero)},
                    files={"data/x.safetensors": off})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 30), st.integers(1, 8), st.integers(1, 5), st.data())
def test_lookup_on_columns_plans_exactly_what_the_full_scan_plans(rows, cols, bands, tiles, data):
    bands, tiles = min(bands, rows), min(tiles, cols)
    m = _grid_manifest(rows, cols, bands, tiles)
    lazy = decode_manifest(encode_manifest(m))
    r0 = data.draw(st.integers(0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    want = Box((r0, c0), (data.draw(st.integers(1, rows - r0)), data.draw(st.integers(1, cols - c0))))
    start = data.draw(st.integers(0, rows * cols - 1))
    fwant = Flat(start, data.draw(st.integers(start + 1, rows * cols)))
    i = data.draw(st.integers(0, bands - 1))
    band = Box((i * rows // bands, 0), ((i + 1) * rows // bands - i * rows // bands, cols))
    a = data.draw(st.integers(0, band.numel - 1))
    zwant = Flat(a, data.draw(st.integers(a + 1, band.numel)), band)  # the same block, split another way
    reqs = [LoadRequest("w", "float32", (rows, cols), want), LoadRequest("f", "float32", (rows, cols), fwant),
            LoadRequest("w", "float32", (rows, cols), fwant), LoadRequest("f", "float32", (rows, cols), want),
            LoadRequest("z", "float32", (rows, cols), zwant), LoadRequest("z", "float32", (rows, cols), want),
            LoadRequest("z", "float32", (rows, cols), fwant), LoadRequest("w", "float32", (rows, cols), zwant)]
    got = plan_load(lazy, reqs)
    assert all(t._shards is None for t in lazy.tensors.values())  # planned from the columns
    expected = plan_load(m, reqs)
    assert [(o.file, o.start, o.length, o.ranges) for o in got.ops] == \
        [(o.file, o.start, o.length, o.ranges) for o in expected.ops]
    # the lookup is a superset of the shards that intersect, and much smaller than all of them on big grids
    cand = lazy.tensors["w"].shards_overlapping(want)
    inter = [s for s in m.tensors["w"].shards if all(
        o < w0 + wl and w0 < o + n for o, n, w0, wl in zip(s.region.offsets, s.region.lengths, want.offsets,
                                                         want.lengths, strict=True))]
    assert {(s.offset) for s in inter} <= {s.offset for s in cand}
    # same block split two ways: only the flat pieces whose ranges overlap are candidates
    zc = lazy.tensors["z"].shards_overlapping(zwant)
    assert {s.offset for s in zc} == {s.offset for s in m.tensors["z"].shards
                                      if s.region.start < zwant.stop and zwant.start < s.region.stop
                                      and s.region.box == band}


def test_load_of_a_format_1_manifest_still_works(tmp_path):
    from tests.manifest_edit import edit_manifest

    url = str(tmp_path / "c")
    src = {"a": torch.randn(5, 3), "o": (1, 2)}
    ckpt.save(src, url)
    edit_manifest(url, lambda d: None)  # rewritten as format 1: no envelope, shard maps
    assert ckpt.inspect(url).version == (1, 0)
    out = {"a": torch.zeros(5, 3), "o": None}
    got = ckpt.load(out, url, verify=True)
    assert torch.equal(out["a"], src["a"]) and got["o"] == (1, 2)
    assert ckpt.verify(url, deep=True).ok


def test_overwrite_replaces_a_checkpoint_whose_manifest_is_damaged(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"a": torch.zeros(4)}, url)
    path = os.path.join(url, MANIFEST_NAME)
    with open(path, "r+b") as f:
        f.seek(-2, os.SEEK_END)
        b = f.read(1)
        f.seek(-2, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ckpt.ManifestIntegrityError):  # never silently replaced
        ckpt.save({"a": torch.ones(4)}, url)
    ckpt.save({"a": torch.ones(4)}, url, overwrite=True)
    out = {"a": torch.zeros(4)}
    ckpt.load(out, url, verify=True)
    assert torch.equal(out["a"], torch.ones(4))


def test_encoding_a_shard_whose_file_is_not_listed_names_tensor_and_file():
    m = _manifest()
    del m.files["data/b.safetensors"]
    with pytest.raises(ckpt.ManifestError, match=r"tensor 'box': shard file 'data/b.safetensors' is not listed"):
        encode_manifest(m)
