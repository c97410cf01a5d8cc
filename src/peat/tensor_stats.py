"""Per-step summary statistics of a tensor (mean, std, min, max, absmax, non-finite count).

The Profiler summarises every layer's activation, weight and weight gradient at every step,
so these statistics are on the hot path of golden training. With torch ops they take at least
three passes over memory (a sum, a norm, ``aminmax``). On CPU, one pass of a small C loop
computes them all: it is compiled on first use with the system C compiler (well under a second)
and cached by source hash. Without a compiler, or for tensors the loop does not take (not a
contiguous float32 CPU tensor, or one holding inf/NaN), the torch ops compute the same
statistics. Either path is deterministic: a fixed accumulation order, no threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

# Shifted sums (x - x[0]) keep the variance exact when |mean| >> std. LANES independent float
# accumulators let the compiler vectorise without reordering any one sum; each block of BLOCK
# elements is folded into double, so a lane never sums more than BLOCK / LANES values in float.
SOURCE = r"""
#include <stdint.h>
#define LANES 16
#define BLOCK 1024
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* AVX2 where the CPU has it (picked at load time); same lanes, same roundings as the default. */
__attribute__((target_clones("avx2", "default")))
#endif
void peat_moments(const float *x, int64_t n, double *out) {
    const float shift = n ? x[0] : 0.0f;
    float lo[LANES], hi[LANES];
    double total = 0.0, squares = 0.0;
    for (int j = 0; j < LANES; j++) lo[j] = hi[j] = shift;
    int64_t i = 0;
    while (i + LANES <= n) {
        float s[LANES] = {0}, q[LANES] = {0};
        int64_t end = i + BLOCK <= n ? i + BLOCK : n - (n - i) % LANES;
        for (; i < end; i += LANES) {
            for (int j = 0; j < LANES; j++) {
                float v = x[i + j], d = v - shift;
                s[j] += d;
                q[j] += d * d;
                lo[j] = v < lo[j] ? v : lo[j];
                hi[j] = v > hi[j] ? v : hi[j];
            }
        }
        for (int j = 0; j < LANES; j++) { total += s[j]; squares += q[j]; }
    }
    for (; i < n; i++) {
        float v = x[i];
        double d = (double)v - shift;
        total += d;
        squares += d * d;
        lo[0] = v < lo[0] ? v : lo[0];
        hi[0] = v > hi[0] ? v : hi[0];
    }
    float l = lo[0], h = hi[0];
    for (int j = 1; j < LANES; j++) { l = lo[j] < l ? lo[j] : l; h = hi[j] > h ? hi[j] : h; }
    out[0] = total; out[1] = squares; out[2] = l; out[3] = h; out[4] = shift;
}
"""
# -ffp-contract=off: no fused multiply-add, so every machine that runs this object rounds alike.
CFLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]
_LIB: list = []  # the loaded function, or None once compiling failed (loaded lazily, once)


def _cache_dir() -> Path:
    root = os.environ.get("PEAT_KERNEL_CACHE", Path.home() / ".cache" / "peat" / "kernels")
    return Path(root) / "tensor_stats"


def _build() -> Path:
    """The shared object for SOURCE, compiled once per source and flags (atomic: parallel jobs race safely)."""
    digest = hashlib.sha256((SOURCE + " ".join(CFLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"moments_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "moments.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([os.environ.get("CC", "cc"), *CFLAGS, "-o", str(built), str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def _moments_function():
    if not _LIB:
        try:
            func = ctypes.CDLL(str(_build())).peat_moments
            func.argtypes, func.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], None
        except (OSError, subprocess.SubprocessError):
            func = None  # no compiler or no writable cache: the torch ops do the work
        _LIB.append(func)
    return _LIB[0]


def compiled() -> bool:
    """Whether the one-pass C loop is in use (else the torch ops)."""
    return _moments_function() is not None


def stats_torch(t: torch.Tensor) -> torch.Tensor:
    """mean, std, min, max, absmax, non-finite count, as a float32 tensor on ``t``'s device."""
    t = t.detach().float()
    # sum and a norm are an order of magnitude faster than torch.std_mean on CPU.
    mean = t.sum() / t.numel()
    std = torch.linalg.vector_norm(t - mean) / max(t.numel() - 1, 1) ** 0.5
    lo, hi = torch.aminmax(t)
    absmax = torch.maximum(lo.abs(), hi.abs())
    # One cheap reduction in the common case: the sum of finite tensors is finite.
    bad = (~torch.isfinite(t)).sum().float() if not torch.isfinite(mean) else torch.zeros((), device=t.device)
    return torch.stack([mean, std, lo, hi, absmax, bad])


def stats(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """The six statistics of ``t``: a float64 numpy row from the C loop when it applies, else
    ``stats_torch(t)`` (a tensor, on ``t``'s device, so that callers can move many at once)."""
    func = _moments_function()
    t = t.detach()
    if func is None or t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() or not t.numel():
        return stats_torch(t)
    raw = np.empty(5)
    func(t.data_ptr(), t.numel(), raw.ctypes.data)
    total, squares, lo, hi, shift = raw
    if not np.isfinite(total + squares):  # inf/NaN inside (or float overflow): the torch ops say which
        return stats_torch(t)
    n = t.numel()
    mean = shift + total / n
    var = max(squares - total * total / n, 0.0) / max(n - 1, 1)
    return np.array([mean, var ** 0.5, lo, hi, max(abs(lo), abs(hi)), 0.0])
