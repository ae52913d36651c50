"""Hugging Face export and import of ckpt checkpoints, for every adapter of :mod:`ckpt.hf`: the
built-in families and the registered ones (the trainer's embedded MoE, Qwen3-MoE architecture).

- :func:`export_hf`: a ckpt checkpoint saved under any layout (or a DCP / Megatron / DeepSpeed
  directory read in place) -> a ``save_pretrained``-style directory (``config.json``,
  ``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json``) with the architecture's own
  key names (per-expert keys), which ``transformers.AutoModelForCausalLM.from_pretrained`` loads;
- :func:`import_hf`: such a directory (one ``model.safetensors`` or an index; per-expert or fused
  expert keys) -> a weights-only ckpt checkpoint the trainer can start from, in any layout.

Both directions validate all that metadata can tell (architecture, names, shapes, dtypes, files)
before writing a byte (the plans: :mod:`ckpt.hf.engine`; the directory: :mod:`ckpt.hf.directory`),
then stream with :func:`ckpt._stream.copy_files`: each output tensor is read with ckpt's
load planner into one of two reusable buffers, cast there if asked, and written by a background
thread while the next buffer fills. Memory stays at the budget, whatever the size of a tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt import _lease as lease
from ckpt import _transaction as transaction
from ckpt._dtypes import dtype_from_name, dtype_name
from ckpt._save_plan import PieceDecl, RankDecl, plan_save
from ckpt._stream import Item, OutFile, Progress, copy_files
from ckpt.errors import CheckpointError, CheckpointExistsError, ConfigError, LayoutError, ManifestError, StateError
from ckpt.formats import foreign_json
from ckpt.formats.msgpack_codec import encode_manifest
from ckpt.hf import files as hf_files
from ckpt.hf import publish
from ckpt.hf.directory import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    SINGLE_NAME,
    ST_METADATA,
    add_computed_file,
    export_dtype,
    few,
    index_of,
    parse_dtype,
    parse_size,
    read_entries,
    read_json,
    split_files,
)
from ckpt.hf.engine import PREFIX, export_items, import_manifest, params_export, params_import, source_adapter
from ckpt.hf.fp8 import QUANT_KEY, check_layout, dequantize_dir, quant_spec, stored_scales
from ckpt.hf.names import names_of
from ckpt.hf.registry import adapter_named, adapter_of_checkpoint, importer_for
from ckpt.layout import Layout
from ckpt.manifest import DATA_DIR, MANIFEST_NAME, Manifest
from ckpt.resharders.rules import HF_RULES, MOE_RULES, RuleSet, recorded_rules
from ckpt.save import read_manifest
from ckpt.shards import full_box
from ckpt.storage import Storage, get_storage

__all__ = ["export_hf", "import_hf", "HFExportResult", "HFImportResult", "parse_size", "parse_dtype", "param_shapes",
           "plan_export", "ExportPlan", "model_config_of", "read_hf_source", "HFSource", "export_dtype",
           "DEFAULT_MAX_SHARD_SIZE", "DEFAULT_MEMORY_BUDGET", "CONFIG_NAME", "INDEX_NAME", "SINGLE_NAME",
           "ST_METADATA", "PREFIX", "RULES_NAME"]

RULES_NAME = MOE_RULES.name  # user_metadata["rules"] of the embedded MoE's checkpoints (the default table)


def param_shapes(cfg: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters and shapes of the model ``cfg`` (the embedded MoE's ``ModelConfig``) describes,
    from the adapter registered under the default rules' name (kept for callers of this name)."""
    return _default_adapter().params(cfg)


def model_config_of(manifest: Manifest, *, url: str = "checkpoint") -> Any:
    """The embedded MoE's config recorded in a checkpoint (kept for callers of this name).

    Raises ManifestError when it is missing, belongs to another architecture, or is invalid."""
    return _default_adapter().checkpoint_config(manifest.user_metadata, url=url)


def _default_adapter() -> Any:
    a = adapter_named(RULES_NAME)
    if a is None:
        raise ManifestError(f"no Hugging Face adapter is registered for {RULES_NAME!r} (the embedded MoE): "
                            "reinstall ckpt (its entry points declare it)")
    return a


