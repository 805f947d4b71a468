"""Multi-rank captures under ``torch.distributed``: one bundle per rank.

Each rank writes its own bundle; its manifest's ``run["distributed"]`` holds the rank, world size
and backend, and the default file name carries the rank (``run.bundle`` -> ``run.rank1.bundle``,
or wherever ``{rank}`` appears in the path). c10d collectives (``dist.all_reduce`` …) are
recorded once their result has landed: the capture waits on the collective's ``Work`` right
after the op is issued (the values are those the user's own ``wait()`` would see; only the
overlap of communication with later compute is lost while capturing).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_RANK_SUFFIX = re.compile(r"\.rank(\d+)$")


def rank_info() -> dict[str, Any] | None:
    """``{"rank", "world_size", "backend", "local_rank"}`` inside an initialized process group, else None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    info: dict[str, Any] = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                            "backend": str(dist.get_backend())}
    if "LOCAL_RANK" in os.environ:
        info["local_rank"] = int(os.environ["LOCAL_RANK"])
    return info


def rank_path(path: Path, info: dict[str, Any] | None) -> Path:
    """The bundle path of this rank: ``{rank}`` in ``path`` replaced, else ``.rankN`` before the suffix
    (unless the name already ends in ``.rankN``). Unchanged outside a multi-rank run."""
    if info is None or info["world_size"] < 2:
        return path
    if "{rank}" in str(path):
        return Path(str(path).replace("{rank}", str(info["rank"])))
    if _RANK_SUFFIX.search(path.stem):
        return path
    return path.with_name(f"{path.stem}.rank{info['rank']}{path.suffix}")


def landed(out: Any) -> list[torch.Tensor]:
    """The tensors a c10d collective wrote, after waiting on its ``Work`` (gloo, NCCL …); none
    when the wait fails (the user's own ``wait()`` then raises the same error)."""
    try:
        for o in tree_leaves(out):
            if isinstance(o, torch.ScriptObject):
                torch._C._distributed_c10d.Work.unbox(o).wait()
    except Exception:  # noqa: BLE001 - capture must never break the user's run
        return []
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
