"""FP8 block-scaled Hugging Face checkpoints (DeepSeek-V3 / Kimi style), kept as stored tensors.

Such a model's ``config.json`` carries ``quantization_config`` ``{"quant_method": "fp8",
"weight_block_size": [b0, b1], ...}``; each quantized weight ``W`` (``float8_e4m3fn``, shape
``(..., R, C)``) comes with ``W_scale_inv`` (``<module>.weight_scale_inv``, float32, shape
``(..., ceil(R / b0), ceil(C / b1))``): element ``(r, c)`` of the model's weight is
``W[r, c] * scale[r // b0, c // b1]``.

Import keeps both as stored tensors, bit for bit: the scale's element map is the weight's map taken
block by block (:func:`scale_target`; a map that would move part of a block is refused), its sharding
rule is its weight's and each fp8 weight declares its blocks (:func:`fp8_rules`: the resharders'
block constraints, recorded with the table in the checkpoint), so a layout whose split would cut a
block is refused by the import before anything is written (:func:`check_layout`) and by any later
``ckpt reshard`` alike. Export writes them back under the same names and dtypes
with the ``quantization_config`` kept. ``import-hf --dequantize`` computes the weights instead, as
transformers' ``Fp8Dequantize`` does (:func:`dequantize`).
"""

from __future__ import annotations

import fnmatch
import glob
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.errors import ConfigError, LayoutError, ManifestError, MismatchError
from ckpt.hf.mapping import Map, Run, Target, merged
from ckpt.layout import Layout
from ckpt.resharders.placement import check_block_splits, specs_of
from ckpt.resharders.rules import Rule, RuleSet

__all__ = ["FP8_WEIGHTS", "QUANT_KEY", "SCALE_DTYPES", "Fp8Spec", "block_patterns", "check_layout", "dequantize",
           "dequantize_dir", "export_scales", "fp8_rules", "import_scales", "quant_spec", "scale_name", "split_quant",
           "stored_scales", "with_quant"]

QUANT_KEY = "quantization_config"
FP8_WEIGHTS = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.float32, torch.bfloat16)
MAX_BLOCK = 1 << 16
_PART = re.compile(r"(?P<base>.*)\.part(?P<k>\d+)")


@dataclass(frozen=True, slots=True)
class Fp8Spec:
    """The block size of a ``quantization_config`` (rows, columns of the weight per scale)."""

    block: tuple[int, int]


def split_quant(d: dict[str, Any], *, where: str) -> tuple[dict[str, Any], Fp8Spec | None]:
    """``d`` without its ``quantization_config`` and the FP8 block spec it declares (None: none).

    Raises ManifestError for a quantization ckpt does not keep (another method, per-tensor FP8, static
    activation scales), ConfigError naming a malformed field.
    """
    q = d.get(QUANT_KEY)
    if not q:
        return d, None
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method != "fp8":
        raise ManifestError(f"{where}: {QUANT_KEY} {method!r}: quantized weights are not supported (FP8 "
                            "block-scaled ones are, quant_method 'fp8'); dequantize to bf16/fp32 first")
    assert isinstance(q, dict)
    block = q.get("weight_block_size")
    if block is None:
        raise ManifestError(f"{where}: {QUANT_KEY} 'fp8' without weight_block_size (one scale per tensor) is not "
                            "supported; only block-scaled FP8 (e.g. [128, 128]) is")
    if not (isinstance(block, list) and len(block) == 2
            and all(type(x) is int and 1 <= x <= MAX_BLOCK for x in block)):
        raise ConfigError(f"{where}: config field '{QUANT_KEY}.weight_block_size' must be two block sizes "
                          f"(integers 1..{MAX_BLOCK}), got {str(block)[:60]}; fix config.json")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ManifestError(f"{where}: {QUANT_KEY}.activation_scheme {str(scheme)[:40]!r}: only 'dynamic' FP8 "
                            "(no stored activation scales) is supported")
    return {k: v for k, v in d.items() if k != QUANT_KEY}, Fp8Spec((block[0], block[1]))


def with_quant(complete: Callable[[dict[str, Any]], Any], d: dict[str, Any], *, where: str) -> Any:
    """``complete(d without its quantization_config)`` (an adapter's own check of the model's fields),
    with the fp8 ``quantization_config`` put back (kept, and written again by an export).

    Raises what :func:`split_quant` raises, and ManifestError for an adapter whose config is not a dict
    (one that stores parameters its own way: the embedded MoE takes bf16/fp32 weights only).
    """
    stripped, spec = split_quant(d, where=where)
    cfg = complete(stripped)
    if spec is None:
        return cfg
    if not isinstance(cfg, dict):
        raise ManifestError(f"{where}: fp8 weights cannot be kept by this model's adapter; import them with "
                            "--dequantize")
    cfg[QUANT_KEY] = d[QUANT_KEY]
    return cfg


