"""Whole memory checkpoints between ranks, point to point over the tier's gloo group, bounded in time.

A *package* is one step directory: a header (the file list with sizes, and the manifest's bytes) and
the data files' bytes, sent straight from a private memory map of each file (no copy on the sender)
in chunks of :data:`CHUNK` bytes. The receiver writes the data files first and commits the manifest
last (an atomic rename, as every ckpt writer does), so a receiver killed mid-way leaves a directory
with no manifest, which no restore ever uses. A sender that has nothing to send (its own write
failed) sends a header saying why; a receiver that cannot write (shared memory full) still drains
the bytes, so that its sender never waits for nothing, and reports the failure.

Every wait ends by a deadline ``timeout`` seconds after the exchange started; a peer that does not
send or take its bytes in time is named in a CollectiveError (gloo closes the group then: the job
must restart).
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from ckpt._comm import describe
from ckpt._transaction import commit_manifest
from ckpt.errors import CheckpointError, CollectiveError, IntegrityError, ManifestError, StorageError
from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage.local import LocalStorage, LocalWriter
from ckpt.tier import safefs
from ckpt.tier.store import manifest_bytes, remove_step

CHUNK = 64 << 20  # bytes per message: bounded receive buffers, whatever the file size
TAG = 31_337  # keeps file bytes apart from the metadata exchanges on the same group
_BUFS: list[torch.Tensor] = []  # the receive double buffer, allocated once per process and reused


@dataclass(slots=True)
class Package:
    """What one rank sends one peer: a step directory's files, or (``ok`` False) why there are none."""

    header: dict[str, Any]
    paths: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(size for _rel, size in self.header.get("files", []))


@dataclass(slots=True)
class Received:
    """What arrived from one sender: committed under the destination, or ``err`` says why not."""

    ok: bool
    err: str = ""
    bytes: int = 0


def failed(message: str) -> Package:
    """A package that carries only the reason there is nothing to send."""
    return Package({"ok": False, "err": message})


def package(step_dir: str, what: str) -> Package:
    """The committed checkpoint in ``step_dir`` as a package; a failed one when it is missing or its
    files do not have the sizes its manifest records (never raises)."""
    try:
        data = manifest_bytes(step_dir)
        m = decode_manifest(data, url=os.path.join(step_dir, MANIFEST_NAME))
        files = sorted(m.files.items())
        paths = [os.path.join(step_dir, rel) for rel, _ in files]
        for path, (_rel, size) in zip(paths, files, strict=True):
            st = safefs.regular(path)  # a link, FIFO or another user's file is not sent (nor waited on)
            if st is None:
                raise IntegrityError(f"{path}: missing or not a regular file of this user; the copy is damaged")
            found = st.st_size
            if found != size:
                raise IntegrityError(f"{path}: {found} bytes, the manifest says {size}; the copy is damaged")
        return Package({"ok": True, "files": [[rel, size] for rel, size in files], "manifest": data}, paths)
    except (OSError, CheckpointError) as e:
        return failed(f"{what}: {describe(e)}")


def _wait(work: Any, deadline: float) -> None:
    work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


def _lost(what: str, rank: int, verb: str, peer: int, e: BaseException, timeout: float) -> CollectiveError:
    text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    how = f"within {timeout:g} s" if "timed out" in text.lower() else f"(connection lost: {text})"
    return CollectiveError(f"{what}: rank {rank} could not {verb} rank {peer} {how}; a rank died, hung or is too "
                           "slow. The memory tier's group is unusable after this: restart the job (the previous "
                           "complete memory checkpoint is still there)")


