"""GPU check (not a test; issue 3 item 13): ``python benchmarks/gpu_check.py [--device cuda] [--out DIR]``.

Captures the demo decoder (``hooks.demo_model:build``, aten level, full mode) on the CPU in fp32
as the reference, then on DEVICE as each target of ``--targets`` (default: fp32, bf16, fp16, the
FP8 variants on ``torch._scaled_mm`` (real float8 tensor cores on a Hopper GPU) and fp32 with
each block through ``torch.compile``), compares each device capture with the CPU one
(``accuracy.compare``, propagated mode, default budgets) and prints, as Markdown:
- one summary row per target: verdict, counts by verdict, the worst op by normalised L2
  error, the first divergence (a target whose capture raises gets a row with the error, and the
  script exits 1 after the other targets ran; a variant the device's kernels refuse, such as
  fp8-e5m2 x fp8-e5m2 in cuBLASLt, gets a row with the kernel's reason);
- the worst ops of each target;
- whether a summary-mode capture on DEVICE ran without one host sync inside the forward
  (``torch.cuda.set_sync_debug_mode("error")`` makes any synchronising call raise): the
  statistics stay on the device as one row per tensor until the capture ends;
- whether those on-device statistics (torch kernels) agree with the CPU kernel
  (``accuracy.fused``, numba) on the same fp32/bf16/fp16 values with NaN, Inf and zeros.
Bundles and JSON reports go to ``--out`` (default: ``$OUT`` when set, else a temporary folder).
It takes seconds on a GPU; ``--device cpu`` runs the same steps on the CPU (a dry run).

Only ``hooks/`` and ``accuracy/`` are imported (no service packages). On the lent H200, whose
image has torch, Triton, numba, numpy and xxhash but not pydantic, run it through
``benchmarks/gpu_session.sh`` (``make gpu-wheels`` here first; that script says how), which also
runs the GPU tests and the capture benchmark on CUDA in the same call.
``tests/test_gpu_check_script.py`` runs the dry run in ``make test``, so the script stays ready for
a session that is lent the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accuracy import report as R  # noqa: E402
from accuracy.bundle import Bundle  # noqa: E402
from accuracy.compare import ComparisonReport, compare  # noqa: E402
from hooks import capture, demo_model  # noqa: E402
from hooks.runner import run_capture  # noqa: E402
from hooks.variants import VariantCoverageError  # noqa: E402

SPEC = "hooks.demo_model:build"
#: target name -> run_capture options; "+compile" runs each block through torch.compile
TARGETS: dict[str, dict[str, Any]] = {
    "fp32": {"variant": "fp32"}, "bf16": {"variant": "bf16"}, "fp16": {"variant": "fp16"},
    "fp8-e4m3": {"variant": "fp8-e4m3"}, "fp8-e4m3-rowwise": {"variant": "fp8-e4m3-rowwise"},
    "fp8-e5m2": {"variant": "fp8-e5m2"}, "fp32+compile": {"variant": "fp32", "compile": True},
}
DRY_RUN_TARGETS = "fp32,bf16"


def _summary_row(name: str, rep: ComparisonReport) -> str:
    counts = ", ".join(f"{n} {v}" for v, n in rep.counts.items() if n)
    scored = [(o.metrics.norm_l2, o) for o in rep.ops if o.metrics is not None]
    norm, worst = max(scored, key=lambda s: s[0], default=(None, None))
    worst_txt = f"`{worst.id}` {R.fmt(norm)}" if worst is not None else "-"
    fd = rep.first_divergence
    fd_txt = f"`{fd.id}` ({fd.reason})" if fd is not None else "none"
    return f"| {name} | {rep.verdict} | {counts} | {worst_txt} | {fd_txt} |"


def _no_sync_summary(device: str, out: Path) -> str:
    """Capture a summary on ``device`` with sync debugging set to raise; say what happened."""
    if not device.startswith("cuda"):
        return "skipped (not a CUDA device)"
    model, (ids,) = demo_model.build()
    model, ids = model.to(device), ids.to(device)
    with torch.no_grad():
        model(ids)
        torch.cuda.synchronize()
        try:
            with capture(model, out / "summary-sync.bundle", mode="summary", progress=False) as cap:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    model(ids)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        except RuntimeError as e:
            return f"FAILED: a host sync inside the forward ({e})"
    records = list(cap.records)
    synced = [d.message for d in Bundle.open(cap.bundle_path).manifest.diagnostics if "synchroniz" in d.message]
    if synced:  # a sync the capture caught and turned into a diagnostic
        return f"FAILED: a host sync inside the forward ({synced[0]})"
    return f"ok: {len(records)} records with statistics, no host sync inside the forward"


def _device_stats_agree(device: str) -> str:
    """The on-device statistics (``hooks.tensors.device_stats``: torch kernels on the device, one
    row per tensor, no host copy) against the CPU kernel (``host_stats``, ``accuracy.fused``) on the
    same values: counts, min and max exactly, the sums to float32 rounding."""
    from hooks.tensors import STAT_FIELDS, device_stats, host_stats

    g = torch.Generator(device="cpu").manual_seed(0)
    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1 << 20, generator=g).to(dtype)
        x[::997] = 0
        x[5], x[7], x[11] = float("nan"), float("inf"), float("-inf")
        on_device = device_stats(x.to(device)).to("cpu", torch.float64).tolist()
        on_host = host_stats(x)
        for i, name in enumerate(STAT_FIELDS):
            a, b = on_device[i], on_host[i]
            exact = name in ("numel", "min", "max", "absmax", "nan", "inf", "zeros")
            if not (a == b if exact else abs(a - b) <= 1e-5 * max(abs(b), 1.0)):
                problems.append(f"{dtype} {name}: device {a!r}, host {b!r}")
    from hooks import tensors

    path = "torch ops" if tensors._TRITON_BROKEN or not tensors._use_triton(torch.ones(1, device=device)) else "Triton"
    return ("FAILED: " + "; ".join(problems) if problems else "ok: device and host statistics agree (fp32, bf16, fp16)") + \
        f" [device path: {path}{'; Triton failed: ' + tensors._TRITON_BROKEN if tensors._TRITON_BROKEN else ''}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="device of the targets (default cuda; cpu for a dry run)")
    ap.add_argument("--targets", default=None,
                    help=f"comma-separated targets of {', '.join(TARGETS)} (default: all on a GPU, "
                         f"{DRY_RUN_TARGETS} on the CPU)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="folder for bundles and JSON reports (default $OUT, else a temporary folder)")
    args = ap.parse_args()
    targets = (args.targets or (DRY_RUN_TARGETS if args.device == "cpu" else ",".join(TARGETS))).split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"--targets: unknown {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run this on the GPU machine, or pass --device cpu for a dry run", file=sys.stderr)
        return 2
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="opband-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# opband GPU check: demo decoder, aten/full, CPU fp32 reference vs {args.device} ({name}), "
          f"torch {torch.__version__}\n")
    ref = run_capture(SPEC, out / "ref-fp32-cpu.bundle", device="cpu", variant="fp32", progress=False)
    rows, details, reports, failed = [], [], {}, []
    for target in targets:
        label = f"{target} on {args.device}"
        try:
            tgt = run_capture(SPEC, out / f"tgt-{target.replace('+', '-')}-{args.device.replace(':', '')}.bundle",
                              device=args.device, progress=False, **TARGETS[target])
            rep = compare(ref, tgt)
        except VariantCoverageError as e:  # the device's kernel refuses the variant: its reason, not opband's failure
            why = next((line.strip() for line in str(e).splitlines() if "refused it" in line), str(e).splitlines()[0])
            rows.append(f"| {label} | refused by the device | {why[:300]} | - | - |")
            continue
        except Exception as e:  # noqa: BLE001 - one target's failure is reported, the others still run
            failed.append(target)
            rows.append(f"| {label} | ERROR | {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''} | - | - |")
            continue
        rows.append(_summary_row(label, rep))
        details.append(f"### {label}: worst ops\n\n{R.to_markdown(rep, limit=10)}")
        reports[label] = json.loads(R.to_json(rep))
    print("| target vs fp32 on cpu | verdict | ops by verdict | worst op (norm L2) | first divergence |")
    print("|---|---|---|---|---|")
    print("\n".join(rows) + "\n")
    print("\n".join(details))
    sync = _no_sync_summary(args.device, out)
    print(f"summary capture on {args.device}: {sync}")
    agree = _device_stats_agree(args.device)
    print(f"statistics on {args.device}: {agree}")
    (out / "reports.json").write_text(json.dumps(reports))
    print(f"\nbundles and reports in {out}; took {time.monotonic() - started:.1f} s")
    return 1 if failed or sync.startswith("FAILED") or agree.startswith("FAILED") else 0


if __name__ == "__main__":
    raise SystemExit(main())
