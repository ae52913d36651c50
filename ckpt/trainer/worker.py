"""One torchrun worker: ``python -m ckpt.trainer.worker --config-json JSON --layout TEXT``.

torchrun sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``TORCHELASTIC_RESTART_COUNT``; the worker joins
the group (gloo on CPU, NCCL on CUDA), trains, and leaves. After a restart it simply starts again:
:func:`ckpt.trainer.train.train` resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from ckpt.resharders.layout import Layout
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.parallel import init_distributed
from ckpt.trainer.train import train


def main(argv: list[str] | None = None) -> None:
    """Parse the worker's arguments, join the process group, train."""
    parser = argparse.ArgumentParser(prog="python -m ckpt.trainer.worker")
    parser.add_argument("--config-json", required=True, help="TrainConfig.to_dict() as JSON")
    parser.add_argument("--layout", required=True, help='e.g. "tp=2,ep=2,zero=1"')
    args = parser.parse_args(argv)
    cfg = TrainConfig.from_dict(json.loads(args.config_json))
    layout = Layout.parse(args.layout)
    device = init_distributed(cfg.device)
    try:
        train(cfg, layout, device=device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
