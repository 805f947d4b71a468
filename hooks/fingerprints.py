"""Fingerprints of a run's model inputs and of each parameter and buffer, for the manifest.

``accuracy.fingerprints`` compares them: different inputs make two runs incomparable, different
parameters are a finding that names the module. A fingerprint is a digest of the tensor's bytes
(CPU tensors; on an accelerator the weights are not copied to the host) plus float64 sum, L2 norm
and absmax, which still compare across an honest dtype cast.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import xxhash
from torch.utils._pytree import tree_flatten_with_path, keystr

from accuracy import fused
from accuracy.manifest import TensorPrint
from hooks.tensors import _KERNEL_DTYPES, tensor_dtype_name


def tensor_print(t: torch.Tensor) -> TensorPrint | None:
    """The fingerprint of one dense tensor (None for quantized, sparse, nested or meta tensors)."""
    with torch.no_grad():
        return _print(t)


def _print(t: torch.Tensor) -> TensorPrint | None:
    """:func:`tensor_print`, under ``no_grad`` already."""
    if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested:
        return None
    data = t.detach().resolve_conj().resolve_neg()
    digest = ""  # on an accelerator the statistics alone (no copy of the weights to the host)
    cpu = data.is_cpu
    if cpu:
        data = data.contiguous()
        if data.dtype in _KERNEL_DTYPES and data.numel():
            return _kernel_print(t, data)
        raw = data.reshape(-1).view(torch.uint8).numpy().data if data.numel() else b""
        digest = xxhash.xxh3_128_hexdigest(raw)  # ~35 GB/s here; blake2b's 0.4 GB/s cost a forward pass
    if data.is_complex():
        data = torch.view_as_real(data)
    if not data.is_floating_point():
        data = data.to(torch.float64)
    total = float(torch.sum(data, dtype=torch.float64)) if data.numel() else 0.0
    nonfinite = 0
    if not math.isfinite(total):
        finite = torch.isfinite(data)
        nonfinite = int(data.numel() - int(finite.sum()))
        data = data[finite]
        total = float(torch.sum(data, dtype=torch.float64)) if data.numel() else 0.0
    empty = data.numel() == 0
    return TensorPrint(shape=list(t.shape), dtype=tensor_dtype_name(t), digest=digest, sum=total,
                       l2=0.0 if empty else float(torch.linalg.vector_norm(data, dtype=torch.float64)),
                       absmax=0.0 if empty else float(data.abs().max()), nonfinite=nonfinite)


#: Bytes hashed and then summarised at a time: the statistics read them back from the core's cache,
#: so a weight costs one trip over memory, not two (llama-mid's 138 MB of weights: 8.1-8.9 -> 6.2 ms).
#: A whole number of the statistics kernel's blocks for every element size.
CHUNK_BYTES = 256 << 10
assert CHUNK_BYTES % (fused.STATS_BLOCK * 8) == 0


def _kernel_print(t: torch.Tensor, data: torch.Tensor) -> TensorPrint:
    """The fingerprint of a non-empty contiguous CPU float tensor: its xxh3-128 digest and sum, L2
    and absmax over its finite values, in one walk of :data:`CHUNK_BYTES` chunks, each hashed
    (streamed: the digest of the whole) and then summarised by ``accuracy.fused``'s statistics
    kernel, by address, continuing one head (the numbers a single pass gives)."""
    raw = data.reshape(-1).view(torch.uint8).numpy().data
    more = fused.MORE_AT[_KERNEL_DTYPES[data.dtype]]
    head = fused.empty_head()
    hasher = xxhash.xxh3_128()
    addr, nbytes, item = data.data_ptr(), raw.nbytes, data.element_size()
    for start in range(0, nbytes, CHUNK_BYTES):
        stop = min(start + CHUNK_BYTES, nbytes)
        hasher.update(raw[start:stop])
        more(addr + start, (stop - start) // item, head)
    digest = hasher.hexdigest()
    lo, hi, total, squares = float(head[0]), float(head[1]), float(head[2]), float(head[3])
    nonfinite, count = int(head[4] + head[5]), int(head[7])
    mean = total / max(count, 1)  # sum as mean x count: the value earlier opbands stored
    return TensorPrint(shape=list(t.shape), dtype=tensor_dtype_name(t), digest=digest, sum=mean * count,
                       l2=math.sqrt(squares), absmax=max(-lo, hi) if count else 0.0, nonfinite=nonfinite)


def input_prints(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, TensorPrint]:
    """Fingerprints of every tensor among a call's arguments, named ``arg0``, ``input_ids``, ``x[1]`` …"""
    out: dict[str, TensorPrint] = {}
    leaves, _ = tree_flatten_with_path((args, kwargs))
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            fp = tensor_print(leaf)
            if fp is not None:
                out[_name(path)] = fp
    return out


def _name(path: tuple[Any, ...]) -> str:
    """``((SequenceKey(0), SequenceKey(1)) -> arg1``, ``(SequenceKey(1), MappingKey('input_ids')) -> input_ids``."""
    head, rest = path[0], path[1:]
    if not rest:
        return "args"
    first, tail = rest[0], rest[1:]
    name = f"arg{first.idx}" if head.idx == 0 else str(getattr(first, "key", first))
    return name + (keystr(tail) if tail else "")


def parameter_prints(model: torch.nn.Module) -> dict[str, TensorPrint]:
    """Fingerprints of the model's parameters and buffers, by their dotted names."""
    out: dict[str, TensorPrint] = {}
    with torch.no_grad():
        for name, t in _parameters_and_buffers(model):
            try:
                fp = _print(t)
            except (RuntimeError, TypeError):  # a tensor subclass that cannot be read: not fingerprinted
                fp = None
            if fp is not None:
                out[name] = fp
    return out


def _parameters_and_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``list(model.named_parameters()) + list(model.named_buffers())`` in one walk of the modules
    (each walk costs ~1 us per module): the same names, order and de-duplication. A model that
    overrides either method (FSDP renames parameters) is asked as before."""
    cls = type(model)
    if cls.named_parameters is not torch.nn.Module.named_parameters or cls.named_buffers is not torch.nn.Module.named_buffers:
        return list(model.named_parameters()) + list(model.named_buffers())
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    seen_params: set[torch.Tensor] = set()
    seen_buffers: set[torch.Tensor] = set()
    for prefix, module in model.named_modules():
        dot = prefix + "." if prefix else ""
        for members, seen, found in ((module._parameters, seen_params, params), (module._buffers, seen_buffers, buffers)):
            for key, value in members.items():
                if value is None or value in seen:
                    continue
                seen.add(value)
                found.append((dot + key, value))
    return params + buffers
