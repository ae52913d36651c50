"""Checkpoints of other tools read in place: which format a directory holds, and its manifest.

``ckpt.load``, ``inspect``, ``verify``, ``reshard``, ``diff``, ``export-hf`` and ``ckpt import``
all take their manifest from :func:`ckpt.load.fetch_manifest`, which asks :func:`foreign_manifest`
when a directory has no ``manifest.msgpack``: a DCP checkpoint (torchtitan, FSDP2 scripts,
Megatron-Core's ``torch_dist``) or a DeepSpeed ZeRO checkpoint is described as a ckpt manifest whose
shards are byte ranges inside the original files, so nothing is converted before it is read.
"""

from __future__ import annotations

from typing import Any

from ckpt.errors import ForeignFormatError, ManifestError
from ckpt.formats import budget as _budget
from ckpt.manifest import MANIFEST_NAME, Manifest
from ckpt.shards import Box, Flat
from ckpt.storage import Storage

# ZeRO-1/2 write mp_rank_00_model_states.pt; ZeRO-3 one zero_pp_rank_<r>_mp_rank_00_model_states.pt per rank
DS_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
LOOKED_FOR = (f"{MANIFEST_NAME} (ckpt), .metadata (torch.distributed.checkpoint / torchtitan / Megatron-Core "
              "torch_dist), latest or *_optim_states.pt (DeepSpeed ZeRO), latest_universal or zero/ "
              "(DeepSpeed universal)")


def deepspeed_root(storage: Storage) -> str | None:
    """The DeepSpeed tag directory inside ``storage`` ("" for the directory itself), or None.

    DeepSpeed's ``save_checkpoint(dir)`` writes ``dir/latest`` (the newest tag) and
    ``dir/<tag>/mp_rank_00_model_states.pt`` (+ ``*_optim_states.pt``); ``ds_to_universal`` writes
    ``dir/latest_universal`` and a tag directory with the model file and ``zero/``; either directory
    is accepted.
    Only these names are probed: a large directory is never listed.
    """
    if any(storage.size(name) is not None for name in DS_MODEL_STATES):
        return ""
    for pointer in ("latest", "latest_universal"):  # the same order deepspeed_manifest follows them in
        size = storage.size(pointer)
        if size is None or size >= 4096:
            continue
        tag = storage.read_file(pointer).decode("utf-8", "replace").strip()
        if tag and "/" not in tag and "\0" not in tag and tag not in (".", "..") and any(
                storage.size(f"{tag}/{name}") is not None for name in DS_MODEL_STATES):
            return tag
        return None  # deepspeed_manifest would follow this pointer: a broken one is not skipped
    return None


def detect(storage: Storage) -> str | None:
    """``"ckpt"``, ``"dcp"``, ``"deepspeed"`` or None: what ``storage`` holds (a few probes, no listing)."""
    from ckpt.interop import dcp_source as dcp_source
    if storage.size(MANIFEST_NAME) is not None:
        return "ckpt"
    if dcp_source.is_dcp(storage):
        return "dcp"
    if deepspeed_root(storage) is not None:
        return "deepspeed"
    return None


def foreign_manifest(storage: Storage) -> Manifest | None:
    """The manifest of a foreign checkpoint in ``storage``, or None when it holds none we read:
    :func:`foreign_source`'s bytes decoded, so it passed the same schema checks as a ckpt manifest.

    Raises ManifestError / IntegrityError / StorageError naming the file; metadata whose objects
    are of the allowed classes but not of the expected shape is a ManifestError too, never a raw
    AttributeError or TypeError.
    """
    from ckpt.formats.msgpack_codec import decode_manifest

    src = foreign_source(storage)
    if src is None:
        return None
    m = decode_manifest(src[0], url=f"{storage.url} (its {src[1]} metadata, read in place)")
    m.source_format = src[1]
    return m


