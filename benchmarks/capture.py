"""Capture overhead benchmark (not a test): ``python benchmarks/capture.py [--model llama-small] [--runs 7]``.

Prints, for one model (``--model``: ``llama-small`` ~20 ms forward with ~400 mostly small ATen
ops, ``llama-mid`` ~100 ms, ``llama-tiny`` llama-small's ops on tensors of a few hundred elements
(capture's fixed costs alone), ``demo`` = ``hooks.demo_model.build_large``; see
``benchmarks/models.py``) and each level:
- summary and full capture time as ratios to the plain forward pass. Every round runs the plain
  forward and each (level, mode) once, in an order rotated from round to round; a round's ratios
  are to that round's plain forward, and the median over rounds is reported (with the ratio of
  the medians next to it, the two agree on a quiet machine);
- the per-op fixed cost of summary mode: (summary - plain - statistics floor) / ops seen, where the
  floor is the bytes the statistics read divided by the statistics kernel's own throughput on one
  large buffer, measured in the same run;
- full mode's extra time as a ratio to a raw sequential write of the same number of bytes, for the
  whole process and for the capturing thread alone (the bundle's writer thread and the weight walk
  run beside it: a spare core takes them off the wall time, not off the process's CPU time).

Writes and page state (``--pages``): this VM returns free memory to its host (virtio free page
reporting) and faults it back in on first touch, so a write into pages freed more than ~2 s ago
costs 6-10x one into pages just freed (74 MB: 100-170 ms CPU vs 15 ms), in no fixed pattern; and
freed pages go back to the freeing CPU's page lists first (58 MB freed on CPU 0: 13 ms to write
again on CPU 0, 27-88 ms on CPU 1). With ``--pages recycled`` (default, when full mode is timed) every
timed run (plain forward, capture, raw write) comes right after an untimed write and delete of as many
bytes as a full capture writes on each CPU (a thread pinned to it), so the capture's writer thread,
wherever it runs, and the raw write both write into recycled pages, as on a machine without page
reporting, and every run starts with the caches that preamble leaves (cold: a forward after it takes
2-4 ms more on llama-mid); ``--pages as-is`` times them as they come.

``--clock cpu`` (default) times the process's CPU time, which a busy shared machine disturbs far
less than wall time (torch runs on ``--threads``, default 1, so the two agree on an idle machine);
``--clock wall`` times wall time (each measurement starts after ``os.sync()``: the previous one's
dirty pages are not written back during it). ``--device cuda`` moves the model and its input to the
GPU and times wall clock with a ``torch.cuda.synchronize()`` at each reading (the forward is
asynchronous there); the statistics floor is then ``hooks.tensors.device_stats``'s throughput on
the GPU. CPU and wall clock part at the ``aten`` level: its weights of 2 MB or more are
fingerprinted on a background thread while the forward runs (``hooks.fingerprints.ParameterPrints``),
which a spare core takes off the wall time but not off the process's CPU time. At the ``aten`` level
both modes are timed under the compiled observer (``hooks/observer.py``, the default where it
serves) and under the Python dispatch mode (``OPBAND_OBSERVER=0``), and summary once more with two forward
passes in one capture: the second pass's extra time over a plain forward, per op, is the marginal
per-op cost, free of what a capture pays once (entry, weight fingerprints, the bundle's write).
Goals (issue 14): llama-small summary <= 1.5x, full <= 2.5x, <= 10 us per op; llama-mid summary
<= 1.2x, full <= plain + 1.2x a raw write.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402

from accuracy.bundle import Bundle  # noqa: E402
from hooks import capture  # noqa: E402

GOALS = {"llama-tiny": (None, None), "llama-small": (1.5, 2.5), "llama-mid": (1.2, None), "llama-mid512": (None, 2.5), "demo": (1.3, 3.0)}


def _plain(clock: Callable[[], float], model: torch.nn.Module, x: torch.Tensor) -> float:
    _recycle_pages()  # the same start as every capture's (see _recycle_pages)
    t = clock()
    model(x)
    return clock() - t


#: (the last forward's time, the exit's time, the capturing thread's CPU time) of each _captured call
_PHASES: list[tuple[float, float, float]] = []

#: when set, a file of this many bytes is written and deleted (untimed) before each timed write
_RECYCLE: dict[str, Path | int] = {}


def _captured(clock: Callable[[], float], model: torch.nn.Module, x: torch.Tensor, path: Path, engine: str = "",
              forwards: int = 1, **opts: object) -> tuple[float, int]:
    """Time one capture of ``forwards`` forward passes; ``engine`` "dispatch" sets OPBAND_OBSERVER=0
    (the Python dispatch mode even where the compiled observer could serve)."""
    path.unlink(missing_ok=True)
    saved = os.environ.get("OPBAND_OBSERVER")
    os.environ["OPBAND_OBSERVER"] = "0" if engine == "dispatch" else "1"
    _recycle_pages()
    try:
        thread = time.thread_time()
        t = clock()
        with capture(model, path, progress=False, **opts):
            for _ in range(forwards - 1):
                model(x)
            last = clock()
            model(x)
            exiting = clock()
        took = clock() - t
        _PHASES.append((exiting - last, clock() - exiting, time.thread_time() - thread))
    finally:
        if saved is None:
            os.environ.pop("OPBAND_OBSERVER")
        else:
            os.environ["OPBAND_OBSERVER"] = saved
    return took, path.stat().st_size


def _synchronized_clock(device: str) -> Callable[[], float]:
    """Wall clock read after the device finished its queued work."""
    sync = torch.get_device_module(torch.device(device).type).synchronize

    def clock() -> float:
        sync()
        return time.perf_counter()

    return clock


def _settle_disk() -> None:
    """Untimed, between measurements: the kernel writes back what the last capture and raw write left
    dirty now, not on the spare core while the next measurement runs (where the aten level walks
    weights and writes tensors in the background)."""
    if hasattr(os, "sync"):
        os.sync()


def _write_file(path: Path, nbytes: int, chunk: int = 16 << 20) -> None:
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (chunk >> 20))
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, chunk)
            f.write(buf[:n])
            left -= n


def _raw_write(clock: Callable[[], float], path: Path, nbytes: int) -> float:
    path.unlink(missing_ok=True)
    _recycle_pages()
    t = clock()
    _write_file(path, nbytes)
    return clock() - t


def _recycle_pages() -> None:
    """With ``--pages recycled``: on each CPU, write and delete (untimed) as many bytes as the next timed
    write writes, so that it writes into pages just freed wherever it runs (see the module docstring).
    Every timed run (plain forward, each capture, raw write) comes after it, not only those that write:
    it leaves the CPU caches cold, which cost a forward after it 2-4 ms more on llama-mid (measured), so
    timing only the full captures after it charged them for the preamble."""
    if not _RECYCLE:
        return
    path, nbytes = Path(_RECYCLE["path"]), int(_RECYCLE["bytes"])

    def on(cpu: int | None) -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # this thread only
        mine = path.with_name(f"{path.name}.{cpu}")
        _write_file(mine, nbytes)
        os.sync()
        mine.unlink()

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else [None]
    for cpu in cpus:
        t = threading.Thread(target=on, args=(cpu,))
        t.start()
        t.join()


def _stats_bandwidth(clock: Callable[[], float], device: str = "cpu") -> float:
    """Bytes per second the statistics kernel reads from a 64 MB float32 buffer (median of 5): the
    CPU kernel (``accuracy.fused``), or on an accelerator the on-device one (``device_stats``)."""
    if device != "cpu":
        from hooks.tensors import device_stats

        y = torch.randn(16 << 20, device=device)
        device_stats(y)
        samples = []
        for _ in range(5):
            t = clock()
            device_stats(y)
            samples.append(clock() - t)
        return y.numel() * 4 / statistics.median(samples)
    try:
        from accuracy import fused
    except ImportError:  # an opband before the fused kernels (the baseline of a before/after run)
        return float("nan")
    x = np.random.default_rng(0).standard_normal(16 << 20, dtype=np.float32)
    fused.tensor_stats(x)
    times = []
    for _ in range(5):
        t = clock()
        fused.tensor_stats(x)
        times.append(clock() - t)
    return x.nbytes / statistics.median(times)


def _vector_width() -> str:
    """The statistics kernel's vector width (``accuracy.fused.WIDE_VECTORS``; older opbands: LLVM's default)."""
    try:
        from accuracy import fused
    except ImportError:
        return "no fused kernels"
    return "512-bit" if getattr(fused, "WIDE_VECTORS", False) else "LLVM's default"


def _fingerprint_time(clock: Callable[[], float], model: torch.nn.Module) -> float | None:
    """CPU time of the parameter fingerprints every capture takes (median of 3), None where there are none."""
    try:
        from hooks.fingerprints import parameter_prints
    except ImportError:
        return None
    times = []
    for _ in range(3):
        t = clock()
        parameter_prints(model)
        times.append(clock() - t)
    return statistics.median(times)


def _summary_shape(path: Path) -> tuple[int, int]:
    """(records with statistics, bytes their statistics read) of a summary bundle."""
    b = Bundle.open(path)
    sizes = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
    with_stats = [r for r in b.records if r.stats is not None]
    return len(with_stats), sum(r.stats.numel * sizes.get(r.dtype, 8) for r in with_stats)  # type: ignore[union-attr]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small", choices=models.MODELS)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--levels", default="aten", help="comma-separated capture levels (module,api,aten)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--device", default="cpu", help="device of the model and input (cuda: wall clock, synchronized)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile N captures of the first level (cProfile, top 20 by own time)")
    ap.add_argument("--profile-mode", choices=("summary", "full"), default="summary", help="the mode --profile captures")
    ap.add_argument("--modes", default="summary,full",
                    help="comma-separated capture modes to time (full mode's large writes and frees disturb the "
                         "page cache and the allocator for the captures after them: summary alone reads steadier)")
    ap.add_argument("--no-fingerprints", action="store_true", help="capture(fingerprints=False): no weight digests")
    ap.add_argument("--pages", choices=("recycled", "as-is"), default="recycled",
                    help="recycled: each timed full capture and raw write writes into pages just freed (see above)")
    ap.add_argument("--malloc", choices=("steady", "default"), default="steady",
                    help="steady: glibc keeps freed memory (models.steady_allocator); default: as the process starts")
    args = ap.parse_args()
    if args.malloc == "steady" and not models.steady_allocator():
        args.malloc = "default (mallopt unavailable)"
    levels = args.levels.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model, (x,) = models.build(args.model)
    if args.device != "cpu":
        model, x = model.to(args.device), x.to(args.device)
        args.clock = "wall, synchronized"
        clock = _synchronized_clock(args.device)
    extra: dict[str, object] = {"fingerprints": False} if args.no_fingerprints else {}
    # (level, mode, engine, forwards): at the aten level summary mode runs under the compiled observer
    # and under the dispatch mode, and under the observer with two forward passes in one capture
    # (the second one's cost is the marginal per-op cost, free of the capture's fixed costs)
    modes = args.modes.split(",")
    configs = [(level, mode, "", 1) for level in levels for mode in modes]
    if "aten" in levels and "summary" in modes:
        configs += [("aten", "summary", "dispatch", 1), ("aten", "summary", "", 2)]
    if "aten" in levels and "full" in modes:
        configs += [("aten", "full", "dispatch", 1)]
    times: dict[object, list[float]] = {c: [] for c in [*configs, "plain"]}
    ratios: dict[object, list[float]] = {c: [] for c in configs}
    nbytes: dict[str, int] = {}
    raw: dict[str, list[float]] = {level: [] for level in levels}
    shape: dict[str, tuple[int, int]] = {}
    ops: dict[str, int] = {}
    engine_of: dict[str, str] = {}
    phases: dict[object, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        d = Path(tmp)
        _plain(clock, model, x)
        for level in levels:
            _captured(clock, model, x, d / "warm.bundle", level=level, mode="full", **extra)
            _captured(clock, model, x, d / "warm.bundle", level=level, mode="summary", **extra)
            with capture(model, d / "count.bundle", progress=False, level=level, mode="summary", **extra) as cap:
                model(x)
            ops[level] = cap._recorder.ops_seen
            engine_of[level] = cap.engine or "module hooks"
            shape[level] = _summary_shape(d / "count.bundle")
            if args.pages == "recycled" and "full" in modes:
                _captured(clock, model, x, d / "size.bundle", level=level, mode="full", **extra)
                _RECYCLE.update(path=d / "recycle.bin", bytes=max(int(_RECYCLE.get("bytes", 0)),
                                                                  (d / "size.bundle").stat().st_size))
        bandwidth = _stats_bandwidth(clock, args.device)
        prints = _fingerprint_time(clock, model)
        for r in range(args.runs):
            plain = _plain(clock, model, x)
            times["plain"].append(plain)
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for config in order:
                level, mode, engine, forwards = config
                t, size = _captured(clock, model, x, d / f"{level}-{mode}.bundle", engine, forwards, level=level,
                                    mode=mode, **extra)
                times[config].append(t)
                ratios[config].append(t / plain)
                phases.setdefault(config, []).append(_PHASES[-1])
                if mode == "full" and not engine:
                    nbytes[level] = size
                    raw[level].append(_raw_write(clock, d / "raw.bin", size))
                (d / f"{level}-{mode}.bundle").unlink()
                _settle_disk()
    med = {k: statistics.median(v) for k, v in times.items()}
    if os.environ.get("OPBAND_BENCH_DEBUG"):
        for k, v in times.items():
            print(k, [round(t * 1e3, 1) for t in v], [tuple(round(p * 1e3, 1) for p in ph) for ph in phases.get(k, [])])
    goals = GOALS[args.model]
    if args.device != "cpu":
        from hooks.tensors import _compiled_cuda

        stats = os.environ.get("OPBAND_DEVICE_STATS") or ("compiled (hooks/native/stats_cuda.cu)" if _compiled_cuda()
                                                          else "triton")
        print(f"on-device statistics: {stats}; summary capture engine: "
              + "; ".join(f"{level}: {engine}" for level, engine in engine_of.items()))
    print(f"model {args.model} on {args.device}: threads={torch.get_num_threads()} runs={args.runs} clock={args.clock} "
          f"malloc={args.malloc} plain forward={med['plain'] * 1e3:.1f} ms (min {min(times['plain']) * 1e3:.1f}); "
          f"statistics kernel {bandwidth / 1e9:.1f} GB/s ({_vector_width()} vectors)")
    engines = {"": "", "dispatch": " (dispatch mode)"}
    if "full" in modes:
        print(f"full captures and raw writes write into {args.pages} pages (--pages)")
    print("level   mode                      median ratio  ratio of medians  goal     bundle")
    for config in configs:
        level, mode, engine, forwards = config
        if forwards > 1:
            continue
        goal = goals[0] if mode == "summary" and not engine else goals[1] if mode == "full" and not engine else None
        size = f"{nbytes[level] / 1e6:,.1f} MB" if mode == "full" else ""
        ratio, of_medians = statistics.median(ratios[config]), med[config] / med["plain"]
        goal_txt = f"<= {goal}x" if goal else "-"
        label = mode + (engines[engine] if level == "aten" else "")
        print(f"{level:7s} {label:25s} {ratio:9.2f}x {of_medians:14.2f}x      {goal_txt:8s} {size}")
    if prints is not None and not args.no_fingerprints:
        print(f"of every capture's time, parameter fingerprints (hooks.fingerprints: xxh3-128 digest, sum, L2, absmax "
              f"of every weight; capture(fingerprints=False) skips them): {prints * 1e3:.1f} ms = "
              f"{prints / med['plain']:.2f}x the plain forward (walked alone, on this thread; the aten level walks "
              "weights of 2 MB or more on a background thread during the forward: see --clock wall)")
    for level in levels:
        records, read = shape[level]
        if "summary" in modes:
            floor = read / bandwidth
            extra = med[(level, "summary", "", 1)] - med["plain"]
            n_ops = max(ops[level], 1)
            print(f"{level}: summary: {ops[level]:,} ops seen, {records:,} records, {read / 1e6:,.1f} MB of statistics "
                  f"reads (floor {floor * 1e3:.1f} ms) -> {(extra - floor) / n_ops * 1e6:.1f} us per op "
                  f"beyond the statistics' memory traffic ({extra / n_ops * 1e6:.1f} us in all, the capture's fixed "
                  "costs spread over its ops)")
            if level == "aten":
                two = phases[("aten", "summary", "", 2)]
                forward = statistics.median(p[0] for p in two) - med["plain"]
                leaving = statistics.median(p[1] for p in two) - statistics.median(p[1] for p in phases[("aten", "summary", "", 1)])
                marginal = forward + leaving
                print(f"aten: summary: a second forward in the same capture costs plain + {forward * 1e3:.2f} ms while "
                      f"it runs and {leaving * 1e3:.2f} ms more at the capture's exit (its {records:,} records) -> "
                      f"{(marginal - floor) / n_ops * 1e6:.1f} us per op beyond the statistics' memory traffic "
                      f"({marginal / n_ops * 1e6:.1f} us in all): the marginal per-op cost (goal <= 10 us)")
                mode_extra = med[("aten", "summary", "dispatch", 1)] - med["plain"]
                print(f"aten: summary under the dispatch mode (OPBAND_OBSERVER=0): {(mode_extra - floor) / n_ops * 1e6:.1f} "
                      f"us per op beyond the statistics' memory traffic")
        if "full" in modes:
            rw = statistics.median(raw[level])
            print(f"{level}: full: {nbytes[level] / 1e6:,.0f} MB; a raw sequential write of the same bytes takes "
                  f"{rw * 1e3:.1f} ms ({nbytes[level] / rw / 1e6:,.0f} MB/s)")
            for engine in ("", "dispatch") if level == "aten" else ("",):
                config = (level, "full", engine, 1)
                extra_full = med[config] - med["plain"]
                own = statistics.median(p[2] for p in phases[config]) - med["plain"]
                name = "the dispatch mode" if engine else "the observer" if level == "aten" else "module hooks"
                goal_txt = " (goal on CUDA: <= 1.3x; outputs copied on a side stream)" if args.device == "cuda" else ""
                print(f"{level}: full under {name}: capture costs plain + {extra_full / rw:.2f}x the raw write{goal_txt}; "
                      f"the capturing thread alone plain + {own / rw:.2f}x (CPU; the writer thread and the weight "
                      "walk run beside it)")
    if args.profile:
        _profile(model, x, levels[0], args.profile_mode, args.profile,
                 {"fingerprints": False} if args.no_fingerprints else {})


def _profile(model: torch.nn.Module, x: torch.Tensor, level: str, mode: str, rounds: int,
             extra: dict[str, object]) -> None:
    """Where a capture's time goes: cProfile over ``rounds`` captures, top 20 by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for r in range(rounds):
            prof.enable()
            with capture(model, Path(tmp) / f"p{r}.bundle", progress=False, level=level, mode=mode, **extra):
                model(x)
            prof.disable()
    print(f"\nprofile: {rounds} {level}/{mode} captures, top 20 by own time (tottime s, cumtime s)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
