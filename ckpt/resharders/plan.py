"""Reshard plans: a pure function of a source manifest, a target layout and the sharding rules.

``plan(manifest, target, rules)`` says, for every target rank, what it holds under the target layout,
which pieces it writes into which file of the new checkpoint, and which byte ranges of which
source files each piece comes from; with totals (bytes read and written, files touched, largest
single read). No I/O, no process group: resharding 8 -> 3 ranks is a unit test.

How the new checkpoint is laid out: every target rank declares its regions (from the rules), and
the ordinary save planner (:func:`ckpt._save_plan.plan_save`) lays out the files, exactly as if the
target ranks had saved. So each piece is stored once: a replicated piece (norms, routers, and
every dense tensor under DP) is written by one of its holders, chosen to balance bytes across
ranks; a target rank reads its own sharded pieces from one file, contiguously, and replicated pieces
from whichever file holds them. The alternative (every target rank's file holds everything that
rank needs) would multiply the checkpoint's size by the replication degree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ckpt._dtypes import dtype_from_name, itemsize
from ckpt._load_plan import LoadRequest, plan_load
from ckpt._regions import may_overlap
from ckpt._save_plan import PieceDecl, RankDecl, SavePlan, plan_save
from ckpt.errors import LayoutError
from ckpt.layout import Coord, Layout
from ckpt.manifest import Manifest, ObjectEntry, TensorEntry
from ckpt.resharders.derive import PREFIX as DERIVED
from ckpt.resharders.derive import check_strict, derive_rules, is_foreign, scheme_of, unmatched_keys
from ckpt.resharders.placement import (
    check_block_splits,
    coord_str,
    num_layers_of,
    regions_for_ranks,
    specs_of,
    stage_layers,
)
from ckpt.resharders.rules import HF_RULES, MOE_RULES, RuleSet, load_rules, recorded_rules, registered_rules
from ckpt.shards import Box, Region

UNMATCHED_SHOWN = 20  # names of whole tensors a JSON plan lists
_NO_SPLIT = 1 << 62  # plan reads as whole contiguous ranges; the executor cuts them to its buffers


@dataclass(slots=True)
class PieceMove:
    """One piece of the new checkpoint: where it goes and which source bytes it is made of."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    region: Region
    nbytes: int
    holders: tuple[int, ...]  # target ranks that hold this piece under the target layout
    writer: int  # the target rank whose file stores it
    file: str
    offset: int  # byte offset in ``file``
    reads: list[tuple[str, int, int]]  # (source file, byte offset, length), coalesced, by file and offset

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "region": region_dict(self.region), "bytes": self.nbytes, "file": self.file,
                "offset": self.offset, "holders": list(self.holders), "reads": [list(r) for r in self.reads]}


@dataclass(slots=True)
class RankPlan:
    """One target rank: what it holds, and what it writes (its own file of the new checkpoint)."""

    rank: int
    coord: Coord
    layers: tuple[int, int] | None  # global layers [lo, hi) of its pipeline stage
    holds: dict[str, Region]  # key -> region it holds under the target layout
    held_bytes: int
    file: str | None  # the file it writes (None: every piece it holds is written by another rank)
    file_size: int
    writes: list[PieceMove] = field(default_factory=list)
    load_files: list[str] = field(default_factory=list)  # files it reads when loading the new checkpoint

    @property
    def bytes_written(self) -> int:
        return self.file_size

    @property
    def bytes_read(self) -> int:
        return sum(n for m in self.writes for _, _, n in m.reads)

    @property
    def source_files(self) -> list[str]:
        return sorted({f for m in self.writes for f, _, _ in m.reads})

    @property
    def largest_read(self) -> int:
        return max((n for m in self.writes for _, _, n in m.reads), default=0)

    def to_dict(self, detail: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "rank": self.rank, "coord": self.coord.to_dict(),
            "layers": list(self.layers) if self.layers else None, "tensors": len(self.holds),
            "held_bytes": self.held_bytes, "file": self.file, "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read, "source_files": self.source_files, "largest_read": self.largest_read,
            "load_files": self.load_files,
        }
        if detail:
            d["holds"] = {k: region_dict(r) for k, r in self.holds.items()}
            d["writes"] = [m.to_dict() for m in self.writes]
        return d


