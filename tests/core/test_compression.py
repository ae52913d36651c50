"""Compressed data files (ckpt._codec): bitwise round trips over dtypes and layouts, the manifest
record and its version, integrity of frames (flipped, truncated, hostile), and DCP's ZStandard."""

from __future__ import annotations

import io
import os
import sys
import tempfile
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import ckpt
import ckpt._codec as codec
from ckpt._codec import UnsupportedCodecError
from ckpt.errors import IntegrityError, ManifestError, StateError
from ckpt.formats.msgpack_codec import decode_manifest, encode_manifest
from ckpt.manifest import MANIFEST_NAME
from tests.dist_utils import run_ranks

pytest.importorskip("zstandard")

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g) * 0.02
        if t.numel():  # special values survive bitwise
            t.view(-1)[0] = float("inf") if dtype not in (torch.float8_e4m3fn,) else 448.0
            t.view(-1)[-1] = -0.0
        return t.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _manifest(url: str):
    with open(os.path.join(url, MANIFEST_NAME), "rb") as f:
        return decode_manifest(f.read())


def _write_manifest(url: str, m) -> None:
    with open(os.path.join(url, MANIFEST_NAME), "wb") as f:
        f.write(encode_manifest(m))


@pytest.fixture
def small_frames(monkeypatch):
    """Frames of 64 raw bytes: small tensors span many frames (a piece's frame boundaries, a read
    crossing frames, the last frame short)."""
    monkeypatch.setattr(codec, "FRAME_RAW", 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_bitwise(tmp_path, small_frames, dtype):
    state = {"w": _tensor(dtype, (7, 13)), "e": _tensor(dtype, (0, 3)), "s": _tensor(dtype, ()), "step": 3}
    url = str(tmp_path / "c")
    ckpt.save(state, url, compression="zstd")
    m = _manifest(url)
    assert m.version == (2, 1) and set(m.codecs) == set(m.files)
    assert all(p.endswith(".zst") for p in m.files) and sorted(os.listdir(f"{url}/data")) == sorted(
        p.split("/")[1] for p in m.files)
    out = ckpt.load({"w": torch.zeros(7, 13, dtype=dtype), "e": torch.zeros(0, 3, dtype=dtype),
                     "s": torch.zeros((), dtype=dtype), "step": None}, url, verify=True)
    for k in ("w", "e", "s"):
        assert _bits(out[k]) == _bits(state[k]), k
    assert out["step"] == 3
    report = ckpt.verify(url, deep=True)
    assert report.ok, report.problems
    assert report.bytes_hashed == sum(t.numel() * t.element_size() for t in (state["w"], state["s"]))


def test_uncompressed_format_is_unchanged(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"w": torch.ones(4)}, url)
    with open(f"{url}/{MANIFEST_NAME}", "rb") as f:
        env = msgpack.unpackb(f.read())
    assert env["version"] == [2, 0]
    assert all(len(e) == 2 for e in msgpack.unpackb(env["body"])["files"])
    assert _manifest(url).codecs == {}


def test_planes_shrink_bf16_weights_and_both_round_trip(tmp_path):
    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    sizes = {}
    for name, comp in (("raw", None), ("zstd", codec.Codec(planes=False)), ("planes", "zstd")):
        url = str(tmp_path / name)
        ckpt.save({"w": w}, url, compression=comp)
        sizes[name] = sum(_manifest(url).files.values())
        assert _bits(ckpt.load({"w": torch.zeros_like(w)}, url, verify=True)["w"]) == _bits(w)
    assert sizes["planes"] < sizes["zstd"] <= sizes["raw"]
    assert sizes["planes"] < 0.85 * sizes["raw"]  # the exponent plane of 0.02-scale weights is near constant


def test_resharded_flat_and_box_loads(tmp_path, small_frames):
    g = _tensor(torch.float32, (10, 8), seed=2)
    url = str(tmp_path / "c")
    ckpt.save({"a": g, "b": ckpt.FlatShard(g.reshape(-1).clone(), (10, 8), 0)}, url, compression="zstd")
    out = ckpt.load({"a": ckpt.Shard(torch.zeros(4, 3), (10, 8), (5, 2)),
                     "b": ckpt.FlatShard(torch.zeros(13), (10, 8), 29)}, url, verify=True)
    assert torch.equal(out["a"].local, g[5:9, 2:5])
    assert torch.equal(out["b"].local, g.reshape(-1)[29:42])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 9), cols=st.integers(1, 9), seed=st.integers(0, 99),
       frame=st.sampled_from([8, 24, 64, 4096]), planes=st.booleans(), level=st.integers(1, 5),
       region=st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(1, 9), st.integers(1, 9)),
       flat=st.tuples(st.integers(0, 80), st.integers(0, 80)))
