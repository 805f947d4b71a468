"""What each capture level is known to perturb, measured by ``tests/test_hooks_intrusive.py``.

``INTRUSIVE`` lists the op_db op names whose outputs were *not* bitwise identical with and
without capture at a level (CPU float32, torch 2.13); every manifest names them in
``run["intrusive_ops"]``. At ``aten`` level none: under any Python ``TorchDispatchMode``
``at::isTensorSubclassLike`` is true, so ``linalg_svdvals``/``linalg_eigvalsh`` (and ``linalg.cond``
and nuclear norms, which call them) would take their differentiable path and LAPACK would return
other bits; ``hooks.composites`` runs them as they run without the mode. ``api`` level (a TorchFunctionMode)
makes ``has_torch_function`` true, which turns off the fused inference fast path of
``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` (a module, not an op_db entry).

``PATH_CHANGES`` lists ops whose *leaf kernel sequence* (profiler) differs under the level's bare
mode while the result stays identical: mostly ``reshape`` decomposing to ``view`` instead of
``_reshape_alias`` under a Python dispatch mode.
"""

from __future__ import annotations

INTRUSIVE: dict[str, frozenset[str]] = {
    "module": frozenset(),
    "api": frozenset({"nn.TransformerEncoderLayer (fast path)", "nn.MultiheadAttention (fast path)"}),
    "aten": frozenset(),  # linalg.svdvals, linalg.cond, linalg.eigvalsh, norm.nuc: fixed by hooks.composites
}

PATH_CHANGES: dict[str, frozenset[str]] = {
    "module": frozenset(),
    "api": frozenset(),
    "aten": frozenset({
        "__rmatmul__", "cartesian_prod", "isclose", "linalg.eigvals", "linalg.eigvalsh", "linalg.matrix_rank.hermitian",
        "linalg.tensorinv", "matmul", "nanmean", "nanquantile", "nn.functional.ctc_loss", "nn.functional.embedding",
        "nn.functional.embedding_bag", "nn.functional.max_pool1d", "nn.functional.multi_head_attention_forward",
        "nn.functional.scaled_dot_product_attention", "pca_lowrank", "quantile", "svd_lowrank",
    }),
}


def intrusive_ops(level: str) -> list[str]:
    """Sorted names of the ops (and module fast paths) known to change results at ``level``."""
    return sorted(INTRUSIVE.get(level, frozenset()))
