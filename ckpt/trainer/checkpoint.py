"""The trainer's checkpoint contents (global keys) and resume, same layout or resharded.

Keys (what the resharder and the Hugging Face exporter read):

- ``model.<param>``: every parameter of :class:`~ckpt.trainer.model.MoEForCausalLM` under its
  global name (global layer index, fused global expert tensors), global unpadded shape, saved as
  ``ckpt.Shard(block, global_shape, offsets)`` with the block of ``param_box`` (rules
  ``MOE_RULES``); only the ranks of the stage that owns a parameter declare it, and replicas are
  deduplicated by ``ckpt.save``. Vocabulary padding is never saved.
- ``optim.exp_avg.<param>``, ``optim.exp_avg_sq.<param>`` (float32): the region of
  ``optim_region``: with ZeRO-1 a ``ckpt.FlatShard(local, shape, start, box=(offsets, lengths))``
  (``box`` omitted when the block is the whole tensor), else a ``Shard`` like the parameter.
- ``optim.step`` (int): AdamW's step count.
- ``train.step`` (int), ``train.sample_index`` (int): steps done and the global sample index of
  the next step's first sample (independent of the data-parallel size).
- ``train.lr_scheduler``: the schedule's state dict. ``ckpt`` flattens nested dicts, so it is
  stored as the objects ``train.lr_scheduler.<field>``; loading the key ``train.lr_scheduler``
  with an object target returns the whole dict.
- ``rng``: ``ckpt.PerRank({"cpu": bytes, "cuda": bytes?})``, torch's generator states.

Save metadata: ``layout=layout.to_dict()`` and ``user_metadata = {"model_config":
cfg.to_dict(), "layout": layout.to_dict(), "rules": "embedded-moe", "trainer": {...}}``; the
``trainer`` entry (data and optimizer settings, for information) is an addition to the contract.
A hybrid-family model (:class:`~ckpt.trainer.hybrid.HybridConfig`, ``model_config`` with
``layer_types``) adds its :meth:`~ckpt.trainer.hybrid.HybridConfig.checkpoint_metadata`: rules
``hf-decoder`` (its parameter names are the Hugging Face ones), the ``minimax`` adapter and its
``hf_config``, so ``ckpt export-hf`` and ``ckpt reshard`` need no flag for it.

Resume: under the saving layout everything is restored, RNG included. Under another layout the
tensors are resharded by ``ckpt.load`` and the per-rank RNG states are not restored (ranks no
longer correspond; training uses no randomness after init, so nothing depends on them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import ckpt
from ckpt._dtypes import dtype_from_name, dtype_name
from ckpt.errors import MismatchError
from ckpt.layout import Layout
from ckpt.manifest import Manifest
from ckpt.shards import Flat
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.hybrid import HybridConfig, HybridForCausalLM
from ckpt.trainer.model import ModelConfig, MoEForCausalLM
from ckpt.trainer.parallelize import ParallelModel, rules_of
from ckpt.trainer.zero import LRSchedule, ZeroAdamW

RULES_NAME = "embedded-moe"  # the MoE model's (rules_of(config).name for any model)


def model_state(pm: ParallelModel) -> dict[str, Any]:
    """``{param name: Shard}`` of this rank's real blocks (views of the parameters: loading into them
    fills the model in place)."""
    out: dict[str, Any] = {}
    for spec in pm.specs:
        if spec.box.numel:
            out[spec.name] = ckpt.Shard(spec.real(), spec.global_shape, spec.box.offsets)
    return out


def optim_state(opt: ZeroAdamW) -> dict[str, Any]:
    """``{"exp_avg": {...}, "exp_avg_sq": {...}, "step": n}`` with each region of ``optim_region``."""
    avg: dict[str, Any] = {}
    avg_sq: dict[str, Any] = {}
    for s in opt.all_slots():
        spec = s.spec
        if s.stop == s.start:
            continue
        if isinstance(s.region, Flat):
            box = (s.region.box.offsets, s.region.box.lengths) if s.region.box is not None else None
            avg[spec.name] = ckpt.FlatShard(s.exp_avg, spec.global_shape, s.start, box=box)
            avg_sq[spec.name] = ckpt.FlatShard(s.exp_avg_sq, spec.global_shape, s.start, box=box)
        else:
            shape = spec.box.lengths
            avg[spec.name] = ckpt.Shard(s.exp_avg.view(shape), spec.global_shape, spec.box.offsets)
            avg_sq[spec.name] = ckpt.Shard(s.exp_avg_sq.view(shape), spec.global_shape, spec.box.offsets)
    return {"exp_avg": avg, "exp_avg_sq": avg_sq, "step": opt.step_count}


def rng_state() -> dict[str, bytes]:
    """This process's torch generator states as bytes (msgpack-able)."""
    out = {"cpu": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return out


def set_rng_state(state: dict[str, bytes] | None) -> None:
    """Inverse of :func:`rng_state` (missing parts are left alone)."""
    if not state:
        return
    if "cpu" in state:
        torch.set_rng_state(torch.frombuffer(bytearray(state["cpu"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))


def training_state(pm: ParallelModel, opt: ZeroAdamW, step: int, sample_index: int,
                   schedule: LRSchedule) -> dict[str, Any]:
    """The full state ``CheckpointManager.save`` writes (see the module docstring for the keys)."""
    return {
        "model": model_state(pm),
        "optim": optim_state(opt),
        "train": {"step": step, "sample_index": sample_index, "lr_scheduler": schedule.state_dict()},
        "rng": ckpt.PerRank(rng_state()),
    }


def save_metadata(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """``user_metadata`` of every trainer checkpoint."""
    trainer = {k: v for k, v in cfg.to_dict().items() if k in (
        "seq_len", "global_batch", "microbatches", "schedule", "steps", "lr", "min_lr_ratio", "warmup",
        "weight_decay", "beta1", "beta2", "eps", "grad_clip", "seed")}
    meta = {"model_config": cfg.model.to_dict(), "layout": layout.to_dict(), "rules": rules_of(cfg.model).name,
            "trainer": trainer}
    if isinstance(cfg.model, HybridConfig):
        meta |= cfg.model.checkpoint_metadata()  # the HF adapter and config (and the same rules name)
    return meta


def config_from_metadata(saved: dict[str, Any]) -> ModelConfig | HybridConfig:
    """The model config a checkpoint's ``model_config`` describes: the hybrid family when it has
    ``layer_types``, else the MoE model. Raises ValueError on unknown or invalid fields."""
    return HybridConfig.from_dict(saved) if "layer_types" in saved else ModelConfig.from_dict(saved)


@dataclass(frozen=True, slots=True)
class Resume:
    """What a restore found: the checkpoint's step and data position, and where it came from;
    ``load_stats``: this rank's ``ckpt.load(..., stats=)`` figures (phase durations in s, bytes)."""

    url: str
    step: int
    sample_index: int
    saved_layout: dict[str, Any] | None
    resharded: bool
    load_stats: dict[str, Any] = field(default_factory=dict, compare=False)


def _check_model_config(manifest: Manifest, cfg: TrainConfig, url: str) -> None:
    saved = manifest.user_metadata.get("model_config") if manifest.user_metadata else None
    if saved is None:
        return  # e.g. imported from Hugging Face: shapes are still checked tensor by tensor
    family = {True: "the hybrid family", False: "the MoE model"}
    theirs, mine_hybrid = "layer_types" in saved, isinstance(cfg.model, HybridConfig)
    if theirs != mine_hybrid:
        raise MismatchError(f"{url}: a checkpoint of {family[theirs]}, this run trains {family[mine_hybrid]}; "
                            "resume with the --config it was trained with")
    mine = cfg.model.to_dict()
    diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {mine.get(k)!r}" for k in diff[:6])
        raise MismatchError(f"{url}: trained with another model config ({detail}); resume with the same --config")


def _require(manifest: Manifest, state: dict[str, Any], url: str, prefixes: tuple[str, ...]) -> None:
    from ckpt._state import TensorItem, flatten_state

    wanted = [it.key for it in flatten_state(state) if isinstance(it, TensorItem) and it.key.startswith(prefixes)]
    missing = [k for k in wanted if k not in manifest.tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise MismatchError(f"{url}: missing tensors {missing[:5]}{more}; is it a checkpoint of this model?")


def restore(url: str, pm: ParallelModel, opt: ZeroAdamW, schedule: LRSchedule, cfg: TrainConfig, *,
            load: Callable[..., dict[str, Any]] | None = None) -> Resume:
    """Load a full training checkpoint into this rank's model and optimizer (collective).

    Same layout: strict load, RNG included. Another layout: every model/optimizer tensor is still
    required (resharded on load), RNG states are skipped. ``load``: what reads the state (default
    ``ckpt.load``; the memory tier passes its own, which reads this rank's local copy and checks
    every checksum, not collective).

    Raises:
        MismatchError: another model config, or missing tensors, naming them.
    """
    manifest = ckpt.inspect(url)
    _check_model_config(manifest, cfg, url)
    layout = pm.ctx.layout
    saved = manifest.layout or (manifest.user_metadata or {}).get("layout")
    same = saved is not None and Layout.from_dict(saved) == layout
    state: dict[str, Any] = {
        "model": model_state(pm),
        "optim": optim_state(opt),
        "train": {"step": 0, "sample_index": 0, "lr_scheduler": None},
    }
    if same:
        state["rng"] = ckpt.PerRank(None)
    else:
        _require(manifest, state, url, ("model.", "optim."))
    stats: dict[str, Any] = {}
    out = (load or ckpt.load)(state, url, strict=same, stats=stats, verify=cfg.verify_restore)
    opt.step_count = int(out["optim"]["step"])
    train = out["train"]
    if not isinstance(train.get("lr_scheduler"), dict):
        raise MismatchError(f"{url}: no train.lr_scheduler state; not a trainer checkpoint?")
    schedule.load_state_dict(train["lr_scheduler"])
    if same:
        set_rng_state(out.get("rng"))
    return Resume(url, int(train["step"]), int(train["sample_index"]), saved, not same, stats)


def _cast_targets(manifest: Manifest, model: dict[str, Any], url: str
                  ) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Weights stored in another floating dtype (e.g. exported with ``--dtype bf16`` and imported
    back) are read into staging blocks of the stored dtype and cast afterwards: ``(state to load,
    [(parameter block, staging block)])``. A resume never goes through here: optimizer state must
    match exactly, so ``restore`` keeps ``ckpt.load``'s dtype check."""
    out: dict[str, Any] = {}
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, value in model.items():
        entry = manifest.tensors.get(f"model.{name}")
        local = value.local if isinstance(value, ckpt.Shard) else value
        if entry is None or entry.dtype == dtype_name(local.dtype):
            out[name] = value
            continue
        stored = dtype_from_name(entry.dtype, key=f"model.{name}")
        if not (stored.is_floating_point and local.dtype.is_floating_point):
            raise MismatchError(f"{url}: model.{name} is stored as {entry.dtype}, the model holds "
                                f"{dtype_name(local.dtype)}; only floating-point weights are cast on --init-from")
        stage = torch.empty(local.shape, dtype=stored, device=local.device)
        out[name] = ckpt.Shard(stage, value.global_shape, value.offsets) if isinstance(value, ckpt.Shard) else stage
        casts.append((local, stage))
    return out, casts


def load_weights(url: str, pm: ParallelModel, *, verify: bool = True) -> dict[str, Any]:
    """Load only ``model.*`` (e.g. a checkpoint imported from Hugging Face), resharded to this
    rank's blocks; other keys in the checkpoint are ignored (collective). Weights stored in another
    floating dtype (a bf16 export imported back) are cast to the model's dtype. Returns this rank's
    ``ckpt.load(..., stats=)`` figures (with ``cast``: how many tensors were cast).

    Raises MismatchError naming missing ``model.*`` tensors, a global shape that differs, or a
    non-floating dtype that differs.
    """
    manifest = ckpt.inspect(url)
    state = {"model": model_state(pm)}
    _require(manifest, state, url, ("model.",))
    state["model"], casts = _cast_targets(manifest, state["model"], url)
    stats: dict[str, Any] = {}
    ckpt.load(state, url, strict=False, stats=stats, verify=verify)
    with torch.no_grad():
        for dst, src in casts:
            dst.copy_(src)
    stats["cast"] = len(casts)
    return stats


def load_full_model(url: str, config: ModelConfig | HybridConfig | None = None
                    ) -> MoEForCausalLM | HybridForCausalLM:
    """The whole model of a checkpoint in one process (e.g. to evaluate or compare); ``config``
    defaults to the checkpoint's ``model_config`` (a :class:`HybridForCausalLM` when it has
    ``layer_types``).

    Raises MismatchError when a ``model.*`` tensor is missing or shaped differently.
    """
    manifest = ckpt.inspect(url)
    if config is None:
        saved = (manifest.user_metadata or {}).get("model_config")
        if saved is None:
            raise MismatchError(f"{url}: no model_config in the metadata; pass the ModelConfig or HybridConfig")
        config = config_from_metadata(saved)
    model = HybridForCausalLM(config) if isinstance(config, HybridConfig) else MoEForCausalLM(config)
    state = {"model": {k: v.data for k, v in model.named_parameters()}}
    _require(manifest, state, url, ("model.",))
    state["model"], casts = _cast_targets(manifest, state["model"], url)
    ckpt.load(state, url, strict=False)
    with torch.no_grad():
        for dst, src in casts:
            dst.copy_(src)
    return model


__all__ = ["RULES_NAME", "model_state", "optim_state", "rng_state", "set_rng_state", "training_state", "save_metadata",
           "config_from_metadata", "Resume", "restore", "load_weights", "load_full_model"]
