"""Issue 30 (3): resharding a checkpoint we did not write splits its tensors.

torchtitan and plain DCP checkpoints name their tensors in their own schemes (``layers.0.attention.wq.weight``,
``optimizer.state.<fqn>.exp_avg``); ``ckpt reshard --to tp=2`` used to report ok while every rank held
every tensor whole. The rules are now derived from the names (ckpt.resharders.derive): each parameter
maps to its canonical name, whose placement the adapters' table knows, and each optimizer state inherits
its parameter's. Checkpoints are built from real modules after a real AdamW step and saved with real
``torch.distributed.checkpoint`` in one process; loading back runs on forked gloo ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.layout import Layout
from ckpt.resharders.derive import UnmatchedTensorsError, derive_rules, optimizer_param
from ckpt.resharders.placement import rank_state, specs_of
from ckpt.resharders.plan import plan, rules_for
from ckpt.resharders.reshard import reshard
from ckpt.resharders.rules import KeyedRules
from ckpt.shards import Box
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore")

H, INTER, VOCAB, HEADS = 16, 24, 40, 4
# suffix of a parameter name -> the dim TP splits (None: whole), per scheme
TITAN = {"attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0, "attention.wo.weight": 1,
         "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1,
         "attention_norm.weight": None, "ffn_norm.weight": None}
TITAN_TOP = {"tok_embeddings.weight": 0, "output.weight": 0, "norm.weight": None}
HF = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
      "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1,
      "input_layernorm.weight": None, "post_attention_layernorm.weight": None}
HF_TOP = {"model.embed_tokens.weight": 0, "lm_head.weight": 0, "model.norm.weight": None}


def _shape(suffix: str) -> tuple[int, ...]:
    if "norm" in suffix:
        return (H,)
    if any(s in suffix for s in ("embed", "tok_emb", "output", "lm_head")):
        return (VOCAB, H)
    if any(s in suffix for s in ("w1", "w3", "gate_proj", "up_proj")):
        return (INTER, H)
    if any(s in suffix for s in ("w2", "down_proj")):
        return (H, INTER)
    return (H, H)


def build(names: list[str]) -> nn.Module:
    """A real module tree whose parameter fqns are exactly ``names`` (as torchtitan's or transformers' are)."""
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.randn(_shape(name))))
    assert sorted(n for n, _ in root.named_parameters()) == sorted(names)
    return root


def _names(scheme: str, layers: list[int]) -> dict[str, int | None]:
    per, top = (TITAN, TITAN_TOP) if scheme == "torchtitan" else (HF, HF_TOP)
    pre = "layers" if scheme == "torchtitan" else "model.layers"
    return {**top, **{f"{pre}.{i}.{s}": d for i in layers for s, d in per.items()}}


def _stepped(names: list[str], seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A model with those parameter names after one real AdamW step: (model, its weights, flat optimizer state)."""
    torch.manual_seed(seed)
    model = build(names)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    loss = sum((p.float() ** 2).sum() for p in params)
    loss.backward()
    opt.step()
    # what torchtitan's OptimizersContainer writes: state.<fqn>.exp_avg / exp_avg_sq / step, param_groups.<fqn>.*
    osd = {f"state.{n}.{k}": v.clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}, osd


def _save(path: Path, scheme: str, layers: list[int], extra: dict[str, torch.Tensor] | None = None) \
        -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
    """A DCP checkpoint: torchtitan (model keys at the top level), hf (the same) or ckpt (under "model")."""
    names = _names("torchtitan" if scheme == "torchtitan" else "hf", layers)
    _model, weights, osd = _stepped(list(names))
    state: dict[str, object] = ({"model": weights} if scheme == "ckpt" else dict(weights))
    state.update({"optimizer": osd, "train_state": {"step": torch.tensor(1)}, **(extra or {})})
    dcp.save(state, checkpoint_id=str(path))
    wrap = "model." if scheme == "ckpt" else ""
    flat = {wrap + k: v for k, v in weights.items()} | {f"optimizer.{k}": v for k, v in osd.items()} | (extra or {})
    flat["train_state.step"] = torch.tensor(1)
    dims = {wrap + k: d for k, d in names.items()}
    return flat, dims


