"""Hugging Face interop for every common decoder family: model adapters (:mod:`ckpt.hf.adapters`),
source key names (:mod:`ckpt.hf.names`), element maps (:mod:`ckpt.hf.mapping`) and the export /
import plans built from them (:mod:`ckpt.hf.engine`). The entry points are
:func:`ckpt.formats.hf.export_hf` and :func:`ckpt.formats.hf.import_hf`."""