def test_generated_tensors_round_trip_through_any_read(monkeypatch, dtype, rows, cols, seed, frame, planes, level,
                                                       region, flat):
    """Any tensor, frame size, plane setting, and any box or flat region read back bitwise."""
    monkeypatch.setattr(codec, "FRAME_RAW", frame)
    t = _tensor(dtype, (rows, cols), seed)
    r0, c0 = min(region[0], rows - 1), min(region[1], cols - 1)
    nr, nc = min(region[2], rows - r0), min(region[3], cols - c0)
    a, b = sorted((min(flat[0], rows * cols), min(flat[1], rows * cols)))
    with tempfile.TemporaryDirectory() as d:
        ckpt.save({"t": t}, d + "/c", compression=codec.Codec(level=level, planes=planes))
        out = ckpt.load({"t": ckpt.Shard(torch.zeros(nr, nc, dtype=dtype), (rows, cols), (r0, c0)),
                         "f": None}, d + "/c", strict=False)
        assert _bits(out["t"].local) == _bits(t[r0 : r0 + nr, c0 : c0 + nc])
        out = ckpt.load({"t": ckpt.FlatShard(torch.zeros(b - a, dtype=dtype), (rows, cols), a)}, d + "/c",
                        verify=True)
        assert _bits(out["t"].local) == _bits(t.reshape(-1)[a:b])


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_is_found_by_verify_deep_and_load(tmp_path, small_frames):
    url = str(tmp_path / "c")
    w = _tensor(torch.bfloat16, (16, 16))
    ckpt.save({"w": w}, url, compression="zstd")
    (path,) = _manifest(url).files
    _flip(f"{url}/{path}", os.path.getsize(f"{url}/{path}") // 2)
    report = ckpt.verify(url, deep=True)
    assert not report.ok and {p.kind for p in report.problems} == {"checksum"}
    assert report.problems[0].file == path and "checksum" in report.problems[0].message
    assert ckpt.verify(url).ok  # shallow: structure and sizes only
    for verify in (True, False):  # the frames' stored CRCs catch it even without verify
        with pytest.raises(IntegrityError, match="frame"):
            ckpt.load({"w": torch.zeros_like(w)}, url, verify=verify)


def _forge_frame(url: str, data: bytes) -> tuple[int, torch.Tensor]:
    """Replace the single data file by ``data`` as its one frame (the manifest's stored CRC made to
    match, as a hostile writer would); returns the frame's recorded raw length and a load target."""
    m = _manifest(url)
    (path,) = m.files
    fc = m.codecs[path]
    assert len(fc.raw_offset) == 1
    with open(f"{url}/{path}", "wb") as f:
        f.write(data)
    from ckpt._checksum import crc32

    fc.length[:] = len(data)
    fc.checksum[:] = crc32(data)
    m.files[path] = len(data)
    _write_manifest(url, m)
    return int(fc.raw_length[0]), torch.zeros(64, dtype=torch.float32)


def test_hostile_frames_give_integrity_error_within_the_recorded_size(tmp_path):
    import zstandard

    url = str(tmp_path / "c")
    ckpt.save({"w": torch.arange(64, dtype=torch.float32)}, url, compression="zstd")
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(256 << 20))  # claims 256 MiB in its header
    good = zstandard.ZstdCompressor().compress(bytes(256))
    short = zstandard.ZstdCompressor().compress(bytes(200))
    for data, why in ((bomb, "more than"), (good[: len(good) // 2], "decompress"), (short, "to 200 bytes"),
                      (b"\x00" * 40, "decompress"), (good + good, "more than"), (good, "checksum mismatch")):
        raw, target = _forge_frame(url, data)
        assert raw == 256
        tracemalloc.start()
        try:
            with pytest.raises(IntegrityError, match=why):
                ckpt.load({"w": target}, url, verify=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, peak  # never near what the frame claims


def test_frames_must_cover_every_shard_and_stay_in_bounds(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"w": torch.arange(64, dtype=torch.float32)}, url, compression="zstd")
    m = _manifest(url)
    fc = next(iter(m.codecs.values()))
    for col, value, msg in (("raw_length", 8, "not stored in its codec's frames"),
                            ("raw_length", 1 << 40, "raw length not in"),
                            ("length", 1 << 30, "stored length"),
                            ("planes", 3, "planes")):
        saved = getattr(fc, col).copy()
        getattr(fc, col)[:] = value
        _write_manifest(url, m)
        with pytest.raises(ManifestError, match=msg):
            ckpt.load({"w": torch.zeros(64)}, url)
        assert not ckpt.verify(url).ok
        getattr(fc, col)[:] = saved
    _write_manifest(url, m)
    assert torch.equal(ckpt.load({"w": torch.zeros(64)}, url)["w"], torch.arange(64, dtype=torch.float32))


def _edit_envelope(url: str, edit) -> None:
    p = f"{url}/{MANIFEST_NAME}"
    with open(p, "rb") as f:
        env = msgpack.unpackb(f.read())
    body = msgpack.unpackb(env["body"], strict_map_key=False)
    edit(env, body)
    from ckpt._checksum import crc32

    env["body"] = msgpack.packb(body, use_bin_type=True)
    env["checksum"] = crc32(env["body"])
    with open(p, "wb") as f:
        f.write(msgpack.packb(env, use_bin_type=True))


def test_unknown_codec_is_refused_with_a_typed_error(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"w": torch.ones(8)}, url, compression="zstd")
    _edit_envelope(url, lambda env, body: body["files"][0][2].__setitem__("name", "brotli9"))
    with pytest.raises(UnsupportedCodecError, match="'brotli9' is not a codec this ckpt knows.*upgrade ckpt"):
        ckpt.load({"w": torch.zeros(8)}, url)
    assert issubclass(UnsupportedCodecError, ckpt.FormatVersionError)
    report = ckpt.verify(url)
    assert [p.kind for p in report.problems] == ["manifest"]


def test_a_2_0_manifest_with_a_codec_is_refused(tmp_path):
    """What a 2.0 reader does with a compressed checkpoint (refuse the files entry), this reader does
    with a manifest that claims 2.0 yet carries codecs: no reader reads frames as raw bytes."""
    url = str(tmp_path / "c")
    ckpt.save({"w": torch.ones(8)}, url, compression="zstd")
    _edit_envelope(url, lambda env, body: env.__setitem__("version", [2, 0]))
    with pytest.raises(ManifestError, match=r"files is not a list of \[path, size\]"):
        ckpt.load({"w": torch.zeros(8)}, url)


def test_bad_arguments(tmp_path, monkeypatch):
    with pytest.raises(StateError, match="compression='lz4' is unknown"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path / "a"), compression="lz4")
    with pytest.raises(StateError, match="data_format='safetensors' only"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path / "b"), compression="zstd", data_format="zarr")
    with pytest.raises(StateError, match="level"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path / "c"), compression=codec.Codec(level=99))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"pip install 'ckpt\[zstd\]'"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path / "d"), compression="zstd")
    assert not any(os.path.exists(tmp_path / n) for n in "abcd")


