"""The memory tier: recent checkpoints in node-local shared memory with copies on peer nodes.

Same format as every ckpt checkpoint (manifest + safetensors, CRC per piece), written per rank
under ``/dev/shm/ckpt-<run_id>/node-<n>/`` (see :mod:`ckpt.tier.nodes`), restored newest complete
step first, every piece's checksum checked, falling back source by source and then to storage.
Used through ``CheckpointManager(..., memory_every=N)`` or directly (:class:`MemoryTier`).
"""

from ckpt.tier.listing import MemoryInfo, MemoryRemoval, gc_memory, list_memory
from ckpt.tier.nodes import node_identity, replica_holders, run_id_for, senders_to
from ckpt.tier.restore import Candidate, TierRestore, plan_restore
from ckpt.tier.store import load_local, pieces_digest
from ckpt.tier.tier import MemoryCheckpoint, MemoryHandle, MemoryTier, TierConfig

__all__ = ["MemoryTier", "TierConfig", "MemoryCheckpoint", "MemoryHandle", "TierRestore", "MemoryInfo", "Candidate",
           "list_memory", "gc_memory", "MemoryRemoval", "node_identity", "replica_holders", "senders_to",
           "run_id_for", "plan_restore", "load_local", "pieces_digest"]
