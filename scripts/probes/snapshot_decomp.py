"""Decompose the step slowdown of an every-step memory checkpoint on one GPU (a CUDA-only probe, not a
bench entry: docs/BENCHMARKS.md "Memory tier, third pass" quotes it).

    MM=512 REPS=10 MODES=off,dma,crc8,tierpoll,tier PYTHONPATH=$PWD python3 scripts/probes/snapshot_decomp.py

The state: 8.59 GB in 64 tensors on the GPU (shapes of bench.save_load.make_state). A synthetic step:
~350 ms of MMxMM bf16 matmuls, a sync, the in-place update of the whole state, a sync. Modes, run in
blocks of 5 steps, ABC/CBA order over REPS repeats; printed: the median of each block's ratio to the
"off" block of its repeat (range), and the medians of the step, of its matmul phase on the GPU
(events), of the time to launch it, and of the call made after the update:

- off: no copies. dma: the state's D2H copies into one pinned buffer on a side stream after the
  update, fenced before the next update. dma16: the same in 16 event-separated groups. dma_paced:
  16 groups, group i waiting for an event recorded 1/17th further into the next step's matmuls.
- crcN[nM]: dma, then a thread waits for the copies and CRCs the buffer on N threads at nice M
  (default 10). dma_crc: crc8. dma_crcpoll: 8 checksum threads, each polling its group's event.
- tier: MemoryTier.save_async(deferred=True) every step, as bench memory-tier does. tierpoll: the
  same with the snapshot's waits switched back to 8 threads polling their events (the code before
  ckpt.tier.snapshot.Landing).

Results are written to $OUT/decomp_<MM>.json ($OUT defaults to /tmp).
"""
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch

from bench.save_load import make_state
from ckpt._checksum import crc32_parallel
from ckpt.tier import MemoryTier, TierConfig

dev = torch.device("cuda")
MM = int(os.environ.get("MM", "4096"))
REPS = int(os.environ.get("REPS", "3"))
PER = 5
_rn = torch.randn
torch.randn = lambda *a, generator=None, dtype=None, **k: torch.empty(*a, dtype=dtype)
shapes = make_state(int(8 * (1 << 30)), 64)
torch.randn = _rn
state = {k: torch.randn(v.shape, dtype=v.dtype, device=dev) for k, v in shapes.items()}
del shapes
total = sum(v.numel() * v.element_size() for v in state.values())
a = torch.randn(MM, MM, device=dev, dtype=torch.bfloat16) / MM ** 0.5
host = torch.empty(total + 64 * 128, dtype=torch.uint8, pin_memory=True)
views = {}
off = 0
for k, v in state.items():
    n = v.numel() * v.element_size()
    views[k] = host[off:off + n].view(v.dtype).view(v.shape)
    off = (off + n + 63) // 64 * 64
cs = torch.cuda.Stream()

def work(n, evs=None):
    x = a
    for i in range(n):
        x = torch.tanh(x @ a)
        if evs is not None and i in evs:
            evs[i].record()

def calib():
    work(4); torch.cuda.synchronize()
    t0 = time.perf_counter(); work(20); torch.cuda.synchronize()
    return max(1, round(0.35 / ((time.perf_counter() - t0) / 20)))
N = calib()

def raw_copies(chunks=1, wait_evs=None):
    ev = torch.cuda.Event(); ev.record(); cs.wait_event(ev)
    items = list(state.items())
    per = (len(items) + chunks - 1) // chunks
    landed = []
    with torch.cuda.stream(cs):
        for c in range(chunks):
            if wait_evs is not None and c > 0:
                cs.wait_event(wait_evs[c - 1])
            for k, v in items[c * per:(c + 1) * per]:
                views[k].copy_(v, non_blocking=True)
            e = torch.cuda.Event(); e.record(cs); landed.append(e)
    return landed

