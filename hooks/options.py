"""What a capture records (:class:`CaptureOptions`): the one place every capture room reads its options from.

It imports nothing of ``hooks``, so the recorder, the modes and the observer take their options from
here while :mod:`hooks.capture`, which assembles them, imports them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LEVELS = ("module", "api", "aten")
MODES = ("summary", "full")


@dataclass
class CaptureOptions:
    """What to record. Each field maps to one ``opband capture`` flag."""

    level: str = "aten"
    mode: str = "full"
    modules: list[str] | None = None  # module path globs to keep (None = all)
    ops: list[str] | None = None  # op name globs to keep (None = all), e.g. "aten.mm", "aten.*softmax*"
    max_bytes: int | None = None  # past this many tensor bytes, keep summaries only
    buffer_bytes: int = 256 << 20  # host buffer before tensors are flushed to disk
    skip_no_number_ops: bool = True
    inputs: bool = False  # aten level: store each op's inputs and call, so it can be replayed
    backward: bool = False  # record gradients (kind "grad") when backward() runs inside the block
    steps: list[int] | None = None  # capture only these steps (``cap.step()`` ends a step); None = all
    #: each call of the captured model is one step (generation: the prefill, then one decode step per
    #: token): a step numbers its op calls afresh and the keys of step N > 0 end in ``@N``, so pairing by
    #: (step, module, op, ordinal) never lets one step's extra ops shift another's
    call_steps: bool = False
    run: dict[str, Any] = field(default_factory=dict)
    progress: bool | None = None  # None: only when stderr is a TTY
    fingerprints: bool = True  # digests of the model's inputs (first call) and parameters, for compare

    def validate(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, not {self.level!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.inputs and self.level != "aten":
            raise ValueError("inputs=True records ATen calls for replay: it needs level='aten'")
        if self.buffer_bytes <= 0:
            raise ValueError("buffer_bytes must be positive")
        if self.steps is not None and any((not isinstance(s, int)) or s < 0 for s in self.steps):
            raise ValueError("steps must be non-negative integers, e.g. steps=[0, 2]")
