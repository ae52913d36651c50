"""S3: ckpt against torch DCP's fsspec writer/reader on the same moto server and the same state.

A moto S3 server (``moto.server.ThreadedMotoServer`` on 127.0.0.1, port 0: loopback only) runs,
by default, in a forked child process, so that the server's Python does not share the GIL with
the contenders. A small WSGI middleware wrapped around moto's app counts, per request, the body
bytes the server sent (GET) and received (PUT/POST): the bytes each contender requested from S3,
whatever its client library does (ranged GETs, read-ahead, retries), the GETs, and the uploads
that carry an ``x-amz-checksum-crc32`` (which moto stores without checking). The state (``--tensors`` 2-D
tensors, alternating fp32/bf16, ``--size-mb`` MB in all, rows and columns multiples of 4, fixed
seed) is generated once. Each round, contenders alternate (their order rotates every round):

- save: ``ckpt.save(state, url, storage_options=...)`` vs ``dcp.save(state,
  storage_writer=FsspecWriter(url, sync_files=False, **s3fs options), no_dist=True)``;
- load into preallocated tensors (zeroed before each load): ``ckpt.load`` vs
  ``dcp.load(dest, storage_reader=FsspecReader(url, **s3fs options), no_dist=True)``;
- resharded loads needing a quarter of the bytes: quarter ``--quarter`` of every tensor's rows
  (dim 0), then of its columns (dim 1). ckpt gets ``ckpt.Shard(local, global_shape, offsets)``
  targets, with its default ``coalesce_gap`` (1 MiB) and with ``coalesce_gap=0``. DCP gets what
  rank ``--quarter`` of a 4-rank job would pass: DTensors ``Shard(dim)`` on a 4-device CPU mesh,
  built in this one process on a "fake" process group (rank ``--quarter`` of 4;
  ``torch.testing._internal.distributed.fake_pg``), loaded with ``no_dist=True``. DCP plans and
  performs a rank's reads locally (``FileSystemReader.read_data`` over the rank's own read items),
  so these are the bytes and the time of one rank's resharded load; only the coordinator's
  exchange of (tiny) plans is skipped. The fake group exists only around DCP's call: ckpt
  becomes collective when a default group is initialized.

Figures are medians over rounds. "needed" is the bytes of tensor data the load must deliver (the
state; a quarter of it); "S3 bytes" is what the server sent (loads: GET bodies, metadata and
listings included) or received (saves: PUT/POST bodies); their ratio is the read (write)
amplification. Loaded tensors are compared bitwise with the source in every round.

moto keeps an object in a spooled temporary file and reads all of it for every ranged GET
(``FakeKey.value``), so a ranged GET costs time proportional to the object's size (a 4 KiB read:
~10-40 ms on a 16 MiB object, ~80-100 ms on a 64 MiB one, here). Both contenders write one data
object per save, so with the default ~64 MB state a contender's load time on moto grows with its
number of GETs much more than it would on S3 (the run measures and prints that per-GET cost). Keep
objects moderate; compare bytes first, times second. ``--rows`` sets the number of GETs of a column
quarter with ``coalesce_gap=0`` (one per row).

    python -m bench s3 [--size-mb 64] [--tensors 32] [--rows 32] [--repeats 3] [--quarter 1]
                       [--server process|thread] [--only CASES] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import multiprocessing
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

import ckpt
from bench.common import fmt, machine_info, markdown_table, median, print_table

BUCKET = "ckpt-bench-s3"
CREDS = {"key": "testing", "secret": "testing"}
STATS_PATH = "/__bench__/stats"
MB = 1e6

State = dict[str, torch.Tensor]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the server: moto behind a counting WSGI middleware


class CountingApp:
    """WSGI middleware: per request kind, the number of requests, request body bytes (from
    Content-Length) and response body bytes. Counted before each body chunk is handed to the
    server for sending, so once a client has a whole reply the counters include it.
    ``GET STATS_PATH`` answers the counters as JSON (``?reset=1``: and zeroes them)."""

    def __init__(self, app: Any):
        self.app = app
        self.lock = threading.Lock()
        self.counts: dict[str, list[int]] = {}

    def _add(self, kind: str, requests: int = 0, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self.lock:
            c = self.counts.setdefault(kind, [0, 0, 0])
            c[0] += requests
            c[1] += bytes_in
            c[2] += bytes_out

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == STATS_PATH:
            with self.lock:
                body = json.dumps(self.counts).encode()
                if "reset=1" in environ.get("QUERY_STRING", ""):
                    self.counts = {}
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        method = environ.get("REQUEST_METHOD", "?")
        # path-style addressing (an IP endpoint): /bucket or /bucket/key
        target = "object" if "/" in path.lstrip("/") else "bucket"
        kind = f"{method} {target}" + (" ranged" if environ.get("HTTP_RANGE") else "")
        if environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked":
            kind += " chunked-upload"  # no Content-Length: its bytes are not counted (never seen so far)
        if method in ("PUT", "POST") and environ.get("HTTP_X_AMZ_CHECKSUM_CRC32"):
            kind += " crc32"  # the body came with a CRC32 for S3 to check (moto stores it unchecked)
        self._add(kind, requests=1, bytes_in=int(environ.get("CONTENT_LENGTH") or 0))
        return self._body(self.app(environ, start_response), kind)

    def _body(self, result: Iterable[bytes], kind: str) -> Iterator[bytes]:
        try:
            for chunk in result:
                self._add(kind, bytes_out=len(chunk))
                yield chunk
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()


def _counting_server_class() -> type:
    from moto.moto_server import threaded_moto_server as tms

    class CountingMotoServer(tms.ThreadedMotoServer):
        """moto's ThreadedMotoServer with its WSGI app wrapped in :class:`CountingApp`."""

        def _server_entry(self) -> None:  # moto 5.x's own, plus the wrapper
            app = CountingApp(tms.DomainDispatcherApplication(tms.create_backend_app))
            self._server = tms.make_server(self._ip_address, self._port, app, True,
                                           request_handler=tms.MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return CountingMotoServer


def _serve(conn: Any) -> None:
    """Child process: run the counting moto server until the parent says stop (or goes away)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = _counting_server_class()(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port())
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        conn.recv()
    server.stop()


class MotoS3:
    """A loopback moto S3 server with byte counters, in a child process (default) or a thread."""

    def __init__(self, mode: str = "process"):
        self.mode = mode
        self.proc: Any = None
        self.server: Any = None
        if mode == "process":
            ctx = multiprocessing.get_context("fork")  # before torch starts threads in this process
            parent, child = ctx.Pipe()
            self.conn = parent
            self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="moto-s3")
            self.proc.start()
            child.close()
            if not parent.poll(60):
                raise RuntimeError("the moto server did not start within 60 s")
            host, port = parent.recv()
        else:
            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            self.server = _counting_server_class()(ip_address="127.0.0.1", port=0, verbose=False)
            self.server.start()
            host, port = self.server.get_host_and_port()
        self.host, self.port = str(host), int(port)
        self.endpoint = f"http://{self.host}:{self.port}"

    def stats(self, reset: bool = True) -> dict[str, list[int]]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", STATS_PATH + ("?reset=1" if reset else ""))
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def admin(self) -> Any:
        """A plain botocore client on the server (bucket creation, cleanup)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=CREDS["key"], aws_secret_access_key=CREDS["secret"])

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.conn.send("stop")
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
        if self.server is not None:
            self.server.stop()


