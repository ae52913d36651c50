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
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._dtypes import dtype_from_name, dtype_name
from ckpt._stream import Item
from ckpt.errors import ConfigError, IntegrityError, MismatchError
from ckpt.formats.safetensors_header import HeaderEntry
from ckpt.hf.adapters import ADAPTER_KEY, Adapter, Config
from ckpt.hf.directory import CONFIG_NAME, IMPORTABLE, ST_TO_TORCH, Tensors, export_dtype, few
from ckpt.hf.fp8 import FP8_WEIGHTS, QUANT_KEY, export_scales, fp8_rules, import_scales, quant_spec, with_quant
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
        meta = manifest.user_metadata
        a = adapter_of_checkpoint(meta, url=url)
        recorded = meta.get("hf_config")
        if isinstance(recorded, dict) and recorded.get(QUANT_KEY) and not a.by_params:
            # the adapter completes the model's own fields; the fp8 block spec is checked and kept here
            cfg = with_quant(lambda d: a.checkpoint_config({**meta, "hf_config": d}, url=url), recorded, where=url)
        else:
            cfg = a.checkpoint_config(meta, url=url)
    else:
        if not isinstance(config, dict):
            raise ConfigError(f"{url}: the Hugging Face config is a {type(config).__name__}, not a JSON object")
        a = adapter_for(config.get("model_type"), where=url)
        cfg = with_quant(lambda d: a.complete(d, where=url), config, where=url)
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
    full, kept = _export_fp8(manifest, full, cfg, src_dtypes, url=url)  # fp8 weights and scales: as stored
    dtype = export_dtype({d for k, d in src_dtypes.items() if k not in kept}, dtype, url=url)
    out: Tensors = []
    for name, t in full.items():
        items = []
        for r in t.runs:
            e = manifest.tensors[r.name]
            cast = None if r.name in kept else dtype
            items.append(Item(r.name, e.dtype, tuple(e.shape), Flat(r.start, r.start + r.numel), cast, name))
        out.append((name, t.shape, items))
    config_json = adapter.hf_config(cfg)
    config_json["torch_dtype"] = config_json["dtype"] = dtype_name(dtype)
    return out, dtype, config_json


def _export_fp8(manifest: Manifest, full: Map, cfg: Any, src_dtypes: dict[str, torch.dtype], *,
                url: str) -> tuple[Map, set[str]]:
    """``full`` with the scale of each fp8 weight after it, and the stored keys exported as they are
    (fp8 weights and their scales). Raises MismatchError for fp8 weights without a fp8 config."""
    spec = quant_spec(cfg, where=url)
    if spec is None:
        fp8 = sorted(k for k, d in src_dtypes.items() if d in FP8_WEIGHTS)
        if fp8:
            raise MismatchError(f"{url}: {few(fp8, 3)} are fp8 but the config has no fp8 {QUANT_KEY}; pass the "
                                "model's config.json (with its quantization_config) with --config")
        return full, set()
    stored = {k: (tuple(t.shape), dtype_from_name(t.dtype, key=k)) for k, t in manifest.tensors.items()}
    full, names = export_scales(full, stored, spec.block, where=url)
    return full, {r.name for n in names for r in full[n].runs}


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
    the user_metadata an import records. FP8 block-scaled weights (a ``quantization_config`` of
    quant_method fp8) and their scales are kept as stored tensors (:mod:`ckpt.hf.fp8`).

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
    shapes = {prefix + n: s for n, s in nm.shapes.items()}
    spec = quant_spec(cfg, where=url)
    kept = import_scales(full, shapes, entries, spec, where=url) if spec is not None else set()
    _check_import_names(adapter, cfg, full, entries, url=url)
    pieces = invert(full, shapes, what=url)
    dtypes = _import_dtypes(entries, kept, url=url)
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
    if spec is not None and nm.kind == "ckpt":  # scales placed with their weights, blocks kept whole (fp8_rules)
        # recorded, not registered: the table depends on this model's fp8 weights and block size
        rules = fp8_rules(adapter.rules, spec.block, {k: t.dtype for k, t in tensors.items()})
        meta |= {"rules": rules.name, "rules_table": rules.to_dict()}
    return Manifest(tensors=tensors, files=files, user_metadata={}), meta