# half of it already keeps a disk busy, and peak memory stays a fraction of transformers' (measured in
# docs/BENCHMARKS.md, section "Hugging Face import / export of a Llama", re-run)
DEFAULT_MEMORY_BUDGET = 512 << 20


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

    config: Any  # the adapter's config (a completed config dict, or its own class: the embedded MoE's)
    dtype: torch.dtype
    files: list[OutFile]
    index: dict[str, Any]
    config_json: dict[str, Any]
    computed: dict[str, bytes] = field(default_factory=dict)  # file -> bytes of tensors computed from the config

    @property
    def total_size(self) -> int:
        return sum(it.out_bytes for f in self.files for it in f.items)


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
    if config is None and adapter_of_checkpoint(manifest.user_metadata, url=url).by_params:
        # a model's own checkpoint (the embedded MoE's): ckpt names only, refused before its config is read
        names_of(manifest, source_names, None, where=url)
    adapter, full = source_adapter(manifest, config, url=url)
    if adapter.by_params:
        tensors, out_dtype, config_json = params_export(manifest, adapter, full, dtype, url=url)
    else:
        names = names_of(manifest, source_names, (adapter, full), where=url)  # None / "auto": recorded, else detected
        tensors, out_dtype, config_json = export_items(manifest, adapter, full, names, dtype, url=url)
    files = split_files(tensors, out_dtype, max_shard_size)
    extra = add_computed_file(files, adapter.derived(full), out_dtype)
    computed = {extra[0]: extra[2]} if extra is not None else {}
    return ExportPlan(full, out_dtype, files, index_of(files, extra[:2] if extra else None), config_json, computed)


