"""Non-intrusiveness measurement: run ops with and without capture and compare bit for bit.

Used by ``tests/test_hooks_intrusive.py`` (a representative subset in ``make test``, every op_db
entry in ``make sweep``). An op is *intrusive* at a level when its outputs, or the inputs it
mutates, differ in bits, dtype, shape or strides under capture. A *path change* is a different
sequence of ATen kernels under the level's bare mode (nothing recorded), seen by the profiler.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hooks.capture import capture
from hooks.options import LEVELS


@dataclass
class OpFinding:
    """What the sweep saw for one op: per level, the first difference (None when identical)."""

    name: str  # op_db name, with the variant after a dot (``addmm.decomposed``)
    samples: int = 0
    nondeterministic: int = 0  # samples whose plain runs already differ from each other
    differences: dict[str, str | None] = field(default_factory=dict)
    path_changes: dict[str, str | None] = field(default_factory=dict)
    diagnostics: dict[str, list[str]] = field(default_factory=dict)

    def intrusive_levels(self) -> list[str]:
        return [lvl for lvl, d in self.differences.items() if d is not None]


def same_bits(a: Any, b: Any, path: str = "output") -> str | None:
    """None when ``a`` and ``b`` are bitwise identical (values, dtype, shape, strides), else where."""
    la, lb = tree_leaves(a), tree_leaves(b)
    if len(la) != len(lb):
        return f"{path}: {len(la)} leaves vs {len(lb)}"
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        where = f"{path}[{i}]"
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"{where}: tensor vs non-tensor"
        if not isinstance(x, torch.Tensor):
            if not (x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))):
                return f"{where}: {x!r} != {y!r}"
            continue
        if (x.dtype, x.shape, x.layout) != (y.dtype, y.shape, y.layout):
            return f"{where}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if x.layout != torch.strided or x.is_quantized:
            continue
        if x.stride() != y.stride() and x.numel() > 1:
            return f"{where}: strides {x.stride()} vs {y.stride()}"
        if not torch.equal(_bits(x), _bits(y)):
            return f"{where}: values differ in bits"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().reshape(-1)
    t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool and t.numel() else t


#: Ops whose plain results vary from run to run on their own (LAPACK drivers whose bits depend on
#: buffer alignment): seen differing at ``module`` level, where capture does not touch the op.
NONDETERMINISTIC = frozenset({"linalg.lstsq", "linalg.lstsq.grad_oriented"})


def _flaky(opinfo: Any, sample: Any, seed: int, expected: Any, tries: int = 3) -> bool:
    """True when plain runs alone already disagree with ``expected`` (the op is nondeterministic)."""
    return any(same_bits(expected, _run(opinfo, sample, seed)) is not None for _ in range(tries))


def _prepare(opinfo: Any, sample: Any) -> tuple[Callable[[], Any], Any]:
    """A thunk that runs the op on fresh copies of the sample's inputs, and those copies."""
    inp, args, kwargs = copy.deepcopy((sample.input, sample.args, sample.kwargs))
    return (lambda: opinfo(inp, *args, **kwargs)), (inp, args, kwargs)


def _run(opinfo: Any, sample: Any, seed: int, wrap: Callable[[Callable[[], Any]], Any] | None = None) -> Any:
    """(outputs, inputs after the call): mutated inputs count as results too."""
    thunk, inputs = _prepare(opinfo, sample)
    torch.manual_seed(seed)
    out = thunk() if wrap is None else wrap(thunk)
    return out, inputs


class _BareDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


class _BareFunction(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def _kernel_sequence(opinfo: Any, sample: Any, mode: Callable[[], Any] | None) -> list[str]:
    from torch.autograd.profiler import profile

    thunk, _ = _prepare(opinfo, sample)
    torch.manual_seed(0)
    with profile() as prof:
        if mode is None:
            thunk()
        else:
            with mode():
                thunk()
    # Leaf kernels only: under a dispatch mode each op also shows up once more, as the parent
    # of its redispatch, and that is the mode's bookkeeping, not a different path.
    return [e.name for e in prof.function_events if e.name.startswith("aten::") and not e.cpu_children]


#: Ops whose outputs are uninitialised memory: never bitwise reproducible, so not judged.
UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                           "empty_permuted", "torch.empty", "nn.functional.dropout"})


