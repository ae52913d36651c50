"""A real scaling curve: save (sync and async) and resharded load of a small sharded state on N
forked gloo ranks of one machine, for each N of ``--ranks``, ckpt vs torch DCP in the same run.

Weak scaling: every rank holds ``--mb-per-rank`` MiB in ``--tensors`` fp32 DTensors sharded
``Shard(0)`` (row blocks) over the N ranks, so the state grows with N while each rank's data stays
the same; ideal data phases stay flat, and what grows is the metadata the coordinator (rank 0)
handles. Each repeat runs, alternating ckpt and DCP on the same tensors:

- ``save``: ``ckpt.save`` with its plan cache cleared (the full planning exchange) / ``dcp.save``;
- ``save, plan cached``: ckpt's steady state (the planning exchange skipped) / ``dcp.save`` again;
- ``async``: ``ckpt.async_save`` (steady state) / ``dcp.async_save`` (thread mode): the time the
  call blocks and the time until the checkpoint is committed;
- ``load``: resharded load (``--load-layout 2d``: onto an (N/2, 2) mesh as ``[Shard(0), Shard(1)]``,
  each rank reading half the columns of two stored row blocks; ``cols``: ``Shard(1)`` on the same
  N ranks, each rank reading a column strip of every stored block) / ``dcp.load``; every load is
  compared bitwise with the values saved;
- ``exchange``: the metadata exchange alone, with each rank's real save declaration as payload:
  ``Comm.exchange`` (gather to rank 0, a reply to each rank) vs ``gather_object`` +
  ``scatter_object_list`` (what DCP's planning round uses).

Figures, medians over repeats: the collective wall time (barrier to barrier); phases as seen by the
coordinator, split the same way for both (plan: until every rank has its plan; write: until the
coordinator has every rank's write report; commit: the rest, manifest / ``.metadata`` written and
the verdict sent); the coordinator's own compute (ckpt: its reply functions; DCP: between its
gather and its scatter/broadcast); and the coordinator's metadata bytes, sent + received (ckpt: its
``Comm`` counters, msgpack payloads plus 8-byte size words; DCP: pickled sizes of the objects its
object collectives carry to or from rank 0). The growth factor per doubling of ranks is
``(m(2N) / m(N))``: 1.0 is flat, 2.0 linear, 4.0 quadratic.

    python -m bench scaling [--ranks 8,16,32,64] [--mb-per-rank 4] [--tensors 16] [--repeats 3]
                            [--warmup 1] [--load-layout 2d|cols] [--exchange-iters 5]
                            [--fanin K] [--timeout 600] [--json PATH] [--out DIR]

``--fanin`` sets ckpt's exchange tree fan-in in the ranks (``ckpt._comm.FANIN``; 0: the flat star
that every exchange used before the tree), to draw the curve before and after. CPU only (gloo);
CUDA is never touched, so it runs the same on GPU machines. Rank counts that would not fit in the
memory available are skipped (and listed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import pickle
import resource
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from bench.common import fmt, machine_info, markdown_table, median, print_table
from bench.ranks import gloo_ranks
from ckpt import _comm as comm_mod
from ckpt._comm import Comm

MiB = 1 << 20
OPS = ("save", "save, plan cached", "async", "load", "exchange")


@dataclass(slots=True)
class Config:
    """One rank count's run. Sizes in MiB, times in seconds."""

    world: int
    mb_per_rank: float = 4.0
    tensors: int = 16
    repeats: int = 3
    warmup: int = 1
    load_layout: str = "2d"
    exchange_iters: int = 5
    timeout: float = 600.0
    fanin: int | None = None  # ckpt's exchange tree fan-in (ckpt._comm.FANIN); None: ckpt's default, 0: flat

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ValueError(f"ranks must be at least 2, got {self.world}")
        if self.load_layout not in ("2d", "cols"):
            raise ValueError(f"load layout must be '2d' or 'cols', got {self.load_layout!r}")
        if self.load_layout == "2d" and self.world % 2:
            raise ValueError(f"--load-layout 2d needs an even number of ranks, got {self.world}; "
                             "use --load-layout cols")
        if self.repeats < 1 or self.tensors < 1 or self.mb_per_rank <= 0:
            raise ValueError("--repeats and --tensors must be >= 1 and --mb-per-rank > 0")


