"""Wall time of ``opband sweep`` over the built-in LLM op list relative to running its ops bare.

Run: ``.venv/bin/python benchmarks/op_sweep.py [--dtypes bf16,fp16,int8] [--regimes all|boundary]``.

The baseline, measured in the same run, calls every case's op on its inputs once in float32 and
once per target dtype with nothing recorded (the arithmetic the sweep cannot avoid); the sweep
adds input generation, two bundles per dtype with statistics, and one replay comparison per
dtype. Prints both times, the case count and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hooks.opcases import BOUNDARY_REGIMES, REGIMES, make_inputs, parse_shapes  # noqa: E402
from hooks.opsweep import SweepConfig, _to_target, plan, run_sweep  # noqa: E402


def bare(cfg: SweepConfig) -> float:
    planned, _ = plan(cfg)
    start = time.perf_counter()
    with torch.no_grad():
        for p in planned:
            inputs = make_inputs(p.case, parse_shapes(p.signature), p.regime, p.seed)
            p.case.call(inputs)
            for variant in cfg.dtypes:
                p.case.call([_to_target(t, variant, "cpu") for t in inputs])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp16,int8")
    ap.add_argument("--regimes", choices=("all", "boundary"), default="all")
    args = ap.parse_args()
    regimes = list(REGIMES) if args.regimes == "all" else list(BOUNDARY_REGIMES)
    cfg = SweepConfig(dtypes=args.dtypes.split(","), regimes=regimes, reference_device="cpu")
    base = bare(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        result = run_sweep(cfg, tmp, progress=False)
        sweep = time.perf_counter() - start
    counts = result.report.counts()
    print(f"built-in LLM list: {len({r.op for r in result.report.rows})} ops x {len(cfg.dtypes)} dtypes x "
          f"{len(regimes)} regimes = {len(result.report.rows)} cases ({counts})")
    print(f"bare op calls: {base:.2f} s; opband sweep (bundles, statistics, compare): {sweep:.2f} s; "
          f"ratio {sweep / base:.1f}x")


if __name__ == "__main__":
    main()
