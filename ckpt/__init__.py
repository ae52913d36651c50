"""ckpt: parallelism-agnostic checkpoints for large-model training in PyTorch.

Four verbs::

    ckpt.save(state, url)          # collective when torch.distributed is initialized
    ckpt.load(state, url)          # fills tensors in place, resharding from any stored layout
    ckpt.inspect(url)              # the manifest
    ckpt.verify(url, deep=True)    # structure, coverage, checksums

and the tools around them, imported on first use: ``ckpt.transfer_iter`` (live weights, streamed),
``ckpt.reshard`` / ``ckpt.diff`` (another parallel
layout, offline), ``ckpt.import_checkpoint`` / ``ckpt.export_dcp`` (other tools' checkpoints),
``ckpt.export_hf`` / ``ckpt.import_hf`` (Hugging Face directories).
"""

from typing import Any

from ckpt import _moved
from ckpt.async_save import SaveHandle, async_save
from ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CollectiveError,
    FormatVersionError,
    IntegrityError,
    LayoutError,
    ManifestError,
    ManifestIntegrityError,
    MismatchError,
    StateError,
    StorageError,
)
from ckpt.load import load
from ckpt.manager import CheckpointManager
from ckpt.manifest import Manifest
from ckpt.save import save
from ckpt.shards import FlatShard, PerRank, Shard
from ckpt.transfer import TransferResult, TransferState, transfer
from ckpt.verify import Problem, VerifyReport, inspect, verify

__version__ = "0.1.0"

_moved.install()  # the 0.1 module paths keep working, with a DeprecationWarning

#: public functions whose modules are heavy (transformers, the resharder): imported when first used
_LAZY = {"transfer_iter": "ckpt.transfer_stream", "reshard": "ckpt.resharders.reshard", "diff": "ckpt.resharders.diff",
         "import_checkpoint": "ckpt.convert", "export_dcp": "ckpt.convert",
         "export_hf": "ckpt.hf.convert", "import_hf": "ckpt.hf.convert"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")

__all__ = [
    "CheckpointError", "CheckpointExistsError", "CollectiveError", "FormatVersionError", "IntegrityError",
    "LayoutError", "ManifestError", "ManifestIntegrityError", "MismatchError", "StateError", "StorageError",
    "Shard", "FlatShard", "PerRank", "Manifest", "VerifyReport", "Problem",
    "save", "load", "inspect", "verify", "async_save", "SaveHandle", "CheckpointManager",
    "transfer", "TransferResult", "TransferState", "transfer_iter",
    "reshard", "diff", "import_checkpoint", "export_dcp", "export_hf", "import_hf",
]
