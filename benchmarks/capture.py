"""Capture overhead benchmark (not a test): ``python benchmarks/capture.py [--runs 7]``.

Prints, for ``hooks.demo_model.build_large`` on this machine:
- summary and full capture time as ratios to the plain forward pass (median of interleaved runs);
- full mode's extra time as a ratio to a raw sequential write of the same number of bytes.
Goals: summary <= 1.3x, full <= 3x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hooks import capture, demo_model  # noqa: E402


def _plain(model: torch.nn.Module, x: torch.Tensor) -> float:
    t = time.perf_counter()
    model(x)
    return time.perf_counter() - t


def _captured(model: torch.nn.Module, x: torch.Tensor, path: Path, **opts: object) -> tuple[float, int]:
    path.unlink(missing_ok=True)
    t = time.perf_counter()
    with capture(model, path, **opts):
        model(x)
    return time.perf_counter() - t, path.stat().st_size


def _raw_write(path: Path, nbytes: int, chunk: int = 16 << 20) -> float:
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (chunk >> 20))
    path.unlink(missing_ok=True)
    t = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, chunk)
            f.write(buf[:n])
            left -= n
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--level", default="aten")
    args = ap.parse_args()
    model, (x,) = demo_model.build_large()
    times: dict[str, list[float]] = {"plain": [], "summary": [], "full": [], "raw": []}
    nbytes = 0
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        d = Path(tmp)
        _plain(model, x)
        _captured(model, x, d / "warm.bundle", level=args.level, mode="full")
        for _ in range(args.runs):
            times["plain"].append(_plain(model, x))
            times["summary"].append(_captured(model, x, d / "s.bundle", level=args.level, mode="summary")[0])
            t, nbytes = _captured(model, x, d / "f.bundle", level=args.level, mode="full")
            times["full"].append(t)
            times["raw"].append(_raw_write(d / "raw.bin", nbytes))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"threads={torch.get_num_threads()} level={args.level} runs={args.runs} "
          f"plain forward={med['plain'] * 1e3:.1f} ms, bundle={nbytes / 1e6:.1f} MB")
    print(f"summary overhead: {med['summary'] / med['plain']:.2f}x plain (goal <= 1.3x)")
    print(f"full overhead:    {med['full'] / med['plain']:.2f}x plain (goal <= 3x)")
    extra = med["full"] - med["plain"]
    print(f"full write speed: {nbytes / extra / 1e6:,.0f} MB/s of capture time over plain, raw sequential write "
          f"{nbytes / med['raw'] / 1e6:,.0f} MB/s -> capture costs {extra / med['raw']:.2f}x a raw write")


if __name__ == "__main__":
    main()