@dataclass(slots=True)
class ReshardPlan:
    """The whole plan: per target rank reads and writes, the new manifest (without checksums)."""

    plan_id: str
    target: Layout
    rules: str
    num_layers: int
    stages: list[int] | None
    source_layout: dict[str, Any] | None
    source_world: int
    ranks: list[RankPlan]
    save: SavePlan  # the new checkpoint's manifest skeleton and per-rank write assignments
    decls: list[RankDecl]  # what each target rank holds, as the save planner saw it
    whole: list[str] = field(default_factory=list)  # tensors no rule places: held whole by every rank

    @property
    def manifest(self) -> Manifest:
        """The new checkpoint's manifest (checksums are filled in by the rewrite)."""
        return self.save.manifest

    @property
    def moves(self) -> list[PieceMove]:
        return [m for r in self.ranks for m in r.writes]

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)

    @property
    def bytes_written(self) -> int:
        """Bytes of the new data files (headers included)."""
        return sum(r.bytes_written for r in self.ranks)

    @property
    def tensor_bytes(self) -> int:
        return sum(m.nbytes for m in self.moves)

    @property
    def source_files(self) -> list[str]:
        return sorted({f for r in self.ranks for f in r.source_files})

    @property
    def target_files(self) -> list[str]:
        return [r.file for r in self.ranks if r.file is not None]

    @property
    def files_touched(self) -> int:
        """Source files read plus new files written."""
        return len(self.source_files) + len(self.target_files)

    @property
    def largest_read(self) -> int:
        return max((r.largest_read for r in self.ranks), default=0)

    def totals(self) -> dict[str, int]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "tensor_bytes": self.tensor_bytes, "files_touched": self.files_touched,
                "source_files_read": len(self.source_files), "target_files": len(self.target_files),
                "largest_read": self.largest_read, "pieces": len(self.moves),
                "tensors": len(self.manifest.tensors), "whole_tensors": len(self.whole)}

    def to_dict(self, detail: bool = True) -> dict[str, Any]:
        """Plain data for ``--json``; ``detail`` adds every piece's region and source byte ranges."""
        return {"plan_id": self.plan_id, "rules": self.rules, "num_layers": self.num_layers,
                "stages": self.stages,
                "source": {"layout": self.source_layout, "world_size": self.source_world},
                "target": {"layout": str(self.target), "world_size": self.target.world_size},
                "totals": self.totals(), "whole_tensors": len(self.whole), "unmatched": self.whole[:UNMATCHED_SHOWN],
                "ranks": [r.to_dict(detail) for r in self.ranks]}


def region_dict(r: Region) -> dict[str, Any]:
    """``{"box": [offsets, lengths]}`` or ``{"flat": [start, stop]}`` (+ ``"box"`` it is a range of)."""
    if isinstance(r, Box):
        return {"box": r.to_list()}
    d: dict[str, Any] = {"flat": r.to_list()}
    if r.box is not None:
        d["box"] = r.box.to_list()
    return d


def source_layout(manifest: Manifest) -> dict[str, Any] | None:
    """The layout a checkpoint was saved under, as recorded (information only), or None."""
    lay = manifest.user_metadata.get("layout", manifest.layout)
    return lay if isinstance(lay, dict) else manifest.layout


def plan_id(manifest: Manifest, target: Layout, rules: RuleSet, stages: list[int] | None, salt: str = "") -> str:
    """A short id that changes whenever the source, the target layout, the rules or the stages do:
    the new files are named after it, so that an interrupted rewrite can tell its own files."""
    # A committed checkpoint is identified by its files (their names carry a random or plan id)
    # and its commit time: no need to hash the whole manifest.
    source = [sorted(manifest.files.items()), manifest.created, manifest.step, manifest.world_size,
              len(manifest.tensors), len(manifest.objects)]
    h = hashlib.sha256(json.dumps([source, str(target), rules.to_dict(), stages, salt], sort_keys=True).encode())
    return h.hexdigest()[:12]


