"""Full aten captures store an op's output once, even when a module returns a reshaped alias of it.

A bias-free ``Linear`` on a 3-d input runs ``mm`` on a 2-d view and returns ``_unsafe_view`` of
its result: the module record names the ``mm`` tensor (bundle format 1.1: a record's tensor may
have another shape with the same element count). Sharing must never hand a record bytes that
differ from its values: not after an in-place write, not when a freed output's address is
recycled, and never for op inputs (replay needs each input in its own shape).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from accuracy.bundle import Bundle
from accuracy.metrics import PairBatch
from hooks import capture


class Proj(nn.Module):
    """A bias-free projection, optionally scaled in place and viewed by its parent."""

    def __init__(self, scale_in_place: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8, bias=False)
        self.scale_in_place = scale_in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)  # [2, 5, 8], an alias of mm's [10, 8]
        if self.scale_in_place:
            y.mul_(2.0)  # the parent's output now differs from what mm wrote
        return y.view(2, 40)


def _capture(model: nn.Module, x: torch.Tensor, path: Path, **opts: object) -> tuple[torch.Tensor, dict[str, torch.Tensor], Bundle]:
    outs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: outs.__setitem__(n, o.detach().clone()))
             for n, m in model.named_modules()]
    try:
        with torch.no_grad(), capture(model, path, level="aten", mode="full", progress=False, **opts):
            out = model(x)
    finally:
        for h in hooks:
            h.remove()
    return out, outs, Bundle.open(path)


def _values(b: Bundle, record_id: str) -> torch.Tensor:
    v = b.record_values(record_id)
    assert v is not None
    return torch.from_numpy(np.array(v))


def test_linear_module_output_shares_the_mm_tensor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Proj(), torch.randn(2, 5, 16)
    out, outs, b = _capture(model, x, tmp_path / "b.bundle")
    recs = {r.id: r for r in b.records}
    lin = recs["lin/forward#0"]
    assert lin.tensor == "lin/aten.mm#0" and lin.shape == [2, 5, 8]
    assert list(b.tensors["lin/aten.mm#0"].shape) == [10, 8]
    assert recs["/forward#0"].tensor == "lin/aten.mm#0" and recs["/forward#0"].shape == [2, 40]
    assert torch.equal(_values(b, "lin/forward#0"), outs["lin"]) and torch.equal(_values(b, "/forward#0"), out)
    assert sorted(b.tensors) == ["lin/aten.mm#0"]  # the weight's transpose is a view: nothing else moves numbers
    assert tuple(map(int, b.manifest.format_version.split("."))) >= (1, 1)  # 1.1 on: equal-size reshapes share


def test_an_in_place_write_after_the_op_stores_the_new_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Proj(scale_in_place=True), torch.randn(2, 5, 16)
    out, outs, b = _capture(model, x, tmp_path / "b.bundle")
    recs = {r.id: r for r in b.records}
    assert recs["/forward#0"].tensor != "lin/aten.mm#0"  # mul_ wrote after mm: its bytes are stale
    assert torch.equal(_values(b, "/forward#0"), out)
    assert torch.equal(_values(b, "/aten.mul_#0"), out.view(2, 5, 8))
    assert torch.equal(_values(b, "lin/aten.mm#0"), (out / 2.0).view(10, 8))


class Recycler(nn.Module):
    """Frees an op's output, then fills memory that may sit at the same address through an op
    capture does not record (``clone``): a match by address alone would hand back ``2x``."""

    def __init__(self, settle: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.addresses: tuple[int, int] = (0, 0)
        self.settle = settle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 3.0
        a = x * 2.0
        first = a.data_ptr()
        del a
        self.settle()  # the bundle writer lets go of ``a`` first, as it may on an idle machine
        b = y.clone()
        self.addresses = (first, b.data_ptr())
        return b


@pytest.mark.parametrize("engine", ["dispatch", "observer"])
def test_a_recycled_address_is_not_mistaken_for_the_freed_output(engine: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from hooks import observer

    monkeypatch.setenv("OPBAND_OBSERVER", "0" if engine == "dispatch" else "1")
    # the observer holds an output until Python hands it to the writer: after every op here, so the
    # freed output's memory can come back within the forward, as under the dispatch mode
    monkeypatch.setattr(observer, "HAND_BYTES", 1)

    def writer_done() -> None:  # the writer thread holds what it was handed until it wrote it
        mode = observer.active()
        if mode is not None:
            mode.rec.writer.drain()

    model, recycled = Recycler(writer_done), 0
    for rep in range(16):  # at least 4 rounds; more until the allocator has recycled an address
        for n in (1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 16, 1 << 17, 1 << 18):
            x = torch.randn(n)
            out, _, b = _capture(model, x, tmp_path / f"{n}-{rep}.bundle")
            recycled += model.addresses[0] == model.addresses[1]
            rec = b.record("/forward#0")
            assert torch.equal(_values(b, "/forward#0"), out), (n, rep)
            assert rec.stats is not None and abs(rec.stats.mean - float(out.double().mean())) < 1e-6
            (tmp_path / f"{n}-{rep}.bundle").unlink()
        if rep >= 3 and recycled:
            break
    assert recycled > 0  # the allocator did hand the freed block out again, so the case was exercised


def test_inputs_mode_keeps_every_tensor_in_its_own_shape(tmp_path: Path) -> None:
    """Replay loads inputs by name, in the stored shape: with ``inputs`` nothing is shared."""
    torch.manual_seed(0)
    model, x = Proj(), torch.randn(2, 5, 16)
    _, _, b = _capture(model, x, tmp_path / "b.bundle", inputs=True)
    for r in b.records:
        if r.tensor is not None:
            assert list(b.tensors[r.tensor].shape) == r.shape, r.id


def test_a_large_model_bundle_shrinks_by_the_shared_outputs(tmp_path: Path) -> None:
    from hooks import demo_model

    model, (x,) = demo_model.build()
    _, _, b = _capture(model, x, tmp_path / "b.bundle")
    shared = [r for r in b.records if r.tensor is not None and r.tensor != r.id]
    reshaped = [r for r in shared if list(b.tensors[r.tensor].shape) != r.shape]
    assert reshaped and all(r.kind == "module" for r in reshaped)
    stored = sum(b.tensors[n].nbytes for n in b.tensors)
    named = sum(b.tensors[r.tensor].nbytes for r in b.records if r.tensor is not None)
    assert stored < 0.85 * named  # every projection's module output would otherwise be a second copy
    for r in reshaped:
        assert _values(b, r.id).shape == tuple(r.shape)


class Reinterpret(nn.Module):
    """The inner module's output viewed as another dtype of the same width (bf16 <-> int16, fp8 as
    uint8 for communication): the same bytes, another record dtype and tag."""

    def __init__(self, src: torch.dtype, dst: torch.dtype) -> None:
        super().__init__()
        self.inner = _Cast(src)
        self.dst = dst

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).view(self.dst)


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).to(self.dtype)


@pytest.mark.parametrize(("src", "dst"), [(torch.bfloat16, torch.int16), (torch.int16, torch.bfloat16),
                                          (torch.float8_e4m3fn, torch.float8_e5m2), (torch.float8_e4m3fn, torch.uint8)])
def test_a_dtype_reinterpreting_view_is_stored_under_its_own_tag(tmp_path: Path, src: torch.dtype,
                                                                 dst: torch.dtype) -> None:
    torch.manual_seed(0)
    model, x = Reinterpret(src, dst), torch.randn(4, 8)
    out, outs, b = _capture(model, x, tmp_path / "b.bundle")  # opens: every record's tensor has its dtype's tag
    root = b.record("/forward#0")
    assert root.dtype == str(dst).removeprefix("torch.") and root.tensor != b.record("inner/forward#0").tensor
    stored = np.array(b.raw(root.tensor)).tobytes()
    assert stored == out.contiguous().view(torch.uint8).numpy().tobytes(), "the bytes of the viewed output"
    assert list(b.tensors[root.tensor].shape) == root.shape


def _numpy_kernel_(t: torch.Tensor) -> None:
    """Stands in for a Triton / C-extension kernel writing through the data pointer: no ATen op,
    so the dispatch mode sees no write and the version counter does not move."""
    a = t.detach().numpy()
    a *= 2.0


class RawKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x)
        _numpy_kernel_(q)  # e.g. a fused rotary embedding applied in place
        return q.reshape(2, 24)


def test_a_write_no_op_announces_is_caught_by_the_sample_re_read(tmp_path: Path) -> None:
    torch.manual_seed(0)
    out, outs, b = _capture(RawKernel(), torch.randn(2, 3, 8), tmp_path / "b.bundle")
    root = b.record("/forward#0")
    assert root.tensor != "q_proj/aten.mm#0"  # its bytes changed after mm: stored again
    assert torch.equal(_values(b, "/forward#0"), out)
    assert root.stats is not None and abs(root.stats.mean - float(out.double().mean())) < 1e-6
    assert torch.equal(_values(b, "q_proj/forward#0"), outs["q_proj"]) and not torch.equal(outs["q_proj"].reshape(2, 24), out)


_TP_SCRIPT = r"""
import os, sys, json
import numpy as np, torch, torch.distributed as dist, torch.multiprocessing as mp
from hooks import capture
from accuracy.bundle import Bundle

