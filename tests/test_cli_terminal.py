"""The CLI as a modern tool and in CI: --version, budgets in TOML/YAML/JSON, a forward-pass error in
the user's code, progress and colour on a terminal (a real pty) but plain output in a log, and the
gate's CI reports: $GITHUB_STEP_SUMMARY, the dashboard link, JUnit failures grouped by root cause."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from service_fixtures import LiveServer, SynthOp, write_bundle

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LONG = "model.encoder.layers.11.self_attention.output_projection_with_a_very_long_module_name"
#: m.l1 is the first divergence; m.l3 and m.l5 fail after it (inherited in propagated mode)
OPS = [SynthOp(f"m.l{i}", noise=1e-3 if i in (1, 3, 5) else 0.0) for i in range(7)] + [SynthOp(LONG)]


def opband(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GITHUB_STEP_SUMMARY", "FORCE_COLOR", "NO_COLOR")}
    return subprocess.run([sys.executable, "-m", "opband.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**clean, **(env or {})})


def opband_on_a_tty(*args: str, columns: int = 120, timeout: float = 300) -> tuple[int, str]:
    """Run opband with stdout and stderr on a pseudo-terminal ``columns`` wide; returns (exit code, output)."""
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "LINES", "GITHUB_STEP_SUMMARY")}
    proc = subprocess.Popen([sys.executable, "-m", "opband.cli", *args], stdout=follower, stderr=follower,
                            stdin=subprocess.DEVNULL, env={**env, "TERM": "xterm-256color"}, close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(30), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cli")
    return {"ref": write_bundle(out / "ref.bundle", OPS), "tgt": write_bundle(out / "tgt.bundle", OPS, target=True)}


def test_version() -> None:
    from importlib.metadata import version

    r = opband("--version", timeout=60)
    assert r.returncode == 0 and r.stdout == f"opband {version('opband')}\n"


BUDGETS = {
    "toml": '[ops."m.l*/*"]\nnorm_l2 = 1e-2\ncosine_min = 0.999\n',
    "yaml": 'ops:\n  "m.l*/*":\n    norm_l2: 1.0e-2\n    cosine_min: 0.999\n',
    "json": json.dumps({"ops": {"m.l*/*": {"norm_l2": 1e-2, "cosine_min": 0.999}}}),
}


@pytest.mark.parametrize("fmt", list(BUDGETS))
def test_budgets_file_in_each_format(fmt: str, bundles: dict[str, Path], tmp_path: Path) -> None:
    """The default fp32 budget (3.05e-5) fails the 1e-3 noise; the override (1e-2) passes it, read from
    TOML (the documented example's format), YAML and JSON alike; the report names the override."""
    path = tmp_path / f"budgets.{fmt}"
    path.write_text(BUDGETS[fmt])
    ref, tgt = str(bundles["ref"]), str(bundles["tgt"])
    if fmt == "toml":  # without the override the noise fails (checked once)
        assert opband("compare", ref, tgt).returncode == 1
    r = opband("compare", ref, tgt, "--budgets", str(path), "--json", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    noisy = next(o for o in json.loads((tmp_path / "r.json").read_text())["ops"] if o["key"] == "m.l1/aten.mm#0")
    assert noisy["budget"] == {"norm_l2": 1e-2, "cosine_min": 0.999, "source": "override m.l*/*"}
    assert noisy["verdict"] == "pass" and 1e-4 < noisy["metrics"]["norm_l2"] < 1e-2


def test_documented_toml_budgets_example_is_read(bundles: dict[str, Path], tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "budgets.md").read_text()
    examples = re.findall(r"```toml\n(.*?)```", doc, re.S)
    assert len(examples) >= 2, "docs/budgets.md must show its TOML examples (norm_l2, and any metric)"
    for k, example in enumerate(examples):
        path = tmp_path / f"budgets{k}.toml"
        path.write_text(example)
        r = opband("compare", str(bundles["ref"]), str(bundles["ref"]), "--budgets", str(path))
        assert r.returncode == 0, r.stderr
    half = tmp_path / "half.toml"
    half.write_text('[ops."aten.mm"]\nnorm_l2 = 1e-3\n')
    r = opband("compare", str(bundles["ref"]), str(bundles["ref"]), "--budgets", str(half))
    assert r.returncode == 2 and "half-specified" in r.stderr and "Traceback" not in r.stderr


BUGGY_SPEC = '''\
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return self.head(y)

    def head(self, y):
        return y @ torch.ones(4, 4)  # wrong shape: the user's bug


def build():
    return Net(), (torch.randn(2, 8),)
'''


def test_forward_pass_error_names_the_users_line_and_leaves_no_bundle(tmp_path: Path) -> None:
    spec = tmp_path / "buggy.py"
    spec.write_text(BUGGY_SPEC)
    out = tmp_path / "out" / "run.bundle"
    r = opband("capture", f"{spec}:build", "-o", str(out), "--device", "cpu")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 6, r.stderr
    assert "the model's forward pass raised RuntimeError: mat1 and mat2 shapes cannot be multiplied" in r.stderr
    # the user's frames, innermost last, with file:line and the source line
    assert f"at {spec}:14 in head: return y @ torch.ones(4, 4)" in r.stderr, r.stderr
    assert f"at {spec}:11 in forward: return self.head(y)" in r.stderr
    assert "no bundle written" in r.stderr
    assert not out.exists() and not list(out.parent.glob("*")), list(out.parent.glob("*"))
    builder = tmp_path / "badbuild.py"
    builder.write_text("def build():\n    raise ValueError('no such checkpoint: ckpt.pt')\n")
    r = opband("capture", f"{builder}:build", "-o", str(out), "--device", "cpu")
    assert r.returncode == 2 and f"at {builder}:2 in build" in r.stderr and "no such checkpoint" in r.stderr


def test_plain_output_when_not_a_terminal(bundles: dict[str, Path]) -> None:
    """In a CI log: no colour codes, no progress redraws, and no table row folded to a guessed width."""
    r = opband("compare", str(bundles["ref"]), str(bundles["tgt"]), env={"COLUMNS": "80"})
    assert r.returncode == 1
    assert not ANSI.search(r.stdout + r.stderr) and "\r" not in r.stdout + r.stderr
    assert "comparing ops" not in r.stderr
    row = next(line for line in r.stdout.splitlines() if LONG in line)  # the long key whole, on its row
    assert "PASS" in row and len(row) > 80
    assert re.search(r"^FAILED \| first divergence: m\.l1/aten\.mm#0 .*\| norm L2 err", r.stdout, re.M)
    header = next(line for line in r.stdout.splitlines() if "verdict" in line)
    assert "budget" in header and "limit" not in header


def test_progress_and_colour_on_a_terminal(bundles: dict[str, Path]) -> None:
    code, out = opband_on_a_tty("compare", str(bundles["ref"]), str(bundles["tgt"]), columns=100)
    assert code == 1, out
    assert "comparing ops" in out, out[-2000:]  # the progress bar, drawn on stderr
    assert "\x1b[1;31mFAIL" in out or "\x1b[31;1mFAIL" in out, "the FAIL verdict is coloured"
    table = [ANSI.sub("", line) for line in out.splitlines() if "│" in line or "┃" in line]
    assert table and max(len(line.rstrip("\r")) for line in table) <= 100  # the terminal's width


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database is incidental here
def test_gate_reports_for_ci(live_server: LiveServer, bundles: dict[str, Path], tmp_path: Path) -> None:
    """Step summary (Markdown, appended), the dashboard permalink, and JUnit with one failing
    testcase per root cause whose details list the inherited failures."""
    summary = tmp_path / "step-summary.md"
    summary.write_text("earlier step\n")
    junit = tmp_path / "junit.xml"
    r = opband("gate", "--server", live_server.url, "--project", "ci", "--reference", str(bundles["ref"]),
               "--target", str(bundles["tgt"]), "--junit", str(junit), "--label", "pr-7", "--target-name", "npu/fp32",
               "--tag", "branch=feature", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert r.returncode == 1, r.stdout + r.stderr
    cid = re.search(r"comparison ([0-9a-f]{32})", r.stdout).group(1)  # type: ignore[union-attr]
    assert f"dashboard: {live_server.url}/#/comparison/{cid}\n" in r.stdout
    assert "opband gate: pr-7 (npu/fp32) vs fp32@cpu" in r.stdout
    text = summary.read_text()
    assert text.startswith("earlier step\n## opband gate: FAIL")
    assert f"[comparison {cid} on the dashboard]({live_server.url}/#/comparison/{cid})" in text
    assert "| fail (inherited) | `m.l3/aten.mm#0` |" in text and "| fail | `m.l1/aten.mm#0` |" in text
    assert "target **pr-7 (npu/fp32)** vs reference **fp32@cpu**" in text
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "1" and suite.get("tests") == "6"
    failing = [c for c in suite.iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failing] == ["m.l1/aten.mm#0"]
    details = failing[0].find("failure").text  # type: ignore[union-attr]
    assert "2 later op(s) inherit this error" in details
    assert "FAIL (inherited) m.l3/aten.mm#0" in details and "FAIL (inherited) m.l5/aten.mm#0" in details
    names = {c.get("name") for c in suite.iter("testcase")}
    assert "m.l3/aten.mm#0" not in names and f"{LONG}/aten.mm#0" in names


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_gate_progress_on_a_terminal(live_server: LiveServer, bundles: dict[str, Path]) -> None:
    code, out = opband_on_a_tty("gate", "--server", live_server.url, "--project", "tty", "--reference",
                                str(bundles["ref"]), "--target", str(bundles["tgt"]))
    assert code == 1, out[-3000:]
    assert "uploading ref.bundle" in out and "uploading tgt.bundle" in out, out[-3000:]
    assert "on the server" in out  # the wait for the server-side comparison
    assert "dashboard: " in out