def quant_spec(cfg: Any, *, where: str) -> Fp8Spec | None:
    """The fp8 block spec of a completed config (None: not quantized, or not a config dict)."""
    return split_quant(cfg, where=where)[1] if isinstance(cfg, dict) else None


def scale_name(name: str) -> str:
    """The scale of weight ``name``, as transformers names it (``x.weight`` -> ``x.weight_scale_inv``,
    a fused ``x.gate_up_proj`` -> ``x.gate_up_proj_scale_inv``); a part ``<w>.part<k>`` (the generic
    adapter's packed tensors) -> ``<scale of w>.part<k>``. Also maps rule patterns (a trailing ``*``
    already matches the scale)."""
    if m := _PART.fullmatch(name):
        return f"{scale_name(m['base'])}.part{m['k']}"
    if name.endswith("*"):
        return name
    return name[:-len("weight")] + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def scale_target(t: Target, shapes: dict[str, tuple[int, ...]], block: tuple[int, int], *, what: str) -> Target:
    """The scale of a weight whose elements are ``t`` (runs over tensors of ``shapes``), as runs over
    those tensors' scales (:func:`scale_name`): the same map, taken block by block.

    Every run must move whole block rows of whole rows (a map that reorders elements inside a block,
    or changes the row width, cannot carry one scale per block). Raises MismatchError naming ``what``.
    """
    if len(t.shape) < 2:
        raise MismatchError(f"{what}: a {len(t.shape)}-D fp8 weight has no 2-D blocks")
    (rows, cols), (b0, b1) = t.shape[-2:], block
    srows, scols = -(-rows // b0), -(-cols // b1)

    def refuse(why: str) -> MismatchError:
        return MismatchError(f"{what}: fp8 weight {list(t.shape)} in {b0}x{b1} blocks: {why}; its scales cannot "
                             "follow it (import it with --dequantize)")

    out: list[Run] = []
    pos = 0
    for r in t.runs:
        ps = shapes[r.name]
        if len(ps) < 2 or ps[-1] != cols:
            raise refuse(f"it is stored as {r.name} {list(ps)}, of another row width")
        if pos % cols or r.start % cols or r.numel % cols:
            raise refuse(f"{r.name} holds parts of its rows")
        prow_n, sprows = ps[-2], -(-ps[-2] // b0)
        wrow, prow, n = pos // cols, r.start // cols, r.numel // cols
        while n > 0:  # one piece per matrix of the weight and of the stored tensor
            wm, wr = divmod(wrow, rows)
            pm, pr = divmod(prow, prow_n)
            k = min(n, rows - wr, prow_n - pr)
            if wr % b0 or pr % b0 or (k % b0 and not (wr + k == rows and pr + k == prow_n)):
                raise refuse(f"rows {wr}..{wr + k} go to rows {pr}..{pr + k} of {r.name}, across blocks")
            out.append(Run(scale_name(r.name), (pm * sprows + pr // b0) * scols, -(-k // b0) * scols))
            wrow, prow, n = wrow + k, prow + k, n - k
        pos += r.numel
    return Target((*t.shape[:-2], srows, scols), merged(out))


def import_scales(full: Map, shapes: dict[str, tuple[int, ...]], entries: dict[str, Any], spec: Fp8Spec, *,
                  where: str) -> set[str]:
    """Add to ``full`` (Hugging Face name -> runs over stored keys) the scale of each fp8 weight of
    ``entries`` (name -> (file, header entry)), and the stored scales' shapes to ``shapes``; return
    the names of the fp8 weights and their scales (the tensors that keep their fp8 / float32 dtype).

    Raises MismatchError: an fp8 weight without its scale, a scale of the wrong shape or dtype.
    """
    from ckpt.hf.directory import ST_TO_TORCH

    kept: set[str] = set()
    problems: list[str] = []
    for name in list(full):
        entry = entries.get(name)
        if entry is None or ST_TO_TORCH.get(entry[1].dtype) not in FP8_WEIGHTS:
            continue
        s = scale_name(name)
        target = scale_target(full[name], shapes, spec.block, what=f"{where}: {name}")
        got = entries.get(s)
        if got is None:
            problems.append(f"{name} is {entry[1].dtype} without {s}")
        elif tuple(got[1].shape) != target.shape:
            problems.append(f"{s} is {list(got[1].shape)}, {spec.block[0]}x{spec.block[1]} blocks of "
                            f"{list(full[name].shape)} need {list(target.shape)}")
        elif ST_TO_TORCH.get(got[1].dtype) not in SCALE_DTYPES:
            problems.append(f"{s} is {got[1].dtype}; scales are F32 or BF16")
        full[s] = target
        kept |= {name, s}
        for w in {r.name for r in full[name].runs}:
            shapes[scale_name(w)] = scale_shape(shapes[w], spec.block)
    if problems:
        raise MismatchError(f"{where}: fp8 weights and scales do not match: " + "; ".join(problems[:6]))
    return kept


def export_scales(full: Map, stored: dict[str, tuple[tuple[int, ...], torch.dtype]], block: tuple[int, int], *,
                  where: str) -> tuple[Map, set[str]]:
    """``full`` (Hugging Face name -> runs over stored keys) with each fp8 weight's scale right after it
    (the order ``save_pretrained`` writes), and the names of the weights and scales written as stored.

    Raises MismatchError: an fp8 weight whose stored scale is missing or mis-shaped.
    """
    out: Map = {}
    kept: set[str] = set()
    shapes = {k: s for k, (s, _) in stored.items()}
    for name, t in full.items():
        out[name] = t
        if not t.runs or any(stored[r.name][1] not in FP8_WEIGHTS for r in t.runs):
            continue
        st = scale_target(t, shapes, block, what=f"{where}: {name}")
        for r in st.runs:
            w = r.name
            want = scale_shape(shapes[next(x.name for x in t.runs if scale_name(x.name) == w)], block)
            if w not in stored or stored[w][0] != want or stored[w][1] not in SCALE_DTYPES:
                found = f"{list(stored[w][0])} {stored[w][1]}" if w in stored else "missing"
                raise MismatchError(f"{where}: fp8 weight {name} needs its scale {w} {list(want)} (F32/BF16); "
                                    f"found {found}")
        out[scale_name(name)] = st
        kept |= {name, scale_name(name)}
    return out, kept


def fp8_rules(base: RuleSet, block: tuple[int, int], dtypes: Mapping[str, str]) -> RuleSet:
    """``base`` with a rule for each scale (its weight's placement: the same dims, in blocks) and a
    block constraint (:class:`~ckpt.resharders.rules.BlockRule`, ``block`` on the last two dims) on
    each fp8 weight of ``dtypes`` (stored key -> dtype name) that has its scale beside it: no reshard
    of the checkpoint may then cut a block (:func:`ckpt.resharders.rules.check_blocks`), the table
    being recorded in it. Named ``<base>+fp8``.
    """
    from ckpt._dtypes import dtype_from_name

    scales = [Rule(scale_name(r.pattern), r.placement) for r in base.rules if scale_name(r.pattern) != r.pattern]
    pre = base.param_prefix
    params = [k[len(pre):] for k in dtypes if k.startswith(pre)]
    weights = {k[len(pre):] for k, dt in dtypes.items() if k.startswith(pre) and scale_name(k) in dtypes
               and dtype_from_name(dt, key=k) in FP8_WEIGHTS}
    d = base.to_dict() | {"name": f"{base.name}+fp8"}
    d["rules"] = [{"pattern": r.pattern, "tp_dim": r.placement.tp_dim, "ep_dim": r.placement.ep_dim,
                   "pad": r.placement.pad} for r in scales] + d["rules"]
    d["blocks"] = [{"pattern": p, "block": list(block)} for p in block_patterns(weights, params)] + d.get("blocks", [])
    return RuleSet.from_dict(d, source=d["name"])


_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")  # a layer (or expert) index between dots


def block_patterns(weights: set[str], params: list[str]) -> list[str]:
    """Glob patterns that match exactly ``weights`` among ``params``: one per module, its indices as
    ``*`` (``model.layers.*.mlp.down_proj.weight``: the table stays small for any depth), or the
    weights' own names where that pattern would also match a tensor outside ``weights``."""
    groups: dict[str, list[str]] = {}
    for w in sorted(weights):
        lits = _INDEX.split(w)
        groups.setdefault("*".join(glob.escape(x) for x in lits), []).append(w)
    out: list[str] = []
    for pat, members in groups.items():
        if all(p in weights for p in params if fnmatch.fnmatchcase(p, pat)):
            out.append(pat)
        else:
            out += [glob.escape(w) for w in members]
    return out


def check_layout(manifest: Any, rules: RuleSet, layout: Layout, *, where: str) -> None:
    """Refuse ``layout`` for an fp8 model (``manifest``, placed by :func:`fp8_rules`' table) when some
    split would cut a block: the resharders' own check (:func:`ckpt.resharders.placement.check_block_splits`),
    run before an import writes anything, with the hint to dequantize.

    Raises LayoutError naming the tensor, the dim, its block count and the sizes that would work.
    """
    try:
        check_block_splits(specs_of(manifest), layout, rules)
    except LayoutError as e:
        raise LayoutError(f"{where}: {e} (or import with --dequantize)") from None


def stored_scales(manifest: Any) -> dict[str, str]:
    """Stored fp8 weight key -> its scale's key, for every fp8 weight of a manifest with its scale beside it."""
    from ckpt._dtypes import dtype_from_name

    tensors = manifest.tensors
    return {k: scale_name(k) for k, t in tensors.items()
            if dtype_from_name(t.dtype, key=k) in FP8_WEIGHTS and scale_name(k) in tensors}


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weight an fp8 ``weight`` with per-block ``scale`` stands for, as ``dtype``: each element
    times its block's scale, in float32, then cast; bitwise what transformers' ``Fp8Dequantize``
    computes (where it is defined: every dim a multiple of its block; a partial last block takes its
    own scale, as DeepSeek's reference ``weight_dequant`` does)."""
    rows, cols = weight.shape[-2:]
    s = scale.to(torch.float32)
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * s).to(dtype)



def dequantize_dir(src: Any, out_dir: str, *, dtype: torch.dtype | None, budget: int) -> None:
    """Write the model directory ``src`` (a :class:`~ckpt.storage.Storage` holding an fp8 model) to the
    local directory ``out_dir`` with every fp8 weight dequantized (:func:`dequantize`, as ``dtype``,
    default bfloat16), the scales dropped and the ``quantization_config`` removed; other tensors and
    the tokenizer files as they are. Tensors are read one at a time, files written at ``budget`` bytes.

    Raises what reading the directory raises, MismatchError for an fp8 weight without its scale.
    """
    import json
    import os

    import safetensors.torch

    from ckpt.hf import files as hf_files
    from ckpt.hf.directory import CONFIG_NAME, ST_METADATA, ST_TO_TORCH, read_entries, read_json

    config = read_json(src, CONFIG_NAME)
    stripped, spec = split_quant(config, where=f"{src.url}/{CONFIG_NAME}")
    out_dtype = dtype or torch.bfloat16
    entries, _ = read_entries(src)

    def read(name: str) -> torch.Tensor:
        file, h = entries[name]
        dt = ST_TO_TORCH.get(h.dtype)
        if dt is None or h.length != math.prod(h.shape) * dt.itemsize:
            raise MismatchError(f"{src.url}/{file}: {name} ({h.dtype}, {h.length} bytes) cannot be read as a tensor")
        buf = bytearray(h.length)
        if h.length:
            src.read_into(file, h.start, memoryview(buf))
        return torch.frombuffer(buf, dtype=dt).reshape(h.shape) if h.length else torch.empty(h.shape, dtype=dt)

    group: dict[str, torch.Tensor] = {}
    files: list[str] = []

    def flush() -> None:
        if group:
            files.append(f"dequantized-{len(files):05d}.safetensors")
            safetensors.torch.save_file(group, os.path.join(out_dir, files[-1]), metadata=ST_METADATA)
            group.clear()

    scales = {scale_name(n) for n, (_, h) in entries.items() if ST_TO_TORCH.get(h.dtype) in FP8_WEIGHTS}
    weight_map: dict[str, str] = {}
    for name in entries:
        if name in scales:
            continue
        t = read(name)
        if t.dtype in FP8_WEIGHTS and spec is not None:
            if scale_name(name) not in entries:
                raise MismatchError(f"{src.url}: {name} is fp8 without its scale {scale_name(name)}")
            t = dequantize(t, read(scale_name(name)), spec.block, out_dtype)
        group[name] = t
        weight_map[name] = f"dequantized-{len(files):05d}.safetensors"
        if sum(x.numel() * x.element_size() for x in group.values()) >= budget:
            flush()
    flush()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(stripped | {"dtype": str(out_dtype).removeprefix("torch.")}, f)
    for name, data in hf_files.read_side_files(src).items():
        with open(os.path.join(out_dir, name), "wb") as fb:
            fb.write(data)
