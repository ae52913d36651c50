"""Launch a training run through torchrun (``torch.distributed.run``) on this machine.

One process per rank of the layout, a c10d rendezvous on a free loopback port, elastic restarts: when
a worker dies (e.g. SIGKILLed by fault injection), torchrun stops the others and starts the whole
group again, and every rank resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid

from ckpt.resharders.layout import Layout
from ckpt.trainer.config import TrainConfig


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry_script() -> str:
    from ckpt.trainer.entry import worker_main

    return os.path.abspath(worker_main.__file__)


def torchrun_args(cfg: TrainConfig, layout: Layout, *, max_restarts: int = 3) -> list[str]:
    """The torchrun command line (after ``python -m torch.distributed.run``) for this run."""
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


def torchrun_command(cfg: TrainConfig, layout: Layout, *, max_restarts: int = 3) -> list[str]:
    """The full argv (this interpreter running torchrun), e.g. for ``subprocess.run``."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg, layout, max_restarts=max_restarts)]


def launch(cfg: TrainConfig, layout: Layout, *, max_restarts: int = 3) -> None:
    """Run the job under torchrun in this process (the elastic agent) until it ends.

    Raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` when workers fail
    more than ``max_restarts`` times; LayoutError before starting anything when the layout cannot
    run the config.
    """
    cfg.check_layout(layout)
    from torch.distributed.run import get_args_parser, run

    run(get_args_parser().parse_args(torchrun_args(cfg, layout, max_restarts=max_restarts)))
