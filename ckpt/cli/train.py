"""``ckpt train`` (launch the embedded trainer through torchrun) and ``ckpt demo`` (the main job)."""

from __future__ import annotations

import inspect
import json
import os
import re
import tempfile
import time
from typing import TYPE_CHECKING, Any

import typer

from ckpt import errors
from ckpt.cli.common import console, err_console, handle_errors, print_json
from ckpt.errors import CheckpointError, LayoutError, StateError

if TYPE_CHECKING:
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig


# --json: stdout carries one JSON object at the end, so the running commentary goes to stderr
_JSON = {"on": False}


def _say(text: str) -> None:
    # Paths and layouts verbatim: no rich markup ("[plot]" is text here), no wrapping inside paths.
    (err_console if _JSON["on"] else console).print(text, highlight=False, markup=False, soft_wrap=True)


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
    memory_stage_on_device: bool = typer.Option(
        False, "--memory-stage-on-device",
        help="stage GPU state in device memory first (the optimizer waits for a device copy only)"),
    memory_max_gbps: float | None = typer.Option(None, "--memory-max-gbps", min=0.001,
                                                 help="budget for the memory tier's background traffic, GB/s per rank"),
    memory_max_overhead: float | None = typer.Option(
        None, "--memory-max-overhead", min=0.001, max=0.999,
        help="slowdown of a step the memory tier may cost, e.g. 0.05: it sets its budget from the step times "
             "(needs --memory-busy skip)"),
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
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="stream torchrun's and the workers' output here (default: a log file under "
                                      "CKPT_DIR/logs, its path printed once)"),
    json_out: bool = typer.Option(False, "--json", help="print a JSON summary of the run on stdout (the lines "
                                                        "shown while it runs go to stderr)"),
) -> None:
    """Train the embedded MoE (or the hybrid family) on dp*tp*pp*ep*sp processes (torchrun, elastic
    restarts), with checkpoints. Quiet by default: a few lines here, the workers' output in a log file."""
    opts = dict(locals())  # the command's options by name, for the helpers below
    from ckpt.layout import Layout

    _JSON["on"] = json_out
    try:
        layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, sp=sp, zero=zero)
        cfg = _train_config(opts, layout)
        _check_faults(cfg, layout)
        _preflight(cfg, layout)
        run = {"config": config, "layout": str(layout), "world_size": layout.world_size, "ckpt_dir": ckpt_dir}
        done = _finished_step(cfg)
        if done is not None:
            last = f"--steps {steps}" + (f", --stop-after {stop_after}" if stop_after is not None else "")
            _say(f"nothing to train: {ckpt_dir} already holds step {done}, the run's last ({last}); raise --steps "
                 "(or --stop-after) to go on")
            if json_out:
                print_json(run | {"trained": False, "latest": done})
            return
        log = None if verbose else _log_file(cfg)
        _announce(config, cfg, layout, log)
        seen = _metrics_size(cfg.metrics_file)
        restarts = _launch(cfg, layout, max_restarts, log)
        facts = _report(cfg, restarts, seen, plot)
        if json_out:
            print_json(run | {"trained": True, "log": log} | facts)
    finally:
        _JSON["on"] = False


def _announce(config: str, cfg: TrainConfig, layout: Layout, log: str | None) -> None:
    _say(f"training {config} under {layout} on {layout.world_size} process(es) via torchrun")
    if log is not None:
        _say(f"worker logs: {log}")
    if cfg.memory_every is not None:
        where = f"{cfg.nodes} simulated node(s)" if cfg.nodes else "one node"
        _say(f"memory tier: every {cfg.memory_every} step(s), {cfg.replicas} peer copy(ies), {where}")


