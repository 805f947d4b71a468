"""Module attribution on the compiled observer's path: each module's instance ``forward`` is a compiled
wrapper (``hooks._observer.ModuleCall``) instead of global forward hooks, and records stay those of the
dispatch mode, which keeps the global hooks. Models the wrapper cannot serve faithfully keep the hooks."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

import zoo
from hooks import capture
from hooks.compiled import capture_paused
from hooks.observer import _observer
from test_observer import _same_records

pytestmark = pytest.mark.skipif(_observer is None, reason="hooks._observer is not built")


def _wrapped(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m.__dict__.get("forward")) is _observer.ModuleCall]


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_every_module_is_wrapped_while_the_capture_runs_and_restored_after(mode: str, tmp_path: Path) -> None:
    entry = next(m for m in zoo.MODELS if m.name == "llama")
    model, inputs = entry.build()
    names = [name for name, _ in model.named_modules()]
    signature = inspect.signature(model.forward)
    during: dict[str, object] = {}

    def run(cap: capture) -> None:
        during["wrapped"] = _wrapped(model)
        during["signature"] = inspect.signature(model.forward)  # transformers reads it (generate's kwargs)
        model(**inputs)

    dispatch, seen = _same_records(tmp_path, "llama", model, run, mode=mode)
    assert during["signature"] == signature
    assert during["wrapped"] == names  # the observer's run; the dispatch mode's ran first, unwrapped
    assert _wrapped(model) == [] and all("forward" not in m.__dict__ for m in model.modules())
    assert {r.module for r in seen.records if r.kind == "module"} == {r.module for r in dispatch.records if r.kind == "module"}


class _OwnCall(nn.Module):
    """A module with a ``__call__`` of its own that calls ``forward`` itself: global hooks never see it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def test_models_the_wrappers_cannot_serve_keep_global_hooks(tmp_path: Path) -> None:
    x = torch.randn(3, 4)
    model = nn.Sequential(nn.Linear(4, 4), _OwnCall())
    seen_wrapped: list[list[str]] = []

    def run(cap: capture) -> None:
        seen_wrapped.append(_wrapped(model))
        model(x)

    _, seen = _same_records(tmp_path, "own-call", model, run)
    assert seen_wrapped == [[], []]
    assert "1/forward#0" not in [r.key for r in seen.records]  # as global hooks see it: never entered

    own = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    replaced = own[1].forward = lambda t: torch.tanh(t) * 2  # an instance forward of the user's (a patch)
    _same_records(tmp_path, "patched", own, lambda cap: seen_wrapped.append(_wrapped(own)) or own(x))
    assert seen_wrapped[-1] == [] and own[1].forward is replaced  # left as it was


class _Dict(nn.Module):
    def forward(self, x: torch.Tensor, extra: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": x * 2, "z": extra[0] + 1}


class _Param(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> nn.Parameter:
        return self.w  # a Parameter, not exactly a torch.Tensor: the Python path records it


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.exp()
        raise RuntimeError("inner failure")


class _Mixed(nn.Module):
    """Outputs and positional arguments the wrapper hands to ModuleHooks' Python path (a dict, a
    Parameter, a nested list argument), a child that raises and is caught, and a block the capture steps
    out of."""

    def __init__(self) -> None:
        super().__init__()
        self.d, self.p, self.f, self.lin, self.hidden = _Dict(), _Param(), _Fails(), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.d(x, [x.sin()])
        w = self.p(x)
        try:
            self.f(x)
        except RuntimeError:
            pass
        y = self.lin(out["y"] + w)
        with capture_paused():  # as a compiled block runs: no module, no op recorded
            self.hidden(y)
        return y, out["z"], None  # a tuple with None: the wrapper records its tensors itself


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_outputs_the_wrapper_hands_to_python_and_a_caught_failure_record_the_same(mode: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(2, 4)
    wrapped: list[list[str]] = []
    _, seen = _same_records(tmp_path, "mixed", model, lambda cap: wrapped.append(_wrapped(model)) or model(x), mode=mode)
    assert wrapped[-1] == [name for name, _ in model.named_modules()]
    keys = [r.key for r in seen.records]
    assert {"d/forward#0", "p/forward#0", "lin/forward#0", "/forward#0"} <= set(keys)
    assert "f/aten.exp#0" in keys and "f/forward#0" not in keys  # it raised: no forward hook ran
    assert not any(k.startswith("hidden/") for k in keys)
    assert _wrapped(model) == []
