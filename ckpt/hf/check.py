"""``export-hf --check``: reload an export with transformers and compare its logits with the source.

The source checkpoint's model (built by the model's own code where its adapter offers it:
:meth:`~ckpt.hf.adapters.Adapter.reference_model`, e.g. the embedded MoE) and the exported
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

from ckpt.errors import ConfigError, StateError
from ckpt.formats import foreign_json
from ckpt.formats.foreign_json import ConfigFields

CHECK_FILE = "ckpt_check.json"


def check_export(src_url: str, out_dir: str, *, tokens: int = 32, batch: int = 2, seed: int = 0,
                 config: str | dict[str, Any] | None = None, source_names: str | None = None) -> dict[str, Any]:
    """Max |logits difference| between the checkpoint at ``src_url`` and its export in ``out_dir``.

    The reference is the model built by its adapter's own code (the embedded MoE's), or, for an adapter family, the
    transformers model built from the export's config with the source's weights mapped in memory
    (read with ``ckpt.load`` through the same element map, independently of the written files).

    Raises:
        StateError: transformers is not installed.
        MismatchError / ManifestError: the source has no model config or misses weights.
    """
    try:
        import transformers
    except ImportError:
        raise StateError("--check needs transformers to reload the export: pip install 'ckpt[hf]'") from None
    where = os.path.join(out_dir, "config.json")
    exported_config = foreign_json.read_path(where, budget=foreign_json.CONFIG)  # bounded; may have been edited
    if not isinstance(exported_config, dict):
        raise ConfigError(f"{where}: not a JSON object")
    fields = ConfigFields(exported_config, where)
    exported = str(exported_config.get("dtype") or exported_config.get("torch_dtype") or "float32")
    cast = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(exported, torch.float32)
    vocab = fields.int("vocab_size")
    transformers.utils.logging.disable_progress_bar()  # stdout stays the command's own (--json)
    try:
        ours = _reference(src_url, exported_config, config, source_names).eval()
        if cast != torch.float32:
            with torch.no_grad():
                for p in ours.parameters():
                    p.copy_(p.to(cast).float())
        # eager kernels: the reference implementations, closest to the trainer's own arithmetic
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    finally:
        transformers.utils.logging.enable_progress_bar()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, tokens), generator=g)
    with torch.no_grad():
        theirs = ours(ids)
        theirs = getattr(theirs, "logits", theirs)
        diff = float((hf(ids).logits.float() - theirs.float()).abs().max())
    record = {"max_abs_logits_diff": diff, "tokens": batch * tokens, "seed": seed, "exported_dtype": exported,
              "source": src_url, "transformers": transformers.__version__}
    tmp = os.path.join(out_dir, CHECK_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, CHECK_FILE))
    return record


def _reference(src_url: str, exported_config: dict[str, Any], config: str | dict[str, Any] | None,
               source_names: str | None) -> torch.nn.Module:
    """The source model in float32: the adapter's own model (the embedded MoE), or the family's transformers model."""
    import transformers

    import ckpt
    from ckpt.hf.convert import _config_arg
    from ckpt.hf.engine import hf_state_dict, source_adapter

    manifest = ckpt.inspect(src_url)
    found = source_adapter(manifest, _config_arg(config), url=src_url)
    adapter, cfg = found
    own = adapter.reference_model(src_url)  # the model's own code, where its adapter offers it
    if own is not None:
        return own  # type: ignore[no-any-return]
    from ckpt.hf.names import names_of

    names = names_of(manifest, source_names, found, where=src_url)
    sd = {k: v.float().contiguous() for k, v in hf_state_dict(src_url, manifest, adapter, cfg, names).items()}
    import tempfile

    import safetensors.torch

    # written by safetensors' own writer and loaded by transformers' own loader (which converts
    # on-disk names to its modules' layout), independently of the export being checked
    with tempfile.TemporaryDirectory(prefix="ckpt-check-") as tmp:
        safetensors.torch.save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(exported_config | {"dtype": "float32", "torch_dtype": "float32"}, f)
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")


__all__ = ["CHECK_FILE", "check_export"]
