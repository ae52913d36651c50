"""Model adapters: one small class per Hugging Face model family.

An adapter knows, for its ``model_type`` s: which config fields it relies on and what transformers
assumes when a ``config.json`` leaves one out (:attr:`Adapter.defaults`, read from transformers'
own config class when installed; a test compares the table with it), which options it cannot
represent (refused by name before anything is written), the canonical parameters of a model (the
names a ckpt checkpoint stores them under, after the ``model.`` key prefix: the Hugging Face names,
except that each MoE layer's experts are stacked ``mlp.experts.{gate,up,down}_proj`` tensors of
shape ``(E, out, in)`` so that expert parallelism is a split of dim 0), and the element map from
the Hugging Face tensors to those parameters (:mod:`ckpt.hf.mapping`).
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import Any

from ckpt.errors import ConfigError, ManifestError
from ckpt.formats.foreign_json import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, ConfigFields
from ckpt.hf.lightning import decay_tables, slope_rates
from ckpt.hf.mapping import Map, Run, Target, whole
from ckpt.resharders.rules import HF_RULES, RuleSet

Config = dict[str, Any]

ADAPTER_KEY = "hf_adapter"  # user_metadata: the adapter's name ("hf_config": its completed config)


class Adapter:
    """Hugging Face <-> canonical parameters for one model family (see module docstring).

    The built-in families are :data:`ADAPTERS`; a model of one's own (the trainer's embedded MoE,
    :mod:`ckpt.trainer.hf_adapters`) subclasses this and registers an instance with
    :func:`ckpt.hf.register_adapter`. Everything export / import / ``--check`` need to know about a
    model goes through the methods below (those under "checkpoints" have defaults for the families).
    """

    name = "?"  # the registry key; recorded as user_metadata[ADAPTER_KEY] by an import
    model_types: tuple[str, ...] = ()
    architecture = "?"
    rules: RuleSet = HF_RULES
    # model types whose Hugging Face directories this adapter imports in place of their family's
    # adapter, when it can represent the config (:meth:`accept`); the family's check runs first
    imports: tuple[str, ...] = ()
    # True: the checkpoint stores each of params(cfg) whole as "model.<param>" (vocab rows may be
    # padded; stacked experts (E, out, in) go to Hugging Face per expert), and export / import go
    # parameter by parameter (ckpt.hf.engine.params_export / params_import) instead of hf_map
    by_params = False
    # field -> what transformers' config class assumes when config.json leaves it out
    defaults: dict[str, Any] = {}  # noqa: RUF012 - class constant
    aliases: dict[str, str] = {}  # noqa: RUF012 - transformers' attribute_map: name in config.json -> field

    # ---- config ----------------------------------------------------------------------------------
    gqa = True  # query heads are grouped over key/value heads (num_attention_heads % num_key_value_heads == 0)

    def complete(self, d: Config, *, where: str) -> Config:
        """``d`` with every field this adapter relies on present (transformers' default where absent)
        and of the right type and range (:meth:`check`).

        Raises ConfigError naming a field of the wrong type or range, ManifestError naming an option
        the adapter cannot represent.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: the config is a {type(d).__name__}, not a JSON object")
        cfg = dict(d)
        for alias, name in self.aliases.items():
            if name not in cfg and alias in cfg:
                cfg[name] = cfg[alias]
        # transformers is consulted only for fields the config leaves out: importing its config classes
        # costs more than exporting a GB (measured in docs/BENCHMARKS.md, section "Hugging Face import /
        # export of a Llama"), and a complete config.json (save_pretrained's) needs none
        missing = tuple(k for k in self.defaults if k not in cfg)
        if missing:
            found = transformers_defaults(self.model_types[0], missing) or {k: self.defaults[k] for k in missing}
            cfg.update(found)
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ManifestError(f"{where}: quantization_config {method!r}: "
                                "quantized weights are not supported; dequantize to bf16/fp32 first")
        self.check(ConfigFields(cfg, where), cfg)
        self.refuse(cfg, where)
        return cfg

    def check(self, f: ConfigFields, cfg: Config) -> None:
        """Check the type and range of every field this adapter reads (through ``f``, which raises
        ConfigError naming the field) and fill the derived ones (``num_key_value_heads``, ``head_dim``)
        into ``cfg``: after it, the parameter code meets only integers and booleans it can use."""
        f.int("vocab_size")
        h = f.int("hidden_size")
        f.int("num_hidden_layers", max=MAX_LAYERS)
        n = f.int("num_attention_heads", max=MAX_HEADS)
        kv = f.opt_int("num_key_value_heads", max=MAX_HEADS)
        cfg["num_key_value_heads"] = kv = n if kv is None else kv
        if self.gqa and n % kv:
            raise ConfigError(f"{f.where}: num_attention_heads={n} is not a multiple of num_key_value_heads={kv}: "
                              "each key/value head serves the same number of query heads; fix config.json")
        if f.opt_int("head_dim") is None:
            if h < n:
                raise f.fail("head_dim", f"given when hidden_size={h} < num_attention_heads={n} (hidden_size // "
                             "num_attention_heads would be 0)")
            cfg["head_dim"] = h // n
        f.int("intermediate_size", min=0)
        for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            f.bool(flag)
        for rope in ("rope_scaling", "rope_parameters"):  # passed through; transformers reads them as objects
            f.opt_dict(rope)

    def refuse(self, cfg: Config, where: str) -> None:
        """Raise ManifestError naming an option of ``cfg`` this adapter cannot represent."""

    def ignored(self, name: str) -> bool:
        """True for a Hugging Face tensor an import drops: a buffer transformers recomputes from the config."""
        return name.endswith("rotary_emb.inv_freq")

    def derived(self, cfg: Config) -> dict[str, Any]:
        """Hugging Face tensors an export computes from the config instead of reading them from the
        checkpoint (persistent buffers such as decay tables): name -> float32 tensor. Default none."""
        return {}

    def hf_config(self, cfg: Config) -> Config:
        """The ``config.json`` body to write (the stored config; ``dtype`` is set by the caller)."""
        out = dict(cfg)
        out["model_type"] = self.model_types[0]
        out["architectures"] = [self.architecture]
        return out

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint_config(self, meta: dict[str, Any], *, url: str) -> Any:
        """The model config of a checkpoint whose ``user_metadata`` (``meta``) names this adapter:
        the ``hf_config`` an import recorded, completed and checked.

        Raises ManifestError (none recorded), ConfigError (a field of the wrong type or range).
        """
        config = meta.get("hf_config")
        if not isinstance(config, dict):
            raise ManifestError(f"{url}: user_metadata names adapter {self.name!r} but no usable hf_config")
        return self.complete(config, where=url)

    def accept(self, d: Config, names: str, *, where: str) -> Any | None:
        """For a model type of :attr:`imports`: the config this adapter imports ``d`` (a config.json
        body its family's adapter has checked) as, or None to leave it to the family's adapter."""
        return None

    def checkpoint_metadata(self, cfg: Any, names: str) -> dict[str, Any]:
        """The ``user_metadata`` an import under naming ``names`` records, from which
        :meth:`checkpoint_config` gets ``cfg`` back."""
        return {ADAPTER_KEY: self.name, "hf_config": cfg, "names": names,
                "rules": self.rules.name if names == "ckpt" else None}

    def describe(self, cfg: Any) -> str:
        """The model a config describes, short, for error messages."""
        return self.name

    def reference_model(self, src_url: str) -> Any | None:
        """``export-hf --check``'s reference: the checkpoint's model built by the model's own code
        (an ``nn.Module`` in float32 returning logits), or None (default) to build transformers' model
        from the checkpoint's weights mapped in memory."""
        return None

    # ---- parameters ------------------------------------------------------------------------------
    def params(self, cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
        """Canonical parameters and shapes, in module order."""
        return [(n, t.shape) for n, t in self._canonical(cfg).items()]

    def hf_map(self, cfg: Config, present: set[str] | None = None) -> Map:
        """Hugging Face tensor name -> its elements as runs over canonical parameters. ``present``:
        the names in the files being imported (picks between equivalent spellings, e.g. fused experts);
        None for an export (the spelling ``save_pretrained`` writes)."""
        out: Map = {}
        for name, t in self._canonical(cfg).items():
            if t.runs and t.runs[0].name == "experts":  # a stacked experts tensor: per expert in HF
                continue
            out[name] = whole(name, t.shape)
        for prefix, hf_prefix, names, shapes in self._experts(cfg):
            out.update(_expert_map(prefix, hf_prefix, names, shapes, present))
        order = [n for n, _ in self._hf_order(cfg, out)]
        return {n: out[n] for n in order}

    def _hf_order(self, cfg: Config, m: Map) -> list[tuple[str, Target]]:
        return list(m.items())

    def _canonical(self, cfg: Config) -> dict[str, Target]:
        """Canonical name -> Target (runs unused, except the marker ``experts`` on stacked experts)."""
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        out: dict[str, Target] = {}

        def p(name: str, *shape: int) -> None:
            out[name] = Target(tuple(shape), [])

        p("model.embed_tokens.weight", v, h)
        for i in range(cfg["num_hidden_layers"]):
            pre = f"model.layers.{i}."
            p(pre + "input_layernorm.weight", h)
            for name, shape in self._layer_attention(cfg, i):
                p(pre + "self_attn." + name, *shape)
            p(pre + "post_attention_layernorm.weight", h)
            for name, shape in self._mlp(cfg, i):
                if name.startswith("experts."):
                    out[pre + "mlp." + name] = Target(tuple(shape), [Run("experts", 0, 0)])
                else:
                    p(pre + "mlp." + name, *shape)
        p("model.norm.weight", h)
        if not cfg.get("tie_word_embeddings"):
            p("lm_head.weight", v, h)
        return out

    def _attention(self, cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
        h, d = cfg["hidden_size"], cfg["head_dim"]
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        out: list[tuple[str, tuple[int, ...]]] = [("q_proj.weight", (q, h)), ("k_proj.weight", (kv, h)),
                                                  ("v_proj.weight", (kv, h)), ("o_proj.weight", (h, q))]
        qkv_bias, o_bias = self._biases(cfg)
        if qkv_bias:
            out[3:3] = [("q_proj.bias", (q,)), ("k_proj.bias", (kv,)), ("v_proj.bias", (kv,))]
        if o_bias:
            out.append(("o_proj.bias", (h,)))
        return out

    def _layer_attention(self, cfg: Config, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """Attention parameters of layer ``layer`` (the same for every layer, except in hybrids)."""
        return self._attention(cfg)

    def _biases(self, cfg: Config) -> tuple[bool, bool]:
        b = bool(cfg.get("attention_bias"))
        return b, b

    def _mlp(self, cfg: Config, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        return _dense(cfg["hidden_size"], cfg["intermediate_size"], bool(cfg.get("mlp_bias")))

    def _experts(self, cfg: Config) -> list[tuple[str, str, tuple[str, str, str], tuple[int, int, int]]]:
        """Per MoE layer: (canonical prefix, HF prefix, HF per-expert names of gate/up/down, (E, I, H))."""
        return []


def _dense(h: int, i: int, bias: bool = False, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [(f"{prefix}gate_proj.weight", (i, h)),
                                              (f"{prefix}up_proj.weight", (i, h)),
                                              (f"{prefix}down_proj.weight", (h, i))]
    if bias:
        out += [(f"{prefix}gate_proj.bias", (i,)), (f"{prefix}up_proj.bias", (i,)), (f"{prefix}down_proj.bias", (h,))]
    return out


_PROJ = ("gate_proj", "up_proj", "down_proj")


def _stacked(e: int, i: int, h: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("experts.gate_proj", (e, i, h)), ("experts.up_proj", (e, i, h)), ("experts.down_proj", (e, h, i))]


def _expert_map(prefix: str, hf_prefix: str, names: tuple[str, str, str], shape: tuple[int, int, int],
                present: set[str] | None) -> Map:
    """HF expert tensors of one layer over the stacked canonical ``{prefix}.{gate,up,down}_proj``:
    per expert (``{hf_prefix}.{e}.{name}.weight``), or transformers' fused ``gate_up_proj`` /
    ``down_proj`` when the files being imported hold those."""
    e, i, h = shape
    gate, up, down = (f"{prefix}.{p}_proj" for p in ("gate", "up", "down"))
    if present is not None and f"{hf_prefix}.gate_up_proj" in present:
        runs = [Run(n, k * i * h, i * h) for k in range(e) for n in (gate, up)]
        return {f"{hf_prefix}.gate_up_proj": Target((e, 2 * i, h), runs),
                f"{hf_prefix}.down_proj": whole(down, (e, h, i))}
    out: Map = {}
    for k in range(e):
        for hf_name, canon, s in zip(names, (gate, up, down), ((i, h), (i, h), (h, i)), strict=True):
            out[f"{hf_prefix}.{k}.{hf_name}.weight"] = Target(s, [Run(canon, k * i * h, i * h)])
    return out


class Llama(Adapter):
    """Llama 2/3.x (``LlamaForCausalLM``): tied embeddings, rope scaling and biases as configured."""

    name, model_types, architecture = "llama", ("llama",), "LlamaForCausalLM"
    defaults = {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,  # noqa: RUF012
                "num_key_value_heads": None, "head_dim": None, "intermediate_size": 11008}


class Qwen2(Adapter):
    """Qwen2 / Qwen2.5 dense (``Qwen2ForCausalLM``): q/k/v biases, no o bias."""

    name, model_types, architecture = "qwen2", ("qwen2",), "Qwen2ForCausalLM"
    defaults = {"tie_word_embeddings": False, "num_key_value_heads": 32, "head_dim": None,  # noqa: RUF012
                "intermediate_size": 22016}

    def _biases(self, cfg: Config) -> tuple[bool, bool]:
        return True, False


class Qwen3(Adapter):
    """Qwen3 dense (``Qwen3ForCausalLM``): q/k RMS norms per head."""

    name, model_types, architecture = "qwen3", ("qwen3",), "Qwen3ForCausalLM"
    defaults = {"attention_bias": False, "tie_word_embeddings": False, "num_key_value_heads": 32,  # noqa: RUF012
                "head_dim": 128, "intermediate_size": 22016}

    def _attention(self, cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
        d = cfg["head_dim"]
        return [*super()._attention(cfg), ("q_norm.weight", (d,)), ("k_norm.weight", (d,))]


class Mixtral(Adapter):
    """Mixtral (``MixtralForCausalLM``): every layer MoE, ``block_sparse_moe.experts.E.w1/w2/w3``."""

    name, model_types, architecture = "mixtral", ("mixtral",), "MixtralForCausalLM"
    defaults = {"tie_word_embeddings": False, "num_key_value_heads": 8, "head_dim": None,  # noqa: RUF012
                "num_local_experts": 8, "intermediate_size": 14336}

    def check(self, f: ConfigFields, cfg: Config) -> None:
        super().check(f, cfg)
        f.int("num_local_experts", max=MAX_EXPERTS)

    def _mlp(self, cfg: Config, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        e, h = cfg["num_local_experts"], cfg["hidden_size"]
        return [("gate.weight", (e, h)), *_stacked(e, cfg["intermediate_size"], h)]

    def hf_map(self, cfg: Config, present: set[str] | None = None) -> Map:
        out: Map = {}
        for name, t in super().hf_map(cfg, present).items():
            out[name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = t
        return out

    def _experts(self, cfg: Config) -> list[tuple[str, str, tuple[str, str, str], tuple[int, int, int]]]:
        e, i, h = cfg["num_local_experts"], cfg["intermediate_size"], cfg["hidden_size"]
        return [(f"model.layers.{n}.mlp.experts", f"model.layers.{n}.block_sparse_moe.experts", ("w1", "w3", "w2"),
                 (e, i, h)) for n in range(cfg["num_hidden_layers"])]

    def _hf_order(self, cfg: Config, m: Map) -> list[tuple[str, Target]]:
        return _layer_order(m)


def _layer_order(m: Map) -> list[tuple[str, Target]]:
    """HF tensors in module order: non-layer first, then by layer, stable within a layer."""
    import re

    def key(item: tuple[int, tuple[str, Target]]) -> tuple[int, int, int]:
        pos, (name, _) = item
        mm = re.search(r"\.layers\.(\d+)\.", name)
        if mm is None:
            return (0 if "embed" in name else 2, 0, pos)
        return (1, int(mm.group(1)), pos)

    return [x for _, x in sorted(enumerate(m.items()), key=key)]


class _QwenMoe(Adapter):
    """Qwen2-MoE / Qwen3-MoE: layer ``i`` is MoE iff ``i`` not in ``mlp_only_layers``, there are experts
    and ``(i + 1) % decoder_sparse_step == 0``; the others are dense MLPs of ``intermediate_size``."""

    aliases = {"num_local_experts": "num_experts"}  # noqa: RUF012

    def check(self, f: ConfigFields, cfg: Config) -> None:
        super().check(f, cfg)
        f.int("num_experts", min=0, max=MAX_EXPERTS)
        f.int("moe_intermediate_size")
        f.opt_int("decoder_sparse_step", max=MAX_LAYERS)
        dense = f.opt_list("mlp_only_layers", max_len=MAX_LAYERS) or []
        if not all(type(i) is int and 0 <= i < MAX_LAYERS for i in dense):
            raise f.fail("mlp_only_layers", "a list of layer numbers (integers from 0)")
        # sorted and unique: membership is a binary search, not a scan per layer (L x len would be 10**10)
        cfg["mlp_only_layers"] = sorted(set(dense))

    def _is_moe(self, cfg: Config, i: int) -> bool:
        step = cfg.get("decoder_sparse_step") or 1
        dense = cfg.get("mlp_only_layers") or []
        k = bisect.bisect_left(dense, i)
        return (not (k < len(dense) and dense[k] == i)) and cfg["num_experts"] > 0 and (i + 1) % step == 0

    def _moe(self, cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
        e, h = cfg["num_experts"], cfg["hidden_size"]
        return [("gate.weight", (e, h)), *_stacked(e, cfg["moe_intermediate_size"], h)]

    def _mlp(self, cfg: Config, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        return self._moe(cfg) if self._is_moe(cfg, layer) else super()._mlp(cfg, layer)

    def _experts(self, cfg: Config) -> list[tuple[str, str, tuple[str, str, str], tuple[int, int, int]]]:
        e, i, h = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
        return [(f"model.layers.{n}.mlp.experts", f"model.layers.{n}.mlp.experts", _PROJ, (e, i, h))
                for n in range(cfg["num_hidden_layers"]) if self._is_moe(cfg, n)]

    def _hf_order(self, cfg: Config, m: Map) -> list[tuple[str, Target]]:
        return _layer_order(m)


class Qwen3Moe(_QwenMoe, Qwen3):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``), including dense layers (``mlp_only_layers``, sparse step)."""

    name, model_types, architecture = "qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM"
    defaults = {"attention_bias": False, "tie_word_embeddings": False, "num_key_value_heads": 4,  # noqa: RUF012
                "head_dim": None, "num_experts": 128, "decoder_sparse_step": 1, "mlp_only_layers": None,
                "moe_intermediate_size": 768, "intermediate_size": 6144}


class Qwen2Moe(_QwenMoe, Qwen2):
    """Qwen2-MoE (``Qwen2MoeForCausalLM``): plus a shared expert and its sigmoid gate per MoE layer."""

    name, model_types, architecture = "qwen2_moe", ("qwen2_moe",), "Qwen2MoeForCausalLM"
    defaults = {"tie_word_embeddings": False, "num_key_value_heads": 16, "qkv_bias": True,  # noqa: RUF012
                "head_dim": None,
                "num_experts": 60, "decoder_sparse_step": 1, "mlp_only_layers": None, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "intermediate_size": 5632}

    def check(self, f: ConfigFields, cfg: Config) -> None:
        super().check(f, cfg)
        f.bool("qkv_bias")
        f.int("shared_expert_intermediate_size", min=0)

    def _biases(self, cfg: Config) -> tuple[bool, bool]:
        return bool(cfg.get("qkv_bias", True)), False

    def _moe(self, cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
        h, s = cfg["hidden_size"], cfg["shared_expert_intermediate_size"]
        return [*super()._moe(cfg), *_dense(h, s, prefix="shared_expert."), ("shared_expert_gate.weight", (1, h))]


class DeepseekV3(Adapter):
    """DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention (``q_a/q_b`` or ``q_proj``,
    ``kv_a_proj_with_mqa``, ``kv_b_proj``), ``first_k_dense_replace`` dense layers, routed experts
    with ``e_score_correction_bias`` and shared experts. Multi-token-prediction layers (weights past
    ``num_hidden_layers``, which transformers does not load) are refused."""

    name, model_types, architecture = "deepseek_v3", ("deepseek_v3",), "DeepseekV3ForCausalLM"
    aliases = {"num_local_experts": "n_routed_experts"}  # noqa: RUF012
    defaults = {"tie_word_embeddings": False, "attention_bias": False, "q_lora_rank": 1536,  # noqa: RUF012
                "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
                "moe_intermediate_size": 2048, "intermediate_size": 18432, "num_key_value_heads": 128}

    gqa = False  # multi-latent attention: num_key_value_heads is not used

    def check(self, f: ConfigFields, cfg: Config) -> None:
        super().check(f, cfg)
        f.opt_int("q_lora_rank", min=0)
        f.int("kv_lora_rank")
        f.int("qk_rope_head_dim")
        f.int("qk_nope_head_dim", min=0)
        f.int("v_head_dim")
        f.int("n_routed_experts", max=MAX_EXPERTS)
        f.int("n_shared_experts", min=0, max=MAX_EXPERTS)
        f.int("first_k_dense_replace", min=0, max=MAX_LAYERS)
        f.int("moe_intermediate_size")

    def refuse(self, cfg: Config, where: str) -> None:
        if cfg.get("attention_bias"):
            raise ManifestError(f"{where}: attention_bias=True is not supported for deepseek_v3 "
                                "(transformers' MLA with biases has no released checkpoints); nothing was written")

    def _attention(self, cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
        h, n = cfg["hidden_size"], cfg["num_attention_heads"]
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        kvr, rope, vd = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        out: list[tuple[str, tuple[int, ...]]] = []
        if cfg.get("q_lora_rank"):
            qr = cfg["q_lora_rank"]
            out += [("q_a_proj.weight", (qr, h)), ("q_a_layernorm.weight", (qr,)), ("q_b_proj.weight", (n * qk, qr))]
        else:
            out += [("q_proj.weight", (n * qk, h))]
        return out + [("kv_a_proj_with_mqa.weight", (kvr + rope, h)), ("kv_a_layernorm.weight", (kvr,)),
                      ("kv_b_proj.weight", (n * (cfg["qk_nope_head_dim"] + vd), kvr)), ("o_proj.weight", (h, n * vd))]

    def _mlp(self, cfg: Config, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        h = cfg["hidden_size"]
        if layer < cfg["first_k_dense_replace"]:
            return _dense(h, cfg["intermediate_size"])
        e, i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        return [("gate.weight", (e, h)), ("gate.e_score_correction_bias", (e,)), *_stacked(e, i, h),
                *_dense(h, i * cfg["n_shared_experts"], prefix="shared_experts.")]

    def _experts(self, cfg: Config) -> list[tuple[str, str, tuple[str, str, str], tuple[int, int, int]]]:
        e, i, h = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
        return [(f"model.layers.{n}.mlp.experts", f"model.layers.{n}.mlp.experts", _PROJ, (e, i, h))
                for n in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])]

    def _hf_order(self, cfg: Config, m: Map) -> list[tuple[str, Target]]:
        return _layer_order(m)


MAX_BLOCK = 1 << 16  # MiniMax's lightning-attention block (released models: 256)


class MiniMax(Mixtral):
    """MiniMax hybrid (``MiniMaxForCausalLM``): ``layer_types`` picks per layer lightning attention
    (``self_attn.qkv_proj``, ``output_gate``, ``out_proj``, ``norm``) or softmax attention (q/k/v/o, no
    biases, no q/k norms); every layer MoE, on disk Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3``.
    The four decay buffers of a linear layer are functions of the config: an import drops them and
    an export writes them (:meth:`derived`)."""

    name, model_types, architecture = "minimax", ("minimax",), "MiniMaxForCausalLM"
    defaults = {"tie_word_embeddings": False, "num_key_value_heads": 8, "head_dim": None,  # noqa: RUF012
                "num_local_experts": 8, "intermediate_size": 14336, "layer_types": None, "block_size": 256}
    BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")

    def complete(self, d: Config, *, where: str) -> Config:
        cfg = super().complete(d, where=where)
        if cfg.get("layer_types") is None:  # transformers' default: full attention first, then alternating
            cfg["layer_types"] = ["full_attention" if (i + 1) % 2 else "linear_attention"
                                  for i in range(cfg["num_hidden_layers"])]
        return cfg

    def check(self, f: ConfigFields, cfg: Config) -> None:
        super().check(f, cfg)
        f.int("block_size", max=MAX_BLOCK)

    def refuse(self, cfg: Config, where: str) -> None:
        types = cfg.get("layer_types")
        if types is None:
            return
        if not isinstance(types, list) or len(types) != cfg["num_hidden_layers"]:
            got = f"a list of {len(types)}" if isinstance(types, list) else f"a {type(types).__name__}"
            raise ConfigError(f"{where}: config field 'layer_types' must list one type per layer "
                              f"(num_hidden_layers={cfg['num_hidden_layers']}), got {got}; fix config.json")
        bad = sorted({repr(t)[:40] for t in types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise ConfigError(f"{where}: config field 'layer_types' holds {'; '.join(bad[:4])}; minimax layers are "
                              "'linear_attention' or 'full_attention'")

    def ignored(self, name: str) -> bool:
        return super().ignored(name) or name.rsplit(".", 1)[-1] in self.BUFFERS and ".self_attn." in name

    def derived(self, cfg: Config) -> dict[str, Any]:
        out: dict[str, Any] = {}
        n, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        # the tables hold heads x block_size**2 floats per linear layer: computed only when they are no
        # larger than the weights themselves (real models: ~0.1% of them), so a config cannot make an
        # export allocate terabytes
        b = cfg["block_size"]
        linear = sum(1 for t in cfg["layer_types"] if t == "linear_attention")
        table = linear * n * (b * b + 2 * b + 1)
        weights = sum(numel(s) for _, s in self.params(cfg))
        if table > max(weights, 1 << 24):
            raise ConfigError(f"config field 'block_size'={b}: the decay tables of {linear} linear layers would hold "
                              f"{table} floats, more than the model's {weights} weights; fix config.json")
        for i, kind in enumerate(cfg["layer_types"]):
            if kind == "linear_attention":
                rate = slope_rates(n, i, layers)[:, None, None]
                tables = (rate, *decay_tables(rate, cfg["block_size"]))
                out |= {f"model.layers.{i}.self_attn.{b}": t for b, t in zip(self.BUFFERS, tables, strict=True)}
        return out

    def _layer_attention(self, cfg: Config, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        if cfg["layer_types"][layer] != "linear_attention":
            return self._attention(cfg)
        h, width = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"]
        return [("qkv_proj.weight", (3 * width, h)), ("out_proj.weight", (h, width)),
                ("output_gate.weight", (width, h)), ("norm.weight", (width,))]


ADAPTERS: dict[str, Adapter] = {a.model_types[0]: a for a in (Llama(), Qwen2(), Qwen3(), Mixtral(), Qwen2Moe(),
                                                                Qwen3Moe(), DeepseekV3(), MiniMax())}


@functools.lru_cache(maxsize=32)
def transformers_defaults(model_type: str, fields: tuple[str, ...]) -> dict[str, Any] | None:
    """What transformers' config class for ``model_type`` takes for each of ``fields`` when a
    ``config.json`` leaves it out: its ``__init__`` default (None: derived from other fields, e.g.
    ``num_key_value_heads`` from the head count). None without transformers or for an unknown type;
    fields its ``__init__`` does not take keep the adapter's own value."""
    try:
        import inspect

        from transformers import CONFIG_MAPPING
        params = inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters
    except Exception:  # noqa: BLE001 - no transformers, or an unknown type: the adapter's table stands
        return None
    adapter = ADAPTERS.get(model_type)
    table = adapter.defaults if adapter is not None else {}
    out: dict[str, Any] = {}
    for f in fields:
        if f in params and params[f].default is not inspect.Parameter.empty:
            v = params[f].default
            out[f] = list(v) if isinstance(v, tuple) else v
        else:
            out[f] = table.get(f)
    return out


def numel(shape: tuple[int, ...]) -> int:
    """Elements of ``shape``."""
    return math.prod(shape)


__all__ = ["Config", "ADAPTER_KEY", "Adapter", "Llama", "Qwen2", "Qwen3", "Mixtral", "Qwen3Moe", "Qwen2Moe",
           "DeepseekV3", "MAX_BLOCK", "MiniMax", "ADAPTERS", "transformers_defaults", "numel"]