def _check_import_names(adapter: Adapter, cfg: Config, full: Map, entries: dict[str, tuple[str, HeaderEntry]], *,
                        url: str) -> None:
    """Refuse files whose tensors are not the ones ``full`` (the config's) names, each problem listed."""
    problems: list[str] = []
    unexpected = sorted(set(entries) - set(full))
    if unexpected:
        hint = (" (multi-token-prediction layers past num_hidden_layers are not part of the model transformers "
                "loads: drop them)" if adapter.name == "deepseek_v3" else "")
        if any(k.endswith("_scale_inv") for k in unexpected) and not cfg.get(QUANT_KEY):
            hint = f" (fp8 scales: the config needs its {QUANT_KEY}, quant_method fp8 with weight_block_size)"
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


def _import_dtypes(entries: dict[str, tuple[str, HeaderEntry]], kept: set[str], *, url: str) -> dict[str, torch.dtype]:
    """Each entry's dtype, checked: a float weight, or (``kept``) an fp8 weight or its scale; its byte
    length checked against its shape. Raises MismatchError / IntegrityError naming the entry."""
    dtypes: dict[str, torch.dtype] = {}
    for name, (_file, h) in entries.items():
        dt = ST_TO_TORCH.get(h.dtype)
        if dt not in IMPORTABLE and not (name in kept and dt in FP8_WEIGHTS):
            hint = " (fp8 weights need their config's fp8 quantization_config and a weight_scale_inv each)" \
                if dt in FP8_WEIGHTS else ""
            raise MismatchError(f"{url}: {name} is {h.dtype}; import takes float64/32/16 and bfloat16 weights{hint}")
        assert dt is not None
        if h.length != math.prod(h.shape) * dt.itemsize:
            raise IntegrityError(f"{url}: {name}: {h.length} bytes for shape {list(h.shape)} of {h.dtype}")
        dtypes[name] = dt
    return dtypes


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
    found = _Found(dict(adapter.params(cfg)))
    for key, (file, h) in sorted(entries.items()):
        if key.endswith("rotary_emb.inv_freq"):  # a non-persistent buffer some old exports carry
            continue
        dname = found.dtype_of(key, h)
        if dname is not None:
            found.take(key, file, h, dname)
    found.assemble_experts()
    found.report(adapter.describe(cfg), url=url)
    tensors = {PREFIX + p: found.out[p] for p in found.params}
    return Manifest(tensors=tensors, files=files, user_metadata={}), adapter.checkpoint_metadata(cfg, "ckpt")


