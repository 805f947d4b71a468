"""A full-mode capture of more than 2 GB with bounded memory (not a test): ``python benchmarks/capture_large.py``.

Runs a chain of elementwise ops on a large activation (``--mb`` MB each, two outputs per step) under
``capture(level="aten", mode="full")`` until more than ``--gb`` GB of tensors are written, into a
temporary directory (``--dir``, default the system temp dir), then prints the bytes written and the
process's peak RSS (``VmHWM``) before and after the capture, verifies that the bundle opens
(``accuracy.bundle.Bundle.open``) and that the last output reads back bit for bit, and deletes it.
``--buffered`` takes the accelerator path (host copies flushed every ``buffer_bytes``) instead of
write-through. ``--json`` prints one JSON line (for ``tests/test_hooks_memory.py``).

The disk must hold the bundle once (tensor data is written once, behind a reserved header), plus
a margin; the script refuses to start when it does not.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accuracy.bundle import Bundle  # noqa: E402
from hooks import capture  # noqa: E402
from hooks.recorder import Recorder  # noqa: E402


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``VmHWM``; ``ru_maxrss`` where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class Chain(torch.nn.Module):
    """``steps`` times ``x = x * a + b``: two fresh outputs of ``x``'s size per step, the older freed."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            x = x * 1.0001 + 0.5
        return x


def run(gb: float, mb: int, where: Path, buffered: bool) -> dict[str, object]:
    numel = mb * (1 << 20) // 4
    steps = math.ceil(gb * 1e9 / (2 * numel * 4)) + 1  # root module output is the last add: stored once
    need = 1.2 * (2 * steps * numel * 4)
    free = shutil.disk_usage(where).free
    if free < need:
        raise SystemExit(f"{where} has {free / 1e9:.1f} GB free, this run needs about {need / 1e9:.1f} GB")
    if buffered:  # what an accelerator run does: copies into a host buffer, flushed when full
        Recorder.write_through = staticmethod(lambda data: False)  # type: ignore[method-assign]
    model = Chain(steps)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(dir=where, prefix="opband-large-") as tmp, torch.no_grad():
        path = Path(tmp) / "large.bundle"
        expected = model(x)  # the plain run's own peak (input, two live activations) is in the baseline
        with capture(model, Path(tmp) / "warm.bundle", level="aten", mode="full", progress=False):
            Chain(2)(torch.randn(1024))  # one-time costs (imports, kernel load) are not the capture's
        del expected
        before = peak_rss_bytes()
        t = time.perf_counter()
        with capture(model, path, level="aten", mode="full", progress=False) as cap:
            out = model(x)
        seconds = time.perf_counter() - t
        after = peak_rss_bytes()
        size = path.stat().st_size
        bundle = Bundle.open(path)
        tensor_bytes = sum(info.nbytes for info in bundle.tensors.values())
        last = bundle.record("/forward#0")
        same = bool(np.array_equal(bundle.values(last.tensor), out.numpy()))
        records = len(bundle.records)
        del bundle, last
        assert cap.bundle_path == path
    deleted = not path.exists()
    return {
        "path": "buffered" if buffered else "write-through", "records": records, "bundle_bytes": size,
        "tensor_bytes": tensor_bytes, "activation_bytes": numel * 4, "seconds": seconds,
        "peak_rss_before": before, "peak_rss_after": after, "peak_rss_growth": after - before,
        "last_output_bitwise_equal": same, "deleted": deleted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2, help="tensor bytes to write, in GB (1e9)")
    ap.add_argument("--mb", type=int, default=64, help="size of each activation in MiB")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--buffered", action="store_true", help="the accelerator path: host buffer, flushed when full")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args.gb, args.mb, args.dir, args.buffered)
    if args.json:
        print(json.dumps(r))
        return
    gb = 1e9
    print(f"{r['path']}: {r['records']} records, bundle {r['bundle_bytes'] / gb:.2f} GB "
          f"({r['tensor_bytes'] / gb:.2f} GB of tensors) in {r['seconds']:.1f} s "
          f"({r['tensor_bytes'] / r['seconds'] / 1e6:,.0f} MB/s)")
    print(f"peak RSS: {r['peak_rss_before'] / 1e6:,.0f} MB before the capture (model, input, plain run), "
          f"{r['peak_rss_after'] / 1e6:,.0f} MB after: +{r['peak_rss_growth'] / 1e6:,.0f} MB "
          f"for {r['tensor_bytes'] / gb:.2f} GB written (one activation is {r['activation_bytes'] / 1e6:,.0f} MB)")
    print(f"bundle opens, last output bit for bit: {r['last_output_bitwise_equal']}, deleted: {r['deleted']}")


if __name__ == "__main__":
    main()
