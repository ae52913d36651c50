"""DeepSpeed checkpoints read in place, without loading them: ZeRO-1/2/3 checkpoints (full fp32
parameters and Adam moments as byte ranges of DeepSpeed's own partitions, the way ``zero_to_fp32.py``
rebuilds them) and DeepSpeed *universal* checkpoints (``ds_to_universal``'s whole tensors).

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``: per data-parallel
rank ``r`` an optimizer file ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holding that rank's
flat fp32 partition of each parameter group (ZeRO-1/2: ``single_partition_of_fp32_groups``, one
slice of the concatenation of the group's parameters; ZeRO-3: ``fp32_flat_groups``, where every
parameter is split on its own into ``ceil(numel / world)`` elements per rank) and the Adam moments
partitioned the same way; and model files (``mp_rank_00_model_states.pt``, or one per rank for
ZeRO-3) with ``param_shapes`` (names and shapes in partition order) and the buffers.

bf16 training (``"bf16": {"enabled": true}``) names the optimizer files ``bf16_zero_pp_rank_...``
and keeps bf16 parameters in the model files; the fp32 master weights and the moments are in the
optimizer files as above (ZeRO-1/2/3 optimizers), or, with ``"data_types": {"grad_accum_dtype":
"fp32"}`` on ZeRO-1 (or pipeline stage 0), in DeepSpeed's ``BF16_Optimizer``'s layout: the same
``single_partition_of_fp32_groups`` and ``base_optimizer_state`` but no ``zero_stage`` (its stage is
read from the saved ``ds_config``) and no alignment paddings: the group's parameters back to back,
padded at the end. ZeRO-1/2 and ``BF16_Optimizer`` files also map each parameter to its slice of
the rank's partition (``param_slice_mappings``); the reassembly is checked against that map.

``python -m deepspeed.checkpoint.ds_to_universal --input_folder dir/<tag> --output_folder dir/<utag>``
writes ``dir/latest_universal`` (``<utag>``) and ``dir/<utag>/``: copies of the model files
(``mp_rank_*_model_states.pt`` / ``zero_pp_rank_*_mp_rank_*_model_states.pt``, ``param_shapes``,
``buffer_names``, ``module``, ``global_steps``), ``zero/optimizer_state.pt`` (the rank-0 optimizer
state without its partitions, ``param_groups``, ``zero_stage``...), and per parameter (and, fp32 only,
per buffer or parameter without optimizer state) ``zero/<name>/fp32.pt``, ``exp_avg.pt`` and
``exp_avg_sq.pt``: the whole tensor, gathered over data (and tensor) parallel ranks, either as
``{"param": tensor, "cat_dim": 0, ...}`` (ZeRO-1/2) or as a bare flat tensor (ZeRO-3), plus
``step.pt`` (the Adam step, ZeRO-1/2; ZeRO-3 keeps it in ``optimizer_state.pt``).

:func:`deepspeed_manifest` indexes those files with the restricted unpickler (DeepSpeed's own
classes are recorded by stand-ins, DeepSpeed need not be installed and none of its code runs) and
returns a manifest whose tensors ``model.<param>``, ``optim.state.<param>.exp_avg`` and
``optim.state.<param>.exp_avg_sq`` are made of byte ranges of those files (flat ranges of the ZeRO
partitions, or whole universal tensors; the master weights, float32 also for bf16 training), plus
buffers (``model.<buffer>``), ``optim.param_groups`` and ``optim.step``; ``user_metadata["source"]``
says what they came from (``zero_stage``, ``mixed_precision``: ``"bf16"``/``"fp16"``/None,
``optimizer``...). Any layout can then load them, and ``ckpt import`` converts them, streaming.
Tensor (model) parallel ZeRO checkpoints (``mp_rank_01``...) and ZeRO-3 frozen parameters are
refused with a clear error; their universal conversion is read.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from ckpt._checksum import crc32
from ckpt._dtypes import dtype_name
from ckpt.errors import CheckpointError, ForeignFormatError, IntegrityError, ManifestError, StorageError
from ckpt.formats import budget as _budget
from ckpt.formats import torch_pickle as tp
from ckpt.formats.msgpack_codec import encode_object
from ckpt.manifest import Manifest, ObjectEntry, ShardEntry, TensorEntry
from ckpt.shards import Flat, full_box

# DeepSpeed classes its files pickle: recorded by stand-ins, never imported.
STUBS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.constants.ZeroStageEnum",
    "argparse.Namespace",
)
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _regular(path: str) -> int:
    """The size of ``path``, which must be a regular file: a FIFO or device would block ``open``."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ManifestError(f"{path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"{path}: not a regular file; refusing to open it")
    return st.st_size