@dataclass(slots=True)
class _Found:
    """What :func:`params_import` found among the entries, parameter by parameter, and each problem."""

    params: dict[str, tuple[int, ...]]
    out: dict[str, TensorEntry] = field(default_factory=dict)
    experts: dict[str, dict[int, tuple[str, ShardEntry]]] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # parameters some entry was found for
    bad_dtype: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    dupes: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)

    def put(self, param: str, t: TensorEntry) -> None:
        if param in self.out:
            self.dupes.append(param)
        self.out[param] = t

    def dtype_of(self, key: str, h: HeaderEntry) -> str | None:
        """The entry's dtype name, or None (a dtype the model cannot hold, a length that does not match)."""
        dt = ST_TO_TORCH.get(h.dtype)
        if dt not in IMPORTABLE:
            self.bad_dtype.append(f"{key} ({h.dtype})")
            return None
        assert dt is not None
        if h.length != math.prod(h.shape) * dt.itemsize:
            self.corrupt.append(f"{key}: {h.length} bytes for shape {list(h.shape)} of {h.dtype}")
            return None
        return dtype_name(dt)

    def take(self, key: str, file: str, h: HeaderEntry, dname: str) -> None:
        """Place one entry: one expert of a stacked parameter, a fused gate_up, or a whole parameter."""
        if m := HF_PER_EXPERT.fullmatch(key):
            param, e = f"{m['prefix']}.{m['proj']}_proj", int(m["expert"])
            self.seen.add(param)
            want = self.params.get(param)
            if want is None or e >= want[0]:
                self.unexpected.append(key)
            elif h.shape != want[1:]:
                self.wrong.append(f"{key} is {list(h.shape)}, expected {list(want[1:])}")
            else:
                self.experts.setdefault(param, {})[e] = (dname, ShardEntry(Box((e, 0, 0), (1, *want[1:])), file,
                                                                           h.start, h.length))
        elif m := HF_GATE_UP.fullmatch(key):
            self._gate_up(key, f"{m['prefix']}.gate_proj", f"{m['prefix']}.up_proj", file, h, dname)
        else:
            self.seen.add(key)
            want = self.params.get(key)
            if want is None:
                self.unexpected.append(key)
            elif h.shape != want:
                self.wrong.append(f"{key} is {list(h.shape)}, expected {list(want)}")
            else:
                self.put(key, TensorEntry(dname, want, [ShardEntry(full_box(want), file, h.start, h.length)]))

    def _gate_up(self, key: str, gate: str, up: str, file: str, h: HeaderEntry, dname: str) -> None:
        self.seen.update((gate, up))
        if gate not in self.params:
            self.unexpected.append(key)
            return
        n_exp, inter, hid = self.params[gate]
        want = (n_exp, 2 * inter, hid)
        if h.shape != want:
            self.wrong.append(f"{key} is {list(h.shape)}, expected {list(want)}")
            return
        row = inter * hid * dtype_from_name(dname).itemsize  # gate_up[e] = cat(gate[e], up[e]): two blocks per expert
        for half, param in enumerate((gate, up)):
            shards = [ShardEntry(Box((e, 0, 0), (1, inter, hid)), file, h.start + (2 * e + half) * row, row)
                      for e in range(n_exp)]
            self.put(param, TensorEntry(dname, (n_exp, inter, hid), shards))

    def assemble_experts(self) -> None:
        """Per-expert entries -> one stacked tensor per parameter (every expert, one dtype)."""
        for param, by_id in sorted(self.experts.items()):
            if param in self.out:
                self.dupes.append(f"{param} (fused and per-expert)")
                continue
            n_exp = self.params[param][0]
            absent = sorted(set(range(n_exp)) - set(by_id))
            if absent:
                self.incomplete.append(f"{param}: experts {absent} missing")
                continue
            kinds = {by_id[e][0] for e in by_id}
            if len(kinds) > 1:
                self.bad_dtype.append(f"{param}.*: experts stored in several dtypes {sorted(kinds)}")
                continue
            self.out[param] = TensorEntry(kinds.pop(), self.params[param], [by_id[e][1] for e in range(n_exp)])

    def report(self, model: str, *, url: str) -> None:
        """Raise for the problems found: IntegrityError (byte lengths), MismatchError (dtypes, names, shapes)."""
        if self.corrupt:
            raise IntegrityError(f"{url}: safetensors entries whose byte length does not match: {few(self.corrupt)}")
        if self.bad_dtype:
            raise MismatchError(f"{url}: dtypes the model cannot hold ({model} takes float64/32/16 "
                                f"and bfloat16 weights): {few(self.bad_dtype)}")
        missing = [p for p in self.params if p not in self.out and p not in self.seen]  # the others: reported
        problems = []
        for label, xs in (("missing", missing), ("unexpected", self.unexpected), ("wrong shape", self.wrong),
                          ("given twice", self.dupes), ("incomplete", self.incomplete)):
            if xs:
                problems.append(f"{label}: {few(sorted(xs))}")
        if problems:
            raise MismatchError(f"{url}: the tensors do not match config.json ({model}): " + " | ".join(problems))
