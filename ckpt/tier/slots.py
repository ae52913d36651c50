"""Shared-memory files that memory checkpoints are written into in place, reused step after step.

Why: a memory checkpoint written as a new file allocates fresh tmpfs pages each time, and that is
what made it slow (copies into new tmpfs pages ran about an order of magnitude slower than into
pages that exist: measured in docs/BENCHMARKS.md, section "Memory tier on one H200"). A *slot* is
one rank's data file kept between memory checkpoints: ``<rank dir>/.slots/slot-<i>``, holding
exactly the bytes ``ckpt.save`` would write for this rank's pieces (safetensors header, then the
pieces back to back, in the planner's order), preallocated with ``posix_fallocate`` (a full
``/dev/shm`` is an ENOSPC at that point, never a SIGBUS on a mapped write), mapped shared, and
registered as pinned memory when the pieces are on a GPU, so the snapshot's device-to-host copies
land in the file itself at full DMA speed and no byte is copied again. A step commits by
hard-linking the slot into its directory as its data file and writing the manifest last
(:func:`ckpt.save.save_linked`); freeing the step unlinks it.

The rule that keeps committed memory checkpoints intact: a slot is written only while no step
directory links it (``st_nlink == 1``), checked in :meth:`SlotPool.acquire`, the one place slots
are handed out. Any other holder of a link (a step, a resharding view) keeps the slot's bytes as
they are until it lets go. Memory: at most ``keep + 1`` slots per rank (the complete memory
checkpoints kept plus the one being written), and the spare one stays allocated between steps:
that is the point of it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.tier import safefs

SLOTS_DIR = ".slots"
SLOT_NAME = re.compile(r"^slot-(\d+)$")


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Where each tensor of a flat state lies in its one-rank data file (see :func:`plan_layout`)."""

    key: tuple[Any, ...]  # the structure it was planned for: (flat key, dtype, shape) per tensor
    header: bytes
    size: int  # file size in bytes
    offsets: dict[str, int]  # flat key -> byte offset of its data


def raw_layout(size: int) -> SlotLayout:
    """A slot of ``size`` bytes with no header or views (a received copy of a peer's data file)."""
    return SlotLayout((), b"", size, {})


def structure_key(flat: dict[str, Any]) -> tuple[Any, ...]:
    """The tensors' keys, dtypes and shapes, in order: equal keys get the same layout."""
    return tuple((k, v.dtype, tuple(v.shape)) for k, v in flat.items() if isinstance(v, torch.Tensor))


def plan_layout(flat: dict[str, Any]) -> SlotLayout:
    """The data file ``ckpt.save`` writes for ``flat`` on a single rank (header and entry offsets),
    planned by ckpt's own planner. Tensors sharing memory are laid out apart (a slot's views never
    alias, so the save of the snapshot finds no tied keys either)."""
    from ckpt._save_plan import plan_save
    from ckpt.save import build_decl

    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    decl, _items = build_decl(tensors, 0)
    decl.aliases = {}
    plan = plan_save([decl], save_id="slot", split_replicas=True)
    a = plan.assignments[0]
    offsets: dict[str, int] = {}
    size = len(a.header)
    for e in a.entries:
        if e.count is not None:  # a piece split in parts: never on one rank, but then no slot
            raise ValueError(f"{e.key}: planned in parts")
        key = decl.pieces[e.piece].key
        if e.offset % tensors[key].element_size():  # a view of the mapping there could not be typed
            raise ValueError(f"{key}: offset {e.offset} is not aligned for {tensors[key].dtype}")
        offsets[key] = e.offset
        size = max(size, e.offset + e.length)
    return SlotLayout(structure_key(flat), a.header, size, offsets)


