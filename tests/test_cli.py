"""The opband command line as a user runs it: capture, compare, demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def opband(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opband.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_capture_and_compare_offline(tmp_path: Path) -> None:
    ref, bf16 = tmp_path / "ref.bundle", tmp_path / "bf16.bundle"
    for out, variant in ((ref, "fp32"), (bf16, "bf16")):
        r = opband("capture", "hooks.demo_model:build", "-o", str(out), "--device", "cpu", "--variant", variant)
        assert r.returncode == 0, r.stderr
        assert f"wrote {out}" in r.stdout and "records" in r.stdout

    same = opband("compare", str(ref), str(ref), "--json", str(tmp_path / "same.json"))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "PASSED" in same.stdout
    report = json.loads((tmp_path / "same.json").read_text())
    assert report["ops"] and all(o["verdict"] == "pass" for o in report["ops"])
    assert report["first_divergence"] is None

    low = opband("compare", str(ref), str(bf16), "--json", str(tmp_path / "bf16.json"),
                 "--markdown", str(tmp_path / "bf16.md"), "--html", str(tmp_path / "bf16.html"))
    assert low.returncode in (0, 1), low.stderr
    report = json.loads((tmp_path / "bf16.json").read_text())
    for field in ("key", "op", "module", "input_shapes", "dtype", "metrics", "verdict"):
        assert all(field in o for o in report["ops"]), field
    compared = [o for o in report["ops"] if o["metrics"] is not None]
    assert max(o["metrics"]["max_abs"] for o in compared) > 0, "bf16 must differ from fp32"
    assert "unmatched" in report and "first_divergence" in report
    assert (tmp_path / "bf16.html").read_text().startswith("<!doctype html>")


def test_compare_bad_input_exits_2(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bundle"
    junk.write_bytes(b"definitely not a bundle")
    r = opband("compare", str(junk), str(junk))
    assert r.returncode == 2
    assert "error:" in r.stderr and "bundle" in r.stderr
    r = opband("capture", "no_such_module_xyz:build", "-o", str(tmp_path / "x.bundle"))
    assert r.returncode == 2 and "cannot import module" in r.stderr


def test_demo_runs_the_whole_pipeline(tmp_path: Path) -> None:
    r = opband("demo", "--data-dir", str(tmp_path / "demo"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bf16 vs fp32" in r.stdout and "int8 vs fp32" in r.stdout
    assert r.stdout.count("opband gate:") == 3 and "opband demo --serve" in r.stdout
    assert "model.layers." in r.stdout, "worst-op tables must name ops"
    # the injected fast-sigmoid bug in layer 2 is localized and flagged as the one regression
    assert "FAILED | first divergence: model.layers.2.mlp.act/" in r.stdout
    assert "regressions flagged: 1\n  model.layers.2.mlp.act/" in r.stdout


def test_unwritable_outputs_and_bad_config_exit_2(tmp_path: Path, demo_bundles: dict[str, Path]) -> None:
    ref = str(demo_bundles["ref"])
    r = opband("compare", ref, ref, "--json", str(tmp_path / "missing-dir" / "r.json"))
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("ops: [unclosed")
    r = opband("compare", ref, ref, "--budgets", str(bad))
    assert r.returncode == 2 and "is not valid YAML" in r.stderr
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    r = opband("compare", ref, ref, "--budgets", str(listed))
    assert r.returncode == 2 and "must be a mapping" in r.stderr
    r = opband("capture", "hooks.demo_model:build", "-o", "/proc/opband-test.bundle", "--device", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def test_worker_metrics_port_taken_exits_2_with_a_message(tmp_path: Path) -> None:
    import socket

    assert opband("db", "upgrade", "--data-dir", str(tmp_path)).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = opband("worker", "--data-dir", str(tmp_path), "--metrics-port", str(s.getsockname()[1]), timeout=60)
    assert r.returncode == 2 and "cannot serve worker metrics" in r.stderr and "--metrics-port" in r.stderr


def test_replay_of_a_missing_or_broken_bundle_exits_2(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bundle"
    junk.write_bytes(b"junk!")
    for ref, says in ((tmp_path / "nope.bundle", "cannot read bundle"), (junk, "8-byte header")):
        r = opband("capture", "-o", str(tmp_path / "x.bundle"), "--replay", str(ref))
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
    r = opband("capture", "hooks.demo_model:build", "-o", str(tmp_path / "x.bundle"), "--replay", str(junk))
    assert r.returncode == 2 and "SPEC hooks.demo_model:build would be ignored: drop it" in r.stderr
    r = opband("capture", "hooks.demo_model:build", "-o", str(tmp_path / "x.bundle"), "--golden")
    assert r.returncode == 2 and "--replay REF_BUNDLE" in r.stderr


def test_capture_help_shows_flags_as_flags_and_the_choices() -> None:
    out = opband("capture", "--help", timeout=60).stdout
    flags = [line for line in out.splitlines() if line.strip("│ ").split(" ")[0] in ("--inputs", "--golden")]
    assert len(flags) == 2 and not any("<bool>" in line for line in flags), flags
    assert "<module|api|aten>" in out and "<full|summary>" in out


def test_upload_and_capture_input_mistakes_say_what_to_do(tmp_path: Path) -> None:
    r = opband("upload", str(tmp_path / "none.bundle"), "--server", "http://127.0.0.1:9", "--project", "p", timeout=60)
    assert r.returncode == 2 and "cannot read bundle" in r.stderr and "opband capture" in r.stderr
    (tmp_path / "a.bundle").write_bytes(b"x")
    r = opband("upload", str(tmp_path / "a.bundle"), "--server", "127.0.0.1:9", "--project", "p", timeout=60)
    assert r.returncode == 2 and "needs its scheme, e.g. http://127.0.0.1:9" in r.stderr
    r = opband("capture", "hooks.demo_model:build", "-o", str(tmp_path / "x.bundle"), "--device", "npu")
    assert r.returncode == 2 and "torch_npu" in r.stderr and "Expected one of" not in r.stderr, r.stderr
