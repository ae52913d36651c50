"""Hugging Face interop for every common decoder family. One module per job:

- :mod:`~ckpt.hf.adapters`: one small adapter per model family (config <-> metadata with
  transformers' defaults, parameters and shapes, element map, sharding rules);
- :mod:`~ckpt.hf.registry`: which adapter serves a model; :func:`register_adapter`, the extension
  point for a model of one's own (the trainer's embedded MoE registers there, from
  :mod:`ckpt.trainer.hf_adapters`, through the ``ckpt.hf_adapters`` entry point);
- :mod:`~ckpt.hf.lightning`: MiniMax's lightning-attention decay buffers, as transformers computes them;
- :mod:`~ckpt.hf.names`: source key names (ckpt, torchtitan, Megatron, a names file);
- :mod:`~ckpt.hf.mapping`: element maps (runs) and their composition / inversion;
- :mod:`~ckpt.hf.engine`: the export / import plans built from them (which stored elements make up
  each Hugging Face tensor, which file bytes make up each stored tensor);
- :mod:`~ckpt.hf.directory`: the model directory on disk (names, dtypes, index and headers, the
  split into ``model-k-of-n`` files).

The copying is :mod:`ckpt._stream`'s; the entry points are :func:`ckpt.hf.convert.export_hf`
and :func:`ckpt.hf.convert.import_hf`."""

from ckpt.hf.registry import register_adapter

__all__ = ["register_adapter"]
