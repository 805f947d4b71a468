"""Compare one bf16 run with its fp32 reference: a model's pair of full bundles (not a test).

Run: ``.venv/bin/python benchmarks/compare_pair.py [--model llama-small] [--rounds 9] [--under ROOT]``.

A child process builds ``--model`` (``benchmarks/models.py``: ``llama-small`` is a 4-layer
``transformers`` Llama with a ~20 ms forward and ~250 compared tensors, most of them small), captures
its fp32 reference and its bf16 variant in full mode (ATen level, one torch thread) and writes both
bundles. A second child loads the metric kernels, compares the pair once untimed and then
``--rounds`` times, and prints the median CPU time of one ``accuracy.compare`` (both bundle opens,
alignment, every metric, the verdicts) with:

- the pairs it judged and the time per pair;
- the metric kernel's own share: ``compare_arrays`` on every distinct pair of stored tensors the
  judged pairs name (clamped to the target dtype's range where the reference goes beyond it, as
  ``compare`` does; records that share stored tensors, e.g. a Linear's module output and its
  ``aten.mm``, are measured once), timed in the same child (the physical part: the rest is fixed cost
  per pair).

With ``--under ROOT`` (another opband checkout, e.g. ``git worktree add /tmp/base <commit>``) the
same two children run under ROOT as well, rounds interleaved with this opband's, and the ratio
ROOT / this is printed: the speed-up of one comparison. Each side captures and compares its own
pair (bundle formats differ between versions). Goal (issue 14): the pair's compare >= 5x faster than
at the issue's filing (its 0.27 s for llama-small).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = str(HERE.parent)

_CAPTURE = """
import sys, torch
sys.path.insert(0, {bench!r})
import models
from hooks import capture
from hooks.variants import apply_variant
torch.set_num_threads(1)
model, (x,) = models.build({model!r})
with torch.no_grad():
    with capture(model, {ref!r}, progress=False, run={{"variant": "fp32", "device": "cpu"}}):
        model(x)
    model, inputs, notes = apply_variant(model, (x,), "bf16", "cpu")[:3]
    with capture(model, {tgt!r}, progress=False, run={{**notes, "device": "cpu"}}):
        model(*inputs)
"""

_COMPARE = """
import json, statistics, time
import numpy as np
from accuracy.compare import compare
rep = compare({ref!r}, {tgt!r})  # loads (or compiles) the metric kernels and warms the page cache
times = []
for _ in range({rounds}):
    c = time.process_time()
    rep = compare({ref!r}, {tgt!r})
    times.append(time.process_time() - c)
judged = [op for op in rep.ops if getattr(op, "metrics", None) is not None]
kernel = None
try:  # the metric kernel alone over the same stored tensors (this opband's API)
    from accuracy.bundle import Bundle
    from accuracy.budgets import DTYPE_MAX
    from accuracy.metrics import compare_arrays
    r, g = Bundle.open({ref!r}), Bundle.open({tgt!r})
    rk = {{rec.key: rec for rec in r.records if rec.tensor}}
    pairs, seen = [], set()
    for rec in g.records:
        other = rk.get(rec.key)
        if rec.tensor and other is not None and other.shape == rec.shape:
            if (other.tensor, rec.tensor) in seen:  # records sharing stored tensors share one measurement
                continue
            seen.add((other.tensor, rec.tensor))
            a, ad = r.stored(other.tensor)
            b, bd = g.stored(rec.tensor)
            absmax = other.stats.absmax if other.stats else None
            top = DTYPE_MAX.get(rec.dtype)
            clip = top if top is not None and absmax is not None and absmax > top else None  # as compare does
            pairs.append((a.reshape(-1), b.reshape(-1), rec.dtype, ad, bd, clip or absmax, clip))
    ks = []
    for _ in range(3):
        k = time.process_time()
        for a, b, dt, ad, bd, absmax, clip in pairs:
            compare_arrays(a, b, dt, absmax, reference_dtype=ad, stored_dtype=bd, clip=clip)
        ks.append(time.process_time() - k)
    kernel = statistics.median(ks)
except (ImportError, AttributeError, TypeError):
    pass
print(json.dumps({{"times": times, "ops": len(rep.ops), "judged": len(judged), "kernel": kernel,
                  "verdict": str(getattr(rep, "verdict", ""))}}))
"""


def _child(code: str, root: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root,
                         env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise SystemExit(f"child under {root} failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--rounds", type=int, default=9, help="timed compares per child (median)")
    ap.add_argument("--repeat", type=int, default=3, help="compare children per side, interleaved")
    ap.add_argument("--under", default=None, help="also run under this opband checkout and print the ratio")
    args = ap.parse_args()
    roots = [("this", ROOT)] + ([("base", str(Path(args.under).resolve()))] if args.under else [])
    with tempfile.TemporaryDirectory(prefix="opband-pair-") as tmp:
        paths = {}
        for label, root in roots:
            ref, tgt = f"{tmp}/{label}-ref.bundle", f"{tmp}/{label}-tgt.bundle"
            _child(_CAPTURE.format(bench=str(HERE), model=args.model, ref=ref, tgt=tgt), root)
            paths[label] = (ref, tgt)
            print(f"{label}: {root}: bundles {os.path.getsize(ref) / 1e6:.1f} + {os.path.getsize(tgt) / 1e6:.1f} MB",
                  flush=True)
        results: dict[str, list[dict]] = {label: [] for label, _ in roots}
        for i in range(args.repeat):
            for label, root in roots if i % 2 == 0 else roots[::-1]:
                ref, tgt = paths[label]
                res = _child(_COMPARE.format(ref=ref, tgt=tgt, rounds=args.rounds), root)
                results[label].append(res)
                print(f"  round {i + 1} {label}: median {statistics.median(res['times']) * 1e3:7.1f} ms "
                      f"(min {min(res['times']) * 1e3:.1f}) {res['verdict']}", flush=True)
    med = {}
    for label, _ in roots:
        runs = results[label]
        med[label] = statistics.median(t for r in runs for t in r["times"])
        last = runs[-1]
        line = (f"{label}: one compare {med[label] * 1e3:.1f} ms (CPU, median of {args.repeat} x {args.rounds}); "
                f"{last['judged']} pairs judged of {last['ops']} ops: {med[label] / max(last['judged'], 1) * 1e6:.0f} "
                f"us per pair")
        kernels = [r["kernel"] for r in runs if r["kernel"] is not None]
        if kernels:
            k = statistics.median(kernels)
            line += (f"; metric kernel alone {k * 1e3:.1f} ms, fixed cost "
                     f"{(med[label] - k) / max(last['judged'], 1) * 1e6:.0f} us per pair")
        print(line)
    if "base" in med:
        print(f"speed-up vs base: {med['base'] / med['this']:.2f}x  (goal: >= 5x vs the issue's filing)")


if __name__ == "__main__":
    main()
