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
default behaviour (``allow_partial_load`` honoured); its Hugging Face storage classes
(``HuggingFaceStorageWriter`` / ``HuggingFaceStorageReader`` / ``QuantizedHuggingFaceStorageReader``, exactly
those) write and read HF's format, not a ckpt checkpoint, so those calls are handed to DCP's own function
with the same arguments; other
custom planners or storage classes and stagers are refused with ``UnsupportedDCPObjectError``;
``_extensions=[ZStandard()]`` saves with ckpt's own zstd compression, other ``_extensions`` are
refused (see :mod:`ckpt._dcp_compat`). The legacy ``save_state_dict`` / ``load_state_dict`` are here, and DCP's
other public names (``Metadata``, ``FileSystemWriter``, ``DefaultSavePlanner``, its submodules, ...)
are re-exported from ``torch.distributed.checkpoint`` so ``from ckpt.dcp import X`` works as before.

Submodules: ``import ckpt.dcp.planner`` (any ``torch.distributed.checkpoint.<name>``) gives DCP's
submodule, whose names are DCP's own objects, so replacing ``torch.distributed.checkpoint`` by
``ckpt.dcp`` everywhere in a code base works; ``ckpt.dcp.state_dict_saver`` / ``state_dict_loader``
have ckpt's ``save`` / ``async_save`` / ``save_state_dict`` / ``load`` / ``load_state_dict``.
Errors: every ckpt error these calls raise is also DCP's ``CheckpointException`` (see
:func:`ckpt._dcp_compat.as_dcp_exception`), so DCP code catching it still does; a missing key or size
mismatch also carries DCP's words after ckpt's message. ``save(state_dict, writer)`` / ``load(state_dict,
reader)`` (the storage object positionally, DCP's older order) work with DCP's warning.

Objects come back of the same type and value as DCP gives them (``torch.dtype``, ``torch.Size``,
``torch.device``, tuples, complex, big ints, numpy values, datetimes, ...), or are refused with a
``StateError`` naming the key: :mod:`ckpt.formats.objects` holds the one table of what is stored
how (every ckpt load decodes through it; checkpoints DCP wrote are read through it too).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from ckpt._dcp_compat import (
    Target,
    UnsupportedCompressionError,
    UnsupportedDCPObjectError,
    as_dcp_exception,
    assign_loaded,
    dcp_function,
    load_target,
    save_target,
)
from ckpt._state import ObjectItem, flatten_state, rebuild_state
from ckpt.async_save import UNSET, SaveHandle, _Unset
from ckpt.async_save import async_save as _async_save
from ckpt.errors import CheckpointError
from ckpt.formats.objects import encode_value
from ckpt.load import load as _load
from ckpt.manifest import Manifest
from ckpt.save import save as _save
from ckpt.shards import PerRank
from ckpt.stateful import expand

_F = TypeVar("_F", bound=Callable[..., Any])


def _positional_storage(kind: str) -> Callable[[_F], _F]:
    """DCP's ``_api_bc_check``: ``save(state_dict, writer)`` / ``load(state_dict, reader)`` (the storage
    object as the second positional argument, the order before DCP made it keyword-only) still works,
    with DCP's warning; any other positional use is a TypeError as Python gives it."""
    def wrap(func: _F) -> _F:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 2:
                warnings.warn(f"The argument order of {func.__name__} has been changed. "
                              "Please check the document to avoid future breakages.", stacklevel=2)
                if kind in kwargs:
                    raise TypeError(f"{func.__name__}() got {kind} both as the second positional argument and "
                                    "as a keyword; pass it once")
                kwargs[kind] = args[1]
                args = args[:1]
            return func(*args, **kwargs)
        return cast(_F, inner)
    return wrap


@_positional_storage("storage_writer")
def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None, no_dist: bool = False,
         use_collectives: bool = True, timeout: float | None | _Unset = UNSET) -> Manifest | Any:
    """``dcp.save``: save ``state_dict`` to ``checkpoint_id`` (collective over ``process_group``).

    Returns the manifest (DCP returns its ``Metadata``). ``no_dist=True`` saves this process's
    state alone (no collective). Raises ckpt's typed errors (``CheckpointError`` subclasses).
    An HF ``storage_writer`` is DCP's own save (HF's files, DCP's ``Metadata``). ``timeout`` (not
    DCP's, whose waits are its process group's): seconds any wait for another rank may take.
    """
    with _dcp_errors():
        t = save_target(checkpoint_id, storage_writer, planner)
        if t.delegate:
            return dcp_function("save")(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                        planner=planner, process_group=process_group, no_dist=no_dist,
                                        use_collectives=use_collectives)
        return _save(_encoded(state_dict), t.url, group=_group(process_group, no_dist), overwrite=t.overwrite,
                     storage_options=t.storage_options, compression=t.compression, **_timeout(timeout))


