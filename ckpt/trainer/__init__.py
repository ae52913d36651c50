"""Embedded MoE trainer: a plain model (``model.py``), parallelism applied from outside, a train loop."""
