"""Compare two multi-rank runs: pair their bundles by rank, compare each pair, name the first divergence.

A multi-rank run is a set of bundles, one per rank, each with ``run["distributed"]`` (rank and
world size; see ``hooks.distributed``). A set is given as a folder holding them, as the base name
the ranks were written from (``run.bundle`` for ``run.rank0.bundle``, ``run.rank1.bundle`` …),
or as a path with ``{rank}`` or ``*`` in it. Each rank is compared with :func:`accuracy.compare`;
the run's first divergence is the earliest one in execution order over all ranks (ranks run the
same program, so a fault on one rank shows there first and reaches the others only through a
collective, later).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accuracy.bundle import Bundle
from accuracy.compare import ComparisonReport, OpResult, compare
from accuracy.errors import OpbandError
from accuracy.verdicts import Verdict, worst_verdict

PathLike = str | os.PathLike[str]


@dataclass
class RankComparison:
    """One report for a multi-rank comparison. Truthy when no rank failed."""

    world_size: int
    reports: dict[int, ComparisonReport]  # by rank
    first_divergence: tuple[int, OpResult] | None  # (rank, op)
    verdict: Verdict

    def __bool__(self) -> bool:
        return self.verdict != Verdict.FAIL


def is_rank_set(path: PathLike) -> bool:
    """Whether ``path`` names a multi-rank run rather than one bundle file."""
    p = Path(path)
    if p.is_dir() or "{rank}" in str(p) or glob.has_magic(str(p)):
        return True
    return not p.exists() and bool(_siblings(p))


def _siblings(p: Path) -> list[Path]:
    pattern = re.compile(re.escape(p.stem) + r"\.rank\d+" + re.escape(p.suffix) + "$")
    folder = p.parent if str(p.parent) else Path(".")
    return sorted(q for q in folder.glob(f"{glob.escape(p.stem)}.rank*{p.suffix}") if pattern.match(q.name)) \
        if folder.is_dir() else []


def open_rank_set(path: PathLike) -> dict[int, Bundle]:
    """The bundles of a multi-rank run by rank; refuses a set with missing, repeated or foreign ranks."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.bundle"))
    elif "{rank}" in str(p) or glob.has_magic(str(p)):
        files = sorted(Path(f) for f in glob.glob(str(p).replace("{rank}", "*")))
    else:
        files = _siblings(p)
    if not files:
        raise OpbandError(f"{path}: no rank bundles found (expected e.g. {p.stem}.rank0{p.suffix or '.bundle'}, "
                          "a folder of them, or a pattern with {rank})")
    by_rank: dict[int, Bundle] = {}
    sizes: set[int] = set()
    for f in files:
        b = Bundle.open(f)
        info = b.manifest.run.get("distributed")
        if not isinstance(info, Mapping) or not isinstance(info.get("rank"), int):
            raise OpbandError(f"{f} was not captured under torch.distributed (no run.distributed.rank): "
                              "a rank set holds only the bundles of one multi-rank run")
        if info["rank"] in by_rank:
            raise OpbandError(f"{f} and {by_rank[info['rank']].path} are both rank {info['rank']}: "
                              "keep one multi-rank run per folder or name")
        by_rank[info["rank"]] = b
        sizes.add(int(info.get("world_size", 0)))
    if len(sizes) != 1:
        raise OpbandError(f"{path}: bundles of different world sizes {sorted(sizes)}: one run per set")
    world = sizes.pop()
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        raise OpbandError(f"{path}: world size {world} but no bundle for rank(s) {missing}")
    return dict(sorted(by_rank.items()))


def compare_ranks(reference: PathLike | Mapping[int, Bundle], target: PathLike | Mapping[int, Bundle],
                  **options: Any) -> RankComparison:
    """Compare two multi-rank runs rank by rank (``options`` go to :func:`accuracy.compare`)."""
    refs = dict(reference) if isinstance(reference, Mapping) else open_rank_set(reference)
    tgts = dict(target) if isinstance(target, Mapping) else open_rank_set(target)
    if set(refs) != set(tgts):
        raise OpbandError(f"the reference has ranks {sorted(refs)} and the target {sorted(tgts)}: compare runs "
                          "of the same world size (each rank's tensors are that rank's shard)")
    reports = {r: compare(refs[r], tgts[r], **options) for r in sorted(refs)}
    firsts = [(rep.first_divergence.index, r, rep.first_divergence) for r, rep in reports.items()
              if rep.first_divergence is not None]
    first = min(firsts, key=lambda x: (x[0], x[1])) if firsts else None
    return RankComparison(world_size=len(refs), reports=reports,
                          first_divergence=(first[1], first[2]) if first else None,
                          verdict=worst_verdict([rep.verdict for rep in reports.values()]))
