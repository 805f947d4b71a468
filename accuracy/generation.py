"""Token-level comparison of two generations: the ``run["generation"]`` that ``hooks.generation`` records.

Per step (0 the prefill, then one per decode step): how many sequences chose the reference's token
(argmax agreement), how much of the reference's top-k the target shares, the log-probability
the target gives the reference's token and, where both bundles hold the step's log-probabilities
(:func:`logprobs_name`), the KL divergence ``KL(reference || target)`` of the next-token distributions
in nats, the mean over sequences. Without teacher forcing, the first step at which a sequence
chose another token is where the runs' inputs part: every later step computes on other tokens, so
its ops are not judged as op faults (``inputs differ``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

#: what reads a bundle's tensor by name (None when the bundle does not hold it)
TensorSource = Callable[[str], "np.ndarray | None"]


def logprobs_name(step: int) -> str:
    """The bundle tensor holding a generation step's log-probabilities (sequences x vocabulary)."""
    return f"generation/logprobs@{step}"


def kl_divergence(reference: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``KL(p || q)`` per row of two log-probability arrays (nats, float64): ``sum p (log p - log q)`` over
    the tokens the reference gives mass; ``inf`` where the target gives such a token none."""
    ref, tgt = np.asarray(reference, np.float64), np.asarray(target, np.float64)
    if ref.shape != tgt.shape:
        raise ValueError(f"log-probabilities of shape {ref.shape} and {tgt.shape}: not the same vocabulary")
    p = np.exp(ref)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (ref - tgt), 0.0)
    return terms.sum(axis=-1)


@dataclass(frozen=True)
class StepTokens:
    """One generation step of both runs."""

    step: int
    position: int | None  # the position of the token this step chose (prompt length + step)
    argmax_agreement: float  # share of sequences whose chosen token is the reference's
    topk_overlap: float  # mean share of the reference's top-k ids in the target's top-k
    logprob_drop: float | None  # mean over sequences: reference's log-prob of its token - the target's (where known)
    kl: float | None  # mean over sequences of KL(reference || target), nats (None: a bundle lacks the log-probs)
    reference_tokens: list[int]
    target_tokens: list[int]


@dataclass
class GenerationComparison:
    """Both runs' generations side by side."""

    steps: list[StepTokens] = field(default_factory=list)
    teacher_forced: bool = False
    #: the first step at which some sequence chose another token than the reference (None: same tokens)
    first_token_divergence: int | None = None

    @property
    def max_kl(self) -> float | None:
        """The largest per-step KL divergence (None when no step has one)."""
        kls = [s.kl for s in self.steps if s.kl is not None]
        return max(kls) if kls else None

    @property
    def inputs_differ_after(self) -> int | None:
        """Steps after this one computed on other tokens than the reference's (never under teacher forcing)."""
        return None if self.teacher_forced else self.first_token_divergence

    def sentence(self) -> str:
        """The headline's words for the generation."""
        n = len(self.steps)
        kl = self.max_kl
        kl_words = f"; next-token KL at most {kl:.3g} nats (step {self._kl_step()})" if kl is not None else ""
        if self.first_token_divergence is None:
            return f"the {n} generated tokens of every sequence are the reference's" + kl_words
        s = self.steps[self.first_token_divergence]
        where = f"step {s.step}" + (f", token position {s.position}" if s.position is not None else "")
        words = (f"greedy tokens first differ at {where} (reference {s.reference_tokens}, target "
                 f"{s.target_tokens}; argmax agreement {s.argmax_agreement:.0%})" + kl_words)
        if self.teacher_forced:
            return words + "; teacher-forced: every step received the reference's tokens and is judged"
        return words + "; later steps compute on other tokens: their ops are not judged (inputs differ)"

    def _kl_step(self) -> int:
        return max((s for s in self.steps if s.kl is not None), key=lambda s: s.kl or 0.0).step

    def as_dict(self) -> dict[str, Any]:
        return {"teacher_forced": self.teacher_forced, "first_token_divergence": self.first_token_divergence,
                "steps": [{k: _json_number(v) for k, v in s.__dict__.items()} for s in self.steps]}


def _json_number(v: Any) -> Any:
    """A float JSON can hold: ``inf`` (a KL where the target rules out a reference token) as a string."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def _chosen(entry: Mapping[str, Any]) -> list[int]:
    return [int(t) for t in entry.get("argmax", [])]


def _step_kl(step: int, tensors: tuple[TensorSource, TensorSource] | None) -> float | None:
    if tensors is None:
        return None
    ref, tgt = (read(logprobs_name(step)) for read in tensors)
    if ref is None or tgt is None or ref.shape != tgt.shape:
        return None
    return float(kl_divergence(ref, tgt).mean())


def compare_generations(reference: Mapping[str, Any], target: Mapping[str, Any],
                        tensors: tuple[TensorSource, TensorSource] | None = None) -> GenerationComparison | None:
    """The token-level comparison of two runs' ``run`` metadata, or None unless both generated;
    ``tensors`` read each bundle's tensors by name (for the per-step KL divergence)."""
    ref, tgt = reference.get("generation"), target.get("generation")
    if not isinstance(ref, Mapping) or not isinstance(tgt, Mapping):
        return None
    prompt = ref.get("prompt_length")
    out = GenerationComparison(teacher_forced=bool(tgt.get("teacher_forced")))
    for step, (r, t) in enumerate(zip(ref.get("steps") or [], tgt.get("steps") or [], strict=False)):
        r_tok, t_tok = _chosen(r), _chosen(t)
        rows = min(len(r_tok), len(t_tok))
        agree = sum(a == b for a, b in zip(r_tok, t_tok, strict=False)) / rows if rows else 1.0
        overlaps, drops = [], []
        for r_ids, r_lp, t_ids, t_lp, tok in zip(r["top_ids"], r["top_logprobs"], t["top_ids"], t["top_logprobs"],
                                                 r_tok, strict=False):
            overlaps.append(len(set(r_ids) & set(t_ids)) / len(r_ids) if r_ids else 1.0)
            if tok in t_ids:
                drops.append(r_lp[r_ids.index(tok)] - t_lp[t_ids.index(tok)])
        position = prompt + step if isinstance(prompt, int) and not ref.get("encoder_decoder") else None
        out.steps.append(StepTokens(step, position, agree, sum(overlaps) / len(overlaps) if overlaps else 1.0,
                                    sum(drops) / len(drops) if drops else None, _step_kl(step, tensors),
                                    r_tok, t_tok))
        if agree < 1.0 and out.first_token_divergence is None:
            out.first_token_divergence = step
    return out
