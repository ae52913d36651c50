"""Write leases: a checkpoint directory is protected from the first byte any writer puts in it.

The rule (docs/RELIABILITY.md, "Leases"):

1. **Every writer takes its own lease before it writes anything** into a step directory:
   ``<dir>/.writing-<rank>-<pid>-<machine>-<random>`` (:func:`acquire`), and drops exactly that
   file once its save is over, committed or failed (:meth:`Lease.release`). Per-rank leases need
   no collective, so rank skew cannot open a window where a rank's data sits unprotected, and a
   failed save can never remove a lease another writer holds. The old single ``.writing`` file
   (rank 0's lease of older versions) is still read as a lease.
2. **gc** (:func:`survey`) treats a directory that holds a *live* lease or a *live* temporary file
   (``<manifest|lease|marker>.tmp.<pid>[.<n>]``, an atomic commit in flight) as untouchable: it deletes
   nothing in it, committed or not. It deletes a lease or temp file only as part of removing a
   directory whose every holder is provably gone.
3. **Staleness is conservative.** A lease written on this machine (same host name, boot and pid
   namespace: the ``machine`` part of its name) is stale exactly when its process is gone (or the
   pid now belongs to a process started later). A lease from another machine or container cannot be
   checked: it counts as live until ``grace_s`` (default :data:`LEASE_GRACE_S`, a day) after the
   later of the time it records and its file's mtime. A lease whose content cannot be read counts
   as live for ``grace_s`` after its mtime, and for ever when there is none (remove it by hand).
   A day, because deleting a live save's files produces a committed checkpoint that misses one (the
   worst outcome), while a crashed save's leftovers only hold disk until then; a same-machine
   crash is cleaned up at once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import CheckpointError, CheckpointExistsError, StorageError
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import Storage, get_storage

LEGACY = ".writing"  # rank 0's single lease of older versions: still honoured
PREFIX = ".writing-"
LEASE_GRACE_S = 24 * 3600.0  # a lease gc cannot check (another machine) counts as live this long
_NAME = re.compile(r"^\.writing-(\d+)-(\d+)-([0-9a-f]{8})-([0-9a-f]{8})$")
_TEMP = re.compile(r"^(?P<base>(?:.*/)?[^/]+)\.tmp\.(?P<pid>\d+)(?:\.\d+)?$")
# A reshard marker (ckpt.resharders.reshard.marker_name): ``.reshard/<plan id>-<rank>[-<writer token>].done``.
RESHARD_MARKER = re.compile(r"^\.reshard/[0-9a-f]{12}-\d{5}(-[0-9a-f]{12})?\.done$")
_ACQUIRE_TRIES = 6  # a concurrent gc may remove the (empty) step directory under a starting lease


def is_lease(path: str) -> bool:
    """True for a lease file's path relative to its step directory (new per-writer or legacy name)."""
    return path == LEGACY or _NAME.match(path) is not None


def is_temp(path: str) -> bool:
    """True for the temporary name of an atomic commit in flight (``<name>.tmp.<pid>[.<n>]``) of a
    file our writers commit into a checkpoint directory: the manifest, a lease, a reshard marker.

    Only those: a user's ``notes.tmp.1`` (or ``results.csv.tmp.2``) beside a checkpoint is a foreign
    file that gc reports and keeps, never a temp file it may delete once it looks stale."""
    t = _TEMP.match(path)
    if t is None:
        return False
    base = t.group("base")
    return base == MANIFEST_NAME or is_lease(base) or RESHARD_MARKER.match(base) is not None


def is_protected_name(path: str) -> bool:
    """Leases and temp files: gc never deletes one except with a directory whose holders are all gone."""
    return is_lease(path) or is_temp(path)


