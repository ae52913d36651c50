"""Hostile JSON at every Hugging Face entry point: ``import_hf`` (``ckpt import-hf``), ``ckpt.inspect`` of
a model directory, ``export_hf(config=...)`` (``export-hf --config``) and a names file.

Each case runs in a forked child under an address-space limit (``RLIMIT_AS``: what the process
maps now plus 1.5 GiB) and a timeout; it must either succeed or raise a ``CheckpointError``
subclass. A raw exception, a ``MemoryError``, a crash or a hang fails the test. Hostile configs are
generated: every field an adapter reads (per family) replaced by a wrong type, zero, a negative, a
huge count, null, a list, a nested object; plus deep nesting, oversized files, NaN, bad UTF-8, bad
indexes, bad names files. The real configs of every family still import (and their transformers
configs, when transformers is installed).
"""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import ckpt
from ckpt.errors import CheckpointError, ConfigError, IntegrityError
from ckpt.formats import foreign_json
from ckpt.formats.safetensors_header import build_header, parse_header
from ckpt.hf.adapters import ADAPTERS
from ckpt.hf.convert import export_hf, import_hf
from tests.fuzz.contain import contained as run_contained

pytestmark = [pytest.mark.filterwarnings("ignore")]

SMALL: dict[str, Any] = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                         "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
                         "hidden_act": "silu"}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
# complete configs (every field an adapter has a default for is present: transformers is never consulted)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**SMALL, "model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "qwen2": {**SMALL, "model_type": "qwen2"},
    "qwen3": {**SMALL, "model_type": "qwen3"},
    "mixtral": {**SMALL, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**SMALL, **MOE, "model_type": "qwen2_moe", "num_experts": 4, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "shared_expert_intermediate_size": 24, "qkv_bias": True},
    # all layers MoE, default RoPE: the embedded MoE's own import path (config_from_hf, param_shapes)
    "qwen3_moe": {**SMALL, **MOE, "model_type": "qwen3_moe", "num_experts": 4, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True, "use_sliding_window": False},
    "deepseek_v3": {**SMALL, **MOE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 4,
                    "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 16,
                    "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8},
    "minimax": {**SMALL, "model_type": "minimax", "num_hidden_layers": 3, "num_local_experts": 4,
                "num_experts_per_tok": 2, "block_size": 4,
                "layer_types": ["full_attention", "linear_attention", "full_attention"]},
}
# every field some adapter (or the embedded MoE's config reader) reads
BASE_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias", "mlp_bias",
               "quantization_config", "rope_scaling", "rope_parameters", "model_type"]
