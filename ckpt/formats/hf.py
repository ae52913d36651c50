"""Hugging Face interop for the embedded MoE (``ckpt.trainer.model``, the Qwen3-MoE architecture).

- :func:`export_hf`: a ckpt checkpoint saved under any layout -> a ``save_pretrained``-style directory
  (``config.json``, ``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json``) with
  per-expert key names, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads;
- :func:`import_hf`: such a directory (one ``model.safetensors`` or an index; per-expert or fused
  expert keys) -> a weights-only ckpt checkpoint the trainer can start from, in any layout.

Checkpoint convention (the trainer's contract): model weights are the tensors ``model.<param>`` for
every ``<param>`` of ``MoEForCausalLM.named_parameters()``, global shapes, any layout; the model
config is ``user_metadata["model_config"]`` (``ModelConfig.to_dict()``). Everything else
(``optim.*``, ``train.*``, ``rng``) is ignored by export and never written by import.

Both directions validate all that metadata can tell (architecture, names, shapes, dtypes, files)
before writing a byte, then stream: each output tensor is read with ckpt's load planner
(:func:`~ckpt.planner.plan_load`, :func:`~ckpt.io.run_read_plan`) into one of two reusable buffers,
cast there if asked, and written by a background thread while the next buffer fills. Memory stays at
the budget, plus one tensor when a single tensor is larger than a buffer.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ckpt import transaction
from ckpt.checksum import crc32
from ckpt.dtypes import dtype_from_name, dtype_name, safetensors_dtype
from ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    IntegrityError,
    LayoutError,
    ManifestError,
    MismatchError,
    StateError,
)
from ckpt.formats import hf_files
from ckpt.formats.msgpack_codec import encode_manifest
from ckpt.formats.safetensors_header import MAX_HEADER_BYTES, HeaderEntry, build_header, parse_header
from ckpt.io import byte_view, run_read_plan
from ckpt.manifest import DATA_DIR, MANIFEST_NAME, Manifest, ShardEntry, TensorEntry, check_relpath
from ckpt.planner import DEFAULT_MAX_READ, LoadRequest, PieceDecl, RankDecl, plan_load, plan_save
from ckpt.resharders.layout import Layout
from ckpt.resharders.rules import MOE_RULES, RuleSet
from ckpt.save import read_manifest
from ckpt.shards import Box, full_box
from ckpt.source_checks import VERIFY_CHUNK, SourceChecks, VerifyingReads
from ckpt.storage import Storage, get_storage
from ckpt.trainer.model import ModelConfig

__all__ = ["export_hf", "import_hf", "HFExportResult", "HFImportResult", "parse_size", "parse_dtype", "param_shapes",
           "plan_export", "ExportPlan", "model_config_of", "read_hf_source", "HFSource",
           "DEFAULT_MAX_SHARD_SIZE", "DEFAULT_MEMORY_BUDGET"]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
RULES_NAME = "embedded-moe"  # user_metadata["rules"] of the embedded MoE's checkpoints
PREFIX = "model."  # checkpoint key = PREFIX + parameter name
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", as transformers counts it
DEFAULT_MEMORY_BUDGET = 1 << 30
ST_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it

Progress = Callable[[int, int], None]

# Output dtypes a Hugging Face export may use, and the float dtypes an import may read.
_DTYPE_ALIASES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
_HF_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_IMPORTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_ST_TO_TORCH = {st: dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2) if (st := safetensors_dtype(dt)) is not None}

# Our fused expert parameters (E, out, in); transformers' per-expert on-disk keys; its fused gate+up.
_FUSED = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate|up|down)_proj")
_HF_PER_EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight")
_HF_GATE_UP = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.gate_up_proj")
_VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")  # dim 0 may carry vocab padding


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "k": 10**3, "m": 10**6, "g": 10**9,
          "t": 10**12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Bytes from ``5000``, ``"5GB"`` (10**9, as transformers counts) or ``"1GiB"`` (2**30).

    Raises StateError on anything else or on a size below one byte.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise StateError(f"{what} {value!r} is not a size; write e.g. 5GB, 500MB, 1GiB or a number of bytes")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise StateError(f"{what} {value!r} must be at least one byte")
    return n


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"|"fp16"|"fp32"`` (or torch names / dtypes) -> torch dtype; None stays None.

    Raises StateError for any other dtype: a Hugging Face export holds float32, float16 or bfloat16.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        dt: torch.dtype | None = value
    else:
        dt = _DTYPE_ALIASES.get(str(value).lower().removeprefix("torch."))
    if dt not in _HF_DTYPES:
        raise StateError(f"dtype {value!r} is not supported: a Hugging Face checkpoint of this model holds "
                         "bf16, fp16 or fp32 weights; pass one of those")
    return dt


def param_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``MoEForCausalLM(cfg).named_parameters()`` names and shapes, in module order, without building it.

    Computed from the config because a meta-device build costs seconds in a fresh process (its
    embedding init imports torch's reference kernels); a test checks it against the module.
    """
    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate.weight", (e, h)),
                (p + "mlp.experts.gate_proj", (e, i, h)), (p + "mlp.experts.up_proj", (e, i, h)),
                (p + "mlp.experts.down_proj", (e, h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]


def _describe(cfg: ModelConfig) -> str:
    return (f"ModelConfig(num_hidden_layers={cfg.num_hidden_layers}, hidden_size={cfg.hidden_size}, "
            f"num_experts={cfg.num_experts}, moe_intermediate_size={cfg.moe_intermediate_size}, "
            f"vocab_size={cfg.vocab_size}, ...)")


def _few(items: list[str], n: int = 6) -> str:
    return "; ".join(items[:n]) + (f"; and {len(items) - n} more" if len(items) > n else "")


# ---------------------------------------------------------------------------------------------
# Streaming: read items into two reusable buffers, write them from a background thread
# ---------------------------------------------------------------------------------------------

_ALIGN = 64


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(slots=True)
class _Item:
    """One output tensor: which box of which stored tensor to read, and what to write."""

    name: str  # entry name in the output file
    req: LoadRequest  # its region is always a Box
    out_dtype: torch.dtype
    out_shape: tuple[int, ...]

    @property
    def src_dtype(self) -> torch.dtype:
        return dtype_from_name(self.req.dtype)

    @property
    def numel(self) -> int:
        return self.req.region.numel

    @property
    def src_bytes(self) -> int:
        return self.numel * self.src_dtype.itemsize

    @property
    def out_bytes(self) -> int:
        return self.numel * self.out_dtype.itemsize

    @property
    def cast(self) -> bool:
        return self.out_dtype != self.src_dtype

    @property
    def cost(self) -> int:
        """Buffer bytes: the stored bytes, plus the cast result when the dtype changes."""
        return _up(self.src_bytes) + (_up(self.out_bytes) if self.cast else 0)


@dataclass(slots=True)
class _OutFile:
    path: str
    header: bytes
    items: list[_Item]

    @property
    def size(self) -> int:
        return len(self.header) + sum(i.out_bytes for i in self.items)


class _Sink:
    """The writing side, on one thread: files in order, each its header then its items' bytes."""

    def __init__(self, storage: Storage, files: list[_OutFile]):
        self.storage = storage
        self.files = files
        self.order = [(fi, ii) for fi, f in enumerate(files) for ii in range(len(f.items))]
        self.pos = 0
        self.writer: Any = None
        self.sizes = [0] * len(files)
        self.opened: list[str] = []

    def write(self, views: list[memoryview], _keepalive: torch.Tensor) -> int:
        n = 0
        for mv in views:
            fi, ii = self.order[self.pos]
            self.pos += 1
            f = self.files[fi]
            if ii == 0:
                self.opened.append(f.path)
                self.writer = self.storage.open_writer(f.path)
                self.writer.write(f.header)
            self.writer.write(mv)
            n += len(mv)
            if ii == len(f.items) - 1:
                self.sizes[fi] = self.writer.close()
                self.writer = None
        return n

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


@dataclass(slots=True)
class _Streamed:
    sizes: list[int]  # per output file
    checksums: list[int]  # per item, in order (empty unless asked for)
    buffer_bytes: int  # most data-buffer bytes held at once


def _batches(items: list[_Item], cap: int) -> list[list[int]]:
    """Consecutive runs of items whose buffer cost fits ``cap``; a larger item is a batch of its own."""
    out: list[list[int]] = []
    cur: list[int] = []
    cost = 0
    for i, it in enumerate(items):
        c = it.cost
        if cur and cost + c > cap:
            out.append(cur)
            cur, cost = [], 0
        cur.append(i)
        cost += c
    if cur:
        out.append(cur)
    return out


def _fill(storage: Storage, manifest: Manifest, items: list[_Item], buf: torch.Tensor, *, workers: int,
          max_read: int, checksums: list[int] | None) -> list[memoryview]:
    """Read ``items`` into ``buf`` (stored dtype), cast where asked; return the bytes to write."""
    targets: list[torch.Tensor] = []
    off = 0
    for it in items:
        lengths = it.req.region.lengths if isinstance(it.req.region, Box) else (it.numel,)
        targets.append(buf[off : off + it.src_bytes].view(it.src_dtype).view(lengths))
        off += _up(it.src_bytes)
    wanted = [i for i, it in enumerate(items) if it.numel]
    plan = plan_load(manifest, [items[i].req for i in wanted], contiguous_targets=[True] * len(wanted),
                     max_read=max_read, max_gap=getattr(storage, "coalesce_gap", 4096))
    run_read_plan(storage, plan, [targets[i] for i in wanted], [items[i].req.dtype for i in wanted],
                  workers=workers)
    views: list[memoryview] = []
    for it, t in zip(items, targets, strict=True):
        if it.cast:
            out = buf[off : off + it.out_bytes].view(it.out_dtype).view(t.shape)
            off += _up(it.out_bytes)
            out.copy_(t)
            _check_cast(it, t, out)
            t = out
        mv = byte_view(t)
        if checksums is not None:
            checksums.append(crc32(mv))
        views.append(mv)
    return views


def _check_cast(it: _Item, src: torch.Tensor, out: torch.Tensor) -> None:
    # Only float16 is narrower than its possible sources (float32/64, bfloat16); bf16 has float32's range.
    if it.out_dtype != torch.float16 or it.src_dtype not in (torch.float64, torch.float32, torch.bfloat16):
        return
    overflow = int(torch.isinf(out).sum()) - int(torch.isinf(src).sum())
    if overflow > 0:
        raise MismatchError(f"tensor {it.req.key!r}: {overflow} values overflow float16 (|x| > 65504) and would "
                            "become inf; export as bf16 or fp32 instead")


def _stream(src: Storage, manifest: Manifest, files: list[_OutFile], dst: Storage, *, budget: int, workers: int,
            checksums: bool, progress: Progress | None, sink: _Sink, verify_source: bool = False) -> _Streamed:
    """Write ``files`` to ``dst``, reading their items from ``manifest``'s tensors in ``src``.

    Memory: two buffers of at most 3/8 of ``budget`` each (one filling while the other is written),
    the read planner's per-worker buffers (at most ``budget / 4`` together), and, for an item that
    alone exceeds a buffer, one dedicated buffer (its stored bytes, plus its cast result if any),
    never two at once. Raises whatever reading or writing raised; the caller
    removes partial files (``sink.opened``).

    ``verify_source``: check the CRC32 of every stored shard (with a checksum) of the tensors read,
    hashing bytes as the reads land (each once, whatever the order) and reading the bytes of a shard
    the items skip through one more buffer (at most ``VERIFY_CHUNK``) once the last batch using its
    tensor is read, before that batch is written. Raises IntegrityError on a mismatch.
    """
    items = [it for f in files for it in f.items]
    cap = max(_ALIGN, budget * 3 // 8)
    max_read = max(1 << 20, min(DEFAULT_MAX_READ, budget // (4 * max(1, workers))))
    batches = _batches(items, cap)
    costs = [sum(items[i].cost for i in b) for b in batches]
    reader: Storage = src
    checks: SourceChecks | None = None
    last: dict[str, int] = {}  # tensor key -> the last batch that reads it
    if verify_source:
        for k, batch in enumerate(batches):
            for i in batch:
                last[items[i].req.key] = k
        checks = SourceChecks(manifest, list(last), src.url, min(VERIFY_CHUNK, max(1 << 16, budget // 16)))
        reader = cast(Storage, VerifyingReads(src, checks))
    finished: list[list[str]] = [[] for _ in batches]
    for key, k in last.items():
        finished[k].append(key)
    slab_size = max((c for c in costs if c <= cap), default=0)
    slabs: list[torch.Tensor | None] = [None, None]
    total = sum(it.out_bytes for it in items)
    done = 0
    held = peak = 0
    sums: list[int] = []
    pending: deque[tuple[Future[int], int]] = deque()  # (write, dedicated buffer bytes)

    def collect() -> None:
        nonlocal done, held
        fut, dedicated = pending.popleft()
        done += fut.result()
        held -= dedicated
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hf-write") as ex:
        try:
            for k, (batch, cost) in enumerate(zip(batches, costs, strict=True)):
                if len(pending) == 2:  # the buffer this batch reuses must be written out first
                    collect()
                dedicated = 0
                if cost > slab_size:  # one tensor larger than a buffer: alone in flight
                    while pending:
                        collect()
                    buf, dedicated = torch.empty(cost, dtype=torch.uint8), cost
                else:
                    slab = slabs[k % 2]
                    if slab is None:
                        slab = slabs[k % 2] = torch.empty(slab_size, dtype=torch.uint8)
                        held += slab_size
                    buf = slab
                held += dedicated
                peak = max(peak, held)
                views = _fill(reader, manifest, [items[i] for i in batch], buf, workers=workers, max_read=max_read,
                              checksums=sums if checksums else None)
                if checks is not None:
                    checks.finish(finished[k], src)  # the shards no later batch reads: all match, or raise
                pending.append((ex.submit(sink.write, views, buf), dedicated))
                del buf, views
            while pending:
                collect()
        except BaseException:
            for fut, _ in pending:
                fut.exception()  # let the writer finish what it holds before aborting
            sink.abort()
            raise
    return _Streamed(sink.sizes, sums, peak)


def _cleanup(storage: Storage, paths: list[str], created_root: str | None) -> None:
    """Best effort: remove files this call wrote, and the directory it created if now empty."""
    for p in paths:
        try:
            storage.delete(p)
        except CheckpointError:
            pass
    if created_root is not None:
        for d in (os.path.join(created_root, DATA_DIR), created_root):
            try:
                os.rmdir(d)
            except OSError:
                pass


def _new_local_root(storage: Storage) -> str | None:
    """The local directory ``storage`` would create, or None (exists already, or not local)."""
    root = getattr(storage, "root", None)
    return root if isinstance(root, str) and not os.path.exists(root) else None


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class HFExportResult:
    """What :func:`export_hf` wrote."""

    out_dir: str
    files: list[str]  # the safetensors files, in order
    tensors: int
    total_size: int  # bytes of tensor data (the index's metadata.total_size)
    dtype: str
    buffer_bytes: int  # most data-buffer bytes held at once
    seconds: float
    side_files: list[str] = field(default_factory=list)  # tokenizer / generation config files written

    def to_dict(self) -> dict[str, Any]:
        return {"out_dir": self.out_dir, "files": self.files, "tensors": self.tensors,
                "total_size": self.total_size, "dtype": self.dtype, "buffer_bytes": self.buffer_bytes,
                "seconds": self.seconds, "side_files": self.side_files}


@dataclass(slots=True)
class ExportPlan:
    """Everything an export writes, derived from the manifest alone (no data read)."""

    config: Any  # ModelConfig (embedded MoE) or an adapter's config dict
    dtype: torch.dtype
    files: list[_OutFile]
    index: dict[str, Any]
    config_json: dict[str, Any]

    @property
    def total_size(self) -> int:
        return sum(it.out_bytes for f in self.files for it in f.items)


def model_config_of(manifest: Manifest, *, url: str = "checkpoint") -> ModelConfig:
    """The embedded MoE's config stored in a checkpoint's ``user_metadata["model_config"]``.

    Raises ManifestError when it is missing, belongs to another architecture, or is invalid.
    """
    meta = manifest.user_metadata
    rules = meta.get("rules")
    if rules is not None and rules != RULES_NAME:
        raise ManifestError(f"{url}: saved for the architecture/rules {rules!r}; Hugging Face export knows only "
                            f"the embedded MoE ({RULES_NAME!r}, exported as Qwen3MoeForCausalLM)")
    raw = meta.get("model_config")
    if raw is None:
        raise ManifestError(f"{url}: no user_metadata['model_config']; Hugging Face export needs a checkpoint of "
                            "the embedded MoE written by the ckpt trainer or by `ckpt import-hf`")
    if not isinstance(raw, dict):
        raise ManifestError(f"{url}: user_metadata['model_config'] is a {type(raw).__name__}, not a map")
    try:
        return ModelConfig.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise ManifestError(f"{url}: user_metadata['model_config'] does not describe the embedded MoE "
                            f"(unknown architecture?): {e}") from None


def plan_export(manifest: Manifest, *, dtype: torch.dtype | None = None,
                max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, url: str = "checkpoint",
                config: dict[str, Any] | None = None, source_names: str | None = None) -> ExportPlan:
    """Plan an export from the manifest alone: names, dtypes, the split into files, headers, index.

    ``config`` (a Hugging Face ``config.json`` body) and ``source_names`` (``ckpt``, ``torchtitan``,
    ``megatron`` or a names file) select an adapter family (:mod:`ckpt.hf`); without them a
    checkpoint written by ``import-hf`` uses the adapter it recorded, and the embedded MoE's
    checkpoints export as Qwen3-MoE.

    Raises ManifestError (no or unknown model config), MismatchError (tensors that do not match the
    config: missing, unexpected, mis-shaped; a stored dtype the export cannot hold).
    """
    from ckpt.hf.engine import export_items, source_adapter, split_files

    found = source_adapter(manifest, config, url=url)
    if found is None and source_names not in (None, "ckpt"):
        raise ManifestError(f"{url}: exporting {source_names} names needs the model's Hugging Face config: "
                            "pass --config CONFIG_JSON (or the HF model directory it came from)")
    if found is not None:
        adapter, full = found
        names = source_names or manifest.user_metadata.get("names") or "ckpt"
        tensors, out_dtype, config_json = export_items(manifest, adapter, full, names, dtype, url=url)
        out_files = split_files(tensors, out_dtype, max_shard_size)
        all_items = [it for f in out_files for it in f.items]
        index = {"metadata": {"total_size": sum(it.out_bytes for it in all_items),
                              "total_parameters": sum(it.numel for it in all_items)},
                 "weight_map": dict(sorted({it.name: f.path for f in out_files for it in f.items}.items()))}
        return ExportPlan(full, out_dtype, out_files, index, config_json)
    cfg = model_config_of(manifest, url=url)
    params = param_shapes(cfg)
    stored = {k[len(PREFIX):]: t for k, t in manifest.tensors.items() if k.startswith(PREFIX)}
    names = {p for p, _ in params}
    problems: list[str] = []
    missing = [PREFIX + p for p, _ in params if p not in stored]
    if missing:
        problems.append(f"missing: {_few(missing)}")
    unexpected = sorted(PREFIX + p for p in stored if p not in names)
    if unexpected:
        problems.append(f"unexpected: {_few(unexpected)}")
    wrong = []
    for p, shape in params:
        if p not in stored:
            continue
        s = tuple(stored[p].shape)
        padded = p in _VOCAB_PARAMS and len(s) == 2 and s[1] == shape[1] and s[0] >= shape[0]
        if s != shape and not padded:
            wrong.append(f"{PREFIX}{p} is {list(s)}, the config needs {list(shape)}")
    if wrong:
        problems.append(f"wrong shape: {_few(wrong)}")
    if problems:
        raise MismatchError(f"{url}: the checkpoint's model tensors do not match its {_describe(cfg)}: "
                            + " | ".join(problems))
    src_dtypes = {p: dtype_from_name(stored[p].dtype, key=PREFIX + p) for p, _ in params}
    not_float = sorted(f"{PREFIX}{p} ({d})" for p, d in src_dtypes.items() if not d.is_floating_point)
    if not_float:
        raise MismatchError(f"{url}: model tensors of non-float dtype cannot be exported as weights: "
                            f"{_few(not_float)}")
    dtype = export_dtype(set(src_dtypes.values()), dtype, url=url)
    st = safetensors_dtype(dtype)
    assert st is not None

    items: list[_Item] = []
    for p, shape in params:
        key, sdt = PREFIX + p, stored[p].dtype
        gshape = tuple(stored[p].shape)
        m = _FUSED.fullmatch(p)
        if m is None:
            region = Box((0,) * len(shape), shape)  # a padded vocab keeps only the first rows
            items.append(_Item(p, LoadRequest(key, sdt, gshape, region), dtype, shape))
            continue
        for e in range(shape[0]):
            region = Box((e, 0, 0), (1, *shape[1:]))
            items.append(_Item(f"{m['prefix']}.{e}.{m['proj']}_proj.weight", LoadRequest(key, sdt, gshape, region),
                               dtype, shape[1:]))

    groups = _split(items, st, max_shard_size)
    n = len(groups)
    files: list[_OutFile] = []
    for k, group in enumerate(groups):
        header, _ = build_header([(it.name, st, it.out_shape, it.out_bytes) for it in group], ST_METADATA)
        files.append(_OutFile(f"model-{k + 1:05d}-of-{n:05d}.safetensors", header, group))
    weight_map = {it.name: f.path for f in files for it in f.items}
    index = {"metadata": {"total_size": sum(it.out_bytes for it in items),
                          "total_parameters": sum(it.numel for it in items)},
             "weight_map": dict(sorted(weight_map.items()))}
    config_json = cfg.to_hf_config_dict()
    config_json["torch_dtype"] = config_json["dtype"] = dtype_name(dtype)
    return ExportPlan(cfg, dtype, files, index, config_json)


def export_dtype(stored: set[torch.dtype], dtype: torch.dtype | None, *, url: str) -> torch.dtype:
    """The export's dtype: ``dtype`` when given, else the one stored dtype, else float32 for mixed
    float16/bfloat16/float32 (the widest, so the export is lossless); MismatchError otherwise."""
    if dtype is not None:
        return dtype
    if len(stored) == 1 and next(iter(stored)) in _HF_DTYPES:
        return next(iter(stored))
    if stored <= set(_HF_DTYPES):
        return torch.float32
    raise MismatchError(f"{url}: stored dtypes {sorted(str(k) for k in stored)} cannot be written to a "
                        "Hugging Face checkpoint as they are; pass dtype bf16, fp16 or fp32")


def _config_arg(config: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """A config.json body from a dict, a config.json path, or a Hugging Face model directory."""
    if config is None or isinstance(config, dict):
        return config
    path = os.path.join(config, CONFIG_NAME) if os.path.isdir(config) else config
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: cannot read the Hugging Face config ({e})") from None
    if not isinstance(d, dict):
        raise ManifestError(f"{path}: not a JSON object")
    return d


def _split(items: list[_Item], st: str, limit: int) -> list[list[_Item]]:
    """Fill files in order up to ``limit`` bytes (header included); a larger tensor gets a file of its own."""
    digits = len(str(sum(it.out_bytes for it in items)))
    big = 10**digits - 1  # no data offset has more digits: header estimates are upper bounds
    fixed = 8 + len(json.dumps({"__metadata__": ST_METADATA}, separators=(",", ":"))) + 8

    def entry(it: _Item) -> int:
        e = {it.name: {"dtype": st, "shape": list(it.out_shape), "data_offsets": [big, big]}}
        return len(json.dumps(e, separators=(",", ":")))  # braces stand in for the comma

    groups: list[list[_Item]] = []
    cur: list[_Item] = []
    size = fixed
    for it in items:
        add = entry(it) + it.out_bytes
        if cur and size + add > limit:
            groups.append(cur)
            cur, size = [], fixed
        cur.append(it)
        size += add
    if cur:
        groups.append(cur)
    return groups


def _check_empty_target(dst: Storage, overwrite: bool, names: set[str]) -> list[str]:
    """Refuse to write over an existing model (or a ckpt checkpoint); return what overwrite replaces."""
    try:
        present = dst.list()
    except CheckpointError:
        present = []
    clash = sorted(p for p in present if p in names or p == MANIFEST_NAME
                   or ("/" not in p and p.endswith(".safetensors")))
    if clash and not overwrite:
        raise CheckpointExistsError(f"{dst.url}: already holds {_few(clash, 3)}; pass overwrite=True "
                                    "(--overwrite) to replace the model there, or export to an empty directory")
    if MANIFEST_NAME in clash:
        raise CheckpointExistsError(f"{dst.url}: holds a ckpt checkpoint; refusing to export over it")
    return clash


def export_hf(src_url: str, out_dir: str, *, dtype: str | torch.dtype | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
              workers: int = 4, overwrite: bool = False, storage_options: dict[str, Any] | None = None,
              progress: Progress | None = None, verify_source: bool = True,
              tokenizer: str | None = None, config: str | dict[str, Any] | None = None,
              source_names: str | None = None) -> HFExportResult:
    """Export the model weights of the checkpoint at ``src_url`` (any layout) as a Hugging Face model.

    Tokenizer and generation-config files found next to the source's manifest, or in the directory
    ``tokenizer`` (they win), are written next to the weights (:mod:`ckpt.formats.hf_files`).

    Writes ``model-0000k-of-0000n.safetensors`` (each at most ``max_shard_size`` bytes unless one
    tensor alone is larger), then ``model.safetensors.index.json``, then ``config.json`` (the
    Qwen3-MoE config). Experts are written per expert (``...mlp.experts.E.gate_proj.weight``), as
    ``save_pretrained`` does; vocab padding is dropped; optimizer and training state are ignored.

    Args:
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``; default: the stored dtype (float32 if mixed).
        max_shard_size: bytes per file, or a string such as ``"5GB"`` (10**9) / ``"4GiB"``.
        memory_budget: bytes of data buffers (reading and writing overlap within it); a single tensor
            larger than 3/8 of it is read into its own buffer.
        workers: parallel readers.
        overwrite: replace a model already in ``out_dir`` (other files there are kept).
        progress: called as ``progress(bytes_written, total_bytes)`` from the calling thread.
        verify_source: check the CRC32 of every source shard the export reads against the source
            manifest (a shard without one is refused: the manifest was edited). The CRCs are computed from the
            bytes as they are read (one more hashing pass, no second read), plus a read of the
            parts of a shard the export skips (vocab padding) through a buffer of at most 16 MiB.
            Without it, corrupted source bytes would be exported as they are.

    Raises (all before anything is written to ``out_dir``): ManifestError (no committed checkpoint,
    no or unknown model config), MismatchError (tensors that do not match the config; a dtype the
    export cannot hold), StateError (bad argument), CheckpointExistsError (``out_dir`` holds a
    model). A float16 overflow, an I/O error or (``verify_source``) an IntegrityError (a source
    shard that does not match its checksum, naming the tensor, file and byte range) found while
    streaming raises after removing the files written so far: the index and ``config.json`` are
    written only after every tensor was read, verified and written.

    Example::

        export_hf("/ckpts/step-1000", "/models/moe-hf", dtype="bf16")
    """
    t0 = time.perf_counter()
    out_dtype = parse_dtype(dtype)
    limit = parse_size(max_shard_size, what="max_shard_size")
    budget = parse_size(memory_budget, what="memory_budget")
    opts = storage_options or {}
    src = get_storage(src_url, **opts)
    dst = get_storage(out_dir, **opts)
    try:
        manifest = read_manifest(src)
        if manifest is None:
            from ckpt.formats.sources import LOOKED_FOR, foreign_manifest

            manifest = foreign_manifest(src)  # a DCP / Megatron / DeepSpeed directory, read in place
            if manifest is None:
                raise ManifestError(f"{src.url}: no committed checkpoint here ({MANIFEST_NAME} is missing; "
                                    f"looked for {LOOKED_FOR})")
            verify_source = False  # other tools record no checksums: nothing to verify against
        plan = plan_export(manifest, dtype=out_dtype, max_shard_size=limit, url=src.url,
                           config=_config_arg(config), source_names=source_names)
        # tokenizer / generation config: beside the source checkpoint's manifest, then --tokenizer DIR
        side = hf_files.from_manifest(manifest) | hf_files.read_side_files(src) | (
            hf_files.from_dir(tokenizer) if tokenizer else {})
        ours = {f.path for f in plan.files} | {INDEX_NAME, CONFIG_NAME} | set(side)
        replaced = _check_empty_target(dst, overwrite, ours)
        created = _new_local_root(dst)
        sink = _Sink(dst, plan.files)
        try:
            res = _stream(src, manifest, plan.files, dst, budget=budget, workers=workers, checksums=False,
                          progress=progress, sink=sink, verify_source=verify_source)
            dst.commit(INDEX_NAME, (json.dumps(plan.index, indent=2) + "\n").encode())
            dst.commit(CONFIG_NAME, (json.dumps(plan.config_json, indent=2, sort_keys=True) + "\n").encode())
            for name, data in side.items():
                dst.commit(name, data)
        except BaseException:
            written = sink.opened + [n for n in (INDEX_NAME, CONFIG_NAME, *side) if n not in replaced]
            _cleanup(dst, written, created)
            raise
        for stale in replaced:  # an older export's shards that this one did not rewrite
            if stale not in ours:
                dst.delete(stale)
        return HFExportResult(out_dir=dst.url, files=[f.path for f in plan.files],
                              tensors=sum(len(f.items) for f in plan.files), total_size=plan.total_size,
                              dtype=dtype_name(plan.dtype), buffer_bytes=res.buffer_bytes,
                              seconds=time.perf_counter() - t0, side_files=sorted(side))
    finally:
        src.close()
        dst.close()


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class HFImportResult:
    """What :func:`import_hf` wrote."""

    dst_url: str
    layout: str
    tensors: int
    total_bytes: int
    buffer_bytes: int
    seconds: float
    manifest: Manifest = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"dst_url": self.dst_url, "layout": self.layout, "tensors": self.tensors,
                "total_bytes": self.total_bytes, "buffer_bytes": self.buffer_bytes, "seconds": self.seconds}


@dataclass(slots=True)
class HFSource:
    """A Hugging Face model directory described as a (virtual) ckpt manifest over its own files:
    each fused expert tensor is a set of box shards pointing into the per-expert or fused entries."""

    config: Any  # ModelConfig (embedded MoE) or the adapter's completed config dict
    manifest: Manifest
    params: list[tuple[str, tuple[int, ...]]]
    meta: dict[str, Any] | None = None  # user_metadata of an adapter import (None: the embedded MoE's)
    rules: RuleSet = field(default_factory=lambda: MOE_RULES)


def _read_json(storage: Storage, name: str) -> Any:
    try:
        return json.loads(storage.read_file(name).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{storage.url}/{name}: not valid JSON ({e})") from None


def _read_header(storage: Storage, path: str, size: int) -> dict[str, HeaderEntry]:
    where = f"{storage.url}/{path}"
    if size < 8:
        raise IntegrityError(f"{where}: {size} bytes, shorter than a safetensors header; the file is truncated")
    head = bytearray(8)
    storage.read_into(path, 0, memoryview(head))
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise IntegrityError(f"{where}: safetensors header length {n} exceeds the file ({size} bytes)")
    full = bytearray(8 + n)
    storage.read_into(path, 0, memoryview(full))
    return parse_header(bytes(full), size, path=where)


def read_hf_source(storage: Storage, names: str = "ckpt") -> HFSource:
    """Read and check a Hugging Face model directory's config and safetensors headers (no tensor data).

    A Qwen3-MoE config the embedded MoE can represent becomes an embedded-MoE source (the trainer
    starts from it); every other supported family (and ``names`` other than ``ckpt``) goes through
    its adapter (:mod:`ckpt.hf.adapters`).

    Raises ManifestError (no or unknown architecture / config, bad index), IntegrityError (a file
    the index names is missing; a malformed header), MismatchError (tensors that do not match the
    config, or of a dtype the model cannot hold).
    """
    url = storage.url
    if storage.size(CONFIG_NAME) is None:
        raise ManifestError(f"{url}: no {CONFIG_NAME}; not a Hugging Face model directory")
    d = _read_json(storage, CONFIG_NAME)
    if not isinstance(d, dict):
        raise ManifestError(f"{url}/{CONFIG_NAME}: not a JSON object")
    model_type = d.get("model_type")
    cfg: ModelConfig | None = None
    if model_type == "qwen3_moe" and names == "ckpt":
        try:
            cfg = ModelConfig.from_hf_config_dict(d)
        except (ValueError, TypeError):
            cfg = None  # dense layers, biases...: the generic Qwen3-MoE adapter takes it
    adapter = None
    if cfg is None:
        from ckpt.hf.adapters import adapter_for

        adapter = adapter_for(model_type, where=f"{url}/{CONFIG_NAME}")
        full = adapter.complete(d, where=f"{url}/{CONFIG_NAME}")
    entries, sizes = _hf_entries(storage)
    if adapter is not None:
        from ckpt.hf.adapters import HF_RULES
        from ckpt.hf.engine import import_manifest

        manifest, meta = import_manifest(adapter, full, entries, sizes, names, url=url)
        return HFSource(full, manifest, [(k, tuple(t.shape)) for k, t in manifest.tensors.items()], meta, HF_RULES)
    assert cfg is not None
    params = param_shapes(cfg)
    tensors = _hf_tensors(cfg, dict(params), entries, url)
    return HFSource(cfg, Manifest(tensors=tensors, files=sizes, user_metadata={}), params)


def _hf_entries(storage: Storage) -> tuple[dict[str, tuple[str, HeaderEntry]], dict[str, int]]:
    """Every tensor of the directory's safetensors files (as the index assigns them) and file sizes."""
    url = storage.url
    # Files and where each tensor is.
    wanted: dict[str, str] | None = None
    if storage.size(INDEX_NAME) is not None:
        idx = _read_json(storage, INDEX_NAME)
        wmap = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
            raise ManifestError(f"{url}/{INDEX_NAME}: no weight_map of tensor name -> file name")
        wanted = dict(wmap)
        names = sorted(set(wanted.values()))
    elif storage.size(SINGLE_NAME) is not None:
        names = [SINGLE_NAME]
    else:
        raise ManifestError(f"{url}: neither {SINGLE_NAME} nor {INDEX_NAME}; no safetensors weights to import")
    sizes: dict[str, int] = {}
    for name in names:
        check_relpath(name, f"{url}/{INDEX_NAME}")
        size = storage.size(name)
        if size is None:
            example = next(k for k, v in (wanted or {}).items() if v == name)
            raise IntegrityError(f"{url}/{name}: missing, but {INDEX_NAME} names it (e.g. for {example!r}); "
                                 "the download is incomplete: fetch that file again")
        sizes[name] = size
    entries: dict[str, tuple[str, HeaderEntry]] = {}
    dupes: list[str] = []
    for name in names:
        for key, h in _read_header(storage, name, sizes[name]).items():
            if wanted is not None and wanted.get(key) != name:
                continue  # transformers reads a tensor from the file the index names
            if key in entries:
                dupes.append(key)
            entries[key] = (name, h)
    if wanted is not None:
        absent = sorted(k for k in wanted if k not in entries)
        if absent:
            raise IntegrityError(f"{url}: {INDEX_NAME} maps {_few(absent, 3)} to files whose headers lack them; "
                                 "the index and the files disagree")
    if dupes:
        raise MismatchError(f"{url}: tensors stored twice: {_few(sorted(dupes))}")
    return entries, sizes


def _hf_tensors(cfg: ModelConfig, params: dict[str, tuple[int, ...]], entries: dict[str, tuple[str, HeaderEntry]],
                url: str) -> dict[str, TensorEntry]:
    """Map Hugging Face entries to checkpoint tensors (key ``model.<param>``) with box shards."""
    n_exp, inter, hid = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, TensorEntry] = {}
    experts: dict[str, dict[int, tuple[str, ShardEntry]]] = {}
    bad_dtype: list[str] = []
    unexpected: list[str] = []
    wrong: list[str] = []
    dupes: list[str] = []
    corrupt: list[str] = []
    seen: set[str] = set()  # parameters some entry was found for

    def put(param: str, t: TensorEntry) -> None:
        if param in out:
            dupes.append(param)
        out[param] = t

    for key, (file, h) in sorted(entries.items()):
        if key.endswith("rotary_emb.inv_freq"):  # a non-persistent buffer some old exports carry
            continue
        dt = _ST_TO_TORCH.get(h.dtype)
        if dt not in _IMPORTABLE:
            bad_dtype.append(f"{key} ({h.dtype})")
            continue
        assert dt is not None
        isz = dt.itemsize
        if h.length != math.prod(h.shape) * isz:
            corrupt.append(f"{key}: {h.length} bytes for shape {list(h.shape)} of {h.dtype}")
            continue
        dname = dtype_name(dt)
        if m := _HF_PER_EXPERT.fullmatch(key):
            param, e = f"{m['prefix']}.{m['proj']}_proj", int(m["expert"])
            seen.add(param)
            want = params.get(param)
            if want is None or e >= n_exp:
                unexpected.append(key)
            elif h.shape != want[1:]:
                wrong.append(f"{key} is {list(h.shape)}, expected {list(want[1:])}")
            else:
                experts.setdefault(param, {})[e] = (dname, ShardEntry(Box((e, 0, 0), (1, *want[1:])), file,
                                                                      h.start, h.length))
        elif m := _HF_GATE_UP.fullmatch(key):
            gate, up = f"{m['prefix']}.gate_proj", f"{m['prefix']}.up_proj"
            seen.update((gate, up))
            want = (n_exp, 2 * inter, hid)
            if gate not in params:
                unexpected.append(key)
            elif h.shape != want:
                wrong.append(f"{key} is {list(h.shape)}, expected {list(want)}")
            else:
                row = inter * hid * isz  # gate_up[e] = cat(gate[e], up[e]): two contiguous blocks per expert
                for half, param in enumerate((gate, up)):
                    shards = [ShardEntry(Box((e, 0, 0), (1, inter, hid)), file, h.start + (2 * e + half) * row, row)
                              for e in range(n_exp)]
                    put(param, TensorEntry(dname, (n_exp, inter, hid), shards))
        else:
            seen.add(key)
            want = params.get(key)
            if want is None:
                unexpected.append(key)
            elif h.shape != want:
                wrong.append(f"{key} is {list(h.shape)}, expected {list(want)}")
            else:
                put(key, TensorEntry(dname, want, [ShardEntry(full_box(want), file, h.start, h.length)]))

    incomplete: list[str] = []
    for param, by_id in sorted(experts.items()):
        if param in out:
            dupes.append(f"{param} (fused and per-expert)")
            continue
        absent = sorted(set(range(n_exp)) - set(by_id))
        if absent:
            incomplete.append(f"{param}: experts {absent} missing")
            continue
        kinds = {by_id[e][0] for e in by_id}
        if len(kinds) > 1:
            bad_dtype.append(f"{param}.*: experts stored in several dtypes {sorted(kinds)}")
            continue
        out[param] = TensorEntry(kinds.pop(), params[param], [by_id[e][1] for e in range(n_exp)])

    if corrupt:
        raise IntegrityError(f"{url}: safetensors entries whose byte length does not match: {_few(corrupt)}")
    if bad_dtype:
        raise MismatchError(f"{url}: dtypes the embedded MoE cannot hold (it takes float64/32/16 and bfloat16 "
                            f"weights): {_few(bad_dtype)}")
    missing = [p for p in params if p not in out and p not in seen]  # the others are reported already
    problems = []
    for label, xs in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong),
                      ("given twice", dupes), ("incomplete", incomplete)):
        if xs:
            problems.append(f"{label}: {_few(sorted(xs))}")
    if problems:
        raise MismatchError(f"{url}: the tensors do not match config.json ({_describe(cfg)}): "
                            + " | ".join(problems))
    return {PREFIX + p: out[p] for p in params}


def _layout(to: str | Layout | None) -> Layout:
    if to is None:
        return Layout()
    return to if isinstance(to, Layout) else Layout.parse(to)


def _reshard_fn(target: Layout) -> Callable[..., Any]:
    try:
        from ckpt.resharders.reshard import reshard
    except ImportError as e:
        if getattr(e, "name", None) not in ("ckpt.resharders.reshard", None):
            raise
        raise LayoutError(f"import to layout {target}: offline resharding (ckpt.resharders.reshard) is not "
                          "available in this ckpt; import without --to (a single-layout checkpoint, which "
                          "ckpt.load already reshards at load time) and reshard it later") from None
    return reshard  # type: ignore[no-any-return]


def import_hf(hf_dir: str, dst_url: str, *, to: str | Layout | None = None, dtype: str | torch.dtype | None = None,
              memory_budget: int | str = DEFAULT_MEMORY_BUDGET, workers: int = 4, overwrite: bool = False,
              storage_options: dict[str, Any] | None = None, tmp_dir: str | None = None,
              progress: Progress | None = None, names: str = "ckpt") -> HFImportResult:
    """Import a Hugging Face Qwen3-MoE directory as a weights-only checkpoint of the embedded MoE.

    Reads ``model.safetensors`` or the files of ``model.safetensors.index.json``; per-expert
    (``...experts.E.gate_proj.weight``) and fused (``experts.gate_up_proj`` / ``experts.down_proj``)
    expert keys. Writes tensors ``model.<param>`` (whole tensors: a single layout), no optimizer or
    training state, and ``user_metadata`` ``model_config`` / ``layout`` / ``rules`` /
    ``source``. Values are copied bit for bit unless ``dtype`` asks for a cast.

    Args:
        to: a layout (``"tp=2,ep=2"``) to write ``dst_url`` in; None or ``"single"``: whole tensors.
            Another layout goes through ``ckpt.resharders.reshard`` from a temporary single-layout
            checkpoint under ``tmp_dir`` (default: next to ``dst_url`` when local).
        dtype: cast every tensor (``"bf16"``, ``"fp16"``, ``"fp32"``); default: keep the stored dtypes.
        memory_budget, workers, progress: as for :func:`export_hf`.
        overwrite: replace a committed checkpoint at ``dst_url``.

    Raises (all before anything is written to ``dst_url``): ManifestError (no config, unknown
    architecture, unreadable index), IntegrityError (a file named in the index is missing, malformed
    headers), MismatchError (tensors that do not match the config; dtypes the model cannot hold),
    CheckpointExistsError, LayoutError (``to`` invalid, or resharding unavailable), StateError.

    Example::

        import_hf("/models/Qwen3-tiny", "/ckpts/init", to="tp=2,ep=2")
    """
    t0 = time.perf_counter()
    target = _layout(to)
    out_dtype = parse_dtype(dtype)
    budget = parse_size(memory_budget, what="memory_budget")
    opts = storage_options or {}
    src = get_storage(hf_dir, **opts)
    try:
        source = read_hf_source(src, names)
        if target.world_size > 1 and names != "ckpt":
            raise LayoutError(f"import to layout {target} with {names} names: the sharding rules know ckpt's "
                              "names only; import without --to (ckpt.load reshards at load time)")
        if target.world_size == 1:
            manifest, buffer_bytes = _import_single(src, source, dst_url, dtype=out_dtype, budget=budget,
                                                    workers=workers, overwrite=overwrite, opts=opts,
                                                    progress=progress, source_url=src.url)
        else:
            reshard = _reshard_fn(target)
            dst = get_storage(dst_url, **opts)
            try:
                transaction.begin(dst, overwrite=overwrite)
                local_root = getattr(dst, "root", None)
            finally:
                dst.close()
            parent = tmp_dir or (os.path.dirname(local_root) if isinstance(local_root, str) else None)
            if parent:
                os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".ckpt-import-", dir=parent)
            try:
                _, buffer_bytes = _import_single(src, source, tmp, dtype=out_dtype, budget=budget, workers=workers,
                                                 overwrite=True, opts={}, progress=progress, source_url=src.url)
                manifest = reshard(tmp, dst_url, target, rules=source.rules, memory_budget=budget, workers=workers,
                                   overwrite=overwrite, progress=progress, storage_options={},
                                   dst_storage_options=opts)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return HFImportResult(dst_url=dst_url, layout=str(target), tensors=len(manifest.tensors),
                              total_bytes=manifest.total_bytes, buffer_bytes=buffer_bytes,
                              seconds=time.perf_counter() - t0, manifest=manifest)
    finally:
        src.close()


def _import_single(src: Storage, source: HFSource, dst_url: str, *, dtype: torch.dtype | None, budget: int,
                   workers: int, overwrite: bool, opts: dict[str, Any], progress: Progress | None,
                   source_url: str) -> tuple[Manifest, int]:
    """Write ``source`` as a single-layout checkpoint at ``dst_url``; return its manifest and buffer peak."""
    vman = source.manifest
    out_dtypes = {k: dtype or dtype_from_name(t.dtype) for k, t in vman.tensors.items()}
    decl = RankDecl(pieces=[PieceDecl(k, dtype_name(out_dtypes[k]), t.shape, full_box(t.shape))
                            for k, t in vman.tensors.items()])
    layout = Layout()
    meta = ({"model_config": source.config.to_dict(), "rules": RULES_NAME} if source.meta is None
            else dict(source.meta))
    meta |= {"layout": layout.to_dict(), "source": {"format": "huggingface", "url": source_url}}
    plan = plan_save([decl], save_id=uuid.uuid4().hex[:12], step=0, user_metadata=meta, layout=layout.to_dict())
    manifest, (assignment,) = plan.manifest, plan.assignments
    assert assignment.file is not None
    items = []
    for e in assignment.entries:
        t = vman.tensors[e.key]
        items.append(_Item(e.key, LoadRequest(e.key, t.dtype, t.shape, full_box(t.shape)), out_dtypes[e.key], t.shape))
    out = _OutFile(assignment.file, assignment.header, items)

    dst = get_storage(dst_url, **opts)
    try:
        transaction.begin(dst, overwrite=overwrite)
        created = _new_local_root(dst)
        sink = _Sink(dst, [out])
        try:
            res = _stream(src, vman, [out], dst, budget=budget, workers=workers, checksums=True, progress=progress,
                          sink=sink)
            manifest.files[out.path] = res.sizes[0]
            for e, crc in zip(assignment.entries, res.checksums, strict=True):
                manifest.tensors[e.key].shards[e.shard].checksum = crc
            data = encode_manifest(manifest)
        except BaseException:
            _cleanup(dst, sink.opened, created)
            raise
        # removes this import's files itself when the commit fails (and keeps them once committed)
        manifest = transaction.commit_manifest(dst, data, overwrite=overwrite, written=sink.opened)
        return manifest, res.buffer_bytes
    finally:
        dst.close()
