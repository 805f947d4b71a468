"""``opband prescribe``: the smallest set of modules to keep at the reference precision so the outputs pass.

Each planted trap leaves the fp32 model's outputs unchanged (the reference is the same model) and breaks one
low-precision path (tests/prescribe_specs.py); every test first checks that the trap really fails the
target (``before``) where the same model without it passes, then that the prescription names the planted
module, keeps at most one more than were planted, and passes (``after``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import prescribe_specs  # noqa: E402

from accuracy.verdicts import Verdict  # noqa: E402
from hooks import keep as keep_mod  # noqa: E402
from hooks.prescribe import PrescribeError, prescribe  # noqa: E402
from hooks.variants import VARIANTS, apply, apply_variant  # noqa: E402

SPECS = Path(prescribe_specs.__file__)


def _spec(name: str) -> str:
    return f"{SPECS}:{name}"


#: (spec, variant, the planted module, how many modules were planted, the same model without the trap)
TRAPS = {
    "llama-int8-outlier": ("llama_outlier", "int8", "model.layers.1.mlp.down_proj", 1, "llama_clean"),
    "qwen2-fp16-overflow": ("qwen2_overflow", "fp16", "model.layers.0.mlp", 1, "qwen2_clean"),
    "gpt2-int8-layernorm": ("gpt2_layernorm_outlier", "int8", "transformer.h.0.attn.c_attn", 1, "gpt2_clean"),
}


@pytest.mark.parametrize("case", sorted(TRAPS))
def test_the_prescription_names_the_planted_module_and_passes(case: str) -> None:
    spec, variant, planted, count, clean = TRAPS[case]
    untouched = prescribe(_spec(clean), variant)  # the trap is what fails: without it nothing needs keeping
    assert untouched.before.verdict == Verdict.PASS and untouched.keep == [] and untouched.runs == 1
    result = prescribe(_spec(spec), variant)
    assert result.before.verdict != Verdict.PASS, "the trap must fail the target, or this test proves nothing"
    assert result.found and result.after is not None and result.after.verdict == Verdict.PASS
    assert 1 <= len(result.keep) <= count + 1
    assert any(keep_mod.inside(k.module, planted) for k in result.keep), (result.paths, planted)
    assert result.after.worst < result.before.worst
    for k in result.keep:  # each kept module is needed: without it the outputs are worse
        assert k.error_without > k.error_with
    assert result.runs <= 64 and result.sensitivity[0][1] > 0


def test_two_planted_traps_need_two_modules_and_the_search_finds_both() -> None:
    """No module passes alone: the ranked prefix (1, 2, ...) with bisection finds the pair."""
    result = prescribe(_spec("llama_two_outliers"), "int8")
    assert result.before.verdict != Verdict.PASS and result.found and result.after is not None
    assert sorted(result.paths) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert all(k.error_without > 0.2 > k.error_with for k in result.keep)


#: the trained model's outputs in int8 sit at the default int8 budget (norm L2 0.257 against 0.252): a team
#: porting it states its own
MINILM_BUDGETS = {"ops": {"/forward#0*": {"norm_l2": 0.3, "cosine_min": 0.82}}}


def test_a_trained_model_with_a_planted_outlier_keeps_the_planted_projection() -> None:
    untouched = prescribe(_spec("minilm_clean"), "int8", budgets=MINILM_BUDGETS)
    assert untouched.before.verdict == Verdict.PASS and untouched.keep == []
    result = prescribe(_spec("minilm_value_outlier"), "int8", budgets=MINILM_BUDGETS)
    assert result.before.verdict != Verdict.PASS and result.before.worst > 0.3
    assert result.found and result.after is not None and result.after.verdict == Verdict.PASS
    assert "encoder.layer.5.attention.output.dense" in result.paths and len(result.paths) <= 2, result.paths


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "fp32"])
def test_every_variant_prescribes_on_a_model_without_a_trap(variant: str) -> None:
    """No trap: the target passes and nothing is kept, or (w4a16 on random weights, at the budget's edge) a
    small set makes it pass; never a set that does not pass."""
    result = prescribe(_spec("llama_clean"), variant, max_runs=24)
    assert result.found
    if result.keep:
        assert result.before.verdict != Verdict.PASS and result.after is not None
        assert result.after.verdict == Verdict.PASS and len(result.keep) <= 2
    else:
        assert result.before.verdict == Verdict.PASS and "already passes" in result.notes[0]


def test_a_users_own_low_precision_model_is_matched_by_module_path() -> None:
    result = prescribe(_spec("llama_outlier"), "int8", target_spec=_spec("llama_outlier_int8"))
    assert result.before.verdict != Verdict.PASS and result.found
    assert result.paths == ["model.layers.1.mlp.down_proj"], result.paths


def test_max_runs_bounds_the_search_and_says_so() -> None:
    result = prescribe(_spec("qwen2_overflow"), "fp16", max_runs=2)
    assert result.runs <= 2 and not result.found
    assert any("--max-runs 2" in n for n in result.notes)


def test_keep_restores_the_target_exactly_and_checks_its_paths() -> None:
    model, inputs = prescribe_specs.llama_clean()
    ref = model(**inputs).logits
    target, tgt_inputs, _ = apply_variant(model, inputs, "fp16", "cpu")
    originals = keep_mod.reference_copies(prescribe_specs.llama_clean()[0], ["model.layers.0.mlp", "model.layers.0"])
    assert list(originals) == ["model.layers.0"]  # a path inside another kept path adds nothing
    with torch.no_grad():
        plain = target(**tgt_inputs).logits
        kept = keep_mod.keep_modules(target, originals, list(originals))
        mixed = target(**tgt_inputs).logits
        assert mixed.dtype == torch.float16  # the modules around the kept one see what they would without it
        assert target.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
        kept.restore()
        assert torch.equal(target(**tgt_inputs).logits, plain)
    assert (mixed.float() - ref).norm() < (plain.float() - ref).norm()
    with pytest.raises(keep_mod.KeepError, match="no module 'model.layers.9.mlp'"):
        keep_mod.reference_copies(model, ["model.layers.9.mlp"])
    with pytest.raises(keep_mod.KeepError, match="root module"):
        keep_mod.reference_copies(model, [""])


def test_apply_keeps_the_prescribed_modules_in_a_fresh_model() -> None:
    model, inputs = prescribe_specs.llama_outlier()
    fixed = apply(model, "int8", keep=["model.layers.1.mlp.down_proj"])
    assert type(fixed.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert type(fixed.model.layers[0].mlp.down_proj) is not torch.nn.Linear  # the rest is quantized


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opband.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_cli_prescribes_writes_its_config_and_capture_applies_it(tmp_path: Path) -> None:
    spec = _spec("llama_outlier")
    done = _cli("prescribe", spec, "--variant", "int8", "--json", "p.json", "--md", "p.md", "--toml", "keep.toml",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "keep model.layers.1.mlp.down_proj" in done.stdout and "after:  PASS" in done.stdout
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["found"] and [k["module"] for k in report["keep"]] == ["model.layers.1.mlp.down_proj"]
    assert report["before"]["verdict"] == "fail" and report["after"]["verdict"] == "pass"
    assert "| `model.layers.1.mlp.down_proj` |" in (tmp_path / "p.md").read_text()
    for name, extra in (("ref", []), ("int8", ["--variant", "int8"]),
                        ("kept", ["--variant", "int8", "--keep", "keep.toml"])):
        run = _cli("capture", spec, "-o", f"{name}.bundle", "--level", "module", *extra, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    before = _cli("compare", "ref.bundle", "int8.bundle", cwd=tmp_path)
    after = _cli("compare", "ref.bundle", "kept.bundle", cwd=tmp_path)
    assert before.returncode == 1 and after.returncode == 0, (before.stdout[-500:], after.stdout[-500:])
    (tmp_path / "wrong.toml").write_text('variant = "fp16"\nkeep = ["model.layers.1.mlp.down_proj"]\n')
    bad = _cli("capture", spec, "-o", "x.bundle", "--variant", "int8", "--keep", "wrong.toml", cwd=tmp_path)
    assert bad.returncode == 2 and "prescribed for --variant fp16, not int8" in bad.stderr
    (tmp_path / "typo.toml").write_text('keep = ["model.layers.1.mlp.down_prj"]\n')
    bad = _cli("capture", spec, "-o", "x.bundle", "--variant", "int8", "--keep", "typo.toml", cwd=tmp_path)
    assert bad.returncode == 2 and "no module 'model.layers.1.mlp.down_prj'" in bad.stderr
    assert not (tmp_path / "x.bundle").exists()
    unknown = _cli("prescribe", spec, "--variant", "int8", "--metric", "cosine", cwd=tmp_path)
    assert unknown.returncode == 2 and "--metric 'cosine'" in unknown.stderr


def test_a_run_that_fails_names_the_set_it_tried() -> None:
    import copy

    from accuracy.budgets import BudgetPolicy
    from hooks.prescribe import Search

    class Broken(torch.nn.Module):
        def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("kernel not implemented for this shape")

    model, inputs = prescribe_specs.llama_clean()
    target, tgt_inputs, _ = apply_variant(copy.deepcopy(model), inputs, "int8", "cpu")
    search = Search(model, inputs, target, tgt_inputs, "int8", ["model.layers.0.mlp.down_proj"], BudgetPolicy(),
                    "norm_l2", 8)
    search._originals["model.layers.0.mlp.down_proj"] = Broken()
    with pytest.raises(PrescribeError, match=r"keeping \['model.layers.0.mlp.down_proj'\] .* failed: RuntimeError: "
                                             "kernel not implemented"):
        search.check(["model.layers.0.mlp.down_proj"])
    assert not isinstance(target.model.layers[0].mlp.down_proj, Broken)  # the failed run put the target's own back
    with torch.no_grad():
        assert torch.isfinite(target(**tgt_inputs).logits).all()
    with pytest.raises(PrescribeError, match="one of norm_l2"):
        prescribe(_spec("llama_clean"), "int8", metric="cosine")
