"""Other tools' checkpoints read in place (DCP / torchtitan / Megatron-Core, DeepSpeed ZeRO and universal, torch.save).

- :mod:`~ckpt.interop.sources`: which format a directory holds, and its manifest (``foreign_manifest``);
- :mod:`~ckpt.interop.dcp_source`: a DCP ``.metadata`` as a ckpt manifest of byte ranges in the ``.distcp`` files;
- :mod:`~ckpt.interop.deepspeed`: a DeepSpeed checkpoint (ZeRO 1/2/3, bf16, universal) likewise;
- :mod:`~ckpt.interop.names`: key-name schemes (ckpt, torchtitan 0.2 / 0.3, Megatron) told from the keys alone.

Converting (``ckpt import``, ``export --format dcp``) is :mod:`ckpt.convert`; Hugging Face is :mod:`ckpt.hf`.
"""
