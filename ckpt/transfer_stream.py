"""``ckpt.transfer_iter``: a live transfer as a stream of ``(name, tensor)`` pairs, wave by wave.

RL refit hands weights to an inference engine whose ``load_weights(iterable)`` takes whole tensors
by Hugging Face name, one at a time, and that has no room for a second copy of the model. Here the
receiver states the names it wants (or all), the senders hold any layout :func:`ckpt.transfer`
takes, and the tensors arrive in **waves** of at most ``stream_bytes`` of destination tensors: each
wave is one :func:`ckpt.transfer` of the senders' pieces into fresh tensors (bucketed, pipelined,
checked as usual), and its tensors are handed out only after the wave committed on every rank. The
receiver's memory is one wave plus the transfer's buffers, whatever the model's size.

Names: without ``names`` a wanted name is a source key (after ``rename``). With ``names`` (a
:data:`ckpt.hf.mapping.Map`: destination name -> runs over source keys, as the Hugging Face adapters'
``hf_map`` gives), a destination tensor is assembled from runs of one or more source tensors: a
stacked expert tensor becomes per-expert tensors, two tensors become one fused ``gate_up_proj``.

The stream is collective: every rank of ``group`` iterates it to the end (a rank that only sends
gets no pairs). A rank that stops early leaves the others waiting until ``timeout``, then every rank
raises :class:`~ckpt.errors.CollectiveError`. A failure raises from the iterator on every rank before
any tensor of the failing wave is yielded; the pairs of earlier waves were correct, but the version
is incomplete: an engine must not serve it until the iterator finished.

Delta (``delta=True`` with a :class:`~ckpt.transfer.TransferState` per rank kept across streams): a
destination tensor all of whose source tensors are unchanged on every sender since the last stream
that finished on every rank with the same catalog is not sent and not yielded (the engine keeps the
one it has); ``stats.bytes_skipped`` counts them. A stream that does not finish forgets that
(the next one sends everything).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import torch

from ckpt._comm import Comm, raise_payload
from ckpt._digest import digests
from ckpt._dtypes import dtype_from_name, dtype_name
from ckpt._save_plan import PieceDecl
from ckpt._state import TensorItem
from ckpt._transfer_coord import exchange
from ckpt.errors import CollectiveError, MismatchError, StateError
from ckpt.hf.mapping import Map, Run
from ckpt.shards import Box, Flat
from ckpt.transfer import (
    DEFAULT_TIMEOUT_S,
    MIN_PART,
    Options,
    Rename,
    TransferResult,
    TransferState,
    after_agreement,
    check_options,
    declared,
    pick_error,
    rank_payload,
    run_items,
)

ALL = "all"  # ``want=ALL``: every tensor the senders hold (every name of ``names``)
DEFAULT_STREAM_BYTES = 512 << 20  # verl's bucket size for refit


@dataclass(slots=True)
class StreamStats:
    """What a finished stream did. Byte counts are over all ranks except ``rank_*``."""

    version: int = 0
    waves: int = 0
    tensors: int = 0  # pairs this rank received
    bytes_sent: int = 0
    bytes_local: int = 0
    bytes_skipped: int = 0  # destination bytes not sent: unchanged since the last stream (delta)
    tensors_skipped: int = 0  # this rank's wanted tensors not yielded: unchanged (delta)
    rank_received: int = 0
    peak_wave_bytes: int = 0  # the largest wave this rank held at once
    seconds: float = 0.0
    results: list[TransferResult] = field(default_factory=list)
    state: TransferState | None = None  # the state passed in (or made, for delta), updated when the stream finished


@dataclass(frozen=True, slots=True)
class _Want:
    """One destination tensor: its name, dtype, shape and elements as runs over source keys."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