def _train_config(opts: dict[str, Any], layout: Layout) -> TrainConfig:
    """The run's TrainConfig from the command's options; StateError (exit 5) naming the flag when one
    is out of range."""
    from ckpt.cli.reshard import parse_size
    from ckpt.trainer.config import TrainConfig, model_config

    nodes = opts["nodes"]
    if nodes is None and (opts["memory_every"] is not None or opts["fail_node"] is not None) \
            and layout.world_size % 2 == 0:
        nodes = 2  # one host: without simulated nodes every peer copy would sit on the same node
    try:
        cap = parse_size(opts["max_staging"]) if opts["max_staging"] is not None else None
    except CheckpointError as e:
        raise StateError(f"--max-staging-bytes: {e}") from None
    same = ("seq_len", "global_batch", "microbatches", "schedule", "steps", "stop_after", "lr", "seed", "ckpt_dir",
            "save_every", "keep_last", "init_from", "fail_at_step", "fail_rank", "device", "fail_node",
            "memory_every", "replicas", "memory_keep", "memory_busy", "memory_stage_on_device", "memory_max_gbps",
            "memory_max_overhead",
            "shm_dir", "run_id", "moe_dispatch", "moe_sequence_shard")
    try:
        return TrainConfig(model=model_config(opts["config"]), async_save=not opts["sync_save"],
                           max_staging_bytes=cap, verify_restore=not opts["no_verify_restore"],
                           metrics_path=opts["metrics"], nodes=nodes, **{k: opts[k] for k in same})
    except ValueError as e:
        raise StateError(_flag_names(str(e))) from None


_FIELD = re.compile(r"(TrainConfig\.)?\b([a-z][a-z0-9_]*)\b(=)?")
_FIELD_FLAGS = {"max_staging_bytes": "--max-staging-bytes", "metrics_path": "--metrics"}  # fields named otherwise


def _flag_names(message: str) -> str:
    """A TrainConfig message in the command's flags: ``TrainConfig.save_every=0`` -> ``--save-every 0``,
    ``fault injection (fail_at_step) needs a ckpt_dir`` -> ``(--fail-at-step) needs a --ckpt-dir``, and in a
    ``TrainConfig: lr must be > 0`` message every field with a flag (``--lr must be > 0``)."""
    from ckpt.cli.common import _flags

    flags = {name: spellings[0] for name, spellings in _flags(inspect.signature(train_cmd)).items() if spellings}
    flags.update(_FIELD_FLAGS)
    whole = message.startswith("TrainConfig: ")
    if whole:
        message = message[len("TrainConfig: "):]

    def sub(m: re.Match[str]) -> str:
        prefixed, name, eq = m.group(1), m.group(2), m.group(3)
        if name in flags and (prefixed or whole or "_" in name):
            return flags[name] + (" " if eq else "")
        return m.group(0)

    return _FIELD.sub(sub, message)


def _check_faults(cfg: TrainConfig, layout: Layout) -> None:
    """The fault-injection flags against the layout (LayoutError / StateError, exit 5)."""
    if cfg.fail_at_step is not None and cfg.fail_rank >= layout.world_size:
        raise LayoutError(f"--fail-rank {cfg.fail_rank} is outside the {layout.world_size} ranks")
    if cfg.fail_node is not None and cfg.nodes is None:
        raise StateError(f"--fail-node needs --nodes N dividing the {layout.world_size} ranks (the simulated "
                         "nodes on this host)")


def _preflight(cfg: TrainConfig, layout: Layout) -> None:
    """What can be checked before any rank starts: the layout against the model, and --init-from's
    weights against the model's; typed errors, so the exit code is the table's."""
    from ckpt.trainer.launch import check_init_from

    cfg.check_layout(layout)
    if cfg.init_from:
        try:
            check_init_from(cfg.init_from, cfg.model)
        except CheckpointError as e:
            raise type(e)(f"--init-from {e}") from None


def _finished_step(cfg: TrainConfig) -> int | None:
    """The newest committed step under ``--ckpt-dir`` when it already reaches the run's last step (there
    is nothing to train), else None."""
    if not cfg.ckpt_dir or not os.path.isdir(cfg.ckpt_dir):
        return None
    from ckpt.manager import list_checkpoints

    steps = [c.step for c in list_checkpoints(cfg.ckpt_dir) if c.committed]
    return max(steps) if steps and max(steps) >= cfg.last_step else None


