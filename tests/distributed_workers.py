"""Process bodies for the multi-rank tests (importable, so torch.multiprocessing can spawn them).

Each worker joins a gloo process group, captures a reference run and a target run in which one
rank (``fault_rank``) has a faulty activation kernel (SiLU of a 0.1% larger input), and leaves one bundle per
rank and run in ``out``: ``ref.rank{r}.bundle`` and ``tgt.rank{r}.bundle``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

DIM, HIDDEN = 16, 32


class Act(nn.Module):
    def __init__(self, faulty: bool) -> None:
        super().__init__()
        self.faulty = faulty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x * 1.001 if self.faulty else x)  # the faulty kernel: silu of a 0.1% larger input


class TensorParallelMLP(nn.Module):
    """Megatron-style MLP: fc1 split by output columns, fc2 by input rows, one all-reduce."""

    def __init__(self, rank: int, world: int, faulty: bool) -> None:
        super().__init__()
        full = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM))  # same seed: same weights on every rank
        shard = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
        self.fc1 = nn.Linear(DIM, HIDDEN // world)
        self.fc2 = nn.Linear(HIDDEN // world, DIM, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(full[0].weight[shard])
            self.fc1.bias.copy_(full[0].bias[shard])
            self.fc2.weight.copy_(full[1].weight[:, shard])
        self.bias = nn.Parameter(full[1].bias.detach().clone())
        self.act = Act(faulty)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(self.act(self.fc1(x)))
        dist.all_reduce(y)
        return y + self.bias


class SmallMLP(nn.Module):
    def __init__(self, faulty: bool) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), Act(faulty), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def tensor_parallel(rank: int, world: int, port: int, out: str, fault_rank: int) -> None:
    from hooks import capture

    _init(rank, world, port)
    try:
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7))  # replicated input
        for name, faulty in (("ref", False), ("tgt", rank == fault_rank)):
            torch.manual_seed(0)
            model = TensorParallelMLP(rank, world, faulty).eval()
            with torch.no_grad(), capture(model, Path(out) / f"{name}.bundle", level="aten", progress=False):
                model(x)
        dist.barrier()  # no rank tears its gloo pairs down while a peer still uses them
    finally:
        dist.destroy_process_group()


def data_parallel_step(rank: int, world: int, port: int, out: str, fault_rank: int) -> None:
    """One SGD step of data-parallel training: each rank its own batch, gradients all-reduced."""
    from hooks import capture

    _init(rank, world, port)
    try:
        g = torch.Generator().manual_seed(100 + rank)  # this rank's shard of the batch
        x, target = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
        for name, faulty in (("ref", False), ("tgt", rank == fault_rank)):
            torch.manual_seed(0)
            model = SmallMLP(faulty)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
            with capture(model, Path(out) / f"{name}.bundle", level="aten", backward=True, progress=False):
                loss = F.mse_loss(model(x), target)
                loss.backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
                opt.step()
        dist.barrier()  # no rank tears its gloo pairs down while a peer still uses them
    finally:
        dist.destroy_process_group()
