"""``export-hf --check``: reload an export with transformers and compare its logits with the source.

The source checkpoint's model (the embedded MoE, built from its ``model_config``) and the exported
directory loaded by ``transformers.AutoModelForCausalLM`` run the same token ids; the largest
absolute logits difference is returned and recorded beside the export in ``ckpt_check.json``. When
the export was cast (``--dtype bf16``), the source weights are rounded the same way first, so the
figure measures the conversion, not the cast.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ckpt.errors import StateError

CHECK_FILE = "ckpt_check.json"


def check_export(src_url: str, out_dir: str, *, tokens: int = 32, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """Max |logits difference| between the checkpoint at ``src_url`` and its export in ``out_dir``.

    Raises:
        StateError: transformers is not installed.
        MismatchError / ManifestError: the source has no model config or misses weights.
    """
    try:
        import transformers
    except ImportError:
        raise StateError("--check needs transformers to reload the export: pip install 'ckpt[hf]'") from None
    from ckpt.trainer.checkpoint import load_full_model

    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    exported = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    ours = load_full_model(src_url).eval()
    cast = getattr(torch, exported, torch.float32)
    if cast != torch.float32:
        with torch.no_grad():
            for p in ours.parameters():
                p.copy_(p.to(cast).float())
    transformers.utils.logging.disable_progress_bar()
    try:
        # eager kernels: the reference implementations, closest to the trainer's own arithmetic
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    finally:
        transformers.utils.logging.enable_progress_bar()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ours.config.vocab_size, (batch, tokens), generator=g)
    with torch.no_grad():
        diff = float((hf(ids).logits.float() - ours(ids)).abs().max())  # type: ignore[operator]
    record = {"max_abs_logits_diff": diff, "tokens": batch * tokens, "seed": seed, "exported_dtype": exported,
              "source": src_url, "transformers": transformers.__version__}
    tmp = os.path.join(out_dir, CHECK_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, CHECK_FILE))
    return record
