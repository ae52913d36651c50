"""Retention and garbage collection under a manager's root: list the ``step-N`` checkpoints, choose
what retention drops, and remove only what is provably ours and finished with.

gc never deletes inside a directory that holds a live lease or temporary file (:mod:`ckpt._lease`),
keeps what it cannot read (damaged, newer format, symlinked, foreign entries are reported), and
removes a committed checkpoint manifest first, then the data files that manifest lists.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from ckpt import _lease as leases
from ckpt import _transaction as transaction
from ckpt.errors import CheckpointError, StorageError
from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import Storage, get_storage, join_url

STEP_DIR = re.compile(r"^step-(\d+)$")
LEASE_GRACE_S = leases.LEASE_GRACE_S  # a lease gc cannot check (another machine) counts as live this long


def step_dir(step: int) -> str:
    """Directory name of the checkpoint of ``step``."""
    return f"step-{step:010d}"


@dataclass(slots=True)
class CheckpointInfo:
    """One entry under a root: its state, size and age.

    ``status``: ``committed`` (manifest present and readable), ``incomplete`` (no manifest: an
    unfinished save), ``unreadable`` (a manifest this ckpt cannot read: damaged, a newer format, not
    a regular file), ``foreign`` (no manifest, and files no writer of ours makes), ``link`` (a
    symlink to a directory elsewhere). ``live``: a running save holds a lease there (or a commit is in
    flight), committed or not; gc touches nothing in it. Only ``incomplete`` entries and committed
    ones retention drops, neither live, are ever removed; ``note`` says why an entry is kept.
    """

    step: int
    name: str
    url: str
    committed: bool
    live: bool  # a running save holds a lease on it (see ckpt._lease): gc leaves it alone
    bytes: int
    mtime: float
    status: str = ""  # derived from ``committed`` when not given
    note: str = ""

    def __post_init__(self) -> None:
        if not self.status:
            self.status = "committed" if self.committed else "incomplete"

    @property
    def removable(self) -> bool:
        """Whether gc may ever delete this entry (only our own checkpoints and unfinished saves)."""
        return self.status in ("committed", "incomplete") and not self.live

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "url": self.url, "committed": self.committed,
                "live": self.live, "bytes": self.bytes, "mtime": self.mtime, "status": self.status,
                "note": self.note}


def list_checkpoints(root: str, storage_options: dict[str, Any] | None = None, *, missing_ok: bool = False,
                     lease_grace_s: float = LEASE_GRACE_S) -> list[CheckpointInfo]:
    """Every ``step-N`` directory under ``root``, oldest first, with its status and size.

    ``lease_grace_s``: how long a lease gc cannot check (written on another machine) counts as live
    (:mod:`ckpt._lease`). Raises StorageError when ``root`` is a local path that is not a directory, or
    does not exist (unless ``missing_ok``: a manager's root before its first save).
    """
    storage = get_storage(root, **(storage_options or {}))
    try:
        if not (missing_ok and _local_dir(storage, "") is not None and not os.path.lexists(storage.url)):
            _check_root(storage)
        return _list(storage, root, lease_grace_s)
    finally:
        storage.close()


def _check_root(storage: Storage) -> None:
    local_root = storage.local_dir
    if local_root is not None and not os.path.isdir(local_root):
        what = "is not a directory" if os.path.exists(local_root) else "does not exist"
        raise StorageError(f"{local_root}: {what}; pass the directory that holds the step-N checkpoints")


def _local_dir(storage: Storage, name: str) -> str | None:
    root = storage.local_dir
    if root is not None:
        return os.path.join(root, name)
    return None


def _list(storage: Storage, root: str, grace_s: float = LEASE_GRACE_S) -> list[CheckpointInfo]:
    groups: dict[str, list[str]] = {}
    links: set[str] = set()
    odd: dict[str, list[str]] = {}  # entries of a step directory that are not regular files
    local_root = storage.local_dir
    if local_root is not None:
        if not os.path.isdir(local_root):
            return []
        for name in os.listdir(local_root):
            if not STEP_DIR.match(name):
                continue
            full = os.path.join(local_root, name)
            if os.path.islink(full):
                links.add(name)  # never followed: a link may point at a checkpoint we do not own
                groups[name] = []
            elif os.path.isdir(full):
                # A crash between mkdir and the first write leaves a step directory with no file in it.
                groups[name], odd[name] = _walk(storage, name)
    else:
        for f in storage.list(""):
            top = f.split("/", 1)[0]
            if STEP_DIR.match(top):
                groups.setdefault(top, []).append(f)
    out = []
    for name, fs in groups.items():
        m = STEP_DIR.match(name)
        assert m is not None
        info = CheckpointInfo(int(m.group(1)), name, join_url(root, name), False, False, 0, _mtime(storage, name),
                              status="incomplete")
        if name in links:
            info.status, info.note = "link", "a symlink: gc never follows or removes it"
            out.append(info)
            continue
        info.bytes = sum(_size(storage, f) for f in fs)
        rel = [f[len(name) + 1:] for f in fs]
        held = leases.storage_survey(storage, name, rel, grace_s=grace_s)
        info.live, info.note = held.busy, held.note()
        strange = [f[len(name) + 1:] for f in odd.get(name, [])]
        if MANIFEST_NAME in rel:
            try:
                decode_manifest(storage.read_file(f"{name}/{MANIFEST_NAME}"))
                info.committed, info.status = True, "committed"
            except CheckpointError as e:
                info.status, info.note = "unreadable", f"kept: {e}"
        elif MANIFEST_NAME in strange:
            info.status, info.note = "unreadable", f"kept: {MANIFEST_NAME} is a link or not a regular file"
        else:
            info.status = "incomplete"
            foreign = strange + transaction.foreign_files([f for f in rel if not leases.is_lease(f)], None)
            if foreign:
                info.status, info.note = "foreign", f"kept: holds files no ckpt writer makes ({', '.join(foreign[:3])})"
        out.append(info)
    return sorted(out, key=lambda c: c.step)


def _walk(storage: Storage, name: str) -> tuple[list[str], list[str]]:
    """The regular files under one local step directory, and the entries that are not (links, to files
    or directories, never followed; FIFOs, sockets): no writer of ours makes one, so an unfinished
    save that holds one is not provably ours, and gc never deletes one."""
    d = _local_dir(storage, name)
    assert d is not None
    out, odd = [], []
    for dirpath, dirs, files in os.walk(d):
        rel = os.path.relpath(dirpath, os.path.dirname(d))
        for f in dirs + files:
            path = f"{rel}/{f}" if rel != "." else f
            try:
                mode = os.lstat(os.path.join(dirpath, f)).st_mode
            except OSError:
                continue  # gone meanwhile
            if stat.S_ISREG(mode):
                out.append(path)
            elif not stat.S_ISDIR(mode):
                odd.append(path)
    return out, odd


def _size(storage: Storage, path: str) -> int:
    try:
        return storage.size(path) or 0
    except CheckpointError:
        return 0


def _mtime(storage: Storage, name: str) -> float:
    d = _local_dir(storage, name)
    if d is not None:
        try:
            return os.lstat(d).st_mtime
        except OSError:
            return 0.0
    return 0.0


def _files_of(storage: Storage, name: str) -> tuple[list[str], list[str]]:
    """Paths (relative to the step directory) of every regular file under it now, and of the entries
    that are not regular files (:func:`_walk`; none on an object store)."""
    if _local_dir(storage, name) is not None:
        files, odd = _walk(storage, name)
        return [f[len(name) + 1:] for f in files], [f[len(name) + 1:] for f in odd]
    return [f[len(name) + 1:] for f in storage.list(name + "/")], []


def _newcomers(storage: Storage, name: str, seen: set[str]) -> bool:
    """Whether a lease, a temp file or a manifest not in ``seen`` is in the directory now: a writer
    arrived after gc looked (its lease comes before its first byte), so gc backs off."""
    d = _local_dir(storage, name)
    if d is not None:
        try:
            now = os.listdir(d)
        except OSError:
            return False
    else:
        now = [f[len(name) + 1:] for f in storage.list(name + "/")]
    return any((leases.is_protected_name(f) or f == MANIFEST_NAME) and f not in seen for f in now)


def _remove(storage: Storage, info: CheckpointInfo, grace_s: float = LEASE_GRACE_S) -> bool:
    """Delete one of our entries: the manifest first (what is left is an unfinished save), then only
    the files the manifest lists and our writers' data and scaffolding, then the stale leases, then
    empty directories. Anything else in the directory stays. Returns whether it was removed.

    Leases make this safe against writers running now: every writer's lease exists before its first
    byte, so after taking the listing gc looks again; a lease (or manifest) it did not see means a
    writer came, and gc leaves the directory. A live lease or temp file is never deleted."""
    name = info.name
    if not info.removable:
        return False
    rel, strange = _files_of(storage, name)  # (links and other odd entries: never deleted)
    held = leases.storage_survey(storage, name, rel, grace_s=grace_s)
    seen = set(rel) | set(strange)
    if held.busy or _newcomers(storage, name, seen) or (MANIFEST_NAME in seen) != (info.status == "committed"):
        return False  # a save holds it, or it changed since it was listed: leave it for the next gc
    listed: set[str] = set()
    if info.status == "committed":
        try:
            listed = set(decode_manifest(storage.read_file(f"{name}/{MANIFEST_NAME}")).files)
        except CheckpointError:
            return False  # changed since it was listed: leave it for the next gc
        storage.delete(f"{name}/{MANIFEST_NAME}")
    plain = [f for f in rel if not leases.is_protected_name(f)]
    ours = {f for f in plain if transaction.is_ours(f)} - {MANIFEST_NAME}
    for f in sorted((listed & set(plain)) | ours):
        if f in listed and not transaction.in_data_area(f):
            continue  # a hostile manifest cannot make gc delete anything outside the data area
        with contextlib.suppress(CheckpointError):  # e.g. a symlink leading outside: left, reported by ls
            storage.delete(f"{name}/{f}")
    # stale temp files, then stale leases: the lease of a dead writer goes last
    for f in sorted(held.stale, key=leases.is_lease):
        with contextlib.suppress(CheckpointError):
            storage.delete(f"{name}/{f}")
    d = _local_dir(storage, name)
    if d is not None:
        for dirpath in sorted((t[0] for t in os.walk(d, topdown=False)), key=len, reverse=True):
            if _newcomers(storage, name, set()):
                break  # a save started here meanwhile: keep its directories
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
    return True


def select_removals(infos: list[CheckpointInfo], keep_last: int | None, keep_every: int | None,
                    protect: set[int] | None = None) -> list[CheckpointInfo]:
    """Which entries retention/gc removes: incomplete ones that no live save holds, and committed ones
    older than the newest ``keep_last`` (except multiples of ``keep_every``). The newest committed
    checkpoint is never removed; unreadable, foreign and symlinked entries never are. Pure function."""
    protect = protect or set()
    committed = [c for c in infos if c.committed]
    keep: set[int] = {c.step for c in committed[-max(keep_last or 0, 1):]} if committed else set()
    if keep_last is None:
        keep = {c.step for c in committed}
    if keep_every:
        keep |= {c.step for c in committed if c.step % keep_every == 0}
    out = []
    for c in infos:
        if c.step in protect or not c.removable:
            continue
        if not c.committed or c.step not in keep:
            out.append(c)
    return out


def gc(root: str, *, keep_last: int | None = None, keep_every: int | None = None, dry_run: bool = False,
       storage_options: dict[str, Any] | None = None, spare_after_step: int | None = None,
       lease_grace_s: float = LEASE_GRACE_S) -> list[CheckpointInfo]:
    """Remove unfinished saves (no manifest, no live lease, only our files) and, with ``keep_last``,
    old committed checkpoints; report-and-keep everything else (see :class:`CheckpointInfo`).

    A directory any live save holds a lease on is never touched, committed or not; a lease or temp
    file is deleted only with a directory whose writers are all gone (:mod:`ckpt._lease` says how
    that is decided; ``lease_grace_s``: how long a lease written on another machine counts as live).
    ``spare_after_step``: never touch steps above it (retention after a commit spares later saves).
    Returns what was removed (with ``dry_run``: what would be). Raises StorageError when ``root`` is
    a local path that does not exist.
    """
    storage = get_storage(root, **(storage_options or {}))
    try:
        _check_root(storage)
        return _gc(storage, root, keep_last, keep_every, dry_run, spare_after_step, lease_grace_s)
    finally:
        storage.close()


def _gc(storage: Storage, root: str, keep_last: int | None, keep_every: int | None, dry_run: bool,
        spare_after_step: int | None, grace_s: float = LEASE_GRACE_S) -> list[CheckpointInfo]:
    infos = _list(storage, root, grace_s)
    protect = {c.step for c in infos if spare_after_step is not None and c.step > spare_after_step}
    doomed = select_removals(infos, keep_last, keep_every, protect)
    if dry_run:
        return doomed
    return [c for c in doomed if _remove(storage, c, grace_s)]
