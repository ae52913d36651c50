"""Planning at scale, simulated: a DeepSeek-V3-sized MoE under a 16,384-rank layout, one process,
descriptors only (no tensor is allocated).

Measures, for ckpt: the save-side global plan (dedup + writer balance + file/offset assignment),
manifest encode size and decode time, one rank's load plan under an 8,192-rank target layout
(after the manifest is decoded), writer balance within replica groups (ranks linked by pieces
they both hold: ``replica_groups``), and per-rank metadata bytes of the save protocol. For torch
DCP: the same save-side planning through its planner API (``create_default_global_save_plan``
after ``dedup_save_plans``) on equivalent metadata (``SavePlan``s of ``WriteItem``s), side by side,
in a child process with a time limit.

    python -m bench scale [--ranks-layout tp=8,ep=64,pp=16,dp=2,zero=1] [--target tp=8,ep=32,pp=16,dp=2,zero=1]
                          [--layers 61] [--sample-ranks 8] [--dcp-timeout 600]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import random
import resource
import time
from typing import Any

import msgpack

from bench.common import print_table
from ckpt._load_plan import LoadRequest, plan_load
from ckpt._save_plan import PieceDecl, RankDecl, plan_save
from ckpt.formats.msgpack_codec import decode_manifest, encode_manifest
from ckpt.layout import Layout
from ckpt.resharders.rules import Placement, Rule, RuleSet, param_box, zero_range
from ckpt.shards import Box, Flat

# DeepSeek-V3 (671B): hidden 7168, 61 layers (first 3 dense), 256 routed + 1 shared expert of FFN
# 2048, dense FFN 18432, vocab 129280, 128 heads; MLA attention (q_lora 1536, kv_lora 512,
# qk_nope 128, qk_rope 64, v 128).
H, V, HEADS, DENSE_FFN, MOE_FFN, EXPERTS = 7168, 129280, 128, 18432, 2048, 256
Q_LORA, KV_LORA, NOPE, ROPE, VDIM = 1536, 512, 128, 64, 128

DSV3_RULES = RuleSet(
    name="deepseek-v3",
    rules=[
        Rule("model.embed_tokens.weight", Placement(tp_dim=0, pad=True)),
        Rule("lm_head.weight", Placement(tp_dim=0, pad=True)),
        Rule("*.self_attn.q_b_proj.weight", Placement(tp_dim=0)),
        Rule("*.self_attn.kv_b_proj.weight", Placement(tp_dim=0)),
        Rule("*.self_attn.o_proj.weight", Placement(tp_dim=1)),
        Rule("*.mlp.experts.gate_proj", Placement(ep_dim=0, tp_dim=1)),
        Rule("*.mlp.experts.up_proj", Placement(ep_dim=0, tp_dim=1)),
        Rule("*.mlp.experts.down_proj", Placement(ep_dim=0, tp_dim=2)),
        Rule("*.mlp.shared_experts.gate_proj.weight", Placement(tp_dim=0)),
        Rule("*.mlp.shared_experts.up_proj.weight", Placement(tp_dim=0)),
        Rule("*.mlp.shared_experts.down_proj.weight", Placement(tp_dim=1)),
        Rule("*.mlp.gate_proj.weight", Placement(tp_dim=0)),
        Rule("*.mlp.up_proj.weight", Placement(tp_dim=0)),
        Rule("*.mlp.down_proj.weight", Placement(tp_dim=1)),
    ],
    first_stage=["model.embed_tokens.*"],
    last_stage=["model.norm.*", "lm_head.*"],
)


def dsv3_params(layers: int = 61, dense_layers: int = 3) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of every parameter."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (V, H))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,)),
                (p + "self_attn.q_a_proj.weight", (Q_LORA, H)), (p + "self_attn.q_a_layernorm.weight", (Q_LORA,)),
                (p + "self_attn.q_b_proj.weight", (HEADS * (NOPE + ROPE), Q_LORA)),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, H)),
                (p + "self_attn.kv_a_layernorm.weight", (KV_LORA,)),
                (p + "self_attn.kv_b_proj.weight", (HEADS * (NOPE + VDIM), KV_LORA)),
                (p + "self_attn.o_proj.weight", (H, HEADS * VDIM))]
        if i < dense_layers:
            out += [(p + "mlp.gate_proj.weight", (DENSE_FFN, H)), (p + "mlp.up_proj.weight", (DENSE_FFN, H)),
                    (p + "mlp.down_proj.weight", (H, DENSE_FFN))]
        else:
            out += [(p + "mlp.gate.weight", (EXPERTS, H)), (p + "mlp.gate.e_score_correction_bias", (EXPERTS,)),
                    (p + "mlp.experts.gate_proj", (EXPERTS, MOE_FFN, H)),
                    (p + "mlp.experts.up_proj", (EXPERTS, MOE_FFN, H)),
                    (p + "mlp.experts.down_proj", (EXPERTS, H, MOE_FFN)),
                    (p + "mlp.shared_experts.gate_proj.weight", (MOE_FFN, H)),
                    (p + "mlp.shared_experts.up_proj.weight", (MOE_FFN, H)),
                    (p + "mlp.shared_experts.down_proj.weight", (H, MOE_FFN))]
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    return out


_STAGES: dict[tuple[int, int, int, int], list[list[tuple[str, tuple[int, ...], Placement]]]] = {}
_BOXES: dict[tuple[Any, ...], tuple[list[int], list[int], int]] = {}


def _by_stage(params: list[tuple[str, tuple[int, ...]]], layers: int, pp: int,
              rules: RuleSet) -> list[list[tuple[str, tuple[int, ...], Placement]]]:
    key = (id(params), id(rules), layers, pp)
    if key not in _STAGES:
        stages: list[list[tuple[str, tuple[int, ...], Placement]]] = [[] for _ in range(pp)]
        for name, shape in params:
            stages[rules.stage_of(name, layers, pp)].append((name, shape, rules.placement(name)))
        _STAGES[key] = stages
    return _STAGES[key]


def rank_pieces(params: list[tuple[str, tuple[int, ...]]], layout: Layout, rank: int, layers: int,
                rules: RuleSet) -> list[PieceDecl]:
    """What one rank declares: its stage's bf16 parameter blocks and fp32 AdamW moments (ZeRO-1).

    Same pieces as ``param_box`` / ``optim_region`` of every parameter of the rank's stage, but the
    parameter's block is computed once per (parameter, TP index, EP index) that it depends on and
    the ZeRO range inline (``optim_region``'s own logic): the 3.1 M pieces of 16,384 ranks in ~12 s
    instead of ~60 s of fnmatch. Every rank still gets its own Region objects (fresh tuples), as
    ``RankDecl.from_wire`` gives the coordinator, so that the measured plan does not profit from
    shared objects.
    """
    c = layout.coord(rank)
    out = []
    for name, shape, pl in _by_stage(params, layers, layout.pp, rules)[c.pp]:
        bk = (id(rules), layout, name, c.tp if pl.tp_dim is not None else -1, c.ep if pl.ep_dim is not None else -1)
        got = _BOXES.get(bk)
        if got is None:
            b = param_box(name, shape, layout, c, rules)
            got = _BOXES[bk] = (list(b.offsets), list(b.lengths), b.numel)
        offs, lens, n = got
        out.append(PieceDecl("model." + name, "bfloat16", tuple(list(shape)), Box(tuple(offs), tuple(lens))))
        reg: Box | Flat
        if layout.zero == 0:
            reg = Box(tuple(offs), tuple(lens))
        else:
            s, e = zero_range(n, layout, c, pl.is_expert)
            reg = Flat(s, e) if tuple(lens) == shape else Flat(s, e, Box(tuple(offs), tuple(lens)))
        if reg.numel:
            out.append(PieceDecl("optim.exp_avg." + name, "float32", tuple(list(shape)), reg))
            out.append(PieceDecl("optim.exp_avg_sq." + name, "float32", tuple(list(shape)), reg))
    return out


def replica_groups(decls: list[RankDecl]) -> tuple[list[list[int]], int]:
    """The replica groups of a save, and the number of distinct non-empty pieces declared.

    A replica group is a connected component of the graph whose nodes are the ranks and where two
    ranks are joined when they both declare some non-empty piece (same key, same region): the sets
    of ranks among which the writer choice can move bytes. Components, not a fixed grouping by
    layout coordinates: under ``tp=8,ep=64,pp=16,dp=2`` the dense blocks of one (pp, tp) are
    replicated over its 128 (dp, ep) ranks, the expert blocks over dp pairs, unsplit parameters and
    their ZeRO chunks over the 8 TP ranks, so one pipeline stage (1,024 ranks) is one group; a
    grouping by (pp, tp) mixed ranks whose bytes the planner cannot trade and hid that. Ranks that
    share nothing are not in any group. Union-find over the first declarer of each piece: O(pieces).
    """
    first: dict[tuple[Any, ...], int] = {}
    parent = list(range(len(decls)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for rank, d in enumerate(decls):
        for p in d.pieces:
            r = p.region
            if isinstance(r, Box):
                if 0 in r.lengths:
                    continue
                sig: tuple[Any, ...] = (p.key, r.offsets, r.lengths)
            else:
                if r.stop <= r.start:
                    continue
                sig = (p.key, r.start, r.stop) if r.box is None else (p.key, r.start, r.stop, r.box.offsets,
                                                                        r.box.lengths)
            f = first.setdefault(sig, rank)
            if f != rank:
                a, b = find(f), find(rank)
                if a != b:
                    parent[b] = a
    members: dict[int, list[int]] = {}
    for r in range(len(decls)):
        members.setdefault(find(r), []).append(r)
    return [g for g in members.values() if len(g) > 1], len(first)


def replica_balance(groups: list[list[int]], loads: list[int]) -> dict[str, Any]:
    """Writer balance within replica groups (``replica_groups``): over the groups, the largest
    ``(max - min) / mean`` and ``max / mean`` of their ranks' written bytes (target: within 5%)."""
    spread, peak = 0.0, 0.0
    for g in groups:
        b = [loads[r] for r in g]
        mean = sum(b) / len(b)
        if mean:
            spread = max(spread, (max(b) - min(b)) / mean)
            peak = max(peak, max(b) / mean)
    return {"replica_groups": len(groups), "replica_group_ranks_max": max(map(len, groups), default=0),
            "replica_group_imbalance_max": spread, "replica_group_max_over_mean": peak}


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _distribution_rank(rank: int, world: int, root: str, out: str) -> None:
    import torch.distributed as dist

    from ckpt._comm import Comm
    from ckpt.load import fetch_manifest
    from ckpt.storage import get_storage

    comm, storage = Comm(None), get_storage(root)
    times: dict[str, float] = {}
    for mode in ("broadcast", "each"):
        dist.barrier()
        t0 = time.perf_counter()
        m = fetch_manifest(storage, comm, manifest_read=mode)
        dist.barrier()  # the slowest rank's time: everyone holds the decoded manifest
        times[mode] = time.perf_counter() - t0
        del m
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def manifest_distribution(data: bytes, ranks: int, root: str) -> dict[str, Any]:
    """Every rank gets the decoded manifest: read once and broadcast over gloo vs every rank reading it.

    ``ranks`` local processes (fork) on this machine; the file is in the page cache, so "each" is
    the best case of a storage that serves many readers well.
    """
    import tempfile

    from bench.ranks import gloo_ranks

    d = tempfile.mkdtemp(prefix="ckpt-scale-manifest-", dir=root)
    try:
        with open(os.path.join(d, "manifest.msgpack"), "wb") as f:
            f.write(data)
        out = os.path.join(d, "times.json")
        gloo_ranks(ranks, _distribution_rank, d, out)
        with open(out) as f:
            times = json.load(f)
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    return {"ranks": ranks, "mb": len(data) / 1e6, "broadcast_s": times["broadcast"], "each_s": times["each"]}


def simulate(layout: Layout, target: Layout, layers: int, sample: int, dist_ranks: int = 0,
             dist_dir: str = "/tmp") -> dict[str, Any]:
    params = dsv3_params(layers)
    res: dict[str, Any] = {"layout": str(layout), "target": str(target), "world": layout.world_size,
                           "params": len(params), "param_count": sum(_numel(s) for _, s in params)}
    t0 = time.perf_counter()
    decls = [RankDecl(pieces=rank_pieces(params, layout, r, layers, DSV3_RULES)) for r in range(layout.world_size)]
    res["declare_s"] = time.perf_counter() - t0
    _progress(res, "declare_s")
    res["declared_pieces"] = sum(len(d.pieces) for d in decls)
    # what each rank sends to the coordinator for planning (msgpack of its declaration)
    per_rank = [len(msgpack.packb(d.to_wire(), use_bin_type=True)) for d in decls[:: max(1, len(decls) // 64)]]
    res["decl_bytes_per_rank_median"] = sorted(per_rank)[len(per_rank) // 2]
    gc.collect()
    t0 = time.perf_counter()
    # As ckpt.save plans a safetensors save: large replicated pieces may be written in parts.
    plan = plan_save(decls, save_id="sim", step=1, split_replicas=True)
    res["global_plan_s"] = time.perf_counter() - t0
    res["peak_rss_after_plan_gb"] = rss_gb()
    _progress(res, "global_plan_s")
    res["manifest_shards"] = sum(len(t.shards) for t in plan.manifest.tensors.values())
    loads = [a.nbytes for a in plan.assignments]
    holders = [b for b in loads if b]
    res["writers"] = len(holders)
    res["writer_bytes_max_over_mean"] = max(holders) / (sum(holders) / len(holders))
    groups, distinct = replica_groups(decls)
    res["distinct_pieces"] = distinct
    res["split_extra_shards"] = res["manifest_shards"] - distinct
    res.update(replica_balance(groups, loads))
    # per-rank reply bytes (its assignment)
    reply = [len(msgpack.packb(a.to_wire(), use_bin_type=True)) for a in plan.assignments[:: max(1, len(loads) // 64)]]
    res["assignment_bytes_per_rank_median"] = sorted(reply)[len(reply) // 2]
    m = plan.manifest
    for t in m.tensors.values():
        for s in t.shards:
            s.checksum = 0xFFFFFFFF
    del decls, plan
    gc.collect()
    t0 = time.perf_counter()
    data = encode_manifest(m)
    res["manifest_encode_s"] = time.perf_counter() - t0
    res["manifest_mb"] = len(data) / 1e6
    del m
    gc.collect()
    t0 = time.perf_counter()
    m2 = decode_manifest(data)
    res["manifest_decode_s"] = time.perf_counter() - t0
    res["peak_rss_gb"] = rss_gb()
    _progress(res, "manifest_decode_s")
    if dist_ranks > 1:
        res["manifest_distribution"] = manifest_distribution(data, dist_ranks, dist_dir)
        print(f"manifest to {dist_ranks} ranks: {res['manifest_distribution']}", flush=True)
    # one target rank's load plan, for a sample of target ranks
    rng = random.Random(0)
    times = []
    tparams = params
    for r in rng.sample(range(target.world_size), sample):
        reqs = [LoadRequest(p.key, p.dtype, p.shape, p.region) for p in rank_pieces(tparams, target, r, layers,
                                                                                   DSV3_RULES)]
        t0 = time.perf_counter()
        rp = plan_load(m2, reqs)
        times.append(time.perf_counter() - t0)
        res.setdefault("load_plan_ops", []).append(len(rp.ops))
        print(f"load plan of target rank {r}: {times[-1]:.3f} s, {len(rp.ops)} reads", flush=True)
    res["load_plan_s_max"] = max(times)
    res["load_plan_s_median"] = sorted(times)[len(times) // 2]
    return res


def _progress(res: dict[str, Any], key: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {key} = {res[key]:.3f}  "
          f"({ {k: v for k, v in res.items() if not isinstance(v, list)} })", flush=True)


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for x in s:
        n *= x
    return n


def dcp_plan(layout: Layout, layers: int, out: str) -> None:
    """DCP's global save planning on the same pieces (run in a child process with a time limit)."""
    import torch
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    try:  # where DCP keeps it varies across versions (private module in 2.13)
        from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    except ImportError:
        from torch.distributed.checkpoint.utils import dedup_save_plans  # type: ignore[attr-defined,no-redef]

    params = dsv3_params(layers)
    t0 = time.perf_counter()
    plans = []
    for r in range(layout.world_size):
        items = []
        for p in rank_pieces(params, layout, r, layers, DSV3_RULES):
            if hasattr(p.region, "offsets"):
                offs, sizes, shape = p.region.offsets, p.region.lengths, p.shape
            else:  # flat pieces as 1-D chunks of the flattened tensor (DCP has no flat-in-box)
                base = 0
                if p.region.box is not None:
                    base = sum(o * s for o, s in zip(p.region.box.offsets, _strides(p.shape), strict=True))
                offs, sizes, shape = (base + p.region.start,), (p.region.numel,), (_numel(p.shape),)
            dt = torch.bfloat16 if p.dtype == "bfloat16" else torch.float32
            items.append(WriteItem(
                index=MetadataIndex(p.key, torch.Size(offs)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offs),
                                                                       sizes=torch.Size(sizes)),
                                            properties=TensorProperties(dtype=dt), size=torch.Size(shape))))
        plans.append(SavePlan(items))
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    deduped = dedup_save_plans(plans)
    t1 = time.perf_counter()
    create_default_global_save_plan(deduped)
    t2 = time.perf_counter()
    with open(out, "w") as f:
        json.dump({"build_s": build, "dedup_s": t1 - t0, "global_plan_s": t2 - t1, "total_plan_s": t2 - t0,
                   "peak_rss_gb": rss_gb()}, f)


def _strides(shape: tuple[int, ...]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def run_dcp(layout: Layout, layers: int, timeout: float, root: str) -> dict[str, Any]:
    out = os.path.join(root, "dcp_scale.json")
    ctx = mp.get_context("fork")
    p = ctx.Process(target=dcp_plan, args=(layout, layers, out))
    t0 = time.perf_counter()
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return {"status": f"did not finish within {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    if p.exitcode != 0:
        return {"status": f"failed (exit code {p.exitcode}; out of memory is SIGKILL = -9)"}
    with open(out) as f:
        return {"status": "ok", **json.load(f)}


TARGETS = [("global save plan (s)", "global_plan_s", 30.0), ("peak memory (GB)", "peak_rss_gb", 8.0),
           ("manifest (MB)", "manifest_mb", 256.0), ("manifest decode (s)", "manifest_decode_s", 5.0),
           ("one rank's load plan, max (s)", "load_plan_s_max", 0.1)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", default="tp=8,ep=64,pp=16,dp=2,zero=1")
    p.add_argument("--target", default="tp=8,ep=32,pp=16,dp=2,zero=1")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--sample-ranks", type=int, default=8)
    p.add_argument("--dcp-timeout", type=float, default=600.0, help="0 skips DCP")
    p.add_argument("--manifest-ranks", type=int, default=8,
                   help="local gloo ranks that fetch the simulated manifest (broadcast vs each); 0 skips")
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    layout, target = Layout.parse(args.layout), Layout.parse(args.target)
    res = simulate(layout, target, args.layers, args.sample_ranks, args.manifest_ranks, args.dir)
    if args.dcp_timeout > 0:
        res["dcp"] = run_dcp(layout, args.layers, args.dcp_timeout, args.dir)
    rows = [[name, f"{res[k]:.3f}", f"< {goal:g}", "met" if res[k] < goal else "MISSED"] for name, k, goal in TARGETS]
    # Within each replica group (see replica_groups), not across groups: stages hold different bytes.
    rows.append(["writer bytes (max - min) / mean, worst replica group",
                 f"{100 * res['replica_group_imbalance_max']:.2f}%", "< 5%",
                 "met" if res["replica_group_imbalance_max"] < 0.05 else "MISSED"])
    rows.append(["writer bytes max / mean, worst replica group", f"{res['replica_group_max_over_mean']:.4f}",
                 "< 1.05", "met" if res["replica_group_max_over_mean"] < 1.05 else "MISSED"])
    print_table(f"{res['world']} ranks ({res['layout']}) -> {res['target']}", ["figure", "ckpt", "target", ""], rows)
    print(json.dumps({k: v for k, v in res.items() if k != "load_plan_ops"}, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0
