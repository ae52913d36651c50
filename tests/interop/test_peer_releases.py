"""Issue 30 (items 1-5) over checkpoints written by the peers' current releases themselves, committed
with the scripts that made them (no peer library is needed here):

- ``tests/fixtures/megatron/core016/tp{1,2}``: megatron-core 0.16.1 ``dist_checkpointing.save``
  (``torch_dist``), tensor parallel 1 and 2; its ``.metadata`` pickles ``all_local_plans`` (item 1);
- ``tests/fixtures/torchtitan/llama3``: torchtitan 0.3.0's own ``CheckpointManager`` (model, optimizer,
  lr_scheduler, train_state) with 0.3's names ``attention.qkv_linear.wq``, ``lm_head`` and the fused
  ``qkv_linear.wqkv`` in the optimizer state (items 2-4), and torchtitan's own ``to_hf`` of the model;
- item 5 over the side files ``transformers`` itself writes (tokenizer, generation config).

The other peers' fixtures (DeepSpeed 0.19.8, megatron-core 0.19.2) have their tests in test_deepspeed.py
and test_megatron.py.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.convert import import_checkpoint
from ckpt.resharders.derive import derive_rules
from ckpt.shards import Box

pytestmark = pytest.mark.filterwarnings("ignore")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MEGATRON_016 = {tp: FIXTURES / "megatron" / "core016" / f"tp{tp}" for tp in (1, 2)}
TITAN = FIXTURES / "torchtitan" / "llama3"
runner = CliRunner()


def _cli(*args: str) -> str:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def _bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def _read(url: str, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = ckpt.load({k: torch.empty(v.shape, dtype=v.dtype) for k, v in want.items()}, url, strict=False)
    return {k: out[k] for k in want}


def _hf_weights(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for p in sorted(d.glob("*.safetensors")) for k, v in load_file(str(p)).items()}


def _llama_config(path: Path, **kw: object) -> Path:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
           "hidden_act": "silu", "torch_dtype": "float32", **kw}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


# ---- Megatron-Core 0.16.1 (item 1) ----

def _megatron_to_hf(exp: dict[str, torch.Tensor], groups: int = 2, heads: int = 4) -> dict[str, torch.Tensor]:
    """The Hugging Face Llama weights of Megatron's stored tensors, by Megatron's layouts: linear_qkv rows
    are query groups in order, each [its query heads, k, v]; linear_fc1 is [gate; up]."""
    out = {"model.embed_tokens.weight": exp["embedding.word_embeddings.weight"],
           "model.norm.weight": exp["decoder.final_layernorm.weight"], "lm_head.weight": exp["output_layer.weight"]}
    qkv = exp["decoder.layers.self_attention.linear_qkv.weight"]
    hpk, hidden = heads // groups, qkv.shape[-1]
    hd = qkv.shape[1] // groups // (hpk + 2)
    for i in range(qkv.shape[0]):
        p = f"model.layers.{i}."
        g = qkv[i].reshape(groups, hpk + 2, hd, hidden)
        fc1 = exp["decoder.layers.mlp.linear_fc1.weight"][i]
        out.update({p + "self_attn.q_proj.weight": g[:, :hpk].reshape(-1, hidden),
                    p + "self_attn.k_proj.weight": g[:, hpk].reshape(-1, hidden),
                    p + "self_attn.v_proj.weight": g[:, hpk + 1].reshape(-1, hidden),
                    p + "self_attn.o_proj.weight": exp["decoder.layers.self_attention.linear_proj.weight"][i],
                    p + "mlp.gate_proj.weight": fc1[: fc1.shape[0] // 2],
                    p + "mlp.up_proj.weight": fc1[fc1.shape[0] // 2:],
                    p + "mlp.down_proj.weight": exp["decoder.layers.mlp.linear_fc2.weight"][i],
                    p + "input_layernorm.weight": exp["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
                    p + "post_attention_layernorm.weight": exp["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i]})
    return {k: v.contiguous() for k, v in out.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_016_fixture_pickles_its_local_plans(tp):
    """The fixture is what it stands for: megatron-core 0.16's metadata.json and a .metadata that
    carries every rank's SavePlan (one per TP rank), as the release writes it."""
    src = MEGATRON_016[tp]
    raw = (src / ".metadata").read_bytes()
    assert b"all_local_plans" in raw and b"SavePlan" in raw and b"WriteItem" in raw and b"TensorWriteData" in raw
    assert json.loads((src / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert len(list(src.glob("__*_*.distcp"))) == 2 * tp


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_016_inspect_verify_import_bitwise(tp, tmp_path):
    src = str(MEGATRON_016[tp])
    exp = load_file(str(MEGATRON_016[tp] / "expected.safetensors"))
    for cmd in ("inspect", "verify"):
        assert "allowlist" not in _cli(cmd, src)
    m = ckpt.inspect(src)
    assert m.user_metadata["source"]["format"] == "megatron-torch_dist"
    assert set(m.tensors) == set(exp)
    _bitwise(_read(src, exp), exp)
    import_checkpoint(src, str(tmp_path / "c"))
    _bitwise(_read(str(tmp_path / "c"), exp), exp)


def test_megatron_016_export_hf_bitwise_at_tp1_and_tp2(tmp_path):
    """export-hf (names detected: ``--source-names auto``) of the TP 1 and TP 2 checkpoints writes the
    same bytes, Megatron's tensors cut by Megatron's own layouts."""
    cfg = _llama_config(tmp_path / "cfg", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    want = _megatron_to_hf(load_file(str(MEGATRON_016[1] / "expected.safetensors")))
    for tp, src in MEGATRON_016.items():
        _cli("export-hf", str(src), str(tmp_path / f"hf{tp}"), "--config", str(cfg), "-q")
        _bitwise(_hf_weights(tmp_path / f"hf{tp}"), want)


# ---- torchtitan 0.3.0 (items 2-4) ----

@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The step directory torchtitan's CheckpointManager wrote, unpacked byte for byte."""
    d = tmp_path_factory.mktemp("titan") / "step-1"
    with tarfile.open(TITAN / "checkpoint.tar.xz") as tar:
        tar.extractall(d, filter="data")
    return str(d)


def _titan_expected() -> dict[str, torch.Tensor]:
    return load_file(str(TITAN / "expected.safetensors"))


def test_torchtitan_03_inspect_load_import_bitwise(titan, tmp_path):
    exp = _titan_expected()
    assert {"layers.0.attention.qkv_linear.wq.weight", "lm_head.weight",
            "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"} <= set(exp)
    m = ckpt.inspect(titan)
    assert set(m.tensors) == set(exp)
    _bitwise(_read(titan, exp), exp)
    other = json.loads((TITAN / "expected.json").read_text())
    objs = ckpt.load({"train_state.step": None, "train_state.ntokens_seen": None, "lr_scheduler.last_epoch": None},
                     titan, strict=False)
    assert objs == {"train_state.step": other["train_state"]["step"],
                    "train_state.ntokens_seen": other["train_state"]["ntokens_seen"],
                    "lr_scheduler.last_epoch": other["lr_scheduler"]["last_epoch"]}
    import_checkpoint(titan, str(tmp_path / "c"))
    _bitwise(_read(str(tmp_path / "c"), exp), exp)


def test_torchtitan_03_loads_as_torchtitan_lays_it_out(titan):
    """Item 4: the model's keys flat at the top level, beside ``optimizer``, ``lr_scheduler`` and
    ``train_state``; torchtitan 0.3 keeps the train state's ``step`` as a plain int (an object)."""
    exp = _titan_expected()
    model_sd = {k: torch.zeros_like(v) for k, v in exp.items() if not k.startswith("optimizer.")}
    optim_sd = {k.removeprefix("optimizer."): torch.zeros_like(v) for k, v in exp.items() if k.startswith("optimizer.")}
    state = {**model_sd, "optimizer": optim_sd, "lr_scheduler": {"last_epoch": 0}, "train_state": {"step": 0}}
    out = ckpt.load(state, titan, strict=False)
    _bitwise({k: out[k] for k in model_sd}, {k: exp[k] for k in model_sd})
    _bitwise(out["optimizer"], {k: exp["optimizer." + k] for k in optim_sd})
    assert out["train_state"] == {"step": 1} and out["lr_scheduler"] == {"last_epoch": 1}


def test_torchtitan_03_export_hf_equals_torchtitans_own_to_hf(titan, tmp_path):
    """Item 2: ``export-hf`` with names detected (the default ``--source-names auto``) writes exactly what
    torchtitan's Llama3StateDictAdapter.to_hf makes of the model (Q/K permuted for HF's RoPE)."""
    c = json.loads((TITAN / "expected.json").read_text())["config"]
    cfg = _llama_config(tmp_path / "cfg", hidden_size=c["dim"], intermediate_size=c["ffn_hidden"],
                        num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
                        vocab_size=c["vocab_size"], rope_theta=c["rope_theta"])
    _cli("export-hf", titan, str(tmp_path / "hf"), "--config", str(cfg), "-q")
    want = load_file(str(TITAN / "expected_hf.safetensors"))
    _bitwise(_hf_weights(tmp_path / "hf"), want)
    # item 6: the count reported is of Hugging Face tensors (it counted copy pieces: 57 for 21)
    out = json.loads(_cli("export-hf", titan, str(tmp_path / "hf2"), "--config", str(cfg), "--json"))
    assert out["tensors"] == len(want)


def _pieces(m: ckpt.Manifest, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = []
    for s in m.tensors[key].shards:
        assert isinstance(s.region, Box), key
        out.append((tuple(s.region.offsets), tuple(s.region.lengths)))
    return sorted(set(out))


def _halves(shape: tuple[int, ...], dim: int | None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if dim is None:
        return [((0,) * len(shape), shape)]
    half = list(shape)
    half[dim] //= 2
    second = [0] * len(shape)
    second[dim] = half[dim]
    return sorted([((0,) * len(shape), tuple(half)), (tuple(second), tuple(half))])


TITAN_TP_DIMS = {"attention.qkv_linear.wq.weight": 0, "attention.qkv_linear.wk.weight": 0,
                 "attention.qkv_linear.wv.weight": 0, "attention.wo.weight": 1, "feed_forward.w1.weight": 0,
                 "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1, "attention_norm.weight": None}


def test_torchtitan_03_reshard_tp2_splits_model_and_optimizer(titan, tmp_path):
    """Item 3: ``reshard --to tp=2`` places every tensor by its name: column-parallel weights and their
    Adam moments split on dim 0 (the fused ``wqkv`` that only the optimizer state names included, by
    whole query groups), row-parallel on dim 1, norms and scalar steps whole; nothing is left without
    a rule, and the pieces put back together are torchtitan's tensors bitwise."""
    dst = str(tmp_path / "tp2")
    out = json.loads(_cli("reshard", titan, dst, "--to", "tp=2", "--json", "--strict-rules"))
    assert out["whole_tensors"] == 0 and out["rules"] == "names:torchtitan"
    m = ckpt.inspect(dst)
    for layer in (0, 1):
        fused = f"layers.{layer}.attention.qkv_linear.wqkv.weight"  # the parameter wq/wk/wv are saved from
        moments = {fused: _halves(tuple(m.tensors[f"optimizer.state.{fused}.exp_avg"].shape), 0)}
        for name, dim in TITAN_TP_DIMS.items():
            key = f"layers.{layer}.{name}"
            moments[key] = _halves(tuple(m.tensors[key].shape), dim)
            assert _pieces(m, key) == moments[key], key
        for fqn, want in moments.items():
            if ".qkv_linear.w" in fqn and fqn != fused:
                continue  # no optimizer state of their own
            for state in ("exp_avg", "exp_avg_sq"):
                assert _pieces(m, f"optimizer.state.{fqn}.{state}") == want, (fqn, state)
            assert _pieces(m, f"optimizer.state.{fqn}.step") == [((), ())]
    for key in ("tok_embeddings.weight", "lm_head.weight"):  # vocab-parallel
        assert len(_pieces(m, key)) == 2, key
    exp = _titan_expected()
    _bitwise(_read(dst, exp), exp)


_TITAN_SPECS = {k: ("float32", tuple(v.shape)) for k, v in load_file(str(TITAN / "expected.safetensors")).items()}


@settings(max_examples=25, deadline=None)
@given(kept=st.sets(st.sampled_from(sorted(_TITAN_SPECS))))
def test_fused_qkv_optimizer_state_is_placed_whatever_else_is_stored(kept):
    """Any subset of torchtitan's keys: each Adam moment of the fused ``wqkv`` (a parameter the model
    state never stores) is placed column-wise with its parameter, its scalar ``step`` never split."""
    rules = derive_rules({k: _TITAN_SPECS[k] for k in kept}, "torchtitan")
    for key in kept:
        fqn, _, state = key.removeprefix("optimizer.state.").rpartition(".")
        if ".wqkv." not in key:
            continue
        if state == "step":
            assert key not in rules.optim
        else:
            assert rules.optim[key] == fqn and rules.keyed[fqn].tp_dim == 0, key
            assert key not in rules.unmatched


# ---- Hugging Face side files as transformers writes them (item 5) ----

def test_hf_round_trip_keeps_the_tokenizer_transformers_wrote(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    src = tmp_path / "hf"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    model.generation_config = transformers.GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=2)
    model.save_pretrained(src)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "ckpt"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(src)
    side = {p.name for p in src.iterdir()} - {"config.json", "model.safetensors"}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= side
    _cli("import-hf", str(src), str(tmp_path / "c"), "-q")
    _cli("export-hf", str(tmp_path / "c"), str(tmp_path / "out"), "-q")
    for name in side:
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert back("hello ckpt world")["input_ids"] == [3, 5, 4]
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path / "out")).max_new_tokens == 7
