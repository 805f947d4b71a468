"""Statistics kernel on real activations (not a test): ``python benchmarks/stats_kernel.py [--model llama-small]``.

Captures every floating ATen output of one forward (a TorchDispatchMode, copies kept), then times,
in interleaved rounds (medians, CPU time), the statistics row of every output as capture computes it
(``hooks.tensors.host_stats``) against one memory-bound numpy pass over the same arrays (``np.max``).
Prints GB/s of both and the ratio, split into large (>= 64k elements) and small outputs, cold (the
outputs cycled: out of cache) and hot (each read just before: in cache, as capture finds an op's
output), and how many 512-element blocks hold NaN/Inf (the kernel's masked path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402

from accuracy import fused  # noqa: E402
from hooks.tensors import host_stats  # noqa: E402


class _Collect(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.outs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
                self.outs.append(t.detach().clone().contiguous())
        return out


def _time(fn, arrays, clock, hot: bool) -> float:  # type: ignore[no-untyped-def]
    """Time ``fn`` over ``arrays``; ``hot``: each array read once just before (untimed), as capture
    finds an op's output in cache right after the op wrote it."""
    if not hot:
        t = clock()
        for a in arrays:
            fn(a)
        return clock() - t
    total = 0.0
    for a in arrays:
        np.bitwise_or.reduce(a[1].reshape(-1).view(np.uint8))  # touch every byte
        t = clock()
        fn(a)
        total += clock() - t
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small", choices=models.MODELS)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model, (x,) = models.build(args.model)
    with torch.no_grad(), _Collect() as c:
        model(x)
    outs = c.outs
    big = [t for t in outs if t.numel() >= 1 << 16]
    small = [t for t in outs if t.numel() < 1 << 16]
    blocks = bad = zero_frac = 0
    for t in outs:
        v = t.float().reshape(-1)
        nb = -(-v.numel() // fused.BLOCK)
        if nb == 0:
            continue
        pad = torch.zeros(nb * fused.BLOCK)
        pad[: v.numel()] = v
        blocks += nb
        bad += int((~torch.isfinite(pad.view(nb, -1))).any(1).sum())
        zero_frac += int((v == 0).sum())
    total = sum(t.numel() for t in outs)
    print(f"model {args.model}: {len(outs)} float outputs, {sum(t.nbytes for t in outs) / 1e6:.1f} MB; "
          f"{len(big)} of >= 64k elements; {bad}/{blocks} blocks with NaN/Inf; {zero_frac / total:.1%} zeros; "
          f"{512 if fused.WIDE_VECTORS else 'default (256)'}-bit vectors (fused.WIDE_VECTORS)")
    arrays = {name: [(t, t.numpy() if t.dtype == torch.float32 else t.view(torch.int16).numpy()) for t in ts]
              for name, ts in (("large", big), ("small", small), ("all", outs))}
    fns = {"stats": lambda p: host_stats(p[0]), "np.max": lambda p: np.max(p[1])}
    for hot in (False, True):
        print("hot: each output read just before (in cache, as capture finds it)" if hot else
              "cold: outputs cycled (out of cache)")
        for name, arr in arrays.items():
            nbytes = sum(t.nbytes for t, _ in arr)
            res: dict[str, list[float]] = {k: [] for k in fns}
            for r in range(args.rounds):
                for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    res[k].append(_time(fns[k], arr, clock, hot))
            med = {k: statistics.median(v) for k, v in res.items()}
            print(f"  {name:6s} {len(arr):4d} arrays {nbytes / 1e6:7.1f} MB: stats {nbytes / med['stats'] / 1e9:5.2f} GB/s "
                  f"({med['stats'] * 1e3:6.2f} ms, {med['stats'] / len(arr) * 1e6:5.1f} us/array); np.max "
                  f"{nbytes / med['np.max'] / 1e9:5.2f} GB/s ({med['np.max'] * 1e3:6.2f} ms); "
                  f"ratio {med['stats'] / med['np.max']:.2f}x")

if __name__ == "__main__":
    main()
