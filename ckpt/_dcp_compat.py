"""What ``ckpt.dcp`` accepts of DCP's objects: storage writers/readers, planners, extensions.

``torch.distributed.checkpoint`` lets a caller pass a ``storage_writer`` / ``storage_reader`` (where
and how to write) and a ``planner`` (what to write). ckpt has its own format, planner and commit,
so it takes from DCP's objects exactly what it can honour and refuses the rest, in one place:

* DCP's own ``FileSystemWriter`` / ``FileSystemReader`` and ``FsspecWriter`` / ``FsspecReader``:
  their path (or URL) is where ckpt saves or loads (fsspec ones through ckpt's fsspec backend,
  with the filesystem's ``storage_options``); ``overwrite=False`` becomes ckpt's exclusive create
  (``CheckpointExistsError``). ``thread_count``, ``per_thread_copy_ahead``, ``single_file_per_rank``,
  ``sync_files`` and ``serialization_format`` are tuning and on-disk choices of DCP's own format:
  ckpt writes one safetensors file per writing rank with its own threads, and always makes the
  commit durable (fsync), so it never writes less safely than asked.
* ``_extensions``: ``[ZStandard()]`` (DCP's zstd stream transform) becomes ckpt's own compression,
  ``compression="zstd"`` (:mod:`ckpt._codec`: per-piece zstd frames with byte planes, recorded in
  the manifest, read back by any ckpt load); any other transform is refused
  (:class:`UnsupportedCompressionError`).
* ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` (exactly those classes): the default behaviour
  they are; ``DefaultLoadPlanner(allow_partial_load=True)`` loads what the checkpoint has and
  leaves the other keys as they are (ckpt's ``strict=False``).
* DCP's Hugging Face storage, ``HuggingFaceStorageWriter`` / ``HuggingFaceStorageReader`` /
  ``QuantizedHuggingFaceStorageReader`` (exactly those classes): their output (or input) is HF's
  format, not a ckpt checkpoint, so ckpt has nothing to add; the call is handed to DCP's own function
  with the same arguments (:attr:`Target.delegate`; planner and stager then are DCP's business).
* Any other planner, subclasses of DCP's planners or storage classes included (ckpt cannot run
  their hooks; a subclass of an HF class too, whose output ckpt cannot vouch for), any other storage
  class and async stagers: :class:`UnsupportedDCPObjectError` naming the class and what to do instead.

Errors: DCP reports every failed save or load as ``CheckpointException`` (with ``failures``:
rank -> (exception, traceback)), and DCP code catches that. :func:`as_dcp_exception` gives ckpt's
typed error a class that is both: ``except CheckpointExistsError`` and ``except CheckpointException``
(and ``except Exception``) all catch it, and its message stays ckpt's one line.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt.errors import CheckpointError, StateError
from ckpt.stateful import is_stateful


class UnsupportedDCPObjectError(StateError):
    """A DCP planner, storage writer/reader or stager ``ckpt.dcp`` cannot honour (a custom class
    whose hooks ckpt would not run); the message names the class and what to pass instead."""


class UnsupportedCompressionError(UnsupportedDCPObjectError):
    """A DCP writer asks for a stream transform (``_extensions``) other than ``ZStandard``, which
    ckpt maps onto its own compression; the others ckpt cannot honour."""


_INSTEAD = ("pass the location as checkpoint_id=<path or URL> (ckpt.save/ckpt.load take storage_options), "
            "or keep torch.distributed.checkpoint for this call")


@dataclass
class Target:
    """Where and how a ``ckpt.dcp`` call saves or loads, resolved from DCP's arguments."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    overwrite: bool = True  # DCP's save replaces what is there unless its writer says overwrite=False
    strict: bool = True  # load: every requested key must be in the checkpoint
    compression: str | None = None  # save: "zstd" for DCP's _extensions=[ZStandard()] (ckpt._codec)
    # the storage object writes/reads another tool's format (HF): DCP's own function runs the call as given
    delegate: bool = False


def _dcp_classes() -> dict[str, tuple[type, ...]]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        fs_w: tuple[type, ...] = (FsspecWriter,)
        fs_r: tuple[type, ...] = (FsspecReader,)
    except ImportError:  # fsspec not installed: no such objects can exist
        fs_w = fs_r = ()
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    return {"writer": (FileSystemWriter, _FileSystemWriter), "reader": (FileSystemReader,), "fs_writer": fs_w,
            "fs_reader": fs_r, "save_planner": (DefaultSavePlanner,), "load_planner": (DefaultLoadPlanner,),
            "dcp_writer": (HuggingFaceStorageWriter,),
            "dcp_reader": (HuggingFaceStorageReader, QuantizedHuggingFaceStorageReader)}


