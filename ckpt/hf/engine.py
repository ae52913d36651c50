"""Export and import plans, for the adapter families (:mod:`ckpt.hf.adapters`) and the adapters that
store their parameters whole (``Adapter.by_params``: the trainer's embedded MoE);
:mod:`ckpt._stream` copies what they describe.

Export: Hugging Face tensor -> runs over canonical parameters (the adapter) -> runs over the
checkpoint's names (:mod:`ckpt.hf.names`) -> stored keys (prefix, alternative spelling, or a layer
of a stacked tensor). Each run becomes one item of the copy (a flat element range); the runs of one
tensor are written back to back under one safetensors header entry. By parameters: one item per
parameter, or per expert of a fused expert tensor (a box), vocab padding left out.

Import: the same map inverted: each stored tensor's elements are pieces of the Hugging Face
entries, i.e. byte ranges of the files, so the source is a (virtual) manifest and the importer
copies it like any checkpoint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

from ckpt._dtypes import dtype_from_name, dtype_name
from ckpt._stream import Item
from ckpt.errors import ConfigError, IntegrityError, MismatchError
from ckpt.formats.safetensors_header import HeaderEntry
from ckpt.hf.adapters import ADAPTER_KEY, Adapter, Config
from ckpt.hf.directory import CONFIG_NAME, IMPORTABLE, ST_TO_TORCH, Tensors, export_dtype, few
from ckpt.hf.mapping import Map, compose, invert, whole
from ckpt.hf.names import naming, resolve
from ckpt.hf.registry import adapter_for, adapter_of_checkpoint
from ckpt.manifest import Manifest, ShardEntry, TensorEntry
from ckpt.shards import Box, Flat, full_box

__all__ = ["ADAPTER_KEY", "FUSED_EXPERT", "HF_GATE_UP", "HF_PER_EXPERT", "PREFIX", "check_scale", "export_items",
           "hf_runs", "hf_state_dict", "import_manifest", "params_export", "params_import", "source_adapter"]

PREFIX = "model."  # checkpoint key = PREFIX + parameter name (the "ckpt" naming)
# Stacked expert parameters: model.layers.N.mlp.experts.{gate,up,down}_proj, (E, out, in).
FUSED_EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate|up|down)_proj")
# Hugging Face per-expert keys, as save_pretrained writes them.
HF_PER_EXPERT = re.compile(
    r"(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)
# transformers' in-memory fusion of gate and up: (E, 2I, H) = cat(gate, up) along dim 1.
HF_GATE_UP = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.gate_up_proj")


# A config may describe at most this many times the tensors and elements the files hold (plus a
# little) before its per-layer / per-expert tables are built: within it, the exact comparison names
# every missing tensor; past it, the config is not these weights' and building its tables could
# exhaust memory (num_hidden_layers or num_experts of 10**9).
SCALE_SLACK = 4


def check_scale(layers: int, params: Callable[[], list[tuple[str, tuple[int, ...]]]], tensors: int,
                amount: int, *, unit: str, where: str, cfg: Any) -> None:
    """Refuse a config whose tables would be far larger than what the files hold, before building them.

    ``layers``: the config's layer count, checked first against ``tensors`` (every layer of every
    family has at least its two norms), so that ``params()`` (the canonical parameter list, one small
    entry per parameter, stacked experts as one) costs O(what the files hold). Then the parameter
    count against ``tensors`` and their elements against ``amount`` (elements, or bytes: at least one
    per element). Raises ConfigError naming the counts the config declares.
    """
    def refuse(what: str) -> ConfigError:
        counts = ", ".join(f"{k}={_field(cfg, k)}" for k in _COUNT_FIELDS if _field(cfg, k) is not None)
        return ConfigError(f"{where}: the config ({counts}) describes {what}, but the weights hold {tensors} tensors "
                           f"of {amount} {unit}: it is not the config of these weights; fix config.json")

    if layers > SCALE_SLACK * tensors + 1024:
        raise refuse(f"{layers} layers")
    ps = params()
    elements = sum(math.prod(shape) for _, shape in ps)
    if len(ps) > SCALE_SLACK * tensors + 1024 or elements > SCALE_SLACK * amount + (1 << 20):
        raise refuse(f"{len(ps)} tensors of {elements} elements")


_COUNT_FIELDS = ("num_hidden_layers", "num_experts", "num_local_experts", "n_routed_experts", "hidden_size",
                 "intermediate_size", "moe_intermediate_size", "vocab_size")


def _field(cfg: Any, k: str) -> Any:
    return cfg.get(k) if isinstance(cfg, dict) else getattr(cfg, k, None)


def source_adapter(manifest: Manifest, config: Config | None, *, url: str) -> tuple[Adapter, Any]:
    """The adapter and config of a checkpoint: ``config`` (a Hugging Face config.json body) when
    given, through its model type's adapter, else what the checkpoint records
    (:func:`ckpt.hf.registry.adapter_of_checkpoint`, :meth:`~ckpt.hf.adapters.Adapter.checkpoint_config`).

    Raises ConfigError (a field of the wrong type or range; a config describing far more than the
    checkpoint holds), ManifestError (an unknown model type or adapter, no usable recorded config, an
    option the adapter cannot represent).
    """
    if config is None:
        a = adapter_of_checkpoint(manifest.user_metadata, url=url)
        cfg = a.checkpoint_config(manifest.user_metadata, url=url)
    else:
        if not isinstance(config, dict):
            raise ConfigError(f"{url}: the Hugging Face config is a {type(config).__name__}, not a JSON object")
        a = adapter_for(config.get("model_type"), where=url)
        cfg = a.complete(config, where=url)
    if not a.by_params:  # params_export checks the scale itself, with its own messages
        check_scale(cfg["num_hidden_layers"], lambda: a.params(cfg), len(manifest.tensors),
                    sum(math.prod(t.shape) for t in manifest.tensors.values()), unit="elements", where=url, cfg=cfg)
    return a, cfg


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
                 *, url: str) -> tuple[Tensors, torch.dtype, Config]:
    """Per Hugging Face tensor, in order: (name, shape, items to read and write back to back); the
    export's dtype and its ``config.json``."""
    full = hf_runs(manifest, adapter, cfg, names, url=url)
    used = {r.name for t in full.values() for r in t.runs}
    src_dtypes = {k: dtype_from_name(manifest.tensors[k].dtype, key=k) for k in used}
    not_float = sorted(f"{k} ({d})" for k, d in src_dtypes.items() if not d.is_floating_point)
    if not_float:
        raise MismatchError(f"{url}: model tensors of non-float dtype cannot be exported as weights: {not_float[:6]}")
    dtype = export_dtype(set(src_dtypes.values()), dtype, url=url)
    out: Tensors = []
    for name, t in full.items():
        items = []
        for r in t.runs:
            e = manifest.tensors[r.name]
            items.append(Item(r.name, e.dtype, tuple(e.shape), Flat(r.start, r.start + r.numel), dtype, name))
        out.append((name, t.shape, items))
    config_json = adapter.hf_config(cfg)
    config_json["torch_dtype"] = config_json["dtype"] = dtype_name(dtype)
    return out, dtype, config_json


_VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")  # dim 0 may carry vocab padding


def params_export(manifest: Manifest, adapter: Adapter, cfg: Any, dtype: torch.dtype | None, *,
                  url: str) -> tuple[Tensors, torch.dtype, dict[str, Any]]:
    """:func:`export_items` for an adapter that stores its parameters whole (``by_params``, e.g. the
    embedded MoE): per-expert tensors, vocab padding dropped.

    Raises MismatchError (tensors that do not match the config: missing, unexpected, mis-shaped; a
    stored dtype the export cannot hold), ConfigError (a config describing far more than the
    checkpoint holds, refused before its parameter list is built).
    """
    check_scale(_field(cfg, "num_hidden_layers"), lambda: adapter.params(cfg), len(manifest.tensors),
                sum(math.prod(t.shape) for t in manifest.tensors.values()), unit="elements", where=url, cfg=cfg)
    params = adapter.params(cfg)
    stored = {k[len(PREFIX):]: t for k, t in manifest.tensors.items() if k.startswith(PREFIX)}
    names = {p for p, _ in params}
    problems: list[str] = []
    missing = [PREFIX + p for p, _ in params if p not in stored]
    if missing:
        problems.append(f"missing: {few(missing)}")
    unexpected = sorted(PREFIX + p for p in stored if p not in names)
    if unexpected:
        problems.append(f"unexpected: {few(unexpected)}")
    wrong = []
    for p, shape in params:
        if p not in stored:
            continue
        s = tuple(stored[p].shape)
        padded = p in _VOCAB_PARAMS and len(s) == 2 and s[1] == shape[1] and s[0] >= shape[0]
        if s != shape and not padded:
            wrong.append(f"{PREFIX}{p} is {list(s)}, the config needs {list(shape)}")
    if wrong:
        problems.append(f"wrong shape: {few(wrong)}")
    if problems:
        raise MismatchError(f"{url}: the checkpoint's model tensors do not match its {adapter.describe(cfg)}: "
                            + " | ".join(problems))
    src_dtypes = {p: dtype_from_name(stored[p].dtype, key=PREFIX + p) for p, _ in params}
    not_float = sorted(f"{PREFIX}{p} ({d})" for p, d in src_dtypes.items() if not d.is_floating_point)
    if not_float:
        raise MismatchError(f"{url}: model tensors of non-float dtype cannot be exported as weights: "
                            f"{few(not_float)}")
    dtype = export_dtype(set(src_dtypes.values()), dtype, url=url)
    out: Tensors = []
    for p, shape in params:
        key, sdt = PREFIX + p, stored[p].dtype
        gshape = tuple(stored[p].shape)
        m = FUSED_EXPERT.fullmatch(p)
        if m is None:
            region = Box((0,) * len(shape), shape)  # a padded vocab keeps only the first rows
            out.append((p, shape, [Item(key, sdt, gshape, region, dtype, p)]))
            continue
        for e in range(shape[0]):
            name = f"{m['prefix']}.{e}.{m['proj']}_proj.weight"
            out.append((name, shape[1:], [Item(key, sdt, gshape, Box((e, 0, 0), (1, *shape[1:])), dtype, name)]))
    config_json = adapter.hf_config(cfg)
    config_json["torch_dtype"] = config_json["dtype"] = dtype_name(dtype)
    return out, dtype, config_json


