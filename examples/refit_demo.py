"""RL refit without disk: the trainer's sharded weights streamed into Hugging Face inference models.

Four forked CPU ranks (gloo) train the embedded MoE under ``tp=2, ep=2`` with ZeRO-1. Every
``--every`` steps, ``ckpt.transfer_iter`` moves the trainer's blocks (rows and columns of TP splits,
experts of EP splits) into whole tensors under Hugging Face names on the rollout ranks, stacked
experts joined into transformers' fused ``gate_up_proj`` through the Qwen3-MoE adapter's name map,
at most ``--stream-mb`` of destination tensors at a time; each rollout rank's
``transformers.Qwen3MoeForCausalLM`` takes them through a ``load_weights(stream)``. The rollout's
logits are then checked against the same weights saved by ``ckpt.save`` and loaded whole (the check
alone uses disk).

    python examples/refit_demo.py [--steps 6] [--every 2] [--rollout 0,2] [--stream-mb 0.25]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckpt
from ckpt.hf.adapters import Qwen3Moe
from ckpt.layout import Layout
from ckpt.trainer.checkpoint import load_full_model, model_state
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource, rank_batch
from ckpt.trainer.model_config import hf_config
from ckpt.trainer.pp import ForwardBackward
from ckpt.trainer.train import build
from ckpt.transfer_stream import transfer_iter

LAYOUT = Layout(tp=2, ep=2, zero=1)
TOLERANCE = 1e-4  # two implementations of the same fp32 model: summation order differs


def load_weights(model: torch.nn.Module, stream: Iterable[tuple[str, torch.Tensor]]) -> int:
    """What an inference engine's ``load_weights`` does: copy each named tensor as it arrives."""
    params = model.state_dict()
    n = 0
    for name, tensor in stream:
        params[name].copy_(tensor)
        n += 1
    return n


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import transformers

    cfg = TrainConfig(steps=args.steps, device="cpu")
    ctx, pm, opt, schedule = build(cfg, LAYOUT, torch.device("cpu"))
    rollout = rank in args.rollout
    hf_cfg = hf_config(cfg.model)
    engine = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf_cfg)).eval() if rollout else None
    want = list(engine.state_dict()) if engine is not None else None
    adapter = Qwen3Moe()
    names = adapter.hf_map(adapter.complete(dict(hf_cfg), where="refit demo"), present=set(want or []))
    source, fb = SampleSource(cfg.seq_len, cfg.seed), ForwardBackward(pm, cfg.microbatches, cfg.schedule)
    probe = SampleSource(32, seed=12345).batch(0, 2)
    sample = 0
    versions = ckpt.TransferState()  # this rank's refit count: version 1, 2, ...
    for step in range(1, args.steps + 1):
        fb(rank_batch(source, sample, cfg.global_batch, ctx.data_rank, ctx.data_world))
        opt.step(schedule.lr(step - 1))
        sample += cfg.global_batch
        if step % args.every:
            continue
        stream = transfer_iter(model_state(pm), want, names=names, stream_bytes=int(args.stream_mb * 2**20),
                               checksum=True, timeout=120, state=versions)
        got = load_weights(engine, stream) if engine is not None else load_weights(torch.nn.Module(), stream)
        url = os.path.join(root, f"step-{step}")  # the reference for the check
        ckpt.save({"model": model_state(pm)}, url)
        reference = load_full_model(url, cfg.model)  # collective: every rank reads the manifest
        if engine is not None:
            with torch.no_grad():
                diff = (engine(probe).logits - reference(probe)).abs().max().item()
            s = stream.stats
            print(f"step {step} rank {rank}: refit version {s.version}: {got} tensors in {s.waves} waves "
                  f"(largest {s.peak_wave_bytes / 2**20:.2f} MiB), {s.rank_received / 2**20:.2f} MiB received, "
                  f"{s.seconds * 1e3:.0f} ms; max |logits - reference| {diff:.2e}", flush=True)
            if not diff <= TOLERANCE:
                raise SystemExit(f"rank {rank}: logits differ by {diff} after the refit of step {step}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--rollout", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2])
    p.add_argument("--stream-mb", type=float, default=0.25)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="ckpt-refit-") as root:
        mp.start_processes(_rank, args=(LAYOUT.world_size, port, args, root), nprocs=LAYOUT.world_size,
                           start_method="fork")
    print("refit demo: every rollout matched the trainer's weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
