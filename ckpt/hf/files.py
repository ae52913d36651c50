"""The files that travel with a Hugging Face model besides its weights: tokenizer and generation config.

``import-hf`` keeps the ones in the Hugging Face directory inside the checkpoint it writes, as bytes
objects ``hf.files.<name>`` (checksummed and committed with the manifest, carried by ``reshard``).
``export-hf`` writes next to the exported weights those objects and the files it finds next to the
source checkpoint's manifest, and ``--tokenizer DIR`` takes them from a directory instead (those
win). A round trip ``import-hf`` -> ``export-hf`` therefore gives back the tokenizer, its chat
template and the generation config. Only these names are copied, each at most 64 MiB; nothing in
them is parsed.
"""

from __future__ import annotations

from ckpt._checksum import crc32
from ckpt.errors import CheckpointError, StateError
from ckpt.formats.msgpack_codec import decode_object, encode_object
from ckpt.manifest import Manifest, ObjectEntry
from ckpt.storage import Storage, get_storage

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
              "chat_template.json")
MAX_SIDE_FILE = 64 << 20
PREFIX = "hf.files."


def read_side_files(storage: Storage) -> dict[str, bytes]:
    """The side files present in ``storage`` (a Hugging Face model directory)."""
    out: dict[str, bytes] = {}
    for name in SIDE_FILES:
        size = storage.size(name)
        if size is not None and size <= MAX_SIDE_FILE:
            out[name] = storage.read_file(name)
    return out


def as_objects(files: dict[str, bytes]) -> dict[str, ObjectEntry]:
    """Side files as the manifest objects :func:`from_manifest` reads back (``import-hf`` keeps them so)."""
    out: dict[str, ObjectEntry] = {}
    for name, value in sorted(files.items()):
        data = encode_object(value, key=PREFIX + name)
        out[PREFIX + name] = ObjectEntry(data=data, checksum=crc32(data))
    return out


def from_manifest(manifest: Manifest) -> dict[str, bytes]:
    """Side files saved in the checkpoint as bytes objects ``hf.files.<name>`` (e.g. by a user's
    ``ckpt.save``); names outside the list are ignored."""
    out: dict[str, bytes] = {}
    for key, o in manifest.objects.items():
        name = key[len(PREFIX):]
        if key.startswith(PREFIX) and name in SIDE_FILES and o.data is not None:
            value = decode_object(o.data, key=key)
            if isinstance(value, bytes):
                out[name] = value
    return out


def from_dir(path: str) -> dict[str, bytes]:
    """``--tokenizer DIR``: the side files in ``DIR``.

    Raises StateError when it holds none of them.
    """
    try:
        st = get_storage(path)
    except CheckpointError as e:
        raise StateError(f"--tokenizer {path}: {e}") from None
    try:
        files = read_side_files(st)
    finally:
        st.close()
    if not files:
        raise StateError(f"--tokenizer {path}: none of {', '.join(SIDE_FILES[:4])}, ... is there")
    return files


__all__ = ["SIDE_FILES", "MAX_SIDE_FILE", "PREFIX", "read_side_files", "as_objects", "from_manifest", "from_dir"]