def test_overwrite_between_formats_keeps_only_the_new_files(tmp_path):
    url = str(tmp_path / "c")
    for i, comp in enumerate(("zstd", None, "zstd", "zstd")):
        w = torch.full((32,), float(i))
        ckpt.save({"w": w}, url, compression=comp, overwrite=True)
        m = _manifest(url)
        assert sorted(os.listdir(f"{url}/data")) == sorted(p.split("/")[1] for p in m.files)
        assert torch.equal(ckpt.load({"w": torch.zeros(32)}, url, verify=True)["w"], w)


def test_async_save_compressed(tmp_path, small_frames):
    url = str(tmp_path / "c")
    w = _tensor(torch.bfloat16, (33, 17))
    h = ckpt.async_save({"w": w, "n": 1}, url, compression="zstd")
    h.staged()
    h.done()
    assert _manifest(url).codecs
    assert _bits(ckpt.load({"w": torch.zeros_like(w)}, url, verify=True)["w"]) == _bits(w)


def test_dcp_zstandard_extension_writes_a_compressed_checkpoint(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard

    import ckpt.dcp as cdcp

    path = str(tmp_path / "c")
    sd = {"w": _tensor(torch.bfloat16, (40, 24)), "b": _tensor(torch.float32, (24,)), "step": 7}
    cdcp.save(sd, storage_writer=cdcp.FileSystemWriter(path, _extensions=[ZStandard()]))
    m = _manifest(path)
    assert m.codecs and all(p.endswith(".zst") for p in m.files)
    got = {"w": torch.zeros(40, 24, dtype=torch.bfloat16), "b": torch.zeros(24), "step": 0}
    cdcp.load(got, checkpoint_id=path)
    assert _bits(got["w"]) == _bits(sd["w"]) and _bits(got["b"]) == _bits(sd["b"]) and got["step"] == 7
    assert ckpt.verify(path, deep=True).ok


def _two_ranks(rank: int, world: int, root: str) -> None:
    g = _tensor(torch.bfloat16, (12, 10), seed=5)
    f = _tensor(torch.float32, (7, 9), seed=6).reshape(-1)
    half = f.numel() // 2
    state = {"g": ckpt.Shard(g[rank * 6 : rank * 6 + 6].clone(), (12, 10), (rank * 6, 0)),
             "f": ckpt.FlatShard(f[:half].clone() if rank == 0 else f[half:].clone(), (7, 9), 0 if rank == 0 else half),
             "r": _tensor(torch.int64, (5,), seed=7)}
    ckpt.save(state, f"{root}/c", compression="zstd")
    # load in another layout: column halves of g, a box of f, the replicated r
    out = ckpt.load({"g": ckpt.Shard(torch.zeros(12, 5, dtype=torch.bfloat16), (12, 10), (0, rank * 5)),
                     "f": ckpt.Shard(torch.zeros(3, 9), (7, 9), (rank * 3 + 1, 0)),
                     "r": torch.zeros(5, dtype=torch.int64)}, f"{root}/c", verify=True)
    assert _bits(out["g"].local) == _bits(g[:, rank * 5 : rank * 5 + 5])
    assert _bits(out["f"].local) == _bits(f.reshape(7, 9)[rank * 3 + 1 : rank * 3 + 4])
    assert torch.equal(out["r"], state["r"])


@pytest.mark.multiproc
def test_two_ranks_save_compressed_and_load_resharded(tmp_path):
    run_ranks(2, _two_ranks, str(tmp_path))
    m = _manifest(str(tmp_path / "c"))
    assert len(m.codecs) == 2 and ckpt.verify(str(tmp_path / "c"), deep=True).ok


def test_frame_table_round_trips_through_the_wire(tmp_path, small_frames):
    url = str(tmp_path / "c")
    ckpt.save({"w": _tensor(torch.float32, (9, 9))}, url, compression="zstd")
    m = _manifest(url)
    again = decode_manifest(encode_manifest(m))
    (p,) = m.codecs
    a, b = m.codecs[p], again.codecs[p]
    assert (a.name, a.level, a.raw_size) == (b.name, b.level, b.raw_size)
    for col in ("raw_offset", "raw_length", "offset", "length", "planes", "checksum"):
        assert np.array_equal(getattr(a, col), getattr(b, col))
    assert len(a.raw_offset) == -(-9 * 9 * 4 // 64)  # frames of 64 raw bytes
    assert set(a.planes.tolist()) == {4}
    import zstandard

    # the file is the frames back to back: plain zstd decompresses it (to the planes)
    with open(f"{url}/{p}", "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(f.read()), read_across_frames=True).read()
    assert len(raw) == 9 * 9 * 4


def test_streaming_readers_reshard_and_diff_a_compressed_checkpoint(tmp_path, small_frames):
    """Readers that plan from the manifest and execute through ckpt._io (reshard, diff, exports)
    read raw bytes of compressed files too (ckpt._codec.decoding), in parts of one element."""
    from ckpt.layout import Layout
    from ckpt.resharders.diff import EQUAL, diff
    from ckpt.resharders.reshard import reshard

    g = torch.Generator().manual_seed(0)
    state = {"model.lm_head.weight": torch.randn(10, 6, generator=g),
             "model.model.layers.0.mlp.experts.gate_proj": torch.randn(4, 6, 3, generator=g).bfloat16(),
             "ids": torch.arange(12), "step": 3}
    a, b, c = (str(tmp_path / n) for n in "abc")
    ckpt.save(state, a, compression="zstd")
    ckpt.save(state, c)
    reshard(a, b, Layout.parse("tp=2,ep=2"))
    for other in (b, c):
        r = diff(a, other, chunk_bytes=1)
        assert r.ok and set(r.counts()) == {EQUAL}, r.counts()
    out = ckpt.load({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}, b,
                    verify=True)
    assert all(_bits(out[k]) == _bits(v) for k, v in state.items() if isinstance(v, torch.Tensor))


_FIELDS = ("raw_offset", "raw_length", "offset", "length", "planes", "checksum")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(("name", "level", "raw_size", "n", "frames", "record", *_FIELDS)),
       value=st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=40), st.text(max_size=8), st.none(),
                       st.lists(st.integers(0, 300), max_size=4)),
       flip=st.integers(0, 10_000))
