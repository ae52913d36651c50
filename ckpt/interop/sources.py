"""Checkpoints of other tools read in place: which format a directory holds, and its manifest.

``ckpt.load``, ``inspect``, ``verify``, ``reshard``, ``diff``, ``export-hf`` and ``ckpt import``
all take their manifest from :func:`ckpt.load.fetch_manifest`, which asks :func:`foreign_manifest`
when a directory has no ``manifest.msgpack``: a DCP checkpoint (torchtitan, FSDP2 scripts,
Megatron-Core's ``torch_dist``) or a DeepSpeed ZeRO checkpoint is described as a ckpt manifest whose
shards are byte ranges inside the original files, so nothing is converted before it is read.
"""

from __future__ import annotations

from ckpt.errors import ManifestError
from ckpt.manifest import MANIFEST_NAME, Manifest
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
    """The manifest of a foreign checkpoint in ``storage``, or None when it holds none we read.

    Raises ManifestError / IntegrityError / StorageError naming the file; metadata whose objects
    are of the allowed classes but not of the expected shape is a ManifestError too, never a raw
    AttributeError or TypeError.
    """
    try:
        return _foreign_manifest(storage)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
        raise ManifestError(f"{storage.url}: malformed checkpoint metadata ({type(e).__name__}: {e}); the files "
                            "are damaged or from a format version ckpt does not know") from None


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


__all__ = ["DS_MODEL_STATES", "LOOKED_FOR", "deepspeed_root", "detect", "foreign_manifest"]
