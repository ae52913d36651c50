"""``ckpt train`` (launch the embedded trainer through torchrun) and ``ckpt demo`` (the main job)."""

from __future__ import annotations

import os

import typer
from rich.markup import escape

from ckpt.cli.common import console, err_console, handle_errors


def _say(text: str) -> None:
    # Paths and layouts verbatim: no rich markup ("[plot]" is text here), no wrapping inside paths.
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def _error(text: str) -> None:
    err_console.print(f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True)


@handle_errors
def train_cmd(
    config: str = typer.Option("tiny", "--config",
                               help="model config: tiny, 100m, 800m (the MoE model) or hybrid-tiny (the hybrid MiniMax "
                                    "family: lightning and softmax attention layers)"),
    tp: int = typer.Option(1, "--tp", min=1, help="tensor-parallel degree"),
    ep: int = typer.Option(1, "--ep", min=1, help="expert-parallel degree"),
    sp: int = typer.Option(1, "--sp", min=1,
                           help="sequence-parallel degree (zigzag slices of each sample, LASP-2H attention)"),
    pp: int = typer.Option(1, "--pp", min=1, help="pipeline stages"),
    dp: int = typer.Option(1, "--dp", min=1, help="data-parallel degree (besides ep)"),
    zero: int = typer.Option(1, "--zero", min=0, max=1, help="1: ZeRO-1 optimizer state sharding"),
    steps: int = typer.Option(200, "--steps", min=1, help="length of the run (the LR schedule spans it)"),
    stop_after: int | None = typer.Option(None, "--stop-after", help="exit after this step (resume later)"),
    ckpt_dir: str | None = typer.Option(None, "--ckpt-dir", help="checkpoint root (resumes from its newest)"),
    save_every: int | None = typer.Option(None, "--save-every", min=1, help="async checkpoint every N steps"),
    keep_last: int = typer.Option(3, "--keep-last", min=1, help="committed checkpoints to keep"),
    sync_save: bool = typer.Option(False, "--sync-save", help="block on every save instead of saving async"),
    max_staging: str | None = typer.Option(None, "--max-staging-bytes",
                                           help="cap each rank's async-save staging memory (e.g. 2GiB): a ring"),
    fail_at_step: int | None = typer.Option(None, "--fail-at-step", help="fault injection: a rank dies at step S"),
    fail_rank: int = typer.Option(0, "--fail-rank", min=0, help="which rank dies (with --fail-at-step)"),
    fail_node: int | None = typer.Option(None, "--fail-node", min=0,
                                         help="instead: every rank of this node dies and its shared memory is lost"),
    memory_every: int | None = typer.Option(None, "--memory-every", min=1,
                                            help="memory checkpoint every N steps (/dev/shm + a peer node's copy)"),
    replicas: int = typer.Option(1, "--replicas", min=0, help="peer-node copies of each memory checkpoint"),
    memory_keep: int = typer.Option(1, "--memory-keep", min=1, help="complete memory checkpoints kept per rank"),
    memory_busy: str = typer.Option("wait", "--memory-busy",
                                    help="a memory checkpoint due while the previous one runs: wait, or skip it"),
    nodes: int | None = typer.Option(None, "--nodes", min=1,
                                     help="simulate N nodes on this host (default with --memory-every: 2)"),
    shm_dir: str | None = typer.Option(None, "--shm-dir", help="memory tier base (default $CKPT_SHM_DIR, /dev/shm)"),
    run_id: str | None = typer.Option(None, "--run-id",
                                      help="the run's identity for the memory tier (default: from --ckpt-dir)"),
    init_from: str | None = typer.Option(None, "--init-from", help="start from this checkpoint's model.* weights"),
    no_verify_restore: bool = typer.Option(False, "--no-verify-restore",
                                           help="restore without checking the checkpoint's checksums"),
    seq_len: int = typer.Option(32, "--seq-len", min=2, help="tokens per sample"),
    global_batch: int = typer.Option(8, "--global-batch", min=1, help="samples per step over all ranks"),
    microbatches: int = typer.Option(2, "--microbatches", min=1, help="pipeline microbatches per rank"),
    schedule: str = typer.Option("1f1b", "--schedule", help="pipeline schedule: gpipe or 1f1b"),
    lr: float = typer.Option(3e-3, "--lr", help="peak learning rate"),
    seed: int = typer.Option(0, "--seed", help="init and data seed"),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when available), cpu or cuda"),
    moe_dispatch: str = typer.Option("dedup", "--moe-dispatch",
                                     help="MoE all-to-all: dedup (one row per token and EP rank) or per-expert"),
    moe_sequence_shard: bool = typer.Option(False, "--moe-sequence-shard/--no-moe-sequence-shard",
                                            help="under TP, each TP rank routes and dispatches 1/tp of the MoE "
                                                 "tokens (fewer EP all-to-all bytes, more TP traffic)"),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="torchrun restarts after a failure"),
    metrics: str | None = typer.Option(None, "--metrics", help="JSON lines file (default CKPT_DIR/metrics.jsonl)"),
    plot: str | None = typer.Option(None, "--plot", help="write the loss curve PNG here (needs matplotlib)"),
) -> None:
    """Train the embedded MoE (or the hybrid family) on dp*tp*pp*ep*sp processes (torchrun, elastic
    restarts), with checkpoints."""
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig, model_config
    from ckpt.trainer.launch import TrainingFailed, launch
    from ckpt.trainer.metrics import plot_loss

    layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, sp=sp, zero=zero)
    try:
        from ckpt.cli.reshard import parse_size
        from ckpt.errors import CheckpointError

        cap = parse_size(max_staging) if max_staging is not None else None
    except CheckpointError as e:
        _error(f"--max-staging-bytes: {e}")
        raise typer.Exit(5) from None
    if nodes is None and (memory_every is not None or fail_node is not None) and layout.world_size % 2 == 0:
        nodes = 2  # one host: without simulated nodes every peer copy would sit on the same node
    try:
        cfg = TrainConfig(model=model_config(config), seq_len=seq_len, global_batch=global_batch,
                          microbatches=microbatches, schedule=schedule, steps=steps, stop_after=stop_after, lr=lr,
                          seed=seed, ckpt_dir=ckpt_dir, save_every=save_every, keep_last=keep_last,
                          async_save=not sync_save, max_staging_bytes=cap, init_from=init_from,
                          verify_restore=not no_verify_restore, fail_at_step=fail_at_step,
                          fail_rank=fail_rank, metrics_path=metrics, device=device, fail_node=fail_node,
                          memory_every=memory_every, replicas=replicas, memory_keep=memory_keep,
                          memory_busy=memory_busy, nodes=nodes, shm_dir=shm_dir, run_id=run_id,
                          moe_dispatch=moe_dispatch, moe_sequence_shard=moe_sequence_shard)
    except ValueError as e:
        _error(str(e))
        raise typer.Exit(5) from None
    if fail_at_step is not None and fail_rank >= layout.world_size:
        _error(f"--fail-rank {fail_rank} is outside the {layout.world_size} ranks")
        raise typer.Exit(5)
    if fail_node is not None and nodes is None:
        _error(f"--fail-node needs --nodes N dividing the {layout.world_size} ranks (the simulated nodes on this host)")
        raise typer.Exit(5)
    cfg.check_layout(layout)  # LayoutError: one line, exit 5, before any process starts
    _say(f"training {config} under {layout} on {layout.world_size} process(es) via torchrun")
    if memory_every is not None:
        where = f"{nodes} simulated node(s)" if nodes else "one node"
        _say(f"memory tier: every {memory_every} step(s), {replicas} peer copy(ies), {where}")
    try:
        restarts = launch(cfg, layout, max_restarts=max_restarts)
    except TrainingFailed as e:
        # a deterministic error (exit 5, like other bad input) is not retried; lost ranks are (exit 1)
        _error(str(e) if e.final else f"{e}; gave up after {max_restarts} restart(s)")
        raise typer.Exit(5 if e.final else 1) from None
    if restarts:
        _say(f"finished after {restarts} restart(s)")
    if ckpt_dir:
        from ckpt.manager import CheckpointManager

        _say(f"checkpoints: {ckpt_dir} (newest {CheckpointManager(ckpt_dir, gc_on_start=False).latest()})")
    if cfg.metrics_file:
        _say(f"metrics: {cfg.metrics_file}")
        if plot:
            png = plot_loss(cfg.metrics_file, plot)
            _say(f"plot: {png}" if png else "plot: skipped (pip install ckpt[plot] for matplotlib)")