def test_any_edit_of_a_codec_record_is_refused_or_read_exactly(tmp_path_factory, field, value, flip):
    """Whatever a codec record says, the manifest is refused with a ManifestError, or the load
    gives the saved values or an IntegrityError: never other bytes, never another exception."""
    url = str(tmp_path_factory.mktemp("c") / "c")
    w = torch.arange(96, dtype=torch.float32)
    ckpt.save({"w": w}, url, compression=codec.Codec(level=1))

    def edit(env, body):
        rec = body["files"][0][2]
        if field == "record":
            body["files"][0][2] = value
        elif field in _FIELDS:
            col = rec["frames"][field]
            if isinstance(value, bytes) and value:
                col[1] = bytes(b ^ value[i % len(value)] if i == flip % max(len(col[1]), 1) else b
                               for i, b in enumerate(col[1]))
            else:
                col[1] = value if isinstance(value, bytes) else col[1]
                col[0] = value if isinstance(value, str) else col[0]
        elif field in ("n", "frames"):
            rec["frames"]["n" if field == "n" else "planes"] = value
        else:
            rec[field] = value

    _edit_envelope(url, edit)
    try:  # unverified: whatever comes back, only typed errors escape
        ckpt.load({"w": torch.zeros(96)}, url)
    except (ManifestError, IntegrityError):
        pass
    try:
        out = ckpt.load({"w": torch.zeros(96)}, url, verify=True)
    except (ManifestError, IntegrityError):
        return
    assert torch.equal(out["w"], w)