def geometry(world: int, mb_per_rank: float, tensors: int) -> tuple[int, int]:
    """(rows per rank, columns) of every tensor: columns a multiple of ``world`` (so that every
    target layout splits them evenly), rows such that a rank holds about ``mb_per_rank`` MiB."""
    cols = world * max(1, math.ceil(256 / world))
    elems = int(mb_per_rank * MiB / 4 / tensors)
    return max(2, elems // cols), cols


def expected(k: int, r0: int, r1: int, c0: int, c1: int, cols: int) -> torch.Tensor:
    """Tensor ``k``'s values in rows [r0, r1) x columns [c0, c1): a hash of the global index, as
    integers below 2**24 (exact in fp32, so equality is bitwise), different for every tensor."""
    rows = torch.arange(r0, r1, dtype=torch.int64).unsqueeze(1)
    idx = rows * cols + torch.arange(c0, c1, dtype=torch.int64)
    return ((idx * 2654435761 + 7919 * k) % (1 << 24)).to(torch.float32)


# --- instrumentation: what the coordinator sends, receives and waits for -------------------------


class Probe:
    """Per-rank recorder, installed once in each forked rank: ``Comm``'s byte counters of every
    ``Comm`` created during an operation and the times of its exchange calls; for DCP, the object
    collectives of ``torch.distributed`` it calls (times, and the objects, pickled after the op)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.comms: list[Comm] = []
        self.events: list[tuple[str, str, float, float]] = []
        self.moved: list[tuple[str, Any]] = []  # ("sent" | "recv", object) for pickled sizes
        self.t0 = 0.0
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.comms, self.events, self.moved = [], [], []
        self.t0 = time.perf_counter()

    def _event(self, kind: str, what: str, t0: float, t1: float) -> None:
        with self.lock:
            self.events.append((kind, what, t0 - self.t0, t1 - self.t0))

    def install(self) -> None:
        probe = self
        init = Comm.__init__

        def comm_init(c: Comm, *a: Any, **k: Any) -> None:
            init(c, *a, **k)
            with probe.lock:
                probe.comms.append(c)

        Comm.__init__ = comm_init  # type: ignore[method-assign]
        for name in ("gather", "send_each", "recv_one", "broadcast_bytes"):
            setattr(Comm, name, self._timed_method(getattr(Comm, name), name))
        exchange = Comm.exchange

        def timed_exchange(c: Comm, obj: Any, reply: Callable[[list[Any]], list[Any]], **k: Any) -> Any:
            what = str(k.get("what", "exchange"))

            def timed_reply(got: list[Any]) -> list[Any]:
                t = time.perf_counter()
                try:
                    return reply(got)
                finally:
                    probe._event("reply", what, t, time.perf_counter())

            t = time.perf_counter()
            try:
                return exchange(c, obj, timed_reply, **k)
            finally:
                probe._event("exchange", what, t, time.perf_counter())

        Comm.exchange = timed_exchange  # type: ignore[method-assign]
        self._install_dist()

    def _timed_method(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        probe = self

        def wrapper(c: Comm, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(c, *a, **k)
            finally:
                probe._event(kind, str(k.get("what", kind)), t, time.perf_counter())

        return wrapper

    def _install_dist(self) -> None:
        # DCP calls these through the public ``torch.distributed`` namespace; wrapping them there
        # sees every object collective of dcp.save / async_save / load, with no private import.
        probe = self
        gather, scatter = dist.gather_object, dist.scatter_object_list
        bcast, allgather = dist.broadcast_object_list, dist.all_gather_object

        def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                          group: Any = None, **k: Any) -> None:
            t = time.perf_counter()
            gather(obj, object_gather_list, dst, group, **k)
            probe._event("gather_object", "dcp", t, time.perf_counter())
            if object_gather_list is not None:
                probe.moved += [("recv", o) for i, o in enumerate(object_gather_list) if i != probe.rank]
            else:
                probe.moved.append(("sent", obj))

        def scatter_object_list(scatter_object_output_list: list[Any],
                                scatter_object_input_list: list[Any] | None = None, src: int | None = None,
                                group: Any = None, **k: Any) -> None:
            t = time.perf_counter()
            scatter(scatter_object_output_list, scatter_object_input_list, src, group, **k)
            probe._event("scatter_object_list", "dcp", t, time.perf_counter())
            if scatter_object_input_list is not None:
                probe.moved += [("sent", o) for i, o in enumerate(scatter_object_input_list) if i != probe.rank]
            else:
                probe.moved.append(("recv", scatter_object_output_list[0]))

        def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None, **k: Any) -> None:
            t = time.perf_counter()
            bcast(object_list, src, group, **k)
            probe._event("broadcast_object_list", "dcp", t, time.perf_counter())
            root = src if src is not None else 0
            if probe.rank == root:  # gloo's broadcast is a binomial tree: the source sends ceil(log2 N) copies
                probe.moved += [("sent", o) for o in object_list] * max(1, math.ceil(math.log2(probe.world)))
            else:
                probe.moved += [("recv", o) for o in object_list]

        def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
            t = time.perf_counter()
            allgather(object_list, obj, group)
            probe._event("all_gather_object", "dcp", t, time.perf_counter())
            probe.moved += [("sent", obj)] * (probe.world - 1)
            probe.moved += [("recv", o) for i, o in enumerate(object_list) if i != probe.rank]

        dist.gather_object = gather_object  # type: ignore[assignment]
        dist.scatter_object_list = scatter_object_list  # type: ignore[assignment]
        dist.broadcast_object_list = broadcast_object_list  # type: ignore[assignment]
        dist.all_gather_object = all_gather_object  # type: ignore[assignment]

    def traffic(self) -> tuple[int, int]:
        """(sent, received) metadata bytes of this rank during the op: ckpt's and DCP's together
        (an op runs only one of them)."""
        sent = sum(c.sent for c in self.comms)
        recv = sum(c.received for c in self.comms)
        for way, obj in self.moved:
            n = len(pickle.dumps(obj))
            if way == "sent":
                sent += n
            else:
                recv += n
        return sent, recv


def _end(events: list[tuple[str, str, float, float]], kind: str, what: str | None = None, nth: int = 0) -> float | None:
    hits = [e for e in events if e[0] == kind and (what is None or e[1] == what)]
    return hits[nth][3] if len(hits) > nth else None


def _start(events: list[tuple[str, str, float, float]], kind: str, nth: int = 0) -> float | None:
    hits = [e for e in events if e[0] == kind]
    return hits[nth][2] if len(hits) > nth else None


def coordinator_view(op: str, lib: str, events: list[tuple[str, str, float, float]], total: float,
                     stats: dict[str, Any] | None = None) -> dict[str, float]:
    """Phases as rank 0 sees them, split the same way for ckpt and DCP, and its own compute time."""
    nan = float("nan")
    out: dict[str, float] = {}
    if lib == "ckpt":
        out["compute"] = sum(e[3] - e[2] for e in events if e[0] == "reply")
        out["fan_in"] = sum(e[3] - e[2] for e in events if e[0] == "gather")
        if op.startswith("save"):
            plan = _end(events, "exchange", "save planning")
            if plan is None:  # plan cached: no exchange, only the local fingerprint
                plan = float((stats or {}).get("plan", 0.0))
            write = _end(events, "gather", "save commit")
            out.update(plan=plan, write=(write - plan) if write is not None else nan,
                       commit=(total - write) if write is not None else nan)
        elif op == "load":
            m = _end(events, "exchange", "load manifest")
            out.update(plan=m if m is not None else nan, read=(total - m) if m is not None else nan)
        return out
    # DCP: save = gather(plans), scatter(plans), [write], gather(results), broadcast(metadata);
    # load = gather(plans), scatter(plans), [read], all_gather(read results)
    g1, s1 = _end(events, "gather_object", nth=0), _end(events, "scatter_object_list", nth=0)
    s1_start = _start(events, "scatter_object_list")
    out["fan_in"] = sum(e[3] - e[2] for e in events if e[0] == "gather_object")
    compute = (s1_start - g1) if (s1_start is not None and g1 is not None) else 0.0
    if op.startswith("save"):
        g2, b_start = _end(events, "gather_object", nth=1), _start(events, "broadcast_object_list")
        if g2 is not None and b_start is not None:
            compute += b_start - g2
        out.update(plan=s1 if s1 is not None else nan, write=(g2 - s1) if (g2 is not None and s1 is not None) else nan,
                   commit=(total - g2) if g2 is not None else nan)
    elif op == "load":
        out.update(plan=s1 if s1 is not None else nan, read=(total - s1) if s1 is not None else nan)
    out["compute"] = compute
    return out


# --- one rank -------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, cfg_d: dict[str, Any], root: str, out_dir: str) -> None:
    try:
        _rank_body(rank, world, Config(**cfg_d), root, out_dir)
    except BaseException:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _join_store(rank: int, world: int, out_dir: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's store, hosted by rank 0 on a free port it publishes in ``out_dir``; the others wait
    for that file. Not in the parent: it forks the ranks, and a child forked while the store's server
    thread holds a lock can hang before it joins (CI once saw a rank never publish its gloo address)."""
    path = os.path.join(out_dir, "store-port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)  # whole or absent: a reader never sees half a port number
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no store port in {path} within "
                               f"{timeout.total_seconds():g} s")
        time.sleep(0.005)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)


