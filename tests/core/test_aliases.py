"""Tied and shared tensors (one tensor under two keys) are stored once and load into both keys."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt._aliases import agree, find_aliases
from ckpt._save_plan import PieceDecl, RankDecl
from ckpt.save import build_decl
from ckpt.shards import Box


def _ranges(m: ckpt.Manifest, key: str) -> set[tuple[str, int, int]]:
    return {(s.file, s.offset, s.length) for s in m.tensors[key].shards}


def test_tied_keys_share_bytes_and_load_into_both(tmp_path):
    w = torch.randn(6, 4)
    url = str(tmp_path / "c")
    m = ckpt.save({"emb": w, "head": w, "x": torch.ones(3)}, url)
    assert _ranges(m, "emb") == _ranges(m, "head")
    stored = {r for k in m.tensors for r in _ranges(m, k)}
    assert sum(n for _, _, n in stored) == 24 * 4 + 3 * 4  # the tied bytes are on disk once
    header = int.from_bytes((tmp_path / "c" / next(iter(m.files))).read_bytes()[:8], "little")
    assert sum(m.files.values()) == 8 + header + 24 * 4 + 3 * 4
    assert ckpt.verify(url, deep=True).ok
    a, b = torch.zeros(6, 4), torch.zeros(6, 4)
    ckpt.load({"emb": a, "head": b, "x": torch.zeros(3)}, url)
    assert torch.equal(a, w) and torch.equal(b, w)
    # the cached plan of the next save keeps the alias; untying re-plans and stores both
    m2 = ckpt.save({"emb": w, "head": w, "x": torch.ones(3)}, str(tmp_path / "d"))
    assert _ranges(m2, "emb") == _ranges(m2, "head")
    m3 = ckpt.save({"emb": w, "head": w.clone(), "x": torch.ones(3)}, str(tmp_path / "e"))
    assert _ranges(m3, "emb") != _ranges(m3, "head")
    c = torch.zeros(6, 4)
    ckpt.load({"head": c}, str(tmp_path / "e"))
    assert torch.equal(c, w)


def test_async_save_stores_tied_keys_once(tmp_path):
    w = torch.randn(5, 5)
    h = ckpt.async_save({"a": w, "b": w}, str(tmp_path / "c"))
    m = h.done()
    assert m is not None
    assert _ranges(m, "a") == _ranges(m, "b")


def test_what_is_not_an_alias():
    base = torch.arange(24.0).reshape(6, 4)
    state = {
        "whole": base,
        "rows": base[:3],               # same storage, another shape
        "view": base.view(4, 6),        # same bytes, another shape: another tensor
        "t": base.t(),                  # other strides
        "int": base.view(torch.int32),  # same bytes, another dtype
        "e1": torch.zeros(0, 4), "e2": torch.zeros(0, 4),  # empty tensors share address 0
        "same": base,                   # the only alias
    }
    _, items = build_decl(state, 0)
    assert find_aliases(items) == {"same": "whole"}


def _decl(keys: list[str], aliases: dict[str, str]) -> RankDecl:
    return RankDecl([PieceDecl(k, "float32", (2,), Box((0,), (2,))) for k in keys], aliases=aliases)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=5))
def test_agree_accepts_only_aliases_that_hold_on_every_declaring_rank(ranks):
    # per rank: holds a? holds b? b tied to a there?
    decls = []
    for has_a, has_b, tied in ranks:
        keys = [k for k, h in (("a", has_a), ("b", has_b)) if h]
        decls.append(_decl(keys, {"b": "a"} if (has_a and has_b and tied) else {}))
    got = agree(decls)
    holders = [d for d in decls if any(p.key == "b" for p in d.pieces)]
    expected = bool(holders) and all(d.aliases.get("b") == "a" for d in holders)
    assert got == ({"b": "a"} if expected else {})


def test_agree_refuses_chains_and_conflicting_targets():
    assert agree([_decl(["a", "b", "c"], {"b": "a", "c": "b"})]) == {"b": "a"}
    assert agree([_decl(["a", "b", "c"], {"c": "a"}), _decl(["a", "b", "c"], {"c": "b"})]) == {}