class TransferStream:
    """The iterator :func:`transfer_iter` returns; ``stats`` is filled as it runs."""

    def __init__(self, src: dict[str, Any] | None, want: Iterable[str] | str | None, *, group: Any, names: Map | None,
                 rename: Rename, dtype: torch.dtype | None, device: torch.device | str | None,
                 stream_bytes: int, opts: Options, state: TransferState | None, delta: bool = False):
        if delta and state is None:
            state = TransferState()
        self._args = (src, want, group, names, rename, dtype, device, stream_bytes, opts, state, delta)
        self.stats = StreamStats(state=state)
        self._started = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise StateError("a transfer stream is iterated once; call transfer_iter again for the next version")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        src, want, group, names, rename, dtype, device, stream_bytes, opts, state, delta = self._args
        t0 = time.perf_counter()
        finished = False
        try:
            yield from self._waves(src, want, group, names, rename, dtype, device, stream_bytes, opts, state, delta)
            finished = True
        finally:
            if state is not None and not finished:
                # Receivers may hold tensors of this unfinished version: nothing is "unchanged since
                # the last stream" any more, so the next delta stream sends everything.
                state.fingerprint = None
        self.stats.seconds = time.perf_counter() - t0

    def _waves(self, src: dict[str, Any] | None, want: Iterable[str] | str | None, group: Any, names: Map | None,
               rename: Rename, dtype: torch.dtype | None, device: torch.device | str | None, stream_bytes: int,
               opts: Options, state: TransferState | None, delta: bool) -> Iterator[tuple[str, torch.Tensor]]:
        comm = Comm(group, timeout=opts.timeout)
        err: dict[str, Any] | None = None
        srcs: list[TensorItem] = []
        decl: dict[str, Any] = {}
        hashes: list[bytes] = []
        try:
            check_options(opts)
            srcs, _ = declared(src, None, rename)
            decl = {"cat": [[i.key, i.dtype, list(i.global_shape)] for i in srcs], "want": _want_wire(want),
                    "dtype": dtype_name(dtype) if dtype is not None else None, "v": opts.version,
                    "last": state.version if state is not None else 0, "delta": None}
            if delta:
                assert state is not None
                hashes = digests([i.local for i in srcs])
                decl["delta"] = {"fp": state.fingerprint,
                                 "s": [PieceDecl(i.key, i.dtype, i.global_shape, i.region).to_wire() for i in srcs],
                                 "u": [k < len(state.src_hashes) and h == state.src_hashes[k]
                                       for k, h in enumerate(hashes)]}
        except Exception as e:  # noqa: BLE001 - reaches every rank, typed, naming this one
            err = rank_payload(e, comm.who)
        mine = _catalog(comm, err or decl, names, stream_bytes, opts.timeout)
        self.stats.bytes_skipped, self.stats.tensors_skipped = int(mine["skipped"]), int(mine["mine_skipped"])
        waves = [[_Want(w[0], w[1], tuple(w[2]), tuple(Run(*r) for r in w[3])) for w in wave] for wave in mine["waves"]]
        shapes = {k: tuple(s) for k, s in mine["shapes"].items()}
        ver = int(mine["version"])
        wave_opts = replace(opts, version=ver)
        for w in range(int(mine["n"])):
            wants = waves[w] if w < len(waves) else []
            outs: list[torch.Tensor] = []
            items: list[TensorItem] = []
            try:  # this rank's own failure (the device, memory for the wave) goes to every rank in the wave's plan
                dev = torch.device(device) if device is not None else _default_device(srcs)
                outs = [torch.empty(x.shape, dtype=dtype_from_name(x.dtype), device=dev) for x in wants]
                items = [it for x, out in zip(wants, outs, strict=True) for it in _pieces(x, out, shapes)]
            except Exception as e:  # noqa: BLE001 - raised alone, it left the others waiting out the timeout
                err = rank_payload(e, comm.who)
            try:
                res = run_items(comm, group, srcs, items, wave_opts, None, err, tag=f"wave {w} of {mine['n']}")
            except CollectiveError as e:
                if not after_agreement(e) or w + 1 == int(mine["n"]):
                    raise
                # this rank alone failed writing a wave every rank agreed on: its tensors are not handed out,
                # and the error goes to every rank in the next wave's plan exchange (raised alone, it left the
                # others waiting there until the timeout)
                err = rank_payload(e, comm.who)
                continue
            self._count(res, sum(x.nbytes for x in wants))
            for x, out in zip(wants, outs, strict=True):
                self.stats.tensors += 1
                yield x.name, out
            del outs, items  # the consumer holds what it kept; this wave's memory is released here
        if state is not None:
            state.version = ver
            # (a stream without delta hashes nothing: the next delta stream has nothing to compare with)
            state.fingerprint, state.src_hashes = (mine["fp"], hashes) if delta else (None, [])
        self.stats.version = ver

    def _count(self, res: TransferResult, wave_bytes: int) -> None:
        s = self.stats
        s.waves += 1
        s.bytes_sent += res.bytes_sent
        s.bytes_local += res.bytes_local
        s.rank_received += res.rank_received
        s.peak_wave_bytes = max(s.peak_wave_bytes, wave_bytes)
        s.results.append(res)


