"""Capture overhead benchmark (not a test): ``python benchmarks/capture.py [--runs 7] [--levels aten,api]``.

Prints, for ``hooks.demo_model.build_large`` on this machine and each level:
- summary and full capture time as ratios to the plain forward pass. Every round runs the plain
  forward and each (level, mode) once, in an order rotated from round to round; a round's ratios
  are to that round's plain forward, and the median over rounds is reported (with the ratio of
  the medians next to it, the two agree on a quiet machine);
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
    with capture(model, path, progress=False, **opts):
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
    ap.add_argument("--levels", default="module,api,aten", help="comma-separated capture levels")
    ap.add_argument("--level", help="one level (same as --levels LEVEL)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    levels = [args.level] if args.level else args.levels.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, (x,) = demo_model.build_large()
    configs = [(level, mode) for level in levels for mode in ("summary", "full")]
    times: dict[object, list[float]] = {c: [] for c in [*configs, "plain"]}
    ratios: dict[object, list[float]] = {c: [] for c in configs}
    nbytes: dict[str, int] = {}
    raw: dict[str, list[float]] = {level: [] for level in levels}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        d = Path(tmp)
        _plain(model, x)
        for level in levels:
            _captured(model, x, d / "warm.bundle", level=level, mode="full")
        for r in range(args.runs):
            plain = _plain(model, x)
            times["plain"].append(plain)
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for level, mode in order:
                t, size = _captured(model, x, d / f"{level}-{mode}.bundle", level=level, mode=mode)
                times[(level, mode)].append(t)
                ratios[(level, mode)].append(t / plain)
                if mode == "full":
                    nbytes[level] = size
                    raw[level].append(_raw_write(d / "raw.bin", size))
                (d / f"{level}-{mode}.bundle").unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    kernel = "accuracy.fused (numba)"
    print(f"threads={torch.get_num_threads()} runs={args.runs} plain forward={med['plain'] * 1e3:.1f} ms "
          f"(min {min(times['plain']) * 1e3:.1f}), statistics: {kernel}")
    print("level   mode     median ratio  ratio of medians  goal   bundle")
    for level, mode in configs:
        goal = 1.3 if mode == "summary" else 3.0
        size = f"{nbytes[level] / 1e6:,.1f} MB" if mode == "full" else ""
        ratio, of_medians = statistics.median(ratios[(level, mode)]), med[(level, mode)] / med["plain"]
        print(f"{level:7s} {mode:8s} {ratio:9.2f}x {of_medians:14.2f}x      <= {goal}x {size}")
    for level in levels:
        extra = med[(level, "full")] - med["plain"]
        rw = statistics.median(raw[level])
        print(f"{level}: full write speed {nbytes[level] / extra / 1e6:,.0f} MB/s of capture time over plain, raw "
              f"sequential write {nbytes[level] / rw / 1e6:,.0f} MB/s -> capture costs {extra / rw:.2f}x a raw write")


if __name__ == "__main__":
    main()