def _storage_kind(obj: Any, role: str, classes: dict[str, tuple[type, ...]]) -> str:
    """The one classification of a DCP storage writer/reader (``role``: "writer" or "reader"):
    ``"ckpt"`` (DCP's file system class: ckpt saves/loads at its path), ``"fsspec"`` (the same through
    ckpt's fsspec backend), ``"dcp"`` (another tool's format, exactly an HF class: handed to DCP), or
    a typed refusal. Exact classes only: a subclass may override what ckpt (or the delegation) relies on."""
    kind = type(obj)
    for name, group in (("ckpt", role), ("fsspec", f"fs_{role}"), ("dcp", f"dcp_{role}")):
        if kind in classes[group]:
            return name
    if role == "writer":
        raise _refuse("storage_writer", obj, "is a storage writer ckpt cannot run (ckpt writes its own format "
                      "through its own storage backends; only DCP's own HuggingFaceStorageWriter is handed to DCP)")
    raise _refuse("storage_reader", obj, "is a storage reader ckpt cannot run (ckpt reads through its own storage "
                  "backends; it reads DCP-written checkpoints by path too; only DCP's own HuggingFaceStorageReader "
                  "is handed to DCP)")


def _refuse(what: str, obj: Any, why: str, instead: str = _INSTEAD) -> UnsupportedDCPObjectError:
    cls = type(obj)
    return UnsupportedDCPObjectError(f"ckpt.dcp: {what}={cls.__module__}.{cls.__qualname__} {why}; {instead}")


def _location(checkpoint_id: str | os.PathLike[str] | None, obj: Any, is_fsspec: bool) -> tuple[str, dict[str, Any]]:
    # DCP resets the writer/reader to checkpoint_id when both are given: the id wins
    if checkpoint_id is not None:
        url = os.fspath(checkpoint_id)
    elif obj is not None:
        url = os.fspath(obj.path)
    else:
        raise StateError("ckpt.dcp: checkpoint_id is required (a directory path or a URL such as "
                         "s3://bucket/run/step-10), or a DCP FileSystemWriter/Reader naming one")
    opts: dict[str, Any] = {}
    if is_fsspec and obj is not None:
        # FsspecWriter(path, **kwargs) built its filesystem with those kwargs; fsspec keeps them
        opts = dict(getattr(getattr(obj.fs, "fs", None), "storage_options", None) or {})
    return url, opts


def save_target(checkpoint_id: str | os.PathLike[str] | None, storage_writer: Any, planner: Any,
                async_stager: Any = None) -> Target:
    """The :class:`Target` of a ``dcp.save`` / ``dcp.async_save`` call, or a typed refusal."""
    classes = _dcp_classes()
    kind = _storage_kind(storage_writer, "writer", classes) if storage_writer is not None else "ckpt"
    if kind == "dcp":  # DCP runs the call with the caller's planner and stager
        return Target(_location(checkpoint_id, storage_writer, False)[0], delegate=True)
    check_planner(planner, "planner", classes["save_planner"])
    if async_stager is not None:
        raise _refuse("async_stager", async_stager, "stages through hooks ckpt does not run (ckpt stages the state "
                      "itself before async_save returns)")
    compression = None
    if storage_writer is not None:
        exts = tuple(getattr(getattr(storage_writer, "transforms", None), "extensions", ()) or ())
        compression = _compression(exts)
    url, opts = _location(checkpoint_id, storage_writer, kind == "fsspec")
    overwrite = bool(getattr(storage_writer, "overwrite", True)) if storage_writer is not None else True
    return Target(url, opts, overwrite=overwrite, compression=compression)


def _compression(exts: tuple[Any, ...]) -> str | None:
    """ckpt's ``compression`` for a DCP writer's ``_extensions``: none, or exactly DCP's ``ZStandard``
    (once): ``"zstd"``. Anything else: UnsupportedCompressionError naming it."""
    if not exts:
        return None
    from torch.distributed.checkpoint._extension import ZStandard

    if len(exts) == 1 and type(exts[0]) is ZStandard:
        return "zstd"
    names = ", ".join(type(e).__name__ for e in exts)
    raise UnsupportedCompressionError(
        f"ckpt.dcp: storage_writer has _extensions=[{names}]: ckpt maps only [ZStandard()] (onto its own zstd "
        "compression) and cannot run other stream transforms; use _extensions=[ZStandard()] or drop _extensions")


def load_target(checkpoint_id: str | os.PathLike[str] | None, storage_reader: Any, planner: Any) -> Target:
    """The :class:`Target` of a ``dcp.load`` call, or a typed refusal."""
    classes = _dcp_classes()
    kind = _storage_kind(storage_reader, "reader", classes) if storage_reader is not None else "ckpt"
    if kind == "dcp":  # DCP runs the call with the caller's planner
        return Target(_location(checkpoint_id, storage_reader, False)[0], delegate=True)
    check_planner(planner, "planner", classes["load_planner"])
    url, opts = _location(checkpoint_id, storage_reader, kind == "fsspec")
    strict = not bool(getattr(planner, "allow_partial_load", False)) if planner is not None else True
    return Target(url, opts, strict=strict)


def dcp_function(name: str) -> Callable[..., Any]:
    """DCP's own ``save`` / ``async_save`` / ``save_state_dict`` / ``load`` / ``load_state_dict`` (from
    its modules, never ckpt.dcp's views of them), for a :attr:`Target.delegate` call."""
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

    fn: Callable[..., Any] = getattr(state_dict_saver if "save" in name else state_dict_loader, name)
    return fn


