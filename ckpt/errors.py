"""Typed errors. Every error names the tensor, file or rank involved and says what to do."""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error this package raises on purpose."""


class ManifestError(CheckpointError):
    """The manifest is missing, undecodable, or violates the format's schema."""


class FormatVersionError(ManifestError):
    """The checkpoint was written with a format major version this package cannot read."""


class IntegrityError(CheckpointError):
    """Stored bytes do not match their checksum, size, or the manifest's description."""


class ManifestIntegrityError(ManifestError, IntegrityError):
    """The manifest's bytes do not match its own checksum (format 2): it was damaged after the save."""


class LayoutError(CheckpointError):
    """Shards do not describe a valid tiling (overlap, gap, out of bounds) or a layout is invalid."""


class StateError(CheckpointError):
    """The state passed to save/load is malformed (unsupported value, inconsistent shards)."""


class MismatchError(CheckpointError):
    """Requested state does not match the checkpoint (missing/unexpected key, shape, dtype)."""


class CheckpointExistsError(CheckpointError):
    """The target already holds a committed checkpoint and ``overwrite`` was not set."""


class StorageError(CheckpointError):
    """An I/O operation failed; the message names the object and the underlying cause."""


class CollectiveError(CheckpointError):
    """Another rank failed during a collective save/load; the message names that rank."""


class ForeignFormatError(IntegrityError):
    """Bytes another tool wrote (a pickle, DCP / DeepSpeed / Megatron metadata, a torch.save record)
    exceed ckpt's decoding budgets or contradict themselves; the message names the file and field."""


class UnsafePathError(StorageError, OSError):
    """A memory-tier path is a link, not a regular file or directory, owned by another user, or
    writable by group or others (shared memory is writable by every local user); never followed."""


class RunInUseError(CheckpointError):
    """Another job holds this run id's memory tier on this host: one run id, one job at a time."""


class DirectoryInUseError(CheckpointError):
    """Another process is writing this output directory (a Hugging Face export holds its lock): one
    writer at a time; wait for it to finish, or write elsewhere."""


class ConfigError(ManifestError):
    """A JSON file from outside (a Hugging Face config.json or index, a names file) is over budget
    (size, nesting, item count), not valid JSON, or one of its fields has the wrong type or range."""


class NoSuchPathError(ManifestError):
    """A path given to read (a checkpoint, a root, a model directory) does not exist: nothing to read there."""


__all__ = ["CheckpointError", "ManifestError", "FormatVersionError", "IntegrityError", "ManifestIntegrityError",
           "LayoutError", "StateError", "MismatchError", "CheckpointExistsError", "StorageError", "CollectiveError",
           "ForeignFormatError", "UnsafePathError", "RunInUseError", "DirectoryInUseError", "ConfigError",
           "NoSuchPathError"]
