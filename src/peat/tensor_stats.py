"""Hot per-tensor statistics, each one pass of a small C loop.

- ``stats``: the per-step summary of a tensor (mean, std, min, max, absmax, non-finite count).
  The Profiler summarises every layer's activation, weight and weight gradient at every step,
  so this is on the hot path of golden training. With torch ops it takes at least three passes
  over memory (a sum, a norm, ``aminmax``).
  On a GPU, ``stats_many`` summarises many tensors in one batch of float64 segment reductions
  instead, reading no value (a read would wait for all the work queued for the step).
- ``compare``: a candidate against golden, its absolute error in the matrix view and how its
  float32 bit patterns differ (bits per position, ULP distances, non-finite values).
  Playback scores every candidate tensor so; with numpy and torch it takes a transposed
  copy, a dozen passes and four byte histograms.
- the rest of playback's per-candidate scoring where numpy needs several passes, a Python
  loop or an array of its own: the Detector's sets S and G (``beyond``), the sums down the
  error matrix's columns (``column_sums``), the variance's sum of squared deviations
  (``squared_deviation_sum``), the periodicity score's 63 periods (``class_maxima``),
  isolated wrong elements (``isolated``), the largest 10 % of an error in ascending order
  (``top_ascending``: the last of a radix sort; else ``top``, then ``ascending``) and the
  median ULP distance (``select``): a radix select, several times faster than
  ``np.partition``, which was half of scoring, after a direct count of the keys below 2^16
  (a median of a few ULPs, or thousands for a reduced precision).

The loops are compiled on first use with the system C compiler (well under a second) and
cached by source hash. Without a compiler, or for tensors a loop does not take (``stats``: not
a contiguous float32 CPU tensor, or one holding inf/NaN), the callers' torch or numpy code
computes the same statistics; every scoring loop bit for bit (the same operations, sums added
in numpy's order; the integers exactly), as tests/test_playback.py checks. Either path is
deterministic: a fixed accumulation order, no threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
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
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#define LANES 16
#define BLOCK 1024
/* d = (x - shift) * scale: scale is a power of two (exact) that brings tiny or huge spreads
   near 1, where float squares neither underflow nor overflow; 1 in the common case, where
   peat_moments runs a copy of the loop without the multiplication (scaled a constant 0). */
static inline void moments_run(const float *x, int64_t n, float scale, const int scaled, double *out) {
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
                float v = x[i + j], d = scaled ? (v - shift) * scale : v - shift;
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
        double d = ((double)v - shift) * scale;
        total += d;
        squares += d * d;
        lo[0] = v < lo[0] ? v : lo[0];
        hi[0] = v > hi[0] ? v : hi[0];
    }
    float l = lo[0], h = hi[0];
    for (int j = 1; j < LANES; j++) { l = lo[j] < l ? lo[j] : l; h = hi[j] > h ? hi[j] : h; }
    out[0] = total; out[1] = squares; out[2] = l; out[3] = h; out[4] = shift;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* AVX2 where the CPU has it (picked at load time); same lanes, same roundings as the default. */
__attribute__((target_clones("avx2", "default")))
#endif
void peat_moments(const float *x, int64_t n, float scale, double *out) {
    if (scale == 1.0f)
        moments_run(x, n, 1.0f, 0, out);
    else
        moments_run(x, n, scale, 1, out);
}

/* peat_compare works through runs of at most CHUNK elements: first the element-wise part
   (vectorisable), then what depends on the data (bit counts), on a run in cache. */
#define CHUNK 512
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Errors, ULP distances and XOR patterns of one run of n elements (c read with a stride);
   state: the largest error's bit pattern (errors are >= 0 or a positive NaN, whose patterns
   order as their values, NaN above inf), non-finite candidates where golden is finite, the
   largest ULP distance, differing elements (the last for this run only). */
CLONES static void compare_run(const float *c, int64_t stride, const float *g, int64_t n, int golden_finite,
                               double *err, uint32_t *ulp, uint32_t *xor, int64_t *state) {
    static const int32_t EXP = 0x7F800000;
    int64_t top = state[0], nonfinite = state[1], ndiff = 0;
    uint32_t utop = (uint32_t)state[2];
    for (int64_t r = 0; r < n; r++) {
        float cv = c[r * stride], gv = g[r];
        double e = fabs((double)cv - (double)gv);
        int64_t eb;
        int32_t a, b;
        memcpy(&eb, &e, 8);
        memcpy(&a, &cv, 4);
        memcpy(&b, &gv, 4);
        err[r] = e;
        top = eb > top ? eb : top;
        uint32_t x = (uint32_t)(a ^ b);
        xor[r] = x;
        ndiff += x != 0;
        int32_t sa = a >> 31, sb = b >> 31;  /* ordered patterns, branch-free: signs are random */
        int64_t d = (int64_t)((a ^ (sa & 0x7FFFFFFF)) - sa) - (int64_t)((b ^ (sb & 0x7FFFFFFF)) - sb);
        uint32_t u = (uint32_t)((d ^ (d >> 63)) - (d >> 63));
        ulp[r] = u;
        utop = u > utop ? u : utop;
        nonfinite += (a & EXP) == EXP && (golden_finite || (b & EXP) != EXP);
    }
    state[0] = top; state[1] = nonfinite; state[2] = utop; state[3] = ndiff;
}

/* Per bit position, the XOR patterns of a run with that bit set, added to counts. Byte-sliced:
   (x >> b) & 0x01010101 holds bits b, 8 + b, 16 + b and 24 + b of x in its four bytes, so one
   32-bit sum counts four positions at once, exactly while a byte's count stays <= 255 (runs of
   255). Positions set in no pattern of the run are skipped (rounding differences touch the low
   mantissa bits alone). */
CLONES static void count_bits(const uint32_t *xor, int64_t n, int64_t *counts) {
    for (int64_t start = 0; start < n; start += 255) {
        int64_t end = n - start < 255 ? n : start + 255;
        uint32_t seen = 0;
        for (int64_t r = start; r < end; r++) seen |= xor[r];
        for (int b = 0; b < 8; b++) {
            if (!((seen >> b) & 0x01010101)) continue;
            uint32_t four = 0;
            for (int64_t r = start; r < end; r++) four += (xor[r] >> b) & 0x01010101;
            for (int k = 0; k < 4; k++) counts[8 * k + b] += (four >> 8 * k) & 255;
        }
    }
}

/* Candidate c against golden g, float32, both in the matrix view: g is that contiguous matrix,
   c is read through strides (an NCHW tensor's view: n0 = N blocks of n1 = H*W rows of n2 = C
   channels) without a transposed copy. err[i] = |c - g| in double (numpy's subtract and abs),
   *top is the largest err. From the bit patterns: out[b] counts elements whose bit b differs,
   out[32] differing elements, out[33] non-finite candidates where golden is finite, out[34]
   the largest ULP distance (ulp[i]: element i's; ordered patterns: a negative pattern
   -2^31 + L maps to -L), out[35] 1 when every err is finite. */
void peat_compare(const float *c, int64_t n0, int64_t n1, int64_t n2, int64_t s0, int64_t s1, int64_t s2,
                  const float *g, int golden_finite, double *err, uint32_t *ulp, int64_t *out, double *top) {
    int64_t i = 0, ndiff = 0, state[4] = {0, 0, 0, 0};
    uint32_t xor[CHUNK];
    for (int64_t p = 0; p < n0; p++) {
        for (int64_t q = 0; q < n1; q++) {
            const float *row = c + p * s0 + q * s1;
            for (int64_t r = 0; r < n2; r += CHUNK) {
                int64_t m = n2 - r < CHUNK ? n2 - r : CHUNK;
                compare_run(row + r * s2, s2, g + i, m, golden_finite, err + i, ulp + i, xor, state);
                ndiff += state[3];
                count_bits(xor, m, out);
                i += m;
            }
        }
    }
    memcpy(top, &state[0], 8);
    out[32] = ndiff; out[33] = state[1]; out[34] = state[2]; out[35] = *top <= DBL_MAX;
}

/* The Detector's sets S (err > tau32) and G (err > bound[i], or > bound[0] alone when
   per_element is 0) as 0/1 bytes, their sizes in counts[0..1], and in *top the largest finite
   err / bound[i] (0 when none is finite). Quotients are >= 0 or NaN: the largest is found on
   their bit patterns (an integer maximum, which vectorises), non-finite ones as 0. */
static inline void beyond_run(const double *err, int64_t n, double tau32, const double *bound, const int per_element,
                              uint8_t *over32, uint8_t *gross, int64_t *counts, int64_t *top) {
    int64_t n32 = 0, ngross = 0, best = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = err[i], b = bound[per_element ? i : 0], q = e / b;
        int64_t qb;
        memcpy(&qb, &q, 8);
        qb = q <= DBL_MAX ? qb : 0;  /* false for inf and NaN */
        best = qb > best ? qb : best;
        uint8_t s = e > tau32, g = e > b;
        over32[i] = s;
        gross[i] = g;
        n32 += s;
        ngross += g;
    }
    counts[0] = n32; counts[1] = ngross;
    *top = best;
}

/* beyond_run over a rows x cols matrix whose bound is bound[0] (tile 0) or one per aligned
   tile x tile tile, bound[(i / tile) * ceil(cols / tile) + j / tile]: spread over the columns
   into row (cols doubles) as each band of tile rows starts, so the loop is the per-element one. */
CLONES void peat_beyond(const double *err, int64_t rows, int64_t cols, double tau32, const double *bound,
                        int64_t tile, double *row, uint8_t *over32, uint8_t *gross, int64_t *counts, double *ratio) {
    int64_t top = 0, found[2], best;
    if (!tile) {
        beyond_run(err, rows * cols, tau32, bound, 0, over32, gross, counts, &top);
    } else {
        counts[0] = counts[1] = 0;
        for (int64_t i = 0; i < rows; i++) {
            if (i % tile == 0) {
                const double *band = bound + (i / tile) * ((cols + tile - 1) / tile);
                for (int64_t j = 0; j < cols; j++) row[j] = band[j / tile];
            }
            beyond_run(err + i * cols, cols, tau32, row, 1, over32 + i * cols, gross + i * cols, found, &best);
            counts[0] += found[0];
            counts[1] += found[1];
            top = best > top ? best : top;
        }
    }
    memcpy(ratio, &top, 8);
}

/* Sums down the columns of a rows x cols matrix m, each adding the rows in order, as numpy's
   sum over axis 0 does (for two or more columns): total[j] over all rows, bands[b * cols + j]
   over rows [b * tile, (b + 1) * tile), blocks[k * cols + j] over rows [edges[k], edges[k + 1])
   for k < nblocks. The outputs start zeroed; m holds no -0.0. */
static inline void add_row(const double *restrict row, int64_t cols, double *restrict total, double *restrict band,
                           double *restrict block) {
    for (int64_t j = 0; j < cols; j++) {
        total[j] += row[j];
        band[j] += row[j];
        if (block) block[j] += row[j];
    }
}

CLONES void peat_column_sums(const double *m, int64_t rows, int64_t cols, int64_t tile, const int64_t *edges,
                             int64_t nblocks, double *total, double *bands, double *blocks) {
    int64_t k = 0;
    for (int64_t r = 0; r < rows; r++) {
        while (k < nblocks && r >= edges[k + 1]) k++;
        double *band = bands + r / tile * cols;
        if (nblocks)  /* two calls: the test on block leaves each loop */
            add_row(m + r * cols, cols, total, band, blocks + k * cols);
        else
            add_row(m + r * cols, cols, total, band, 0);
    }
}

/* The sum of (x[i] - mean)^2 (numpy's subtract then multiply, no fused multiply-add) in the
   order np.sum adds up that array, without making it: pairwise, in blocks of at most 128 summed
   in 8 lanes, halves split at a multiple of 8. */
static inline double squared(double x, double mean) {
    double d = x - mean;
    return d * d;
}

double peat_squared_deviation_sum(const double *x, int64_t n, double mean) {
    if (n < 8) {
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += squared(x[i], mean);
        return sum;
    }
    if (n <= 128) {
        double r[8];
        int64_t i;
        for (int k = 0; k < 8; k++) r[k] = squared(x[k], mean);
        for (i = 8; i < n - n % 8; i += 8)
            for (int k = 0; k < 8; k++) r[k] += squared(x[i + k], mean);
        double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) sum += squared(x[i], mean);
        return sum;
    }
    int64_t half = n / 2 - (n / 2) % 8;
    return peat_squared_deviation_sum(x, half, mean) + peat_squared_deviation_sum(x + half, n - half, mean);
}

/* Set elements of a rows x cols 0/1 mask none of whose 8 neighbours is set: each is an
   8-connected component of its own, so their count is a lower bound of the components'. */
static inline int set_at(const uint8_t *row, int64_t c, int64_t cols) { return c >= 0 && c < cols && row[c]; }

static int64_t isolated_at(const uint8_t *up, const uint8_t *row, const uint8_t *down, int64_t c, int64_t cols) {
    int near = set_at(row, c - 1, cols) | set_at(row, c + 1, cols);
    for (int64_t d = -1; d <= 1; d++) near |= set_at(up, c + d, cols) | set_at(down, c + d, cols);
    return row[c] && !near;
}

CLONES int64_t peat_isolated(const uint8_t *m, int64_t rows, int64_t cols, const uint8_t *zeros) {
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = m + r * cols, *up = r ? row - cols : zeros, *down = r + 1 < rows ? row + cols : zeros;
        for (int64_t c = 1; c + 1 < cols; c++)  /* the inner columns, branch-free (it vectorises) */
            count += row[c] & !(row[c - 1] | row[c + 1] | up[c - 1] | up[c] | up[c + 1] | down[c - 1] | down[c] |
                                down[c + 1]);
        count += isolated_at(up, row, down, 0, cols);
        if (cols > 1) count += isolated_at(up, row, down, cols - 1, cols);
    }
    return count;
}

/* The i-th smallest (from 0) of n unsigned keys of width 4 or 8 bytes: what numpy's partition
   puts at i. A radix select from the highest bit set in any key down: count each digit among
   the keys that share the digits chosen so far and take the digit whose count holds rank i.
   Only the first round (about log2 n bits, 8 to 16) reads all n keys; those sharing its digit
   are copied to buf (n at most) for the next rounds (12 bits each). Non-negative floats order
   as their bit patterns. hist holds 65536 counts. */
static int64_t pick(const int64_t *hist, int64_t *i) {
    int64_t d = 0;
    while (*i >= hist[d]) *i -= hist[d++];
    return d;
}

static inline uint64_t key_at(const void *keys, int width, int64_t j) {
    return width == 8 ? ((const uint64_t *)keys)[j] : ((const uint32_t *)keys)[j];
}

/* One round over the m keys: count the b-bit digit at shift, take the digit whose count holds
   rank i and keep the keys that have it in buf (moving keys down only: buf may be keys). */
static uint64_t narrow(const void *keys, int width, int64_t *m, int shift, int b, int64_t *i, uint64_t *buf,
                       int64_t *hist) {
    uint64_t mask = ((uint64_t)1 << b) - 1;
    memset(hist, 0, ((size_t)1 << b) * sizeof(int64_t));
    for (int64_t j = 0; j < *m; j++) hist[(key_at(keys, width, j) >> shift) & mask]++;
    uint64_t digit = (uint64_t)pick(hist, i);
    int64_t kept = 0;
    for (int64_t j = 0; j < *m && shift > 0; j++) {  /* branch-free: kept only when its digit is the one */
        uint64_t key = key_at(keys, width, j);
        buf[kept] = key;
        kept += ((key >> shift) & mask) == digit;
    }
    *m = kept;
    return digit;
}

/* Keys below SMALL counted directly, when the rank's key is one of them (the ULP distances of a
   result near golden: the median is a few ULPs, a few thousand for a reduced precision): one
   pass counting them, one filling WAYS interleaved count tables (an increment of one count waits
   for the one before, and most keys share a few counts), no copies; 3-6x faster than the radix
   rounds below on such keys. tables holds WAYS * (SMALL + 1) counts (n < 2^32). Returns 1 and
   the key in *out, or 0 when the rank's key is larger. */
#define SMALL 65536
#define WAYS 4
static int select_small(const void *keys, int64_t n, int width, int64_t i, int64_t *hist, uint32_t *tables,
                        uint64_t *out) {
    int64_t below = 0, j = 0;
    for (int64_t r = 0; r < n; r++) below += key_at(keys, width, r) < SMALL;
    if (i >= below) return 0;
    memset(tables, 0, WAYS * (SMALL + 1) * sizeof(uint32_t));
    for (; j + WAYS <= n; j += WAYS)
        for (int w = 0; w < WAYS; w++) {
            uint64_t key = key_at(keys, width, j + w);
            tables[w * (SMALL + 1) + (key < SMALL ? key : SMALL)]++;
        }
    for (; j < n; j++) {
        uint64_t key = key_at(keys, width, j);
        tables[key < SMALL ? key : SMALL]++;
    }
    for (int64_t d = 0; d < SMALL; d++) {
        hist[d] = 0;
        for (int w = 0; w < WAYS; w++) hist[d] += tables[w * (SMALL + 1) + d];
    }
    *out = (uint64_t)pick(hist, &i);
    return 1;
}

/* The radix rounds; largest: the largest key, or 0 (then found): only its highest bit set is
   read, which is that of every key's OR. */
static uint64_t select_radix(const void *keys, int64_t n, int width, int64_t i, uint64_t *buf, int64_t *hist,
                             uint64_t largest) {
    uint64_t all = largest;
    for (int64_t j = 0; j < n && !largest; j++) all |= key_at(keys, width, j);
    int shift = 0, b = 8;
    while (shift < 64 && all >> shift) shift++;
    while (b < 16 && ((int64_t)1 << b) < n) b++;
    b = b < shift ? b : shift;
    shift -= b;
    uint64_t prefix = narrow(keys, width, &n, shift, b, &i, buf, hist) << shift;
    while (shift > 0) {
        b = shift < 12 ? shift : 12;
        shift -= b;
        prefix |= narrow(buf, 8, &n, shift, b, &i, buf, hist) << shift;
    }
    return prefix;
}

/* tables: NULL, or room for select_small, tried first. */
uint64_t peat_select(const void *keys, int64_t n, int width, int64_t i, uint64_t *buf, int64_t *hist,
                     uint32_t *tables) {
    uint64_t small;
    if (tables && n < ((int64_t)1 << 32) && select_small(keys, n, width, i, hist, tables, &small))
        return small;
    return select_radix(keys, n, width, i, buf, hist, 0);
}

/* The k largest of n finite doubles >= 0, less the zeros among them: those above the k-th
   largest in the order they come, then that value as often as it is among them (numpy's
   x[x > t] and a fill, t from peat_select); returns how many, at most k (out holds k). largest:
   the bit pattern of the largest, when known (else 0), which spares a pass. Float64 patterns are
   never small (select_small). */
int64_t peat_top(const double *x, int64_t n, int64_t k, uint64_t *buf, int64_t *hist, double *out,
                 uint64_t largest) {
    uint64_t bits = select_radix(x, n, 8, n - k, buf, hist, largest);
    double t;
    memcpy(&t, &bits, 8);
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++) {  /* branch-free: m stays below k, so out[m] is in bounds */
        out[m] = x[j];
        m += x[j] > t;
    }
    if (t == 0.0) return m;
    for (; m < k; m++) out[m] = t;
    return k;
}

/* Sorts n float64 values >= 0 (their bit patterns, which order as the values) ascending in place:
   an LSD radix sort on 11-bit digits that skips a digit every value shares (the low mantissa bits
   of an error between float32 values are zero). tmp holds n, hist 2048. Returns 0, or 1 and
   leaves x as it was when a sign bit is set (-0.0, a negative value: not sorted so). */
static void radix_sort(uint64_t *x, int64_t n, uint64_t any, uint64_t every, uint64_t *tmp, int64_t *hist);

int peat_sort(uint64_t *x, int64_t n, uint64_t *tmp, int64_t *hist) {
    uint64_t any = 0, every = ~(uint64_t)0;
    for (int64_t j = 0; j < n; j++) { any |= x[j]; every &= x[j]; }
    if (any >> 63) return 1;
    radix_sort(x, n, any, every, tmp, hist);
    return 0;
}

/* any and every: the OR and the AND of the n keys. */
static void radix_sort(uint64_t *x, int64_t n, uint64_t any, uint64_t every, uint64_t *tmp, int64_t *hist) {
    uint64_t *src = x, *dst = tmp;
    for (int shift = 0; shift < 64; shift += 11) {
        if (!(((any ^ every) >> shift) & 2047)) continue;
        memset(hist, 0, 2048 * sizeof(int64_t));
        for (int64_t j = 0; j < n; j++) hist[(src[j] >> shift) & 2047]++;
        for (int64_t d = 0, sum = 0; d < 2048; d++) { int64_t c = hist[d]; hist[d] = sum; sum += c; }
        for (int64_t j = 0; j < n; j++) dst[hist[(src[j] >> shift) & 2047]++] = src[j];
        uint64_t *t = src; src = dst; dst = t;
    }
    if (src != x) memcpy(x, src, (size_t)n * sizeof(uint64_t));
}

/* peat_top's values in ascending order (what sorting them gives), found as the largest of a sort:
   one pass counts the top 16 bits of every key, one keeps the keys whose digit is at least that
   of the k-th largest (at most 4k + 4096 of them, else -1: the caller selects first), which are
   sorted (radix_sort); their last k less the zeros among them are the values. buf and tmp hold
   min(n, 4k + 4096) + 1 keys, hist 65536; largest as peat_top's. Returns how many, or -1 (also
   where a sign bit is set: -0.0 orders as no value >= 0). */
int64_t peat_top_sorted(const double *x, int64_t n, int64_t k, uint64_t *buf, uint64_t *tmp, int64_t *hist,
                        double *out, uint64_t largest) {
    const uint64_t *keys = (const uint64_t *)x;
    uint64_t all = largest;
    for (int64_t j = 0; j < n && !largest; j++) all |= keys[j];
    if (all >> 63) return -1;
    int high = 0;
    while (high < 64 && all >> high) high++;
    int b = high < 16 ? high : 16, shift = high - b;
    uint64_t mask = ((uint64_t)1 << b) - 1;
    memset(hist, 0, (size_t)(mask + 1) * sizeof(int64_t));
    for (int64_t j = 0; j < n; j++) hist[(keys[j] >> shift) & mask]++;
    int64_t above = 0, d = (int64_t)mask;
    while (above + hist[d] < k) above += hist[d--];
    int64_t m = above + hist[d];
    if (m > 4 * k + 4096) return -1;
    int64_t c = 0;
    uint64_t any = 0, every = ~(uint64_t)0;
    for (int64_t j = 0; j < n; j++) {  /* branch-free: c stays at most m, so buf[c] is in bounds */
        uint64_t key = keys[j];
        buf[c] = key;
        c += (key >> shift) >= (uint64_t)d;
    }
    for (int64_t j = 0; j < m; j++) { any |= buf[j]; every &= buf[j]; }
    radix_sort(buf, m, any, every, tmp, hist);
    int64_t first = m - k;
    while (first < m && buf[first] == 0) first++;
    memcpy(out, buf + first, (size_t)(m - first) * sizeof(double));
    return m - first;
}

/* For each period k in 2..kmax, the largest of the k residue-class sums of mass[0..n), each
   summed in index order (as numpy's mass.reshape(-1, k).sum(0) plus the remainder): best[k]. */
void peat_periods(const double *mass, int64_t n, int64_t kmax, double *classes, double *best) {
    for (int64_t k = 2; k <= kmax; k++) {
        for (int64_t j = 0; j < k; j++) classes[j] = 0.0;
        for (int64_t i = 0; i < n; i += k) {
            int64_t m = n - i < k ? n - i : k;
            for (int64_t j = 0; j < m; j++) classes[j] += mass[i + j];
        }
        double m = classes[0];
        for (int64_t j = 1; j < k; j++) m = classes[j] > m ? classes[j] : m;
        best[k] = m;
    }
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


_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# Each C function's argument and return types: ctypes would pass a Python int as a C int (32 bits).
_SIGNATURES = {
    "peat_moments": ([_P, _I64, ctypes.c_float, _P], None),
    "peat_compare": ([_P, *[_I64] * 6, _P, ctypes.c_int, *[_P] * 4], None),
    "peat_select": ([_P, _I64, ctypes.c_int, _I64, _P, _P, _P], ctypes.c_uint64),
    "peat_top": ([_P, _I64, _I64, _P, _P, _P, ctypes.c_uint64], _I64),
    "peat_sort": ([_P, _I64, _P, _P], ctypes.c_int),
    "peat_top_sorted": ([_P, _I64, _I64, _P, _P, _P, _P, ctypes.c_uint64], _I64),
    "peat_periods": ([_P, _I64, _I64, _P, _P], None),
    "peat_beyond": ([_P, _I64, _I64, ctypes.c_double, _P, _I64, *[_P] * 5], None),
    "peat_column_sums": ([_P, *[_I64] * 3, _P, _I64, *[_P] * 3], None),
    "peat_squared_deviation_sum": ([_P, _I64, ctypes.c_double], ctypes.c_double),
    "peat_isolated": ([_P, _I64, _I64, _P], _I64),
}


def _library():
    if not _LIB:
        try:
            lib = ctypes.CDLL(str(_build()))
            for name, (args, result) in _SIGNATURES.items():
                getattr(lib, name).argtypes = args
                getattr(lib, name).restype = result
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
    if not t.numel():  # a layer of width 0 (a pruned head, say): no value to summarise, none bad
        return torch.tensor([math.nan] * 5 + [0.0], device=t.device)
    if t.device.type != "cpu":
        return _stats_batch([t])[0]
    # sum and a norm are an order of magnitude faster than torch.std_mean on CPU. Summed in float64:
    # a float32 sum of finite values near the float32 maximum (a diverging layer) is inf or NaN.
    mean = t.sum(dtype=torch.float64) / t.numel()
    lo, hi = torch.aminmax(t)
    # Float32 squares of tiny or huge deviations under- or overflow, and huge deviations themselves
    # may: those (rare) are taken in float64, where neither happens.
    wide = _scale(max(hi.item() - mean.item(), mean.item() - lo.item())) != 1.0
    deviations = t.double() - mean if wide else t - mean.float()
    std = (torch.linalg.vector_norm(deviations) / max(t.numel() - 1, 1) ** 0.5).float()
    mean = mean.float()
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
    # Python floats: inf - inf is NaN without numpy's RuntimeWarning (an error under -W error) at
    # every layer holding an inf.
    total, squares, lo, hi, shift = _moments(lib, t, 1.0).tolist()
    scale = _scale(max(hi - shift, shift - lo))
    if scale != 1.0:  # rare: a second pass, rather than a slower first one for every tensor
        total, squares, *_ = _moments(lib, t, scale).tolist()
    if not math.isfinite(total + squares):  # inf/NaN inside: the torch ops say which
        return stats_torch(t)
    n = t.numel()
    mean = shift + total / scale / n
    var = max(squares - total * total / n, 0.0) / max(n - 1, 1) / (scale * scale)
    return np.array([mean, var ** 0.5, lo, hi, max(abs(lo), abs(hi)), 0.0])


# Elements summarised in one batch on a GPU: the concatenation and its float64 copy take 12 bytes each.
BATCH_ELEMENTS = 1 << 24


def stats_many(tensors: list[torch.Tensor]) -> list[np.ndarray | torch.Tensor]:
    """``stats`` of each tensor. On a GPU in batches of about 25 kernels each: the Profiler
    summarises every layer's output, weight and gradient each step, and ~15 launches per tensor
    cost more than a small model's step."""
    device = tensors[0].device if tensors else None
    if device is None or device.type == "cpu" or any(t.device != device for t in tensors):
        return [stats(t) for t in tensors]
    return [row for batch in batches(tensors, BATCH_ELEMENTS) for row in _stats_batch(batch).unbind(0)]