def transfer_iter(src: dict[str, Any] | None, want: Iterable[str] | str | None = None, *, group: Any = None,
                  names: Map | None = None, rename: Rename = None, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, stream_bytes: int = DEFAULT_STREAM_BYTES,
                  bucket_bytes: int | None = None, window: int | None = None,
                  timeout: float | None = DEFAULT_TIMEOUT_S, version: int | None = None, checksum: bool = False,
                  state: TransferState | None = None, min_part: int = MIN_PART, delta: bool = False
                  ) -> TransferStream:
    """Stream the tensors this rank wants as ``(name, tensor)`` pairs, moved live from the senders.

    Collective over ``group``: every rank iterates the result to the end. ``src`` as for
    :func:`ckpt.transfer` (None: this rank only receives). ``want``: the destination names this rank
    wants, in the order to yield them; :data:`ALL` for every one; None (or empty) on a rank that only
    sends. ``names``: destination name -> runs over source keys (a Hugging Face adapter's
    ``hf_map``); without it destination names are source keys. ``dtype``: convert on receive (default:
    the senders' dtype); ``device``: where the tensors are made (default: where this rank's source
    tensors are, else CPU). ``stream_bytes``: the most bytes of destination tensors one wave holds (a
    tensor larger than that travels alone). ``delta``: a wanted tensor whose source tensors are all
    unchanged on every sender since the last stream with ``state`` that finished (same catalog: the
    senders' pieces and every rank's wanted tensors) is neither sent nor yielded, the engine keeps
    its own (``stats.bytes_skipped``); needs a ``state`` per rank kept across streams (one is made
    and kept in ``stats.state`` if None). The other arguments are :func:`ckpt.transfer`'s.

    Each yielded tensor is new and whole, the caller's to keep; it is yielded only after its wave
    committed on every rank. ``.stats`` (:class:`StreamStats`) sums the waves.

    Raises (from the iterator, on every rank): MismatchError for a wanted name nobody sends or that
    ``names`` does not define, StateError for bad arguments, and every error of :func:`ckpt.transfer`.

    Example::

        stream = ckpt.transfer_iter(trainer_shards if is_trainer else None,
                                    ckpt.transfer_stream.ALL if is_rollout else None, names=adapter.hf_map(cfg))
        engine.load_weights(iter(stream)) if is_rollout else list(stream)
    """
    if stream_bytes < 1:
        raise StateError(f"stream_bytes must be at least 1, got {stream_bytes}")
    # fresh tensors per wave, handed out only after it committed: nothing to stage (in_place); the
    # wanted dtype is the receiver's choice (cast)
    opts = Options(bucket_bytes=bucket_bytes, window=window, timeout=timeout, version=version, checksum=checksum,
                      cast=True, in_place=True, min_part=min_part)
    return TransferStream(src, want, group=group, names=names, rename=rename, dtype=dtype, device=device,
                          stream_bytes=stream_bytes, opts=opts, state=state, delta=bool(delta))


def _want_wire(want: Iterable[str] | str | None) -> list[str] | str | None:
    if want is None or want == ALL:
        return want
    if isinstance(want, str):
        raise StateError(f"want must be a list of names, ckpt.transfer_stream.ALL or None, got the string {want!r}")
    out = list(want)
    bad = [w for w in out if not isinstance(w, str)]
    if bad:
        raise StateError(f"want must hold tensor names (str), got {bad[0]!r}")
    return out or None


def _default_device(srcs: list[TensorItem]) -> torch.device:
    return srcs[0].local.device if srcs else torch.device("cpu")


def _catalog(comm: Comm, mine: dict[str, Any], names: Map | None, stream_bytes: int,
             timeout: float | None) -> dict[str, Any]:
    """The coordinator learns what every sender holds and what every receiver wants, and hands each
    rank its waves (the number of waves is the same on every rank: the largest)."""
    def reply(got: list[dict[str, Any]]) -> list[Any]:
        bad = pick_error(got)
        if bad is not None:
            return [bad] * comm.world
        try:
            return _plan_waves(got, names, stream_bytes)
        except Exception as e:  # noqa: BLE001 - names the tensor and rank itself
            return [rank_payload(e, None)] * comm.world

    out = exchange(comm, mine, reply, timeout=timeout, what="transfer stream")
    if "err" in out:
        raise_payload(out)
    return out


def _plan_waves(got: list[dict[str, Any]], names: Map | None, stream_bytes: int) -> list[dict[str, Any]]:
    """Per rank: its wanted destination tensors resolved against the senders' catalog, cut into waves."""
    held: dict[str, tuple[str, list[int]]] = {}
    for g in got:
        for key, dt, shape in g["cat"]:
            held.setdefault(key, (dt, shape))
    versions = {g["v"] for g in got if g["v"] is not None}
    if len(versions) > 1:
        raise StateError(f"ranks give different transfer versions {sorted(versions)}; pass the same one (or none)")
    ver = next(iter(versions)) if versions else max(int(g["last"]) for g in got) + 1
    wanted = [_wanted(rank, g, held, names) for rank, g in enumerate(got)]
    fp, keep = _unchanged(got, wanted)
    kept = [[w for w in ws if not keep(w)] for ws in wanted]
    per_rank = [_cut(ws, stream_bytes) for ws in kept]
    skipped = sum(w.nbytes for ws in wanted for w in ws if keep(w))
    n = max((len(w) for w in per_rank), default=0)
    shapes = {k: v[1] for k, v in held.items()}
    return [{"version": ver, "n": n, "waves": w, "shapes": shapes, "fp": fp, "skipped": skipped,
             "mine_skipped": len(ws) - len(k)} for w, ws, k in zip(per_rank, wanted, kept, strict=True)]


