"""``python -m bench <subcommand>``: run one benchmark and print its table.

Subcommands::

    save-load   ckpt.save/ckpt.load vs torch DCP, torch.save and safetensors (single process)
    hf-export   ckpt export-hf (streaming) vs load-everything + save_file / save_pretrained
    hf-llama    a Llama: ckpt import-hf / export-hf vs transformers from_pretrained + save_pretrained
    lasp        LASP-2 on 2 and 4 gloo ranks: AllGather bytes per linear-attention layer vs a ring, and time
    multirank   4 forked gloo ranks: save as Shard(0), resharded load as Shard(1), vs DCP
    fsdp-tp     4 forked gloo ranks: FSDP2 x TP model + AdamW saved, loaded FSDP-only, vs DCP
    dcp-source  a DCP checkpoint (saved on 4 ranks) loaded resharded on 3 by dcp.load and by ckpt.load
    deepspeed   DeepSpeed ZeRO -> fp32: zero_to_fp32 vs ckpt import, time and peak RSS (needs deepspeed)
    async       async save: blocking, staged, done times and memory vs DCP async_save and others
    s3          S3 (moto on loopback): save, load, quarter loads and bytes requested vs DCP's fsspec reader/writer
    reshard     ckpt reshard between layouts: throughput vs dd, peak RSS vs budget, vs DCP load + save
    crash       SIGKILL during saves (500 random + targeted kills), audit every checkpoint left behind
    fuzz        long fuzzing of the manifest/header/object parsers and verify; single-fault corruption census
    hashcost    save time with and without CRC-32 checksumming
    memory-tier memory tier: restore vs persistent (vs H2D/memcpy), recovery with/without, peer fetch, stall
    gpu-io      loads into GPU tensors (warm, cold) and synchronous GPU saves vs DCP and safetensors
    scale       simulated planning for a DeepSeek-V3-sized MoE on 16,384 ranks, ckpt vs DCP
    scaling     real forked gloo ranks (8..64): save, async save, resharded load vs DCP; coordinator bytes
    sp          sequence parallelism (sp=1,2,4 gloo ranks): activation memory, step time, LASP-2H vs ring bytes
    compression ckpt zstd (with / without byte planes) vs uncompressed and vs DCP _extensions=[ZStandard()]
    bytecheckpoint  ByteCheckpoint 0.0.2 vs ckpt vs DCP: 2 torchrun ranks, FSDP2 + AdamW on CPU (optional dep)
    xmoe        trainer MoE all-to-all bytes per step: X-MoE dedup dispatch vs per-expert (forked gloo ranks)
    trainer-gpu the trainer on N GPUs (NCCL) or CPU ranks: sp=1/2/4 and ep=4 (dedup / per-expert): tokens/s,
                all-to-all bytes and time, peak memory vs sequence length, kill + resume bitwise (issue 20.3)
    transfer    ckpt.transfer between running CPU ranks (same and disjoint ranks) vs save+load and gather+broadcast
    transfer-moe  ckpt.transfer of a MoE model, tp=2,ep=2 -> tp=4 and to a disjoint group, vs save+load and send/recv
    transfer-delta  delta refits (transfer and transfer_iter) with a few tensors changed vs sending everything,
                and what the digests cost
    memtier-gpu the memory tier on N GPUs as 2 simulated nodes: --memory-every 1 slowdown at >= 8 GB per GPU,
                node loss recovered from peer copies vs from storage, against H2D bandwidth (issue 20.2)
    tier-reshard  the memory tier restored under another layout across 2 simulated hosts: only the wanted
                shards crossing (ckpt.transfer) vs whole copies vs storage, vs raw gloo
"""

from __future__ import annotations

import argparse
import sys

import bench.bytecheckpoint_bench as bytecheckpoint_bench
from bench import (
    async_bench,
    compression,
    crash,
    dcp_source,
    deepspeed_convert,
    fsdp_tp,
    fuzz,
    gpu_io,
    hashcost,
    hf_export,
    hf_llama,
    lasp_bench,
    memory_tier,
    memtier_gpu,
    multirank,
    reshard,
    s3_bench,
    save_load,
    scale,
    scaling,
    seqpar,
    tier_reshard,
    trainer_gpu,
    transfer,
    transfer_delta,
    transfer_moe,
    xmoe,
)

