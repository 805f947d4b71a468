"""Capture a ``transformers`` generation: greedy ``generate()`` as steps, the tokens it chose, teacher forcing.

Under capture with ``call_steps`` each call of the model is one step: the prefill (step 0), then one
decode step per further token over the KV cache. :func:`generate` runs the greedy generation and
returns what the manifest keeps of it (``run["generation"]``): the prompt's length, the tokens each
step chose, and each step's top-k token ids and log-probabilities, read by a logits processor
outside the recorded ops, and each step's full log-probabilities as bundle tensors named
:func:`accuracy.generation.logprobs_name` (``keep``), from which the comparison computes the KL divergence
of the target's next-token distribution from the reference's. With ``teacher`` (the tokens of a reference generation) each step is
made to choose the reference's token, so a target whose greedy choice would differ still receives
the reference's inputs at every step and stays comparable op by op.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch

from accuracy.generation import logprobs_name

#: token ids and log-probabilities kept per step and sequence
TOP_K = 5


def generation_kwargs(inputs: Any) -> dict[str, Any]:
    """The SPEC's inputs as ``generate()`` keyword arguments: a dict as is, a tensor (or a tuple whose first
    item is one) as ``input_ids``."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, (tuple, list)) and inputs and isinstance(inputs[0], torch.Tensor) and len(inputs) <= 2:
        out = {"input_ids": inputs[0]}
        if len(inputs) == 2:
            out["attention_mask"] = inputs[1]
        return out
    if isinstance(inputs, torch.Tensor):
        return {"input_ids": inputs}
    raise ValueError("--generate needs the SPEC's inputs as a dict of generate() arguments (input_ids, "
                     f"attention_mask, ...) or an input_ids tensor, not {type(inputs).__name__}")


class _StepLog:
    """A ``LogitsProcessor``: reads each step's scores (top-k, the chosen token) and, teacher forcing,
    makes the step choose the teacher's token. Its torch work runs unrecorded (``paused``)."""

    def __init__(self, teacher: list[list[int]] | None, paused: Callable[[], AbstractContextManager[None]],
                 keep: Callable[[str, torch.Tensor], None] | None = None) -> None:
        self.teacher, self.paused, self.keep = teacher, paused, keep
        self.steps: list[dict[str, Any]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        with self.paused(), torch.no_grad():
            step = len(self.steps)
            logp = torch.log_softmax(scores.float(), dim=-1)
            top = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1)
            chosen = scores.argmax(-1)
            if self.keep is not None:
                self.keep(logprobs_name(step), logp)
            entry = {"top_ids": top.indices.tolist(), "top_logprobs": [[round(v, 6) for v in row]
                                                                       for row in top.values.tolist()],
                     "argmax": chosen.tolist()}
            if self.teacher is not None:
                forced = torch.tensor([row[step] if step < len(row) else int(chosen[i])
                                       for i, row in enumerate(self.teacher)], device=scores.device)
                entry["forced"] = forced.tolist()
                scores = torch.full_like(scores, -torch.inf).scatter(-1, forced[:, None], 0.0)
            self.steps.append(entry)
        return scores


def generate(model: torch.nn.Module, inputs: Any, new_tokens: int, teacher: list[list[int]] | None = None,
             paused: Callable[[], AbstractContextManager[None]] = nullcontext,
             keep: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, Any]:
    """Greedy ``model.generate`` of exactly ``new_tokens`` tokens (forced to ``teacher``'s tokens when given);
    returns ``run["generation"]``: prompt length, the generated tokens per sequence, per-step top-k.
    ``keep(name, logprobs)`` (``capture.add_tensor``) stores each step's log-probabilities (sequences x vocab)."""
    from transformers import LogitsProcessorList

    kwargs = generation_kwargs(inputs)
    prompt = kwargs.get("input_ids")
    if teacher is not None and prompt is not None and len(teacher) != prompt.shape[0]:
        raise ValueError(f"--teacher-force: the reference generated {len(teacher)} sequences, this run's inputs "
                         f"hold {prompt.shape[0]}: capture both with the same SPEC")
    log = _StepLog(teacher, paused, keep)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    out = model.generate(**kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         num_beams=1, logits_processor=LogitsProcessorList([log]),
                         **({} if pad is not None else {"pad_token_id": 0}))
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    is_encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    start = 1 if is_encoder_decoder else (prompt.shape[-1] if prompt is not None else 0)
    return {"new_tokens": new_tokens, "prompt_length": int(prompt.shape[-1]) if prompt is not None else None,
            "encoder_decoder": is_encoder_decoder, "teacher_forced": teacher is not None,
            "tokens": sequences[:, start:].tolist(), "steps": log.steps, "logprobs": keep is not None}


def reference_tokens(manifest_run: Mapping[str, Any], source: str) -> list[list[int]]:
    """The generated tokens a reference bundle's ``run["generation"]`` holds (for ``--teacher-force``)."""
    gen = manifest_run.get("generation")
    if not isinstance(gen, Mapping) or not isinstance(gen.get("tokens"), list):
        raise ValueError(f"--teacher-force {source}: that bundle holds no generation (capture the reference "
                         "with --generate N first)")
    return [[int(t) for t in row] for row in gen["tokens"]]


def steps_of(generation: Mapping[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, entry) for each generation step recorded in ``run["generation"]``."""
    yield from enumerate(generation.get("steps") or [])
