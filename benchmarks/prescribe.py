"""``opband prescribe`` benchmark (not a test): ``python benchmarks/prescribe.py [--model llama-small]``.

Plants the LLM.int8 trap in layer 1 of a benchmark Llama (one intermediate channel of the MLP made
``--scale`` times larger by ``up_proj`` and read back as many times weaker by ``down_proj``: fp32 computes
the same, dynamic int8 loses every other channel of ``down_proj``'s input), then times, in the same run:

- one plain forward of the fp32 model;
- one ``opband capture`` of the int8 variant (aten level, full mode: what a user runs first);
- ``opband prescribe --variant int8`` on the model.

Prints the target runs the search took, what it kept, and the prescription's time as a ratio to the
plain forward and to the one capture (process CPU time on one torch thread; ``--clock wall`` for wall).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import SIZES, build, steady_allocator  # noqa: E402
from hooks import capture  # noqa: E402
from hooks.prescribe import prescribe_models  # noqa: E402
from hooks.variants import apply_variant  # noqa: E402


def plant(model: torch.nn.Module, scale: float, channel: int = 5) -> None:
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.up_proj.weight[channel] *= scale
        mlp.down_proj.weight[:, channel] /= scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-small", choices=sorted(SIZES))
    ap.add_argument("--scale", type=float, default=3000.0)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steady_allocator()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model, (ids,) = build(args.model)
    plant(model, args.scale)
    inputs = {"input_ids": ids}
    tmp = Path(tempfile.mkdtemp(prefix="opband-prescribe-"))

    with torch.no_grad():
        model(**inputs)  # warm-up
        t0 = clock()
        model(**inputs)
        forward = clock() - t0
        target, tgt_inputs, _ = apply_variant(copy.deepcopy(model), inputs, "int8", "cpu")
        target(**tgt_inputs)
        t0 = clock()
        with capture(target, tmp / "int8.bundle", level="aten", mode="full", progress=False):
            target(**tgt_inputs)
        one_capture = clock() - t0
    t0 = clock()
    result = prescribe_models(model, inputs, "int8")
    took = clock() - t0
    print(f"{args.model}: int8 with an outlier channel planted before layer 1's down_proj (scale {args.scale:g})")
    print(f"  before {result.before.verdict} (norm_l2 {result.before.worst:.3g}) -> after "
          f"{result.after.verdict if result.after else '-'} (norm_l2 {result.after.worst if result.after else 0:.3g})")
    print(f"  keep {result.paths}; {result.runs} target runs over {result.candidates} candidates (+1 reference run)")
    print(f"{'':<28}{'seconds':>10}{'x forward':>12}{'x capture':>12}")
    for name, secs in (("plain forward (fp32)", forward), ("one capture (int8, full)", one_capture),
                       ("opband prescribe", took)):
        print(f"{name:<28}{secs:>10.3f}{secs / forward:>12.1f}{secs / one_capture:>12.2f}")


if __name__ == "__main__":
    main()
