"""Training steps under capture (``opband capture --backward``): forward, loss, backward, optimizer step.

Gradients are recorded by capture's ``backward=True`` hooks (``path/backward#N`` for each module
output's gradient, ``path/grad.weight#N`` for each parameter's); after each optimizer step every
parameter's update (new value minus old) is recorded as ``path/update.weight#N``. Dropout and
other train-mode randomness stay off (the model is in eval mode) so two runs are comparable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hooks.capture import capture

OPTIMIZERS = ("sgd", "adamw")


def loss_of(output: Any, loss_fn: Callable[[Any], Any] | None) -> torch.Tensor:
    """The scalar loss: ``loss_fn(output)``, else the model's own ``output.loss`` (Hugging Face models
    given labels), else the output itself when it is a scalar."""
    if loss_fn is not None:
        loss = loss_fn(output)
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, dict) and output.get("loss") is not None:
        loss = output["loss"]
    else:
        loss = output
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise ValueError("--backward needs a scalar loss that requires grad: return (model, inputs, loss_fn) from "
                         "the SPEC, give the model labels so that it returns .loss, or return a scalar")
    return loss


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, not {name!r}")


def train_steps(model: nn.Module, inputs: Any, cap: capture, loss_fn: Callable[[Any], Any] | None = None,
                steps: int = 1, optimizer: str = "sgd", lr: float = 1e-3) -> dict[str, Any]:
    """Run ``steps`` training steps inside an open ``capture(..., backward=True)``; returns run notes."""
    if steps < 1:
        raise ValueError("train_steps must be at least 1")
    opt = make_optimizer(model, optimizer, lr)
    names = {p: n for n, p in model.named_parameters()}
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss = loss_of(out, loss_fn)
        loss.backward()
        with cap.paused():  # the update is recorded once, as new value - old value, not op by op
            before = {p: p.detach().clone() for p in names}
            opt.step()
            updates = {p: p.detach() - before[p] for p in names}
        for p, name in names.items():
            module, _, leaf = name.rpartition(".")
            cap.record_tensor(module, f"update.{leaf}", updates[p])
        losses.append(float(loss.detach()))
        cap.step()
    return {"training": {"steps": steps, "optimizer": optimizer, "lr": lr, "losses": losses,
                         "loss": "loss_fn" if loss_fn else "model output"}}
