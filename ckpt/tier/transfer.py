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

Between ranks of one host (``local`` peers: the same host name and shared-memory base, see
:func:`ckpt.tier.nodes.host_peers`) no file byte goes through gloo: the header names the sender's
step directory (relative to the run directory both trust) and the receiver copies the files itself
on several threads, every piece's CRC checked as it lands (:mod:`ckpt.tier.localcopy`), then
commits as above and answers one small message (kept or not). The sender waits for that answer
before the exchange returns, so its files stay as they are while they are read, as the streamed
path keeps them until their bytes left. ``CKPT_TIER_LOCAL_COPY=0`` (or no ``local`` peers) keeps
every copy on the streamed path.
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from ckpt._comm import Comm, _grace, describe
from ckpt._io import byte_view
from ckpt._transaction import commit_manifest
from ckpt.errors import CheckpointError, CollectiveError, IntegrityError, ManifestError, StorageError, UnsafePathError
from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage.local import LocalStorage, LocalWriter
from ckpt.tier import safefs
from ckpt.tier.localcopy import FileCopy, copy_verified
from ckpt.tier.pace import Pace
from ckpt.tier.slots import Slot, raw_layout
from ckpt.tier.store import manifest_bytes, remove_step

CHUNK = 64 << 20  # bytes per message: bounded receive buffers, whatever the file size
TAG = 31_337  # keeps file bytes apart from the metadata exchanges on the same group
ACK_TAG = TAG + 1  # a same-host receiver's answer (1: kept, 0: not), apart from the files' messages
_BUFS: list[torch.Tensor] = []  # the receive double buffer, allocated once per process and reused


@dataclass(slots=True)
class Package:
    """What one rank sends one peer: a step directory's files, or (``ok`` False) why there are none."""

    header: dict[str, Any]
    paths: list[str] = field(default_factory=list)
    dir: str = ""  # the step directory (a same-host peer reads the files from there)

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
        return Package({"ok": True, "files": [[rel, size] for rel, size in files], "manifest": data}, paths,
                       step_dir)
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


def after_copy(timeout: float) -> float:
    """The timeout of the metadata exchange that follows a copy (:func:`exchange`): a grace longer than
    the copy's.

    Why: a rank whose copy waits for a failed peer gives up at the copy's deadline, posts what it saw
    (:func:`_tell_the_others`) and never reports in the exchange after; its parent there, waiting with
    the same deadline, named it instead of the failed peer (a chain 0 -> 1 -> 2 -> 3 with rank 1
    failing before its copy: rank 2 named rank 3; found by the generated tier audit). A grace later
    the verdict is posted, and the parent raises it (:meth:`ckpt._comm.Comm._heard_from_below`)."""
    return timeout + _grace(timeout)


def exchange(pg: Any, sends: dict[int, Package], recvs: dict[int, str], *, rank: int, timeout: float,
             what: str, slots: Callable[[int, int], Any] | None = None, local: Collection[int] = (),
             run_dir: str | None = None, threads: int = 4,
             pace: Pace | None = None) -> dict[int, Received]:
    """Send each ``sends[peer]`` to its peer and receive one package from each ``recvs`` peer into
    the directory ``recvs[peer]`` (replaced if it exists); collective among the ranks involved.

    ``slots(sender, size)``, when given, returns a :class:`ckpt.tier.slots.Slot` of ``size`` bytes
    that no step links (or None): each data file is then received straight into it (no copy, no
    fresh tmpfs pages) and hard-linked into the directory, as the owner's own memory checkpoints
    are; an OSError from it (shared memory full) fails that copy like a failed write.

    ``local``: peers on this host (same shared memory); with ``run_dir`` (the trusted run directory
    the packages lie in, the same on both sides) a package for one of them carries only its place,
    and the peer copies the files on ``threads`` threads, checking every piece's CRC (see the module
    docstring). The receiver follows what each header says, so ranks need not agree on ``local``.
    ``pace(nbytes, deadline)``, when given, is called before each such copy's reads (the tier's bandwidth
    budget, :mod:`ckpt.tier.pace`).

    ``pg``: the gloo group (None: not distributed, then both maps must be empty), registered with
    torch or one of ckpt's own (:func:`ckpt._comm.side_group`); peers are ranks of that group, and
    the bytes go through its own ``send`` / ``recv``. Returns what arrived, by sender. Local write
    failures are reported in the result, never raised.

    Raises CollectiveError when a peer does not send or take its bytes within ``timeout`` seconds,
    having posted it as the group's verdict (see :func:`_tell_the_others`).
    """
    if not sends and not recvs:
        return {}
    try:
        return _exchange(pg, sends, recvs, rank=rank, timeout=timeout, what=what, slots=slots, local=local,
                         run_dir=run_dir, threads=threads, pace=pace)
    except CollectiveError as e:
        told = _tell_the_others(pg, e, timeout)
        if told is None:
            raise
        raise told from e


