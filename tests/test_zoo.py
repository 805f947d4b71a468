"""The zoo (``tests/zoo.py``): verdicts on architectures opband was not tuned for.

For every model: an fp32 run with another thread count and honest bf16/fp16 ports fail nothing,
and each injected fault's first divergence lies in the module it was injected into. The models
marked ``fast`` run in ``make test``; the whole zoo runs in ``make sweep`` (and as a table in
``benchmarks/zoo.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import zoo  # noqa: E402

import accuracy  # noqa: E402
from accuracy import report  # noqa: E402
from accuracy.errors import OpbandError  # noqa: E402


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 reference bundles, captured once per model on first use."""
    out = tmp_path_factory.mktemp("zoo")
    cache: dict[str, Path] = {}

    class Refs(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> Path:
            cache[name] = zoo.capture_run(zoo.BY_NAME[name], None, out / f"{name}-ref.bundle")
            self[name] = cache[name]
            return cache[name]

    return Refs()


def _params(fast: bool) -> list[object]:
    marks = [] if fast else [pytest.mark.sweep]
    return [pytest.param(m, c, id=f"{m.name}-{c.name}", marks=marks)
            for m, c in zoo.all_cases() if m.fast == fast]


@pytest.mark.parametrize("model,case", _params(True) + _params(False))
def test_zoo_case(references: dict[str, Path], tmp_path: Path, model: zoo.Model, case: zoo.Case) -> None:
    rep = zoo.run_case(model, case, tmp_path, references[model.name])
    problem = zoo.judge_case(case, rep)
    assert problem is None, problem + "\n" + report.headline(rep)
    if case.benign:
        assert rep.counts["fail"] == rep.counts["warn"] == 0 and rep.parameters == []
        return
    fd = rep.first_divergence
    assert rep.verdict == "fail" and fd is not None and not fd.inherited
    assert f"module {fd.module}" in report.headline(rep)
    if case.fault == "lowp_gemm":  # the trap is named on the op that lost the precision
        assert fd.finding is not None and "computed in bfloat16" in fd.finding and "declared fp32" in fd.finding


def test_zoo_covers_the_issue() -> None:
    """>= 8 architectures incl. a MoE, a decoder with biases, an encoder-decoder, a ViT, a convnet and trained weights;
    every model has >= 4 fault kinds; the fast subset covers a decoder, a convnet and the trained encoder."""
    assert len(zoo.MODELS) >= 8
    families = " ".join(m.family for m in zoo.MODELS)
    for word in ("MoE", "biases", "encoder-decoder", "vision transformer", "convnet", "trained weights"):
        assert word in families
    assert all(len(m.faults) >= 4 and set(m.faults) <= set(zoo.FAULTS) for m in zoo.MODELS)
    fast = {m.name for m in zoo.MODELS if m.fast}
    assert {"llama", "resnet", "all-minilm-l6-v2"} <= fast


def test_benign_cases_really_change_numbers(references: dict[str, Path], tmp_path: Path) -> None:
    """The honest ports are not vacuous: bf16 moves every module output by more than fp32 rounding."""
    rep = zoo.run_case(zoo.BY_NAME["llama"], zoo.Case("bf16", variant="bf16"), tmp_path, references["llama"])
    assert max(o.error for o in rep.ops if o.kind == "module") > 1e-3


# -- fingerprints: different inputs, different weights, unrelated models -------------------------------
def _variant(name: str, build: zoo.Builder) -> zoo.Model:
    return zoo.Model(name, "variant", build, {})


def test_different_inputs_make_runs_incomparable(references: dict[str, Path], tmp_path: Path) -> None:
    """Another sequence length: compare stops with a sentence naming the input (the CLI exits 2 on it)."""
    def longer() -> tuple[object, zoo.Inputs]:
        model, _ = zoo.BY_NAME["llama"].build()
        return model, {"input_ids": torch.randint(3, 256, (zoo.BATCH, 16), generator=torch.Generator().manual_seed(1))}

    tgt = zoo.capture_run(_variant("llama16", longer), None, tmp_path / "t.bundle")
    with pytest.raises(OpbandError, match=r"different inputs: input_ids shape 2x12 vs 2x16"):
        accuracy.compare(references["llama"], tgt)
    cli = subprocess.run([sys.executable, "-m", "opband.cli", "compare", str(references["llama"]), str(tgt)],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "the two runs had different inputs: input_ids shape 2x12 vs 2x16" in cli.stderr
    assert "Traceback" not in cli.stderr

    def other_tokens() -> tuple[object, zoo.Inputs]:
        model, inputs = zoo.BY_NAME["llama"].build()
        inputs["input_ids"][0, 3] += 1
        return model, inputs

    tgt = zoo.capture_run(_variant("llama-tok", other_tokens), None, tmp_path / "t2.bundle")
    with pytest.raises(OpbandError, match=r"different inputs: input_ids \(2x12\) sum"):
        accuracy.compare(references["llama"], tgt)


def test_different_weights_are_a_finding_naming_the_module(references: dict[str, Path], tmp_path: Path) -> None:
    def bad_conversion() -> tuple[object, zoo.Inputs]:
        model, inputs = zoo.BY_NAME["llama"].build()
        with torch.no_grad():
            model.layers[1].mlp.up_proj.weight[3, :3] += 0.5
        return model, inputs

    tgt = zoo.capture_run(_variant("llama-w", bad_conversion), None, tmp_path / "t.bundle")
    rep = accuracy.compare(references["llama"], tgt)
    assert [d.name for d in rep.parameters] == ["layers.1.mlp.up_proj.weight"]
    fd = rep.first_divergence
    assert rep.verdict == "fail" and fd is not None and fd.module == "layers.1.mlp.up_proj"
    assert "FINDING | weight of `layers.1.mlp.up_proj` differs: sum" in report.headline(rep)
    assert report.to_dict(rep)["parameters"][0]["module"] == "layers.1.mlp.up_proj"


def test_quantized_variant_changes_weights_by_design(references: dict[str, Path], tmp_path: Path) -> None:
    tgt = zoo.capture_run(zoo.BY_NAME["llama"], zoo.Case("int8", variant="int8"), tmp_path / "t.bundle")
    rep = accuracy.compare(references["llama"], tgt)
    assert rep.parameters == [] and rep.notes and "changes weights by design" in rep.notes[0]
    assert "Note: the target's variant int8 changes weights by design" in report.headline(rep)


def test_unrelated_models_are_refused(references: dict[str, Path]) -> None:
    with pytest.raises(OpbandError, match=r"not the same model: only \d+ of the reference's \d+ modules"):
        accuracy.compare(references["llama"], references["bert"])
