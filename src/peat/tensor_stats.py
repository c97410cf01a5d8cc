"""Two hot per-tensor statistics, each one pass of a small C loop.

- ``stats``: the per-step summary of a tensor (mean, std, min, max, absmax, non-finite count).
  The Profiler summarises every layer's activation, weight and weight gradient at every step,
  so this is on the hot path of golden training. With torch ops it takes at least three passes
  over memory (a sum, a norm, ``aminmax``).
- ``bit_diff``: how a candidate's float32 bit patterns differ from golden's (bits per
  position, ULP distances, non-finite values). Playback scores every candidate tensor so;
  with numpy it takes a dozen passes and four byte histograms.

The loops are compiled on first use with the system C compiler (well under a second) and
cached by source hash. Without a compiler, or for tensors a loop does not take (``stats``: not
a contiguous float32 CPU tensor, or one holding inf/NaN), the callers' torch or numpy code
computes the same statistics (``bit_diff``'s integers exactly). Either path is deterministic:
a fixed accumulation order, no threads.
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

/* Candidate c against golden g (float32 bit patterns): out[b] counts elements whose bit b
   differs (through four byte histograms), out[32] differing elements, out[33] non-finite
   candidates where golden is finite, out[34] the largest ULP distance; ulp[i] gets element
   i's ULP distance (ordered patterns: a negative pattern -2^31 + L maps to -L). */
void peat_bitdiff(const int32_t *c, const int32_t *g, int64_t n, int golden_finite,
                  uint32_t *ulp, int64_t *out) {
    static const int32_t EXP = 0x7F800000;
    int64_t hist[4][256] = {{0}}, ndiff = 0, nonfinite = 0;
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t a = c[i], b = g[i];
        uint32_t x = (uint32_t)(a ^ b);
        int32_t sa = a >> 31, sb = b >> 31;  /* branch-free: signs are random in real tensors */
        int64_t d = (int64_t)((a ^ (sa & 0x7FFFFFFF)) - sa) - (int64_t)((b ^ (sb & 0x7FFFFFFF)) - sb);
        uint32_t u = (uint32_t)((d ^ (d >> 63)) - (d >> 63));
        ulp[i] = u;
        top = u > top ? u : top;
        if (x) {
            ndiff++;
            hist[0][x & 255]++; hist[1][(x >> 8) & 255]++; hist[2][(x >> 16) & 255]++; hist[3][x >> 24]++;
        }
        if ((a & EXP) == EXP && (golden_finite || (b & EXP) != EXP)) nonfinite++;
    }
    for (int k = 0; k < 4; k++)
        for (int v = 1; v < 256; v++)
            for (int bit = 0; bit < 8; bit++)
                if ((v >> bit) & 1) out[8 * k + bit] += hist[k][v];
    out[32] = ndiff; out[33] = nonfinite; out[34] = top;
}
"""
# -ffp-contract=off: no fused multiply-add, so every machine that runs this object rounds alike.
CFLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]
_LIB: list = []  # the loaded library, or None once compiling failed (loaded lazily, once)


def _cache_dir() -> Path:
    root = os.environ.get("PEAT_KERNEL_CACHE", Path.home() / ".cache" / "peat" / "kernels")
    return Path(root) / "tensor_stats"


def _build() -> Path:
    """The shared object for SOURCE, compiled once per source and flags (atomic: parallel jobs race safely)."""
    digest = hashlib.sha256((SOURCE + " ".join(CFLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"stats_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "stats.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([os.environ.get("CC", "cc"), *CFLAGS, "-o", str(built), str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def _library():
    if not _LIB:
        try:
            lib = ctypes.CDLL(str(_build()))
            lib.peat_moments.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            lib.peat_moments.restype = None
            lib.peat_bitdiff.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                         ctypes.c_void_p, ctypes.c_void_p]
            lib.peat_bitdiff.restype = None
        except (OSError, subprocess.SubprocessError):
            lib = None  # no compiler or no writable cache: torch or numpy do the work
        _LIB.append(lib)
    return _LIB[0]


def compiled() -> bool:
    """Whether the one-pass C loops are in use (else torch and numpy ops)."""
    return _library() is not None


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
    lib = _library()
    t = t.detach()
    if lib is None or t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() or not t.numel():
        return stats_torch(t)
    raw = np.empty(5)
    lib.peat_moments(t.data_ptr(), t.numel(), raw.ctypes.data)
    total, squares, lo, hi, shift = raw
    if not np.isfinite(total + squares):  # inf/NaN inside (or float overflow): the torch ops say which
        return stats_torch(t)
    n = t.numel()
    mean = shift + total / n
    var = max(squares - total * total / n, 0.0) / max(n - 1, 1)
    return np.array([mean, var ** 0.5, lo, hi, max(abs(lo), abs(hi)), 0.0])


def bit_diff(candidate: np.ndarray, golden: np.ndarray, golden_finite: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """How the float32 patterns ``candidate`` differ from ``golden`` (flat int32 arrays of the
    same size): (counts, ulp). counts[b] for b in 0..31 is the number of elements whose bit b
    differs, then differing elements, non-finite candidates where golden is finite, and the
    largest ULP distance; ulp holds every element's ULP distance (uint32). None without the
    C loop."""
    lib = _library()
    if lib is None:
        return None
    candidate, golden = (np.ascontiguousarray(a, dtype=np.int32) for a in (candidate, golden))
    counts, ulp = np.zeros(35, dtype=np.int64), np.empty(candidate.size, dtype=np.uint32)
    lib.peat_bitdiff(candidate.ctypes.data, golden.ctypes.data, candidate.size, int(golden_finite),
                     ulp.ctypes.data, counts.ctypes.data)
    return counts, ulp
