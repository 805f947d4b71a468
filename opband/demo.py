"""``opband demo``: the whole pipeline on embedded defaults, end to end over real HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from opband.client import Client
from opband.gate import gate_table
from api.server import BackgroundServer, free_port
from api.settings import Settings
from accuracy.verdicts import Verdict

SPEC = "hooks.demo_model:build"
BUG_SPEC = "hooks.demo_faults:build_fast_sigmoid_bug"
BUG_TARGET = "fp32-bug"  # fp32 on cpu, with a fast-sigmoid SiLU in layer 2: what a broken kernel looks like
PROJECT = "demo"


def run_demo(data_dir: Path, *, port: int = 0, keep_serving: bool = False, targets: list[str] | None = None,
             echo: Callable[[str], None] = print) -> int:
    """Capture reference + targets, upload, compare on the server, print worst ops per target."""
    from hooks import devices
    from hooks.runner import run_capture

    targets = targets or ["bf16", "int8", BUG_TARGET]
    started = time.monotonic()
    bundles = data_dir / "bundles"
    ref_device = devices.default_device()
    echo(f"[1/4] capturing the demo decoder: reference fp32 on {ref_device}, targets {', '.join(targets)} on cpu")
    ref = run_capture(SPEC, bundles / f"reference-fp32-{ref_device}.bundle", device=ref_device, variant="fp32")
    target_paths = {
        v: run_capture(BUG_SPEC if v == BUG_TARGET else SPEC, bundles / f"target-{v}-cpu.bundle", device="cpu",
                       variant="fp32" if v == BUG_TARGET else v)
        for v in targets
    }
    settings = Settings(data_dir=data_dir, port=port or free_port(), log_level="warning")  # the tables are the output
    with BackgroundServer(settings) as server:
        echo(f"[2/4] server up at {server.url} (SQLite + blobs in {data_dir})")
        client = Client(server.url)
        ref_row = client.upload(PROJECT, ref)
        echo(f"[3/4] uploaded reference {ref_row['id']} ({ref_row['records']} records)")
        worst_code = 0
        for variant, path in target_paths.items():
            tgt_row = client.upload(PROJECT, path)
            c = client.wait(client.create_comparison(PROJECT, ref_row["id"], tgt_row["id"])["id"])
            if c["status"] != "done":
                echo(f"FAILED | comparison of {variant} could not run: {c['error']}")
                return 2
            ops = client.ops(c["id"], limit=10, sort="worst", order="desc")["data"]
            title = "fp32 with a fast-sigmoid SiLU bug in layer 2" if variant == BUG_TARGET else variant
            echo(f"\n[4/4] compared on the server: {title} vs fp32, worst ops")
            echo(gate_table(c, ops, limit=10))
            worst_code = max(worst_code, 1 if c["verdict"] == Verdict.FAIL else 0)
        regressions = client.regressions(PROJECT)
        echo(f"\nregressions flagged: {regressions['count']}"
             + "".join(f"\n  {r['key']} (input shapes {r['shape_signature']}): {r['reason']}" for r in regressions["data"]))
        took = f"demo took {time.monotonic() - started:.1f}s"
        if keep_serving:
            echo(f"\ndashboard: {server.url}/?project={PROJECT}   ({took}; serving until Ctrl-C)")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        client.close()
    if not keep_serving:
        echo(f"\n{took}. The server has stopped; to browse the drift dashboard run `opband demo --serve`, or "
             f"`opband serve --data-dir {data_dir}` and open /?project={PROJECT}")
    return 0
