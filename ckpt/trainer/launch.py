"""Launch a training run through torchrun (``torch.distributed.run``) on this machine.

One process per rank of the layout, a c10d rendezvous on a free loopback port. Restarts are this
launcher's, not torchrun's: each attempt is one torchrun (``--max-restarts 0``) that ends when any
worker dies; the launcher then starts a fresh group, which resumes from the newest committed
checkpoint. Doing the retry loop here lets it tell the two kinds of failure apart: a lost rank
(SIGKILL, a dead peer, an I/O hiccup) is retried, while a deterministic error (a config, layout or
dtype mismatch, a checkpoint that cannot be restored) would fail the same way every time, so a worker
that hits one writes a record into ``CKPT_FATAL_DIR`` and exits with :data:`FINAL_EXIT_CODE`, and the
launcher stops at once with that error instead of retrying it.

What can be checked without ranks is checked before any starts: the layout against the model
(here), and the ``init_from`` checkpoint's weights against the model's (:func:`check_init_from`,
which ``ckpt train`` calls first).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from typing import IO

from ckpt.errors import CheckpointError, MismatchError, NoSuchPathError
from ckpt.layout import Layout
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.hybrid import HybridConfig
from ckpt.trainer.metrics import MetricsLog
from ckpt.trainer.model import ModelConfig

ATTEMPT_ENV = "CKPT_ATTEMPT"  # which attempt a worker belongs to (0 = first start)
FATAL_ENV = "CKPT_FATAL_DIR"  # where a worker records an error that retrying cannot fix
LOWER_RANK_WAIT_S = 5.0  # how long a failing rank waits for lower ranks' records (see record_final_error)
FINAL_EXIT_CODE = 3  # a worker's exit code for such an error (also when run under plain torchrun)


class TrainingFailed(CheckpointError):
    """The training job failed: ``final`` when a worker hit a deterministic error (not retried;
    ``cause`` is its type's name, e.g. ``"MismatchError"``), else after every allowed restart was
    used."""

    def __init__(self, message: str, *, final: bool, attempts: int, cause: str | None = None):
        super().__init__(message)
        self.final = final
        self.attempts = attempts
        self.cause = cause


def check_init_from(url: str, model: ModelConfig | HybridConfig) -> None:
    """Check in this process, before any rank starts, that ``url`` holds every ``model.*`` weight of
    ``model`` in its global shape and a floating dtype: what every rank's ``load_weights`` would
    find, told at once instead of after a torchrun start.

    Raises:
        NoSuchPathError: nothing at a local ``url``.
        ManifestError: no readable checkpoint there.
        MismatchError: a weight missing, of another shape, or stored in a non-floating dtype.
    """
    import torch

    import ckpt
    from ckpt._dtypes import dtype_from_name
    from ckpt.trainer.hybrid import HybridForCausalLM
    from ckpt.trainer.model import MoEForCausalLM

    local = url[len("file://"):] if url.startswith("file://") else None if "://" in url else url
    if local is not None and not os.path.lexists(local):
        raise NoSuchPathError(f"{url}: no such file or directory (nothing to start from; check the path)")
    manifest = ckpt.inspect(url)
    with torch.device("meta"):  # shapes only: no memory, no init
        net = HybridForCausalLM(model) if isinstance(model, HybridConfig) else MoEForCausalLM(model)
    wanted = {f"model.{n}": tuple(p.shape) for n, p in net.named_parameters()}
    missing = [k for k in wanted if k not in manifest.tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise MismatchError(f"{url}: missing tensors {missing[:5]}{more}; is it a checkpoint of this model "
                            f"config ({len(wanted)} model.* weights)?")
    for key, shape in wanted.items():
        entry = manifest.tensors[key]
        if tuple(entry.shape) != shape:
            raise MismatchError(f"{url}: {key} has shape {tuple(entry.shape)}, this model config's is {shape}; "
                                "start from a checkpoint of the same model config")
        if not dtype_from_name(entry.dtype, key=key).is_floating_point:
            raise MismatchError(f"{url}: {key} is stored as {entry.dtype}; only floating-point weights can "
                                "start a run")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry_script() -> str:
    # found, not imported: the script imports the worker, which imports this module
    spec = importlib.util.find_spec("ckpt.trainer.entry.worker_main")
    if spec is None or spec.origin is None:
        raise CheckpointError("ckpt.trainer.entry.worker_main is missing from the installation; reinstall ckpt")
    return os.path.abspath(spec.origin)


def torchrun_args(cfg: TrainConfig, layout: Layout, *, max_restarts: int = 0) -> list[str]:
    """The torchrun command line (after ``python -m torch.distributed.run``) for one attempt."""
    return [
        "--nnodes", "1",
        "--nproc-per-node", str(layout.world_size),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-id", f"ckpt-{uuid.uuid4().hex[:8]}",
        "--local-addr", "127.0.0.1",
        "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.2",
        # by path, not ``-m``: ``-m`` puts the working directory first on the workers' sys.path, and
        # a folder named ``ckpt`` there would be imported instead of the installed package
        _entry_script(),
        "--config-json", json.dumps(cfg.to_dict()),
        "--layout", str(layout),
    ]


def torchrun_command(cfg: TrainConfig, layout: Layout, *, max_restarts: int = 0) -> list[str]:
    """The full argv (this interpreter running torchrun), e.g. for ``subprocess.run``."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg, layout, max_restarts=max_restarts)]


def final_errors(fatal_dir: str) -> list[dict[str, object]]:
    """The deterministic-error records workers wrote (``rank``, ``type``, ``message``), by rank."""
    records = []
    for name in sorted(os.listdir(fatal_dir)):
        try:
            with open(os.path.join(fatal_dir, name)) as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            continue  # a worker killed while writing its record: the others still say what happened
    return sorted(records, key=lambda r: int(r.get("rank", 0)))  # type: ignore[call-overload]


def record_final_error(rank: int, error: BaseException) -> None:
    """Called by a worker that hit a deterministic error: leave a record for the launcher."""
    fatal_dir = os.environ.get(FATAL_ENV)
    if not fatal_dir:
        return
    tmp = os.path.join(fatal_dir, f".rank-{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "type": type(error).__name__, "message": str(error)}, f)
    os.replace(tmp, os.path.join(fatal_dir, f"rank-{rank}.json"))
    # The launcher names the lowest rank's error. A rank that exits first makes torchrun kill the
    # others, possibly before rank 0 (hitting the same error a moment later) has written its record:
    # wait briefly for the lower ranks' records so the report does not depend on who was fastest.
    deadline = time.monotonic() + LOWER_RANK_WAIT_S
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(fatal_dir, f"rank-{r}.json")) for r in range(rank)):
            return
        time.sleep(0.02)