def foreign_source(storage: Storage) -> tuple[bytes, str] | None:
    """The manifest of a foreign checkpoint in ``storage`` encoded as ckpt records it (what a load
    decodes and validates), and the format's name; None when ``storage`` holds none we read.

    Raises as :func:`foreign_manifest`; a value the metadata holds that no manifest can record (a
    lone surrogate in a key, an integer beyond 64 bits) is a ForeignFormatError naming it.
    """
    try:
        m = _foreign_manifest(storage)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
        raise ManifestError(f"{storage.url}: malformed checkpoint metadata ({type(e).__name__}: {e}); the files "
                            "are damaged or from a format version ckpt does not know") from None
    if m is None:
        return None
    return encode_foreign(m, storage.url), m.source_format


def encode_foreign(manifest: Manifest, what: str) -> bytes:
    """``manifest`` (read in place from another tool's files, ``what``) encoded as ckpt's manifest.

    The one place where a foreign reader's values become a ckpt record: every reader (DCP, Megatron,
    DeepSpeed, torch.save) hands its manifest through here before it is used, so a value msgpack
    cannot hold (a key with a lone surrogate, which pickles and JSON escapes can carry; an integer
    beyond 64 bits) is a ForeignFormatError naming the field, not a raw UnicodeEncodeError or
    OverflowError from the encoder (or, across ranks, a bare CheckpointError wrapping one).
    """
    from ckpt.formats.msgpack_codec import encode_manifest

    try:
        return encode_manifest(manifest)
    except (TypeError, ValueError, OverflowError) as e:  # UnicodeEncodeError is a ValueError
        raise ForeignFormatError(f"{what}: {_unrecordable(manifest, what)} cannot be recorded in a ckpt manifest "
                                 f"({type(e).__name__}: {str(e)[:200]}); the metadata is damaged or was not written "
                                 "by the tool it claims") from None


def _unrecordable(m: Manifest, what: str) -> str:
    """Where in ``m`` the first value msgpack cannot encode is (found only after the encoder failed)."""
    def ints(r: Any) -> list[Any]:
        if isinstance(r, Box):
            return [*r.offsets, *r.lengths]
        if isinstance(r, Flat):
            return [r.start, r.stop, *(ints(r.box) if r.box is not None else [])]
        return [r]

    view = {"tensors": {k: {"dtype": t.dtype, "shape": list(t.shape),
                            "shards": [[s.file, s.offset, s.length, *ints(s.region)] for s in t.shards]}
                        for k, t in m.tensors.items()},
            "objects": dict.fromkeys(m.objects), "files": m.files, "step": m.step, "layout": m.layout,
            "user_metadata": m.user_metadata}
    for path, v in _budget.walk(view, what):
        for x in (*path[-1:], v):
            if not _recordable(x):
                return f"the value at {'/'.join(ascii(p) for p in path)} ({ascii(x)[:100]})"
    return "a value"


def _recordable(x: Any) -> bool:
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(x, int) and not isinstance(x, bool):
        return -(1 << 63) <= x < 1 << 64
    return x is None or isinstance(x, (bool, float, bytes, list, dict))


def _foreign_manifest(storage: Storage) -> Manifest | None:
    from ckpt.interop import dcp_source as dcp_source
    if dcp_source.is_dcp(storage):
        return dcp_source.dcp_manifest(storage)
    tag = deepspeed_root(storage)
    if tag is not None:
        from ckpt.interop import deepspeed as deepspeed
        from ckpt.storage.local import LocalStorage

        if not isinstance(storage, LocalStorage):
            raise ManifestError(f"{storage.url}: DeepSpeed checkpoints are read from local directories only; "
                                "copy it to a local disk first")
        return deepspeed.deepspeed_manifest(storage.root, tag=tag or None)
    return None


__all__ = ["DS_MODEL_STATES", "LOOKED_FOR", "deepspeed_root", "detect", "foreign_manifest", "foreign_source",
           "encode_foreign"]
