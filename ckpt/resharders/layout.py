"""Moved to :mod:`ckpt.layout` (the parallel layout is core: the trainer and the resharders read it).

Kept as a re-export so that ``from ckpt.resharders.layout import Layout`` keeps working.
"""

from ckpt.layout import AXES, RANK_ORDER, Coord, Layout

__all__ = ["AXES", "RANK_ORDER", "Coord", "Layout"]
