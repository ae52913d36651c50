"""Damaging a checkpoint on purpose and judging what verify and load made of it.

Shared by ``tests/integrity/test_corruption.py`` and the corruption census in ``bench/fuzz.py``.
The criteria (what counts as "detected") are spelled out in test_corruption.py's docstring and in
docs/RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import ckpt
from ckpt.manifest import MANIFEST_NAME
from tests.integrity.sample import Outcome, check, header_change, header_span, manifest_change

MASKS = (0x01, 0x80, 0xFF, 0x10, 0x04, 0x40, 0x20, 0x02, 0x08)


class Sample:
    """A saved checkpoint, its expected contents, and the original bytes of every file (to restore)."""

    def __init__(self, url: str, expected: dict[str, Any]):
        self.url = url
        self.expected = expected
        m = ckpt.inspect(url)
        self.files = [MANIFEST_NAME, *sorted(m.files)]
        self.raw = {f: _read(os.path.join(url, f)) for f in self.files}

    @contextlib.contextmanager
    def replaced(self, rel: str, data: bytes | None) -> Iterator[None]:
        """The file ``rel`` holds ``data`` (None: deleted) inside the block, its original bytes after.

        Edits happen in place (only the bytes that differ, ``truncate`` for a shorter file, a rename
        for a deletion): rewriting a file from scratch costs a block-allocation flush on ext4.
        """
        path = os.path.join(self.url, rel)
        raw = self.raw[rel]
        if data is None:
            os.rename(path, path + ".deleted")
            try:
                yield
            finally:
                os.rename(path + ".deleted", path)
            return
        _patch(path, raw, data)
        try:
            yield
        finally:
            _patch(path, data, raw)

    def check(self, rel: str, data: bytes | None, workers: int = 1) -> Outcome:
        with self.replaced(rel, data):
            return check(self.url, self.expected, workers=workers)


def _patch(path: str, old: bytes, new: bytes) -> None:
    """Turn the file at ``path`` from ``old`` into ``new`` by writing only what differs."""
    diff = [i for i in range(min(len(old), len(new))) if old[i] != new[i]]
    with open(path, "r+b") as f:
        if diff:
            f.seek(diff[0])
            f.write(new[diff[0] : diff[-1] + 1])
        if len(new) > len(old):
            f.seek(len(old))
            f.write(new[len(old) :])
        elif len(new) < len(old):
            f.truncate(len(new))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def flip(raw: bytes, pos: int, mask: int) -> bytes:
    b = bytearray(raw)
    b[pos] ^= mask
    return bytes(b)


def data_file(s: Sample) -> str:
    return next(f for f in s.files if f != MANIFEST_NAME)


# Reported gaps that a strict-xfail test tracks (classes judged leniently by ``sweep`` callers).
# Format 2's manifest checksum closed the last two (flips of objects' bytes and names).
KNOWN: tuple[str, ...] = ()
MANIFEST_ERRORS = ("ManifestError", "ManifestIntegrityError", "FormatVersionError")


def _envelope(raw: bytes) -> dict[str, Any] | None:
    """The format-2 envelope of manifest bytes (None: format 1 or undecodable)."""
    import msgpack

    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return None
    return d if isinstance(d, dict) and "body" in d else None


def minor_version_only(raw: bytes, mutated: bytes) -> bool:
    """Whether two format-2 manifests differ only in the envelope's minor version."""
    env, m_env = _envelope(raw), _envelope(mutated)
    if env is None or m_env is None:
        return False
    v = m_env.get("version")
    return ({k: x for k, x in m_env.items() if k != "version"} == {k: x for k, x in env.items() if k != "version"}
            and isinstance(v, list) and len(v) == 2 and v[0] == env["version"][0]
            and isinstance(v[1], int) and not isinstance(v[1], bool))  # [2, {}] is malformed, not a minor


def refused(out: Outcome) -> bool:
    """verify reports only a manifest problem and both loads raise a manifest error."""
    return (not out.verify_ok and out.verify_kinds == ["manifest"] and out.verified_load in MANIFEST_ERRORS
            and out.plain_load in MANIFEST_ERRORS)


# ------------------------------------------------------------------------------------------------
# classification of one flip


def judge(s: Sample, rel: str, pos: int, mask: int, workers: int = 1) -> tuple[str, list[str]]:
    """Flip byte ``pos`` of ``rel`` with ``mask``; return (the flip's class, violated expectations).

    Classes: ``data`` (tensor bytes), ``header-prefix``, ``header:<change>`` (see
    ``sample.header_change``), ``manifest:<change>`` (see ``sample.manifest_change``).
    """
    raw = s.raw[rel]
    mutated = flip(raw, pos, mask)
    out = s.check(rel, mutated, workers)
    bad: list[str] = []
    if out.verified_load == "different":
        bad.append("load(verify=True) returned values that differ from the saved ones")
    if out.verify_ok and out.plain_load == "different":
        bad.append("verify passed a checkpoint whose load returns different values")
    if rel == MANIFEST_NAME:
        kind = "manifest:" + manifest_change(raw, mutated)
        env = _envelope(raw)
        if env is not None:
            # Format 2: the body's checksum catches every flip but one of the envelope's minor version.
            if minor_version_only(raw, mutated):
                if out.plain_load != "same" or out.verified_load != "same":
                    bad.append(f"a minor-version flip changed what load returns: {out}")
            elif not refused(out):
                bad.append(f"manifest flip ({kind}) not refused by verify and both loads: {out}")
            return kind, bad
        if kind == "manifest:undecodable":
            if out.verify_ok or out.verify_kinds != ["manifest"]:
                bad.append(f"undecodable manifest not reported as a manifest problem: {out}")
            if out.verified_load != "ManifestError":
                bad.append(f"undecodable manifest: load(verify=True) gave {out.verified_load}")
        return kind, bad
    lo, hi = header_span(raw)
    if pos >= hi:
        if out.verify_ok or "checksum" not in out.verify_kinds or out.verified_load != "IntegrityError":
            bad.append(f"tensor byte flip not detected by both verify and load(verify=True): {out}")
        return "data", bad
    kind = "header-prefix" if pos < lo else "header:" + header_change(raw[lo:hi], mutated[lo:hi])
    # load never reads headers: it must give back exactly what was saved (or refuse)
    if out.plain_load != "same" or out.verified_load != "same":
        bad.append(f"a header flip changed what load returns: {out}")
    if kind in ("header:none", "header:metadata"):
        if not out.verify_ok:
            bad.append(f"harmless header flip reported: {out}")
    elif kind != "header:dtype-shape" and (out.verify_ok or "header" not in out.verify_kinds):
        bad.append(f"header flip ({kind}) not reported by verify: {out}")
    return kind, bad


def sweep(s: Sample, rel: str, positions: range) -> tuple[Counter[str], list[str], dict[str, list[str]]]:
    kinds: Counter[str] = Counter()
    failures: list[str] = []
    by_kind: dict[str, list[str]] = {}
    for pos in positions:
        mask = MASKS[pos % len(MASKS)]
        kind, bad = judge(s, rel, pos, mask)
        kinds[kind] += 1
        for b in bad:
            by_kind.setdefault(kind, []).append(f"{rel} byte {pos} ^ {mask:#04x}: {b}")
            failures.append(f"{rel} byte {pos} ^ {mask:#04x} ({kind}): {b}")
    return kinds, failures, by_kind