def _log_file(cfg: TrainConfig) -> str:
    """A fresh log file for this run's torchrun and worker output: under ``--ckpt-dir``/logs (else next
    to ``--metrics``, else in a new temporary directory)."""
    base = cfg.ckpt_dir or (os.path.dirname(os.path.abspath(cfg.metrics_path)) if cfg.metrics_path else None)
    folder = os.path.join(base, "logs") if base else tempfile.mkdtemp(prefix="ckpt-train-")
    os.makedirs(folder, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(folder, f"train-{stamp}.log")
    n = 1
    while os.path.exists(path):  # two runs in one second
        n += 1
        path = os.path.join(folder, f"train-{stamp}-{n}.log")
    return path


def _metrics_size(path: str | None) -> int:
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def _launch(cfg: TrainConfig, layout: Layout, max_restarts: int, log: str | None) -> int:
    """Run the job; its restarts. A worker's deterministic error is raised as its own type (the exit
    code of the CLI's table: 5 for a mismatch, 3 for corrupt data ...); lost ranks, after every
    restart failed, as TrainingFailed (exit 1)."""
    from ckpt.trainer.launch import TrainingFailed, launch

    try:
        return launch(cfg, layout, max_restarts=max_restarts, log=log)
    except TrainingFailed as e:
        where = f" (worker logs: {log})" if log and e.final else ""
        if not e.final:
            raise TrainingFailed(f"{e}; gave up after {max_restarts} restart(s)", final=False,
                                 attempts=e.attempts) from None
        cls = getattr(errors, e.cause or "", None)
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            cls = StateError  # a ValueError or TypeError of the config: bad input all the same
        raise cls(f"{e}{where}") from None


def _report(cfg: TrainConfig, restarts: int, seen: int, plot: str | None) -> dict[str, Any]:
    """A few lines on what the run did (from the metrics records it wrote), and where everything is;
    returns the same facts (``--json``)."""
    from ckpt.trainer.demo import summarize_records
    from ckpt.trainer.metrics import plot_loss

    facts: dict[str, Any] = {"restarts": restarts, "latest": None, "metrics": cfg.metrics_file, "plot": None,
                             "summary": []}
    if cfg.metrics_file and os.path.exists(cfg.metrics_file):
        facts["summary"] = summarize_records(_records_since(cfg.metrics_file, seen))
        for line in facts["summary"]:
            _say(f"  {line}")
    if restarts:
        _say(f"finished after {restarts} restart(s)")
    if cfg.ckpt_dir:
        from ckpt.manager import CheckpointManager

        facts["latest"] = CheckpointManager(cfg.ckpt_dir, gc_on_start=False).latest()
        _say(f"checkpoints: {cfg.ckpt_dir} (newest {facts['latest']})")
    if cfg.metrics_file:
        _say(f"metrics: {cfg.metrics_file}")
        if plot:
            png = plot_loss(cfg.metrics_file, plot)
            facts["plot"] = png
            _say(f"plot: {png}" if png else "plot: skipped (pip install ckpt[plot] for matplotlib)")
    return facts


def _records_since(path: str, offset: int) -> list[dict[str, Any]]:
    """The metrics records written after byte ``offset`` (this run's; a torn line is skipped)."""
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


@handle_errors
def demo_cmd(
    out: str = typer.Option("ckpt-demo", "--out", help="directory for checkpoints, metrics and the plot"),
    steps: int = typer.Option(200, "--steps", min=20, help="total training steps"),
    node_loss: bool = typer.Option(False, "--node-loss",
                                   help="lose a whole node instead of one rank; recover from the memory tier"),
    json_out: bool = typer.Option(False, "--json", help="print the run's report (demo.json) on stdout; the "
                                                        "lines shown while it runs go to stderr"),
) -> None:
    """The main job: train tiny on 4 ranks, kill one, resume, continue on 2 ranks under another layout,
    verify, export (when the HF exporter is there), plot."""
    _JSON["on"] = json_out
    try:
        _demo(out, steps, node_loss, json_out)
    finally:
        _JSON["on"] = False


def _demo(out: str, steps: int, node_loss: bool, json_out: bool) -> None:
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
    if json_out:
        print_json(report.to_dict())


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``demo`` to the app."""
    app.command("train")(train_cmd)
    app.command("demo")(demo_cmd)


__all__ = ["train_cmd", "demo_cmd", "register"]
