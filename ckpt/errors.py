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