@contextmanager
def _dcp_errors() -> Iterator[None]:
    """Raise ckpt's typed errors as DCP's ``CheckpointException`` too (same class, message, cause)."""
    try:
        yield
    except CheckpointError as e:
        raise as_dcp_exception(e).with_traceback(e.__traceback__) from e.__cause__


@_positional_storage("storage_reader")
def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_reader: Any = None, planner: Any = None, process_group: Any = None, no_dist: bool = False,
         timeout: float | None | _Unset = UNSET) -> None:
    """``dcp.load``: fill ``state_dict`` in place from ``checkpoint_id``, resharding as needed.

    Tensors, DTensors and ShardedTensors are filled in place, Stateful values get
    ``load_state_dict``, and then every other loaded top-level key is assigned
    (``state_dict[key] = value``) as DCP does. Keys stored but not requested are ignored (as in DCP);
    with ``DefaultLoadPlanner(allow_partial_load=True)`` requested keys the checkpoint lacks are left as they are.
    ``timeout``: as for :func:`save`.
    """
    with _dcp_errors():
        t = load_target(checkpoint_id, storage_reader, planner)
        if t.delegate:  # an HF reader: DCP's own load
            dcp_function("load")(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                                 planner=planner, process_group=process_group, no_dist=no_dist)
            return
        _load_into(state_dict, t, process_group, no_dist, timeout)


def _load_into(state_dict: dict[str, Any], t: Target, process_group: Any, no_dist: bool,
               timeout: float | None | _Unset = UNSET) -> None:
    out = _load(state_dict, t.url, group=_group(process_group, no_dist), strict=t.strict,
                storage_options=t.storage_options, **_timeout(timeout))  # expands Stateful values and restores them
    assign_loaded(state_dict, out)


class _Future(Future):  # type: ignore[type-arg]
    """DCP's ``async_save`` future (``result()``, ``done()``), backed by a ckpt save handle."""

    def __init__(self, handle: SaveHandle):
        super().__init__()
        self.handle = handle

    def done(self) -> bool:
        return self.handle.is_done

    def result(self, timeout: float | None = None) -> Manifest | None:
        with _dcp_errors():
            return self.handle.done(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except BaseException as e:  # noqa: BLE001 - the save's error is the answer
            return e
        return None


@_positional_storage("storage_writer")
def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None,
               async_checkpointer_type: Any = None, async_stager: Any = None, no_dist: bool = False,
               use_collectives: bool = True, timeout: float | None | _Unset = UNSET) -> Future:  # type: ignore[type-arg]
    """``dcp.async_save``: returns a future whose ``result()`` is the committed manifest.

    Like DCP's thread mode, it returns once the state is staged (copied out), so the caller may
    change its tensors right away; writing and the commit run in the background. (``ckpt.async_save``
    returns earlier, after planning, and leaves ``h.staged()`` to the caller.) An HF ``storage_writer``
    is DCP's own async_save, whose future it returns. ``timeout``: as for :func:`save`.
    """
    with _dcp_errors():
        t = save_target(checkpoint_id, storage_writer, planner, async_stager)
        if t.delegate:
            kw = {} if async_checkpointer_type is None else {"async_checkpointer_type": async_checkpointer_type}
            return cast(Future, dcp_function("async_save")(  # type: ignore[type-arg]
                state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                process_group=process_group, async_stager=async_stager, no_dist=no_dist,
                use_collectives=use_collectives, **kw))
        h = _async_save(_encoded(state_dict), t.url, group=_group(process_group, no_dist), overwrite=t.overwrite,
                        storage_options=t.storage_options, compression=t.compression, **_timeout(timeout))
        h.staged()
    return _Future(h)


def _timeout(timeout: float | None | _Unset) -> dict[str, Any]:
    """``timeout`` as the keyword of ckpt's own functions: none when not given (their default)."""
    return {} if isinstance(timeout, _Unset) else {"timeout": timeout}


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
                    coordinator_rank: int = 0, no_dist: bool = False, planner: Any = None) -> Manifest | Any:
    """DCP's legacy ``save_state_dict``: :func:`save` with the location taken from ``storage_writer``.

    ``coordinator_rank`` is accepted for compatibility; ckpt's coordinator is the group's rank 0.
    An HF ``storage_writer`` is DCP's own ``save_state_dict``.
    """
    with _dcp_errors():
        if save_target(None, storage_writer, planner).delegate:
            return dcp_function("save_state_dict")(state_dict, storage_writer, process_group, coordinator_rank,
                                                   no_dist, planner)
    return save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                no_dist=no_dist)


