import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def shm() -> Iterator[str]:
    """A fresh shared-memory base directory (under /dev/shm when there is one), removed afterwards."""
    base = tempfile.mkdtemp(prefix="ckpt-test-tier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield base
    shutil.rmtree(base, ignore_errors=True)
