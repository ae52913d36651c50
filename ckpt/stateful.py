"""Stateful values (DCP's protocol): objects with ``state_dict()`` / ``load_state_dict()``.

Data loaders, LR schedulers, torchdata's ``StatefulDataLoader``, a user's train-state object, or
an ``nn.Module`` / optimizer wrapper: saved through ``state_dict()`` and restored in place through
``load_state_dict()``, as ``torch.distributed.checkpoint`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt.errors import StateError


def is_stateful(v: Any) -> bool:
    """True for a value with callable ``state_dict`` and ``load_state_dict`` (not a tensor)."""
    return (not isinstance(v, (torch.Tensor, dict, type)) and callable(getattr(v, "state_dict", None))
            and callable(getattr(v, "load_state_dict", None)))


def expand(state: Any, prefix: str = "") -> Any:
    """``state`` with every Stateful value replaced by its ``state_dict()`` (recursively); the
    input is not modified. Returns ``state`` itself when it holds no Stateful value."""
    if is_stateful(state):
        try:
            sd = state.state_dict()
        except Exception as e:  # noqa: BLE001 - a user object: name it
            raise StateError(f"{prefix or 'state'}: {type(state).__name__}.state_dict() failed ({type(e).__name__}: "
                             f"{e})") from e
        return expand(sd, prefix)
    if isinstance(state, dict):
        out = {k: expand(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in state.items()}
        return state if all(out[k] is state[k] for k in state) else out
    return state


def restore(state: Any, loaded: Any, prefix: str = "") -> None:
    """Hand each Stateful value in ``state`` its part of ``loaded`` through ``load_state_dict``."""
    if is_stateful(state):
        try:
            state.load_state_dict(loaded)
        except Exception as e:  # noqa: BLE001
            raise StateError(f"{prefix or 'state'}: {type(state).__name__}.load_state_dict() failed "
                             f"({type(e).__name__}: {e})") from e
        return
    if isinstance(state, dict) and isinstance(loaded, dict):
        for k, v in state.items():
            if k in loaded:
                restore(v, loaded[k], f"{prefix}.{k}" if prefix else str(k))


def update_in_place(state: dict[str, Any], new: dict[str, Any]) -> None:
    """Write loaded non-tensor values back into ``state`` (tensors were filled in place already);
    Stateful values are restored through ``load_state_dict``."""
    for k, v in new.items():
        cur = state.get(k)
        if is_stateful(cur):
            restore(cur, v, k)
        elif isinstance(v, dict) and isinstance(cur, dict):
            update_in_place(cur, v)
        elif not isinstance(v, torch.Tensor):  # tensors (and Shard / DTensor targets) were filled in place
            state[k] = v


__all__ = ["expand", "is_stateful", "restore", "update_in_place"]
