"""A fused one-pass statistics kernel for CPU tensors, compiled on first use with the system C compiler.

``torch`` has no reduction that returns min, max, sum, sum of squares and the zero count of a
tensor in one read, so summarising it costs four or five passes (``aminmax`` alone runs at a fifth
of ``sum``'s speed). This module compiles a ~100-line C loop (``#pragma omp simd`` reductions,
``-O3 -march=native``, no ``-ffast-math``: NaN and signed zeros keep IEEE semantics) into a shared
library cached under ``$OPBAND_CACHE_DIR`` (default ``~/.cache/opband``; ``$TMPDIR/opband-UID``
only when that is not writable), keyed by the source, the compiler and the CPU, and calls it through :mod:`ctypes` (which releases the GIL). Large
tensors are split over ``torch.get_num_threads()`` threads of the OpenMP pool torch itself runs on
(built with ``-fopenmp``, the library binds to the ``libgomp.so.1`` torch has loaded; separate
POSIX threads were slower: they compete with that pool's spinning workers). A cached library is
loaded only from a directory and file this user owns and nobody else can write (anything else is
rebuilt, in a fresh private temp dir when no cache qualifies); one that fails to load is rebuilt once.

Strictly optional: with no compiler, a failed build or ``OPBAND_CSTATS=0``, :func:`kernel`
returns None and :func:`hooks.tensors.host_stats` uses torch reductions instead. The kernel
only reads the tensor's memory; it never calls into torch, so it cannot change what a model
computes.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

#: Output layout: lo, hi, sum, sum of squares (over finite values), NaN, Inf, zero and finite counts, then samples.
N_HEAD = 8
#: Elements per thread below which the kernel runs on the calling thread only.
MIN_PER_THREAD = 1 << 16

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define BLOCK 2048

typedef struct { double lo, hi, sum, sumsq, bad, zeros; } part_t;

static void part_f32(const float *x, int64_t n, part_t *p) {
    double S = 0, Q = 0; float lo = INFINITY, hi = -INFINITY; int64_t Z = 0, B = 0;
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t e = b + BLOCK < n ? b + BLOCK : n;
        float s = 0, q = 0, l = INFINITY, h = -INFINITY; int32_t z = 0;
        #pragma omp simd reduction(+:s,q,z) reduction(min:l) reduction(max:h)
        for (int64_t i = b; i < e; i++) {
            float v = x[i];
            s += v; q += v * v;
            l = v < l ? v : l; h = v > h ? v : h;
            z += (v == 0.0f);
        }
        /* An Inf is the block's min or max (an all-NaN block leaves them infinite too). A NaN, which
           the comparisons skip, makes the sum NaN; so can an overflow: the float64 sums tell which. */
        int bad = isinf(l) || isinf(h);
        if (!bad && !(fabsf(s) <= 3.40282346638528859812e+38f && q <= 3.40282346638528859812e+38f)) {
            double ds = 0, dq = 0;
            for (int64_t i = b; i < e; i++) { double v = x[i]; ds += v; dq += v * v; }
            if (ds != ds) bad = 1; else { s = 0; q = 0; S += ds; Q += dq; }
        }
        S += s; Q += q; lo = l < lo ? l : lo; hi = h > hi ? h : hi; Z += z; B += bad;
    }
    p->lo = lo; p->hi = hi; p->sum = S; p->sumsq = Q; p->bad = (double)B; p->zeros = (double)Z;
}

static void part_f64(const double *x, int64_t n, part_t *p) {
    double S = 0, Q = 0, lo = INFINITY, hi = -INFINITY; int64_t Z = 0, B = 0;
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t e = b + BLOCK < n ? b + BLOCK : n;
        double s = 0, q = 0, l = INFINITY, h = -INFINITY; int64_t z = 0;
        #pragma omp simd reduction(+:s,q,z) reduction(min:l) reduction(max:h)
        for (int64_t i = b; i < e; i++) {
            double v = x[i];
            s += v; q += v * v;
            l = v < l ? v : l; h = v > h ? v : h;
            z += (v == 0.0);
        }
        int bad = isinf(l) || isinf(h) || s != s;  /* as above; an overflow here goes the masked way */
        S += s; Q += q; lo = l < lo ? l : lo; hi = h > hi ? h : hi; Z += z; B += bad;
    }
    p->lo = lo; p->hi = hi; p->sum = S; p->sumsq = Q; p->bad = (double)B; p->zeros = (double)Z;
}

/* Non-finite values present: min/max/sums over the finite ones; NaN count in ->bad, finite count in ->cnt. */
typedef struct { double lo, hi, sum, sumsq, nan, cnt, zeros; } mpart_t;

#define MASKED(NAME, T, MAXV, FABS)                                                              \
static void NAME(const T *x, int64_t n, mpart_t *p) {                                            \
    double S = 0, Q = 0; T lo = INFINITY, hi = -INFINITY; int64_t Z = 0, N = 0, C = 0;          \
    for (int64_t b = 0; b < n; b += BLOCK) {                                                     \
        int64_t e = b + BLOCK < n ? b + BLOCK : n;                                               \
        double s = 0, q = 0; T l = INFINITY, h = -INFINITY; int64_t z = 0, nan = 0, c = 0;    \
        _Pragma("omp simd reduction(+:s,q,z,nan,c) reduction(min:l) reduction(max:h)")           \
        for (int64_t i = b; i < e; i++) {                                                        \
            T v = x[i];                                                                          \
            int fin = FABS(v) <= MAXV;                                                           \
            T f = fin ? v : (T)0;                                                                \
            s += f; q += (double)f * f; c += fin;  /* rare path: float64 sums, no overflow */     \
            l = (fin && v < l) ? v : l; h = (fin && v > h) ? v : h;                              \
            z += (v == (T)0);                                                                    \
            nan += (v != v);                                                                     \
        }                                                                                        \
        S += s; Q += q; lo = l < lo ? l : lo; hi = h > hi ? h : hi; Z += z; N += nan; C += c;    \
    }                                                                                            \
    p->lo = lo; p->hi = hi; p->sum = S; p->sumsq = Q; p->nan = (double)N; p->cnt = (double)C;    \
    p->zeros = (double)Z;                                                                        \
}
MASKED(masked_f32, float, 3.40282346638528859812e+38f, fabsf)
MASKED(masked_f64, double, 1.79769313486231570815e+308, fabs)

typedef struct { const char *x; int64_t n; int f64; int masked; part_t p; mpart_t m; } job_t;

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    if (j->masked) {
        if (j->f64) masked_f64((const double *)j->x, j->n, &j->m); else masked_f32((const float *)j->x, j->n, &j->m);
    } else {
        if (j->f64) part_f64((const double *)j->x, j->n, &j->p); else part_f32((const float *)j->x, j->n, &j->p);
    }
    return 0;
}

#define MAX_THREADS 64

static int run_all(const void *data, int64_t n, int f64, int masked, int threads, job_t *jobs) {
    if (n <= 0) return 0;  /* no chunks: the divisions below need n > 0 */
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t size = f64 ? 8 : 4, chunk = (n + threads - 1) / threads;
    chunk = (chunk + BLOCK - 1) / BLOCK * BLOCK;
    int used = (int)((n + chunk - 1) / chunk);
    for (int t = 0; t < used; t++) {
        int64_t b = t * chunk;
        jobs[t].x = (const char *)data + b * size;
        jobs[t].n = b + chunk < n ? chunk : n - b;
        jobs[t].f64 = f64;
        jobs[t].masked = masked;
    }
    /* With -fopenmp this runs on the OpenMP pool torch already started (libgomp.so.1 is loaded once
       per process), so its spinning workers take the chunks; without it, serially. */
    #pragma omp parallel for num_threads(used) schedule(static, 1) if (used > 1)
    for (int t = 0; t < used; t++) run_job(&jobs[t]);
    return used;
}

/* out[0..7] = lo, hi, sum, sumsq, nan, inf, zeros, finite count (min/max/sums over finite values);
   out[8..8+k) = x[idx[i]]. Partial results are combined in a fixed order: the result depends on the
   thread count only. Values are read in one pass, plus a second, masked one when any is non-finite. */
int opband_stats(const void *data, int64_t n, int f64, int threads, const int64_t *idx, int64_t k, double *out) {
    job_t jobs[MAX_THREADS];
    int used = run_all(data, n, f64, 0, threads, jobs);
    part_t r = {INFINITY, -INFINITY, 0, 0, 0, 0};
    for (int t = 0; t < used; t++) {
        part_t *p = &jobs[t].p;
        r.lo = p->lo < r.lo ? p->lo : r.lo; r.hi = p->hi > r.hi ? p->hi : r.hi;
        r.sum += p->sum; r.sumsq += p->sumsq; r.bad += p->bad; r.zeros += p->zeros;
    }
    double nan = 0, cnt = (double)n;
    if (r.bad > 0) {
        used = run_all(data, n, f64, 1, threads, jobs);
        mpart_t m = {INFINITY, -INFINITY, 0, 0, 0, 0, 0};
        for (int t = 0; t < used; t++) {
            mpart_t *p = &jobs[t].m;
            m.lo = p->lo < m.lo ? p->lo : m.lo; m.hi = p->hi > m.hi ? p->hi : m.hi;
            m.sum += p->sum; m.sumsq += p->sumsq; m.nan += p->nan; m.cnt += p->cnt; m.zeros += p->zeros;
        }
        r.lo = m.lo; r.hi = m.hi; r.sum = m.sum; r.sumsq = m.sumsq; r.zeros = m.zeros;
        nan = m.nan; cnt = m.cnt;
    }
    out[0] = r.lo; out[1] = r.hi; out[2] = r.sum; out[3] = r.sumsq;
    out[4] = nan; out[5] = (double)n - cnt - nan; out[6] = r.zeros; out[7] = cnt;
    for (int64_t i = 0; i < k; i++)
        out[8 + i] = f64 ? ((const double *)data)[idx[i]] : (double)((const float *)data)[idx[i]];
    return used;
}
"""