def _component(name: str, what: str) -> str:
    """``name``, which must be one path component: a tag or parameter name never leads out of the checkpoint."""
    if "/" in name or "\0" in name or name in (".", ".."):
        raise ManifestError(f"{what}: {name[:200]!r} is not a plain file name; refusing to follow it")
    return name


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


_MAX_DIM = 1 << 48  # no tensor dimension is larger; a claim beyond it is hostile or damaged


def _count(value: Any, what: str, field: str, low: int = 0, high: int = _MAX_DIM) -> int:
    """``value`` as an int in ``[low, high]`` (the shared check, :func:`ckpt.formats.budget.integer`):
    every count a file claims is checked before it sizes a loop or an allocation."""
    return _budget.integer(value, what, field, low, high)


def _shape(value: Any, what: str, field: str) -> tuple[int, ...]:
    """A parameter shape from the file (:func:`ckpt.formats.budget.dims`), each dimension at most 2**48."""
    return tuple(_count(s, what, field) for s in _budget.dims(value, what, field))


def _world(pc: Any, what: str) -> int:
    """The data-parallel world size from ``partition_count`` (one int, or one per group, all equal).
    The caller checks it against the rank files present (each rank wrote one) without looping over
    it: a claim of 10**12 ranks costs nothing."""
    counts = pc if isinstance(pc, list) else [pc]
    if not counts:
        raise ForeignFormatError(f"{what}: partition_count is an empty list")
    values = {_count(c, what, "partition_count", 1, 1 << 40) for c in counts}
    if len(values) != 1:
        raise ForeignFormatError(f"{what}: partition_count differs across groups ({sorted(values)[:8]}); "
                                 "ckpt reads checkpoints whose groups are partitioned over the same ranks")
    return values.pop()


def _stage(value: Any, what: str) -> int:
    if isinstance(value, tp.Stub) and value.args:
        value = value.args[0]  # ZeroStageEnum(n), recorded
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return value
    raise ManifestError(f"{what}: unreadable zero_stage {value!r:.100} (DeepSpeed's stages are 0 to 3)")


def _config_stage(config: Any, what: str) -> int:
    """The ZeRO stage of a ``BF16_Optimizer`` file: its saved ``ds_config``'s (DeepSpeed's default 0)."""
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1):
        raise ManifestError(f"{what}: a BF16_Optimizer file (no zero_stage) whose ds_config gives ZeRO stage "
                            f"{stage!r}; DeepSpeed uses it for stages 0 and 1 only: not a layout this reader knows")
    return stage


def _precision(config: Any) -> str | None:
    """``"bf16"``, ``"fp16"`` or None: the mixed precision the saved ``ds_config`` enabled."""
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = config.get(key) if isinstance(config, dict) else None
        if isinstance(section, dict) and section.get("enabled") is True:
            return name
    return None


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


def _dtype(pieces: list[tuple[str, tp.TensorRef, int, int, int]], key: str) -> str:
    """The dtype of a tensor made of ``pieces``: its partitions' (float32 master weights, unless
    DeepSpeed was told to keep them in bf16), the same in every piece."""
    found = {p[1].dtype for p in pieces}
    if len(found) > 1:
        raise ManifestError(f"{pieces[0][0]}: tensor {key!r} is partitioned in different dtypes across ranks "
                            f"({sorted(str(t) for t in found)}); the rank files are from different runs")
    return dtype_name(found.pop(), key=key) if found else "float32"


def _check_slices(shapes: Any, states: list[Any], layout: dict[str, tuple[tuple[int, ...], Pieces]]) -> None:
    """ZeRO-1/2 and BF16_Optimizer files also map each parameter to its slice of the rank's fp32
    partition (``param_slice_mappings``: group -> name -> fragment_address(numel, start)): the
    reassembly from the shapes must find the same slices, or the layout is not the one this reader knows."""
    for name, _, _, osd in states:
        maps = osd.get("param_slice_mappings")
        if maps is None:
            continue  # older DeepSpeed versions save none: nothing to check against
        if not isinstance(maps, list) or len(maps) != len(shapes):
            raise ManifestError(f"{name}: param_slice_mappings has {len(maps) if isinstance(maps, list) else '?'} "
                                f"groups, param_shapes {len(shapes)}")
        for g, group in enumerate(shapes):
            got = {str(p): (at, n) for p in group for f, _, at, _, n in layout[str(p)][1] if f == name}
            want = {}
            for p, addr in (maps[g].items() if isinstance(maps[g], dict) else ()):
                st = addr.state if isinstance(addr, tp.Stub) else None
                if not (isinstance(st, dict) and isinstance(st.get("start"), int) and isinstance(st.get("numel"), int)):
                    raise ManifestError(f"{name}: unreadable param_slice_mappings entry for {p!r}: {addr!r}")
                if st["numel"]:
                    want[str(p)] = (st["start"], st["numel"])
            if got != want:
                raise ManifestError(f"{name}: group {g}'s parameter slices (param_slice_mappings, start and numel) "
                                    f"are {want}, but its partition laid out from param_shapes gives {got}: a "
                                    "DeepSpeed layout this reader does not know")


