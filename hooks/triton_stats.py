"""Summary statistics of a GPU tensor in two Triton kernels instead of ~25 torch ops.

:func:`hooks.tensors.device_stats` as torch ops launches about 25 kernels per tensor; on an H200 a
summary capture spent most of its time launching them (docs/capture.md). Here one kernel reads the tensor once, each program folding its tiles into
partials (count, mean and centred sum of squares combined by Chan's rule, sum of squares, min, max,
NaN, Inf and zero counts; float32 within a tile except the sum of squares, float64 across), and a one-program kernel merges
the partials and writes the same row as the torch path: numel, min, max, mean, std, l2, absmax,
nan, inf, zeros (over the finite values), then the sample at the same cached indices. No host sync.
A tensor of up to :data:`ONE_PROGRAM_MAX` elements (most of a model's activations) is read by one
program that writes the row itself: one launch, as Triton's Python launcher is most of what a
small tensor costs. Integer and bool tensors are read as float32, as the
torch path converts them.

Triton ships with every CUDA build of torch, so nothing is compiled at install; its JIT compiles
each kernel once per dtype at first use and caches it on disk. Where Triton is missing, or the
tensor is float64, complex or not on a CUDA device, ``device_stats`` keeps its torch path.
``TRITON_INTERPRET=1`` runs these kernels on CPU tensors (the tests do).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a CPU-only torch has none; a broken install: the torch path runs
    triton = None  # type: ignore[assignment]

#: Elements one program reads per tile, the most programs a tensor is split over, and the largest
#: tensor read by a single program (one launch; 1 MB of float32 is ~10 us of one SM's bandwidth, less
#: than a second launch costs the host).
BLOCK = 2048
MAX_PROGRAMS = 512
ONE_PROGRAM_MAX = 1 << 18
#: Partials per program: count, mean, centred sum of squares, sum of squares, min, max, nan, inf, zeros
_PARTS = 9
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
          torch.uint8, torch.bool)
#: Runtime integers a kernel is not recompiled for (Triton specialises ints that are 1 or multiples of
#: 16); the interpreter cannot loop over an unspecialised bound, so it specialises
_RUNTIME_INTS = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["n", "tiles", "programs", "picks", "size"]


def usable_for(values: torch.Tensor) -> bool:
    """Whether :func:`stats_row` takes ``values``: a plain tensor (no subclass: a FakeTensor or DTensor has
    no memory of its own to read) of one of :data:`DTYPES` on a CUDA device (or any device under the
    interpreter)."""
    if triton is None or values.dtype not in DTYPES or type(values) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return values.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _fold(x_ptr, n, first, tiles, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Partials of tiles ``first .. first + tiles - 1``: float32 within a tile (except the sum of
        squares: squares of |x| > 1.8e19 overflow float32), float64 across, count/mean/M2 by Chan's rule."""
        cnt = tl.full((), 0.0, tl.float64)
        mean = tl.full((), 0.0, tl.float64)
        m2 = tl.full((), 0.0, tl.float64)
        sq = tl.full((), 0.0, tl.float64)
        lo = tl.full((), float("inf"), tl.float32)
        hi = tl.full((), float("-inf"), tl.float32)
        nans = tl.full((), 0.0, tl.float64)
        infs = tl.full((), 0.0, tl.float64)
        zeros = tl.full((), 0.0, tl.float64)
        for t in range(0, tiles):
            offs = (tl.full((), 0, tl.int64) + first + t) * BLOCK + tl.arange(0, BLOCK)  # int64: > 2^31 elements
            inside = offs < n
            x = tl.load(x_ptr + offs, mask=inside, other=0).to(tl.float32)
            is_nan = x != x
            is_inf = tl.abs(x) == float("inf")
            fin = inside & ~is_nan & ~is_inf
            xf = tl.where(fin, x, 0.0)
            c = tl.sum(fin.to(tl.float32), axis=0)
            tile_mean = tl.sum(xf, axis=0) / tl.maximum(c, 1.0)
            d = tl.where(fin, x - tile_mean, 0.0)
            c64 = c.to(tl.float64)
            total = cnt + c64
            delta = tile_mean.to(tl.float64) - mean
            share = c64 / tl.maximum(total, 1.0)
            mean = mean + delta * share
            m2 = m2 + tl.sum(d * d, axis=0).to(tl.float64) + delta * delta * cnt * share
            cnt = total
            xd = xf.to(tl.float64)
            sq = sq + tl.sum(xd * xd, axis=0)
            lo = tl.minimum(lo, tl.min(tl.where(fin, x, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(fin, x, float("-inf")), axis=0))
            nans = nans + tl.sum((inside & is_nan).to(tl.float32), axis=0).to(tl.float64)
            infs = infs + tl.sum((inside & is_inf).to(tl.float32), axis=0).to(tl.float64)
            zeros = zeros + tl.sum((inside & (x == 0.0)).to(tl.float32), axis=0).to(tl.float64)
        return cnt, mean, m2, sq, lo.to(tl.float64), hi.to(tl.float64), nans, infs, zeros

    @triton.jit
    def _write_row(row_ptr, x_ptr, idx_ptr, picks, size, n, count, mean, m2, sq, lo, hi, nans, infs,  # type: ignore[no-untyped-def]
                   zeros, SAMPLE: tl.constexpr):
        """The row: numel, min, max, mean, std, l2, absmax, nan, inf, zeros, then the sample (zero-padded)."""
        tl.store(row_ptr, n.to(tl.float32))
        tl.store(row_ptr + 1, lo.to(tl.float32))
        tl.store(row_ptr + 2, hi.to(tl.float32))
        tl.store(row_ptr + 3, mean.to(tl.float32))
        tl.store(row_ptr + 4, tl.sqrt(m2 / tl.maximum(count, 1.0)).to(tl.float32))
        tl.store(row_ptr + 5, tl.sqrt(sq).to(tl.float32))
        tl.store(row_ptr + 6, tl.maximum(-lo, hi).to(tl.float32))
        tl.store(row_ptr + 7, nans.to(tl.float32))
        tl.store(row_ptr + 8, infs.to(tl.float32))
        tl.store(row_ptr + 9, zeros.to(tl.float32))
        s = tl.arange(0, SAMPLE)
        taken = s < picks
        where = tl.load(idx_ptr + s, mask=taken, other=0)
        sample = tl.load(x_ptr + where, mask=taken, other=0).to(tl.float32)
        tl.store(row_ptr + 10 + s, sample, mask=s < size)

    @triton.jit(do_not_specialize=_RUNTIME_INTS)
    def _one_program(x_ptr, idx_ptr, picks, row_ptr, size, n, tiles,  # type: ignore[no-untyped-def]
                     BLOCK: tl.constexpr, SAMPLE: tl.constexpr):
        cnt, mean, m2, sq, lo, hi, nans, infs, zeros = _fold(x_ptr, n, 0, tiles, BLOCK)
        _write_row(row_ptr, x_ptr, idx_ptr, picks, size, n, cnt, mean, m2, sq, lo, hi, nans, infs, zeros, SAMPLE)

    @triton.jit(do_not_specialize=_RUNTIME_INTS)
    def _partials(x_ptr, part_ptr, n, tiles, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        pid = tl.program_id(0)
        cnt, mean, m2, sq, lo, hi, nans, infs, zeros = _fold(x_ptr, n, pid * tiles, tiles, BLOCK)
        base = part_ptr + pid * 9
        tl.store(base, cnt)
        tl.store(base + 1, mean)
        tl.store(base + 2, m2)
        tl.store(base + 3, sq)
        tl.store(base + 4, lo)
        tl.store(base + 5, hi)
        tl.store(base + 6, nans)
        tl.store(base + 7, infs)
        tl.store(base + 8, zeros)

    @triton.jit(do_not_specialize=_RUNTIME_INTS)
    def _merge(part_ptr, programs, x_ptr, idx_ptr, picks, row_ptr, size, n,  # type: ignore[no-untyped-def]
               P: tl.constexpr, SAMPLE: tl.constexpr):
        p = tl.arange(0, P)
        live = p < programs
        at = part_ptr + p * 9
        c = tl.load(at, mask=live, other=0.0)
        means = tl.load(at + 1, mask=live, other=0.0)
        count = tl.sum(c, axis=0)
        mean = tl.sum(c * means, axis=0) / tl.maximum(count, 1.0)
        spread = means - mean
        m2 = tl.sum(tl.load(at + 2, mask=live, other=0.0) + c * spread * spread, axis=0)
        sq = tl.sum(tl.load(at + 3, mask=live, other=0.0), axis=0)
        lo = tl.min(tl.load(at + 4, mask=live, other=float("inf")), axis=0)
        hi = tl.max(tl.load(at + 5, mask=live, other=float("-inf")), axis=0)
        nans = tl.sum(tl.load(at + 6, mask=live, other=0.0), axis=0)
        infs = tl.sum(tl.load(at + 7, mask=live, other=0.0), axis=0)
        zeros = tl.sum(tl.load(at + 8, mask=live, other=0.0), axis=0)
        _write_row(row_ptr, x_ptr, idx_ptr, picks, size, n, count, mean, m2, sq, lo, hi, nans, infs, zeros, SAMPLE)


def stats_row(values: torch.Tensor, sample_index: torch.Tensor, sample_size: int) -> torch.Tensor:
    """``device_stats``'s float32 row of ``values`` (see :func:`usable_for`): one kernel launch up to
    :data:`ONE_PROGRAM_MAX` elements, two beyond.

    ``sample_index``: the cached flat indices of the sample (``min(sample_size, numel)`` of them, int64,
    on the same device); the row is padded with zeros beyond them. Launched on the current stream of
    the tensor's device (Triton launches on the current device: a tensor on another GPU switches to it)."""
    if values.is_cuda and values.device.index != torch.cuda.current_device():
        with torch.cuda.device(values.device):
            return _stats_row(values, sample_index, sample_size)
    return _stats_row(values, sample_index, sample_size)


def _stats_row(values: torch.Tensor, sample_index: torch.Tensor, sample_size: int) -> torch.Tensor:
    x = values.reshape(-1)
    if x.numel() > 1 and x.stride(0) != 1:  # a 1-D slice, a column, x[..., ::2], an expand: reshape keeps the view
        x = x.contiguous()
    n = x.numel()
    row = torch.empty(10 + sample_size, dtype=torch.float32, device=x.device)
    tiles_total = triton.cdiv(n, BLOCK)
    sample = triton.next_power_of_2(sample_size)
    if n <= ONE_PROGRAM_MAX:
        _one_program[(1,)](x, sample_index, sample_index.numel(), row, sample_size, n, tiles_total,
                           BLOCK=BLOCK, SAMPLE=sample)
        return row
    tiles = triton.cdiv(tiles_total, MAX_PROGRAMS)
    programs = triton.cdiv(tiles_total, tiles)
    part = torch.empty(programs * _PARTS, dtype=torch.float64, device=x.device)
    _partials[(programs,)](x, part, n, tiles, BLOCK=BLOCK)
    _merge[(1,)](part, programs, x, sample_index, sample_index.numel(), row, sample_size, n,
                 P=triton.next_power_of_2(programs), SAMPLE=sample)
    return row