class RowParallel(torch.nn.Module):  # Megatron's RowParallelLinear: bias-free mm, then an in-place all-reduce
    def __init__(self):
        super().__init__(); self.w = torch.nn.Parameter(torch.randn(6, 8))
    def forward(self, x):
        y = torch.nn.functional.linear(x, self.w)
        dist.all_reduce(y)
        return y

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.proj = RowParallel()
    def forward(self, x): return self.proj(x)

def main(rank, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    m, x = Net(), torch.randn(2, 3, 8)
    path = f"{out}/tp_{rank}.bundle"
    with torch.no_grad(), capture(m, path, level="aten", mode="full", progress=False) as cap:
        y = m(x)
    b = Bundle.open(cap.bundle_path)  # tp_{rank}.rank{rank}.bundle: one bundle per rank
    got = {r.id: np.array(b.record_values(r.id)).ravel()[:4].tolist() for r in b.records if r.tensor}
    json.dump({"y": y.ravel()[:4].tolist(), "records": got, "skipped": b.manifest.skipped_ops},
              open(f"{out}/tp_{rank}.json", "w"))
    dist.barrier()  # no rank tears its gloo pairs down while a peer still uses them
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""


def test_an_in_place_all_reduce_is_not_mistaken_for_the_mm_it_overwrote(tmp_path: Path) -> None:
    """c10d's in-place collectives declare no mutation and complete asynchronously: the module
    output after the all-reduce holds the reduced values, not the local mm's; the all-reduce itself
    is recorded once it has landed (hooks.distributed)."""
    import json
    import subprocess
    import sys

    from api.server import free_port

    script = tmp_path / "tp.py"
    script.write_text(_TP_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, str(script), str(free_port()), str(tmp_path)], capture_output=True,
                       text=True, timeout=240, cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"tp_{rank}.json").read_text())
        recs = got["records"]
        assert np.allclose(recs["proj/forward#0"], got["y"]) and np.allclose(recs["/forward#0"], got["y"])
        assert not np.allclose(recs["proj/aten.mm#0"], got["y"])  # the local partial sum
        assert np.allclose(recs["proj/c10d.allreduce_#0"], got["y"])