class Slot:
    """One mapped slot file. ``views[key]``: the tensor of ``key`` inside the mapping (for the
    layout the slot was last shaped for)."""

    def __init__(self, path: str):
        self.path = path
        self.size = 0
        self.layout: SlotLayout | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.base: torch.Tensor | None = None
        self.registered = False
        self.ident: tuple[int, int] | None = None  # (device, inode) of the file mapped
        self._mm: mmap.mmap | None = None

    def link_as(self, path: str) -> None:
        """Hard-link this slot as ``path`` (a checkpoint's data file), making its directory; exclusive:
        never replaces a file. Raises OSError."""
        safefs.makedirs(os.path.dirname(path))
        safefs.link(self.path, path)

    def linked(self) -> bool:
        """Whether a step directory (or any other holder) links this file: then it is not written."""
        st = safefs.regular(self.path)
        return st is not None and st.st_nlink > 1

    @property
    def base_ptr(self) -> int:
        assert self.base is not None
        return int(self.base.data_ptr())

    def shape_for(self, layout: SlotLayout, pin: bool) -> None:
        """Make the file ``layout.size`` bytes, allocated, mapped, with its header written, and the
        views of ``layout``; pinned (registered with CUDA) when ``pin``. Raises OSError (ENOSPC:
        shared memory full; the slot file is then removed)."""
        same_file = self.identity() == self.ident  # (not: a file replaced under us, to be mapped anew)
        if self.layout is not None and self.layout.key == layout.key and self.size == layout.size and same_file:
            if pin and not self.registered:
                self._register()
            return
        if self.size != layout.size or not same_file:
            self.close()
            try:
                fd = safefs.open_file(self.path, os.O_RDWR | os.O_CREAT)  # never through a link, never a FIFO
                try:
                    os.ftruncate(fd, layout.size)
                    if layout.size:
                        os.posix_fallocate(fd, 0, layout.size)
                    self._mm = _map(fd, layout.size) if layout.size else None
                    st = os.fstat(fd)
                    self.ident = (st.st_dev, st.st_ino)
                finally:
                    os.close(fd)
            except OSError:
                self.close()
                with contextlib.suppress(OSError):
                    safefs.unlink(self.path)  # a full shared memory gets its bytes back (a link: itself removed)
                raise
            self.size = layout.size
            self.base = (torch.frombuffer(self._mm, dtype=torch.uint8) if self._mm is not None
                         else torch.empty(0, dtype=torch.uint8))
        assert self.base is not None
        if layout.header:
            self.base[: len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        self.views = {}
        for key, dtype, shape in layout.key:
            off = layout.offsets[key]
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            self.views[key] = self.base[off : off + n].view(dtype).view(shape)
        self.layout = layout
        if pin and not self.registered:
            self._register()

    def map_existing(self, pin: bool) -> bool:
        """Map the slot file as it is (no layout: its bytes are a committed step's, read only until
        :meth:`shape_for`), pinned when ``pin``; for a restore that reads the mapping in place
        (:func:`ckpt.tier.fastload.load_pieces`). False when the file is gone or empty."""
        self.close()
        try:
            fd = safefs.open_file(self.path, os.O_RDWR)
        except OSError:  # (UnsafePathError too: a link or FIFO is not a slot to map)
            return False
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not size:
                return False
            self._mm = _map(fd, size)
            self.ident = (st.st_dev, st.st_ino)
        except OSError:
            return False
        finally:
            os.close(fd)
        self.size = size
        self.base = torch.frombuffer(self._mm, dtype=torch.uint8)
        if pin:
            self._register()
        return True

    def identity(self) -> tuple[int, int] | None:
        """(device, inode) of the file at the slot's path now: a step's data file linking it has the
        same."""
        st = safefs.regular(self.path)
        return None if st is None else (st.st_dev, st.st_ino)

    def _register(self) -> None:
        """Pin the mapping (``cudaHostRegister``): device-to-host copies into it are then DMA at full
        speed. Best effort: unpinned, the copies still land, more slowly."""
        if self.base is None or not self.size or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.base_ptr, self.size, 0)
        self.registered = int(rc) == 0

    def close(self) -> None:
        """Unpin and unmap (the file stays)."""
        if self.registered and self.base is not None:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()  # no copy may still be landing in pages about to be unpinned
                torch.cuda.cudart().cudaHostUnregister(self.base_ptr)
        self.registered = False
        self.views, self.base, self.layout, self.size, self.ident = {}, None, None, 0, None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped when it dies
                self._mm.close()
        self._mm = None