def _resolve_tag(root: str, tag: str | None) -> str | None:
    """``tag``, else the one ``root/latest`` (or ``root/latest_universal``) names, else None."""
    for pointer in ("latest", "latest_universal"):
        path = os.path.join(root, pointer)
        if tag is None and os.path.isfile(path) and _regular(path) < 4096:
            with open(path) as f:
                tag = _component(f.read().strip(), path) or None
    return tag


def _optim_files(d: str, names: list[str]) -> dict[int, tuple[str, int, str]]:
    """rank -> (file name, mp rank, bf16 prefix) of the ``*_optim_states.pt`` files among ``names``."""
    optim: dict[int, tuple[str, int, str]] = {}
    for n in names:
        if mt := _OPTIM.match(n):
            r = int(mt.group(2))
            if r in optim and optim[r][1] == int(mt.group(3)):  # a fp32 and a bf16 save in one directory
                raise ManifestError(f"{d}: both {optim[r][0]} and {n}: two saves in one tag directory; remove the "
                                    "stale one")
            optim[r] = (n, int(mt.group(3)), mt.group(1) or "")
    return optim


def _check_optim_files(d: str, optim: dict[int, tuple[str, int, str]]) -> None:
    """Refuse rank files this reader cannot take: tensor-parallel, none, or of two saves mixed."""
    if any(mp for _, mp, _ in optim.values()):
        raise ManifestError(f"{d}: a tensor-parallel DeepSpeed checkpoint (mp_rank_01...); ckpt reads mp_rank_00 "
                            "(ZeRO data parallel) only: convert with DeepSpeed's universal checkpoint first")
    if not optim:
        raise ManifestError(f"{d}: no *_optim_states.pt files: not a DeepSpeed ZeRO checkpoint")
    if len({p for _, _, p in optim.values()}) > 1:  # DeepSpeed names all of one save's files alike
        raise ManifestError(f"{d}: rank files of a bf16 and of a non-bf16 save mixed "
                            f"({', '.join(n for n, _, _ in optim.values())}); remove the stale ones")


def _check_all_ranks(d: str, optim: dict[int, tuple[str, int, str]], world: int, stage: int) -> None:
    """Every rank of the ZeRO world has its optimizer file (names the first few missing)."""
    prefix = optim[min(optim)][2]
    # the first few missing ranks: at most len(optim) present ones are skipped, whatever world claims
    missing = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
               for r in itertools.islice((r for r in range(world) if r not in optim), 8)]
    if missing or len(optim) != world:
        raise ManifestError(f"{d}: DeepSpeed ZeRO-{stage} over {world} ranks, but rank file(s) {missing or '?'} "
                            "are missing (a save that did not finish on every rank?)")


def _rank_states(root: str, rel: Callable[[str], str], optim: dict[int, tuple[str, int, str]], first: Any,
                 world: int, zero3: bool) -> list[Any]:
    """Per rank: (file, its fp32 partition of each group, its base optimizer state, its optimizer dict)."""
    states = []
    for r in range(world):
        name = rel(optim[r][0])
        osd = first if r == min(optim) else _get(_load(root, name), "optimizer_state_dict", name)
        groups = _get(osd, "fp32_flat_groups" if zero3 else "single_partition_of_fp32_groups", name)
        base = _get(osd, "optimizer_state_dict" if zero3 else "base_optimizer_state", name)
        states.append((name, [_ref(g, name) for g in groups], base, osd))
    return states