def import_manifest(adapter: Adapter, cfg: Config, entries: dict[str, tuple[str, HeaderEntry]], files: dict[str, int],
                    names: str, *, url: str) -> tuple[Manifest, dict[str, Any]]:
    """The Hugging Face files as a (virtual) manifest of stored tensors under naming ``names``, and
    the user_metadata an import records.

    Raises ConfigError (a config describing far more than the files hold, before any table is
    built), MismatchError / IntegrityError (tensors that do not match the config).
    """
    check_scale(cfg["num_hidden_layers"], lambda: adapter.params(cfg), len(entries),
                sum(h.length for _, h in entries.values()), unit="bytes", where=f"{url}/{CONFIG_NAME}", cfg=cfg)
    entries = {k: v for k, v in entries.items() if not adapter.ignored(k)}
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
        dt = ST_TO_TORCH.get(h.dtype)
        if dt not in IMPORTABLE:
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
    meta = adapter.checkpoint_metadata(cfg, nm.kind)
    return Manifest(tensors=tensors, files=files, user_metadata={}), meta


def params_import(adapter: Adapter, cfg: Any, entries: dict[str, tuple[str, HeaderEntry]], files: dict[str, int],
                  *, url: str) -> tuple[Manifest, dict[str, Any]]:
    """:func:`import_manifest` for an adapter that stores its parameters whole (``by_params``, e.g. the
    embedded MoE): the Hugging Face entries as checkpoint tensors (key ``model.<param>``) with box
    shards; per-expert and fused ``gate_up_proj`` expert keys.

    Raises IntegrityError (an entry whose byte length does not match), MismatchError (dtypes the
    model cannot hold; tensors that do not match the config, each problem named), ConfigError (a config
    describing far more than the files hold, refused before its tables are built).
    """
    check_scale(_field(cfg, "num_hidden_layers"), lambda: adapter.params(cfg), len(entries),
                sum(h.length for _, h in entries.values()), unit="bytes", where=f"{url}/{CONFIG_NAME}", cfg=cfg)
    params = dict(adapter.params(cfg))
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
        dt = ST_TO_TORCH.get(h.dtype)
        if dt not in IMPORTABLE:
            bad_dtype.append(f"{key} ({h.dtype})")
            continue
        assert dt is not None
        isz = dt.itemsize
        if h.length != math.prod(h.shape) * isz:
            corrupt.append(f"{key}: {h.length} bytes for shape {list(h.shape)} of {h.dtype}")
            continue
        dname = dtype_name(dt)
        if m := HF_PER_EXPERT.fullmatch(key):
            param, e = f"{m['prefix']}.{m['proj']}_proj", int(m["expert"])
            seen.add(param)
            want = params.get(param)
            if want is None or e >= want[0]:
                unexpected.append(key)
            elif h.shape != want[1:]:
                wrong.append(f"{key} is {list(h.shape)}, expected {list(want[1:])}")
            else:
                experts.setdefault(param, {})[e] = (dname, ShardEntry(Box((e, 0, 0), (1, *want[1:])), file,
                                                                      h.start, h.length))
        elif m := HF_GATE_UP.fullmatch(key):
            gate, up = f"{m['prefix']}.gate_proj", f"{m['prefix']}.up_proj"
            seen.update((gate, up))
            if gate not in params:
                unexpected.append(key)
                continue
            n_exp, inter, hid = params[gate]
            want = (n_exp, 2 * inter, hid)
            if h.shape != want:
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
        n_exp = params[param][0]
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
        raise IntegrityError(f"{url}: safetensors entries whose byte length does not match: {few(corrupt)}")
    if bad_dtype:
        raise MismatchError(f"{url}: dtypes the model cannot hold ({adapter.describe(cfg)} takes float64/32/16 "
                            f"and bfloat16 weights): {few(bad_dtype)}")
    missing = [p for p in params if p not in out and p not in seen]  # the others are reported already
    problems = []
    for label, xs in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong),
                      ("given twice", dupes), ("incomplete", incomplete)):
        if xs:
            problems.append(f"{label}: {few(sorted(xs))}")
    if problems:
        raise MismatchError(f"{url}: the tensors do not match config.json ({adapter.describe(cfg)}): "
                            + " | ".join(problems))
    tensors = {PREFIX + p: out[p] for p in params}
    return Manifest(tensors=tensors, files=files, user_metadata={}), adapter.checkpoint_metadata(cfg, "ckpt")