def _rank_body(rank: int, world: int, cfg: Config, root: str, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg.timeout)
    store = _join_store(rank, world, out_dir, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    if cfg.fanin is not None:
        importlib.import_module("ckpt._comm").FANIN = cfg.fanin
    probe = Probe(rank, world)
    probe.install()
    save_mod = importlib.import_module("ckpt.save")
    rows, cols = geometry(world, cfg.mb_per_rank, cfg.tensors)
    shape = (world * rows, cols)
    mesh = init_device_mesh("cpu", (world,))
    src = {f"w{k}": DTensor.from_local(expected(k, rank * rows, (rank + 1) * rows, 0, cols, cols), mesh, [Shard(0)],
                                       run_check=False, shape=shape, stride=(cols, 1))
           for k in range(cfg.tensors)}
    if cfg.load_layout == "2d":
        mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))
        i, j = divmod(rank, 2)
        r0, r1, c0, c1 = i * 2 * rows, (i + 1) * 2 * rows, j * cols // 2, (j + 1) * cols // 2
        placements: list[Any] = [Shard(0), Shard(1)]
        dst_mesh = mesh2
    else:
        r0, r1, c0, c1 = 0, world * rows, rank * cols // world, (rank + 1) * cols // world
        placements, dst_mesh = [Shard(1)], mesh
    want = [expected(k, r0, r1, c0, c1, cols) for k in range(cfg.tensors)]
    dst = {f"w{k}": DTensor.from_local(torch.zeros(r1 - r0, c1 - c0), dst_mesh, placements, run_check=False,
                                       shape=shape, stride=(cols, 1)) for k in range(cfg.tensors)}
    decl_wire = save_mod.build_decl(src, rank)[0].to_wire()  # the planning payload, for the exchange alone
    records: dict[str, dict[str, list[Any]]] = {}
    sizes: dict[str, int] = {}

    def check(lib: str) -> None:
        for k in range(cfg.tensors):
            got = dst[f"w{k}"].to_local()
            if not torch.equal(got.view(torch.int32), want[k].view(torch.int32)):
                bad = int((got != want[k]).sum())
                raise AssertionError(f"rank {rank}: {lib} load of w{k} differs from what was saved in {bad} elements")
            got.zero_()

    def measure(op: str, lib: str, keep: bool, fn: Callable[..., dict[str, Any] | None], *args: Any) -> None:
        dist.barrier()
        probe.reset()
        t0 = time.perf_counter()
        extra = fn(*args) or {}
        t1 = time.perf_counter()
        dist.barrier()
        wall = time.perf_counter() - t0
        if not keep:
            return
        sent, recv = probe.traffic()
        rounds = int(extra.pop("rounds", 1))  # the exchange alone: bytes of one round
        rec: dict[str, Any] = {"wall": wall, "local": t1 - t0, "sent": sent / rounds, "recv": recv / rounds}
        stats = extra.pop("stats", None)
        rec.update(extra)
        if rank == 0:
            rec["view"] = coordinator_view(op, lib, probe.events, t1 - t0, stats)
            rec["stats"] = stats
        r = records.setdefault(f"{op}/{lib}", {})
        for key, v in rec.items():
            r.setdefault(key, []).append(v)

    def ckpt_save(d: str, cold: bool) -> dict[str, Any]:
        if cold:
            save_mod._SYNC_CACHES.clear()
        st: dict[str, Any] = {}
        m = ckpt.save(src, d, stats=st, timeout=cfg.timeout)
        if rank == 0:
            st["commit_s"] = (m.stats or {}).get("commit_s")
        return {"stats": st}

    def ckpt_async(d: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        h = ckpt.async_save(src, d)
        t1 = time.perf_counter()
        h.done()
        return {"blocking": t1 - t0, "done": time.perf_counter() - t0, "stats": dict(h.stats)}

    def dcp_async(d: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        fut = dcp.async_save(src, checkpoint_id=d)
        t1 = time.perf_counter()
        fut.result()
        return {"blocking": t1 - t0, "done": time.perf_counter() - t0}

    def dcp_save(d: str) -> None:
        dcp.save(src, checkpoint_id=d)

    def dcp_load(d: str) -> None:
        dcp.load(dst, checkpoint_id=d)

    def ckpt_load(d: str) -> dict[str, Any]:
        st: dict[str, Any] = {}
        ckpt.load(dst, d, stats=st, timeout=cfg.timeout)
        return {"stats": st}

    def ckpt_exchange() -> dict[str, Any]:
        times = []
        for _ in range(cfg.exchange_iters):
            c = Comm(None)
            t = time.perf_counter()
            c.exchange(decl_wire, lambda got: got, timeout=cfg.timeout, what="bench exchange")
            times.append(time.perf_counter() - t)
        return {"iter": median(times), "rounds": len(times)}

    def object_exchange() -> dict[str, Any]:
        times = []
        for _ in range(cfg.exchange_iters):
            t = time.perf_counter()
            got: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(decl_wire, got, dst=0)
            out: list[Any] = [None]
            dist.scatter_object_list(out, got, src=0)
            times.append(time.perf_counter() - t)
        return {"iter": median(times), "rounds": len(times)}

    for rep in range(cfg.warmup + cfg.repeats):
        keep = rep >= cfg.warmup
        d = {name: os.path.join(root, f"{name}-{rep}")
             for name in ("ckpt", "ckpt-steady", "ckpt-async", "dcp", "dcp-2", "dcp-async")}
        measure("save", "ckpt", keep, ckpt_save, d["ckpt"], True)
        measure("save", "dcp", keep, dcp_save, d["dcp"])
        measure("save, plan cached", "ckpt", keep, ckpt_save, d["ckpt-steady"], False)
        measure("save, plan cached", "dcp", keep, dcp_save, d["dcp-2"])
        measure("async", "ckpt", keep, ckpt_async, d["ckpt-async"])
        measure("async", "dcp", keep, dcp_async, d["dcp-async"])
        measure("load", "ckpt", keep, ckpt_load, d["ckpt"])
        check("ckpt")
        measure("load", "dcp", keep, dcp_load, d["dcp"])
        check("dcp")
        measure("exchange", "ckpt", keep, ckpt_exchange)
        measure("exchange", "dcp", keep, object_exchange)
        if rank == 0 and not sizes:
            sizes = {"manifest": os.path.getsize(os.path.join(d["ckpt"], "manifest.msgpack")),
                     "dcp_metadata": os.path.getsize(os.path.join(d["dcp"], ".metadata")),
                     "decl_msgpack": len(save_mod.msgpack.packb(decl_wire, use_bin_type=True))}
        dist.barrier()
        if rank == 0:
            for p in d.values():
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"records": records, "sizes": sizes, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "verified": True}, f, default=str)
    dist.barrier()
    dist.destroy_process_group()


