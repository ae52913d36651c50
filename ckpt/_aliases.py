"""Tied and shared tensors: one tensor under several keys is written once.

An embedding tied to the LM head, or any tensor placed under two keys, reaches ``ckpt.save`` as
the same memory under two names. Each rank finds such aliases among its own pieces
(:func:`find_aliases`: same storage, offset, shape, strides, dtype, global shape and region, for
every piece of both keys) and declares them. The coordinator accepts an alias only where it holds
on every rank that declares the key (:func:`agree`): a key tied on one rank and a separate copy on
another is simply stored twice, never lost. Accepted aliases are left out of the plan on every rank
(:func:`without`), and the manifest gives the alias the same shards (files, offsets, checksums) as
the tensor it aliases, so any reader loads it like any other tensor, and ``load`` fills both keys.
"""

from __future__ import annotations

from typing import Any

from ckpt._save_plan import PieceDecl, RankDecl
from ckpt._state import TensorItem


def _identity(item: TensorItem) -> tuple[Any, ...] | None:
    """Where the piece's bytes are in memory; None for an empty piece (all share address 0)."""
    t = item.local
    if t.numel() == 0:
        return None
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), tuple(t.stride()), t.dtype)


def find_aliases(items: list[TensorItem]) -> dict[str, str]:
    """``{alias key: first key}`` for keys whose every piece is the same memory, region, dtype and
    global shape as another key's (the first such key in state order)."""
    by_key: dict[str, list[TensorItem]] = {}
    for it in items:
        by_key.setdefault(it.key, []).append(it)
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for key, pieces in by_key.items():
        ids = [_identity(p) for p in pieces]
        if any(i is None for i in ids):
            continue
        sig = (pieces[0].dtype, pieces[0].global_shape,
               tuple(sorted((repr(p.region), i) for p, i in zip(pieces, ids, strict=True))))
        if sig in first:
            out[key] = first[sig]
        else:
            first[sig] = key
    return out


def agree(decls: list[RankDecl]) -> dict[str, str]:
    """The aliases that hold on every rank declaring the alias key (coordinator, pure)."""
    proposed: dict[str, str] = {}
    refused: set[str] = set()
    for d in decls:
        for b, a in d.aliases.items():
            if proposed.setdefault(b, a) != a:
                refused.add(b)
    if not proposed:
        return {}
    declared: dict[str, list[int]] = {}
    for r, d in enumerate(decls):
        for key in {p.key for p in d.pieces}:
            if key in proposed:
                declared.setdefault(key, []).append(r)
    for b, ranks in declared.items():
        if any(decls[r].aliases.get(b) != proposed[b] for r in ranks):
            refused.add(b)
    accepted = {b: a for b, a in proposed.items() if b not in refused}
    # the target of an alias must itself be stored
    return {b: a for b, a in accepted.items() if a not in accepted}


def without(decl: RankDecl, aliases: dict[str, str]) -> tuple[RankDecl, list[int]]:
    """``decl`` less the pieces of aliased keys, and the indices of the pieces kept."""
    if not aliases:
        return decl, list(range(len(decl.pieces)))
    keep = [i for i, p in enumerate(decl.pieces) if p.key not in aliases]
    pieces: list[PieceDecl] = [decl.pieces[i] for i in keep]
    return RankDecl(pieces, decl.objects, decl.per_rank_objects, dict(decl.aliases)), keep