def _tell_the_others(pg: Any, e: CollectiveError, timeout: float) -> CollectiveError | None:
    """Post ``e`` (which names the peer this rank lost) as the verdict about ``pg``'s ranks, or return
    the verdict another rank posted first, to raise instead (:meth:`ckpt._comm.Comm.post_or_heard`).

    Why: only the ranks paired with a failed rank in an exchange see it fail; they leave the tier's
    protocol with their error while the others go on to the next exchange (the agreement, the fetch
    results) and lose *their* parent there, an innocent rank (the coordinator, when it was the failed
    rank's pair). Without a verdict they named that innocent rank; with one, every rank names the
    failed one (:meth:`ckpt._comm.Comm._verdict`), as after a failure inside an exchange."""
    try:
        return Comm(pg, timeout=timeout).post_or_heard(e, timeout)
    except Exception:  # noqa: BLE001 - best effort: each rank says what it saw itself
        return None


def _exchange(pg: Any, sends: dict[int, Package], recvs: dict[int, str], *, rank: int, timeout: float,
              what: str, slots: Callable[[int, int], Any] | None, local: Collection[int], run_dir: str | None,
              threads: int, pace: Pace | None) -> dict[int, Received]:
    deadline = time.monotonic() + timeout
    maps: list[mmap.mmap] = []
    tensors: list[torch.Tensor] = []
    posted: list[tuple[int, Any]] = []
    acks: list[tuple[int, Any]] = []
    for dst, pkg in sorted(sends.items()):
        place = _place(pkg, run_dir) if dst in local else None
        mine: list[tuple[mmap.mmap, torch.Tensor] | None] = []
        try:
            for path, (_rel, size) in zip(pkg.paths, pkg.header.get("files", []), strict=True):
                mine.append(_map(path, size) if size and place is None else None)
        except OSError as e:
            mine, pkg = [], failed(f"{what}: rank {rank} cannot read {e.filename or ''}: {e.strerror or e}")
        header = pkg.header if place is None or not pkg.header.get("ok") else dict(pkg.header, local=place)
        head = msgpack.packb(header, use_bin_type=True)
        out_t = [torch.tensor([len(head)], dtype=torch.int64), torch.frombuffer(bytearray(head), dtype=torch.uint8)]
        for item in mine:
            if item is not None:
                maps.append(item[0])
                out_t += [item[1][o:o + CHUNK] for o in range(0, item[1].numel(), CHUNK)]
        tensors += out_t
        try:
            posted += [(dst, pg.send([t], dst, TAG)) for t in out_t]
            if "local" in header:  # the peer reads the files itself: its answer says when it is done with them
                ack = torch.zeros(1, dtype=torch.int64)
                tensors.append(ack)
                acks.append((dst, pg.recv([ack], dst, ACK_TAG)))
        except Exception as e:  # noqa: BLE001 - gloo: the group was closed by an earlier failure
            raise _lost(what, rank, "send to", dst, e, timeout) from e
    out = {src: _receive(pg, src, dest, deadline, rank=rank, timeout=timeout, what=what, slots=slots,
                         run_dir=run_dir, threads=threads, pace=pace)
           for src, dest in sorted(recvs.items())}
    for dst, work in posted + acks:
        try:
            _wait(work, deadline)
        except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone
            raise _lost(what, rank, "send to", dst, e, timeout) from e
    posted.clear()
    acks.clear()
    tensors.clear()  # the views go before the maps (an exported buffer cannot be closed)
    for m in maps:
        with contextlib.suppress(BufferError):
            m.close()
    return out


def _place(pkg: Package, run_dir: str | None) -> str | None:
    """Where ``pkg``'s step directory lies relative to ``run_dir`` (None: not below it, send the bytes)."""
    if run_dir is None or not pkg.dir:
        return None
    rel = os.path.relpath(os.path.abspath(pkg.dir), os.path.abspath(run_dir))
    return None if rel == os.curdir or rel.startswith(os.pardir) or os.path.isabs(rel) else rel


def _recv(pg: Any, src: int, t: torch.Tensor, deadline: float) -> None:
    _wait(pg.recv([t], src, TAG), deadline)


