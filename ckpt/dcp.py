"""A one-line switch from ``torch.distributed.checkpoint``: ``import ckpt.dcp as dcp``.

The calls users make, with DCP's signatures, backed by ckpt's format, planner and transaction::

    import ckpt.dcp as dcp                      # was: import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, checkpoint_id=path)
    dcp.load(state_dict, checkpoint_id=path)    # in place, resharding from any saved layout
    fut = dcp.async_save(state_dict, checkpoint_id=path); fut.result()

What differs from DCP: the checkpoint is a ckpt checkpoint (safetensors data files + a msgpack
manifest, never pickle); saving over an existing checkpoint replaces it (as DCP does) through ckpt's
atomic commit; ``load`` raises ``MismatchError`` naming a requested key the checkpoint lacks (DCP
raises too). Stateful values (``state_dict()`` / ``load_state_dict()``) are saved and restored as
DCP does; rank-specific keys (torchtitan's ``dataloader.dp_rank_<r>``) are saved as the union of
all ranks' keys. ``ShardedTensor`` values (FSDP1 ``SHARDED_STATE_DICT``) save and load as pieces of
their global tensor. Loading assigns every loaded top-level key (``state_dict[key] = value``) as
DCP does, after filling tensors in place.

DCP's objects: its ``FileSystemWriter`` / ``FileSystemReader`` / ``FsspecWriter`` / ``FsspecReader``
give the location (and ``overwrite``), its ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` are the
default behaviour (``allow_partial_load`` honoured); custom planners or storage classes and
stagers are refused with ``UnsupportedDCPObjectError``; ``_extensions=[ZStandard()]`` saves with
ckpt's own zstd compression, other ``_extensions`` are refused (see :mod:`ckpt._dcp_compat`). The
legacy ``save_state_dict`` / ``load_state_dict`` are here, and DCP's
other public names (``Metadata``, ``FileSystemWriter``, ``DefaultSavePlanner``, its submodules, ...)
are re-exported from ``torch.distributed.checkpoint`` so ``from ckpt.dcp import X`` works as before.

Objects come back of the same type and value as DCP gives them (``torch.dtype``, ``torch.Size``,
``torch.device``, tuples, complex, big ints, numpy values, datetimes, ...), or are refused with a
``StateError`` naming the key: :mod:`ckpt.formats.objects` holds the one table of what is stored
how (every ckpt load decodes through it; checkpoints DCP wrote are read through it too).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from ckpt._dcp_compat import (
    Target,
    UnsupportedCompressionError,
    UnsupportedDCPObjectError,
    assign_loaded,
    load_target,
    save_target,
)
from ckpt._state import ObjectItem, flatten_state, rebuild_state
from ckpt.async_save import SaveHandle
from ckpt.async_save import async_save as _async_save
from ckpt.formats.objects import encode_value
from ckpt.load import load as _load
from ckpt.manifest import Manifest
from ckpt.save import save as _save
from ckpt.shards import PerRank
from ckpt.stateful import expand


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None, no_dist: bool = False,
         use_collectives: bool = True) -> Manifest:
    """``dcp.save``: save ``state_dict`` to ``checkpoint_id`` (collective over ``process_group``).

    Returns the manifest (DCP returns its ``Metadata``). ``no_dist=True`` saves this process's
    state alone (no collective). Raises ckpt's typed errors (``CheckpointError`` subclasses).
    """
    t = save_target(checkpoint_id, storage_writer, planner)
    return _save(_encoded(state_dict), t.url, group=_group(process_group, no_dist), overwrite=t.overwrite,
                 storage_options=t.storage_options, compression=t.compression)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_reader: Any = None, planner: Any = None, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.load``: fill ``state_dict`` in place from ``checkpoint_id``, resharding as needed.

    Tensors, DTensors and ShardedTensors are filled in place, Stateful values get
    ``load_state_dict``, and then every other loaded top-level key is assigned
    (``state_dict[key] = value``) as DCP does. Keys stored but not requested are ignored (as in DCP);
    with ``DefaultLoadPlanner(allow_partial_load=True)`` requested keys the checkpoint lacks are left as they are.
    """
    t = load_target(checkpoint_id, storage_reader, planner)
    _load_into(state_dict, t, process_group, no_dist)


def _load_into(state_dict: dict[str, Any], t: Target, process_group: Any, no_dist: bool) -> None:
    out = _load(state_dict, t.url, group=_group(process_group, no_dist), strict=t.strict,
                storage_options=t.storage_options)  # expands Stateful values and restores them
    assign_loaded(state_dict, out)