def _config_arg(config: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """A config.json body from a dict, a config.json path, or a Hugging Face model directory."""
    if config is None or isinstance(config, dict):
        return config
    path = os.path.join(config, CONFIG_NAME) if os.path.isdir(config) else config
    d = foreign_json.read_path(path, budget=foreign_json.CONFIG)  # bounded: size, depth, items
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return d


def _check_empty_target(dst: Storage, overwrite: bool, names: set[str]) -> list[str]:
    """Refuse to write over an existing model (or a ckpt checkpoint); return what overwrite replaces."""
    try:
        present = dst.list()
    except CheckpointError:
        present = []
    clash = sorted(p for p in present if p in names or p == MANIFEST_NAME
                   or ("/" not in p and p.endswith(".safetensors")))
    if clash and not overwrite:
        raise CheckpointExistsError(f"{dst.url}: already holds {few(clash, 3)}; pass overwrite=True "
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
    ``tokenizer`` (they win), are written next to the weights (:mod:`ckpt.hf.files`).

    Writes ``model-0000k-of-0000n.safetensors`` (each at most ``max_shard_size`` bytes unless one
    tensor alone is larger), then ``config.json`` (the Qwen3-MoE config), then
    ``model.safetensors.index.json``, last. Experts are written per expert (``...mlp.experts.E.gate_proj.weight``), as
    ``save_pretrained`` does; vocab padding is dropped; optimizer and training state are ignored.
    Persistent buffers an adapter computes from the config (MiniMax's decay tables,
    :meth:`~ckpt.hf.adapters.Adapter.derived`) go into one more ``model-k-of-n`` file, so that
    ``from_pretrained`` finds every key it expects.

    Args:
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``; default: the stored dtype (float32 if mixed).
        max_shard_size: bytes per file, or a string such as ``"5GB"`` (10**9) / ``"4GiB"``.
        memory_budget: bytes of data buffers (reading and writing overlap within it); a tensor
            larger than a buffer (3/8 of it) is copied in parts.
        workers: parallel readers.
        overwrite: replace a model already in ``out_dir`` (other files there are kept). Crash-safe on a
            local directory: the new files are written under this export's own names
            (``.ckpt-export-<id>/``) and put in place with the index renamed last, so that a failure or a kill
            at any moment leaves the previous model loadable (or the new one, once its index is in place);
            only ``config.json`` and the side files are replaced a moment before the index
            (:mod:`ckpt.hf.publish`; on object stores, see there).
        progress: called as ``progress(bytes_written, total_bytes)`` from the calling thread.
        verify_source: check the CRC32 of every source shard the export reads against the source
            manifest (a shard without one is refused: the manifest was edited). The CRCs are computed from the
            bytes as they are read (one more hashing pass, no second read), plus a read of the
            parts of a shard the export skips (vocab padding) through a buffer of at most 16 MiB.
            Without it, corrupted source bytes would be exported as they are.

    Raises (all before anything is written to ``out_dir``): ManifestError (no committed checkpoint,
    no or unknown model config), MismatchError (tensors that do not match the config; a dtype the
    export cannot hold), StateError (bad argument), CheckpointExistsError (``out_dir`` holds a
    model), DirectoryInUseError (another export into ``out_dir`` is running: one at a time; raised at
    once). A float16 overflow, an I/O error or (``verify_source``) an IntegrityError (a source
    shard that does not match its checksum, naming the tensor, file and byte range) found while
    streaming raises after removing the files this export created (and only those), putting back
    the config and side files it replaced: the index is written only after every tensor was read,
    verified and written.

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
        manifest, foreign = _source_manifest(src)
        verify_source = verify_source and not foreign  # other tools record no checksums: nothing to verify against
        plan = plan_export(manifest, dtype=out_dtype, max_shard_size=limit, url=src.url,
                           config=_config_arg(config), source_names=source_names)
        # tokenizer / generation config: beside the source checkpoint's manifest, then --tokenizer DIR
        side = hf_files.from_manifest(manifest) | hf_files.read_side_files(src) | (
            hf_files.from_dir(tokenizer) if tokenizer else {})
        ours = {f.path for f in plan.files} | set(plan.computed) | {INDEX_NAME, CONFIG_NAME} | set(side)
        _check_empty_target(dst, overwrite, ours)  # before anything is written
        verify = {it.key for f in plan.files for it in f.items} if verify_source else None
        created = _new_local_root(dst)
        try:
            # one export into a directory at a time (a second one: DirectoryInUseError at once), and an
            # overwrite that a failure or a kill leaves loadable: ckpt.hf.publish
            with transaction.live_writer() as me, publish.ExportLock(dst, me):
                replaced = _check_empty_target(dst, overwrite, ours)  # again, holding the lock
                publish.remove_leftovers(dst)  # staging directories of killed exports
                buffer_bytes = _write_export(src, manifest, dst, plan, side, replaced, budget=budget,
                                             workers=workers, verify=verify, progress=progress, token=me["token"])
        except BaseException:
            _cleanup(dst, [], created)  # the directory, if this export made it and it is empty
            raise
        return HFExportResult(out_dir=dst.url, files=[f.path for f in plan.files],
                              tensors=len(plan.index["weight_map"]),  # Hugging Face tensors, not copy pieces
                              total_size=plan.total_size,
                              dtype=dtype_name(plan.dtype), buffer_bytes=buffer_bytes,
                              seconds=time.perf_counter() - t0, side_files=sorted(side))
    finally:
        src.close()
        dst.close()


def _source_manifest(src: Storage) -> tuple[Manifest, bool]:
    """The checkpoint's manifest, or a DCP / Megatron / DeepSpeed directory's read in place (True: foreign).

    Raises ManifestError when there is neither."""
    manifest = read_manifest(src)
    if manifest is not None:
        return manifest, False
    from ckpt.interop.sources import LOOKED_FOR, foreign_manifest

    manifest = foreign_manifest(src)
    if manifest is None:
        raise ManifestError(f"{src.url}: no committed checkpoint here ({MANIFEST_NAME} is missing; "
                            f"looked for {LOOKED_FOR})")
    return manifest, True


def _write_export(src: Storage, manifest: Manifest, dst: Storage, plan: ExportPlan, side: dict[str, bytes],
                  replaced: list[str], *, budget: int, workers: int, verify: set[str] | None,
                  progress: Progress | None, token: str) -> int:
    """Write the planned files and the computed ones under this export's own names, then config.json and
    the side files, then the index, last (:func:`ckpt.hf.publish.publish`: a reader finds the new model
    only once every tensor is written, and the previous one until then); on a failure before that, remove
    what this call created. Returns the most buffer bytes held at once."""
    def write(prefix: str, written: transaction.WrittenSet) -> int:
        files = [OutFile(prefix + f.path, f.header, f.items) for f in plan.files]
        return copy_files(src, manifest, dst, files, budget=budget, readers=workers, verify=verify,
                          progress=progress, written=written).buffer_bytes

    meta = {CONFIG_NAME: (json.dumps(plan.config_json, indent=2, sort_keys=True) + "\n").encode(), **side}
    out = publish.Outputs([f.path for f in plan.files], plan.index, dict(plan.computed), meta)
    return publish.publish(dst, out, write, token=token, replaced=replaced)


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

    config: Any  # the adapter's config: a completed config dict, or its own class (the embedded MoE's)
    manifest: Manifest
    params: list[tuple[str, tuple[int, ...]]]
    meta: dict[str, Any]  # the user_metadata the import records (Adapter.checkpoint_metadata)
    rules: RuleSet = field(default_factory=lambda: HF_RULES)


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
    where = f"{url}/{CONFIG_NAME}"
    if storage.size(CONFIG_NAME) is None:
        raise ManifestError(f"{url}: no {CONFIG_NAME}; not a Hugging Face model directory")
    d = read_json(storage, CONFIG_NAME)  # bounded (ckpt.formats.foreign_json)
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: not a JSON object")
    # every field the family's adapter reads is type- and range-checked first (ConfigError naming it),
    # also for a config a registered adapter then takes: nothing below meets a string, a bool or a
    # 10**9 for a count
    adapter, cfg = importer_for(d, names, where=where)
    entries, sizes = read_entries(storage)
    if adapter.by_params:  # checks the config's scale against the files first
        manifest, meta = params_import(adapter, cfg, entries, sizes, url=url)
        return HFSource(cfg, manifest, adapter.params(cfg), meta, adapter.rules)
    manifest, meta = import_manifest(adapter, cfg, entries, sizes, names, url=url)
    recorded = recorded_rules(meta)  # fp8: the scales' rules and the weights' blocks too
    return HFSource(cfg, manifest, [(k, tuple(t.shape)) for k, t in manifest.tensors.items()], meta,
                    recorded or adapter.rules)


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
              progress: Progress | None = None, names: str = "ckpt", dequantize: bool = False) -> HFImportResult:
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
            FP8 block-scaled weights and their scales (:mod:`ckpt.hf.fp8`) are kept as stored.
        memory_budget, workers, progress: as for :func:`export_hf`.
        overwrite: replace a committed checkpoint at ``dst_url``.
        dequantize: an FP8 block-scaled model's weights are computed (``dtype``, default bfloat16) as
            transformers dequantizes them, through a temporary directory under ``tmp_dir``; the scales and
            the ``quantization_config`` are dropped. No effect on a model that is not quantized.

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
    origin = src.url
    plain: str | None = None  # the dequantized copy of an fp8 model (import_hf(dequantize=True))
    try:
        if dequantize and _is_quantized(src):
            plain = tempfile.mkdtemp(prefix=".ckpt-dequant-", dir=_tmp_parent(dst_url, tmp_dir, opts))
            dequantize_dir(src, plain, dtype=out_dtype, budget=budget)
            src.close()
            src = get_storage(plain)
        source = read_hf_source(src, names)
        if target.world_size > 1 and names != "ckpt":
            raise LayoutError(f"import to layout {target} with {names} names: the sharding rules know ckpt's "
                              "names only; import without --to (ckpt.load reshards at load time)")
        spec = quant_spec(source.config, where=origin)
        if spec is not None:  # before any byte is written: no shard may cut an fp8 block
            check_layout(source.manifest, source.rules, target, where=origin)
        if target.world_size == 1:
            manifest, buffer_bytes = _import_single(src, source, dst_url, dtype=out_dtype, budget=budget,
                                                    workers=workers, overwrite=overwrite, opts=opts,
                                                    progress=progress, source_url=origin)
        else:
            manifest, buffer_bytes = _import_resharded(src, source, dst_url, target, dtype=out_dtype, budget=budget,
                                                       workers=workers, overwrite=overwrite, opts=opts,
                                                       progress=progress, tmp_dir=tmp_dir, source_url=origin)
        return HFImportResult(dst_url=dst_url, layout=str(target), tensors=len(manifest.tensors),
                              total_bytes=manifest.total_bytes, buffer_bytes=buffer_bytes,
                              seconds=time.perf_counter() - t0, manifest=manifest)
    finally:
        src.close()
        if plain is not None:
            shutil.rmtree(plain, ignore_errors=True)


def _is_quantized(src: Storage) -> bool:
    """True when the directory's config.json declares a quantization_config (checked later in full)."""
    if src.size(CONFIG_NAME) is None:
        return False
    d = read_json(src, CONFIG_NAME)
    return isinstance(d, dict) and bool(d.get(QUANT_KEY))


def _tmp_parent(dst_url: str, tmp_dir: str | None, opts: dict[str, Any]) -> str | None:
    """Where an import's temporary directories go: ``tmp_dir``, else next to a local ``dst_url``."""
    if tmp_dir:
        os.makedirs(tmp_dir, exist_ok=True)
        return tmp_dir
    dst = get_storage(dst_url, **opts)
    try:
        local_root = dst.local_dir
    finally:
        dst.close()
    parent = os.path.dirname(local_root) if isinstance(local_root, str) else None
    if parent:
        os.makedirs(parent, exist_ok=True)
    return parent


def _import_resharded(src: Storage, source: HFSource, dst_url: str, target: Layout, *, dtype: torch.dtype | None,
                      budget: int, workers: int, overwrite: bool, opts: dict[str, Any], progress: Progress | None,
                      tmp_dir: str | None, source_url: str) -> tuple[Manifest, int]:
    """Import as a single layout under a temporary directory, then reshard that to ``target`` at ``dst_url``."""
    reshard = _reshard_fn(target)
    dst = get_storage(dst_url, **opts)
    try:
        transaction.begin(dst, overwrite=overwrite)
    finally:
        dst.close()
    tmp = tempfile.mkdtemp(prefix=".ckpt-import-", dir=_tmp_parent(dst_url, tmp_dir, opts))
    try:
        _, buffer_bytes = _import_single(src, source, tmp, dtype=dtype, budget=budget, workers=workers,
                                         overwrite=True, opts={}, progress=progress, source_url=source_url)
        manifest = reshard(tmp, dst_url, target, rules=source.rules, memory_budget=budget, workers=workers,
                           overwrite=overwrite, progress=progress, storage_options={}, dst_storage_options=opts)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest, buffer_bytes


def _import_single(src: Storage, source: HFSource, dst_url: str, *, dtype: torch.dtype | None, budget: int,
                   workers: int, overwrite: bool, opts: dict[str, Any], progress: Progress | None,
                   source_url: str) -> tuple[Manifest, int]:
    """Write ``source`` as a single-layout checkpoint at ``dst_url``; return its manifest and buffer peak."""
    vman = source.manifest
    kept = {x for pair in stored_scales(vman).items() for x in pair}  # fp8 weights and scales: never cast
    out_dtypes = {k: (None if k in kept else dtype) or dtype_from_name(t.dtype) for k, t in vman.tensors.items()}
    # in the order the tensors lie in the source files: a cold read then streams each file front to
    # back (read-ahead works) instead of seeking across it in the index's name order
    def where(key: str) -> tuple[str, int]:
        shards = vman.tensors[key].shards
        return (shards[0].file, shards[0].offset) if shards else ("", 0)

    decl = RankDecl(pieces=[PieceDecl(k, dtype_name(out_dtypes[k]), vman.tensors[k].shape,
                                      full_box(vman.tensors[k].shape)) for k in sorted(vman.tensors, key=where)])
    layout = Layout()
    meta = dict(source.meta)
    meta |= {"layout": layout.to_dict(), "source": {"format": "huggingface", "url": source_url}}
    try:  # the recorded config must encode and decode before any byte is written (ckpt._transaction)
        _, meta = transaction.check_header(0, meta, layout.to_dict())
    except StateError as bad:
        raise ConfigError(f"{source_url}/config.json: a value cannot be recorded in the checkpoint ({bad}); fix "
                          "the config (e.g. an integer beyond 64 bits)") from None
    # a random save id: the data file's name is one no other writer can produce (ckpt._transaction)
    plan = plan_save([decl], save_id=transaction.new_id(), step=0, user_metadata=meta, layout=layout.to_dict())
    manifest, (assignment,) = plan.manifest, plan.assignments
    assert assignment.file is not None
    manifest.objects.update(hf_files.as_objects(hf_files.read_side_files(src)))  # tokenizer etc. travel along
    items = []
    for e in assignment.entries:
        t = vman.tensors[e.key]
        items.append(Item(e.key, t.dtype, tuple(t.shape), full_box(t.shape), out_dtypes[e.key]))
    out = OutFile(assignment.file, assignment.header, items)

    dst = get_storage(dst_url, **opts)
    held: lease.Lease | None = None
    try:
        transaction.begin(dst, overwrite=overwrite)
        created = _new_local_root(dst)
        # leased before the first byte, as every writer's (ckpt.save.take_lease): gc never takes its files
        held = lease.acquire(dst_url, 0, opts)
        opened = transaction.WrittenSet()  # this import's own files: the only ones it may remove
        try:
            res = copy_files(src, vman, dst, [out], budget=budget, readers=workers, checksums=True, progress=progress,
                             written=opened)
            manifest.files[out.path] = res.sizes[0]
            for e, crc in zip(assignment.entries, res.checksums[0], strict=True):
                manifest.tensors[e.key].shards[e.shard].checksum = crc
            data = encode_manifest(manifest)
        except BaseException:
            transaction.remove_files(dst, opened)
            held.release()
            _cleanup(dst, [], created)
            raise
        # removes this import's files itself when the commit fails (and keeps them once committed)
        manifest = transaction.commit_manifest(dst, data, overwrite=overwrite, written=opened)
        return manifest, res.buffer_bytes
    finally:
        dst.close()
        if held is not None:
            held.release()  # (a second call does nothing)


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
    root = storage.local_dir  # None for object stores and other fsspec URLs: nothing local to create
    return root if root is not None and not os.path.exists(root) else None