COMMANDS = {
    "save-load": (save_load, "save/load throughput vs DCP, torch.save, safetensors and dd"),
    "hf-export": (hf_export, "Hugging Face export time and peak RSS vs the naive load-then-save paths"),
    "hf-llama": (hf_llama, "a Llama (adapter family): ckpt import-hf/export-hf vs from_pretrained + save_pretrained"),
    "lasp": (lasp_bench, "LASP-2 (one AllGather of memory states) vs a LASP-1 ring: bytes per layer and time"),
    "multirank": (multirank, "4 gloo ranks: DTensor Shard(0) save, Shard(1) load vs DCP"),
    "fsdp-tp": (fsdp_tp, "4 gloo ranks: FSDP2 x TP state saved, loaded as FSDP-only, vs DCP; bytes on disk"),
    "dcp-source": (dcp_source, "a DCP checkpoint saved on 4 ranks, loaded resharded on 3: dcp.load vs ckpt.load"),
    "deepspeed": (deepspeed_convert, "DeepSpeed ZeRO -> fp32: zero_to_fp32 vs ckpt import, time and peak RSS"),
    "async": (async_bench, "async save: blocking/staged/done vs DCP async_save, torch.save, safetensors"),
    "s3": (s3_bench, "S3 on a loopback moto server: save/load/quarter loads, bytes requested vs DCP fsspec"),
    "reshard": (reshard, "offline reshard (ckpt reshard) throughput and peak RSS vs dd and DCP load+save"),
    "crash": (crash, "SIGKILL during saves; every manifest verifies, latest() loads"),
    "fuzz": (fuzz, "fuzz the parsers of untrusted bytes (100k inputs) and census single-fault corruptions"),
    "hashcost": (hashcost, "save time with and without CRC-32 checksums"),
    "memory-tier": (memory_tier, "memory tier: restore vs persistent and H2D/memcpy, recovery with and without "
                                 "the tier, peer fetch vs raw gloo, step slowdown"),
    "gpu-io": (gpu_io, "GPU restores (warm/cold) and sync GPU saves vs dcp and safetensors, vs H2D/disk/dd"),
    "scale": (scale, "simulated DeepSeek-V3 planning at 16,384 ranks: ckpt vs DCP's planner, no tensors"),
    "scaling": (scaling, "8..64 forked gloo ranks: save/async/resharded load vs DCP, coordinator bytes and growth"),
    "sp": (seqpar, "sequence parallelism: per-rank activations and step time vs seq len for sp=1,2,4; LASP-2H bytes"),
    "xmoe": (xmoe, "trainer MoE all-to-all bytes per step, dedup vs per-expert dispatch, ep 2/4, top-k 2/4/8"),
    "trainer-gpu": (trainer_gpu, "trainer on N GPUs/CPU ranks: sp, ep=4 dispatch, longest sequence, kill + resume"),
    "tier-reshard": (tier_reshard, "memory tier restored under another layout across 2 hosts: wanted shards vs "
                                   "whole copies vs storage, vs raw gloo"),
    "memtier-gpu": (memtier_gpu, "memory tier on N GPUs as 2 nodes: --memory-every 1 cost, node loss vs storage"),
    "compression": (compression, "zstd data files (planes or not): bytes on disk, save/load GB/s vs DCP ZStandard"),
    "transfer": (transfer, "live resharding between CPU ranks: ckpt.transfer vs save+load vs gather+broadcast"),
    "transfer-moe": (transfer_moe, "a MoE live: tp=2,ep=2 -> tp=4 and to a disjoint group vs save+load, send/recv"),
    "transfer-delta": (transfer_delta, "delta refits with a few tensors changed vs sending everything; digest cost"),
    "bytecheckpoint": (bytecheckpoint_bench, "ByteCheckpoint vs ckpt vs DCP: FSDP2 + AdamW, 2 torchrun ranks on CPU"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="ckpt benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    module, _ = COMMANDS[args.command]
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
