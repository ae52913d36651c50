"""Export and import plans for the adapter families (:mod:`ckpt.hf.adapters`), on the streaming
engine of :mod:`ckpt.formats.hf` (the same buffers, writer thread, checksum checks and commit).

Export: Hugging Face tensor -> runs over canonical parameters (the adapter) -> runs over the
checkpoint's names (:mod:`ckpt.hf.names`) -> stored keys (prefix, alternative spelling, or a layer
of a stacked tensor). Each run becomes one read of a flat element range; the runs of one tensor are
written back to back under one safetensors header entry.

Import: the same map inverted: each stored tensor's elements are pieces of the Hugging Face
entries, i.e. byte ranges of the files, so the source is a (virtual) manifest and the importer
copies it like any checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ckpt.dtypes import dtype_from_name, dtype_name, safetensors_dtype
from ckpt.errors import IntegrityError, ManifestError, MismatchError
from ckpt.formats.safetensors_header import HeaderEntry, build_header
from ckpt.hf.adapters import ADAPTERS, HF_RULES, Adapter, Config, adapter_for
from ckpt.hf.mapping import Map, compose, invert, whole
from ckpt.hf.names import naming, resolve
from ckpt.manifest import Manifest, ShardEntry, TensorEntry
from ckpt.planner import LoadRequest
from ckpt.shards import Flat, full_box

ADAPTER_KEY = "hf_adapter"  # user_metadata: the adapter's name, "hf_config": its completed config


def source_adapter(manifest: Manifest, config: Config | None, *, url: str) -> tuple[Adapter, Config] | None:
    """The adapter and config of a checkpoint: ``config`` (a Hugging Face config.json body) when
    given, else what ``import-hf`` recorded; None for the embedded MoE's checkpoints (no adapter)."""
    meta = manifest.user_metadata
    if config is None:
        name = meta.get(ADAPTER_KEY)
        if name is None:
            return None
        config = meta.get("hf_config")
        if not isinstance(config, dict) or name not in ADAPTERS:
            raise ManifestError(f"{url}: user_metadata names adapter {name!r} but no usable hf_config")
    a = adapter_for(config.get("model_type"), where=url)
    return a, a.complete(config, where=url)


def hf_runs(manifest: Manifest, adapter: Adapter, cfg: Config, names: str, *, url: str) -> Map:
    """Hugging Face tensor -> runs over the checkpoint's stored keys (what an export writes)."""
    nm = naming(names, adapter, cfg)
    stored = {k: tuple(t.shape) for k, t in manifest.tensors.items()}
    return compose(compose(adapter.hf_map(cfg), nm.map), resolve(nm, stored, where=url))


