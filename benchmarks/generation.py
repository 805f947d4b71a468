"""Generation capture benchmark (not a test): ``python benchmarks/generation.py [--model llama-small] [--tokens 32]``.

Times a greedy ``generate()`` of ``--tokens`` new tokens from a 32-token prompt, plain and under
``capture(..., call_steps=True)`` the way ``opband capture --generate`` runs it (summary and full
mode, the compiled observer where it serves, each step's log-probabilities kept in the bundle), in
rounds whose order rotates; prints each mode's median ratio to the plain ``generate()`` of the same
round, the records per step and the engine, beside a floor no capture on this design goes under: the
plain ``generate()`` with a no-op global module forward pre- and post-hook (what module attribution
alone costs in ``torch.nn.Module._call_impl``).
Process CPU time on one torch thread (``--clock wall`` for wall time). Goal (issue 32): summary
<= 1.5x on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy.bundle import Bundle  # noqa: E402
from models import SIZES, steady_allocator  # noqa: E402
from hooks import capture  # noqa: E402
from hooks.generation import generate  # noqa: E402

PROMPT = 32


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(SIZES[name])
    size.pop("seq")
    size.pop("batch", None)
    torch.manual_seed(0)
    cfg = LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=512)
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    return LlamaForCausalLM(cfg).eval(), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-small", choices=sorted(SIZES))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steady_allocator()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model, ids = build(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="opband-gen-"))

    def plain() -> None:
        with torch.no_grad():
            generate(model, {"input_ids": ids}, args.tokens)

    def hooked() -> None:
        mm = torch.nn.modules.module
        handles = [mm.register_module_forward_pre_hook(lambda m, a: None),
                   mm.register_module_forward_hook(lambda m, a, o: None)]
        try:
            plain()
        finally:
            for h in handles:
                h.remove()

    def captured(mode: str) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), capture(model, tmp / f"{mode}.bundle", level="aten", mode=mode, progress=False,
                                          call_steps=True) as cap:
                generate(model, {"input_ids": ids}, args.tokens, paused=cap.paused, keep=cap.add_tensor)
        return run

    runs: dict[str, Callable[[], None]] = {"plain": plain, "no-op hooks": hooked, "summary": captured("summary"),
                                           "full": captured("full")}
    for fn in runs.values():  # warm-up: kernels, allocator, caches
        fn()
    ratios: dict[str, list[float]] = {k: [] for k in runs if k != "plain"}
    names = list(runs)
    for r in range(args.runs):
        order = names[r % len(names):] + names[:r % len(names)]
        took = {}
        for name in order:
            for old in tmp.glob("*.bundle"):  # a capture writes a new bundle: removing the last one is not its cost
                old.unlink()
            t0 = clock()
            runs[name]()
            took[name] = clock() - t0
        for name in ratios:
            ratios[name].append(took[name] / took["plain"])
    runs["summary"]()
    b = Bundle.open(tmp / "summary.bundle")
    steps = max(r.step for r in b.records) + 1
    print(f"{args.model}: generate({args.tokens} tokens) from a {PROMPT}-token prompt, {args.clock} clock, "
          f"{args.runs} rounds; {len(b.records)} records over {steps} steps, engine {b.manifest.run.get('engine')}")
    print(f"{'mode':<12}{'median ratio to plain generate()':>36}{'min':>8}{'max':>8}")
    for name, rs in ratios.items():
        print(f"{name:<12}{statistics.median(rs):>36.2f}{min(rs):>8.2f}{max(rs):>8.2f}")
    print("goal: summary <= 1.5x (issue 32)")


if __name__ == "__main__":
    main()
