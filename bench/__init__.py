"""Benchmarks for ckpt; run them with ``python -m bench <subcommand>``."""