def _zero_tensors(shapes: Any, states: list[Any], first: Any, world: int, zero3: bool) -> dict[str, TensorEntry]:
    """The fp32 parameters and Adam moments as byte ranges of the ranks' flat partitions."""
    tensors: dict[str, TensorEntry] = {}
    kinds = {"model.{}": None, "optim.state.{}.exp_avg": "exp_avg", "optim.state.{}.exp_avg_sq": "exp_avg_sq"}
    for fmt, moment in kinds.items():
        def part(r: int, g: int, moment: str | None = moment) -> tp.TensorRef:
            name, groups, base, _ = states[r]
            if moment is None:
                return groups[g]
            ref = _ref(_get(_get(_get(base, "state", name), g, name), moment, name), name)
            # the moments keep the partition's alignment padding at their end; the fp32 copy may not
            if ref.shape[0] < groups[g].shape[0]:
                raise ManifestError(f"{name}: {moment} of group {g} has {ref.shape[0]} elements, fewer than the "
                                    f"fp32 partition's {groups[g].shape[0]}")
            return ref

        layout = _zero3(shapes, states, part, world) if zero3 else _zero12(shapes, states, first, part, world)
        if moment is None and not zero3:
            _check_slices(shapes, states, layout)
        for pname, (shape, pieces) in layout.items():
            key = fmt.format(pname)
            tensors[key] = TensorEntry(_dtype(pieces, key), shape, _flat_shards(pieces, math.prod(shape), states[0][0]))
    return tensors


def deepspeed_manifest(root: str, *, tag: str | None = None) -> Manifest:
    """A manifest describing the DeepSpeed ZeRO or universal checkpoint ``root/<tag>`` (``tag``: when
    None, from ``root/latest``, else ``root/latest_universal``, or ``root`` itself when it holds the
    files); file paths are relative to ``root``. A tag directory with ``zero/`` and no
    ``*_optim_states.pt`` is a universal checkpoint (``ds_to_universal``'s output).

    Raises:
        ManifestError: missing rank or parameter files (named), rank files of two saves, tensor-parallel
            or unknown layouts (a BF16_Optimizer file of a stage other than 0/1, a ``param_slice_mappings``
            that disagrees with the reassembly), partitions that do not add up to the parameters' shapes
            or differ in dtype across ranks.
        IntegrityError: a pickle names a global outside the allowlist, or a file is damaged.
        StorageError: a checkpoint file that is not a regular file.
    """
    tag = _resolve_tag(root, tag)
    sub = tag or ""
    d = os.path.join(root, sub)
    try:
        names = sorted(os.listdir(d))
    except OSError as e:
        raise ManifestError(f"{d}: cannot list the DeepSpeed checkpoint ({e.strerror})") from None
    optim = _optim_files(d, names)
    if not optim and os.path.isdir(os.path.join(d, "zero")):
        return _universal(root, tag, names)
    _check_optim_files(d, optim)
    rel = (lambda n: f"{sub}/{n}" if sub else n)  # noqa: E731 - paths relative to root
    first_rel = rel(optim[min(optim)][0])
    top = _load(root, first_rel)
    first = _get(top, "optimizer_state_dict", first_rel)
    config = top.get("ds_config")
    # DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation, ZeRO-1 or none) saves no zero_stage
    bf16_optimizer = "zero_stage" not in first and "single_partition_of_fp32_groups" in first
    stage = _config_stage(config, first_rel) if bf16_optimizer else _stage(_get(first, "zero_stage", first_rel),
                                                                            first_rel)
    zero3 = stage == 3 and not bf16_optimizer
    world = _world(_get(first, "partition_count", first_rel), f"{root}/{first_rel}")
    _check_all_ranks(d, optim, world, stage)
    model_name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero3 else "mp_rank_00_model_states.pt"
    if model_name not in names:
        raise ManifestError(f"{d}: {model_name} is missing")
    model = _load(root, rel(model_name))
    shapes = _get(model, "param_shapes", rel(model_name))
    if zero3 and model.get("frozen_param_shapes"):
        raise ManifestError(f"{d}: ZeRO-3 frozen parameters are not supported yet")
    states = _rank_states(root, rel, optim, first, world, zero3)
    tensors = _zero_tensors(shapes, states, first, world, zero3)
    buffers = _buffers(model, rel(model_name))
    clash = sorted(set(tensors) & set(buffers))
    if clash:  # (one would silently replace the other)
        raise ManifestError(f"{root}/{rel(model_name)}: {clash[0][len('model.'):]!r} is both a parameter and a buffer; "
                            "the file is damaged or not a DeepSpeed checkpoint this reader knows")
    tensors.update(buffers)
    objects = _objects(states[0][2], root, states[0][0])
    files = {rel(n): _regular(os.path.join(d, n)) for n in names if n.endswith(".pt")}
    _check_bounds(root, tensors, files)
    steps = model.get("global_steps")
    step = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    prefix = optim[min(optim)][2]
    user = {"source": {"format": "deepspeed", "zero_stage": stage, "world_size": world, "tag": tag,
                       "ds_version": str(model.get("ds_version", "")), "global_steps": step,
                       "mixed_precision": "bf16" if prefix else _precision(config),
                       "optimizer": "BF16_Optimizer" if bf16_optimizer else
                       "DeepSpeedZeroOptimizer_Stage3" if zero3 else "DeepSpeedZeroOptimizer"}}
    m = Manifest(tensors=tensors, objects=objects, files=files, step=step, user_metadata=user)
    m.source_format = "deepspeed"
    return m


