"""The trainer's run configuration: a typed dataclass validated once, with messages that say the fix.

The parallel layout is separate (:class:`ckpt.layout.Layout`): a run may change layout
at a restart while its :class:`TrainConfig` stays the same, which is what elastic resume means.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ckpt.errors import CheckpointError, LayoutError
from ckpt.layout import Layout
from ckpt.trainer.hybrid import HYBRID_CONFIGS, HybridConfig
from ckpt.trainer.hybrid_parallel import check_hybrid_layout
from ckpt.trainer.model import CONFIGS, ModelConfig
from ckpt.trainer.sp import check_sp

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """What to train and how; the same on every rank.

    Args:
        model: the architecture: the MoE model (``CONFIGS["tiny"]`` ...) or the hybrid
            linear-attention family (``HYBRID_CONFIGS["hybrid-tiny"]``).
        seq_len: tokens per sample.
        global_batch: samples per optimizer step over all data-parallel ranks (``dp x ep`` of them).
        microbatches: pipeline microbatches per data-parallel rank (used when ``pp > 1``).
        schedule: pipeline schedule, ``"gpipe"`` or ``"1f1b"``.
        steps: length of the run (the LR schedule spans it).
        stop_after: exit after this many steps (the schedule still spans ``steps``); None: ``steps``.
        lr / min_lr_ratio / warmup: linear warmup over ``warmup`` steps, then cosine decay to
            ``lr * min_lr_ratio`` at ``steps``.
        weight_decay / beta1 / beta2 / eps: AdamW (decay on matrices only, not on norm weights).
        grad_clip: global gradient-norm clip; 0 disables it.
        seed: weight init and data order.
        ckpt_dir: root of the run's checkpoints (``CheckpointManager``); None: no checkpoints.
        save_every: checkpoint every N steps (async), and always at the end; None: only at the end.
        keep_last: committed checkpoints kept under ``ckpt_dir``.
        async_save: save in the background (else block until committed).
        max_staging_bytes: cap on each rank's host staging memory for async saves (a ring below
            the state's size; ``CheckpointManager(max_staging_bytes=)``); None: no cap.
        init_from: start from the weights (``model.*`` only) of this checkpoint when ``ckpt_dir``
            holds none yet.
        verify_restore: check the CRC32 of every stored shard a rank restores (``ckpt.load(...,
            verify=True)``); a checkpoint that fails on any rank is skipped for the next older one.
        fail_at_step / fail_rank: fault injection: that rank SIGKILLs itself when it reaches this
            step, in the first attempt of a torchrun job only.
        fail_node: fault injection instead of ``fail_rank``: every rank of this node deletes the
            node's memory-tier directory and SIGKILLs itself at ``fail_at_step`` (a lost node).
        memory_every: memory checkpoint every N steps (node-local shared memory, a copy on a peer
            node; ``CheckpointManager(memory_every=)``); None: no memory tier.
        replicas / memory_keep: peer copies of each rank's memory checkpoint; complete memory
            checkpoints kept per rank.
        memory_busy: ``wait`` (a memory checkpoint due while the previous one still runs waits for
            it) or ``skip`` (it is skipped: no stall, fewer memory checkpoints); see
            :class:`ckpt.tier.TierConfig`.
        memory_stage_on_device / memory_max_gbps / memory_max_overhead: stage GPU pieces in device
            memory before the host copy; a budget (GB/s per rank) for the tier's background traffic;
            the slowdown the tier may cost (a fraction: the budget follows from the step times); see
            :class:`ckpt.tier.TierConfig`.
        nodes: simulate this many nodes on one host (contiguous blocks of ranks); None: the node
            comes from ``CKPT_NODE`` or torchrun's ``LOCAL_WORLD_SIZE``.
        shm_dir / run_id: the memory tier's base directory (default ``$CKPT_SHM_DIR`` or
            ``/dev/shm``) and the run's identity (default ``$CKPT_RUN_ID`` or a hash of ``ckpt_dir``).
        metrics_path: JSON lines, one per step (rank 0 writes); None: ``<ckpt_dir>/metrics.jsonl``
            when there is a ``ckpt_dir``.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        moe_dispatch: ``"dedup"`` (X-MoE: one all-to-all row per (token, EP rank)) or
            ``"per-expert"`` (one row per (token, expert)); see :mod:`ckpt.trainer.ep`.
        moe_sequence_shard: under TP, each TP rank routes and dispatches 1/tp of the MoE tokens
            (fewer EP all-to-all bytes, more TP traffic; off by default).
    """

    model: ModelConfig | HybridConfig = CONFIGS["tiny"]
    seq_len: int = 32
    global_batch: int = 8
    microbatches: int = 2
    schedule: str = "1f1b"
    steps: int = 200
    stop_after: int | None = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_dir: str | None = None
    save_every: int | None = None
    keep_last: int = 3
    async_save: bool = True
    max_staging_bytes: int | None = None
    init_from: str | None = None
    verify_restore: bool = True
    fail_at_step: int | None = None
    fail_rank: int = 0
    fail_node: int | None = None
    memory_every: int | None = None
    replicas: int = 1
    memory_keep: int = 1
    memory_busy: str = "wait"
    memory_stage_on_device: bool = False
    memory_max_gbps: float | None = None
    memory_max_overhead: float | None = None
    nodes: int | None = None
    shm_dir: str | None = None
    run_id: str | None = None
    metrics_path: str | None = None
    device: str = "auto"
    moe_dispatch: str = "dedup"
    moe_sequence_shard: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch", "microbatches", "steps", "keep_last"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
        if self.seq_len < 2:
            raise ValueError("TrainConfig.seq_len must be >= 2: a causal LM predicts token t+1 from t")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TrainConfig.schedule={self.schedule!r}: choose one of {SCHEDULES}")
        if self.max_staging_bytes is not None:
            from ckpt._staging import check_cap

            try:
                check_cap(self.max_staging_bytes)
            except CheckpointError as e:
                raise ValueError(f"TrainConfig.{e}") from None
        if self.save_every is not None and self.save_every < 1:
            raise ValueError(f"TrainConfig.save_every={self.save_every}: use a positive step count or None")
        if self.stop_after is not None and not 0 <= self.stop_after <= self.steps:
            raise ValueError(f"TrainConfig.stop_after={self.stop_after} must lie in [0, steps={self.steps}]")
        if self.fail_at_step is not None and self.ckpt_dir is None:
            raise ValueError("fault injection (fail_at_step) needs a ckpt_dir to resume from")
        if self.fail_node is not None and (self.fail_at_step is None or self.fail_node < 0):
            raise ValueError(f"TrainConfig.fail_node={self.fail_node}: a node index >= 0, with fail_at_step set")
        if self.memory_every is not None and (self.memory_every < 1 or self.ckpt_dir is None):
            raise ValueError(f"TrainConfig.memory_every={self.memory_every}: use a positive step count, with a "
                             "ckpt_dir (it names the run; persistent saves go there)")
        if self.memory_busy not in ("wait", "skip"):
            raise ValueError(f"TrainConfig.memory_busy={self.memory_busy!r}: use 'wait' or 'skip'")
        if self.memory_max_gbps is not None and not self.memory_max_gbps > 0:
            raise ValueError(f"TrainConfig.memory_max_gbps={self.memory_max_gbps!r}: use a positive GB/s per rank, "
                             "or None for full speed")
        if self.memory_max_overhead is not None and (not 0 < self.memory_max_overhead < 1
                                                     or self.memory_busy != "skip"):
            raise ValueError(f"TrainConfig.memory_max_overhead={self.memory_max_overhead!r}: use a fraction of the "
                             "step time (e.g. 0.05) with memory_busy='skip', or None")
        if self.replicas < 0 or self.memory_keep < 1:
            raise ValueError(f"TrainConfig: replicas={self.replicas} must be >= 0 and memory_keep="
                             f"{self.memory_keep} >= 1")
        if self.nodes is not None and self.nodes < 1:
            raise ValueError(f"TrainConfig.nodes={self.nodes}: simulate at least one node")
        if self.fail_node is not None and self.nodes is not None and self.fail_node >= self.nodes:
            raise ValueError(f"TrainConfig.fail_node={self.fail_node} is outside the {self.nodes} node(s)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"TrainConfig.device={self.device!r}: choose auto, cpu or cuda")
        if self.moe_dispatch not in ("dedup", "per-expert"):
            raise ValueError(f"TrainConfig.moe_dispatch={self.moe_dispatch!r}: choose dedup or per-expert")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup < 0:
            raise ValueError("TrainConfig: lr must be > 0, min_lr_ratio in [0, 1], warmup >= 0")

    @property
    def last_step(self) -> int:
        """The step count this invocation stops at."""
        return self.steps if self.stop_after is None else self.stop_after

    @property
    def metrics_file(self) -> str | None:
        """Where per-step metrics go (None: nowhere)."""
        if self.metrics_path is not None:
            return self.metrics_path
        return f"{self.ckpt_dir.rstrip('/')}/metrics.jsonl" if self.ckpt_dir else None

    def check_layout(self, layout: Layout) -> None:
        """Raise LayoutError when ``layout`` cannot run this config, naming the fix."""
        if isinstance(self.model, HybridConfig):
            # Whole heads per TP rank (linear and softmax layers), experts over EP, and under sp the
            # zigzag chunks must hold whole lightning blocks (LASP-2 computes block by block); the
            # checks below see the shared fields through the MoE view.
            check_hybrid_layout(self.model, tp=layout.tp, ep=layout.ep, sp=layout.sp, seq_len=self.seq_len,
                                sequence_layout="zigzag")
            m, width = self.model.moe_config(), "intermediate_size"
        else:
            m, width = self.model, "moe_intermediate_size"
            if m.num_key_value_heads % layout.tp:
                raise LayoutError(f"tp={layout.tp} must divide num_key_value_heads={m.num_key_value_heads} "
                                  "(each TP rank keeps whole key/value groups)")
        data = layout.dp * layout.ep
        if self.global_batch % data:
            raise LayoutError(f"global_batch={self.global_batch} does not split over dp x ep = {data} data-parallel "
                              "ranks; choose a multiple")
        if layout.pp > 1 and (self.global_batch // data) % self.microbatches:
            raise LayoutError(f"{self.global_batch // data} samples per data-parallel rank do not split into "
                              f"{self.microbatches} pipeline microbatches; change --microbatches or the batch")
        if layout.pp > 1 and self.schedule == "1f1b" and self.microbatches < layout.pp:
            raise LayoutError(f"the 1F1B schedule needs at least pp={layout.pp} microbatches, got "
                              f"{self.microbatches}; raise --microbatches or use --schedule gpipe")
        if layout.pp > m.num_hidden_layers:
            raise LayoutError(f"pp={layout.pp} exceeds the {m.num_hidden_layers} layers of the model")
        if m.num_experts % layout.ep:
            raise LayoutError(f"ep={layout.ep} must divide num_experts={m.num_experts}")
        if m.moe_intermediate_size % layout.tp:
            raise LayoutError(f"tp={layout.tp} must divide {width}={m.moe_intermediate_size} (the experts' width)")
        check_sp(self.seq_len, layout.sp)
        if self.nodes is not None and layout.world_size % self.nodes:
            raise LayoutError(f"--nodes {self.nodes} must divide the {layout.world_size} ranks (ranks per node = "
                              "world / nodes)")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for checkpoint metadata and the worker command line)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        model = d.pop("model", None)
        if isinstance(model, str):
            d["model"] = model_config(model)
        elif model is not None:
            d["model"] = HybridConfig.from_dict(model) if "layer_types" in model else ModelConfig.from_dict(model)
        return cls(**d)


def model_config(name: str) -> ModelConfig | HybridConfig:
    """``CONFIGS[name]`` (the MoE model) or ``HYBRID_CONFIGS[name]`` (the hybrid family), with an
    error listing the known names."""
    if name in CONFIGS:
        return CONFIGS[name]
    if name in HYBRID_CONFIGS:
        return HYBRID_CONFIGS[name]
    raise ValueError(f"unknown model config {name!r}; choose one of {sorted(CONFIGS) + sorted(HYBRID_CONFIGS)}")


__all__ = ["SCHEDULES", "TrainConfig", "model_config"]
