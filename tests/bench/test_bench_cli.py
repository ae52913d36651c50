"""The benchmark CLI itself (no benchmark runs here): building its parsers must not touch CUDA, or
every forked-rank bench fails on a GPU machine ("Cannot re-initialize CUDA in forked subprocess")."""

from __future__ import annotations

import pytest
import torch


def test_building_the_bench_parsers_never_asks_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object, **_k: object) -> object:
        raise AssertionError("CUDA was queried while building the bench parsers")

    for name in ("is_available", "device_count", "init", "current_device", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    import bench.__main__ as bench_main

    with pytest.raises(SystemExit) as done:
        bench_main.main(["--help"])
    assert done.value.code == 0
    with pytest.raises(SystemExit) as done:
        bench_main.main(["async", "--help"])
    assert done.value.code == 0