@handle_errors
def demo_cmd(
    out: str = typer.Option("ckpt-demo", "--out", help="directory for checkpoints, metrics and the plot"),
    steps: int = typer.Option(200, "--steps", min=20, help="total training steps"),
    node_loss: bool = typer.Option(False, "--node-loss",
                                   help="lose a whole node instead of one rank; recover from the memory tier"),
) -> None:
    """The main job: train tiny on 4 ranks, kill one, resume, continue on 2 ranks under another layout,
    verify, export (when the HF exporter is there), plot."""
    from ckpt.trainer.demo import run_demo, summarize

    report = run_demo(out, steps=steps, say=_say, node_loss=node_loss)
    for line in summarize(report):
        _say(f"  {line}")
    _say(f"final checkpoint: {report.final_checkpoint} (verified: checksums and coverage OK)")
    _say(f"held-out loss of the final model: {report.eval_loss:.3f}")
    _say(f"checkpoints: {report.ckpt_dir}")
    _say(f"metrics: {report.metrics}")
    _say(f"worker logs: {os.path.join(report.out_dir, 'logs')}")
    _say(f"plot: {report.plot}" if report.plot else f"plot: {report.plot_note}")
    _say(f"hugging face: {report.hf_export} ({report.hf_note})" if report.hf_export
                  else f"hugging face: {report.hf_note}")
    _say(f"done in {report.wall_s:.0f} s; summary in {os.path.join(report.out_dir, 'demo.json')}")


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``demo`` to the app."""
    app.command("train")(train_cmd)
    app.command("demo")(demo_cmd)