def test_records_sharing_stored_tensors_are_measured_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module records that name the ``mm`` tensor get that pair's metrics, measured once: equal
    values (an fp64 check of the largest error), each record its own copy."""
    import sys

    from accuracy.compare import compare

    torch.manual_seed(0)
    model, x = Proj(), torch.randn(2, 5, 16)
    _, _, ref = _capture(model, x, tmp_path / "ref.bundle")
    with torch.no_grad():
        model.lin.weight.mul_(1.01)
    out, _, tgt = _capture(model, x, tmp_path / "tgt.bundle")
    module = sys.modules["accuracy.judging"]  # where pairs are measured
    calls: list[tuple[int, int]] = []  # every measurement: alone (compare_arrays) or queued in a batch
    real, queue = module.compare_arrays, PairBatch.add

    def add(batch: PairBatch, r: tuple[int, int, str], t: tuple[int, int, str], *a: object) -> bool:
        queued = queue(batch, r, t, *a)
        if queued:
            calls.append((r[1] // 4, t[1] // 4))  # float32 on both sides: 4 bytes an element
        return queued

    monkeypatch.setattr(module, "compare_arrays", lambda r, t, *a, **k: calls.append((r.size, t.size)) or real(r, t, *a, **k))
    monkeypatch.setattr(PairBatch, "add", add)
    results = {op.id: op for op in compare(ref, tgt).ops}
    mm, lin, top = results["lin/aten.mm#0"], results["lin/forward#0"], results["/forward#0"]
    assert calls == [(80, 80)]  # one stored tensor pair: one measurement
    assert mm.metrics is not None and mm.metrics == lin.metrics == top.metrics
    assert mm.metrics is not lin.metrics and lin.metrics is not top.metrics
    expected = (_values(tgt, "lin/aten.mm#0").double() - _values(ref, "lin/aten.mm#0").double()).abs().max()
    assert mm.metrics.max_abs == pytest.approx(float(expected), rel=1e-6) and mm.metrics.max_abs > 0
    assert torch.equal(_values(tgt, "/forward#0"), out)