def _unchanged(got: list[dict[str, Any]], wanted: list[list[_Want]]) -> tuple[str | None, Any]:
    """Delta: the catalog's fingerprint and ``keep(want)``, true for a wanted tensor all of whose
    source tensors are unchanged on every sender, where every rank's last finished stream had this
    same catalog (else nothing is kept: some receiver may not hold the last version)."""
    modes = {g["delta"] is not None for g in got}
    if len(modes) > 1:
        raise StateError(f"ranks disagree on delta: {[r for r, g in enumerate(got) if g['delta'] is not None]} pass "
                         "delta=True, the others not; pass the same on every rank")
    if modes != {True}:
        return None, lambda w: False
    what = [[g["delta"]["s"] for g in got],
            [[[w.name, w.dtype, list(w.shape), [[r.name, r.start, r.numel] for r in w.runs]] for w in ws]
             for ws in wanted]]
    fp = hashlib.blake2b(msgpack.packb(what, use_bin_type=True), digest_size=16).hexdigest()
    if any(g["delta"]["fp"] != fp for g in got):
        return fp, lambda w: False
    changed = {p[0] for g in got for p, same in zip(g["delta"]["s"], g["delta"]["u"], strict=True) if not same}
    return fp, lambda w: all(r.name not in changed for r in w.runs)


def _wanted(rank: int, g: dict[str, Any], held: dict[str, tuple[str, list[int]]], names: Map | None) -> list[_Want]:
    """The destination tensors ``g``'s rank wants, resolved, in the order it asked for them."""
    want = g["want"]
    if want is None:
        return []
    order = list(names if names is not None else held) if want == ALL else want
    return [_resolve(rank, name, held, names, g["dtype"]) for name in order]


def _cut(wants: list[_Want], stream_bytes: int) -> list[list[list[Any]]]:
    """Wanted tensors in waves of at most ``stream_bytes`` (a larger one alone), in wire form."""
    waves: list[list[list[Any]]] = []
    size = stream_bytes
    for w in wants:
        if not waves or size + w.nbytes > stream_bytes:
            waves.append([])
            size = 0
        waves[-1].append([w.name, w.dtype, list(w.shape), [[r.name, r.start, r.numel] for r in w.runs]])
        size += w.nbytes
    return waves


def _resolve(rank: int, name: str, held: dict[str, tuple[str, list[int]]], names: Map | None,
             dtype: str | None) -> _Want:
    """A wanted destination name as runs over held source keys; MismatchError naming it when it cannot be."""
    if names is None:
        if name not in held:
            raise MismatchError(f"tensor {name!r}: rank {rank} wants it but no sender holds it; check the names "
                                "(or pass names= to map them)")
        dt, shape = held[name]
        return _Want(name, dtype or dt, tuple(shape), (Run(name, 0, math.prod(shape)),))
    target = names.get(name)
    if target is None:
        raise MismatchError(f"tensor {name!r}: rank {rank} wants it but the name map does not define it")
    missing = sorted({r.name for r in target.runs if r.name not in held})
    if missing:
        raise MismatchError(f"tensor {name!r}: rank {rank} wants it, made of {missing}, which no sender holds; "
                            "check the name map against the senders' keys")
    dts = {held[r.name][0] for r in target.runs}
    if dtype is None and len(dts) > 1:
        raise MismatchError(f"tensor {name!r} joins source tensors of dtypes {sorted(dts)}; pass dtype= to convert")
    return _Want(name, dtype or dts.pop(), tuple(target.shape), tuple(target.runs))


def _pieces(w: _Want, out: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> list[TensorItem]:
    """The destination pieces that fill ``out``: the whole source tensor as a box when the destination
    is one whole source tensor, else a flat range of a source tensor per run."""
    if len(w.runs) == 1:
        r = w.runs[0]
        shape = shapes[r.name]
        if r.start == 0 and r.numel == math.prod(shape) and tuple(shape) == w.shape:
            return [TensorItem(r.name, out, w.dtype, shape, Box((0,) * len(shape), shape))]
    flat = out.view(-1)
    items, at = [], 0
    for r in w.runs:
        items.append(TensorItem(r.name, flat[at: at + r.numel], w.dtype, shapes[r.name],
                                Flat(r.start, r.start + r.numel)))
        at += r.numel
    return items


__all__ = ["ALL", "DEFAULT_STREAM_BYTES", "StreamStats", "TransferStream", "transfer_iter"]
