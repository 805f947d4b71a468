"""What each way of seeing every ATen op costs, on one model (not a test; issue 14, goal 1).

Run: ``.venv/bin/python benchmarks/dispatch_floor.py [--model llama-small] [--rounds 15]``.

Every round runs, in a rotated order, with one torch thread, timed in CPU time:

- ``plain``: the forward alone;
- ``python mode``: the forward under a ``TorchDispatchMode`` that only calls the op (what opband's
  ``aten`` level pays before it does anything);
- ``opband summary``: ``hooks.capture(level="aten", mode="summary")``, which runs under opband's own
  compiled observer (``hooks/observer.py``, built at install time);
- ``opband summary (dispatch mode)``: the same with ``OPBAND_OBSERVER=0`` (the Python dispatch mode);
- ``c++ observer``: a thread-local ``at::RecordFunction`` callback (the profiler's hook, compiled here
  with the system C++ compiler against torch's headers) that sees every dispatcher call with its
  outputs and only counts them;
- ``c++ observer + stats``: the same computing min, max, sum and sum of squares of every contiguous
  float32 output in C++ (``-O3 -march=native -ffast-math``), the core of a summary row.

It prints the medians as ratios to the plain forward and the cost per call seen (Python dispatch
calls for the mode rows, dispatcher calls for the observer rows). The observer rows show what a
compiled capture path could cost; they are skipped, saying why, where no compiler or headers are
found. The observer compiled here is this script's own (the floor, counting only); opband's is
``hooks/native/observer.cpp``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402

from hooks import capture  # noqa: E402

_OBSERVER = r"""
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

static at::CallbackHandle handle = 0;
static int64_t calls = 0, summarised = 0;
static double checksum = 0;
static bool stats = false;

static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction&) { return nullptr; }

static void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  ++calls;
  if (!stats) return;
  for (const auto& v : fn.outputs()) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || !t.is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous()) continue;
    const float* p = t.const_data_ptr<float>();
    const int64_t n = t.numel();
    float lo = INFINITY, hi = -INFINITY, sum = 0, sq = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = p[i];
      lo = std::min(lo, x); hi = std::max(hi, x); sum += x; sq += x * x;
    }
    checksum += lo + hi + sum + sq;
    ++summarised;
  }
}

extern "C" void observer_start(int with_stats) {
  stats = with_stats != 0;
  calls = summarised = 0;
  handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_enter, on_exit)
                                          .needsInputs(false).needsOutputs(true)
                                          .scopes({at::RecordScope::FUNCTION}));
}

extern "C" int64_t observer_stop(int64_t* summarised_out) {
  at::removeCallback(handle);
  *summarised_out = summarised;
  return calls;
}
"""


class _NoOpMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _build_observer(folder: Path) -> ctypes.CDLL | str:
    """The observer as a shared library loaded with ctypes, or a sentence saying why not."""
    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        return "no C++ compiler (set CXX)"
    lib_dir = Path(torch.__file__).parent / "lib"
    source, out = folder / "observer.cpp", folder / "observer.so"
    source.write_text(_OBSERVER)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()],
           str(source), "-o", str(out),
           f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"the observer did not compile: {done.stderr.strip().splitlines()[-1:]}"
    lib = ctypes.CDLL(str(out))
    lib.observer_start.argtypes = [ctypes.c_int]
    lib.observer_stop.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.observer_stop.restype = ctypes.c_int64
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small", choices=models.MODELS)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    models.steady_allocator()  # freed memory stays in the process: no page-fault swings between runs
    torch.set_num_threads(1)
    model, (x,) = models.build(args.model)
    mode = _NoOpMode()
    seen: dict[str, int] = {}

    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        folder = Path(tmp)
        print("compiling the C++ observer ...", flush=True)
        lib = _build_observer(folder)

        def observed(with_stats: int) -> Callable[[], None]:
            def run() -> None:
                assert isinstance(lib, ctypes.CDLL)
                summarised = ctypes.c_int64()
                lib.observer_start(with_stats)
                try:
                    model(x)
                finally:
                    seen["dispatcher calls"] = lib.observer_stop(ctypes.byref(summarised))
                if with_stats:
                    seen["float32 outputs summarised"] = summarised.value
            return run

        def python_mode() -> None:
            mode.calls = 0
            with mode:
                model(x)
            seen["python dispatch calls"] = mode.calls

        def summary(engine: str) -> Callable[[], None]:
            def run() -> None:
                os.environ["OPBAND_OBSERVER"] = engine
                with capture(model, folder / "summary.bundle", progress=False, level="aten", mode="summary"):
                    model(x)
                os.environ.pop("OPBAND_OBSERVER")
            return run

        runs: dict[str, Callable[[], None]] = {"plain": lambda: model(x), "python mode": python_mode,
                                               "opband summary": summary("1"),
                                               "opband summary (dispatch mode)": summary("0")}
        if isinstance(lib, ctypes.CDLL):
            runs |= {"c++ observer": observed(0), "c++ observer + stats": observed(1)}
        else:
            print(f"c++ observer rows skipped: {lib}")
        names = list(runs)
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            runs[name]()  # warm: kernels, caches, the first-call costs
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t = time.process_time()
                runs[name]()
                times[name].append(time.process_time() - t)

    med = {name: statistics.median(v) for name, v in times.items()}
    plain = med["plain"]
    per = {"python mode": "python dispatch calls", "opband summary": "python dispatch calls",
           "opband summary (dispatch mode)": "python dispatch calls",
           "c++ observer": "dispatcher calls", "c++ observer + stats": "dispatcher calls"}
    print(f"model {args.model}: one thread, CPU time, median of {args.rounds} rounds; "
          + ", ".join(f"{v:,} {k}" for k, v in seen.items()))
    print(f"{'':32s} {'median':>9s} {'ratio':>7s} {'per call seen':>14s}")
    for name in names:
        calls = seen.get(per.get(name, ""), 0)
        cost = f"{(med[name] - plain) / calls * 1e6:9.2f} us" if calls else ""
        print(f"{name:32s} {med[name] * 1e3:7.1f} ms {med[name] / plain:6.2f}x {cost:>14s}")


if __name__ == "__main__":
    main()