def load_state_dict(state_dict: dict[str, Any], storage_reader: Any, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: Any = None) -> None:
    """DCP's legacy ``load_state_dict``: :func:`load` with the location taken from ``storage_reader``.

    ``coordinator_rank`` is accepted for compatibility; ckpt's coordinator is the group's rank 0.
    An HF ``storage_reader`` is DCP's own ``load_state_dict``.
    """
    with _dcp_errors():
        t = load_target(None, storage_reader, planner)
        if t.delegate:
            dcp_function("load_state_dict")(state_dict, storage_reader, process_group, coordinator_rank, no_dist,
                                            planner)
            return
        _load_into(state_dict, t, process_group, no_dist)


def load_sharded_optimizer_state_dict(model_state_dict: dict[str, Any], optimizer_key: str, storage_reader: Any,
                                      planner: Any = None) -> dict[str, Any]:
    """Not available through ``ckpt.dcp``: DCP builds the optimizer state from its own metadata."""
    raise as_dcp_exception(UnsupportedDCPObjectError(
        "ckpt.dcp: load_sharded_optimizer_state_dict is not supported (it builds FSDP1 optimizer state from DCP's "
        "metadata); load the optimizer state with dcp.load into FSDP.optim_state_dict(model, optim) (or "
        "torch.distributed.checkpoint.state_dict.get_state_dict) and apply it with FSDP.optim_state_dict_to_load"))


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
    # submodules appear as attributes once imported, e.g. ``state_dict``); a submodule comes as
    # ckpt.dcp's view of it, so ckpt.dcp.state_dict_saver.save is ckpt's save, never DCP's
    if not name.startswith("_"):
        import torch.distributed.checkpoint as tdcp

        if hasattr(tdcp, name):
            value = getattr(tdcp, name)
            if isinstance(value, types.ModuleType) and value.__name__ == f"{_DCP}.{name}":
                value = importlib.import_module(f"{__name__}.{name}")
            globals()[name] = value  # once
            return value
    raise AttributeError(f"module 'ckpt.dcp' has no attribute {name!r}")


_DCP = "torch.distributed.checkpoint"
# ckpt.dcp is a package whose submodules are views of DCP's (found by _Submodules): `import
# ckpt.dcp.planner`, `from ckpt.dcp.state_dict import get_state_dict` work as with DCP
__path__: list[str] = []


def _entry_points() -> dict[str, dict[str, Any]]:
    return {"state_dict_saver": {"save": save, "async_save": async_save, "save_state_dict": save_state_dict},
            "state_dict_loader": {"load": load, "load_state_dict": load_state_dict}}


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``ckpt.dcp.<x>`` for every submodule ``torch.distributed.checkpoint.<x>`` (nested ones
    too): a module that forwards every attribute to DCP's, except the save/load entry points,
    which are ckpt's (:func:`_entry_points`)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        real = _DCP + fullname[len(__name__):]
        try:
            found = importlib.util.find_spec(real)
        except ImportError:  # a parent that is no package
            return None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=found.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module; exec_module fills it

    def exec_module(self, module: types.ModuleType) -> None:
        rel = module.__name__[len(__name__) + 1:]
        real = importlib.import_module(f"{_DCP}.{rel}")
        module.__doc__ = f"ckpt.dcp's view of {real.__name__}: its names, with ckpt's save/load entry points."
        vars(module).update(__getattr__=lambda name: getattr(real, name),  # PEP 562 module attributes
                            __dir__=lambda: sorted(set(dir(real)) | set(vars(module))))
        if hasattr(real, "__all__"):
            vars(module)["__all__"] = list(real.__all__)
        if hasattr(real, "__path__"):
            module.__path__ = []
        vars(module).update(_entry_points().get(rel, {}))


if not any(isinstance(f, _Submodules) for f in sys.meta_path):
    sys.meta_path.append(_Submodules())


__all__ = ["save", "load", "async_save", "save_state_dict", "load_state_dict", "load_sharded_optimizer_state_dict",
           "UnsupportedDCPObjectError", "UnsupportedCompressionError", *sorted(_FORWARDED)]
