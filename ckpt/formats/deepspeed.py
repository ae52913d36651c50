"""DeepSpeed ZeRO-1/2/3 checkpoints read in place: full fp32 parameters and Adam moments as byte
ranges of DeepSpeed's own files, the way ``zero_to_fp32.py`` rebuilds them, without loading them.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``: per data-parallel
rank ``r`` an optimizer file ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holding that rank's
flat fp32 partition of each parameter group (ZeRO-1/2: ``single_partition_of_fp32_groups``, one
slice of the concatenation of the group's parameters; ZeRO-3: ``fp32_flat_groups``, where every
parameter is split on its own into ``ceil(numel / world)`` elements per rank) and the Adam moments
partitioned the same way; and model files (``mp_rank_00_model_states.pt``, or one per rank for
ZeRO-3) with ``param_shapes`` (names and shapes in partition order) and the buffers.

:func:`deepspeed_manifest` indexes those files with the restricted unpickler (DeepSpeed's own
classes are recorded by stand-ins, DeepSpeed need not be installed and none of its code runs) and
returns a manifest whose tensors ``model.<param>``, ``optim.state.<param>.exp_avg`` and
``optim.state.<param>.exp_avg_sq`` are made of flat ranges pointing into the partitions, plus
buffers (``model.<buffer>``), ``optim.param_groups`` and ``optim.step``. Any layout can then load
them, and ``ckpt import`` converts them, streaming. Tensor (model) parallel DeepSpeed checkpoints
(``mp_rank_01``...) and ZeRO-3 frozen parameters are refused with a clear error.
"""

from __future__ import annotations

import math
import os
import re
import stat
from typing import Any

from ckpt.checksum import crc32
from ckpt.dtypes import dtype_name
from ckpt.errors import CheckpointError, IntegrityError, ManifestError, StorageError
from ckpt.formats import torch_pickle as tp
from ckpt.formats.msgpack_codec import encode_object
from ckpt.manifest import Manifest, ObjectEntry, ShardEntry, TensorEntry
from ckpt.shards import Box, Flat