def _map(path: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    fd = safefs.open_file(path)
    try:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: writable for torch, never written
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _buffers(need: int) -> list[torch.Tensor]:
    size = min(CHUNK, max(need, 1))
    if not _BUFS or _BUFS[0].numel() < size:
        _BUFS[:] = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
    return _BUFS


def exchange(pg: Any, sends: dict[int, Package], recvs: dict[int, str], *, rank: int, timeout: float,
             what: str, slots: Callable[[int, int], Any] | None = None) -> dict[int, Received]:
    """Send each ``sends[peer]`` to its peer and receive one package from each ``recvs`` peer into
    the directory ``recvs[peer]`` (replaced if it exists); collective among the ranks involved.

    ``slots(sender, size)``, when given, returns a :class:`ckpt.tier.slots.Slot` of ``size`` bytes
    that no step links (or None): each data file is then received straight into it (no copy, no
    fresh tmpfs pages) and hard-linked into the directory, as the owner's own memory checkpoints
    are; an OSError from it (shared memory full) fails that copy like a failed write.

    ``pg``: the gloo group (None: not distributed, then both maps must be empty), registered with
    torch or one of ckpt's own (:func:`ckpt._comm.side_group`); peers are ranks of that group, and
    the bytes go through its own ``send`` / ``recv``. Returns what arrived, by sender. Local write
    failures are reported in the result, never raised.

    Raises CollectiveError when a peer does not send or take its bytes within ``timeout`` seconds.
    """
    if not sends and not recvs:
        return {}
    deadline = time.monotonic() + timeout
    maps: list[mmap.mmap] = []
    tensors: list[torch.Tensor] = []
    posted: list[tuple[int, Any]] = []
    for dst, pkg in sorted(sends.items()):
        mine: list[tuple[mmap.mmap, torch.Tensor] | None] = []
        try:
            for path, (_rel, size) in zip(pkg.paths, pkg.header.get("files", []), strict=True):
                mine.append(_map(path, size) if size else None)
        except OSError as e:
            mine, pkg = [], failed(f"{what}: rank {rank} cannot read {e.filename or ''}: {e.strerror or e}")
        head = msgpack.packb(pkg.header, use_bin_type=True)
        out_t = [torch.tensor([len(head)], dtype=torch.int64), torch.frombuffer(bytearray(head), dtype=torch.uint8)]
        for item in mine:
            if item is not None:
                maps.append(item[0])
                out_t += [item[1][o:o + CHUNK] for o in range(0, item[1].numel(), CHUNK)]
        tensors += out_t
        try:
            posted += [(dst, pg.send([t], dst, TAG)) for t in out_t]
        except Exception as e:  # noqa: BLE001 - gloo: the group was closed by an earlier failure
            raise _lost(what, rank, "send to", dst, e, timeout) from e
    out = {src: _receive(pg, src, dest, deadline, rank=rank, timeout=timeout, what=what, slots=slots)
           for src, dest in sorted(recvs.items())}
    for dst, work in posted:
        try:
            _wait(work, deadline)
        except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone
            raise _lost(what, rank, "send to", dst, e, timeout) from e
    posted.clear()
    tensors.clear()  # the views go before the maps (an exported buffer cannot be closed)
    for m in maps:
        with contextlib.suppress(BufferError):
            m.close()
    return out


def _recv(pg: Any, src: int, t: torch.Tensor, deadline: float) -> None:
    _wait(pg.recv([t], src, TAG), deadline)


def _receive(pg: Any, src: int, dest: str, deadline: float, *, rank: int, timeout: float,
             what: str, slots: Callable[[int, int], Any] | None = None) -> Received:
    try:
        n = torch.zeros(1, dtype=torch.int64)
        _recv(pg, src, n, deadline)
        head = torch.empty(int(n.item()), dtype=torch.uint8)
        _recv(pg, src, head, deadline)
    except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone
        raise _lost(what, rank, "receive from", src, e, timeout) from e
    header = msgpack.unpackb(head.numpy().tobytes(), raw=False)
    if not header.get("ok"):
        return Received(False, str(header.get("err", "the sender had nothing to send")))
    files = [(str(rel), int(size)) for rel, size in header["files"]]
    error: BaseException | None = None
    try:  # the directories above the copy: real, ours, 0700 (else nothing is written: drained, reported)
        safefs.makedirs(os.path.dirname(dest))
    except OSError as e:
        error = e if isinstance(e, CheckpointError) else StorageError(f"{dest}: {e}")
    remove_step(dest)
    storage = LocalStorage(dest)
    try:
        chunks = [(i, o, min(CHUNK, size - o)) for i, (_rel, size) in enumerate(files) for o in range(0, size, CHUNK)]
        bufs = _buffers(max((c[2] for c in chunks), default=1))
        writers: dict[int, LocalWriter] = {}
        into: dict[int, Any] = {}  # file index -> the slot it is received into
        for i, (rel, size) in enumerate(files):
            if size == 0:
                error = error or _touch(storage, rel)
            elif slots is not None and error is None and not into:  # one slot per copy: its data file
                try:
                    slot = slots(src, size)
                except OSError as e:  # shared memory full: drained, reported
                    error = StorageError(f"{dest}: no room for {rel} ({e.strerror or e})")
                    continue
                if slot is not None:
                    into[i] = slot

        def target(k: int) -> torch.Tensor:
            i, o, length = chunks[k]
            if error is None and i in into:
                return into[i].base[o : o + length]  # straight into the slot
            return bufs[k % 2][:length]

        work = pg.recv([target(0)], src, TAG) if chunks else None
        for k, (i, o, length) in enumerate(chunks):
            try:
                _wait(work, deadline)
            except Exception as e:  # noqa: BLE001
                raise _lost(what, rank, "receive from", src, e, timeout) from e
            if k + 1 < len(chunks):  # the next chunk arrives while this one is written
                work = pg.recv([target(k + 1)], src, TAG)
            if error is not None:
                continue  # drain: the sender must not wait for a receiver that gave up
            try:
                if i in into:
                    if o + length == files[i][1]:
                        _link(into[i], storage._full(files[i][0]))  # (inside dest, or ManifestError)
                    continue
                if o == 0:
                    writers[i] = storage.open_writer(files[i][0])
                writers[i].write(memoryview(bufs[k % 2][:length].numpy()))  # type: ignore[arg-type]
                if o + length == files[i][1]:
                    writers.pop(i).close()
            except CheckpointError as e:
                error = e
                for w in writers.values():
                    w.abort()
                writers.clear()
        if error is None:
            error = _commit(storage, dest, header, files)
    finally:
        storage.close()
    if error is not None:
        remove_step(dest)
        return Received(False, f"{what}: rank {rank} could not keep rank {src}'s copy: {describe(error)}")
    return Received(True, bytes=sum(size for _rel, size in files))


def _link(slot: Any, path: str) -> None:
    """Hard-link a received slot as ``path`` (exclusive: never replaces a file)."""
    try:
        slot.link_as(path)
    except OSError as e:
        raise StorageError(f"{path}: cannot link the received copy ({e.strerror})") from e


def _touch(storage: LocalStorage, rel: str) -> BaseException | None:
    try:
        storage.open_writer(rel).close()
        return None
    except CheckpointError as e:
        return e


def _commit(storage: LocalStorage, dest: str, header: dict[str, Any], files: list[tuple[str, int]]
            ) -> BaseException | None:
    """Check that the manifest describes exactly the files received, then commit it (last)."""
    try:
        data = bytes(header["manifest"])
        m = decode_manifest(data, url=os.path.join(dest, MANIFEST_NAME))
        if sorted(m.files.items()) != sorted(files):
            raise ManifestError(f"{dest}: the manifest received does not list the files received; the copy is "
                                "not kept")
        commit_manifest(storage, data, overwrite=False)  # the one commit: checked, data names durable, exclusive
        return None
    except (CheckpointError, OSError) as e:
        return e if isinstance(e, CheckpointError) else StorageError(f"{dest}: {e}")


__all__ = ["CHUNK", "TAG", "Package", "Received", "failed", "package", "exchange"]