@functools.cache
def machine_id() -> str:
    """This host, boot and pid namespace, hashed: equal ids mean a pid can be checked with kill(0)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=4).hexdigest()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` of this machine still runs (False once gone, or its pid taken by a
    process started after ``start``, in clock ticks since boot; None: not checked)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    if start is not None:
        now = start_time(pid)
        if now is not None and now != start:
            return False  # the pid was reused by a process started later
    return True


@dataclass(slots=True)
class Lease:
    """This writer's lease on one directory; :meth:`release` drops it (once; later calls do nothing)."""

    url: str  # the leased directory
    name: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    released: bool = False
    made_dir: bool = True  # the lease created the (local) directory: tidy may remove it again

    def release(self, *, tidy: bool = False) -> None:
        """Delete this lease file (only this one: never another writer's). ``tidy``: also remove
        the directory when nothing else is in it (a skipped or failed save left nothing there) and
        this lease created it (a user's empty directory given as the destination stays).
        Best effort: a lease that cannot be deleted is stale as soon as this process ends."""
        if self.released:
            return
        self.released = True
        storage = get_storage(self.url, **self.storage_options)
        try:
            with contextlib.suppress(CheckpointError):
                storage.delete(self.name)
            local = storage.local_dir
            if tidy and local is not None and self.made_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(local)  # only when empty; a writer starting there retries its lease
        finally:
            storage.close()


def acquire(url: str, rank: int, storage_options: dict[str, Any] | None = None) -> Lease:
    """Take a new lease on directory ``url`` for ``rank`` of this process (creating the directory).
    Call it before this writer writes any byte under ``url``.

    Raises StorageError naming the directory when the lease cannot be written.
    """
    opts = dict(storage_options or {})
    name = f"{PREFIX}{rank:05d}-{os.getpid()}-{machine_id()}-{uuid.uuid4().hex[:8]}"
    data = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "rank": rank,
                       "start": start_time(os.getpid()), "machine": machine_id()}).encode()
    storage = get_storage(url, **opts)
    try:
        made = storage.local_dir is not None and not os.path.lexists(storage.local_dir)
        for attempt in range(_ACQUIRE_TRIES):
            try:
                storage.commit(name, data, exclusive=True)
                return Lease(url, name, opts, made_dir=made)
            except CheckpointExistsError:
                if attempt == 0:
                    raise
                # our own earlier try is in place (it failed after the rename, e.g. at a directory
                # fsync): the name is this lease's alone, so it is held
                return Lease(url, name, opts, made_dir=made)
            except StorageError as e:
                # gc removes an empty step directory; it may do so between our mkdir and the
                # write of the lease: try again (a real I/O problem fails every time).
                if attempt == _ACQUIRE_TRIES - 1:
                    raise StorageError(f"{url}: cannot take the write lease {name} ({e}); check that the "
                                       "directory is writable") from e
                time.sleep(0.005 * (attempt + 1))
    finally:
        storage.close()
    raise AssertionError("unreachable")


@dataclass(slots=True)
class Holders:
    """Who holds a directory, from its listing: live holders (leases and temp files gc must not
    touch) and the stale ones gc may delete with the directory."""

    live: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # name -> the reason of its verdict

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def note(self) -> str:
        """One line for ``ckpt ls`` / ``gc``: who holds the directory."""
        if not self.live:
            return ""
        first = self.live[0]
        more = f" (+{len(self.live) - 1} more)" if len(self.live) > 1 else ""
        return f"kept: a save in progress holds it ({first}: {self.why[first]}){more}"