def check_op(opinfo: Any, max_samples: int = 4, levels: Iterable[str] = LEVELS, paths: bool = True,
             workdir: Path | None = None) -> OpFinding:
    """Run ``opinfo``'s CPU float32 samples plain and under each capture level; compare bits."""
    finding = OpFinding(opinfo.name if not opinfo.variant_test_name else f"{opinfo.name}.{opinfo.variant_test_name}")
    if opinfo.name in UNINITIALIZED or finding.name in NONDETERMINISTIC:
        finding.nondeterministic = -1
        return finding
    with torch.no_grad():
        samples = []
        for s in opinfo.sample_inputs("cpu", torch.float32, requires_grad=False):
            samples.append(s)
            if len(samples) >= max_samples:
                break
    plain, keep = [], []
    for i, s in enumerate(samples):
        try:
            first, second = _run(opinfo, s, i), _run(opinfo, s, i)
        except Exception:  # noqa: BLE001 - a sample the op itself rejects is not ours to judge
            continue
        if same_bits(first, second) is not None:
            finding.nondeterministic += 1
            continue
        plain.append(first)
        keep.append((i, s))
    finding.samples = len(keep)
    model = torch.nn.Module()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for level in levels:
            diffs: list[tuple[int, Any, Any, str]] = []
            with capture(model, Path(tmp) / f"{level}.bundle", level=level, mode="full", inputs=level == "aten",
                         progress=False) as cap:
                for (i, s), expected in zip(keep, plain, strict=True):
                    try:
                        got = _run(opinfo, s, i)
                    except Exception as e:  # noqa: BLE001
                        diffs.append((i, s, expected, f"sample {i}: raised {type(e).__name__} under capture: {e}"))
                        continue
                    d = same_bits(expected, got, f"sample {i}")
                    if d is not None:
                        diffs.append((i, s, expected, d))
            real = []
            for i, s, expected, d in diffs:  # outside the capture: are plain runs stable on their own?
                if _flaky(opinfo, s, i, expected):
                    finding.nondeterministic += 1
                else:
                    real.append(d)
            finding.differences[level] = real[0] if real else None
            finding.diagnostics[level] = [d.message for d in cap.diagnostics]
    if paths:
        for level, mode in (("api", _BareFunction), ("aten", _BareDispatch)):
            change = None
            for i, s in keep:
                base, under = _kernel_sequence(opinfo, s, None), _kernel_sequence(opinfo, s, mode)
                if base != under:
                    change = f"sample {i}: {_first_difference(base, under)}"
                    break
            finding.path_changes[level] = change
    return finding


def _first_difference(a: list[str], b: list[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"kernel {i}: {x} plain vs {y} under the mode"
    return f"{len(a)} kernels plain vs {len(b)} under the mode"


def self_compare(opinfo: Any, max_samples: int = 4, workdir: Path | None = None) -> Any:
    """Capture ``opinfo``'s CPU float32 samples twice at ``aten`` level and compare the two bundles;
    returns the :class:`~accuracy.compare.ComparisonReport` (None when nothing was recorded). An
    identical second run must fail nothing: outputs that hold uninitialised memory (``_ctc_loss``'s
    log_alpha beyond the valid region) are auxiliary outputs, reported but not judged alone."""
    from accuracy.compare import compare
    from accuracy.errors import OpbandError

    if opinfo.name in UNINITIALIZED:
        return None
    with torch.no_grad():
        samples = []
        for s in opinfo.sample_inputs("cpu", torch.float32, requires_grad=False):
            samples.append(s)
            if len(samples) >= max_samples:
                break
    model = torch.nn.Module()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        paths = []
        for run in range(2):
            path = Path(tmp) / f"run{run}.bundle"
            with capture(model, path, level="aten", mode="full", progress=False, fingerprints=False):
                for i, s in enumerate(samples):
                    try:
                        _run(opinfo, s, i)
                    except Exception:  # noqa: BLE001 - a sample the op itself rejects is not ours to judge
                        continue
            paths.append(path)
        try:
            return compare(paths[0], paths[1])
        except OpbandError:  # nothing recorded (every sample rejected, or no op that moves numbers)
            return None
