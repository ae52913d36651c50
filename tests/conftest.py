"""Suite-wide set-up: a fixed seed, and the ``gpu`` marker's skip where there is no CUDA device.

Markers (registered in pyproject.toml): ``slow`` (over ~5 s on a 2-core machine), ``multiproc``
(forks ranks or runs subprocesses), ``gpu`` (needs CUDA). The fast tier is
``scripts/test.sh -m "not slow and not multiproc"``; CI runs everything. Nothing here calls CUDA
(GPUs are counted by ``nvidia-smi``): once pytest's process has used CUDA, no CUDA rank forked from
it can start, so on GPU machines ``-m gpu`` runs in a process of its own.
"""

from __future__ import annotations

import pytest
import torch

from ckpt.testing.ranks import gpu_count

torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu`` test without CUDA (one place, instead of a skipif on each). GPUs are counted
    without CUDA (``torch.cuda.is_available()`` here would break every CUDA rank a test forks)."""
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