def _receive(pg: Any, src: int, dest: str, deadline: float, *, rank: int, timeout: float,
             what: str, slots: Callable[[int, int], Any] | None = None, run_dir: str | None = None,
             threads: int = 4, pace: Pace | None = None) -> Received:
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
    if "local" in header:  # a peer of this host: the files are read from its step directory, then it is answered
        got = _receive_local(src, dest, header, deadline, rank=rank, what=what, slots=slots, run_dir=run_dir,
                             threads=threads, pace=pace)
        return _answer(pg, src, got, deadline, rank=rank, timeout=timeout, what=what)
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
                except Exception as e:  # noqa: BLE001 - any other failure of this rank's slot: drained, reported
                    error = StorageError(f"{dest}: no slot for {rel} ({type(e).__name__}: {e})")
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


def _answer(pg: Any, src: int, got: Received, deadline: float, *, rank: int, timeout: float, what: str) -> Received:
    """Tell a same-host sender that its files are no longer read (1: the copy was kept, 0: not); ``got``."""
    answer = torch.tensor([int(got.ok)], dtype=torch.int64)
    try:
        _wait(pg.send([answer], src, ACK_TAG), deadline)
    except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone
        raise _lost(what, rank, "answer", src, e, timeout) from e
    return got


def _receive_local(src: int, dest: str, header: dict[str, Any], deadline: float, *, rank: int, what: str,
                   slots: Callable[[int, int], Any] | None, run_dir: str | None, threads: int,
                   pace: Pace | None = None) -> Received:
    """Keep rank ``src``'s copy by reading its files from its step directory (same host): into a slot
    from ``slots`` (or a new file), every piece's CRC checked, linked, the manifest committed last."""
    files = [(str(rel), int(size)) for rel, size in header["files"]]
    error: BaseException | None = None
    fresh: list[Slot] = []  # files made for this copy (no slot): unmapped at the end
    storage: LocalStorage | None = None
    try:
        src_dir = os.path.join(_trusted(run_dir, what), _below(header.get("local"), "the sender's step directory"))
        safefs.makedirs(os.path.dirname(dest))  # the directories above the copy: real, ours, 0700
        remove_step(dest)
        storage = LocalStorage(dest)
        m = decode_manifest(bytes(header["manifest"]), url=os.path.join(src_dir, MANIFEST_NAME))
        copies: list[FileCopy] = []
        into: dict[str, Slot] = {}  # file name -> the reused slot it is copied into
        for rel, size in files:
            full = storage._full(_below(rel, "a data file"))  # (inside dest, or ManifestError)
            if size == 0:
                if (bad := _touch(storage, rel)) is not None:
                    raise bad
                continue
            slot = slots(src, size) if slots is not None and not into else None  # one slot per copy, as above
            if slot is None:
                safefs.makedirs(os.path.dirname(full))
                slot = Slot(full)
                fresh.append(slot)
                slot.shape_for(raw_layout(size), pin=False)  # (ENOSPC: an OSError, the copy not kept)
            else:
                into[rel] = slot
            assert slot.base is not None
            copies.append(FileCopy(rel, size, os.path.join(src_dir, rel), byte_view(slot.base)))
        try:
            copy_verified(copies, m, threads=threads, deadline=deadline, what=f"{what}: rank {src}'s copy", pace=pace)
        finally:
            for c in copies:
                c.dst.release()
        for rel, slot in into.items():
            _link(slot, storage._full(rel))
        error = _commit(storage, dest, header, files)
    except Exception as e:  # noqa: BLE001 - this rank's own failure to keep the copy: reported, never raised
        error = e if isinstance(e, CheckpointError) else StorageError(
            f"{dest}: {e.strerror or e}" if isinstance(e, OSError) else f"{dest}: {type(e).__name__}: {e}")
    finally:
        for slot in fresh:
            slot.close()
        if storage is not None:
            storage.close()
    if error is not None:
        remove_step(dest)
        return Received(False, f"{what}: rank {rank} could not keep rank {src}'s copy: {describe(error)}")
    return Received(True, bytes=sum(size for _rel, size in files))


def _trusted(run_dir: str | None, what: str) -> str:
    if run_dir is None:
        raise StorageError(f"{what}: the sender named a copy on this host but this rank was given no run directory "
                           "to read it from; pass run_dir to exchange (or unset the sender's local peers)")
    return run_dir


def _below(rel: Any, what: str) -> str:
    """``rel`` when it is a plain relative path (no ``..``, not absolute): else UnsafePathError."""
    if (not isinstance(rel, str) or not rel or os.path.isabs(rel) or os.path.normpath(rel) != rel
            or rel.split(os.sep)[0] == os.pardir):
        raise UnsafePathError(f"{rel!r}: {what} must be a plain path below the memory tier's run directory; the "
                              f"sender's header is not the tier's, nothing was read: {safefs.ADVICE}")
    return rel


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


__all__ = ["after_copy", "CHUNK", "TAG", "ACK_TAG", "Package", "Received", "failed", "package", "exchange"]
