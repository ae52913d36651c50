"""A one-line switch from ``torch.distributed.checkpoint``: ``import ckpt.dcp as dcp``.

The calls users make, with DCP's signatures, backed by ckpt's format, planner and transaction::

    import ckpt.dcp as dcp                      # was: import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, checkpoint_id=path)
    dcp.load(state_dict, checkpoint_id=path)    # in place, resharding from any saved layout
    fut = dcp.async_save(state_dict, checkpoint_id=path); fut.result()

What differs from DCP: the checkpoint is a ckpt checkpoint (safetensors data files + a msgpack
manifest, never pickle); ``storage_writer`` / ``storage_reader`` / ``planner`` objects of DCP are
refused (pass a URL or path as ``checkpoint_id``; S3 and fsspec URLs work); saving over an existing
checkpoint replaces it (as DCP does) through ckpt's atomic commit; ``load`` raises
``MismatchError`` naming a requested key the checkpoint lacks (DCP raises too). Stateful values
(``state_dict()`` / ``load_state_dict()``) are saved and restored as DCP does; rank-specific keys
(torchtitan's ``dataloader.dp_rank_<r>``) are saved as the union of all ranks' keys.

Objects come back of the same type and value as DCP gives them (``torch.dtype``, ``torch.Size``,
``torch.device``, tuples, complex, big ints, numpy values, datetimes, ...), or are refused with a
``StateError`` naming the key: :mod:`ckpt.formats.objects` holds the one table of what is stored
how (every ckpt load decodes through it; checkpoints DCP wrote are read through it too).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from ckpt.async_save import SaveHandle
from ckpt.async_save import async_save as _async_save
from ckpt.errors import StateError
from ckpt.formats.objects import encode_value
from ckpt.load import load as _load
from ckpt.manifest import Manifest
from ckpt.save import save as _save
from ckpt.shards import PerRank
from ckpt.state import ObjectItem, flatten_state, rebuild_state
from ckpt.stateful import expand, update_in_place


def _url(checkpoint_id: str | os.PathLike[str] | None, **unsupported: Any) -> str:
    for name, value in unsupported.items():
        if value is not None and value is not False:
            raise StateError(f"ckpt.dcp: {name}={type(value).__name__} is a torch.distributed.checkpoint object ckpt "
                             "does not use; pass the location as checkpoint_id=<path or URL> instead "
                             "(storage options: call ckpt.save/ckpt.load directly)")
    if checkpoint_id is None:
        raise StateError("ckpt.dcp: checkpoint_id is required (a directory path or a URL such as s3://bucket/run/step-10)")
    return os.fspath(checkpoint_id)


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None, no_dist: bool = False,
         use_collectives: bool = True) -> Manifest:
    """``dcp.save``: save ``state_dict`` to ``checkpoint_id`` (collective over ``process_group``).

    Returns the manifest (DCP returns its ``Metadata``). ``no_dist=True`` saves this process's
    state alone (no collective). Raises ckpt's typed errors (``CheckpointError`` subclasses).
    """
    url = _url(checkpoint_id, storage_writer=storage_writer, planner=planner)
    return _save(_encoded(state_dict), url, group=_group(process_group, no_dist), overwrite=True)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_reader: Any = None, planner: Any = None, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.load``: fill ``state_dict`` in place from ``checkpoint_id``, resharding as needed.

    Tensors and DTensors are filled in place, other values are replaced in the dict, Stateful
    values get ``load_state_dict``. Keys stored but not requested are ignored (as in DCP).
    """
    url = _url(checkpoint_id, storage_reader=storage_reader, planner=planner)
    out = _load(state_dict, url, group=_group(process_group, no_dist), strict=True)  # expands Stateful values
    update_in_place(state_dict, out)


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
    url = _url(checkpoint_id, storage_writer=storage_writer, planner=planner, async_stager=async_stager)
    h = _async_save(_encoded(state_dict), url, group=_group(process_group, no_dist), overwrite=True)
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
        # a group of this process alone, made by it alone (ckpt.comm.side_group; new_group would need
        # every rank to call it): no collective, as DCP's no_dist promises
        from ckpt.comm import side_group

        return side_group([dist.get_rank()], "dcp-no-dist")
    return None


__all__ = ["save", "load", "async_save"]