def _whole(ref: tp.TensorRef, file: str, key: str, shape: tuple[int, ...] | None = None) -> TensorEntry:
    """A TensorEntry for the contiguous tensor ``ref`` (seen as ``shape``, same numel), all in ``file``."""
    off, n = ref.byte_range()
    shape = ref.shape if shape is None else shape
    return TensorEntry(dtype_name(ref.dtype, key=key), shape, [ShardEntry(full_box(shape), file, off, n)])


def _buffers(model: Any, model_rel: str) -> dict[str, TensorEntry]:
    """``model.<buffer>``: the buffers, whole tensors in the model file's ``module``."""
    names = model.get("buffer_names") or []
    module = _get(model, "module", model_rel) if names else None
    if not isinstance(module, dict):  # a pipeline-parallel model file keeps its modules elsewhere
        return {}
    refs = {str(b): module.get(b) for b in names}
    return {f"model.{b}": _whole(r, model_rel, b) for b, r in refs.items()
            if isinstance(r, tp.TensorRef) and r.contiguous}


def _check_bounds(root: str, tensors: dict[str, TensorEntry], files: dict[str, int]) -> None:
    """Every shard's bytes lie inside its file (a truncated file is named, not read short later)."""
    for t in tensors.values():
        for s in t.shards:
            if s.length and s.offset + s.length > files.get(s.file, -1):
                raise IntegrityError(f"{root}/{s.file}: bytes [{s.offset}, {s.offset + s.length}) lie beyond the file "
                                     "(truncated?)")


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
            _unique(out, pname, states[0][0])
            shape = _shape(shape, states[0][0], f"param_shapes[{g}][{str(pname)[:100]!r}]")
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
            off += n + (_count(paddings[g][i], states[0][0], f"param_alignment_paddings[{g}][{i}]") if paddings
                        else 0)
    return out


def _unique(out: dict[str, Any], pname: Any, what: str) -> None:
    """ManifestError when ``param_shapes`` names parameter ``pname`` twice (in one group or two): the
    second would silently replace the first's pieces."""
    if str(pname) in out:
        raise ManifestError(f"{what}: param_shapes names parameter {str(pname)[:100]!r} twice; the file is damaged "
                            "or not a DeepSpeed checkpoint this reader knows")


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
            _unique(out, pname, states[0][0])
            shape = _shape(shape, states[0][0], f"param_shapes[{str(pname)[:100]!r}]")
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


# ZeRO-1/2 and ZeRO-3 model files; ds_to_universal copies them beside zero/
_MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_UC_STATES = {"model.{}": "fp32", "optim.state.{}.exp_avg": "exp_avg", "optim.state.{}.exp_avg_sq": "exp_avg_sq"}


def _uc_tensor(obj: Any, what: str) -> tp.TensorRef:
    """The tensor of a universal ``zero/<name>/<state>.pt``: ``{"param": tensor, ...}`` or the tensor."""
    ref = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(ref, tp.TensorRef) or not ref.contiguous:
        raise ManifestError(f"{what}: expected a contiguous tensor or {{'param': tensor}}, found {type(obj).__name__}; "
                            "not a DeepSpeed universal checkpoint file this reader knows")
    return ref