def check_planner(planner: Any, what: str, defaults: tuple[type, ...]) -> None:
    """Accept ``None`` or an instance of exactly DCP's default planner class; refuse anything else
    (a subclass overrides hooks ckpt would silently skip)."""
    if planner is None or type(planner) in defaults:
        return
    raise _refuse(what, planner, f"is a custom planner: ckpt plans with its own planner and would not run its "
                  f"hooks (only {', '.join(c.__name__ for c in defaults)}() is accepted, as the default it is)",
                  f"drop {what}= to plan with ckpt, or keep torch.distributed.checkpoint for this call")


def assign_loaded(state_dict: dict[str, Any], out: dict[str, Any]) -> None:
    """Give ``state_dict`` what :func:`ckpt.load` returned, as DCP does: every loaded top-level key is
    assigned once (``state_dict[key] = value``), after its tensors were filled and its nested dicts
    updated in place, so a dict subclass sees the ``__setitem__`` DCP makes. Stateful values were
    restored through ``load_state_dict`` by the load itself and are not assigned (nor restored
    twice). Keys the load did not produce are left alone."""
    for key in list(state_dict):
        if key not in out:
            continue
        cur, new = state_dict[key], out[key]
        if is_stateful(cur):
            continue
        if isinstance(cur, dict) and isinstance(new, dict):
            _update(cur, new)
            new = cur
        elif isinstance(cur, torch.Tensor):  # tensors, DTensors, ShardedTensors: filled in place
            new = cur
        state_dict[key] = new


def _update(cur: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        c = cur.get(k)
        if is_stateful(c) or isinstance(c, torch.Tensor):
            continue  # restored by the load / filled in place
        if isinstance(c, dict) and isinstance(v, dict):
            _update(c, v)
        else:
            cur[k] = v


_DCP_CLASSES: dict[type, type] = {}


def as_dcp_exception(err: CheckpointError) -> CheckpointError:
    """``err`` as an instance of a class deriving from both ``type(err)`` and DCP's
    ``CheckpointException``, with ``failures == {this rank: (err, its traceback)}`` as DCP builds it.

    The message, args and cause are ``err``'s; an error that already is one is returned as is.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException):
        return err
    kind = type(err)
    cls = _DCP_CLASSES.get(kind)
    if cls is None:
        # ckpt's class first, so its methods win; CheckpointException adds failures and the isinstance
        cls = type(kind.__name__, (kind, CheckpointException), {
            "__module__": kind.__module__, "__str__": lambda self: BaseException.__str__(self) + dcp_wording(self),
            "__reduce__": lambda self: (as_dcp_exception, (kind(*self.args),)),
            "__doc__": f"{kind.__name__}, also a torch.distributed.checkpoint CheckpointException."})
        _DCP_CLASSES[kind] = cls
    new = cls.__new__(cls, *err.args)
    new.args = err.args
    new.__dict__.update(err.__dict__)
    new._failures = {_rank(): (err, traceback.extract_tb(err.__traceback__))}
    new.__cause__, new.__context__ = err.__cause__, err.__context__
    return new


# DCP's own words for the failures DCP code matches on (assertRaisesRegex(CheckpointException, "Missing key in
# checkpoint")): (pattern over ckpt's message, DCP's message built from its groups). ckpt's message stays first.
_DCP_WORDING: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"requested but missing from the checkpoint: (.+?) \(pass strict=False"),
     lambda m: f"Missing key in checkpoint state_dict: {m[1].replace(chr(39), '')}."),
    (re.compile(r"tensor '(.+?)': not in the checkpoint"),
     lambda m: f"Missing key in checkpoint state_dict: {m[1]}."),
    (re.compile(r"tensor '(.+?)': checkpoint has global shape \[(.*?)\], the target expects \[(.*?)\]"),
     lambda m: f"Size mismatch between saved torch.Size([{m[2]}]) and current: torch.Size([{m[3]}]) for {m[1]}"),
    # DCP's FileSystemWriter / FsspecWriter(overwrite=False) on a committed checkpoint (test_fsspec::test_overwrite)
    (re.compile(r"already holds a committed checkpoint"),
     lambda m: "Checkpoint already exists and self.overwrite=False."),
)


def dcp_wording(err: BaseException) -> str:
    """``"; DCP: <DCP's message>"`` for a ckpt error DCP reports in words of its own (a missing key, a
    size mismatch), so code matching DCP's text still matches; ``""`` for the others."""
    msg = BaseException.__str__(err)
    for pattern, words in _DCP_WORDING:
        m = pattern.search(msg)
        if m:
            return f"; DCP: {words(m)}"
    return ""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = ["Target", "UnsupportedCompressionError", "UnsupportedDCPObjectError", "as_dcp_exception", "assign_loaded",
           "check_planner", "dcp_function", "dcp_wording", "load_target", "save_target"]
