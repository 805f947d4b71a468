"""Capture overhead of the issue-10 paths (not a test): ``python benchmarks/capture_paths.py [--runs 5]``.

For each path, every round runs the plain computation and the captured one back to back (order
alternating between rounds); the median over rounds of captured / plain is printed:
- quantizing variants (int8, w8a16, w4a16, fp8 per tensor and per row) on a 4-layer decoder
  (width 256), one forward, aten level, summary and full;
- ``--compile``: per-block torch.compile (Inductor C++), one forward, aten level, full;
- ``--backward``: one SGD training step, aten level with gradients and updates, full;
- multi-rank: a 2-rank tensor-parallel MLP under gloo (measured inside rank 0), aten level, full.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hooks import capture, demo_model  # noqa: E402
from hooks.compiled import compile_blocks  # noqa: E402
from hooks.demo_model import DecoderConfig  # noqa: E402
from hooks.training import train_steps  # noqa: E402
from hooks.variants import apply_variant  # noqa: E402

CFG = DecoderConfig(vocab=1024, dim=256, layers=4, heads=4, hidden=704, seq=64, batch=2)


def _median_ratio(plain: Callable[[], None], captured: Callable[[], None], runs: int) -> tuple[float, float]:
    plain()
    captured()  # warm
    ratios, base = [], []
    for r in range(runs):
        order = (plain, captured) if r % 2 == 0 else (captured, plain)
        t = {}
        for fn in order:
            s = time.perf_counter()
            fn()
            t[fn] = time.perf_counter() - s
        ratios.append(t[captured] / t[plain])
        base.append(t[plain])
    return statistics.median(ratios), statistics.median(base)


def _forward_paths(runs: int, d: Path) -> list[tuple[str, float, float]]:
    out = []
    for variant in ("int8", "w8a16", "w4a16", "fp8-e4m3", "fp8-e4m3-rowwise"):
        model, inputs = demo_model.build(CFG)
        model, inputs, _ = apply_variant(model, inputs, variant, "cpu")
        for mode in ("summary", "full"):
            def plain() -> None:
                with torch.no_grad():
                    model(*inputs)

            def cap() -> None:
                with torch.no_grad(), capture(model, d / "v.bundle", mode=mode, progress=False):
                    model(*inputs)

            ratio, base = _median_ratio(plain, cap, runs)
            out.append((f"--variant {variant} (aten, {mode})", ratio, base))
    model, inputs = demo_model.build(CFG)
    model, _ = compile_blocks(model)

    def plain_c() -> None:
        with torch.no_grad():
            model(*inputs)

    def cap_c() -> None:
        with torch.no_grad(), capture(model, d / "c.bundle", progress=False):
            model(*inputs)

    out.append(("--compile (aten, full)", *_median_ratio(plain_c, cap_c, runs)))
    return out


def _backward_path(runs: int, d: Path) -> tuple[str, float, float]:
    model, (ids,) = demo_model.build(CFG)
    target = torch.randint(0, CFG.vocab, ids.shape, generator=torch.Generator().manual_seed(1))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, CFG.vocab), target.reshape(-1))

    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(ids)).backward()
        opt.step()

    def cap() -> None:
        with capture(model, d / "b.bundle", backward=True, progress=False) as c:
            train_steps(model, (ids,), c, loss_fn, steps=1, lr=1e-3)

    return ("--backward, 1 SGD step (aten, full)", *_median_ratio(plain, cap, runs))


def _rank_worker(rank: int, world: int, port: int, runs: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        fc1 = torch.nn.Linear(512, 2048 // world)
        fc2 = torch.nn.Linear(2048 // world, 512, bias=False)

        class TP(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = fc1, fc2

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y = self.fc2(F.gelu(self.fc1(x)))
                dist.all_reduce(y)
                return y

        model, x = TP(), torch.randn(256, 512)

        def plain() -> None:
            with torch.no_grad():
                model(x)

        def cap() -> None:
            with torch.no_grad(), capture(model, Path(out) / "tp.bundle", progress=False):
                model(x)

        ratio, base = _median_ratio(plain, cap, runs)
        if rank == 0:
            (Path(out) / "tp.txt").write_text(f"{ratio} {base}")
    finally:
        dist.destroy_process_group()


def _rank_path(runs: int, d: Path) -> tuple[str, float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_worker, args=(2, port, runs, str(d)), nprocs=2, start_method="spawn")
    ratio, base = map(float, (d / "tp.txt").read_text().split())
    return "2 ranks, tensor-parallel MLP + all_reduce (aten, full)", ratio, base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        rows = [*_forward_paths(args.runs, d), _backward_path(args.runs, d), _rank_path(args.runs, d)]
    print(f"{'path':58} {'plain (s)':>10} {'captured/plain':>15}")
    for name, ratio, base in rows:
        print(f"{name:58} {base:10.4f} {ratio:14.2f}x")


if __name__ == "__main__":
    main()
