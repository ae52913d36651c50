"""Running one hostile input under watch, and torch.save records built field by field: shared by the
fuzz tests (``test_hostile_pickles.py``, ``test_foreign_input_audit.py``).

:func:`contained` runs a call in a forked child under an address-space limit (RLIMIT_AS: what the child
maps now plus ``extra_as``) and a timeout, and reports how it ended: a hang or a crash comes back as an
outcome, never as a stuck or dead test process.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable
from typing import Any

import torch


def status(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmSize``, ``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def contained(fn: Callable[[], Any], classify: Callable[[BaseException], tuple[str, str]], *, timeout: float,
              extra_as: int = 2 << 30) -> dict[str, Any]:
    """Run ``fn`` in a forked child under RLIMIT_AS and ``timeout``; its outcome: ``kind`` ("ok", or what
    ``classify`` says of the exception it raised, e.g. "typed" / "raw"), ``msg``, ``type`` (the exception's
    class name), ``seconds`` and ``grew`` (peak resident memory growth). A hang or a crash is ``raw``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        out: dict[str, Any] = {}
        try:
            limit = status("VmSize") + extra_as
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
            torch.set_num_threads(1)
            rss0, t0 = status("VmRSS"), time.perf_counter()
            try:
                fn()
                out = {"kind": "ok", "msg": "", "type": None}
            except BaseException as e:  # noqa: BLE001 - classified, reported to the parent
                kind, msg = classify(e)
                out = {"kind": kind, "msg": msg, "type": type(e).__name__}
            out |= {"seconds": time.perf_counter() - t0, "grew": status("VmHWM") - rss0}
            out["msg"] = out["msg"][:3000] + ("..." if len(out["msg"]) > 3000 else "")  # a hostile key is long
            data = json.dumps(out).encode()
        except BaseException as e:  # noqa: BLE001 - even the report failed: say so
            data = json.dumps({"kind": "raw", "msg": f"child: {type(e).__name__}: {e}", "type": None,
                               "seconds": 0, "grew": 0}).encode()
        try:
            os.write(w, data)
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)  # the child this call forked, by its id
            os.waitpid(pid, 0)
            return {"kind": "raw", "msg": f"hang: no answer within {timeout} s", "type": None, "seconds": timeout,
                    "grew": 0}
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
    finally:
        os.close(r)
    _, code = os.waitpid(pid, 0)
    if not chunks:
        return {"kind": "raw", "msg": f"the child died (status {code}): a crash or the memory limit", "type": None,
                "seconds": 0, "grew": 0}
    return json.loads(b"".join(chunks))  # type: ignore[no-any-return]


# ---- torch.save records, field by field ----------------------------------------------------------

class Storage:
    """A float storage of ``numel`` elements, as a torch.save pickle names it (a persistent id)."""

    def __init__(self, numel: int) -> None:
        self.numel = numel


class Tensor:
    """Pickles exactly as torch's tensors do, with the record's fields chosen by the test."""

    def __init__(self, storage: Storage, offset: Any, size: Any, stride: Any) -> None:
        self.args = (storage, offset, size, stride)

    def __reduce__(self):  # noqa: D105 - the (possibly hostile) record
        storage, offset, size, stride = self.args
        return (torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, collections.OrderedDict()))


class TorchPickler(pickle.Pickler):
    """Writes :class:`Storage` as torch.save's persistent ids."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
        return None