class SaveSequence(RuleBasedStateMachine):
    """Saves over one location alternating codecs, levels, planes and frame sizes: after each,
    exactly the manifest's files are on disk and the last state loads bitwise (verified)."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.url = self.dir.name + "/c"
        self.state: dict[str, torch.Tensor] | None = None

    @rule(comp=st.sampled_from([None, "zstd", codec.Codec(planes=False), codec.Codec(level=5)]),
          dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int16, torch.bool]), seed=st.integers(0, 9),
          frame=st.sampled_from([16, 64, 4 << 20]))
    def save(self, comp, dtype, seed, frame):
        old = codec.FRAME_RAW
        codec.FRAME_RAW = frame
        try:
            self.state = {"a": _tensor(dtype, (5, 7), seed), "b": _tensor(torch.float32, (3,), seed + 1)}
            ckpt.save(self.state, self.url, compression=comp, overwrite=True)
        finally:
            codec.FRAME_RAW = old
        m = _manifest(self.url)
        assert bool(m.codecs) == (comp is not None) and m.version == ((2, 1) if comp else (2, 0))

    @invariant()
    def intact(self):
        if self.state is None:
            return
        m = _manifest(self.url)
        assert sorted(os.listdir(f"{self.url}/data")) == sorted(p.split("/")[1] for p in m.files)
        out = ckpt.load({k: torch.zeros_like(v) for k, v in self.state.items()}, self.url, verify=True)
        assert all(_bits(out[k]) == _bits(v) for k, v in self.state.items())

    def teardown(self) -> None:
        self.dir.cleanup()


TestSaveSequence = SaveSequence.TestCase
TestSaveSequence.settings = settings(max_examples=10, stateful_step_count=5, deadline=None)