keys_in_order = list(state)
def crc_poll_bg(landed, per):
    def run():
        def before(i):
            e = landed[i // per]
            while not e.query(): time.sleep(0.0005)
        crc32_parallel([memoryview(views[k].view(-1).view(torch.uint8).numpy()) for k in keys_in_order], 8, nice=10, before=before)
    t = threading.Thread(target=run); t.start(); return t

def crc_bg(landed, threads=8, nice=10):
    def run():
        for e in landed:
            while not e.query(): time.sleep(0.0005)
        crc32_parallel([memoryview(host.numpy())], threads, nice=nice)
    t = threading.Thread(target=run); t.start(); return t

shm = tempfile.mkdtemp(dir="/dev/shm")
tier = MemoryTier(TierConfig(shm, run_id="decomp", shm_dir=shm, replicas=0))
tier.reset(None)
tier.save(1, state); tier.save(2, state)
stepno = [2]
modes = os.environ.get("MODES", "off,dma,dma_crc,tier,dma16,dma_paced").split(",")
res = {m: {"wall": [], "gpu": [], "launch": [], "stall": []} for m in modes}
blocks = []

def step(mode, carry):
    t0 = time.perf_counter()
    e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    evs = None
    if mode == "dma_paced":
        k = 16
        evs = {int(N * (i + 1) / (k + 1)): torch.cuda.Event() for i in range(k)}
    work(N, evs if mode == "dma_paced" else None)
    e1.record()
    tl = time.perf_counter() - t0
    torch.cuda.current_stream().synchronize()
    fence = carry.get("fence")
    if fence is not None:
        torch.cuda.current_stream().wait_event(fence)
    if "h" in carry:
        carry["h"].staged()
    for v in state.values():
        v.add_(1)
    t1 = time.perf_counter()
    if "thread" in carry:
        carry["thread"].join()
    carry.clear()
    if mode in ("dma", "dma_crc", "dma16", "dma_crcpoll"):
        landed = raw_copies(16 if mode in ("dma16", "dma_crcpoll") else 1)
        carry["fence"] = landed[-1]
        if mode == "dma_crc":
            carry["thread"] = crc_bg(landed)
        if mode == "dma_crcpoll":
            carry["thread"] = crc_poll_bg(landed, 4)
    elif mode.startswith("crc"):
        landed = raw_copies(1)
        carry["fence"] = landed[-1]
        th, _, nc = mode[3:].partition("n")
        carry["thread"] = crc_bg(landed, int(th), int(nc or 10))
    elif mode == "dma_paced":
        pass  # copies queued at the start of next work, gated by events (below)
    elif mode in ("tier", "tierpoll"):
        stepno[0] += 1
        h = tier.save_async(stepno[0], state, deferred=True)
        carry["h"] = h
        carry["fence_h"] = h
    st = time.perf_counter() - t1
    torch.cuda.current_stream().synchronize()
    w = time.perf_counter() - t0
    return w, e0.elapsed_time(e1), tl, st

# paced variant: copies gated by events inside next step's work; implement by hooking
from ckpt.tier import snapshot as SN

_new = (SN.Snapshot.first_landed, SN.Snapshot.wait_piece)
def _poll(ev):
    while not ev.query(): time.sleep(0.0005)
def _old_first(self):
    for ev in self.landed.values():
        _poll(ev); return
def _old_piece(self, key):
    ev = self.landed.get(key)
    if ev is not None: _poll(ev)

def run_block(mode):
    if mode == "tierpoll":
        SN.Snapshot.first_landed, SN.Snapshot.wait_piece = _old_first, _old_piece
    try:
        return _run_block(mode)
    finally:
        SN.Snapshot.first_landed, SN.Snapshot.wait_piece = _new

def _run_block(mode):
    carry = {}
    out = []
    for _ in range(PER):
        if mode == "dma_paced":
            # queue chunked copies gated on events recorded during this step's work
            t0 = time.perf_counter()
            e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
            k = 16
            idx = [int(N * (i + 1) / (k + 1)) for i in range(k)]
            evs = {i: torch.cuda.Event() for i in idx}
            # copies: chunk c waits for evs[idx[c-1]] (chunk 0 starts at once)
            e0.record()
            landed = raw_copies(k, [evs[i] for i in idx])
            work(N, evs)
            e1.record()
            tl = time.perf_counter() - t0
            torch.cuda.current_stream().synchronize()
            torch.cuda.current_stream().wait_event(landed[-1])
            for v in state.values():
                v.add_(1)
            torch.cuda.current_stream().synchronize()
            out.append((time.perf_counter() - t0, e0.elapsed_time(e1), tl, 0.0))
            continue
        w = step(mode, carry)
        out.append(w)
    if "h" in carry:
        carry["h"].result()
    if "thread" in carry:
        carry["thread"].join()
    torch.cuda.synchronize()
    return out

for r in range(REPS):
    order = modes if r % 2 == 0 else modes[::-1]
    blk = {}
    blocks.append(blk)
    for m in order:
        got = run_block(m)
        blk[m] = statistics.median([x[0] for x in got])
        for w, g, tl, st in got:
            res[m]["wall"].append(w * 1e3); res[m]["gpu"].append(g); res[m]["launch"].append(tl * 1e3); res[m]["stall"].append(st * 1e3)
tier.clear(); shutil.rmtree(shm, ignore_errors=True)
base = statistics.median(res["off"]["wall"])
print(f"N={N} matmuls {MM}^2, state {total/1e9:.2f} GB")
for m in modes:
    d = res[m]
    pr = sorted(b[m] / b["off"] for b in blocks)
    print(f"{m:11s} paired {statistics.median(pr):.3f}x ({pr[0]:.3f}-{pr[-1]:.3f}) wall {statistics.median(d['wall']):7.1f} ({statistics.median(d['wall'])/base:.3f}x) gpu-work {statistics.median(d['gpu']):7.1f} launch {statistics.median(d['launch']):6.1f} stall {statistics.median(d['stall']):5.2f} sd {statistics.pstdev(d['wall']):.1f}")
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"decomp_{MM}.json"), "w"))