# --- the parent -------------------------------------------------------------------------------------


def _raise_fd_limit(world: int) -> None:
    # gloo keeps one socket per peer per group (the world, ckpt's async commit group, DCP's): ~3 x N
    # per rank, plus the files; raise the soft limit to the hard one when it is short.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 8 * world + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def rank_memory(world: int, mb_per_rank: float) -> float:
    """Bytes one forked rank holds of its own (beyond the pages it shares with the parent): measured
    ~140 MiB at 32 ranks (PSS; gloo's per-peer buffers grow with the world), plus a few state copies."""
    return (48 + 3 * world) * MiB + 8 * mb_per_rank * MiB


def memory_verdict(world: int, mb_per_rank: float) -> str | None:
    """None when ``world`` ranks should fit in the memory available now, else why not."""
    avail = _available_bytes()
    need = world * rank_memory(world, mb_per_rank)
    if avail is not None and need > 0.9 * avail:
        return (f"{world} ranks need ~{need / 2**30:.1f} GiB ({rank_memory(world, mb_per_rank) / MiB:.0f} MiB per "
                f"rank), {avail / 2**30:.1f} GiB available")
    return None


def run_one(cfg: Config, root: str) -> dict[str, Any]:
    """Fork ``cfg.world`` gloo ranks, run every measurement, return the aggregated figures."""
    _raise_fd_limit(cfg.world)
    out_dir = tempfile.mkdtemp(prefix="ckpt-scaling-out-", dir=root)
    work = tempfile.mkdtemp(prefix=f"ckpt-scaling-{cfg.world}-", dir=root)
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    os.environ["OMP_NUM_THREADS"] = "1"
    if saved["GLOO_SOCKET_IFNAME"] is None and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    t0 = time.perf_counter()
    try:
        # the ranks join through rank 0's store themselves (group=False): no port race, and they find each
        # other on 127.0.0.1 whatever this host's name resolves to
        gloo_ranks(cfg.world, _rank_main, asdict(cfg), work, out_dir, group=False, barrier=False)
        per_rank = []
        for r in range(cfg.world):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                per_rank.append(json.load(f))
    except Exception as e:
        errs = sorted((p for p in os.listdir(out_dir) if p.startswith("error-")), key=lambda p: int(p[6:-4]))
        # a rank that hangs raises nothing: the ranks that did raise (e.g. a store timeout waiting for it) name it
        detail = f"\nranks that raised: {[int(p[6:-4]) for p in errs]}" if errs else ""
        if errs:
            with open(os.path.join(out_dir, errs[0])) as f:
                detail += f"\n{errs[0]}:\n{f.read()}"
        raise RuntimeError(f"{cfg.world} ranks: {type(e).__name__}: {e}{detail}") from e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return aggregate(cfg, per_rank, time.perf_counter() - t0)