def batches(tensors: list[torch.Tensor], limit: int, key=lambda t: None) -> list[list[torch.Tensor]]:
    """``tensors`` cut, in order, into runs of equal ``key`` of at most ``limit`` elements (a larger
    tensor alone): what one concatenation may hold, its copy bounded."""
    out, size = [], 0
    for t in tensors:
        if not out or key(t) != key(out[-1][0]) or size + t.numel() > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel()
    return out


def _stats_batch(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The rows of ``stats_torch`` for tensors on one device, as a (k, 6) float32 tensor: segment
    reductions over their concatenation in float64, without reading a value."""
    sizes = tuple(t.numel() for t in tensors)
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).double()
    counts, chunks, chunks_per_tensor = _segments(sizes, flat.device, CHUNK)

    def per_tensor(how: str, values: torch.Tensor) -> torch.Tensor:
        # unsafe: no check of the lengths, which would read them
        partial = torch.segment_reduce(values, how, lengths=chunks, unsafe=True)
        return torch.segment_reduce(partial, how, lengths=chunks_per_tensor, unsafe=True)

    mean = per_tensor("sum", flat) / counts
    deviations = flat - mean.repeat_interleave(counts, output_size=flat.numel())
    var = per_tensor("sum", deviations * deviations) / (counts - 1).clamp(min=1)
    lo, hi = per_tensor("min", flat), per_tensor("max", flat)
    bad = per_tensor("sum", (~torch.isfinite(flat)).double())
    rows = torch.stack([mean, var.sqrt(), lo, hi, torch.maximum(-lo, hi), bad], 1).float()
    empty = [i for i, n in enumerate(sizes) if not n]
    if empty:  # a layer of width 0: no value to summarise, none bad (as stats_torch says)
        rows[empty] = torch.tensor([math.nan] * 5 + [0.0], device=rows.device)
    return rows


# Elements per first-level segment. A GPU reduces each segment in one thread block (CUB's segmented
# reduction): whole tensors as segments would leave most of a GPU idle while one block reads the largest.
CHUNK = 1 << 16


@functools.lru_cache(maxsize=256)
def _segments(sizes: tuple[int, ...], device: torch.device, chunk: int) -> tuple[torch.Tensor, ...]:
    """Each tensor's length, its chunks' lengths in order, and how many chunks each tensor has.
    Kept: a copy from the host to a GPU waits for the work queued there, and the sizes repeat every step."""
    chunks = [min(chunk, n - start) for n in sizes for start in range(0, n, chunk)]
    per_tensor = [-(-n // chunk) for n in sizes]
    return tuple(torch.tensor(x, device=device) for x in (sizes, chunks, per_tensor))


def _moments(lib, t: torch.Tensor, scale: float) -> np.ndarray:
    """``peat_moments``: the sum and the sum of squares of (t - t[0]) * scale, min, max, t[0]."""
    raw = np.empty(5)
    lib.peat_moments(t.data_ptr(), t.numel(), scale, raw.ctypes.data)
    return raw


# Float squares of deviations below 2^-63 are subnormal (0 below 2^-75), above 2^64 infinite:
# spreads outside [2^-40, 2^40] are scaled to about 1, by 2^-126..2^126 (normal float32 values).
_SPREAD = (2.0 ** -40, 2.0 ** 40)


def _scale(spread: float) -> float:
    """1, or the power of two that brings a tiny or huge ``spread`` (finite, > 0) near 1."""
    if not (0.0 < spread < _SPREAD[0] or _SPREAD[1] < spread < math.inf):
        return 1.0
    return math.ldexp(1.0, -min(max(math.frexp(spread)[1], -126), 126))


def compare(candidate: torch.Tensor, golden: np.ndarray, golden_finite: bool) -> dict | None:
    """A candidate against golden in one pass (``peat_compare``): ``candidate`` a float32 CPU
    tensor, ``golden`` the contiguous float32 matrix of its matrix view (``peat.errors.matrix``).
    Returns err (|candidate - golden| in float64, that matrix's shape), top (err's largest
    value), finite (every err finite), ulp (every
    element's ULP distance, uint32, in matrix order) and counts (per bit position the elements
    whose bit differs, then differing elements, non-finite candidates where golden is finite,
    the largest ULP distance). None without the C loop, or for a tensor it does not take."""
    lib = _library()
    if lib is None or candidate.dtype != torch.float32 or candidate.device.type != "cpu" or not golden.size:
        return None
    view = _strided_matrix(candidate)
    # The loop reads and writes as many elements as the candidate has: another shape than golden's
    # would run past the buffers (numpy's code raises its broadcast error instead).
    if view is None or (view.shape[0] * view.shape[1], view.shape[2]) != golden.shape:
        return None
    golden = np.ascontiguousarray(golden, dtype=np.float32)
    n = golden.size
    err, ulp = np.empty(golden.shape), np.empty(n, dtype=np.uint32)
    counts, top = np.zeros(36, dtype=np.int64), np.zeros(1)
    lib.peat_compare(view.data_ptr(), *view.shape, *view.stride(), golden.ctypes.data, int(golden_finite),
                     err.ctypes.data, ulp.ctypes.data, counts.ctypes.data, top.ctypes.data)
    return {"err": err, "top": float(top[0]), "finite": bool(counts[35]), "ulp": ulp, "counts": counts[:35]}


SELECT_MIN = 4096
SMALL_MIN = 16384  # select tries small keys first from this many keys on


def select(keys: np.ndarray, i: int) -> int | None:
    """The ``i``-th smallest (from 0) of ``keys``, a 1-d uint32 or uint64 array (the bit patterns
    of non-negative float64 values order as the values): ``np.partition(keys, i)[i]``, in two
    passes over all keys and a few over those that share its leading bits. None without the C
    loop, for fewer than SELECT_MIN keys (np.partition is as fast there) or an ``i`` out of range."""
    lib = _library()
    if lib is None or keys.size < SELECT_MIN or not 0 <= i < keys.size:  # numpy's path raises for a bad i
        return None
    keys = np.ascontiguousarray(keys)
    buf, hist = np.empty(keys.size, dtype=np.uint64), np.empty(65536, dtype=np.int64)
    # Counting the keys below 2^16 directly (select_small) pays for its 1 MB of tables from this size on.
    tables = np.empty(4 * 65537, dtype=np.uint32) if keys.size >= SMALL_MIN else None
    return int(lib.peat_select(keys.ctypes.data, keys.size, keys.itemsize, i, buf.ctypes.data, hist.ctypes.data,
                               None if tables is None else tables.ctypes.data))


def top(x: np.ndarray, k: int, largest: float | None = None) -> np.ndarray | None:
    """The ``k`` (1 <= k <= size) largest of a 1-d float64 array of finite values >= 0, less the
    zeros among them: those above the k-th largest in the order they come, then that value as
    often as it is among them (``peat_top``); ``largest``: ``x.max()``, when known (a pass
    spared). None without the C loop, for fewer than SELECT_MIN values or a ``k`` out of range."""
    lib = _library()
    if lib is None or x.size < SELECT_MIN or not 1 <= k <= x.size:
        return None
    x = np.ascontiguousarray(x, dtype=np.float64)
    buf, hist, out = np.empty(x.size, dtype=np.uint64), np.empty(65536, dtype=np.int64), np.empty(k)
    bits = 0 if largest is None else int(np.float64(largest).view(np.uint64))
    return out[:lib.peat_top(x.ctypes.data, x.size, k, buf.ctypes.data, hist.ctypes.data, out.ctypes.data, bits)]


def top_ascending(x: np.ndarray, k: int, largest: float | None = None) -> np.ndarray | None:
    """``np.sort(top(x, k, largest))`` found in one sort (``peat_top_sorted``): the keys from the
    k-th largest's top 16 bits on, sorted, their last k less the zeros. None where ``top`` gives
    None, or where that digit holds too many keys (then ``top`` and ``ascending``)."""
    lib = _library()
    if lib is None or x.size < SELECT_MIN or not 1 <= k <= x.size:
        return None
    x = np.ascontiguousarray(x, dtype=np.float64)
    room = min(x.size, 4 * k + 4096) + 1  # the keys kept, at most (peat_top_sorted): 0.4 of x's for the top 10 %
    buf, tmp, hist, out = (np.empty(room, dtype=np.uint64), np.empty(room, dtype=np.uint64),
                           np.empty(65536, dtype=np.int64), np.empty(k))
    bits = 0 if largest is None else int(np.float64(largest).view(np.uint64))
    found = lib.peat_top_sorted(x.ctypes.data, x.size, k, buf.ctypes.data, tmp.ctypes.data, hist.ctypes.data,
                                out.ctypes.data, bits)
    return None if found < 0 else out[:found]


def ascending(x: np.ndarray) -> np.ndarray | None:
    """``np.sort(x)`` of a 1-d float64 array of values >= 0 (no -0.0, no NaN), as a new array: a radix
    sort of their bit patterns (``peat_sort``), 3-8x faster than numpy's on the largest 10 % of
    an error (few distinct values, or thousands). None without the C loop, for fewer than SELECT_MIN values or
    a value with its sign bit set."""
    lib = _library()
    if lib is None or x.ndim != 1 or x.size < SELECT_MIN or x.dtype != np.float64:
        return None
    out = np.array(x, dtype=np.float64, order="C")  # a copy, sorted in place
    tmp, hist = np.empty(x.size, dtype=np.uint64), np.empty(2048, dtype=np.int64)
    return None if lib.peat_sort(out.ctypes.data, out.size, tmp.ctypes.data, hist.ctypes.data) else out


def _strided_matrix(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s matrix view as a 3-d strided view (blocks, rows per block, columns) of its own
    memory: an NCHW tensor as (N, H*W, C), anything else as (1, rows, last dimension). None
    when the memory does not allow such a view."""
    if t.dim() == 4:
        n, c, h, w = t.shape
        view = t.movedim(1, -1)
        try:
            return view.view(n, h * w, c)
        except RuntimeError:  # H and W not mergeable in this layout
            return None
    t = t.contiguous()
    return t.reshape(1, -1, t.shape[-1] if t.dim() else 1)


def class_maxima(mass: np.ndarray, kmax: int) -> np.ndarray | None:
    """For each period k in 2..kmax (entries 0 and 1 unused), the largest residue-class sum of
    ``mass`` (float64), each class summed in index order; None without the C loop."""
    lib = _library()
    if lib is None:
        return None
    mass = np.ascontiguousarray(mass, dtype=np.float64)
    best, classes = np.zeros(kmax + 1), np.empty(max(kmax, 1))
    lib.peat_periods(mass.ctypes.data, mass.size, kmax, classes.ctypes.data, best.ctypes.data)
    return best


def beyond(err: np.ndarray, tau32: float, bound: np.ndarray | float, tile: int = 0) -> tuple | None:
    """(err > tau32, err > bound, the sizes of both, the largest finite err / bound or 0) in one
    pass; ``err`` a float64 matrix, ``bound`` a number or (``tile`` > 0) one value per aligned
    ``tile`` x ``tile`` tile of it, as ``peat.scores.per_tile`` gives them. None without the
    C loop."""
    lib = _library()
    if lib is None:
        return None
    err = np.ascontiguousarray(err, dtype=np.float64)
    bound = np.ascontiguousarray(bound, dtype=np.float64)
    if tile and (err.ndim != 2 or bound.shape != tuple(-(-s // tile) for s in err.shape)):
        return None
    rows, cols = err.shape if tile else (err.size, 1)
    over32, gross = np.empty(err.shape, dtype=bool), np.empty(err.shape, dtype=bool)
    counts, ratio, row = np.zeros(2, dtype=np.int64), np.zeros(1), np.empty(cols)
    lib.peat_beyond(err.ctypes.data, rows, cols, float(tau32), bound.ctypes.data, tile, row.ctypes.data,
                    over32.ctypes.data, gross.ctypes.data, counts.ctypes.data, ratio.ctypes.data)
    return over32, gross, int(counts[0]), int(counts[1]), float(ratio[0])


def column_sums(m: np.ndarray, tile: int, edges: np.ndarray | None) -> tuple | None:
    """Sums down the columns of a float64 matrix (>= 0, two or more columns), adding its rows in
    order as numpy's ``m.sum(0)`` does, in one pass: over all rows, over each band of ``tile``
    rows, and over each block of rows between consecutive ``edges`` (or None). None without
    the C loop."""
    lib = _library()
    rows, cols = m.shape
    if lib is None or cols < 2:  # numpy sums a single column pairwise, not row by row
        return None
    m = np.ascontiguousarray(m, dtype=np.float64)
    total, bands = np.zeros(cols), np.zeros((-(-rows // tile), cols))
    nblocks = 0 if edges is None else len(edges) - 1
    blocks = np.zeros((max(nblocks, 1), cols))
    edges = np.ascontiguousarray(edges if edges is not None else [0], dtype=np.int64)
    lib.peat_column_sums(m.ctypes.data, rows, cols, tile, edges.ctypes.data, nblocks, total.ctypes.data,
                         bands.ctypes.data, blocks.ctypes.data)
    return total, bands, (blocks if nblocks else None)


def squared_deviation_sum(x: np.ndarray, mean: float) -> float:
    """((x - mean) ** 2).sum() of a contiguous float64 array, bit for bit, in one pass without
    the squared deviations' array (numpy: a subtraction, a multiplication and np.sum's pairwise
    order)."""
    lib = _library()
    if lib is None or x.dtype != np.float64 or not x.flags.c_contiguous:
        spread = x - mean
        spread *= spread
        return float(spread.sum())
    return float(lib.peat_squared_deviation_sum(x.ctypes.data, x.size, float(mean)))


def isolated(mask: np.ndarray) -> int:
    """How many set elements of a 2-d boolean mask have no set neighbour among their 8: a lower
    bound of its 8-connected components (0 without the C loop, which bounds them too)."""
    lib = _library()
    if lib is None or mask.ndim != 2 or not mask.size:
        return 0
    mask = np.ascontiguousarray(mask, dtype=bool)
    zeros = np.zeros(mask.shape[1], dtype=np.uint8)  # the rows beyond the edges
    return int(lib.peat_isolated(mask.ctypes.data, mask.shape[0], mask.shape[1], zeros.ctypes.data))
