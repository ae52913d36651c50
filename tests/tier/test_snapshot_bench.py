"""``python -m bench memory-tier --only snapshot`` on CPU at a tiny size: its four contenders run in
alternating blocks, every memory checkpoint it takes completes, and the paired ratios are the ones
its blocks give."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import bench.__main__ as bench_main


def test_snapshot_bench_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "snap.json"
    rc = bench_main.main(["memory-tier", "--device", "cpu", "--size-gb", "0.004", "--tensors", "6", "--only",
                          "snapshot", "--repeats", "3", "--step-ms", "5", "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())["snapshot"]
    modes = ["off", "copies", "copies+crc", "on"]
    assert len(got["blocks"]) == 3 and all(sorted(b) == sorted(modes) for b in got["blocks"])
    assert all(len(got["step_s"][m]) == 15 for m in modes)  # 3 blocks of 5 steps each
    for m in modes[1:]:
        ratios = [b[m] / b["off"] for b in got["blocks"]]
        assert got["paired_ratio"][m] == statistics.median(ratios)
    assert len(got["records"]) == 3 and all(r["complete"] for r in got["records"])
    assert len(got["stall_s"]) == 15 and got["bytes"] > 0.004 * 2**30 * 0.9


def test_bf16_state_has_the_mixed_states_bytes_in_bf16_only() -> None:
    import torch

    from bench.memory_tier import _state

    mixed = _state(0.002, 6, "mixed", torch.device("cpu"))
    bf16 = _state(0.002, 6, "bf16", torch.device("cpu"))
    assert {v.dtype for v in mixed.values()} == {torch.float32, torch.bfloat16}
    assert {v.dtype for v in bf16.values()} == {torch.bfloat16} and list(bf16) == list(mixed)
    def sizes(state: dict[str, torch.Tensor]) -> list[int]:
        return [v.numel() * v.element_size() for v in state.values()]

    assert sizes(bf16) == sizes(mixed)
