"""One torchrun worker: ``python -m ckpt.trainer.worker --config-json JSON --layout TEXT``.

torchrun sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; :func:`ckpt.trainer.launch.launch` adds
``CKPT_ATTEMPT`` (which start of the group this is) and ``CKPT_FATAL_DIR``. The worker joins the
group (gloo on CPU, NCCL on CUDA), trains, and leaves. After a restart it simply starts again:
:func:`ckpt.trainer.train.train` resumes from the newest committed checkpoint.

A deterministic error (config, layout, dtype or shape mismatch, a checkpoint that cannot be
restored) is recorded for the launcher and ends the worker with ``FINAL_EXIT_CODE`` so that the
job stops instead of failing the same way on every restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch.distributed as dist

from ckpt.errors import IntegrityError, LayoutError, ManifestError, MismatchError, StateError
from ckpt.layout import Layout
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.launch import FINAL_EXIT_CODE, record_final_error
from ckpt.trainer.parallel import init_distributed
from ckpt.trainer.train import train

# Errors that a restart would meet again: the same config against the same checkpoints. Lost peers
# (CollectiveError, gloo's RuntimeError), storage hiccups (StorageError) and kills are retried.
DETERMINISTIC = (LayoutError, MismatchError, ManifestError, StateError, IntegrityError, ValueError, TypeError)


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
    except DETERMINISTIC as e:
        rank = int(os.environ.get("RANK", "0"))
        record_final_error(rank, e)
        traceback.print_exc()
        print(f"rank {rank}: {type(e).__name__}: {e} (deterministic: exiting with code {FINAL_EXIT_CODE}, "
              "not to be retried)", file=sys.stderr, flush=True)
        os._exit(FINAL_EXIT_CODE)  # no destroy_process_group: peers may be blocked in a collective
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()


__all__ = ["DETERMINISTIC", "main"]