def delete_prefix(admin: Any, prefix: str) -> None:
    token: str | None = None
    while True:
        kw: dict[str, Any] = {"Bucket": BUCKET, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        page = admin.list_objects_v2(**kw)
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            admin.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
        token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        if not token:
            return


def ranged_get_cost(admin: Any, prefix: str, n: int = 5) -> dict[str, Any]:
    """moto's time for a 4 KiB ranged GET (median of ``n``, one at a time) of the largest object under ``prefix``."""
    objs = admin.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    big = max(objs, key=lambda o: o["Size"])
    mid = big["Size"] // 2
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        admin.get_object(Bucket=BUCKET, Key=big["Key"], Range=f"bytes={mid}-{mid + 4095}")["Body"].read()
        ts.append(time.perf_counter() - t0)
    return {"key": big["Key"], "size": big["Size"], "ms": 1e3 * median(ts)}


def summarize_counts(counts: dict[str, list[int]]) -> dict[str, int]:
    """Server counters of one operation -> GET bytes/requests (reads), PUT/POST bytes (writes), all requests."""
    out = {"requests": 0, "gets": 0, "ranged_gets": 0, "get_bytes": 0, "object_get_bytes": 0,
           "writes": 0, "write_bytes": 0, "puts": 0, "crc32_puts": 0, "heads": 0, "lists": 0}
    for kind, (n, bytes_in, bytes_out) in counts.items():
        method, target = kind.split()[:2]
        out["requests"] += n
        if method == "GET":
            out["gets"] += n
            out["get_bytes"] += bytes_out
            if target == "object":
                out["object_get_bytes"] += bytes_out
                if "ranged" in kind:
                    out["ranged_gets"] += n
            else:
                out["lists"] += n
        elif method in ("PUT", "POST"):
            out["writes"] += n
            out["write_bytes"] += bytes_in
            if method == "PUT":  # the requests with a body to hash (create/complete are POSTs)
                out["puts"] += n
                out["crc32_puts"] += n if kind.endswith(" crc32") else 0
        elif method == "HEAD":
            out["heads"] += n
    return out


# ---------------------------------------------------------------------------------------------
# the state


def make_state(total_bytes: int, n_tensors: int, mean_rows: int, seed: int = 0) -> State:
    """``n_tensors`` random 2-D tensors (even indices fp32, odd bf16), ~``total_bytes`` in all.

    Sizes vary 0.5-1.5x around the mean; rows 0.5-1.5x ``mean_rows``; rows and columns are
    multiples of 4, so a quarter of either is exact (and matches DTensor's Shard split).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(n_tensors)]
    wsum = sum(weights)
    state: State = {}
    for i, w in enumerate(weights):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        esize = 4 if dtype == torch.float32 else 2
        numel = max(16, int(total_bytes * w / wsum) // esize)
        rows = max(4, 4 * round(rng.uniform(0.5, 1.5) * mean_rows / 4))
        cols = max(4, numel // rows // 4 * 4)
        state[f"layers.{i:03d}.weight"] = torch.randn(rows, cols, generator=gen, dtype=dtype)
    return state


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quarter(t: torch.Tensor, dim: int, q: int) -> torch.Tensor:
    n = t.shape[dim] // 4
    return t.narrow(dim, q * n, n)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


# ---------------------------------------------------------------------------------------------
# contenders


def ckpt_options(endpoint: str, gap: int | None = None) -> dict[str, Any]:
    opts: dict[str, Any] = {**CREDS, "endpoint_url": endpoint}
    if gap is not None:
        opts["coalesce_gap"] = gap
    return opts


def dcp_options(endpoint: str) -> dict[str, Any]:
    return {**CREDS, "endpoint_url": endpoint}  # what FsspecWriter/Reader pass to s3fs.S3FileSystem


def ckpt_save(state: State, url: str, opts: dict[str, Any]) -> None:
    ckpt.save(state, url, storage_options=opts)


def dcp_save(state: State, url: str, opts: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # sync_files=False: with True, DCP calls os.sync() of this host for every file (an s3fs file
    # has no fileno), which makes nothing on S3 more durable.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FsspecWriter(url, sync_files=False, **opts), no_dist=True)


def ckpt_load(dest: dict[str, Any], url: str, opts: dict[str, Any]) -> None:
    ckpt.load(dest, url, storage_options=opts)


def dcp_load(dest: dict[str, Any], url: str, opts: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, storage_reader=FsspecReader(url, **opts), no_dist=True)


@contextlib.contextmanager
def fake_rank(rank: int, world: int = 4) -> Iterator[Any]:
    """A fake default process group (rank ``rank`` of ``world``) and a 1-D CPU mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def dtensor_targets(mesh: Any, state: State, locals_: State, dim: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    return {k: DTensor.from_local(locals_[k], mesh, [Shard(dim)], run_check=False, shape=t.shape, stride=t.stride())
            for k, t in state.items()}


def shard_targets(state: State, locals_: State, dim: int, q: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, t in state.items():
        offsets = [0] * t.dim()
        offsets[dim] = q * (t.shape[dim] // 4)
        out[k] = ckpt.Shard(locals_[k], t.shape, tuple(offsets))
    return out


# ---------------------------------------------------------------------------------------------
# the run

CASES = [  # (case, contenders in it)
    ("save", ["ckpt", "dcp"]),
    ("load", ["ckpt", "dcp"]),
    ("rows 1/4", ["ckpt", "ckpt gap=0", "dcp"]),
    ("cols 1/4", ["ckpt", "ckpt gap=0", "dcp"]),
]


def _rotate(xs: list[str], r: int) -> list[str]:
    k = r % len(xs)
    return xs[k:] + xs[:k]


def run(size_mb: float, n_tensors: int, mean_rows: int, repeats: int, q: int, mode: str,
        seed: int = 0, cases: list[str] | None = None) -> dict[str, Any]:
    server = MotoS3(mode)  # first: the fork happens before torch starts any thread here
    try:
        return _run(server, size_mb, n_tensors, mean_rows, repeats, q, seed, cases)
    finally:
        server.close()


def _run(server: MotoS3, size_mb: float, n_tensors: int, mean_rows: int, repeats: int, q: int,
         seed: int, only: list[str] | None) -> dict[str, Any]:
    # "save" always runs (the loads need its checkpoints); ``only`` picks case or case/contender names
    cases = [(c, [n for n in names if c == "save" or only is None or c in only or f"{c}/{n}" in only])
             for c, names in CASES]
    cases = [(c, names) for c, names in cases if names]
    admin = server.admin()
    admin.create_bucket(Bucket=BUCKET)
    ep = server.endpoint
    _log(f"moto S3 at {ep} ({server.mode}); generating the state ...")
    state = make_state(int(size_mb * MB), n_tensors, mean_rows, seed)
    total = sum(nbytes(t) for t in state.values())
    dims = {"rows 1/4": 0, "cols 1/4": 1}
    needed = {"save": total, "load": total,
              **{c: sum(nbytes(quarter(t, d, q)) for t in state.values()) for c, d in dims.items()}}
    dest = {k: torch.zeros_like(t) for k, t in state.items()}  # allocated and touched once
    qlocal = {(c, name): {k: torch.zeros_like(quarter(t, d, q).contiguous()) for k, t in state.items()}
              for c, d in dims.items() for name in ("ckpt", "ckpt gap=0", "dcp")}
    opts = {"ckpt": ckpt_options(ep), "ckpt gap=0": ckpt_options(ep, 0), "dcp": dcp_options(ep)}

    def measure(fn: Callable[[], None]) -> dict[str, Any]:
        server.stats(reset=True)
        t0 = time.perf_counter()
        fn()
        s = time.perf_counter() - t0
        return {"s": s, **summarize_counts(server.stats(reset=True))}

    box = [0.0]  # dcp.load's own time inside a resharded DCP load (the fake group's setup excluded)

    def load_quarter(name: str, case: str, url: str) -> Callable[[], None]:
        dim, locs = dims[case], qlocal[(case, name)]
        for t in locs.values():
            t.zero_()
        if name == "dcp":
            def go() -> None:
                with fake_rank(q) as mesh:
                    targets = dtensor_targets(mesh, state, locs, dim)  # not timed: the caller's state
                    t0 = time.perf_counter()
                    dcp_load(targets, url, opts["dcp"])
                    box[0] = time.perf_counter() - t0
            return go
        targets = shard_targets(state, locs, dim, q)
        return lambda: ckpt_load(targets, url, opts[name])

    # untimed warm-up on a small state: imports, s3fs instances and connections, DTensor machinery
    small = dict(list(state.items())[:2])
    ckpt_save(small, f"s3://{BUCKET}/warm/ckpt", opts["ckpt"])
    dcp_save(small, f"s3://{BUCKET}/warm/dcp", opts["dcp"])
    ckpt_load({k: torch.zeros_like(v) for k, v in small.items()}, f"s3://{BUCKET}/warm/ckpt", opts["ckpt"])
    dcp_load({k: torch.zeros_like(v) for k, v in small.items()}, f"s3://{BUCKET}/warm/dcp", opts["dcp"])
    with fake_rank(q) as mesh:
        loc = {k: torch.zeros_like(quarter(v, 0, q).contiguous()) for k, v in small.items()}
        dcp_load(dtensor_targets(mesh, small, loc, 0), f"s3://{BUCKET}/warm/dcp", opts["dcp"])
    delete_prefix(admin, "warm/")
    server.stats(reset=True)

    raw: dict[str, dict[str, list[dict[str, Any]]]] = {c: {n: [] for n in names} for c, names in cases}
    mismatches: list[str] = []
    calib: dict[str, Any] = {}
    for r in range(repeats):
        urls = {"ckpt": f"s3://{BUCKET}/r{r}/ckpt", "dcp": f"s3://{BUCKET}/r{r}/dcp"}
        for case, names in cases:
            if case != "save" and r == 0 and not calib:
                calib = {n: ranged_get_cost(admin, f"r0/{n}/") for n in ("ckpt", "dcp")}
                _log("moto, a 4 KiB ranged GET: " + ", ".join(
                    f"{c['ms']:.0f} ms on {c['key']} ({c['size'] / MB:.1f} MB)" for c in calib.values()))
            for name in _rotate(names, r):
                url = urls["dcp" if name == "dcp" else "ckpt"]
                if case == "save":
                    save = ckpt_save if name == "ckpt" else dcp_save
                    m = measure(lambda save=save, url=url, name=name: save(state, url, opts[name]))
                elif case == "load":
                    for t in dest.values():
                        t.zero_()
                    load = ckpt_load if name == "ckpt" else dcp_load
                    m = measure(lambda load=load, url=url, name=name: load(dest, url, opts[name]))
                    mismatches += [f"{case}/{name}/{k}" for k, t in state.items() if not same_bytes(t, dest[k])]
                else:
                    fn = load_quarter(name, case, url)
                    m = measure(fn)
                    if name == "dcp":
                        m["s_total"], m["s"] = m["s"], box[0]  # time of dcp.load alone
                    locs = qlocal[(case, name)]
                    mismatches += [f"{case}/{name}/{k}" for k, t in state.items()
                                   if not same_bytes(quarter(t, dims[case], q), locs[k])]
                raw[case][name].append(m)
                ratio = (m["write_bytes"] if case == "save" else m["get_bytes"]) / needed[case]
                _log(f"[{r + 1}/{repeats}] {case:9s} {name:11s} {m['s']:7.2f} s  S3/needed {ratio:5.2f}x  "
                     f"requests {m['requests']:5d} (GET {m['gets']}, PUT/POST {m['writes']}, "
                     f"{m['crc32_puts']} of {m['puts']} PUTs with a CRC32)")
        delete_prefix(admin, f"r{r}/")

    shapes = [list(t.shape) for t in state.values()]
    out: dict[str, Any] = {
        "bytes": total, "tensors": n_tensors, "mean_rows": mean_rows, "repeats": repeats, "quarter": q,
        "server": server.mode, "needed": needed, "shapes_rows": [s[0] for s in shapes],
        "shapes_cols": [s[1] for s in shapes], "total_rows": sum(s[0] for s in shapes),
        "mismatches": mismatches, "machine": machine_info("."), "raw": raw, "summary": {},
        "cases": [[c, names] for c, names in cases], "ranged_get": calib,
    }
    with contextlib.suppress(Exception):
        import importlib.metadata as md

        out["versions"] = {p: md.version(p) for p in ("moto", "s3fs", "aiobotocore", "botocore", "fsspec")}
    for case, names in cases:
        out["summary"][case] = {}
        for name in names:
            ms = raw[case][name]
            key = "write_bytes" if case == "save" else "get_bytes"
            out["summary"][case][name] = {
                "s": median([m["s"] for m in ms]), "best_s": min(m["s"] for m in ms),
                "s3_bytes": median([m[key] for m in ms]), "requests": median([m["requests"] for m in ms]),
                "data_requests": median([m["writes" if case == "save" else "gets"] for m in ms]),
                "gets": median([m["gets"] for m in ms]), "puts": median([m["puts"] for m in ms]),
                "crc32_puts": median([m["crc32_puts"] for m in ms]),
            }
    return out


COLUMNS = ["operation", "contender", "median s", "best s", "needed MB/s", "x ckpt", "needed MB", "S3 MB",
           "S3 / needed", "requests", "GETs"]


def rows(res: dict[str, Any]) -> list[list[str]]:
    out = []
    for case, names in res["cases"]:
        s = res["summary"][case]
        ref = s["ckpt"]["s"] if "ckpt" in s else float("nan")
        need = res["needed"][case]
        for name in names:
            c = s[name]
            out.append([case, name, fmt(c["s"]), fmt(c["best_s"]), fmt(need / MB / c["s"], 1),
                        fmt(c["s"] / ref, 2), fmt(need / MB, 1), fmt(c["s3_bytes"] / MB, 1),
                        f"{c['s3_bytes'] / need:.2f}x", f"{c['requests']:.0f}", f"{c.get('gets', 0):.0f}"])
    return out


def target_lines(res: dict[str, Any], limit: float = 1.1) -> list[str]:
    """Per load and ckpt contender: bytes requested <= ``limit`` x needed, and GETs <= DCP's."""
    lines = []
    for case in ("load", "rows 1/4", "cols 1/4"):
        dcp = res["summary"].get(case, {}).get("dcp")
        for name in ("ckpt", "ckpt gap=0"):
            c = res["summary"].get(case, {}).get(name)
            if c is None:
                continue
            ratio = c["s3_bytes"] / res["needed"][case]
            line = (f"{case} / {name}: requested {ratio:.2f}x needed: "
                    f"{'met' if ratio <= limit else 'missed'} (target <= {limit}x)")
            if dcp is not None and "gets" in c:
                line += (f"; {c['gets']:.0f} GETs vs DCP's {dcp['gets']:.0f}: "
                         f"{'met' if c['gets'] <= dcp['gets'] else 'missed'} (target <= DCP's)")
            lines.append(line)
    return lines


def report(res: dict[str, Any]) -> str:
    lines = [f"state: {res['bytes'] / MB:.1f} MB, {res['tensors']} tensors (fp32/bf16), "
             f"{res['total_rows']} rows in all; {res['repeats']} rounds, medians; quarter {res['quarter']} of 4; "
             f"moto server in a {res['server']}",
             "x ckpt: median time / ckpt's (default options) in the same operation; "
             "S3 MB: GET bodies (loads) or PUT/POST bodies (saves) as counted by the server",
             *target_lines(res)]
    if res["ranged_get"]:
        lines.append("moto, one 4 KiB ranged GET (server time grows with the object's size, not the range's): "
                     + ", ".join(f"{c['ms']:.0f} ms on a {c['size'] / MB:.1f} MB object ({n})"
                                 for n, c in res["ranged_get"].items()))
    save = res["summary"].get("save", {})
    if save and all("crc32_puts" in c for c in save.values()):
        lines.append("save, PUTs (single objects, multipart parts) carrying x-amz-checksum-crc32: " + ", ".join(
            f"{n} {c['crc32_puts']:.0f} of {c['puts']:.0f}" for n, c in save.items()))
    lines.append("bitwise check: " + ("all loads equal the source" if not res["mismatches"]
                                      else f"{len(res['mismatches'])} MISMATCHES: {res['mismatches'][:8]}"))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, default=64.0, help="state size in MB (1e6 bytes; default 64)")
    p.add_argument("--tensors", type=int, default=32, help="number of tensors (default 32)")
    p.add_argument("--rows", type=int, default=32,
                   help="mean rows per tensor (default 32); a column quarter with coalesce_gap=0 is one "
                        "ranged GET per row")
    p.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument("--quarter", type=int, default=1, choices=[0, 1, 2, 3],
                   help="which quarter the resharded loads read (the fake rank of DCP's 4-rank mesh)")
    p.add_argument("--server", choices=["process", "thread"], default="process",
                   help="run moto in a forked child process (default) or in a thread of this process")
    p.add_argument("--only", default=None,
                   help="comma-separated cases or case/contender to run, e.g. 'load,rows 1/4' or "
                        "'cols 1/4/ckpt' (save always runs; default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    only = [x.strip() for x in args.only.split(",")] if args.only else None
    res = run(args.size_mb, args.tensors, args.rows, args.repeats, args.quarter, args.server, args.seed, only)
    print_table("S3 (moto on loopback): ckpt vs DCP FsspecWriter/FsspecReader", COLUMNS, rows(res))
    print(report(res))
    print("\n" + markdown_table(COLUMNS, rows(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 1 if res["mismatches"] else 0
