"""The pytest plugin (``pytest11`` entry point) in a fresh project, driven by ``pytester``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = '''
import pytest
import torch
from torch.nn import functional as F


def naive_softmax(x):
    """A half-precision kernel that skips the max subtraction: exp overflows on large logits."""
    if x.dtype in (torch.float16, torch.bfloat16):
        e = x.float().exp()
        return (e / e.sum(-1, keepdim=True)).to(x.dtype)
    return torch.softmax(x, dim=-1)


def test_rms_norm_passes(opband):
    x, w = torch.randn(8, 256), 1 + 0.1 * torch.randn(256)
    report = opband.check(lambda x, w: F.rms_norm(x, (256,), w, eps=1e-6), (x, w), dtypes=["bf16", "fp16"],
                          op="aten.rms_norm")
    assert len(report.rows) == 2 and all(r.verdict == "pass" for r in report.rows)


@pytest.mark.opband(dtypes=["bf16"], regimes=["large"])
def test_naive_softmax_fails_on_large_logits(opband):
    opband.check(naive_softmax, torch.randn(4, 128), op="aten._softmax", name="naive_softmax")


@pytest.mark.opband(dtypes=["bf16"])
def test_naive_softmax_passes_on_normal_logits(opband):
    opband.check(naive_softmax, torch.randn(4, 128), op="aten._softmax")


def test_unsupported_on_the_target(opband):
    def only_fp32(x):
        if x.dtype != torch.float32:
            raise TypeError("this kernel has no half-precision path")
        return x * 2
    opband.check(only_fp32, torch.randn(8), dtypes=["fp16"])
'''


def test_plugin_in_a_fresh_project(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ops=TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "--opband-target", "cpu")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "FAILED | naive_softmax bf16 shape 4x128 regime large (op aten._softmax, "
        "key pytest.naive_softmax.large.4x128/aten._softmax#0) | * NaN where the reference is finite",
        "Note: each op ran alone on the reference's stored inputs*",
    ])
    assert "regime given (op check.naive_softmax" not in out, "the given inputs pass: only the large regime fails"
    result.stdout.fnmatch_lines(["MISSING | only_fp32 fp16 shape 8 regime given *",
                                 "SKIPPED | fp16 pytest.only_fp32.given.8/check.only_fp32#0: check.only_fp32 raised "
                                 "TypeError: this kernel has no half-precision path"])
    bad = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "--opband-target", "cuda:7")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--opband-target cuda:7: device cuda:7 is not available*"])
    assert "Traceback" not in out and "opband/pytest_plugin.py" not in out


def test_plugin_uploads_to_the_server(tmp_path: Path, live_server) -> None:  # noqa: ANN001
    # a plain subprocess in a fresh folder: pytester's sys.modules snapshot would re-import the
    # live server fixture's httpx/sqlalchemy between parametrizations
    (tmp_path / "test_ops.py").write_text(TESTS)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--opband-server",
                             live_server.url, "--opband-project", "kernels", "-k", "naive_softmax", "test_ops.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 1 and "1 failed, 1 passed" in out, out + result.stderr
    assert ("FAILED | pytest.naive_softmax.large.4x128/aten._softmax#0 bf16 shape 4x128 | " in out
            and "NaN where the reference is finite" in out), out
    assert "Note: judged by the server's comparison in project 'kernels'" in out
    with live_server.client() as http:
        bundles = http.get("/api/v1/projects/kernels/bundles").json()
    assert bundles["count"] == 4, "reference and bf16 target of each of the two checks"