def _parse(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        d = json.loads(data)
        return d if isinstance(d, dict) else None
    except (ValueError, UnicodeDecodeError):
        return None


def _by_age(written: float | None, now: float, grace: float, what: str) -> tuple[bool, str]:
    if written is None:
        return True, f"{what}; no time known: remove it by hand when no save is running"
    age = now - written
    if age < grace:
        return True, f"{what}, written {age:.0f} s ago (live for {grace:.0f} s)"
    return False, f"{what}, written {age:.0f} s ago (over {grace:.0f} s)"


def judge(name: str, data: bytes | None, mtime: float | None, *, now: float | None = None,
          grace_s: float = LEASE_GRACE_S) -> tuple[bool, bool, str]:
    """Verdict on one lease (``name``: its path in the directory, or the temp name of one being
    written). Returns ``(live, checked, why)``: ``checked`` when its process was looked up on this
    machine (the verdict is exact), else it rests on its age."""
    now = time.time() if now is None else now
    t = _TEMP.match(name)
    base = t.group("base") if t else name
    lease = _parse(data)
    m = _NAME.match(base)
    when = [x for x in (mtime, _num(lease, "time")) if x is not None]
    written = max(when) if when else None
    if m is not None:
        pid, machine = int(m.group(2)), m.group(3)
        if machine == machine_id():
            start = lease.get("start") if lease else None
            alive = process_alive(pid, start if isinstance(start, int) else None)
            return alive, True, f"pid {pid} on this machine {'runs' if alive else 'is gone'}"
        live, why = _by_age(written, now, grace_s, f"pid {pid} on another machine")
        return live, False, why
    # the legacy ``.writing`` (or its temp file): {"host", "pid", "time"}
    if lease is None or not isinstance(lease.get("host"), str) or _num(lease, "pid") is None:
        live, why = _by_age(mtime, now, grace_s, "an unreadable lease")
        return live, False, why
    pid = int(_num(lease, "pid") or 0)
    if lease["host"] == socket.gethostname():
        alive = process_alive(pid, None)
        return alive, True, f"pid {pid} on this host {'runs' if alive else 'is gone'}"
    live, why = _by_age(written, now, grace_s, f"pid {pid} on {lease['host']}")
    return live, False, why


def _num(d: dict[str, Any] | None, key: str) -> float | None:
    v = d.get(key) if d else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def survey(files: Iterable[str], read: Callable[[str], bytes | None], mtime: Callable[[str], float | None], *,
           now: float | None = None, grace_s: float = LEASE_GRACE_S) -> Holders:
    """Who holds a directory whose files (relative paths) are ``files``. ``read``/``mtime`` give a
    file's bytes / modification time (None when unknown or gone).

    Leases (and temp files of leases being written) are judged by :func:`judge`. Any other temp file
    (a manifest being committed) belongs to a writer that holds a lease there: it is stale only when
    a lease checked on this machine with its pid is stale, or when it is older than ``grace_s``.
    """
    now = time.time() if now is None else now
    out = Holders()
    others: list[tuple[str, int]] = []
    dead_pids: set[int] = set()
    for f in sorted(files):
        t = _TEMP.match(f)
        if not is_lease(f) and not (t and is_lease(t.group("base"))):
            if t and is_temp(f):  # (a user's ``x.tmp.1`` holds nothing: foreign, kept by gc)
                others.append((f, int(t.group("pid"))))
            continue
        live, checked, why = judge(f, _safe(read, f), _safe(mtime, f), now=now, grace_s=grace_s)
        out.why[f] = why
        (out.live if live else out.stale).append(f)
        if not live and checked:
            pid = _pid_of(f, read)
            if pid is not None:
                dead_pids.add(pid)
    for f, pid in others:
        if pid in dead_pids:
            out.stale.append(f)
            out.why[f] = f"temp file of pid {pid}, whose lease is stale"
            continue
        live, why = _by_age(_safe(mtime, f), now, grace_s, f"temp file of pid {pid}")
        out.why[f] = why
        (out.live if live else out.stale).append(f)
    return out


def _pid_of(name: str, read: Callable[[str], bytes | None]) -> int | None:
    t = _TEMP.match(name)
    if t:
        return int(t.group("pid"))
    m = _NAME.match(name)
    if m:
        return int(m.group(2))
    p = _num(_parse(_safe(read, name)), "pid")
    return int(p) if p is not None else None


def _safe(fn: Callable[[str], Any], name: str) -> Any:
    try:
        return fn(name)
    except (CheckpointError, OSError):
        return None


def storage_survey(storage: Storage, prefix: str, files: Iterable[str], *, grace_s: float = LEASE_GRACE_S,
                   now: float | None = None) -> Holders:
    """:func:`survey` of the directory ``prefix`` of ``storage`` (``files`` relative to it)."""
    pre = f"{prefix}/" if prefix else ""
    local = storage.local_dir

    def read(f: str) -> bytes | None:
        size = storage.size(pre + f)
        if size is None or size > 64 << 10:  # a lease is a few hundred bytes: never read a big file
            return None
        return storage.read_file(pre + f)

    def mtime(f: str) -> float | None:
        if local is None:
            return None
        return os.lstat(os.path.join(local, pre + f)).st_mtime

    return survey(files, read, mtime, now=now, grace_s=grace_s)


__all__ = ["LEASE_GRACE_S", "LEGACY", "RESHARD_MARKER", "Holders", "Lease", "acquire", "is_lease", "is_protected_name",
           "is_temp", "judge", "machine_id", "storage_survey", "survey"]