# DeepSpeed classes its files pickle: recorded by stand-ins, never imported.
STUBS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.constants.ZeroStageEnum",
    "argparse.Namespace",
)
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _regular(path: str) -> int:
    """The size of ``path``, which must be a regular file: a FIFO or device would block ``open``."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ManifestError(f"{path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"{path}: not a regular file; refusing to open it")
    return st.st_size


def _read(root: str, rel: str) -> tp.Read:
    path = os.path.join(root, rel)
    _regular(path)

    def read(offset: int, n: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(n)
        if len(data) != n:
            raise IntegrityError(f"{path}: ends before byte {offset + n} (truncated?)")
        return data

    return read


def _load(root: str, rel: str) -> Any:
    path = os.path.join(root, rel)
    size = _regular(path)
    return tp.load_torch(_read(root, rel), 0, size, what=path, stubs=STUBS).obj


def _get(d: Any, key: Any, what: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ManifestError(f"{what}: no {key!r} entry; not a DeepSpeed ZeRO checkpoint file this reader knows")
    return d[key]


def _stage(value: Any, what: str) -> int:
    if isinstance(value, tp.Stub) and value.args and isinstance(value.args[0], int):
        return value.args[0]  # ZeroStageEnum(n), recorded
    if isinstance(value, int):
        return value
    raise ManifestError(f"{what}: unreadable zero_stage {value!r}")


def _ref(v: Any, what: str) -> tp.TensorRef:
    if not isinstance(v, tp.TensorRef) or not v.contiguous or len(v.shape) != 1:
        raise ManifestError(f"{what}: expected a flat (1-D, contiguous) partition, got {v!r}")
    return v


def _flat_shards(pieces: list[tuple[str, tp.TensorRef, int, int, int]], numel: int, file: str) -> list[ShardEntry]:
    """ShardEntries from ``(file, partition, partition element, tensor element, count)`` pieces."""
    out = []
    for rel, ref, at, start, count in pieces:
        isz = ref.dtype.itemsize
        out.append(ShardEntry(Flat(start, start + count), rel, ref.data_offset + (ref.storage_offset + at) * isz,
                              count * isz))
    if not out:  # an empty parameter: one empty shard, as ckpt's writers record it
        out.append(ShardEntry(Flat(0, 0), file, 0, 0))
    return out


def deepspeed_manifest(root: str, *, tag: str | None = None) -> Manifest:
    """A manifest describing the DeepSpeed checkpoint ``root/<tag>`` (``tag``: from ``root/latest``
    when None, or ``root`` itself when it holds the rank files); file paths are relative to ``root``.

    Raises:
        ManifestError: missing rank files (listed), tensor-parallel or unknown layouts, partitions
            that do not add up to the parameters' shapes.
        IntegrityError: a pickle names a global outside the allowlist, or a file is damaged.
    """
    if tag is None and os.path.isfile(os.path.join(root, "latest")) and _regular(os.path.join(root, "latest")) < 4096:
        with open(os.path.join(root, "latest")) as f:
            tag = f.read().strip()
    sub = tag or ""
    d = os.path.join(root, sub)
    try:
        names = sorted(os.listdir(d))
    except OSError as e:
        raise ManifestError(f"{d}: cannot list the DeepSpeed checkpoint ({e.strerror})") from None
    optim = {int(mt.group(1)): (n, int(mt.group(2))) for n in names if (mt := _OPTIM.match(n))}
    if any(mp for _, mp in optim.values()):
        raise ManifestError(f"{d}: a tensor-parallel DeepSpeed checkpoint (mp_rank_01...); ckpt reads mp_rank_00 "
                            "(ZeRO data parallel) only: convert with DeepSpeed's universal checkpoint first")
    if not optim:
        raise ManifestError(f"{d}: no *_optim_states.pt files: not a DeepSpeed ZeRO checkpoint")
    rel = (lambda n: f"{sub}/{n}" if sub else n)  # noqa: E731 - paths relative to root
    first = _get(_load(root, rel(optim[min(optim)][0])), "optimizer_state_dict", rel(optim[min(optim)][0]))
    stage = _stage(_get(first, "zero_stage", rel(optim[min(optim)][0])), rel(optim[min(optim)][0]))
    pc = _get(first, "partition_count", rel(optim[min(optim)][0]))
    world = max(pc) if isinstance(pc, list) else int(pc)
    missing = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world) if r not in optim]
    if missing or len(optim) != world:
        raise ManifestError(f"{d}: DeepSpeed ZeRO-{stage} over {world} ranks, but rank file(s) {missing or '?'} "
                            "are missing (a save that did not finish on every rank?)")
    model_name = "mp_rank_00_model_states.pt" if stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if model_name not in names:
        raise ManifestError(f"{d}: {model_name} is missing")
    model = _load(root, rel(model_name))
    shapes = _get(model, "param_shapes", rel(model_name))
    if stage == 3 and model.get("frozen_param_shapes"):
        raise ManifestError(f"{d}: ZeRO-3 frozen parameters are not supported yet")
    states = []
    for r in range(world):
        name = rel(optim[r][0])
        osd = first if r == min(optim) else _get(_load(root, name), "optimizer_state_dict", name)
        groups = _get(osd, "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups", name)
        base = _get(osd, "base_optimizer_state" if stage <= 2 else "optimizer_state_dict", name)
        states.append((name, [_ref(g, name) for g in groups], base))
    tensors: dict[str, TensorEntry] = {}
    kinds = {"model.{}": None, "optim.state.{}.exp_avg": "exp_avg", "optim.state.{}.exp_avg_sq": "exp_avg_sq"}
    for fmt, moment in kinds.items():
        def part(r: int, g: int, moment: str | None = moment) -> tp.TensorRef:
            name, groups, base = states[r]
            if moment is None:
                return groups[g]
            ref = _ref(_get(_get(_get(base, "state", name), g, name), moment, name), name)
            # the moments keep the partition's alignment padding at their end; the fp32 copy may not
            if ref.shape[0] < groups[g].shape[0]:
                raise ManifestError(f"{name}: {moment} of group {g} has {ref.shape[0]} elements, fewer than the "
                                    f"fp32 partition's {groups[g].shape[0]}")
            return ref

        layout = _zero12(shapes, states, first, part, world) if stage <= 2 else _zero3(shapes, states, part, world)
        for pname, (shape, pieces) in layout.items():
            tensors[fmt.format(pname)] = TensorEntry("float32", shape,
                                                     _flat_shards(pieces, math.prod(shape), states[0][0]))
    for bname in model.get("buffer_names") or []:  # buffers: whole tensors in the model file
        ref = _get(model, "module", rel(model_name)).get(bname)
        if isinstance(ref, tp.TensorRef) and ref.contiguous:
            off, n = ref.byte_range()
            tensors[f"model.{bname}"] = TensorEntry(dtype_name(ref.dtype, key=bname), ref.shape,
                                                    [ShardEntry(Box((0,) * len(ref.shape), ref.shape),
                                                                rel(model_name), off, n)])
    objects = _objects(states[0][2], root, states[0][0])
    files = {rel(n): _regular(os.path.join(d, n)) for n in names if n.endswith(".pt")}
    for t in tensors.values():
        for s in t.shards:
            if s.length and s.offset + s.length > files.get(s.file, -1):
                raise IntegrityError(f"{root}/{s.file}: bytes [{s.offset}, {s.offset + s.length}) lie beyond the file "
                                    "(truncated?)")
    steps = model.get("global_steps")
    step = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    user = {"source": {"format": "deepspeed", "zero_stage": stage, "world_size": world, "tag": tag,
                       "ds_version": str(model.get("ds_version", "")), "global_steps": step}}
    m = Manifest(tensors=tensors, objects=objects, files=files, step=step, user_metadata=user)
    m.source_format = "deepspeed"
    return m


Pieces = list[tuple[str, tp.TensorRef, int, int, int]]


def _zero12(shapes: Any, states: list[Any], first: Any, part: Any, world: int
            ) -> dict[str, tuple[tuple[int, ...], Pieces]]:
    """ZeRO-1/2: group ``g``'s parameters, in order (plus alignment paddings), fill the
    concatenation of the ranks' partitions of that group."""
    paddings = first.get("param_alignment_paddings")
    out: dict[str, tuple[tuple[int, ...], Pieces]] = {}
    for g, group in enumerate(shapes):
        parts = [part(r, g) for r in range(world)]
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + p.shape[0])
        off = 0
        for i, (pname, shape) in enumerate(group.items()):
            shape = tuple(int(s) for s in shape)
            n = math.prod(shape)
            pieces: Pieces = []
            for r, p in enumerate(parts):
                lo, hi = max(off, starts[r]), min(off + n, starts[r + 1])
                if lo < hi:
                    pieces.append((states[r][0], p, lo - starts[r], lo - off, hi - lo))
            if sum(c for *_, c in pieces) != n:
                raise ManifestError(f"{states[0][0]}: parameter {pname!r} {list(shape)} runs past the end of group "
                                    f"{g}'s partitions ({starts[-1]} elements)")
            out[str(pname)] = (shape, pieces)
            off += n + (int(paddings[g][i]) if paddings else 0)
    return out