_lock = threading.Lock()
_lib: Any = None
_tried = False
_error: str | None = None


def _cache_dir() -> Path:
    """The primary cache: ``$OPBAND_CACHE_DIR``, else ``$XDG_CACHE_HOME/opband``, else ``~/.cache/opband``.
    Raises (RuntimeError, KeyError) when the home directory cannot be determined."""
    env = os.environ.get("OPBAND_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "opband"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _fallback_dir() -> Path:
    """The per-user temp cache, used only when the primary one is not writable (or not private)."""
    return Path(tempfile.gettempdir()) / f"opband-{_uid()}"


def _private(st: os.stat_result, kind: int) -> bool:
    """``st`` (an ``lstat``, so a symlink fails) is a ``kind`` (S_IFDIR/S_IFREG) owned by this user
    that nobody else can write: what another local user could not have planted or changed."""
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == _uid() and not st.st_mode & 0o022


def _private_dir(path: Path) -> bool:
    try:
        return _private(os.lstat(path), stat.S_IFDIR)
    except OSError:
        return False


def _private_file(path: Path) -> bool:
    try:
        return _private(os.lstat(path), stat.S_IFREG)
    except OSError:
        return False


def _usable_dir(path: Path) -> bool:
    """Create ``path`` (mode 0o700) if needed; True when it is a private directory this user can write."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return _private_dir(path) and os.access(path, os.W_OK | os.X_OK)


def _cache_dirs() -> list[Path]:
    """Where the library may be cached, best first: the primary cache when it is usable, else the
    per-user temp dir when that is. Empty: build into a fresh private directory."""
    try:
        primary: Path | None = _cache_dir()
    except (RuntimeError, KeyError, OSError):  # HOME unset and no passwd entry
        primary = None
    dirs = [d for d in (primary, _fallback_dir()) if d is not None]
    usable = []
    for d in dirs:
        if _usable_dir(d):
            usable.append(d)
            if d == primary:
                break  # the temp dir only when the primary cache cannot be used
    return usable


def _cpu_id() -> str:
    """What ``-march=native`` depends on: a library built here must not be loaded on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _build(compiler: str, out: Path) -> None:
    src = out.with_suffix(".c")
    src.write_text(_SOURCE)
    base = [compiler, "-O3", "-fPIC", "-shared", "-o", str(out), str(src)]
    wide = ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []  # AVX-512 where present
    tries = (["-march=native", *wide, "-fopenmp"], ["-march=native", "-fopenmp"], ["-march=native", "-fopenmp-simd"],
             ["-fopenmp-simd"], [])
    attempts = [base[:2] + flags + base[2:] for flags in tries]
    err = ""
    for cmd in attempts:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if r.returncode == 0:
            return
        err = r.stderr[-500:]
    raise RuntimeError(f"compiling the statistics kernel failed: {err}")


def _install(compiler: str, cache: Path, name: str) -> Path:
    """Build the library into the private directory ``cache`` as ``name`` (atomically)."""
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # mode 0o700
        built = Path(tmp) / "cstats.so"
        _build(compiler, built)
        os.chmod(built, 0o700)  # whatever the umask: never group/world-writable
        os.replace(built, cache / name)  # atomic: concurrent builders each install a whole file
    return cache / name


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _open_cached(cache: Path, name: str, compiler: str) -> Any:
    """Load ``cache/name``: the cached file when it is private and loads, else a fresh build (once)."""
    path = cache / name
    if os.path.lexists(path):
        if _private_file(path):
            try:
                return ctypes.CDLL(str(path))
            except OSError:  # corrupt, truncated or built for something else: rebuild it once
                pass
        _unlink(path)  # unloadable, or not provably this user's own: never load it
    path = _install(compiler, cache, name)
    if not _private_file(path):
        raise RuntimeError(f"{path} changed owner or mode after it was built")
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:  # rebuilt and still unloadable: fall back to torch
        raise RuntimeError(f"the rebuilt statistics kernel {path} does not load: {e}") from e


def _open(name: str, compiler: str) -> Any:
    """The loaded library, built and cached on first use (see :func:`_cache_dirs`); with no usable
    cache, built into a fresh private temp dir that is removed once loaded (dlopen keeps the mapping)."""
    err: Exception | None = None
    for cache in _cache_dirs():
        try:
            return _open_cached(cache, name, compiler)
        except OSError as e:  # could not build or install here (read-only, full): try the next place
            err = e
    tmp = tempfile.mkdtemp(prefix="opband-cstats-")  # mode 0o700, a name nobody could predict
    try:
        path = Path(tmp) / name
        _build(compiler, path)
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise RuntimeError(f"the statistics kernel does not build or load (cache: {err}): {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _lib_name(compiler: str) -> str:
    digest = hashlib.sha256("\0".join([_SOURCE, compiler, platform.machine(), _cpu_id()]).encode())
    return f"cstats-{digest.hexdigest()[:16]}.so"


def load() -> Any:
    """The compiled library (built and cached on first use), or None when it is unavailable."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("OPBAND_CSTATS", "1") == "0":
                raise RuntimeError("disabled by OPBAND_CSTATS=0")
            if sys.platform == "win32":
                raise RuntimeError("not built on Windows")
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
            if not compiler:
                raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
            lib = _open(_lib_name(compiler), compiler)
            fn = lib.opband_stats
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _lib = lib
        except Exception as e:  # noqa: BLE001 - the torch path is always there
            _error = f"{type(e).__name__}: {e}"
            _lib = None
        _tried = True
        return _lib


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when the kernel is loaded or not tried yet)."""
    return _error


def reset() -> None:
    """Forget the loaded library (tests: force a rebuild or the torch path)."""
    global _lib, _tried, _error
    with _lock:
        _lib, _tried, _error = None, False, None


_OUT_LEN = N_HEAD + 64
_out_type = ctypes.c_double * _OUT_LEN


def fused(x: torch.Tensor, idx: torch.Tensor) -> list[float] | None:
    """``[lo, hi, sum, sumsq, nan, inf, zeros, finite, *x[idx]]`` of a contiguous 1-D float32/float64
    CPU tensor (min, max and sums over the finite values), or None when the kernel is unavailable.
    ``idx``: int64 CPU indices. One pass over memory, two when a value is non-finite."""
    lib = _lib if _tried else load()
    if lib is None:
        return None
    n = x.numel()
    k = idx.numel()
    if k > _OUT_LEN - N_HEAD:
        return None  # more samples than the output buffer holds: the caller uses torch
    if n == 0:  # nothing to read (and no valid index): the kernel's empty result, without calling it
        return None if k else [math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    out = _out_type()
    threads = max(1, min(torch.get_num_threads(), n // MIN_PER_THREAD, 64))
    lib.opband_stats(x.data_ptr(), n, int(x.dtype == torch.float64), threads, idx.data_ptr(), k, out)
    return out[: N_HEAD + k]
