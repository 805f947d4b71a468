"""Generation captured as steps: each call of the model (the prefill, then one per decode step over the
KV cache) is one step, numbers its op calls afresh and pairs only with the same step of the other run.

The honest ports of a greedy ``generate()`` (another thread count, bf16, fp16) add casts in some
steps and not in others; with steps in the identity those casts never shift another step's ops, so
nothing fails and nothing is missing. A decode-only bug is named at its module and its step.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import generation_specs  # noqa: E402

import accuracy  # noqa: E402
import accuracy.report  # noqa: E402
from accuracy.align import align  # noqa: E402
from accuracy.bundle import Bundle  # noqa: E402
from accuracy.capture_format import op_key, step_of_key  # noqa: E402
from accuracy.verdicts import Verdict  # noqa: E402
from hooks import capture  # noqa: E402
from hooks.generation import generate  # noqa: E402
from hooks.variants import apply_variant  # noqa: E402

NEW_TOKENS = 8


def _llama() -> torch.nn.Module:
    return generation_specs.llama()[0]


def _gpt2() -> torch.nn.Module:
    return generation_specs.gpt2()[0]


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"llama": _llama, "gpt2": _gpt2}
PROMPT = generation_specs.PROMPT


def _prompt() -> torch.Tensor:
    return generation_specs.prompt()


def _generate(model: torch.nn.Module, path: Path, variant: str = "fp32", threads: int | None = None,
              observer: bool = True, teacher: list[list[int]] | None = None) -> list[int]:
    """Capture a greedy generation as ``opband capture --generate`` does; the generated tokens."""
    model, inputs, run = apply_variant(model, (_prompt(),), variant, "cpu")
    before = torch.get_num_threads()
    os.environ["OPBAND_OBSERVER"] = "1" if observer else "0"
    try:
        if threads:
            torch.set_num_threads(threads)
        with torch.no_grad(), capture(model, path, level="aten", mode="summary", progress=False, call_steps=True,
                                      run=run) as cap:
            run["generation"] = generate(model, inputs, NEW_TOKENS, teacher, cap.paused, cap.add_tensor)
    finally:
        torch.set_num_threads(before)
        os.environ.pop("OPBAND_OBSERVER", None)
    return run["generation"]["tokens"][0]


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param) / "ref.bundle"
    _generate(MODELS[request.param](), path, threads=1)
    return request.param, path


def test_each_call_of_the_model_is_a_step_with_its_own_ordinals(reference: tuple[str, Path]) -> None:
    _, path = reference
    records = Bundle.open(path).records
    steps = sorted({r.step for r in records})
    assert steps == list(range(NEW_TOKENS))  # the prefill (0), then one step per further token
    for r in records:
        assert step_of_key(r.key) == r.step
        assert r.key == op_key(r.module, r.op, r.ordinal, r.step)
    first_ops = {r.ordinal for r in records if r.step == 3 and r.kind == "aten"}
    assert 0 in first_ops  # a decode step numbers its calls from 0 again


@pytest.mark.parametrize("case", ["threads", "bf16", "fp16"])
def test_honest_ports_of_a_generation_fail_nothing(reference: tuple[str, Path], tmp_path: Path, case: str) -> None:
    name, ref = reference
    tgt = tmp_path / f"{case}.bundle"
    if case == "threads":
        _generate(MODELS[name](), tgt, threads=max(2, min(4, os.cpu_count() or 2)))
    else:
        _generate(MODELS[name](), tgt, variant=case)
    report = accuracy.compare(ref, tgt)
    fd = report.first_divergence
    assert report.counts[Verdict.FAIL] == 0 and report.counts[Verdict.WARN] == 0, (fd.id, fd.reason) if fd else None
    assert report.counts[Verdict.MISSING] == 0  # the port's extra casts are "new"; no reference op lost its partner
    gen = report.generation
    assert gen is not None and all(st.kl is not None for st in gen.steps)  # both bundles hold each step's log-probs
    kl = gen.max_kl
    assert kl is not None and 0.0 <= kl < (1e-6 if case == "threads" else 0.05), kl  # same distribution, near enough
    if case == "threads":
        assert report.counts[Verdict.NEW] == 0
    pairs, unmatched = align(list(Bundle.open(ref).records), list(Bundle.open(tgt).records))
    assert pairs and all(p.reference.step == p.target.step for p in pairs)
    assert {p.reference.step for p in pairs} == set(range(NEW_TOKENS))
    assert all(u.side == "target" for u in unmatched)


def test_both_engines_write_the_same_stepped_keys(reference: tuple[str, Path], tmp_path: Path) -> None:
    name, ref = reference
    tgt = tmp_path / "dispatch.bundle"
    _generate(MODELS[name](), tgt, threads=1, observer=False)
    observed = [(r.key, r.step, r.shape) for r in Bundle.open(ref).records]
    dispatched = [(r.key, r.step, r.shape) for r in Bundle.open(tgt).records]
    assert observed == dispatched


@pytest.mark.parametrize("bad_step", [4])
def test_a_decode_only_positions_bug_is_named_at_its_module_and_step(reference: tuple[str, Path], tmp_path: Path,
                                                                      bad_step: int) -> None:
    name, ref = reference
    model = MODELS[name]()
    module = generation_specs.break_positions(model, name, bad_step)
    tgt = tmp_path / "bug.bundle"
    _generate(model, tgt, threads=1)
    report = accuracy.compare(ref, tgt)
    fd = report.first_divergence
    assert report.verdict == Verdict.FAIL and fd is not None
    assert fd.step == bad_step, (fd.id, fd.reason)
    assert fd.module == module or fd.module.startswith(module + "."), (fd.id, fd.reason)
    bad_steps = {o.step for o in report.ops if o.verdict == Verdict.FAIL}
    assert min(bad_steps) == bad_step  # the earlier steps are clean: the bug is decode-only
    assert report.generation is not None
    kls = [st.kl for st in report.generation.steps]
    assert all(kl is not None for kl in kls)
    assert max(kls[:bad_step]) < 1e-6 < 1e-3 < kls[bad_step], kls  # the next-token distribution moves at that step
    where = f"step {bad_step} (decode, token position {PROMPT + bad_step})"
    assert where in accuracy.report.headline(report)
    md, page = accuracy.report.to_markdown(report), accuracy.report.to_html(report)
    assert "### generation, step by step" in md and f"| {bad_step} | {PROMPT + bad_step} |" in md
    assert '<table id="generation">' in page and where in page
    assert f"step {bad_step}" in accuracy.report.headline(report)


def test_a_hand_written_decode_loop_is_stepped_too(tmp_path: Path) -> None:
    model = _llama()
    ids = _prompt()
    path = tmp_path / "loop.bundle"
    with torch.no_grad(), capture(model, path, level="aten", mode="summary", progress=False, call_steps=True):
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    records = Bundle.open(path).records
    assert sorted({r.step for r in records}) == [0, 1, 2, 3]
    per_step = [sum(1 for r in records if r.step == s) for s in (1, 2, 3)]
    assert per_step[0] == per_step[1] == per_step[2] > 0  # decode steps: the same ops, numbered alike
    ids = [r.id for r in records]
    assert len(ids) == len(set(ids))


def test_steps_never_pair_across_even_where_one_step_runs_more_ops() -> None:
    from accuracy.manifest import Record

    def rec(step: int, op: str, ordinal: int, index: int) -> Record:
        return Record(key=op_key("m", op, ordinal, step), output=0, module="m", op=op, ordinal=ordinal, kind="aten",
                      index=index, input_shapes=[[4]], shape=[4], dtype="float32", step=step)
    ref = [rec(0, "aten.mul", 0, 0), rec(1, "aten.mul", 0, 1), rec(2, "aten.mul", 0, 2)]
    # the target's step 1 runs an extra add first: step 1's implementation differs, and only step 1's
    tgt = [rec(0, "aten.mul", 0, 0), rec(1, "aten.add", 0, 1), rec(1, "aten.mul", 0, 2), rec(2, "aten.mul", 0, 3)]
    pairs, unmatched = align(ref, copy.deepcopy(tgt))
    assert {(p.reference.key, p.target.key) for p in pairs} == {
        ("m/aten.mul#0", "m/aten.mul#0"), ("m/aten.mul#0@2", "m/aten.mul#0@2")}
    assert sorted((u.side, u.record.key) for u in unmatched) == [
        ("reference", "m/aten.mul#0@1"), ("target", "m/aten.add#0@1"), ("target", "m/aten.mul#0@1")]


def test_a_target_whose_tokens_diverge_is_reported_as_such(reference: tuple[str, Path], tmp_path: Path) -> None:
    name, ref = reference
    model = MODELS[name]()
    module = generation_specs.break_positions(model, name, 4)
    tgt = tmp_path / "bug.bundle"
    tokens = _generate(model, tgt, threads=1)
    ref_tokens = Bundle.open(ref).manifest.run["generation"]["tokens"][0]
    assert tokens[:4] == ref_tokens[:4] and tokens != ref_tokens  # the planted bug does change the generation
    report = accuracy.compare(ref, tgt)
    gen = report.generation
    assert gen is not None and not gen.teacher_forced
    first = next(k for k, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b)
    assert gen.first_token_divergence == first and gen.steps[first].position == PROMPT + first
    assert gen.steps[first].argmax_agreement == 0.0 and all(s.argmax_agreement == 1.0 for s in gen.steps[:first])
    later = [o for o in report.ops if o.step > first and o.reason.startswith("inputs differ")]
    assert later and all(o.verdict == Verdict.WARN and o.inherited for o in later)
    assert not [o for o in report.ops if o.step > first and o.verdict == Verdict.FAIL]
    assert report.first_divergence is not None and report.first_divergence.step == 4
    assert report.first_divergence.module.startswith(module)
    assert f"greedy tokens first differ at step {first}" in accuracy.report.headline(report)
    assert accuracy.report.to_dict(report)["generation"]["first_token_divergence"] == first


def test_teacher_forcing_keeps_every_step_comparable(reference: tuple[str, Path], tmp_path: Path) -> None:
    name, ref = reference
    teacher = Bundle.open(ref).manifest.run["generation"]["tokens"]
    model = MODELS[name]()
    generation_specs.break_positions(model, name, 4)
    tgt = tmp_path / "forced.bundle"
    tokens = _generate(model, tgt, threads=1, teacher=teacher)
    assert tokens == teacher[0]  # fed the reference's tokens at every step
    report = accuracy.compare(ref, tgt)
    assert report.generation is not None and report.generation.teacher_forced
    assert report.generation.inputs_differ_after is None
    assert report.first_divergence is not None and report.first_divergence.step == 4
    judged_later = [o for o in report.ops if o.step > 5 and o.verdict == Verdict.FAIL]
    assert judged_later and not any(o.reason.startswith("inputs differ") for o in report.ops)
    # an honest port teacher-forced: nothing fails, and the target's own greedy choice is still reported
    honest = tmp_path / "bf16.bundle"
    _generate(MODELS[name](), honest, variant="bf16", teacher=teacher)
    report = accuracy.compare(ref, honest)
    assert report.counts[Verdict.FAIL] == 0 and report.generation is not None
    assert all(s.topk_overlap > 0.5 for s in report.generation.steps)


def test_opband_capture_generate_and_teacher_force_from_the_cli(tmp_path: Path) -> None:
    import subprocess
    import sys
    spec = f"{Path(__file__).parent / 'generation_specs.py'}:llama"
    cli = [sys.executable, "-m", "opband.cli"]
    ref, tgt = tmp_path / "ref.bundle", tmp_path / "tgt.bundle"
    out = subprocess.run([*cli, "capture", spec, "--generate", "8", "--mode", "summary", "-o", str(ref)],
                         capture_output=True, text=True, check=True).stdout
    assert "generated 8 tokens for each of 1 sequence(s)" in out
    out = subprocess.run([*cli, "capture", spec, "--generate", "8", "--mode", "summary", "--variant", "bf16",
                          "--teacher-force", str(ref), "-o", str(tgt)], capture_output=True, text=True, check=True).stdout
    assert "(teacher-forced)" in out
    done = subprocess.run([*cli, "compare", str(ref), str(tgt)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TOKENS |" in done.stdout
    bad = subprocess.run([*cli, "capture", spec, "--teacher-force", str(ref), "-o", str(tmp_path / "x.bundle")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "add --generate N" in bad.stderr + bad.stdout
    bad = subprocess.run([*cli, "capture", spec, "--generate", "4", "--teacher-force", str(tgt.with_suffix(".none")),
                          "-o", str(tmp_path / "y.bundle")], capture_output=True, text=True)
    assert bad.returncode == 2 and not (tmp_path / "y.bundle").exists()


@pytest.mark.parametrize("setup", ["t5", "llama_padded", "llama_static"])
def test_encoder_decoder_padded_batches_and_a_static_cache_generate_as_steps(setup: str, tmp_path: Path) -> None:
    """An honest bf16 port of each fails nothing; pairs stay within their step."""
    paths = {}
    for variant in ("fp32", "bf16"):
        model, inputs = getattr(generation_specs, setup)()
        model, inputs, run = apply_variant(model, inputs, variant, "cpu")
        paths[variant] = tmp_path / f"{variant}.bundle"
        with torch.no_grad(), capture(model, paths[variant], level="aten", mode="summary", progress=False,
                                      call_steps=True, run=run) as cap:
            run["generation"] = generate(model, inputs, NEW_TOKENS, None, cap.paused)
        assert len(run["generation"]["tokens"][0]) == NEW_TOKENS
    records = Bundle.open(paths["fp32"]).records
    assert sorted({r.step for r in records}) == list(range(NEW_TOKENS))
    ids = [r.id for r in records]
    assert len(ids) == len(set(ids))
    report = accuracy.compare(paths["fp32"], paths["bf16"])
    fd = report.first_divergence
    assert report.counts[Verdict.FAIL] == 0 and report.counts[Verdict.MISSING] == 0, (fd.id, fd.reason) if fd else None
    assert report.generation is not None and len(report.generation.steps) == NEW_TOKENS
    if setup == "t5":
        assert any(r.module.startswith("encoder") and r.step == 0 for r in records)
        assert not any(r.module.startswith("encoder") and r.step > 0 for r in records)  # the encoder runs once


def test_a_cache_write_bug_is_named_at_its_layer_and_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From decode step 3 on, layer 1's cache stores the new token's values at half scale (a port whose
    cache write converts them wrongly): the first divergence is that layer's attention, at step 3."""
    import transformers.cache_utils as cache_utils

    ref = tmp_path / "ref.bundle"
    _generate(_llama(), ref, threads=1)
    update, lazy = cache_utils.DynamicLayer.update, cache_utils.DynamicLayer.lazy_initialization
    made = [0]

    def numbered(self: Any, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.opband_layer, made[0] = made[0] % 2, made[0] + 1  # the model's 2 layers, in creation order
        return lazy(self, key, value, *args, **kwargs)

    def bad_write(self: Any, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.is_initialized and self.opband_layer == 1 and self.keys.shape[-2] >= PROMPT + 2:
            value = value * 0.5
        return update(self, key, value, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicLayer, "lazy_initialization", numbered)
    monkeypatch.setattr(cache_utils.DynamicLayer, "update", bad_write)
    tgt = tmp_path / "cache.bundle"
    _generate(_llama(), tgt, threads=1)
    report = accuracy.compare(ref, tgt)
    fd = report.first_divergence
    assert fd is not None and report.verdict == Verdict.FAIL
    assert fd.step == 3 and fd.module == "model.layers.1.self_attn", (fd.id, fd.reason)
    assert not [o for o in report.ops if o.step < 3 and o.verdict == Verdict.FAIL]


def test_kl_divergence_of_next_token_distributions_by_hand() -> None:
    import numpy as np

    from accuracy.generation import kl_divergence

    with np.errstate(divide="ignore"):
        p, q = np.log([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]), np.log([[0.25, 0.75, 0.0], [0.2, 0.3, 0.5]])
        kl = kl_divergence(p, q)
    # 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75); a token neither gives mass adds nothing; the same rows: 0
    assert kl[0] == pytest.approx(0.5 * np.log(2.0) + 0.5 * np.log(2.0 / 3.0), rel=1e-12)
    assert kl[1] == pytest.approx(0.0, abs=1e-15)
    with np.errstate(divide="ignore"):
        assert kl_divergence(np.log([[0.5, 0.5]]), np.log([[1.0, 0.0]]))[0] == np.inf  # mass the target rules out
    with pytest.raises(ValueError, match="same vocabulary"):
        kl_divergence(np.zeros((1, 3)), np.zeros((1, 4)))


def _generate_padded(path: Path, forget_padding_from: int | None = None) -> list[list[int]]:
    """Two left-padded prompts; with ``forget_padding_from``, the decode steps from that call on get an
    all-ones attention mask (a port whose decode path drops the padding mask)."""
    model, inputs = generation_specs.llama_padded()
    if forget_padding_from is not None:
        calls = [0]

        def drop_padding(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            calls[0] += 1
            if calls[0] > forget_padding_from and kwargs.get("attention_mask") is not None:
                kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
            return args, kwargs

        model.model.register_forward_pre_hook(drop_padding, with_kwargs=True)
    run: dict[str, Any] = {}
    with torch.no_grad(), capture(model, path, level="aten", mode="summary", progress=False, call_steps=True,
                                  run=run) as cap:
        run["generation"] = generate(model, inputs, NEW_TOKENS, None, cap.paused, cap.add_tensor)
    return run["generation"]["tokens"]


def test_an_attention_mask_bug_during_decode_is_named_at_its_module_and_step(tmp_path: Path) -> None:
    """From decode step 3 on the padded sequence attends to its padding: the mask is built in ``model``
    (LlamaModel) and its own ops change there, so that module is the first divergence, at step 3; the
    sequence without padding keeps its tokens, the padded one parts later."""
    ref, bug = tmp_path / "ref.bundle", tmp_path / "mask.bundle"
    tokens = _generate_padded(ref)
    broken = _generate_padded(bug, forget_padding_from=3)
    assert broken[1] == tokens[1] and broken[0][:3] == tokens[0][:3] != broken[0]  # only the padded row moves
    report = accuracy.compare(ref, bug)
    fd = report.first_divergence
    assert report.verdict == Verdict.FAIL and fd is not None
    assert fd.step == 3 and fd.module == "model", (fd.id, fd.reason)
    assert not [o for o in report.ops if o.step < 3 and o.verdict == Verdict.FAIL]
    gen = report.generation
    assert gen is not None and gen.first_token_divergence is not None and gen.first_token_divergence >= 3
    assert gen.steps[gen.first_token_divergence].argmax_agreement == 0.5  # one of the two sequences


def test_a_generation_replays_op_by_op_within_its_steps(tmp_path: Path) -> None:
    """``opband capture --replay`` of a generation (captured with inputs): every op of every step re-runs alone
    in bf16 under the same stepped key, and the honest port passes op by op."""
    from hooks import run_capture

    spec = f"{Path(__file__).parent / 'generation_specs.py'}:llama"
    ref = run_capture(spec, tmp_path / "ref.bundle", device="cpu", generate=NEW_TOKENS, inputs=True, mode="full")
    rep = run_capture(spec, tmp_path / "rep.bundle", device="cpu", replay=ref, variant="bf16")
    ref_ops = {r.key: r.step for r in Bundle.open(ref).records if r.kind == "aten"}
    replayed = {r.key: r.step for r in Bundle.open(rep).records}
    assert replayed and set(replayed.values()) == set(range(NEW_TOKENS))
    assert all(ref_ops[k] == step for k, step in replayed.items())  # each op re-ran under its own step's key
    assert len(replayed) >= 0.9 * len(ref_ops)
    report = accuracy.compare(ref, rep)
    assert report.counts[Verdict.FAIL] == 0 and report.counts[Verdict.WARN] == 0