class _Future(Future):  # type: ignore[type-arg]
    """DCP's ``async_save`` future (``result()``, ``done()``), backed by a ckpt save handle."""

    def __init__(self, handle: SaveHandle):
        super().__init__()
        self.handle = handle

    def done(self) -> bool:
        return self.handle.is_done

    def result(self, timeout: float | None = None) -> Manifest | None:
        return self.handle.done(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.handle.done(timeout)
        except TimeoutError:
            raise
        except BaseException as e:  # noqa: BLE001 - the save's error is the answer
            return e
        return None


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None,
               async_checkpointer_type: Any = None, async_stager: Any = None, no_dist: bool = False,
               use_collectives: bool = True) -> Future:  # type: ignore[type-arg]
    """``dcp.async_save``: returns a future whose ``result()`` is the committed manifest.

    Like DCP's thread mode, it returns once the state is staged (copied out), so the caller may
    change its tensors right away; writing and the commit run in the background. (``ckpt.async_save``
    returns earlier, after planning, and leaves ``h.staged()`` to the caller.)
    """
    t = save_target(checkpoint_id, storage_writer, planner, async_stager)
    h = _async_save(_encoded(state_dict), t.url, group=_group(process_group, no_dist), overwrite=t.overwrite,
                    storage_options=t.storage_options, compression=t.compression)
    h.staged()
    return _Future(h)


def _encoded(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (Stateful values expanded) with every object leaf in its stored form
    (:func:`~ckpt.formats.objects.encode_value`): what DCP would torch.save and give back as is,
    ckpt stores exactly or refuses here, before anything is written (StateError naming the key)."""
    state = expand(state_dict)
    values: dict[str, Any] = {}
    for it in flatten_state(state):
        if isinstance(it, ObjectItem):
            stored = encode_value(it.value, key=it.key)
            values[it.key] = PerRank(stored) if it.per_rank else stored
    return rebuild_state(state, values) if values else state


def _group(process_group: Any, no_dist: bool) -> Any:
    if not no_dist:
        return process_group
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # a group of this process alone, made by it alone (ckpt._comm.side_group; new_group would need
        # every rank to call it): no collective, as DCP's no_dist promises
        from ckpt._comm import side_group

        return side_group([dist.get_rank()], "dcp-no-dist")
    return None


def save_state_dict(state_dict: dict[str, Any], storage_writer: Any, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: Any = None) -> Manifest:
    """DCP's legacy ``save_state_dict``: :func:`save` with the location taken from ``storage_writer``.

    ``coordinator_rank`` is accepted for compatibility; ckpt's coordinator is the group's rank 0.
    """
    return save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                no_dist=no_dist)


def load_state_dict(state_dict: dict[str, Any], storage_reader: Any, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: Any = None) -> None:
    """DCP's legacy ``load_state_dict``: :func:`load` with the location taken from ``storage_reader``.

    ``coordinator_rank`` is accepted for compatibility; ckpt's coordinator is the group's rank 0.
    """
    t = load_target(None, storage_reader, planner)
    _load_into(state_dict, t, process_group, no_dist)


def load_sharded_optimizer_state_dict(model_state_dict: dict[str, Any], optimizer_key: str, storage_reader: Any,
                                      planner: Any = None) -> dict[str, Any]:
    """Not available through ``ckpt.dcp``: DCP builds the optimizer state from its own metadata."""
    raise UnsupportedDCPObjectError(
        "ckpt.dcp: load_sharded_optimizer_state_dict is not supported (it builds FSDP1 optimizer state from DCP's "
        "metadata); load the optimizer state with dcp.load into FSDP.optim_state_dict(model, optim) (or "
        "torch.distributed.checkpoint.state_dict.get_state_dict) and apply it with FSDP.optim_state_dict_to_load")


# DCP's other public names, forwarded from torch.distributed.checkpoint on first use (importing it
# costs time): types (Metadata, WriteItem, ...), its writer/reader/planner classes (ckpt.dcp accepts
# instances of the default ones), its submodules. None of them saves or loads through DCP by itself.
_FORWARDED = frozenset({
    "BytesStorageMetadata", "CheckpointException", "ChunkStorageMetadata", "DefaultLoadPlanner", "DefaultSavePlanner",
    "FileSystemReader", "FileSystemWriter", "HuggingFaceStorageReader", "HuggingFaceStorageWriter", "LoadPlan",
    "LoadPlanner", "Metadata", "QuantizedHuggingFaceStorageReader", "ReadItem", "SavePlan", "SavePlanner",
    "StorageReader", "StorageWriter", "TensorStorageMetadata", "WriteItem", "api", "default_planner", "filesystem",
    "hf_storage", "logger", "logging_handlers", "metadata", "optimizer", "planner", "planner_helpers",
    "quantized_hf_storage", "resharding", "staging", "state_dict_loader", "state_dict_saver", "stateful",
    "storage", "utils"})


def __getattr__(name: str) -> Any:
    # any other public name of torch.distributed.checkpoint too (the package has no __all__; its
    # submodules appear as attributes once imported, e.g. ``state_dict``)
    if not name.startswith("_"):
        import torch.distributed.checkpoint as tdcp

        if hasattr(tdcp, name):
            value = getattr(tdcp, name)
            globals()[name] = value  # once
            return value
    raise AttributeError(f"module 'ckpt.dcp' has no attribute {name!r}")


__all__ = ["save", "load", "async_save", "save_state_dict", "load_state_dict", "load_sharded_optimizer_state_dict",
           "UnsupportedDCPObjectError", "UnsupportedCompressionError", *sorted(_FORWARDED)]