class SlotPool:
    """This rank's slots under ``root`` (its rank directory): at most ``count`` files."""

    def __init__(self, root: str, count: int):
        self.dir = os.path.join(root, SLOTS_DIR)
        self.count = count
        self._slots: dict[int, Slot] = {}
        self._layouts: dict[tuple[Any, ...], SlotLayout] = {}
        self.allocations = 0  # slot files (re)shaped, here or ahead: tests check the steady state
        self._claimed: int | None = None  # the slot the shaping-ahead thread owns until it is done with it
        self._ahead: threading.Thread | None = None
        self.ahead_error: str | None = None  # why shaping ahead stopped early (e.g. shared memory full)

    def layout(self, flat: dict[str, Any]) -> SlotLayout:
        """The slot layout of ``flat`` (planned once per structure)."""
        key = structure_key(flat)
        got = self._layouts.get(key)
        if got is None:
            self._layouts = {key: plan_layout(flat)}  # one structure at a time: the model's
            got = self._layouts[key]
        return got

    def acquire(self, layout: SlotLayout, *, pin: bool) -> Slot | None:
        """A slot no step links, shaped for ``layout``; None when every slot is linked (the caller
        then writes a new file). Prefers one already of this layout (nothing to allocate); a slot
        being shaped ahead (:meth:`shape_ahead`) is waited for only when no other one is free.
        Raises OSError when shared memory cannot hold it."""
        _discard_foreign(self.dir, directory=True)
        safefs.makedirs(self.dir)
        self.trim()
        free = self._free()
        if not [s for s in free if s.layout is not None and s.layout.key == layout.key] and self._claimed is not None:
            self.join_ahead()  # the slot being shaped for this layout is the one to take
            free = self._free()
        if not free:
            return None
        ready = [s for s in free if s.layout is not None and s.layout.key == layout.key]
        if not ready:
            ready = [s for s in free if _file_size(s.path) == layout.size] or free
            self.allocations += 1
        slot = ready[0]
        slot.shape_for(layout, pin)
        return slot

    def _free(self) -> list[Slot]:
        """The slots no step links and the shaping-ahead thread does not hold, in index order."""
        free = []
        for i in range(self.count):
            if i == self._claimed:
                continue
            s = self._slots.get(i) or Slot(os.path.join(self.dir, f"slot-{i}"))
            self._slots[i] = s
            if _discard_foreign(s.path, directory=False):
                s.close()  # (what was mapped is not this path's file any more)
            if not s.linked():
                free.append(s)
        return free

    def shape_ahead(self, layout: SlotLayout, taken: Slot | None, *, pin: bool, device: Any = None) -> None:
        """Keep one spare slot shaped for ``layout``: when no free slot but ``taken`` (the one just
        handed out: its snapshot is landing, not touched) is ready, shape the next free one on a
        background thread, so that the next memory checkpoint finds its slot allocated, mapped and
        pinned: allocating and pinning a fresh slot costs more than the copies into it (the first
        snapshots of 9.4 GB took ~3 s where a reused slot takes a fraction). One at a time: shaping
        every spare at once (tens of GB of shared memory populated and pinned beside training) held
        a step up for seconds. The same ``keep + 1`` slots as without it; only when they are
        allocated changes. Best effort: a full shared memory stops it (``ahead_error``), and the
        slot is then allocated when needed. ``device``: the CUDA device whose context pins."""
        if self._ahead is not None and self._ahead.is_alive():
            return
        self.join_ahead()
        try:
            _discard_foreign(self.dir, directory=True)
            safefs.makedirs(self.dir)
            free = [s for s in self._free() if s is not taken]
        except OSError as e:  # never the caller's failure: its slot is taken already
            self.ahead_error = f"{type(e).__name__}: {e}"
            return
        if not free or any(s.layout is not None and s.layout.key == layout.key and s.size == layout.size
                           for s in free):
            return
        self._claimed = next(i for i, s in self._slots.items() if s is free[0])
        self._ahead = threading.Thread(target=self._shape_ahead, args=(layout, self._claimed, pin, device),
                                       daemon=True, name="ckpt-memory-tier-slots-ahead")
        self._ahead.start()

    def _shape_ahead(self, layout: SlotLayout, i: int, pin: bool, device: Any) -> None:
        try:
            if pin and device is not None and torch.cuda.is_available():
                torch.cuda.set_device(device)  # the registration's context is the job's device's
            s = self._slots[i]
            if _discard_foreign(s.path, directory=False):
                s.close()
            if not s.linked():  # (a link made since: not ours to write)
                s.shape_for(layout, pin)
                self.allocations += 1
        except Exception as e:  # noqa: BLE001 - best effort: acquire allocates what is missing
            self.ahead_error = f"{type(e).__name__}: {e}"
        finally:
            self._claimed = None

    def join_ahead(self) -> None:
        """Wait for the shaping-ahead thread, if any (the pool is the caller's alone afterwards)."""
        t, self._ahead = self._ahead, None
        if t is not None:
            t.join()
        self._claimed = None

    def map_linked(self, data_file: str, *, pin: bool) -> Slot | None:
        """Map (and pin when ``pin``) the slot that ``data_file`` (a committed step's data file)
        links, ahead of a restore that reads it in place; the slot stays mapped for the snapshots
        that later reuse it (its pinning then costs nothing more). None: no slot of this pool is
        that file (a file written whole, not through a slot)."""
        self.join_ahead()
        st = safefs.regular(data_file)
        if st is None:
            return None
        for i in range(self.count):
            s = self._slots.get(i) or Slot(os.path.join(self.dir, f"slot-{i}"))
            if s.identity() != (st.st_dev, st.st_ino):
                continue
            self._slots[i] = s
            if s.base is None or s.ident != (st.st_dev, st.st_ino):
                if not s.map_existing(pin):
                    return None
            elif pin and not s.registered:  # mapped by a snapshot of this process, not pinned yet
                s._register()
            return s
        return None

    def mapped(self) -> dict[tuple[int, int], torch.Tensor]:
        """The mapping of every mapped slot by (device, inode): a restore reads pieces of the files
        linking them from there (:func:`ckpt.tier.fastload.load_pieces`)."""
        self.join_ahead()
        out: dict[tuple[int, int], torch.Tensor] = {}
        for s in self._slots.values():
            if s.ident is not None and s.base is not None and s.size and s.base.numel() == s.size:
                out[s.ident] = s.base
        return out

    def trim(self) -> None:
        """Remove slot files beyond ``count`` that nothing links any more (a job that kept more copies
        left them, or their step was just freed): memory stays within ``count`` slots."""
        for name in safefs.listdir(self.dir):  # (a link at .slots lists nothing: its target is not ours to trim)
            m = SLOT_NAME.match(name)
            if m is not None and int(m.group(1)) < self.count:
                continue
            path = os.path.join(self.dir, name)
            st = safefs.regular(path)
            with contextlib.suppress(OSError):
                if st is not None and st.st_nlink == 1:
                    safefs.unlink(path)

    def close(self, *, remove: bool = False) -> None:
        """Unmap every slot; ``remove``: delete the files too (a linked one stays with its step)."""
        self.join_ahead()
        for s in self._slots.values():
            s.close()
        self._slots = {}
        if remove:
            for name in safefs.listdir(self.dir):
                with contextlib.suppress(OSError):
                    safefs.unlink(os.path.join(self.dir, name))
            with contextlib.suppress(OSError):
                safefs.rmdir(self.dir)


def _map(fd: int, size: int) -> mmap.mmap:
    """A shared mapping of ``size`` bytes of ``fd`` with its page tables filled at once
    (``MAP_POPULATE``): populating then registering is markedly faster than letting the
    registration fault the pages in itself (measured in docs/BENCHMARKS.md, section "Memory tier,
    second pass")."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def _file_size(path: str) -> int:
    st = safefs.regular(path)
    return -1 if st is None else st.st_size


def _discard_foreign(path: str, *, directory: bool) -> bool:
    """Remove what is at ``path`` when it is not the pool's own kind of entry (a link, a FIFO, a
    directory where a slot file belongs, another user's file): the slot directory is the tier's own,
    so whatever was planted there goes (a link itself, never what it points to). True if removed."""
    st = safefs.lstat(path)
    if st is None:
        return False
    ours = st.st_uid == os.geteuid() and (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode))
    if ours:
        return False
    safefs.rmtree(path)
    return True


__all__ = ["SLOTS_DIR", "SLOT_NAME", "SlotLayout", "raw_layout", "structure_key", "plan_layout", "Slot", "SlotPool"]