def _zero3(shapes: Any, states: list[Any], part: Any, world: int) -> dict[str, tuple[tuple[int, ...], Pieces]]:
    """ZeRO-3: each parameter split on its own, ``ceil(numel / world)`` elements per rank, at the same
    offset of every rank's (concatenated) flat groups."""
    groups = len(states[0][1])
    sizes = [part(0, g).shape[0] for g in range(groups)]
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    out: dict[str, tuple[tuple[int, ...], Pieces]] = {}
    off = 0
    for group in shapes:
        for pname, shape in group.items():
            shape = tuple(int(s) for s in shape)
            n = math.prod(shape)
            pn = math.ceil(n / world)
            pieces: Pieces = []
            for r in range(world):
                start, count = r * pn, max(0, min(pn, n - r * pn))
                at = off  # rank r's virtual offset; a parameter may span two groups
                while count > 0:
                    g = next((i for i in range(groups) if bounds[i] <= at < bounds[i + 1]), None)
                    if g is None:
                        raise ManifestError(f"{states[r][0]}: parameter {pname!r} runs past the rank's flat groups")
                    take = min(count, bounds[g + 1] - at)
                    pieces.append((states[r][0], part(r, g), at - bounds[g], start, take))
                    at, start, count = at + take, start + take, count - take
            out[str(pname)] = (shape, pieces)
            off += pn
    if off > bounds[-1]:
        raise ManifestError(f"{states[0][0]}: the parameters need {off} elements per rank, the flat groups hold "
                            f"{bounds[-1]}")
    return out


def _objects(base: Any, root: str, name: str) -> dict[str, ObjectEntry]:
    """``optim.param_groups`` (without the parameter indices) and ``optim.step`` (group 0's)."""
    out: dict[str, ObjectEntry] = {}
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if isinstance(groups, list):
        clean = [{k: v for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]
        try:
            data = encode_object(clean, key="optim.param_groups")
            out["optim.param_groups"] = ObjectEntry(data=data, checksum=crc32(data))
        except CheckpointError:
            pass  # a value msgpack cannot hold: the tensors are what matters
    state = base.get("state") if isinstance(base, dict) else None
    step = state.get(0, {}).get("step") if isinstance(state, dict) else None
    if isinstance(step, tp.TensorRef) and step.numel == 1:
        value = tp.materialize(step, _read(root, name)).item()
        data = encode_object(float(value), key="optim.step")
        out["optim.step"] = ObjectEntry(data=data, checksum=crc32(data))
    elif isinstance(step, (int, float)):
        data = encode_object(step, key="optim.step")
        out["optim.step"] = ObjectEntry(data=data, checksum=crc32(data))
    return out
