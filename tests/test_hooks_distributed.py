"""Multi-rank runs: real processes in a gloo group, one bundle per rank, rank pairing in compare.

A 2-rank tensor-parallel MLP (column/row split, one all-reduce) and a 4-rank data-parallel
training step are captured twice, the second time with a faulty activation on one rank. The
comparison must pair ranks, put the first divergence on the faulty rank (with op and input
shapes), and see the other ranks diverge only after the collective that carried the error.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from accuracy.bundle import Bundle
from accuracy.errors import OpbandError
from accuracy.ranks import compare_ranks, is_rank_set, open_rank_set
from accuracy.report import ranks_to_dict, ranks_to_text

import distributed_workers as workers


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn, world: int, out: Path, fault_rank: int) -> None:  # type: ignore[no-untyped-def]
    mp.start_processes(fn, args=(world, _port(), str(out), fault_rank), nprocs=world, start_method="spawn")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    _spawn(workers.tensor_parallel, 2, out, fault_rank=1)
    return out


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp")
    _spawn(workers.data_parallel_step, 4, out, fault_rank=2)
    return out


def test_each_rank_writes_its_bundle_with_rank_in_manifest(tp_run: Path) -> None:
    assert sorted(p.name for p in tp_run.iterdir()) == ["ref.rank0.bundle", "ref.rank1.bundle",
                                                         "tgt.rank0.bundle", "tgt.rank1.bundle"]
    for r in (0, 1):
        run = Bundle.open(tp_run / f"ref.rank{r}.bundle").manifest.run
        assert run["distributed"] == {"rank": r, "world_size": 2, "backend": "gloo"}


def test_collective_recorded_after_it_landed(tp_run: Path) -> None:
    """The all-reduce record holds the sum over ranks: rank 0's value equals rank 1's, and equals
    the sum of the two fc2 partial outputs recorded before it."""
    b = [Bundle.open(tp_run / f"ref.rank{r}.bundle") for r in (0, 1)]
    ar = [x.record_values("/c10d.allreduce_#0") for x in b]
    part = [x.record_values("fc2/forward#0") for x in b]
    assert ar[0] is not None and ar[1] is not None and part[0] is not None and part[1] is not None
    assert (ar[0] == ar[1]).all()
    assert abs(ar[0] - (part[0] + part[1])).max() < 1e-6
    assert abs(part[0] - part[1]).max() > 1e-3  # the shards really differ


def test_tensor_parallel_fault_is_localized_to_its_rank(tp_run: Path) -> None:
    assert is_rank_set(tp_run / "ref.bundle") and not is_rank_set(tp_run / "ref.rank0.bundle")
    rc = compare_ranks(tp_run / "ref.bundle", tp_run / "tgt.bundle")
    assert rc.verdict == "fail" and rc.world_size == 2
    rank, op = rc.first_divergence  # type: ignore[misc]
    # the faulty kernel runs an extra op (mul) before silu: the ops no longer pair, the module boundary does
    assert rank == 1 and op.module == "act" and op.shape_signature == "4x16", op.id
    # rank 0 ran no faulty op: it diverges first at the all-reduce that brings rank 1's error
    r0 = rc.reports[0].first_divergence
    assert r0 is not None and r0.op == "c10d.allreduce_" and r0.index > op.index
    text = ranks_to_text(rc)
    assert f"FAILED | first divergence: rank 1, {op.id} (" in text and "module act," in text and "input shapes 4x16" in text
    d = ranks_to_dict(rc)
    assert d["first_divergence"]["rank"] == 1 and set(d["ranks"]) == {"0", "1"}


def test_data_parallel_step_fault_is_localized(dp_run: Path) -> None:
    refs = open_rank_set(dp_run / "ref.bundle")
    assert sorted(refs) == [0, 1, 2, 3]
    assert any(r.kind == "grad" for r in refs[0].records)
    rc = compare_ranks(dp_run / "ref.rank{rank}.bundle", dp_run / "tgt.bundle")
    rank, op = rc.first_divergence  # type: ignore[misc]
    assert rank == 2 and op.module == "act" and op.shape_signature == "6x16", op.id
    for r in (0, 1, 3):  # healthy ranks: forward identical, then the all-reduced gradients carry rank 2's error
        rep = rc.reports[r]
        fwd = [o for o in rep.ops if o.kind == "module" and o.op == "forward"]
        assert fwd and all(o.verdict == "pass" for o in fwd)
        assert rep.first_divergence is not None and rep.first_divergence.op == "c10d.allreduce_"
        assert rep.first_divergence.index > op.index


def test_cli_compares_rank_sets(dp_run: Path, tmp_path: Path) -> None:
    opband = str(Path(sys.executable).parent / "opband")
    r = subprocess.run([opband, "compare", str(dp_run / "ref.bundle"), str(dp_run / "tgt.bundle"),
                        "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "4 ranks" in r.stdout and "first divergence: rank 2" in r.stdout
    assert '"world_size": 4' in (tmp_path / "r.json").read_text()


def test_rank_sets_that_do_not_pair_are_refused(tp_run: Path, dp_run: Path) -> None:
    with pytest.raises(OpbandError, match=r"ranks \[0, 1\] and the target \[0, 1, 2, 3\]"):
        compare_ranks(tp_run / "ref.bundle", dp_run / "ref.bundle")
    with pytest.raises(OpbandError, match="no rank bundles found"):
        open_rank_set(tp_run / "nothing.bundle")
    only_one = tp_run.parent / "one"
    only_one.mkdir(exist_ok=True)
    (only_one / "a.rank1.bundle").write_bytes((tp_run / "ref.rank1.bundle").read_bytes())
    with pytest.raises(OpbandError, match=r"no bundle for rank\(s\) \[0\]"):
        open_rank_set(only_one)