def _real_keys(rank: int, world: int) -> None:
    names = list(_names("torchtitan", [0]))
    torch.manual_seed(0)
    model = build(names)
    opt = torch.optim.AdamW(model.parameters())
    sum((p ** 2).sum() for p in model.parameters()).backward()
    opt.step()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    params = {n: None for n in names}
    for state in ("exp_avg", "exp_avg_sq", "step"):
        key = f"optimizer.state.{names[1]}.{state}"
        assert key.removeprefix("optimizer.") in osd, sorted(osd)[:5]
        assert optimizer_param(key, params) == names[1]


@pytest.mark.multiproc
def test_real_optimizer_state_dict_keys():
    """The keys DCP's own get_optimizer_state_dict writes (run in a real 1-rank group) are the ones the
    derivation maps back to their parameters."""
    run_ranks(1, _real_keys)


def _pieces(m: ckpt.Manifest, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = []
    for s in m.tensors[key].shards:
        assert isinstance(s.region, Box), key
        out.append((s.region.offsets, s.region.lengths))
    return sorted(out)


def _expected(shape: tuple[int, ...], dim: int | None, tp: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if dim is None:
        return [((0,) * len(shape), shape)]
    n = -(-shape[dim] // tp)
    out = []
    for i in range(tp):
        off, lens = [0] * len(shape), list(shape)
        off[dim], lens[dim] = i * n, min(n, shape[dim] - i * n)
        out.append((tuple(off), tuple(lens)))
    return sorted(out)


def _check_split(dst: str, dims: dict[str, int | None], tp: int) -> None:
    m = ckpt.inspect(dst)
    for key, d in dims.items():
        fqn = key.removeprefix("model.") if key.startswith("model.model.") or key == "model.lm_head.weight" else key
        want = _expected(tuple(m.tensors[key].shape), d, tp)
        assert _pieces(m, key) == want, key
        for state in ("exp_avg", "exp_avg_sq"):  # the moments split exactly like their parameter
            assert _pieces(m, f"optimizer.state.{fqn}.{state}") == want, (key, state)
        assert tuple(m.tensors[f"optimizer.state.{fqn}.step"].shape) == ()  # the scalar step stays whole


def _load_back(rank: int, world: int, dst: str, ref_path: str, target: str) -> None:
    ref = torch.load(ref_path)
    m = ckpt.inspect(dst)
    rules = rules_for(m)  # re-derived from the names the resharded checkpoint still has
    assert isinstance(rules, KeyedRules)
    state = rank_state(m, Layout.parse(target), rank, rules)
    ckpt.load(state, dst, strict=False)
    for key, piece in state.items():
        off = piece.offsets
        sl = tuple(slice(o, o + n) for o, n in zip(off, piece.local.shape, strict=True))
        want = ref[key][sl] if sl else ref[key]
        assert piece.local.dtype == want.dtype and torch.equal(piece.local, want), (rank, key)


SCHEMES = ["torchtitan", "ckpt", "hf"]


@pytest.mark.multiproc
@pytest.mark.parametrize("scheme", SCHEMES)
def test_foreign_reshard_tp2_splits_and_loads_bitwise(tmp_path, scheme):
    src, dst = tmp_path / "src", str(tmp_path / "dst")
    flat, dims = _save(src, scheme, [0, 1])
    res = CliRunner().invoke(app, ["reshard", str(src), dst, "--to", "tp=2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["whole_tensors"] == 0 and out["rules"] == f"names:{scheme}"
    _check_split(dst, dims, 2)
    ref = str(tmp_path / "ref.pt")
    torch.save(flat, ref)
    run_ranks(2, _load_back, dst, ref, "tp=2")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scheme=st.sampled_from(SCHEMES), layers=st.sets(st.integers(0, 5), min_size=1, max_size=3),
       tp=st.sampled_from([2, 4]), data=st.data())
def test_every_known_name_and_its_moments_split(tmp_path_factory, scheme, layers, tp, data):
    """Any subset of layers and parameters, any scheme: the plan splits every known parameter on its
    dim and each optimizer state identically; nothing known stays whole."""
    names = _names("torchtitan" if scheme == "torchtitan" else "hf", sorted(layers))
    keep = data.draw(st.sets(st.sampled_from(sorted(names)), min_size=1))
    wrap = "model." if scheme == "ckpt" else ""
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for n in keep:
        shape = _shape(n)
        specs[wrap + n] = ("float32", shape)
        for s in ("exp_avg", "exp_avg_sq"):
            specs[f"optimizer.state.{n}.{s}"] = ("float32", shape)
        specs[f"optimizer.state.{n}.step"] = ("float32", ())
    rules = derive_rules(specs, "ckpt" if scheme == "ckpt" else scheme)
    assert rules.unmatched == ()
    from ckpt.resharders.placement import regions_for_ranks
    per_rank = regions_for_ranks(specs, Layout.parse(f"tp={tp}"), rules, max(layers) + 1)
    for n in keep:
        got = sorted((r[wrap + n].offsets, r[wrap + n].lengths) for r in per_rank)
        want = _expected(_shape(n), names[n], tp)
        assert sorted(set(got)) == want if names[n] is not None else set(got) == set(want), n
        for s in ("exp_avg", "exp_avg_sq"):
            assert [r[f"optimizer.state.{n}.{s}"] for r in per_rank] == [r[wrap + n] for r in per_rank]
        assert optimizer_param(f"optimizer.state.{n}.step", rules.keyed) == wrap + n


UNKNOWN = st.from_regex(r"(layers\.0\.attention\.mystery|extra_head|decoder\.blk)\.weight[0-9]?", fullmatch=True)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(unknown=st.sets(UNKNOWN, min_size=1, max_size=3))
def test_unknown_tensors_counted_and_refused_when_strict(tmp_path_factory, unknown):
    """Random unknown extra tensors: plan counts exactly them (and their optimizer state) as whole;
    --strict-rules refuses, naming one, and writes nothing."""
    root = tmp_path_factory.mktemp("unk")
    extra = {k: torch.randn(6, 4) for k in unknown}
    _save(root / "src", "torchtitan", [0], extra={**extra})
    res = CliRunner().invoke(app, ["plan", str(root / "src"), "--to", "tp=2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["whole_tensors"] == len(unknown) and sorted(out["unmatched"]) == sorted(unknown)
    assert out["totals"]["whole_tensors"] == len(unknown)
    human = CliRunner().invoke(app, ["plan", str(root / "src"), "--to", "tp=2"])
    assert f"{len(unknown)} of " in human.output and "stay whole" in human.output
    m = ckpt.inspect(str(root / "src"))
    with pytest.raises(UnmatchedTensorsError, match=sorted(unknown)[0].replace(".", r"\.")):
        plan(m, Layout.parse("tp=2"), rules_for(m), strict_rules=True)
    dst = root / "dst"
    with pytest.raises(UnmatchedTensorsError):
        reshard(str(root / "src"), str(dst), Layout.parse("tp=2"), rules=rules_for(m), strict_rules=True)
    assert not dst.exists() or not any(dst.rglob("*.safetensors"))
    res = CliRunner().invoke(app, ["reshard", str(root / "src"), str(dst), "--to", "tp=2", "--strict-rules"])
    assert res.exit_code != 0 and "match no sharding rule" in res.output.replace("\n", " ")


def test_clean_foreign_plan_reports_zero_whole(tmp_path):
    _save(tmp_path / "src", "torchtitan", [0, 1])
    res = CliRunner().invoke(app, ["plan", str(tmp_path / "src"), "--to", "tp=2", "--json", "--strict-rules"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["whole_tensors"] == 0


def test_pipeline_stages_follow_names_and_states(tmp_path):
    """pp=2: layer 0 and the embeddings (with their optimizer state) on stage 0, layer 1, the final norm
    and the head on stage 1; the scalar step with its parameter."""
    _save(tmp_path / "src", "torchtitan", [0, 1])
    m = ckpt.inspect(str(tmp_path / "src"))
    p = plan(m, Layout.parse("pp=2"), rules_for(m))
    s0, s1 = (set(r.holds) for r in p.ranks)
    for k in ("tok_embeddings.weight", "optimizer.state.tok_embeddings.weight.exp_avg",
              "layers.0.attention.wq.weight", "optimizer.state.layers.0.attention.wq.weight.step"):
        assert k in s0 and k not in s1, k
    for k in ("output.weight", "norm.weight", "optimizer.state.output.weight.exp_avg_sq",
              "layers.1.feed_forward.w2.weight", "optimizer.state.layers.1.feed_forward.w2.weight.step"):
        assert k in s1 and k not in s0, k
    assert specs_of(m).keys() == s0 | s1  # nothing lost
