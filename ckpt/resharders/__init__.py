"""Layouts, sharding rules, reshard plans, the offline reshard, checkpoint diff, fused parameters.

One module per job (the functions live in the module of the same name, which this package does not
shadow):

- :mod:`~ckpt.resharders.rules`: ``RuleSet``, ``MOE_RULES``, ``HF_RULES``, ``load_rules`` (TOML),
  ``param_box``, :func:`register_rules` (a model's own table, found by the name a checkpoint records);
- :mod:`~ckpt.resharders.placement`: which region of each key a rank holds (``shard_state``,
  ``rank_state``);
- :mod:`~ckpt.resharders.plan`: ``plan(manifest, target, rules) -> ReshardPlan`` (pure);
- :mod:`~ckpt.resharders.reshard`: ``reshard(src, dst, target)`` (streaming, resumable);
- :mod:`~ckpt._stream`: ``copy_files`` / ``read_items``, the one streaming copy engine
  (reshard, converters, HF export/import, DCP export);
- :mod:`~ckpt.resharders.diff`: ``diff(a, b, atol) -> DiffReport``;
- :mod:`~ckpt.resharders.fused`: ``FusedSpec``, ``split_fused``, ``join_fused``.

Example::

    from ckpt.layout import Layout
    from ckpt.resharders.plan import plan
    from ckpt.resharders.reshard import reshard
    from ckpt.resharders.diff import diff

    print(plan(ckpt.inspect(src), Layout.parse("tp=1,ep=4,pp=2")).totals())
    reshard(src, dst, Layout.parse("tp=1,ep=4,pp=2"))
    assert diff(src, dst).ok
"""

from ckpt.resharders.rules import register_rules

__all__ = ["register_rules"]