def aggregate(cfg: Config, per_rank: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """Medians over repeats: rank 0's wall and coordinator view; bytes of rank 0 and the largest
    of any other rank."""
    rows, cols = geometry(cfg.world, cfg.mb_per_rank, cfg.tensors)
    r0 = per_rank[0]
    ops: dict[str, Any] = {}
    for key, rec in r0["records"].items():
        entry: dict[str, Any] = {"wall": median(rec["wall"]), "local_rank0": median(rec["local"]),
                                 "coord_sent": median(rec["sent"]), "coord_recv": median(rec["recv"]),
                                 "walls": rec["wall"]}
        entry["coord_bytes"] = entry["coord_sent"] + entry["coord_recv"]
        others = [median([s + r for s, r in zip(p["records"][key]["sent"], p["records"][key]["recv"], strict=True)])
                  for p in per_rank[1:]]
        entry["max_other_rank_bytes"] = max(others) if others else 0
        for extra in ("blocking", "done", "iter"):
            if extra in rec:
                entry[extra] = median(rec[extra])
                if extra != "iter":  # the slowest rank's
                    entry[f"{extra}_max"] = median([max(p["records"][key][extra][i] for p in per_rank)
                                                    for i in range(len(rec[extra]))])
        views = rec.get("view") or []
        if views:
            entry["phases"] = {k: median([v[k] for v in views]) for k in views[0]}
        stats = [s for s in rec.get("stats") or [] if s]
        if stats:
            nums = {k for s in stats for k, v in s.items() if isinstance(v, int | float)}
            entry["rank0_stats"] = {k: median([float(s[k]) for s in stats if isinstance(s.get(k), int | float)])
                                    for k in sorted(nums)}
        ops[key] = entry
    return {"ranks": cfg.world, "config": asdict(cfg), "shape": [cfg.world * rows, cols], "rows_per_rank": rows,
            "bytes_per_rank": cfg.tensors * rows * cols * 4, "total_bytes": cfg.world * cfg.tensors * rows * cols * 4,
            "sizes": r0["sizes"], "ops": ops, "verified": all(p["verified"] for p in per_rank),
            "max_rss": max(p["rss"] for p in per_rank), "elapsed": elapsed}


def growth(runs: list[dict[str, Any]], metric: Callable[[dict[str, Any]], float]) -> list[float]:
    """The factor per doubling of ranks between consecutive runs: (m2 / m1) ** (1 / log2(n2 / n1))."""
    out = []
    for a, b in zip(runs, runs[1:], strict=False):
        ma, mb = metric(a), metric(b)
        if not (ma > 0 and mb > 0):
            out.append(float("nan"))
            continue
        out.append((mb / ma) ** (1.0 / math.log2(b["ranks"] / a["ranks"])))
    return out


def run(ranks: list[int], *, mb_per_rank: float = 4.0, tensors: int = 16, repeats: int = 3, warmup: int = 1,
        load_layout: str = "2d", exchange_iters: int = 5, timeout: float = 600.0, fanin: int | None = None,
        root: str | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every rank count of ``ranks`` in turn (forked gloo ranks); the figures and growth factors."""
    own = root is None
    root = root or tempfile.mkdtemp(prefix="ckpt-bench-scaling-")
    os.makedirs(root, exist_ok=True)
    runs: list[dict[str, Any]] = []
    skipped: dict[int, str] = {}
    try:
        for n in sorted(ranks):
            cfg = Config(n, mb_per_rank, tensors, repeats, warmup, load_layout, exchange_iters, timeout, fanin)
            why = memory_verdict(n, mb_per_rank)
            if why is not None:
                skipped[n] = why
                if progress:
                    progress(f"skipping {n} ranks: {why}")
                continue
            if progress:
                progress(f"{n} ranks ...")
            runs.append(run_one(cfg, root))
            if progress:
                progress(f"{n} ranks: done in {runs[-1]['elapsed']:.1f} s")
        res: dict[str, Any] = {"runs": runs, "skipped": skipped, "machine": machine_info(root),
                               "fanin": fanin if fanin is not None else getattr(comm_mod, "FANIN", "flat")}
        res["growth"] = growth_table(runs)
        return res
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


GROWTH_METRICS: dict[str, Callable[[dict[str, Any]], float]] = {}
for _op in OPS[:-1]:
    for _lib in ("ckpt", "dcp"):
        GROWTH_METRICS[f"{_op}/{_lib} wall"] = lambda r, k=f"{_op}/{_lib}": r["ops"][k]["wall"]
        GROWTH_METRICS[f"{_op}/{_lib} coordinator bytes"] = lambda r, k=f"{_op}/{_lib}": r["ops"][k]["coord_bytes"]
for _op in ("save", "load"):
    GROWTH_METRICS[f"{_op}/ckpt coordinator compute"] = (
        lambda r, k=f"{_op}/ckpt": r["ops"][k].get("phases", {}).get("compute", float("nan")))
for _lib in ("ckpt", "dcp"):
    GROWTH_METRICS[f"exchange/{_lib} one round"] = lambda r, k=f"exchange/{_lib}": r["ops"][k]["iter"]
    GROWTH_METRICS[f"exchange/{_lib} coordinator bytes"] = lambda r, k=f"exchange/{_lib}": r["ops"][k]["coord_bytes"]


def growth_table(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    out = {}
    for name, metric in GROWTH_METRICS.items():
        try:
            out[name] = growth(runs, metric)
        except KeyError:
            continue
    return out


# --- rendering --------------------------------------------------------------------------------------


def _kb(n: float) -> str:
    return fmt(n / 1e3, 1)


def time_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in res["runs"]:
        for op in OPS:
            c, d = r["ops"][f"{op}/ckpt"], r["ops"][f"{op}/dcp"]
            if op == "async":
                rows.append([str(r["ranks"]), "async blocking", fmt(c["blocking_max"], 4), fmt(d["blocking_max"], 4),
                             fmt(d["blocking_max"] / c["blocking_max"], 2), "-", "-"])
                name = "async done"
            else:
                name = op
            cw = c["iter"] if op == "exchange" else c["wall"]
            dw = d["iter"] if op == "exchange" else d["wall"]
            rows.append([str(r["ranks"]), name, fmt(cw, 4), fmt(dw, 4), fmt(dw / cw, 2),
                         _kb(c["coord_bytes"]), _kb(d["coord_bytes"])])
    return rows


TIME_COLUMNS = ["ranks", "operation", "ckpt s", "dcp s", "dcp/ckpt", "ckpt coord KB", "dcp coord KB"]


def phase_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in res["runs"]:
        for op in ("save", "save, plan cached", "load"):
            for lib in ("ckpt", "dcp"):
                p = r["ops"][f"{op}/{lib}"].get("phases", {})
                second = p.get("write", p.get("read", float("nan")))
                rows.append([str(r["ranks"]), f"{op} / {lib}", fmt(p.get("plan", float("nan")), 4), fmt(second, 4),
                             fmt(p.get("commit", float("nan")), 4), fmt(p.get("compute", float("nan")), 4),
                             fmt(p.get("fan_in", float("nan")), 4)])
    return rows


PHASE_COLUMNS = ["ranks", "op / lib", "plan s", "write/read s", "commit s", "coord compute s", "coord gather s"]


def growth_rows(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    runs = res["runs"]
    cols = ["metric"] + [f"{a['ranks']}->{b['ranks']}" for a, b in zip(runs, runs[1:], strict=False)]
    rows = [[name] + [fmt(x, 2) for x in xs] for name, xs in res["growth"].items()]
    return cols, rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="8,16,32,64", help="comma-separated rank counts (default 8,16,32,64)")
    p.add_argument("--mb-per-rank", type=float, default=4.0, help="MiB of state per rank (weak scaling)")
    p.add_argument("--tensors", type=int, default=16, help="tensors in the state (each sharded over every rank)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    p.add_argument("--load-layout", choices=("2d", "cols"), default="2d",
                   help="2d: [Shard(0), Shard(1)] on an (N/2, 2) mesh; cols: Shard(1) on the N ranks")
    p.add_argument("--exchange-iters", type=int, default=5, help="rounds of the exchange-alone figure")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds: gloo group and ckpt timeouts")
    p.add_argument("--fanin", type=int, default=None,
                   help="ckpt's exchange tree fan-in in the ranks (ckpt._comm.FANIN; 0: flat star; default: ckpt's)")
    p.add_argument("--json", default=None, help="write the full results here")
    p.add_argument("--out", default=None, help="directory for the checkpoints (default: a temp dir, removed)")


def main(args: argparse.Namespace) -> int:
    ranks = [int(x) for x in str(args.ranks).split(",") if x.strip()]
    res = run(ranks, mb_per_rank=args.mb_per_rank, tensors=args.tensors, repeats=args.repeats, warmup=args.warmup,
              load_layout=args.load_layout, exchange_iters=args.exchange_iters, timeout=args.timeout,
              fanin=args.fanin, root=args.out,
              progress=lambda s: print(s, flush=True))
    if not res["runs"]:
        print("nothing ran")
        return 1
    r0 = res["runs"][0]
    print(f"\nstate: {args.tensors} fp32 tensors, {r0['bytes_per_rank'] / 1e6:.2f} MB per rank; saved Shard(0), "
          f"loaded {args.load_layout}; ckpt exchange fan-in {res['fanin']}; medians of {args.repeats}; every load "
          "checked bitwise")
    print_table("wall time (barrier to barrier; exchange: one round) and the coordinator's metadata bytes",
                TIME_COLUMNS, time_rows(res))
    print_table("phases seen by the coordinator (rank 0)", PHASE_COLUMNS, phase_rows(res))
    gcols, grows = growth_rows(res)
    if len(res["runs"]) > 1:
        print_table("growth per doubling of ranks (1 flat, 2 linear, 4 quadratic)", gcols, grows)
    print("\nsizes: " + "; ".join(f"{r['ranks']} ranks: manifest {r['sizes']['manifest']} B, DCP .metadata "
                                   f"{r['sizes']['dcp_metadata']} B, one declaration {r['sizes']['decl_msgpack']} B"
                                   for r in res["runs"]))
    print("\n" + markdown_table(TIME_COLUMNS, time_rows(res)))
    print("\n" + markdown_table(PHASE_COLUMNS, phase_rows(res)))
    if len(res["runs"]) > 1:
        print("\n" + markdown_table(gcols, grows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0