def hf_state_dict(src_url: str, manifest: Manifest, adapter: Adapter, cfg: Config, names: str,
                  **load_kwargs: Any) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of a checkpoint, in memory (``export-hf --check``'s reference)."""
    import ckpt

    full = hf_runs(manifest, adapter, cfg, names, url=src_url)
    keys = sorted({r.name for t in full.values() for r in t.runs})
    want = {k: torch.empty(tuple(manifest.tensors[k].shape), dtype=dtype_from_name(manifest.tensors[k].dtype))
            for k in keys}
    got = ckpt.load(want, src_url, **load_kwargs)
    flat = {k: v.reshape(-1) for k, v in got.items()}
    return {name: torch.cat([flat[r.name][r.start:r.start + r.numel] for r in t.runs]).view(t.shape)
            for name, t in full.items()}


def export_items(manifest: Manifest, adapter: Adapter, cfg: Config, names: str, dtype: torch.dtype | None,
                 *, url: str) -> tuple[list[tuple[str, tuple[int, ...], list[Any]]], torch.dtype, Config]:
    """Per Hugging Face tensor, in order: (name, shape, items to read and write back to back)."""
    from ckpt.formats.hf import _Item, export_dtype

    full = hf_runs(manifest, adapter, cfg, names, url=url)
    used = {r.name for t in full.values() for r in t.runs}
    src_dtypes = {k: dtype_from_name(manifest.tensors[k].dtype, key=k) for k in used}
    not_float = sorted(f"{k} ({d})" for k, d in src_dtypes.items() if not d.is_floating_point)
    if not_float:
        raise MismatchError(f"{url}: model tensors of non-float dtype cannot be exported as weights: {not_float[:6]}")
    dtype = export_dtype(set(src_dtypes.values()), dtype, url=url)
    out: list[tuple[str, tuple[int, ...], list[Any]]] = []
    for name, t in full.items():
        items = []
        for r in t.runs:
            e = manifest.tensors[r.name]
            items.append(_Item(name, LoadRequest(r.name, e.dtype, tuple(e.shape), Flat(r.start, r.start + r.numel)),
                               dtype, (r.numel,)))
        out.append((name, t.shape, items))
    config_json = adapter.hf_config(cfg)
    config_json["torch_dtype"] = config_json["dtype"] = dtype_name(dtype)
    return out, dtype, config_json


def split_files(tensors: list[tuple[str, tuple[int, ...], list[Any]]], dtype: torch.dtype,
                limit: int) -> list[Any]:
    """Fill ``model-k-of-n.safetensors`` files in order up to ``limit`` bytes (whole tensors)."""
    from ckpt.formats.hf import ST_METADATA, _OutFile

    st = safetensors_dtype(dtype)
    assert st is not None
    groups: list[list[tuple[str, tuple[int, ...], list[Any]]]] = []
    size = 0
    for t in tensors:
        n = math.prod(t[1]) * dtype.itemsize + 128 + len(t[0])  # a header entry is ~100 bytes + the name
        if groups and groups[-1] and size + n <= limit:
            groups[-1].append(t)
            size += n
        else:
            groups.append([t])
            size = n
    files = []
    for k, group in enumerate(groups):
        header, _ = build_header([(name, st, shape, math.prod(shape) * dtype.itemsize) for name, shape, _ in group],
                                 ST_METADATA)
        files.append(_OutFile(f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors", header,
                              [it for _, _, items in group for it in items]))
    return files


def import_manifest(adapter: Adapter, cfg: Config, entries: dict[str, tuple[str, HeaderEntry]], files: dict[str, int],
                    names: str, *, url: str) -> tuple[Manifest, dict[str, Any]]:
    """The Hugging Face files as a (virtual) manifest of stored tensors under naming ``names``, and
    the user_metadata an import records."""
    from ckpt.formats.hf import _IMPORTABLE, _ST_TO_TORCH

    entries = {k: v for k, v in entries.items() if not k.endswith("rotary_emb.inv_freq")}
    hf = adapter.hf_map(cfg, set(entries))
    nm = naming(names, adapter, cfg)
    prefix = nm.prefixes[0]
    to_keys: Map = {n: whole(prefix + n, s) for n, s in nm.shapes.items()}
    full = compose(compose(hf, nm.map), to_keys)
    problems: list[str] = []
    unexpected = sorted(set(entries) - set(full))
    if unexpected:
        hint = (" (multi-token-prediction layers past num_hidden_layers are not part of the model transformers "
                "loads: drop them)" if adapter.name == "deepseek_v3" else "")
        problems.append(f"unexpected: {unexpected[:6]}{hint}")
    missing = sorted(set(full) - set(entries))
    if missing:
        problems.append(f"missing: {missing[:6]}")
    wrong = [f"{k} is {list(entries[k][1].shape)}, expected {list(t.shape)}" for k, t in full.items()
             if k in entries and tuple(entries[k][1].shape) != t.shape]
    if wrong:
        problems.append(f"wrong shape: {wrong[:6]}")
    if adapter.name != "deepseek_v3" and cfg.get("tie_word_embeddings") and "lm_head.weight" in unexpected:
        problems.append("lm_head.weight is stored although tie_word_embeddings is true (a tied head is not saved)")
    if problems:
        raise MismatchError(f"{url}: the tensors do not match config.json ({adapter.name}): " + " | ".join(problems))
    shapes = {prefix + n: s for n, s in nm.shapes.items()}
    pieces = invert(full, shapes, what=url)
    dtypes: dict[str, torch.dtype] = {}
    for name, (_file, h) in entries.items():
        dt = _ST_TO_TORCH.get(h.dtype)
        if dt not in _IMPORTABLE:
            raise MismatchError(f"{url}: {name} is {h.dtype}; import takes float64/32/16 and bfloat16 weights")
        assert dt is not None
        if h.length != math.prod(h.shape) * dt.itemsize:
            raise IntegrityError(f"{url}: {name}: {h.length} bytes for shape {list(h.shape)} of {h.dtype}")
        dtypes[name] = dt
    tensors: dict[str, TensorEntry] = {}
    for key, ps in pieces.items():
        kinds = {dtypes[p.target] for p in ps}
        if len(kinds) > 1:
            raise MismatchError(f"{url}: {key} would be assembled from tensors of several dtypes "
                                f"{sorted(map(str, kinds))}")
        dt = kinds.pop()
        shape = shapes[key]
        shards = []
        for p in ps:
            file, h = entries[p.target]
            region = full_box(shape) if len(ps) == 1 else Flat(p.start, p.start + p.numel)
            shards.append(ShardEntry(region, file, h.start + p.at * dt.itemsize, p.numel * dt.itemsize))
        tensors[key] = TensorEntry(dtype_name(dt), shape, shards)
    meta = {ADAPTER_KEY: adapter.name, "hf_config": cfg, "names": nm.kind,
            "rules": HF_RULES.name if nm.kind == "ckpt" else None}
    return Manifest(tensors=tensors, files=files, user_metadata={}), meta
