"""Where the memory tier lives and who holds whose copies: node identity, peer mapping, paths.

Pure functions (no process group, no I/O) except :func:`node_identity` and
:func:`local_copy_enabled`, which read the environment. Layout on each node (``base`` defaults to
``/dev/shm``, or ``CKPT_SHM_DIR``)::

    <base>/ckpt-<run_id>/                               mode 0700, this user's (see ckpt.tier.safefs)
    <base>/ckpt-<run_id>/tier.json                      who wrote this tier (for ``ckpt ls``)
    <base>/ckpt-<run_id>/.lock, .lock-<i>               one job per run id (see ckpt.tier.runlock)
    <base>/ckpt-<run_id>/node-<n>/rank-<r>/step-<S>/    rank r's own memory checkpoint of step S
    <base>/ckpt-<run_id>/node-<n>/replicas/rank-<o>/step-<S>/   a copy of rank o's, held for it

Each step directory is an ordinary ckpt checkpoint (manifest + safetensors, CRC per piece). The
``node-<n>`` level lets one host simulate several nodes (tests, ``ckpt train --nodes``); on a real
cluster each host's ``/dev/shm`` simply holds its own node's directory.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from ckpt._retention import STEP_DIR  # noqa: F401 - a memory step is named as a manager's step
from ckpt._retention import step_dir as step_name  # noqa: F401
from ckpt.errors import StateError

NODE_ENV = "CKPT_NODE"  # this process's node index (overrides the LOCAL_WORLD_SIZE grouping)
SHM_ENV = "CKPT_SHM_DIR"  # base directory of memory tiers (default /dev/shm)
RUN_ID_ENV = "CKPT_RUN_ID"  # the run's identity (default: derived from the persistent root)
LOCAL_COPY_ENV = "CKPT_TIER_LOCAL_COPY"  # "0": copies to peers of this host go through gloo too (see host_peers)
DEFAULT_SHM = "/dev/shm"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RANK_DIR = re.compile(r"^rank-(\d+)$")
NODE_DIR = re.compile(r"^node-(\d+)$")


def shm_base(shm_dir: str | None = None) -> str:
    """The base directory: ``shm_dir``, else ``$CKPT_SHM_DIR``, else ``/dev/shm``."""
    return os.path.abspath(shm_dir or os.environ.get(SHM_ENV) or DEFAULT_SHM)


def run_id_for(root: str, run_id: str | None = None) -> str:
    """The run's identity: ``run_id``, else ``$CKPT_RUN_ID``, else a hash of the persistent root.

    A memory tier is only ever restored by a job with the same run id (and world and layout), so a
    job that reuses a checkpoint root for a *new* run should pass a new run id.

    Raises StateError for a run id that is not a short file name.
    """
    rid = run_id or os.environ.get(RUN_ID_ENV)
    if not rid:
        norm = root if "://" in root else os.path.abspath(root)
        rid = hashlib.blake2b(norm.rstrip("/").encode(), digest_size=8).hexdigest()
    if not RUN_ID.match(rid):
        raise StateError(f"run id {rid!r}: use 1-64 characters of [A-Za-z0-9._-] (it names a directory under the "
                         "shared-memory base), starting with a letter or digit")
    return rid


def tier_dir(base: str, run_id: str) -> str:
    """``<base>/ckpt-<run_id>``: every node directory of one run."""
    return os.path.join(base, f"ckpt-{run_id}")


def node_dir(base: str, run_id: str, node: int) -> str:
    """``<base>/ckpt-<run_id>/node-<node>``: what one node keeps."""
    return os.path.join(tier_dir(base, run_id), f"node-{node}")


def node_identity(rank: int, world: int, *, node: int | None = None, nodes: int | None = None) -> int:
    """This rank's node index.

    In order: ``node`` (explicit); ``nodes`` (simulated nodes on one host: contiguous blocks of
    ``world // nodes`` ranks); ``$CKPT_NODE``; ``rank // $LOCAL_WORLD_SIZE`` (torchrun starts the
    ranks of a node contiguously); else 0 (one node).

    Raises StateError when ``nodes`` does not divide ``world`` or a value is not a non-negative int.
    """
    if node is not None:
        if node < 0:
            raise StateError(f"node={node}: a node index is >= 0")
        return node
    if nodes is not None:
        if nodes < 1 or world % nodes:
            raise StateError(f"nodes={nodes} must divide the {world} ranks evenly (ranks per node = world / nodes)")
        return rank // (world // nodes)
    env = os.environ.get(NODE_ENV)
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            value = -1
        if value < 0:
            raise StateError(f"{NODE_ENV}={env!r}: set it to this process's node index (0, 1, ...)")
        return value
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) > 0:
        return rank // int(local)
    return 0


def replica_holders(nodes: list[int], replicas: int) -> list[list[int]]:
    """``holders[r]``: the ranks that keep a copy of rank ``r``'s memory checkpoint.

    Nodes are ordered by index; rank ``r``, the ``j``-th rank of its node, sends its copies to the
    ``j``-th rank (mod size) of each of the next ``replicas`` nodes (wrapping around). Every holder is
    on another node than ``r``, so losing one node loses no piece; ranks of a node spread their
    copies over the next node's ranks. With fewer than ``replicas + 1`` nodes, as many copies as
    there are other nodes. Pure and the same on every rank.

    Example: ``replica_holders([0, 0, 1, 1], 1) == [[2], [3], [0], [1]]``.
    """
    order = sorted(set(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out: list[list[int]] = []
    for r, n in enumerate(nodes):
        i, j = order.index(n), members[n].index(r)
        held: list[int] = []
        for k in range(1, min(replicas, len(order) - 1) + 1):
            peers = members[order[(i + k) % len(order)]]
            held.append(peers[j % len(peers)])
        out.append(held)
    return out


def host_peers(hosts: list[Any], rank: int, *, enabled: bool = True) -> set[int]:
    """The other ranks whose shared memory is ``rank``'s: equal host keys (:func:`ckpt.tier.runlock.host_key`:
    host name and the base directory's device and inode). Copies between them are read from the
    sender's files (:mod:`ckpt.tier.localcopy`) instead of streamed through gloo; empty when not
    ``enabled`` (``$CKPT_TIER_LOCAL_COPY=0``, see :func:`local_copy_enabled`). Pure.

    Example: ``host_peers([["a", 1, 2], ["a", 1, 2], ["b", 1, 2]], 0) == {1}``.
    """
    if not enabled or hosts[rank] is None:
        return set()
    return {r for r, h in enumerate(hosts) if r != rank and h == hosts[rank]}


def local_copy_enabled() -> bool:
    """Whether copies between ranks of one host may read each other's files (``$CKPT_TIER_LOCAL_COPY``
    unset or not ``0``)."""
    return os.environ.get(LOCAL_COPY_ENV, "1").strip() not in ("0", "false", "no", "off")


def senders_to(holders: list[list[int]]) -> list[list[int]]:
    """The inverse of :func:`replica_holders`: ``senders[h]`` = the ranks whose copies ``h`` keeps."""
    out: list[list[int]] = [[] for _ in holders]
    for r, hs in enumerate(holders):
        for h in hs:
            out[h].append(r)
    return out


__all__ = ["NODE_ENV", "SHM_ENV", "RUN_ID_ENV", "DEFAULT_SHM", "RUN_ID", "RANK_DIR", "NODE_DIR", "shm_base",
           "run_id_for", "tier_dir", "node_dir", "node_identity", "replica_holders", "senders_to", "LOCAL_COPY_ENV",
           "host_peers", "local_copy_enabled"]
