"""Wrappers and sub-configs (ckpt.hf.generic): multimodal models whose language model sits under
``text_config`` (llava, qwen2_5_vl, mistral3, gemma3: weights under ``model.language_model.`` or
``language_model.model.``) and ``*_text`` text models, saved by transformers at a tiny size, round-trip
through ``tp=2``: the language model split by its plan, the vision tower kept whole as stored tensors,
every weight bitwise, logits equal, the files' own tensor names written back."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import ckpt
from ckpt.errors import ConfigError
from ckpt.hf.convert import export_hf, import_hf
from ckpt.hf.generic import LAYOUT_KEY, Generic

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

from tests.hf.generic_util import round_trip, tiny_config  # noqa: E402 - after the importorskip

VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1, "num_attention_heads": 2,
          "num_heads": 2, "head_dim": 16, "image_size": 32, "patch_size": 8, "out_hidden_size": 64, "hidden_dim": 32,
          "embed_dim": 32, "projection_dim": 32, "fullatt_block_indexes": [0], "window_size": 16}
TOKENS = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id",
          "vision_token_id", "boi_token_index", "eoi_token_index", "eos_token_id", "bos_token_id", "pad_token_id")
FAMILIES = {"llava": "LlavaForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
            "mistral3": "Mistral3ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}


def tiny_multimodal(model_type: str) -> Any:
    """The family's default config, its text model shrunk (tests.hf.generic_util) and its vision tower too."""
    cfg = tiny_config(model_type)
    for k, v in VISION.items():
        if hasattr(cfg.vision_config, k):
            setattr(cfg.vision_config, k, v)
    text = cfg.get_text_config()
    for k in TOKENS:  # special token ids inside the tiny vocabulary
        for c in (cfg, text):
            if isinstance(getattr(c, k, None), int) and getattr(c, k) >= 200:
                setattr(c, k, 200 + TOKENS.index(k))
    if model_type.startswith("qwen2"):  # multimodal rope sections sum to head_dim // 2
        text.rope_parameters["mrope_section"] = [2, 3, 3]
    return cfg


def _save(model_type: str, out: Path) -> tuple[Any, torch.Tensor]:
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[model_type])(tiny_multimodal(model_type)).eval()
    with torch.no_grad():
        for p in model.parameters():  # every weight distinct: a misplaced element changes the logits
            p.copy_(torch.randn_like(p) * 0.05)
        logits = model(input_ids=torch.arange(8).reshape(1, 8) % 200).logits
    model.save_pretrained(out)
    return model, logits


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_multimodal_round_trip_tp2(model_type: str, tmp_path: Path) -> None:
    model, logits = _save(model_type, tmp_path / "hf")
    round_trip(model_type, tmp_path, model, logits, "tp=2")
    m = ckpt.inspect(str(tmp_path / "ckpt"))
    q = [k for k in m.tensors if k.endswith("layers.0.self_attn.q_proj.weight") and "vision" not in k]
    assert len(q) == 1 and len(m.tensors[q[0]].shards) == 2  # the language model: split by its plan
    vision = [k for k in m.tensors if ("vision" in k or "visual" in k) and k.endswith(".weight")]
    assert vision and all(len(m.tensors[k].shards) == 1 for k in vision)  # the tower: kept whole


def test_text_model_of_a_multimodal_family(tmp_path: Path) -> None:
    """qwen2_5_vl_text (no causal LM of its own): its text model, names without a prefix, split over tp."""
    model = transformers.Qwen2_5_VLTextModel(tiny_multimodal("qwen2_5_vl").get_text_config()).eval()
    model.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), to="tp=2")
    assert ckpt.verify(str(tmp_path / "ckpt"), deep=True).ok
    assert len(ckpt.inspect(str(tmp_path / "ckpt")).tensors["model.layers.0.self_attn.q_proj.weight"].shards) == 2
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    back = transformers.Qwen2_5_VLTextModel.from_pretrained(tmp_path / "out")
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_other_spelling_of_the_names_is_kept(tmp_path: Path) -> None:
    """transformers 5 saves llava as ``language_model.model.*``; files spelled ``model.language_model.*``
    (which it loads as well) import, and export writes them back under their own names."""
    model, _ = _save("llava", tmp_path / "saved")
    spelled = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
               "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}

    def respell(k: str) -> str:
        return next((new + k[len(old):] for old, new in spelled.items() if k.startswith(old)), k)

    saved = safetensors.torch.load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in saved)
    (tmp_path / "hf").mkdir()
    want = {respell(k): v for k, v in saved.items()}
    safetensors.torch.save_file(want, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tmp_path / "saved" / "config.json", tmp_path / "hf" / "config.json")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), to="tp=2")
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    got: dict[str, torch.Tensor] = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got |= safetensors.torch.load_file(str(f))
    assert set(got) == set(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    back = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "out")
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_recorded_file_names_are_checked() -> None:
    lay = {"tensors": [["a", [2]], ["b", [2]]], "packed": {}, "rules": {}, "layers": 1, "layers_given": True}
    for bad in ({"a": "x", "b": "x"}, {"a": "b"}, {"c": "x"}, ["a"]):
        with pytest.raises(ConfigError, match=f"{LAYOUT_KEY}.file_names"):
            Generic().complete({"model_type": "x", LAYOUT_KEY: lay | {"file_names": bad}}, where="w")