FIELDS: dict[str, list[str]] = {
    "llama": BASE_FIELDS, "qwen2": BASE_FIELDS, "qwen3": BASE_FIELDS,
    "mixtral": [*BASE_FIELDS, "num_local_experts"],
    "qwen2_moe": [*BASE_FIELDS, "num_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                  "shared_expert_intermediate_size", "qkv_bias"],
    "qwen3_moe": [*BASE_FIELDS, "num_experts", "num_local_experts", "moe_intermediate_size", "decoder_sparse_step",
                  "mlp_only_layers", "num_experts_per_tok", "norm_topk_prob", "rms_norm_eps", "rope_theta",
                  "max_position_embeddings", "hidden_act", "use_sliding_window", "router_aux_loss_coef",
                  "initializer_range"],
    "deepseek_v3": [*BASE_FIELDS, "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "q_lora_rank",
                    "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size"],
    "minimax": [*BASE_FIELDS, "num_local_experts", "block_size", "layer_types"],
}

TIMEOUT_S = 60.0
HEADROOM = 1536 << 20

# ------------------------------------------------------------------------------------------------
# running one case: forked, memory-limited, timed


def _kind(e: BaseException) -> tuple[str, str]:
    if isinstance(e, CheckpointError):
        return "typed", f"{type(e).__name__}: {e}"
    return "raw", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"


def contained(fn: Any, *args: Any, **kwargs: Any) -> str:
    """Run ``fn`` in a forked child under RLIMIT_AS and a timeout (:func:`tests.fuzz.contain.contained`):
    ``"ok"``, ``"typed <Class>: msg"`` or ``"RAW ..."`` (a raw exception, a crash, a hang)."""
    out = run_contained(lambda: fn(*args, **kwargs), _kind, timeout=TIMEOUT_S, extra_as=HEADROOM)
    return "ok" if out["kind"] == "ok" else f"{'typed' if out['kind'] == 'typed' else 'RAW'} {out['msg']}"


def assert_contained(res: str, case: Any) -> None:
    assert res == "ok" or res.startswith("typed "), f"{case}: {res}"


# ------------------------------------------------------------------------------------------------
# model directories


def write_model(d: Path, family: str, config: dict[str, Any] | None = None) -> Path:
    """A Hugging Face directory of ``family``: config.json and model.safetensors holding every tensor
    the adapter expects (per-expert names, as save_pretrained writes them), zeros."""
    cfg = CONFIGS[family]
    a = ADAPTERS[family]
    full = a.complete(cfg, where="test")
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(t.shape, generator=g) for n, t in a.hf_map(full).items()}
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg if config is None else config))
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per family: (its HF directory, a checkpoint import_hf wrote from it)."""
    root = tmp_path_factory.mktemp("hostile-json")
    out = {}
    for family in CONFIGS:
        hf = write_model(root / family / "hf", family)
        import_hf(str(hf), str(root / family / "ck"))
        out[family] = (hf, root / family / "ck")
    return out


@pytest.mark.slow
def test_every_family_imports_and_exports_from_its_config(models, tmp_path):
    """The configs the hostile cases start from are valid: each family imports (the qwen3_moe one as
    the embedded MoE) and exports with --config."""
    for family, (hf, ck) in models.items():
        m = ckpt.inspect(str(ck))
        assert m.user_metadata.get("hf_adapter", "embedded") == ("embedded" if family == "qwen3_moe" else family)
        export_hf(str(ck), str(tmp_path / family), config=str(hf / "config.json")
                  if family != "qwen3_moe" else None)
        assert (tmp_path / family / "model.safetensors.index.json").exists()


@pytest.mark.slow
def test_real_transformers_configs_of_every_family_still_import(tmp_path):
    transformers = pytest.importorskip("transformers")
    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mixtral": "MixtralConfig",
               "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config",
               "minimax": "MiniMaxConfig"}
    for family, cls in classes.items():
        fields = {k: v for k, v in CONFIGS[family].items() if k not in ("model_type", "rope_scaling")}
        if family == "deepseek_v3":
            fields |= {"n_group": 2, "topk_group": 1}
        real = json.loads(getattr(transformers, cls)(**fields).to_json_string())  # what save_pretrained writes
        d = write_model(tmp_path / family, family, config=real)
        res = import_hf(str(d), str(tmp_path / f"ck-{family}"))
        assert res.tensors > 0, family


# ------------------------------------------------------------------------------------------------
# generated hostile configs

LEAF = st.one_of(
    st.sampled_from([0, -1, -(2**63), 10**9, 10**18, 2**64, 10**400, True, False, None, "2", "", "32", 2.5, 1e308,
                     -0.0, float("nan"), float("inf"), [], [1, 2], [[[]]], {}, {"a": 1}, {"rope_type": "x"}]),
    st.integers(), st.floats(), st.text(max_size=4), st.lists(st.integers(-3, 10**6), max_size=4),
)
HOSTILE = st.recursive(LEAF, lambda c: st.one_of(st.lists(c, max_size=3),
                                                 st.dictionaries(st.text(max_size=3), c, max_size=3)),
                       max_leaves=6)


@st.composite
def hostile_config(draw: st.DrawFn) -> tuple[str, dict[str, Any], list[str]]:
    family = draw(st.sampled_from(sorted(CONFIGS)))
    cfg = dict(CONFIGS[family])
    changed = draw(st.lists(st.sampled_from(FIELDS[family]), min_size=1, max_size=3, unique=True))
    for field in changed:
        cfg[field] = draw(HOSTILE)
    return family, cfg, changed


def _import(hf: str, dst: str, names: str = "ckpt") -> None:
    import_hf(hf, dst, names=names)


@pytest.mark.multiproc
@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=hostile_config(), entry=st.sampled_from(["import", "export", "inspect"]), names=st.sampled_from(
    ["ckpt", "torchtitan", "megatron"]))
@pytest.mark.slow
@pytest.mark.multiproc
def test_hostile_config_fields_give_a_typed_error_or_succeed(models, tmp_path_factory, case, entry, names):
    family, cfg, changed = case
    d = tmp_path_factory.mktemp("case")
    hf, ck = models[family]
    (d / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity written as such, as json.dumps does
    if entry == "export":
        res = contained(export_hf, str(ck), str(d / "out"), config=str(d / "config.json"))
    else:
        shutil.copy(hf / "model.safetensors", d / "model.safetensors")
        if entry == "inspect":
            res = contained(ckpt.inspect, str(d))
        else:
            res = contained(_import, str(d), str(d / "ck"), names)
    assert_contained(res, (family, changed, {k: cfg[k] for k in changed}, entry))


# ------------------------------------------------------------------------------------------------
# the audit's instances, each named


@pytest.mark.multiproc
@pytest.mark.parametrize("family,field,value,match", [
    ("llama", "num_hidden_layers", 10**9, "'num_hidden_layers' is 1000000000 \\(an integer\\); it must be an "
                                          "integer in \\[1, 100000\\]"),
    ("llama", "num_hidden_layers", 50_000, "describes 50000 layers"),
    ("qwen3_moe", "num_hidden_layers", 50_000, "describes 50000 layers"),
    ("qwen2_moe", "num_experts", 10**9, "'num_experts' is 1000000000"),
    ("qwen2_moe", "num_experts", 10**6, "num_experts=1000000"),
    ("qwen3_moe", "num_experts", 10**6, "num_experts=1000000"),  # the embedded MoE's path
    ("mixtral", "num_local_experts", 10**6, "num_local_experts=1000000"),
    ("deepseek_v3", "n_routed_experts", 10**6, "n_routed_experts=1000000"),
    ("mixtral", "num_local_experts", 10**7, "'num_local_experts' is 10000000"),  # over the absolute cap
    ("llama", "num_attention_heads", 0, "'num_attention_heads' is 0"),
    ("qwen3_moe", "num_attention_heads", 0, "'num_attention_heads' is 0"),
    ("llama", "intermediate_size", None, "'intermediate_size' is None"),
    ("llama", "num_key_value_heads", "2", "'num_key_value_heads' is '2' \\(a string\\)"),
    ("qwen3_moe", "num_experts", True, "'num_experts' is True \\(a boolean\\)"),
    ("qwen3_moe", "rope_scaling", ["default"], "'rope_scaling' is \\['default'\\]"),
    ("llama", "rope_scaling", [1, 2], "'rope_scaling' is \\[1, 2\\]"),
    ("qwen2_moe", "mlp_only_layers", 5, "'mlp_only_layers' is 5"),
    ("minimax", "layer_types", [["x"], {}, 3], "'layer_types' holds"),
    ("minimax", "block_size", 10**5, "'block_size' is 100000"),
    ("deepseek_v3", "first_k_dense_replace", -1, "'first_k_dense_replace' is -1"),
    ("llama", "hidden_size", 2, "hidden_size=2 < num_attention_heads=4"),
    ("llama", "tie_word_embeddings", "false", "'tie_word_embeddings' is 'false'"),
])
@pytest.mark.multiproc
def test_the_audits_configs_are_refused_naming_the_field(models, tmp_path, family, field, value, match):
    hf, _ = models[family]
    cfg = dict(CONFIGS[family], **{field: value})
    if field == "hidden_size":
        del cfg["head_dim"]  # derived: hidden_size // num_attention_heads
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(hf / "model.safetensors", tmp_path / "model.safetensors")
    res = contained(_import, str(tmp_path), str(tmp_path / "ck"))
    assert res.startswith("typed ConfigError") and __import__("re").search(match, res), res
    assert str(tmp_path / "config.json") in res  # the file is named
    assert not (tmp_path / "ck").exists()


@pytest.mark.multiproc
def test_block_size_that_fits_the_cap_but_not_the_weights_is_refused_on_export(models, tmp_path):
    """MiniMax's decay tables (heads x block_size**2 per linear layer) are computed on export: a
    block_size whose tables outweigh the model is refused before they are allocated."""
    hf, ck = models["minimax"]
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIGS["minimax"], block_size=60_000)))
    res = contained(export_hf, str(ck), str(tmp_path / "out"), config=str(tmp_path / "config.json"))
    assert res.startswith("typed ConfigError") and "'block_size'=60000" in res, res


# ------------------------------------------------------------------------------------------------
# whole documents


def _documents(budget: foreign_json.Budget) -> dict[str, bytes]:
    deep = 100_000
    return {
        "deep list": b"[" * deep + b"]" * deep,
        "deep object": b'{"a":' * deep + b"1" + b"}" * deep,
        "deep inside a value": b'{"model_type": "llama", "x": ' + b"[" * deep + b"]" * deep + b"}",
        "unclosed": b"[" * deep,
        "too many values": b"[" + b"[]," * (budget.max_items + 1) + b"[]]",
        "NaN": json.dumps(dict(CONFIGS["llama"], num_hidden_layers=float("nan"))).encode(),
        "Infinity": json.dumps(dict(CONFIGS["llama"], hidden_size=float("inf"))).encode(),
        "huge integer": b'{"num_hidden_layers": 1' + b"0" * 5000 + b"}",
        "bad utf-8": b'{"model_type": "\xff\xfe"}',
        "a list": b"[1, 2, 3]",
        "a string": b'"config"',
        "empty": b"",
        "BOM": b'\xef\xbb\xbf{"model_type": "llama"}',
    }


@pytest.mark.multiproc
def test_hostile_documents_at_every_entry_point(models, tmp_path):
    hf, ck = models["llama"]
    for name, data in _documents(foreign_json.CONFIG).items():
        d = tmp_path / name.replace(" ", "-")
        d.mkdir()
        (d / "config.json").write_bytes(data)
        shutil.copy(hf / "model.safetensors", d / "model.safetensors")
        for entry, res in (("import", contained(_import, str(d), str(d / "ck"))),
                           ("inspect", contained(ckpt.inspect, str(d))),
                           ("export --config", contained(export_hf, str(ck), str(d / "out"),
                                                         config=str(d / "config.json")))):
            assert res.startswith("typed "), (name, entry, res)
            if entry != "inspect":
                assert "ConfigError" in res, (name, entry, res)


@pytest.mark.multiproc
def test_an_oversized_config_is_refused_before_it_is_read(models, tmp_path):
    hf, _ = models["llama"]
    big = json.dumps(dict(CONFIGS["llama"], pad="x" * (foreign_json.CONFIG.max_bytes + 1))).encode()
    (tmp_path / "config.json").write_bytes(big)
    shutil.copy(hf / "model.safetensors", tmp_path / "model.safetensors")
    res = contained(_import, str(tmp_path), str(tmp_path / "ck"))
    assert res.startswith("typed ConfigError") and "more than the 16777216" in res, res


@pytest.mark.multiproc
@pytest.mark.parametrize("index", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"weight_map": [1, 2]}',
    b'{"weight_map": {"model.norm.weight": 5}}',
    b'{"weight_map": {"model.norm.weight": "../../etc/passwd"}}',
    b'{"weight_map": {"model.norm.weight": "model.safetensors"}, "metadata": NaN}',
    b'{"weight_map": {"model.norm.weight": "absent.safetensors"}}',
    b'{"weight_map": ' + b'{"a": [' * 10 + b"]}" * 10 + b"}",
])
@pytest.mark.multiproc
def test_hostile_indexes_are_refused(models, tmp_path, index):
    hf, _ = models["llama"]
    (tmp_path / "config.json").write_bytes((hf / "config.json").read_bytes())
    shutil.copy(hf / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    res = contained(_import, str(tmp_path), str(tmp_path / "ck"))
    assert res.startswith("typed "), res


@pytest.mark.multiproc
@pytest.mark.parametrize("spec", [
    b"[" * 100_000,
    b'{"rename": 5}',
    b'{"rename": [["a"]]}',
    b'{"rename": [[1, 2]]}',
    b'{"rename": [["(", "x"]]}',
    b'{"rename": [["model", "\\\\9"]]}',
    b'{"rename": [["a", "b"]], "pad": "' + b"x" * (5 << 20) + b'"}',
])
@pytest.mark.multiproc
def test_hostile_names_files_are_refused(models, tmp_path, spec):
    hf, _ = models["llama"]
    (tmp_path / "names.json").write_bytes(spec)
    res = contained(_import, str(hf), str(tmp_path / "ck"), str(tmp_path / "names.json"))
    assert res.startswith("typed ConfigError"), res


# ------------------------------------------------------------------------------------------------
# the reader itself, and foreign safetensors headers


@settings(max_examples=50, deadline=None)
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                        | st.text(alphabet='ab"\\[]{},: \n\u00e9', max_size=6),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(
                            st.text(alphabet='ab"\\[]{}', max_size=4), c, max_size=4), max_leaves=30))
def test_the_scan_measures_exactly_what_the_decoder_nests(doc):
    """Depth and items counted without decoding match the document (strings full of brackets, quotes
    and backslashes included), so the budget check is never fooled into letting a deep one through."""
    text = json.dumps(doc).encode()

    def depth(x: Any) -> int:
        if isinstance(x, list):
            return 1 + max(map(depth, x), default=0)
        if isinstance(x, dict):
            return 1 + max(map(depth, x.values()), default=0)
        return 0

    items, d = foreign_json._scan(text)
    assert d == depth(doc)
    assert foreign_json.loads(text, where="t", budget=foreign_json.Budget(1 << 20, d, items)) == doc
    if d:
        with pytest.raises(ConfigError, match="nested"):
            foreign_json.loads(text, where="t", budget=foreign_json.Budget(1 << 20, d - 1, items))


def test_brackets_inside_strings_are_not_nesting():
    doc = b'{"a": "\\"' + b"[" * 10_000 + b'\\\\", "b": ["\\\\"]}'
    assert foreign_json._scan(doc)[1] == 2
    assert foreign_json.loads(doc, where="t", budget=foreign_json.CONFIG)["b"] == ["\\"]


def test_foreign_safetensors_headers_are_bounded():
    head, _ = build_header([("a", "F32", (2,), 8), ("b", "F32", (2,), 8)])
    size = len(head) + 16
    assert set(parse_header(head, size, path="f")) == {"a", "b"}
    overlapping = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    cases = {
        "overlap": overlapping,
        "deep": b'{"__metadata__": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        "nan": b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}',
    }
    for name, body in cases.items():
        body += b" " * (-len(body) % 8)
        data = len(body).to_bytes(8, "little") + body
        with pytest.raises(IntegrityError):
            parse_header(data, len(data) + 64, path=name)