def _universal(root: str, tag: str | None, names: list[str]) -> Manifest:
    """The manifest of the DeepSpeed universal checkpoint ``root/<tag>`` (``names``: its entries):
    each ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` is one whole tensor (a flat ZeRO-3 one takes
    its shape from ``param_shapes``); buffers come from the model file, as for ZeRO checkpoints."""
    sub = tag or ""
    rel = (lambda n: f"{sub}/{n}" if sub else n)  # noqa: E731 - paths relative to root
    d = os.path.join(root, sub)
    model_name = next((n for n in _MODEL_FILES if n in names), None)
    if model_name is None:
        raise ManifestError(f"{d}: a DeepSpeed universal checkpoint (zero/) without {' or '.join(_MODEL_FILES)}")
    model = _load(root, rel(model_name))
    shapes = {_component(str(k), f"{root}/{rel(model_name)}"): _shape(v, f"{root}/{rel(model_name)}",
                                                                       f"param_shapes[{str(k)[:100]!r}]")
              for group in _get(model, "param_shapes", rel(model_name)) or [] for k, v in group.items()}
    opt_rel = rel("zero/optimizer_state.pt")
    if not os.path.lexists(os.path.join(root, opt_rel)):
        raise ManifestError(f"{root}/{opt_rel} is missing: not a complete DeepSpeed universal checkpoint "
                            "(a ds_to_universal run that did not finish?)")
    opt = _load(root, opt_rel)
    if not isinstance(opt, dict):
        raise ManifestError(f"{root}/{opt_rel}: not a DeepSpeed universal optimizer state ({type(opt).__name__})")
    try:
        listed = sorted(n for n in os.listdir(os.path.join(d, "zero")) if os.path.isdir(os.path.join(d, "zero", n)))
    except OSError as e:
        raise ManifestError(f"{d}/zero: cannot list the universal checkpoint ({e.strerror})") from None
    tensors = _buffers(model, rel(model_name))
    files = {rel(n): _regular(os.path.join(d, n)) for n in names if n.endswith(".pt")}
    files[opt_rel] = _regular(os.path.join(root, opt_rel))
    step: Any = None
    step_rel = opt_rel
    for pname in [*shapes, *(n for n in listed if n not in shapes)]:
        if f"model.{pname}" in tensors:
            continue  # a buffer: ds_to_universal also writes a float32 copy of it, zero/<buffer>/fp32.pt
        shape: tuple[int, ...] | None = None
        for fmt, state in _UC_STATES.items():
            frel = rel(f"zero/{pname}/{state}.pt")
            if not os.path.lexists(os.path.join(root, frel)):
                if state == "fp32":
                    raise ManifestError(f"{root}/{frel} is missing (parameter {pname!r} of {rel(model_name)})")
                continue  # a parameter without optimizer state (never given a gradient)
            files[frel] = _regular(os.path.join(root, frel))
            ref = _uc_tensor(_load(root, frel), f"{root}/{frel}")
            if shape is None:  # ZeRO-3's are flat; a tensor-parallel file's param_shapes are its shard's
                flat = len(ref.shape) == 1 and math.prod(shapes.get(pname, (-1,))) == ref.numel
                shape = shapes[pname] if flat else ref.shape
            elif ref.numel != math.prod(shape) or (len(ref.shape) != 1 and ref.shape != shape):
                raise ManifestError(f"{root}/{frel}: {state} is {list(ref.shape)}, the parameter {list(shape)}")
            tensors[fmt.format(pname)] = _whole(ref, frel, pname, shape)
        srel = rel(f"zero/{pname}/step.pt")
        if step is None and os.path.lexists(os.path.join(root, srel)):  # ZeRO-1/2: one per parameter, all equal
            step, step_rel = _load(root, srel), srel
            files[srel] = _regular(os.path.join(root, srel))
    if step is None:  # ZeRO-3: the rank-0 optimizer state, kept whole
        osd = opt.get("optimizer_state_dict")
        first = osd.get("state", {}).get(0) if isinstance(osd, dict) and isinstance(osd.get("state"), dict) else None
        step = first.get("step") if isinstance(first, dict) else None
    objects = _objects({"param_groups": opt.get("param_groups"), "state": {0: {"step": step}}}, root, step_rel)
    _check_bounds(root, tensors, files)
    steps = model.get("global_steps")
    gstep = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    stage = _stage(opt["zero_stage"], opt_rel) if "zero_stage" in opt else None
    world = model.get("dp_world_size")
    user = {"source": {"format": "deepspeed", "universal": True, "zero_stage": stage,
                       "world_size": world if isinstance(world, int) else None, "tag": tag,
                       "ds_version": str(model.get("ds_version", "")), "global_steps": gstep,
                       "mixed_precision": _precision(model.get("ds_config"))}}
    m = Manifest(tensors=tensors, objects=objects, files=files, step=gstep, user_metadata=user)
    m.source_format = "deepspeed"
    return m


__all__ = ["STUBS", "deepspeed_manifest", "Pieces"]