def launch(cfg: TrainConfig, layout: Layout, *, max_restarts: int = 3, log: str | None = None) -> int:
    """Run the job under torchrun until it ends; returns how many restarts it took.

    ``log``: append the workers' and torchrun's output to this file instead of this process's
    stdout/stderr (the demo keeps its console to the story this way).

    Raises:
        LayoutError: before starting anything, when the layout cannot run the config.
        TrainingFailed: ``final=True`` at the first deterministic error (named with its rank), or
            after ``max_restarts`` restarts all failed.
    """
    cfg.check_layout(layout)
    fatal_dir = tempfile.mkdtemp(prefix="ckpt-fatal-")
    try:
        with ExitStack() as stack:
            out: IO[str] | None = stack.enter_context(open(log, "a")) if log else None
            rc = 0
            for attempt in range(max_restarts + 1):
                env = {**os.environ, ATTEMPT_ENV: str(attempt), FATAL_ENV: fatal_dir}
                cmd = torchrun_command(cfg, layout)
                if out is not None:
                    out.write(f"==== attempt {attempt}: {' '.join(cmd)}\n")
                    out.flush()
                rc = subprocess.run(cmd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT if out is not None else None, check=False).returncode
                # when the failure was seen (the "recovery" record's detect / restart split)
                MetricsLog(cfg.metrics_file).write({"event": "attempt_end", "attempt": attempt, "rc": rc})
                if rc == 0:
                    return attempt
                records = final_errors(fatal_dir)
                if records:
                    first = records[0]
                    raise TrainingFailed(
                        f"rank {first['rank']}: {first['type']}: {first['message']} (a deterministic error: "
                        f"not retried)", final=True, attempts=attempt + 1, cause=str(first["type"]))
            where = f"; see {log}" if log else "; see the worker tracebacks above"
            raise TrainingFailed(f"training failed {max_restarts + 1} time(s) (last exit code {rc}){where}",
                                 final=False, attempts=max_restarts + 1)
    finally:
        shutil.rmtree(fatal_dir, ignore_errors=True)


__all__ = ["ATTEMPT_ENV", "FATAL_ENV", "LOWER_RANK_WAIT_S", "FINAL_EXIT_CODE", "TrainingFailed", "check_init_from",
           "free_port", "torchrun_args", "torchrun_command", "final_errors", "record_final_error", "launch"]
