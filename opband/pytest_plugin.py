"""pytest plugin (entry point ``pytest11``): operator-level accuracy tests with the ``opband`` fixture.

```python
def test_rmsnorm(opband):
    x, w = torch.randn(4, 256), torch.ones(256)
    opband.check(lambda x, w: F.rms_norm(x, (256,), w), (x, w), dtypes=["bf16", "fp16"])

@pytest.mark.opband(dtypes=["bf16"], regimes=["large", "near_zero"])
def test_silu(opband):
    opband.check(F.silu, torch.randn(8, 512), op="aten.silu")
```

``check`` runs the function on the reference device in float32 and on the target device
(``--opband-target``, default cpu) in each dtype on the same stored inputs, compares them with
opband's budgets, and fails the test with opband's ``FAILED | what | by how much`` lines and a
``Note:``. With ``--opband-server`` the bundles are uploaded and the server's comparison (which
uses the project's bands once it has history) decides.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opband", "operator-level accuracy checks (opband)")
    group.addoption("--opband-target", default="cpu",
                    help="device the checked functions run on as the target (cpu, cuda, npu:0; default cpu)")
    group.addoption("--opband-reference", default=None,
                    help="reference device (float32; default cuda when present, else cpu)")
    group.addoption("--opband-server", default=None,
                    help="opband server URL: upload each check's bundles and let the server judge them "
                         "against the project's bands (OPBAND_SERVER also works)")
    group.addoption("--opband-project", default="pytest", help="project the uploads go to (default pytest)")
    group.addoption("--opband-token", default=None, help="project write token, when the server has auth on")
    group.addoption("--opband-keep", default=None,
                    help="keep every check's bundles under this folder (default: the test's tmp_path)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "opband(dtypes=[...], regimes=[...], budgets={...}): defaults for the "
                                       "opband fixture's check() in this test")
    for flag in ("--opband-target", "--opband-reference"):
        device = config.getoption(flag)
        if device and device != "cpu":  # a device this machine lacks is a usage error, said once
            from hooks.runner import check_device

            try:
                check_device(device)
            except ValueError as e:
                raise pytest.UsageError(f"{flag} {device}: {e}") from None


class OpbandCheckFailed(AssertionError):
    """An op out of budget; its message is opband's three-part text."""


class Checker:
    """The ``opband`` fixture: ``check(fn, inputs, dtypes=[...])`` per operator under test."""

    def __init__(self, request: pytest.FixtureRequest, out_dir: Path) -> None:
        self._request = request
        self._out = out_dir
        self._count = 0
        opt = request.config.getoption
        marker = request.node.get_closest_marker("opband")
        self.defaults: dict[str, Any] = dict(marker.kwargs) if marker else {}
        self.target: str = opt("--opband-target")
        self.reference: str | None = opt("--opband-reference")
        self.server: str | None = opt("--opband-server") or os.environ.get("OPBAND_SERVER")
        self.project: str = opt("--opband-project")
        self.token: str | None = opt("--opband-token") or os.environ.get("OPBAND_TOKEN")
        self.results: list[Any] = []

    def check(self, fn: Callable[..., Any], inputs: Any, *, dtypes: Sequence[str] | None = None,
              regimes: Sequence[str] | None = None, op: str | None = None, name: str | None = None,
              budgets: Mapping[str, Any] | None = None) -> Any:
        """Check ``fn(*inputs)`` on the target in each dtype against the float32 reference; raises
        with opband's FAILED lines when an op is out of budget. Returns the sweep report."""
        from hooks.opcheck import check_function

        self._count += 1
        base = name or getattr(fn, "__name__", "<lambda>")
        base = self._request.node.name if base == "<lambda>" else base
        label = base if self._count == 1 else f"{base}_{self._count}"
        out = self._out / f"check{self._count}"
        result = check_function(
            fn, inputs, out, name=label, op=op, dtypes=list(dtypes or self.defaults.get("dtypes") or ["bf16"]),
            regimes=list(regimes or self.defaults.get("regimes") or []), reference_device=self.reference,
            target_device=self.target, budgets=budgets or self.defaults.get("budgets"))
        self.results.append(result)
        lines = result.report.failure_lines()
        if self.server:
            lines = self._judge_on_server(result)
        failed = [line for line in lines if line.startswith(("FAILED", "MISSING"))]
        if failed:
            why = [f"SKIPPED | {s}" for s in result.report.skipped[:10]]  # e.g. the op raised on the target
            raise OpbandCheckFailed("\n".join(lines + why + [f"bundles: {out}"]))
        return result.report

    def _judge_on_server(self, result: Any) -> list[str]:
        """Upload reference and targets, compare on the server (mode replay), and phrase its verdict."""
        from accuracy.verdicts import Verdict
        from opband.client import Client, ClientError

        client = Client(self.server or "", self.token)
        lines: list[str] = []
        try:
            ref = client.upload(self.project, result.reference)
            for variant, path in result.targets.items():
                tgt = client.upload(self.project, path)
                comparison = client.wait(client.create_comparison(self.project, ref["id"], tgt["id"], "replay")["id"])
                if comparison["status"] != "done":
                    lines.append(f"FAILED | {variant} | the server could not compare: {comparison.get('error')}")
                    continue
                for o in client.ops(comparison["id"])["data"]:
                    if o["verdict"] in (Verdict.FAIL, Verdict.MISSING):
                        lines.append(f"FAILED | {o['key']} {variant} shape {o['shape_signature']} | {o['reason']}")
        except ClientError as e:
            lines.append(f"FAILED | upload to {self.server} | {e}")
        finally:
            client.close()
        if lines:
            lines.append(f"Note: judged by the server's comparison in project {self.project!r} (bands where it has "
                         "history); open its dashboard for the distributions.")
        return lines


@pytest.fixture
def opband(request: pytest.FixtureRequest, tmp_path: Path) -> Checker:
    """Operator-level accuracy checks: ``opband.check(fn, inputs, dtypes=["bf16"])``."""
    keep = request.config.getoption("--opband-keep")
    out = Path(keep) / request.node.name if keep else tmp_path / "opband"
    return Checker(request, out)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Show an out-of-budget check as opband's message, not a traceback into the plugin."""
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(OpbandCheckFailed):
        report.longrepr = str(call.excinfo.value)
    return report
