"""ckpt: parallelism-agnostic checkpoints for large-model training in PyTorch.

Four verbs::

    ckpt.save(state, url)          # collective when torch.distributed is initialized
    ckpt.load(state, url)          # fills tensors in place, resharding from any stored layout
    ckpt.inspect(url)              # the manifest
    ckpt.verify(url, deep=True)    # structure, coverage, checksums
"""

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
from ckpt.transfer_stream import transfer_iter
from ckpt.verify import Problem, VerifyReport, inspect, verify

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CheckpointExistsError", "CollectiveError", "FormatVersionError", "IntegrityError",
    "LayoutError", "ManifestError", "ManifestIntegrityError", "MismatchError", "StateError", "StorageError",
    "Shard", "FlatShard", "PerRank", "Manifest", "VerifyReport", "Problem",
    "save", "load", "inspect", "verify", "async_save", "SaveHandle", "CheckpointManager",
    "transfer", "TransferResult", "TransferState", "transfer_iter",
]
