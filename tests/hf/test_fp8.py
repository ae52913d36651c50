"""FP8 block-scaled Hugging Face checkpoints (ckpt.hf.fp8): a tiny DeepSeek-V3 saved by transformers, its
linear weights quantized to float8_e4m3fn with one float32 ``weight_scale_inv`` per 128x128 block (as the
Hub ships DeepSeek-V3 / Kimi). Import keeps them (tp=2,ep=2: each scale split with its weight), verify
deep, export bit-identical; a layout that would cut a block is refused; ``dequantize`` matches
transformers' own Fp8Dequantize bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import ConfigError, LayoutError, ManifestError, MismatchError
from ckpt.hf.convert import export_hf, import_hf
from ckpt.hf.fp8 import dequantize, scale_name
from ckpt.layout import Layout
from ckpt.resharders.rules import BlockRule, Placement, Rule, RuleSet, check_blocks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

BLOCK = 128
QUANT = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic",
         "fmt": "e4m3"}
# linear weights of the layers (DeepSeek-V3 ships these in fp8; embeddings, norms, router and head stay bf16)
QUANTIZED = ("_proj.weight",)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block max-abs fp8 (partial edge blocks included), as DeepSeek's own quantizer does."""
    rows, cols = w.shape
    sr, sc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(sr * BLOCK, sc * BLOCK)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(sr, BLOCK, sc, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(sr * BLOCK, sc * BLOCK)
    return q[:rows, :cols].contiguous(), scale


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 in fp8: 2 layers (a dense one, an MoE one of 2 experts), 256-wide (2x2 blocks);
    kv_a_proj_with_mqa (192 rows) and kv_b_proj (64 columns) have partial blocks."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=256, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=256,
                           kv_lora_rank=64, qk_rope_head_dim=128, qk_nope_head_dim=128, v_head_dim=128,
                           head_dim=128, n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1, n_group=1,
                           topk_group=1, first_k_dense_replace=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    tmp = tmp_path_factory.mktemp("fp8")
    plain, out = tmp / "plain", tmp / "hf"
    model.save_pretrained(plain)
    tensors = safetensors.torch.load_file(str(plain / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(QUANTIZED) and t.ndim == 2:
            fp8[name], fp8[scale_name(name)] = _quantize(t.float() * 40)  # * 40: values across fp8's range
        else:
            fp8[name] = t
    out.mkdir()
    safetensors.torch.save_file(fp8, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = QUANT
    (out / "config.json").write_text(json.dumps(config))
    return out


def _files(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= safetensors.torch.load_file(str(f))
    return out


def test_round_trip_tp2_ep2_bit_identical(fp8_model: Path, tmp_path: Path) -> None:
    dst, out = str(tmp_path / "ckpt"), tmp_path / "out"
    import_hf(str(fp8_model), dst, to="tp=2,ep=2")
    assert ckpt.verify(dst, deep=True).ok
    m = ckpt.inspect(dst)
    w, s = "model.model.layers.1.self_attn.q_b_proj.weight", "model.model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    assert m.tensors[w].dtype == "float8_e4m3fn" and m.tensors[s].dtype == "float32"
    # each rank's scale rows are exactly the blocks of its weight rows (q_b: colwise, 4 row blocks over tp=2)
    wb = sorted((sh.region.offsets, sh.region.lengths) for sh in m.tensors[w].shards)
    sb = sorted((sh.region.offsets, sh.region.lengths) for sh in m.tensors[s].shards)
    assert [(o[0] // BLOCK, ln[0] // BLOCK) for o, ln in wb] == [(o[0], ln[0]) for o, ln in sb]
    assert {ln[0] for _, ln in wb} == {256}
    experts = m.tensors["model.model.layers.1.mlp.experts.down_proj_scale_inv"]
    assert {tuple(sh.region.lengths) for sh in experts.shards} == {(1, 2, 1)}  # ep over experts, tp over columns
    export_hf(dst, str(out))
    want, got = _files(fp8_model), _files(out)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANT


def test_split_that_cuts_a_block_is_refused(fp8_model: Path, tmp_path: Path) -> None:
    """tp=4 would give each rank 64 columns of the dense down_proj (2 column blocks): refused, nothing written."""
    dst = tmp_path / "ckpt"
    with pytest.raises(LayoutError, match=r"down_proj\.weight' \[256, 256\]: its 2 blocks of 128 on dim 1 .* tp=4.*"
                                          r"choose tp in \[1, 2\].*--dequantize"):
        import_hf(str(fp8_model), str(dst), to="tp=4")
    assert not dst.exists()


def test_dequantize_matches_transformers(fp8_model: Path, tmp_path: Path) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dst = str(tmp_path / "ckpt")
    import_hf(str(fp8_model), dst, to="tp=2", dequantize=True)
    m = ckpt.inspect(dst)
    assert not any(k.endswith("_scale_inv") for k in m.tensors)
    assert "quantization_config" not in m.user_metadata["hf_config"]
    files = _files(fp8_model)
    names = [k for k in files if files[k].dtype == torch.float8_e4m3fn and "experts" not in k]
    want = {"model." + k: torch.empty(tuple(files[k].shape), dtype=torch.bfloat16) for k in names}
    got = ckpt.load(want, dst)
    ref = Fp8Dequantize(None)
    for k in names:
        w, s = files[k], files[scale_name(k)]
        if w.shape[0] % BLOCK or w.shape[1] % BLOCK:  # transformers refuses partial blocks: DeepSeek's rule
            expect = dequantize(w, s, (BLOCK, BLOCK), torch.bfloat16)
        else:
            expect = ref._dequantize_one(w, s, output_dtype=torch.bfloat16)
        assert torch.equal(got["model." + k], expect), k


@settings(max_examples=25, deadline=None)
@given(rb=st.integers(1, 3), cb=st.integers(1, 3), block=st.sampled_from([(128, 128), (16, 32), (1, 32)]),
       experts=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_dequantize_bitwise_transformers(rb: int, cb: int, block: tuple[int, int], experts: int, seed: int) -> None:
    """Any shape in whole blocks (and stacked experts): ours is transformers' Fp8Dequantize, bit for bit."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(seed)
    lead = (experts,) if experts else ()
    w = (torch.randn(*lead, rb * block[0], cb * block[1], generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(*lead, rb, cb, generator=g) + 1e-3
    for dt in (torch.bfloat16, torch.float32):
        assert torch.equal(dequantize(w, s, block, dt), Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dt))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 700), b=st.sampled_from([1, 3, 128]), parts=st.integers(1, 8))
def test_block_rule_iff_blocks_stay_whole(n: int, b: int, parts: int) -> None:
    """The resharders' block constraint (what fp8_rules declares) refuses exactly when some element's
    shard (torch.chunk of the weight) differs from the shard of its block's scale (torch.chunk of the scales)."""
    nb = -(-n // b)
    c, cs = -(-n // parts), -(-nb // parts)
    whole = all(i // c == (i // b) // cs for i in range(n))
    rules = RuleSet([Rule("w", Placement(tp_dim=0))], name="t", param_prefix="", blocks=[BlockRule("w", (b, 4))])
    if whole:
        check_blocks("w", (n, 4), Layout(tp=parts), rules)
    else:
        with pytest.raises(LayoutError, match=f"'w' \\[{n}, 4\\]: its {nb} blocks of {b} on dim 0 .* tp={parts}"):
            check_blocks("w", (n, 4), Layout(tp=parts), rules)


def _edit(fp8_model: Path, tmp: Path, tensors: Any = None, quant: Any = QUANT) -> str:
    d = tmp / "edited"
    d.mkdir(parents=True)
    files = _files(fp8_model)
    if tensors is not None:
        files = tensors(files)
    safetensors.torch.save_file(files, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_model / "config.json").read_text())
    config["quantization_config"] = quant
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_bad_fp8_inputs_are_refused(fp8_model: Path, tmp_path: Path) -> None:
    o = "model.layers.0.self_attn.o_proj.weight"
    cases: list[tuple[Any, Any, type[Exception], str]] = [
        (lambda f: {k: v for k, v in f.items() if k != scale_name(o)}, QUANT, MismatchError, "without .*o_proj"),
        (lambda f: f | {scale_name(o): torch.ones(3, 2)}, QUANT, MismatchError, r"need \[2, 2\]"),
        (lambda f: f | {scale_name(o): torch.ones(2, 2, dtype=torch.int32)}, QUANT, MismatchError, "F32 or BF16"),
        (None, {"quant_method": "bitsandbytes"}, ManifestError, "'bitsandbytes'"),
        (None, QUANT | {"weight_block_size": [128, "x"]}, ConfigError, "weight_block_size"),
        (None, QUANT | {"weight_block_size": None}, ManifestError, "one scale per tensor"),
        (None, None, MismatchError, "scale_inv.*the config needs its quantization_config"),
    ]
    for i, (edit, quant, err, msg) in enumerate(cases):
        src = _edit(fp8_model, tmp_path / str(i), edit, quant)
        with pytest.raises(err, match=msg):
            import_hf(src, str(tmp_path / str(i) / "ckpt"))
        assert not (tmp_path / str(i) / "ckpt").exists()


def test_cli_dequantize(fp8_model: Path, tmp_path: Path) -> None:
    """``ckpt import-hf --dequantize``: bf16 weights, no scales; without it the fp8 weights are kept."""
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    for flag, dtype in (["--dequantize"], "bfloat16"), ([], "float8_e4m3fn"):
        dst = str(tmp_path / (flag[0][2:] if flag else "kept"))
        r = CliRunner().invoke(app, ["import-hf", str(fp8_model), dst, "--quiet", *flag])
        assert r.exit_code == 0, r.output
        tensors = ckpt.inspect(dst).tensors
        assert tensors["model.model.layers.0.self_attn.o_proj.weight"].dtype == dtype
        assert ("model.model.layers.0.self_attn.o_proj.weight_scale_inv" in tensors) == (not flag)


def test_generic_family_fused_tensors(tmp_path: Path) -> None:
    """phi3 through the generic adapter (rules from transformers' plan), in 32x32 blocks: the scales of its
    fused qkv_proj / gate_up_proj split over tp=2 with them; exported bit-identical."""
    from tests.hf.generic_util import build

    b = 32
    assert build("phi3", tmp_path / "plain") is not None
    plain = safetensors.torch.load_file(str(next((tmp_path / "plain").glob("*.safetensors"))))
    files: dict[str, torch.Tensor] = {}
    for k, v in plain.items():
        if k.endswith("proj.weight"):
            w = v.float().reshape(v.shape[0] // b, b, v.shape[1] // b, b)  # tiny phi3: whole 32x32 blocks
            s = w.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            files[k] = (w / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(v.shape)
            files[scale_name(k)] = s
        else:
            files[k] = v
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.torch.save_file(files, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"quantization_config": QUANT | {"weight_block_size": [b, b]}}))
    dst = str(tmp_path / "ckpt")
    import_hf(str(hf), dst, to="tp=2")
    assert ckpt.verify(dst, deep=True).ok
    m = ckpt.inspect(dst)
    assert m.user_metadata["rules"] == "hf-generic:phi3+fp8"
    for p in ("mlp.gate_up_proj", "self_attn.qkv_proj", "mlp.down_proj"):
        w, s = (m.tensors[f"model.model.layers.0.{p}.{x}"] for x in ("weight", "weight_scale_inv"))
        assert len(w.shards) == len(s.shards) == 2, p
        assert sorted(tuple(o // b for o in sh.region.offsets) for sh in w.shards) == sorted(
            tuple(sh.region.offsets) for sh in s.shards), p
    export_hf(dst, str(tmp_path / "out"))
    got = _files(tmp_path / "out")
    assert set(got) == set(files)
    for k, v in files.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["plain", "packed", "experts", "packed_row"]), rb=st.integers(1, 3),
       cb=st.integers(1, 3), cut=st.integers(0, 1), block=st.sampled_from([(2, 4), (4, 2), (1, 3)]),
       seed=st.integers(0, 2**16))
def test_scales_follow_their_weights_through_the_generic_map(kind: str, rb: int, cb: int, cut: int,
                                                             block: tuple[int, int], seed: int) -> None:
    """Through the generic adapter's element map (a whole tensor, one with partial edge blocks, packed
    gate/up parts, per-expert tensors stacked): the stored weights dequantized with the stored scales
    are the file weights dequantized, moved by the same map. A map that changes the row width (packed on the input
    dim) is refused (MismatchError)."""
    from ckpt.hf.fp8 import scale_shape, scale_target
    from ckpt.hf.generic import LAYOUT_KEY, Generic

    b0, b1 = block
    rows, cols = rb * b0, cb * b1
    packed: dict[str, list[int]] = {}
    if kind == "experts":
        tensors = [[f"m.layers.0.mlp.experts.{e}.w.weight", [rows, cols]] for e in range(2)]
    elif kind in ("packed", "packed_row"):
        dim = 0 if kind == "packed" else 1
        tensors = [["m.layers.0.p.weight", [rows * (2 - dim), cols * (1 + dim)]]]
        packed = {"m.layers.0.p.weight": [dim, 2]}
    else:  # partial edge blocks when cut: the last block row / column is short
        tensors = [["m.layers.0.x.weight", [rows - cut * (b0 > 1), cols - cut * (b1 > 1)]]]
    lay = {"tensors": tensors, "packed": packed, "rules": {"name": "t", "rules": []}, "layers": 1,
           "layers_given": True}
    g = Generic()
    cfg = g.complete({"model_type": "t", LAYOUT_KEY: lay}, where="t")
    m, params = g.hf_map(cfg), dict(g.params(cfg))
    gen = torch.Generator().manual_seed(seed)
    weights = {n: (torch.randn(*s, generator=gen) * 50).to(torch.float8_e4m3fn) for n, s in tensors}
    scales = {n: torch.rand(*scale_shape(tuple(s), block), generator=gen) + 0.5 for n, s in tensors}
    if kind == "packed_row":
        with pytest.raises(MismatchError, match="of another row width"):
            scale_target(m[tensors[0][0]], params, block, what="t")
        return
    stored_w = {p: torch.zeros(s, dtype=torch.float32).reshape(-1) for p, s in params.items()}
    stored_s = {scale_name(p): torch.zeros(scale_shape(s, block)).reshape(-1) for p, s in params.items()}
    want = {p: torch.zeros(s).reshape(-1) for p, s in params.items()}
    for n, t in m.items():
        st_ = scale_target(t, params, block, what="t")
        for target, src, runs in ((stored_w, weights[n].float(), t.runs), (stored_s, scales[n], st_.runs),
                                  (want, dequantize(weights[n], scales[n], block, torch.float32), t.runs)):
            flat, pos = src.reshape(-1), 0
            for r in runs:
                target[r.name][r.start:r.start + r.numel] = flat[pos:pos + r.numel]
                pos += r.numel
    for p, s in params.items():
        w = stored_w[p].reshape(s).to(torch.float8_e4m3fn)
        got = dequantize(w, stored_s[scale_name(p)].reshape(scale_shape(s, block)), block, torch.float32)
        assert torch.equal(got.reshape(-1), want[p]), p


def test_dtype_casts_only_the_unquantized_tensors(fp8_model: Path, tmp_path: Path) -> None:
    """--dtype fp32 on import and bf16 on export: embeddings and norms are cast (losslessly back), fp8
    weights and their scales never are."""
    dst, out = str(tmp_path / "ckpt"), tmp_path / "out"
    import_hf(str(fp8_model), dst, dtype="fp32")
    t = ckpt.inspect(dst).tensors
    assert t["model.model.embed_tokens.weight"].dtype == "float32"
    assert t["model.model.layers.0.self_attn.o_proj.weight"].dtype == "float8_e4m3fn"
    assert t["model.model.layers.0.self_attn.o_proj.weight_scale_inv"].dtype == "float32"
    export_hf(dst, str(out), dtype="bf16")
    want, got = _files(fp8_model), _files(out)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_reshard_of_an_imported_fp8_checkpoint_keeps_blocks_whole(fp8_model: Path, tmp_path: Path) -> None:
    """``ckpt reshard`` of an fp8 checkpoint imported as one layout: the recorded table carries the
    weights' blocks, so --to tp=2 keeps each scale with its weight's blocks (exported bit-identical)
    and --to tp=4 (the dense down_proj has 2 column blocks) is refused, nothing written."""
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    src, dst, bad, out = (str(tmp_path / n) for n in ("one", "tp2", "tp4", "out"))
    import_hf(str(fp8_model), src)
    table = ckpt.inspect(src).user_metadata["rules_table"]
    assert {"pattern": "model.layers.*.mlp.down_proj.weight", "block": [BLOCK, BLOCK]} in table["blocks"]
    assert not any("embed_tokens" in b["pattern"] or "scale_inv" in b["pattern"] for b in table["blocks"])
    r = CliRunner().invoke(app, ["reshard", src, dst, "--to", "tp=2"])
    assert r.exit_code == 0, r.output
    assert ckpt.verify(dst, deep=True).ok
    m = ckpt.inspect(dst)
    for w in ("layers.0.mlp.down_proj.weight", "layers.1.self_attn.q_b_proj.weight", "layers.0.mlp.gate_proj.weight"):
        ws, ss = (m.tensors[f"model.model.{w}"], m.tensors[f"model.model.{scale_name(w)}"])
        assert len(ws.shards) == 2
        assert sorted((tuple(o // BLOCK for o in sh.region.offsets), tuple(-(-n // BLOCK) for n in sh.region.lengths))
                      for sh in ws.shards) == sorted((sh.region.offsets, sh.region.lengths) for sh in ss.shards), w
    r = CliRunner().invoke(app, ["reshard", src, bad, "--to", "tp=4"])
    assert r.exit_code != 0, r.output
    said = " ".join(r.output.split())
    assert "tensor 'model.model.layers.0.mlp.down_proj.weight'" in said, said
    assert "its 2 blocks of 128 on dim 1 do not split evenly over tp=4" in said and "choose tp in [1, 2]" in said
    assert not Path(bad).exists()
    export_hf(dst, out)
    want, got = _files(fp8_model), _files(Path(out))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_block_patterns_match_exactly_the_fp8_weights() -> None:
    """One pattern per module where it matches only fp8 weights; the weights' own names where it would
    also match a tensor kept unquantized (a layer left in bf16); glob characters in names escaped."""
    import fnmatch

    from ckpt.hf.fp8 import block_patterns

    params = [f"layers.{i}.{m}.weight" for i in range(3) for m in ("a", "b")] + ["x[1].weight", "x1.weight"]
    weights = {"layers.0.a.weight", "layers.1.a.weight", "layers.2.a.weight", "layers.0.b.weight", "x[1].weight"}
    pats = block_patterns(weights, params)
    assert "layers.*.a.weight" in pats and "layers.0.b.weight" in pats and "layers.*.b.weight" not in pats
    assert {p for p in params if any(fnmatch.fnmatchcase(p, q) for q in pats)} == weights