def check_model(manifest: Manifest, target: Layout, rules: RuleSet) -> None:
    """Model-level checks for the trainer's models (their config is in ``user_metadata["model_config"]``;
    the embedded MoE, or the hybrid family with ``layer_types``): TP must split attention by whole
    heads (query and key/value; a hybrid with no softmax layer only its heads), EP must divide the
    experts.

    Raises LayoutError saying which values would work.
    """
    cfg = manifest.user_metadata.get("model_config")
    if rules.name not in (MOE_RULES.name, HF_RULES.name) or not isinstance(cfg, dict):
        return
    ints = {k: v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    heads, kv = ints.get("num_attention_heads"), ints.get("num_key_value_heads")
    experts = ints.get("num_experts", ints.get("num_local_experts"))
    types = cfg.get("layer_types")
    if isinstance(types, list) and "full_attention" not in types:
        kv = heads  # linear layers only: q, k and v all have num_attention_heads heads
    if target.tp > 1 and heads and kv and (heads % target.tp or kv % target.tp):
        raise LayoutError(
            f"target layout {target}: tp={target.tp} does not divide the model's {heads} attention heads and "
            f"{kv} key/value heads (every TP rank must hold whole heads); choose tp in {_divisors(heads, kv)}")
    if target.ep > 1 and experts and experts % target.ep:
        raise LayoutError(
            f"target layout {target}: ep={target.ep} does not divide the model's {experts} experts per layer "
            f"(every EP rank must hold the same number of experts); choose ep in {_divisors(experts)}")


def _divisors(*ns: int) -> list[int]:
    return [d for d in range(1, min(ns) + 1) if all(n % d == 0 for n in ns)]


def plan(manifest: Manifest, target: Layout, rules: RuleSet = MOE_RULES, *, stages: list[int] | None = None,
         salt: str = "", strict_rules: bool = False) -> ReshardPlan:
    """Plan rewriting the checkpoint described by ``manifest`` for layout ``target``.

    Args:
        manifest: the source checkpoint's manifest (any layout; only its shards matter).
        target: the layout the new checkpoint's shards follow.
        rules: the sharding rules (the embedded MoE's by default; others from a TOML file).
        stages: explicit layers per pipeline stage (``[3, 1]``); balanced when None.
        salt: mixed into the plan id (hence the new file names), e.g. to avoid reusing names.
        strict_rules: refuse when some tensor matches no rule (it would be held whole by every rank);
            without it they are counted in :attr:`ReshardPlan.whole`.

    Raises:
        LayoutError: the target layout cannot hold some tensor (6 experts over ep=4, a TP dim that
            does not split, pp larger than the layers), naming the tensor and rank.
        StateError / MismatchError: the manifest's tensors are inconsistent with the rules.
        UnmatchedTensorsError: (``strict_rules``) tensors no rule places, the first few named.

    Example::

        p = plan(ckpt.inspect(url), Layout.parse("tp=1,ep=4,pp=2"))
        print(p.totals())
    """
    check_model(manifest, target, rules)
    whole = unmatched_keys(manifest, rules)
    if strict_rules:
        check_strict(whole, len(manifest.tensors))
    specs = specs_of(manifest)
    check_block_splits(specs, target, rules)  # a split that would cut a stored block: refused by name
    n_layers = num_layers_of(manifest, rules)
    try:
        per_rank = regions_for_ranks(specs, target, rules, n_layers, stages)
    except LayoutError as e:
        msg = str(e)
        raise LayoutError(msg if msg.startswith("tensor ") else f"target layout {target}: {msg}") from None
    decls = [RankDecl(pieces=[PieceDecl(k, specs[k][0], specs[k][1], r) for k, r in regs.items()])
             for regs in per_rank]
    pid = plan_id(manifest, target, rules, stages, salt)
    user = dict(manifest.user_metadata)
    user.update(layout=target.to_dict(), rules=rules.name,
                resharded_from={"layout": source_layout(manifest), "world_size": manifest.world_size})
    if stages is not None:
        user["pp_stages"] = list(stages)
    else:
        user.pop("pp_stages", None)
    sp = plan_save(decls, save_id=pid, step=manifest.step, user_metadata=user, layout=target.to_dict())
    sp.manifest.objects = {k: _object_for(o, manifest.world_size, target.world_size)
                           for k, o in manifest.objects.items()}
    sp.manifest.world_size = target.world_size

    holders: dict[tuple[str, Region], list[int]] = {}
    for rank, regs in enumerate(per_rank):
        for k, r in regs.items():
            holders.setdefault((k, r), []).append(rank)
    where: dict[tuple[str, Region], str] = {}  # stored piece -> file
    ranks: list[RankPlan] = []
    for rank, a in enumerate(sp.assignments):
        moves = []
        for ent in a.entries:
            p = decls[rank].pieces[ent.piece]
            assert a.file is not None
            where[(p.key, p.region)] = a.file
            moves.append(PieceMove(p.key, p.dtype, p.shape, p.region, ent.length,
                                   tuple(holders[(p.key, p.region)]), rank, a.file, ent.offset,
                                   source_reads(manifest, p.key, p.region)))
        held = sum(r.numel * itemsize(dtype_from_name(specs[k][0])) for k, r in per_rank[rank].items())
        ranks.append(RankPlan(rank, target.coord(rank), stage_layers(target, rank, n_layers, stages),
                              per_rank[rank], held, a.file, sp.manifest.files.get(a.file, 0) if a.file else 0,
                              moves))
    for rank, rp in enumerate(ranks):
        rp.load_files = sorted({where[(k, r)] for k, r in per_rank[rank].items() if (k, r) in where})
    return ReshardPlan(pid, target, rules.name, n_layers, list(stages) if stages is not None else None,
                       source_layout(manifest), manifest.world_size, ranks, sp, decls, whole)


def narrowed(manifest: Manifest, key: str, region: Region) -> Manifest:
    """A manifest holding only tensor ``key`` with only the shards that may overlap ``region``, so
    that planning a small read does not visit every shard of a many-shard tensor."""
    t = manifest.tensors[key]
    shape = tuple(t.shape)
    shards = [s for s in t.shards if may_overlap(s.region, region, shape)]
    return Manifest(tensors={key: TensorEntry(t.dtype, shape, shards)}, files=manifest.files)


def _object_for(o: ObjectEntry, src_world: int, dst_world: int) -> ObjectEntry:
    """Global objects are copied. Per-rank objects (RNG states) get one value per target rank, so the
    new checkpoint is complete for its layout: rank r keeps source rank r's value where it existed,
    and a new rank r gets a copy of source rank ``r % src_world``'s (ranks do not correspond across
    layouts; only rank-for-rank identity is kept)."""
    if o.per_rank is None:
        return ObjectEntry(o.data, o.checksum)
    n = max(1, src_world)
    return ObjectEntry(per_rank={r: o.per_rank[r if r in o.per_rank else r % n] for r in range(dst_world)
                                 if r in o.per_rank or r % n in o.per_rank})


def source_reads(manifest: Manifest, key: str, region: Region) -> list[tuple[str, int, int]]:
    """Byte ranges ``(file, offset, length)`` of the source checkpoint that make up ``region`` of
    tensor ``key``, coalesced where adjacent, ordered by file and offset."""
    t = manifest.tensors[key]
    rp = plan_load(narrowed(manifest, key, region), [LoadRequest(key, t.dtype, tuple(t.shape), region)],
                   max_read=_NO_SPLIT, max_gap=0)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for op in rp.ops:
        by_file.setdefault(op.file, []).extend(op.ranges)
    out: list[tuple[str, int, int]] = []
    for f in sorted(by_file):
        cur: list[int] | None = None
        for off, n in sorted(by_file[f]):
            if cur is not None and off <= cur[0] + cur[1]:
                cur[1] = max(cur[0] + cur[1], off + n) - cur[0]
                continue
            if cur is not None:
                out.append((f, cur[0], cur[1]))
            cur = [off, n]
        if cur is not None:
            out.append((f, cur[0], cur[1]))
    return out


def rules_for(manifest: Manifest, path: str | None = None) -> RuleSet:
    """The rules to reshard ``manifest`` with: the TOML file at ``path`` when given, else the table
    the checkpoint names (``user_metadata["rules"]``, :func:`~ckpt.resharders.rules.recorded_rules`:
    the one it carries, or a registered one: built in ``embedded-moe`` and ``hf-decoder``, or one a
    model added with :func:`ckpt.resharders.rules.register_rules`), else,
    when it names none: rules derived from its key names when they are not ckpt's (a torchtitan or DCP
    checkpoint, :func:`ckpt.resharders.derive.derive_rules`; recorded as ``names:<scheme>`` and derived
    again on the next reshard), else the embedded MoE's.

    Raises LayoutError when the checkpoint names other rules and no file is given.
    """
    if path is not None:
        return load_rules(path)
    name = manifest.user_metadata.get("rules")
    if (name is None and is_foreign(manifest)) or (isinstance(name, str) and name.startswith(DERIVED)):
        return derive_rules(specs_of(manifest), scheme_of(manifest))
    if name is None:
        return MOE_RULES
    found = recorded_rules(manifest.user_metadata)
    if found is not None:
        return found
    raise LayoutError(f"the checkpoint was saved with sharding rules {name!r}, not a registered table "
                      f"({', '.join(registered_rules())}); pass the model's rules file with --rules FILE (TOML, "
                      "see the README)")


def parse_stages(text: str | None) -> list[int] | None:
    """``"3,1"`` -> ``[3, 1]`` (layers per pipeline stage); None or ``""`` -> None (balanced)."""
    if text is None or not text.strip():
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        raise LayoutError(f"--stages {text!r}: expected layers per stage as integers, e.g. 3,1") from None


__all__ = ["PieceMove", "RankPlan", "ReshardPlan", "plan", "plan_id", "check_model", "source_reads", "rules_for",
           "parse_stages", "region_dict", "source_layout", "coord_str", "narrowed"]
