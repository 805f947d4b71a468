"""``opband sweep``: ops x shapes x dtypes x value regimes, without a model.

Each case's inputs are generated once (seeded, float32/int64) and stored in the *reference*
bundle next to the reference's outputs; every target (another device, fp16, bf16, int8 or FP8
emulation) reads them back from that bundle, so all sides run on the same bytes. Bundles are
ordinary: op key ``sweep.<op>.<regime>.<shape>/<recorded op>#0``; the reference manifest's
``run.sweep.cases`` maps each key to its op, regime and shapes; targets name the reference in
``run.replay_of`` (each op ran on the reference's inputs), so ``opband compare --mode replay`` and
the service judge them like any replay. (Not :mod:`hooks.sweep`: that one measures intrusiveness.)
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accuracy.bundle import Bundle
from accuracy.compare import compare
from accuracy.manifest import shape_signature
from accuracy.sweep_report import SweepReport, missing_rows, rows_from_comparison
from hooks.options import CaptureOptions
from hooks.environment import environment
from hooks.fp8 import FP8_DTYPES, quantize_dequantize
from hooks.opcases import (
    BY_ATEN, BUILTIN, REGIMES, CaseError, OpCase, call_case, exact_values, make_inputs, parse_shapes, resolve_case,
)
from hooks.recorder import Recorder

TARGET_VARIANTS = ("fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp8-e5m2")
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_DTYPES = ("bf16", "fp16", "int8")


@dataclass
class OpSpec:
    """One op of a sweep file: a name, optional shape signatures, keyword arguments and a label."""

    name: str
    shapes: list[str] = field(default_factory=list)
    kwargs: dict[str, Any] | None = None
    label: str | None = None
    call: dict[str, Any] | None = None  # a call recorded by a capture with --inputs (op overload + arguments)
    input_dtypes: list[str | None] | None = None  # of that call's tensor inputs


@dataclass
class SweepConfig:
    """What to sweep. Each field is one ``opband sweep`` flag and one key of a sweep file."""

    ops: list[OpSpec] = field(default_factory=list)  # empty: the bundle's ops, else the built-in LLM list
    shapes: list[str] = field(default_factory=list)  # override every op's shapes
    dtypes: list[str] = field(default_factory=lambda: list(DEFAULT_DTYPES))
    regimes: list[str] = field(default_factory=lambda: list(REGIMES))
    reference_device: str | None = None  # default: cuda when present, else cpu
    target_device: str = "cpu"
    seed: int = 0
    from_bundle: str | None = None  # take ops and their recorded input shapes from this bundle
    max_shapes: int = 3  # per op, from a bundle
    exact_inputs: bool = True  # round inputs to what the target dtypes hold (measure kernels, not casts)

    def validate(self) -> None:
        bad = [d for d in self.dtypes if d not in TARGET_VARIANTS]
        if bad or not self.dtypes:
            raise CaseError(f"dtype(s) {bad or '(none)'}: choose from {', '.join(TARGET_VARIANTS)}")
        bad = [r for r in self.regimes if r not in REGIMES]
        if bad or not self.regimes:
            raise CaseError(f"regime(s) {bad or '(none)'}: choose from {', '.join(REGIMES)}")
        if self.max_shapes < 1:
            raise CaseError("max_shapes must be at least 1")


_FILE_KEYS = {f for f in SweepConfig.__dataclass_fields__}


def _read_sweep_file(path: str | os.PathLike[str]) -> Any:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CaseError(f"cannot read sweep file {p}: {e}") from e
    try:
        if p.suffix.lower() == ".toml":
            import tomllib

            return tomllib.loads(text)
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
    except Exception as e:  # noqa: BLE001 - any parser error is the user's file, said once
        raise CaseError(f"sweep file {p} is not valid {p.suffix[1:].upper()}: {e}") from e
    raise CaseError(f"sweep file {p}: unknown suffix {p.suffix!r}; use .toml, .yaml or .yml")


def load_sweep_file(path: str | os.PathLike[str]) -> SweepConfig:
    """A sweep file (TOML or YAML) with the keys of :class:`SweepConfig`; ``ops`` entries are names
    or tables ``{name, shapes, kwargs, label}``. Types are checked; a wrong one is refused by name."""
    from pydantic import TypeAdapter, ValidationError

    data = _read_sweep_file(path)
    if not isinstance(data, Mapping):
        raise CaseError(f"sweep file {path}: expected a table of settings such as ops = [\"softmax\"]")
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise CaseError(f"sweep file {path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_FILE_KEYS)}")
    data = dict(data)
    ops = data.get("ops") or []
    if not isinstance(ops, list):
        raise CaseError(f"sweep file {path}: ops must be a list of names or tables")
    data["ops"] = [{"name": o} if isinstance(o, str) else o for o in ops]
    for entry in data["ops"]:
        extra = set(entry) - {"name", "shapes", "kwargs", "label"} if isinstance(entry, Mapping) else set()
        if extra:
            raise CaseError(f"sweep file {path}: op {entry.get('name')!r} has unknown field(s) {sorted(extra)}")
    try:
        return TypeAdapter(SweepConfig).validate_python(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise CaseError(f"sweep file {path}: {where}: {first['msg']} (e.g. dtypes = [\"bf16\"], "
                        "shapes = [\"64x256,256x128\"])") from None


@dataclass(frozen=True)
class PlannedCase:
    key: str
    case: OpCase
    label: str
    regime: str
    signature: str
    seed: int
    inputs: tuple[torch.Tensor, ...] | None = None  # given inputs (pytest plugin); None: generated from seed


def _ops_from_bundle(path: str, max_shapes: int) -> list[OpSpec]:
    """The ATen ops of a captured bundle at their recorded tensor input shapes (most frequent first).
    A bundle captured with ``--inputs`` also recorded each call: those calls are replayed as they
    were (overload, dims, scalars) on generated tensors; the built-in case of an op comes first."""
    b = Bundle.open(path)
    calls = b.manifest.run.get("calls") or {}
    seen: dict[str, dict[str, list[Any]]] = {}
    for r in b.records:
        if r.kind != "aten" or r.output != 0:
            continue
        shapes = [s for s in r.input_shapes if s is not None]
        if shapes:
            sig = shape_signature(shapes)
            entry = seen.setdefault(r.op, {}).setdefault(sig, [0, calls.get(r.key), r.input_dtypes])
            entry[0] += 1
    specs = []
    for op, sigs in seen.items():
        plain: list[str] = []
        for sig, (_, call, dtypes) in sorted(sigs.items(), key=lambda kv: -kv[1][0])[:max_shapes]:
            builtin = BY_ATEN.get(op)
            if call and (builtin is None or len(builtin.roles) != sig.count(",") + 1):
                specs.append(OpSpec(op, [sig], call=call, input_dtypes=list(dtypes),
                                    label=str(call.get("target", op)).replace(".", "_")))
            else:
                plain.append(sig)
        if plain:
            specs.append(OpSpec(op, plain))
    return specs


def plan(cfg: SweepConfig) -> tuple[list[PlannedCase], list[str]]:
    """The cases to run (op x shape x regime) and, for ops that cannot be swept, why not."""
    cfg.validate()
    specs = list(cfg.ops)
    if not specs:
        specs = (_ops_from_bundle(cfg.from_bundle, cfg.max_shapes) if cfg.from_bundle
                 else [OpSpec(name) for name in BUILTIN])
    planned: list[PlannedCase] = []
    skipped: list[str] = []
    keys: set[str] = set()
    for spec in specs:
        try:
            case = (call_case(spec.call, spec.input_dtypes or []) if spec.call is not None
                    else resolve_case(spec.name, spec.kwargs))
        except CaseError as e:
            skipped.append(f"{spec.name}: {e}")
            continue
        signatures = cfg.shapes or spec.shapes or list(case.shapes)
        if not signatures:
            skipped.append(f"{spec.name}: no shapes; give them with --shape or shapes = [...] in the sweep file")
            continue
        label = (spec.label or case.name).replace(".", "_")
        for sig in signatures:
            try:
                shapes = parse_shapes(sig)
                if case.roles and len(case.roles) != len(shapes):
                    raise CaseError(f"takes {len(case.roles)} tensor input(s), shape {sig} gives {len(shapes)}")
            except CaseError as e:
                skipped.append(f"{spec.name} {sig}: {e}")
                continue
            sig = shape_signature(shapes)
            for regime in cfg.regimes:
                key = f"sweep.{label}.{regime}.{sig.replace(',', '_')}/{case.op}#0"
                if key in keys:
                    if spec.call is not None:
                        continue  # another recorded call of the same overload and shapes (other scalars): the first is kept
                    raise CaseError(f"op {spec.name} appears twice with shape {sig}: give one of them a label")
                keys.add(key)
                # the seed follows the key, not the position: a case keeps its inputs whatever else is swept,
                # so its history (bands per op key) compares like with like
                planned.append(PlannedCase(key, case, label, regime, sig, (zlib.crc32(key.encode()) + cfg.seed) % 2**31))
    return planned, skipped


def _exact_dtypes(variants: Iterable[str]) -> list[torch.dtype]:
    """Casts the targets make, finest first (fp16 before bf16: bf16 values fit fp16's grid)."""
    return [d for v, d in (("fp16", torch.float16), ("bf16", torch.bfloat16)) if v in variants]


def _recorder(out: Path) -> Recorder:
    return Recorder(out, CaptureOptions(level="aten", mode="full", progress=False))


def run_reference(cfg: SweepConfig, out: str | os.PathLike[str], progress: Callable[[str], None] | None = None,
                  planned: list[PlannedCase] | None = None) -> Path:
    """Generate every case's inputs, run the op on the reference device in float32, and write the
    reference bundle (outputs, the inputs, and ``run.sweep``). ``planned``: these cases instead of
    :func:`plan`'s."""
    from hooks.devices import default_device
    from hooks.runner import check_device

    planned, skipped = (planned, []) if planned is not None else plan(cfg)
    if not planned:
        raise CaseError("nothing to sweep: " + ("; ".join(skipped) or "no ops"))
    device = cfg.reference_device or ("cuda" if default_device() == "cuda" else "cpu")
    check_device(device)
    exact = _exact_dtypes(cfg.dtypes) if cfg.exact_inputs else []
    rec = _recorder(Path(out))
    cases: dict[str, Any] = {}
    for p in planned:
        if progress:
            progress(p.key)
        try:
            inputs = ([exact_values(t, exact) for t in p.inputs] if p.inputs is not None
                      else make_inputs(p.case, parse_shapes(p.signature), p.regime, p.seed, exact))
        except CaseError as e:
            rec.diagnose(p.key, f"not swept: {e}")
            continue
        names = rec.snapshot_inputs(p.key, inputs)
        cases[p.key] = {"op": p.case.name if p.case.name in BUILTIN else p.case.op, "label": p.label,
                        "kwargs": p.case.kwargs or None, "regime": p.regime, "shape": p.signature, "seed": p.seed}
        if p.case.recorded_call is not None:
            cases[p.key]["call"] = p.case.recorded_call
            cases[p.key]["input_dtypes"] = [str(t.dtype).removeprefix("torch.") for t in inputs]
        _run_case(rec, p.key, p.case, [t.to(device) for t in inputs], names)
    run = {"variant": "fp32", "device": device, "level": "aten", "mode": "full",
           "sweep": {"cases": cases, "regimes": {r: REGIMES[r] for r in cfg.regimes},
                     "exact_inputs": [str(d).removeprefix("torch.") for d in exact], "skipped": skipped}}
    return rec.finish(run, environment(device))


def _run_case(rec: Recorder, key: str, case: OpCase, tensors: list[torch.Tensor],
              names: list[str | None] | None = None) -> None:
    module, op = key.split("/", 1)[0], case.op
    try:
        with torch.no_grad():
            outs = case.call(tensors)
    except Exception as e:  # noqa: BLE001 - an op the device or dtype does not support is a finding, not a crash
        rec.diagnose(key, f"{case.op} raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        return
    rec.ops_seen += 1
    rec.record(case.kind, module, op, key, 0, outs, tensors, names)


def _to_target(t: torch.Tensor, variant: str, device: str) -> torch.Tensor:
    t = t.to(device)
    if not t.is_floating_point():
        return t
    if variant in _CASTS:
        return t.to(_CASTS[variant])
    if variant == "int8":  # per-tensor symmetric fake quantization over the finite values
        finite = torch.isfinite(t)
        amax = torch.where(finite, t.abs(), 0).amax() if t.numel() else torch.tensor(0.0)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        return (t / scale).round().clamp(-127, 127) * scale
    if variant in FP8_DTYPES:  # per-tensor scale, as hooks.fp8 quantizes activations
        return quantize_dequantize(t, FP8_DTYPES[variant])
    return t


def run_target(reference: str | os.PathLike[str], out: str | os.PathLike[str], variant: str, device: str = "cpu",
               progress: Callable[[str], None] | None = None, cases: Mapping[str, OpCase] | None = None) -> Path:
    """Run every case of a sweep reference bundle on ``device`` in ``variant``, on the inputs the
    reference stored, and write the target bundle (same op keys). ``cases``: the case of each key
    (functions under test); default: resolved by the op name the reference noted."""
    from hooks.replay import _load as load_input
    from hooks.runner import check_device

    if variant not in TARGET_VARIANTS:
        raise CaseError(f"variant {variant!r}: choose from {', '.join(TARGET_VARIANTS)}")
    check_device(device)
    ref = Bundle.open(reference)
    sweep = ref.manifest.run.get("sweep")
    if not isinstance(sweep, dict) or not isinstance(sweep.get("cases"), dict):
        raise CaseError(f"{reference} is not a sweep reference bundle (no run.sweep): make one with `opband sweep`")
    rec = _recorder(Path(out))
    for key, meta in sweep["cases"].items():
        if progress:
            progress(key)
        try:
            record = ref.record(key)
            case = (cases[key] if cases is not None
                    else call_case(meta["call"], meta.get("input_dtypes") or []) if meta.get("call")
                    else resolve_case(meta["op"], meta.get("kwargs")))
            inputs = [load_input(ref, n, "cpu", None) for n in record.input_tensors or []]
        except (KeyError, CaseError) as e:
            rec.diagnose(key, f"not run: {e}")
            continue
        _run_case(rec, key, case, [_to_target(t, variant, device) for t in inputs])
    notes = {"int8": "inputs fake-quantized per tensor to int8 (symmetric, finite amax), fp32 compute",
             "fp8-e4m3": "inputs quantized to float8_e4m3fn per tensor and dequantized, fp32 compute",
             "fp8-e5m2": "inputs quantized to float8_e5m2 per tensor and dequantized, fp32 compute"}
    run = {"variant": variant, "device": device, "level": "aten", "mode": "full", "replay_of": str(reference),
           "sweep": {"reference": str(reference)}, **({"emulation": notes[variant]} if variant in notes else {})}
    return rec.finish(run, environment(device))


@dataclass
class SweepResult:
    reference: Path
    targets: dict[str, Path]
    report: SweepReport


def run_sweep(cfg: SweepConfig, out_dir: str | os.PathLike[str], progress: bool | None = None,
              planned: list[PlannedCase] | None = None, budgets: Mapping[str, Any] | None = None,
              reference: str | os.PathLike[str] | None = None) -> SweepResult:
    """Reference bundle, one target bundle per dtype, and the report per op x dtype x shape x regime.

    Writes ``OUT_DIR/reference.bundle`` and ``OUT_DIR/<dtype>.bundle``; each target compares
    against the reference with ``accuracy.compare(..., mode="replay")``, as ``opband compare`` does.
    ``planned``: run these cases (e.g. a function under test) instead of the config's ops;
    ``budgets``: per-op budget overrides, as ``opband compare --budgets``; ``reference``: an
    existing sweep reference bundle (made elsewhere, e.g. on the GPU machine): only the targets run,
    on its stored inputs.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = {p.key: p.case for p in planned} if planned is not None else None
    if reference is not None:
        sweep = Bundle.open(reference).manifest.run.get("sweep")
        if not isinstance(sweep, dict) or not isinstance(sweep.get("cases"), dict):
            raise CaseError(f"{reference} is not a sweep reference bundle (no run.sweep): make one with `opband sweep`")
        total = len(sweep["cases"])
    else:
        planned = planned if planned is not None else plan(cfg)[0]
        total = len(planned)
    console = Console(stderr=True)
    show = console.is_terminal if progress is None else progress
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not show, transient=True) as bar:
        if reference is not None:
            ref = Path(reference)
        else:
            task = bar.add_task("reference fp32", total=total)
            ref = run_reference(cfg, out / "reference.bundle", lambda _k: bar.advance(task),
                                planned if cases is not None else None)
        targets: dict[str, Path] = {}
        for variant in cfg.dtypes:
            task = bar.add_task(f"target {variant}", total=total)
            targets[variant] = run_target(ref, out / f"{variant}.bundle", variant, cfg.target_device,
                                          lambda _k, t=task: bar.advance(t), cases)
        ref_bundle = Bundle.open(ref)
        rows = []
        cases_meta = ref_bundle.manifest.run["sweep"]["cases"]
        for variant, path in targets.items():
            if not Bundle.open(path).records:  # nothing ran on the target (the SKIPPED lines say why)
                rows += missing_rows(cases_meta, variant, f"the target ran no case in {variant}")
                continue
            rows += rows_from_comparison(cases_meta, compare(ref_bundle, path, mode="replay", budgets=budgets), variant)
    skipped = list(ref_bundle.manifest.run["sweep"].get("skipped") or [])
    skipped += [f"{d.key}: {d.message}" for d in ref_bundle.manifest.diagnostics]
    for variant, path in targets.items():  # an op the target device or dtype cannot run: why
        skipped += [f"{variant} {d.key}: {d.message}" for d in Bundle.open(path).manifest.diagnostics]
    return SweepResult(ref, targets, SweepReport(rows, skipped))



def make_config(sweep_file: str | os.PathLike[str] | None = None, *, ops: Iterable[str] = (), **flags: Any) -> SweepConfig:
    """A sweep file's settings (or the defaults), with the given flags on top (``None``/empty: not given)."""
    cfg = load_sweep_file(sweep_file) if sweep_file is not None else SweepConfig()
    if ops:
        cfg.ops = [OpSpec(name) for name in ops]
    for name, value in flags.items():
        if name not in _FILE_KEYS:
            raise TypeError(f"unknown sweep setting {name!r}")
        if value is not None and value != [] and value != ():
            setattr(cfg, name, list(value) if isinstance(value, (list, tuple)) else value)
    cfg.validate()
    return cfg
