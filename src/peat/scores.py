"""Per-tensor error scores of a candidate result against the golden float32 result.

PEAT's scores (max, mean, mean of the top 10 % and variance of the absolute error), the
same relative to the float32-vs-float64 rounding noise of that very tensor, ULP distances,
the fraction of differing elements, a histogram of the bit positions where golden and
candidate differ, a spatial profile in the matrix view of ``peat.errors.matrix`` (rows x
columns; channels are the columns of NCHW tensors) and the count of non-finite values
where golden is finite. Everything works on plain tensors; nothing here knows about files.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import matrix

TOP_FRACTION = 0.10
TILE = 16           # tile edge for the tile-concentration score
MAX_PERIOD = 64     # longest column/row period searched by the periodicity score
TINY = 1e-30
MAP_SIZE = 32       # edge of the downsampled spatial error map kept per tensor


def abs_error(candidate: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """|candidate - golden| in float64, with non-finite differences kept as inf."""
    err = (candidate.double() - golden.double()).abs()
    return torch.nan_to_num(err, nan=math.inf)


def summary(err: torch.Tensor) -> dict:
    """PEAT's four scores of an absolute-error tensor: max, mean, top-10 % mean, variance."""
    flat = err.reshape(-1).double().numpy()
    finite = flat[np.isfinite(flat)] if not np.isfinite(flat).all() else flat
    if finite.size == 0:
        return {"max": math.nan, "mean": math.nan, "top10": math.nan, "var": math.nan}
    k = max(1, math.ceil(TOP_FRACTION * finite.size))
    top = np.partition(finite, finite.size - k)[finite.size - k:]  # O(n), unlike a sort
    return {"max": float(top.max()), "mean": float(finite.mean()), "top10": float(top.mean()),
            "var": float(finite.var())}


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns mapped to int64 so that adjacent floats differ by one (ULP order)."""
    bits = t.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance(candidate: torch.Tensor, golden: torch.Tensor, golden_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Number of representable float32 values between candidate and golden, per element."""
    golden_bits = ordered_bits(golden) if golden_bits is None else golden_bits
    return (ordered_bits(candidate) - golden_bits).abs()


# Bit b of every byte value, for the per-bit histogram of a byte histogram.
_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(np.int64)


def xor_bits(candidate: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """Bitwise XOR of the float32 patterns of candidate and golden (int32)."""
    return candidate.float().contiguous().view(torch.int32) ^ golden.float().contiguous().view(torch.int32)


def bit_histogram(candidate: torch.Tensor, golden: torch.Tensor, xor: torch.Tensor | None = None) -> np.ndarray:
    """Count of elements whose bit ``b`` (0 = mantissa LSB, 31 = sign) differs, for b in 0..31."""
    xor = xor_bits(candidate, golden) if xor is None else xor
    # Four byte histograms (one pass each) instead of 32 bit passes.
    as_bytes = xor.reshape(-1).numpy().astype("<i4", copy=False).view(np.uint8).reshape(-1, 4)
    return np.concatenate([np.bincount(as_bytes[:, k], minlength=256) @ _BYTE_BITS for k in range(4)])


def popcount(x: torch.Tensor) -> torch.Tensor:
    """Set bits per element of the low 32 bits of an integer tensor (as int64)."""
    low = x.to(torch.int64).bitwise_and(0xFFFFFFFF).numpy().astype(np.uint32)
    return torch.from_numpy(np.bitwise_count(low).astype(np.int64)).reshape(x.shape)


def periodicity(mass: np.ndarray, max_period: int = MAX_PERIOD) -> tuple[int, float]:
    """The longest period K (>= 2) whose best residue class holds at least 99 % of the mass
    that any period holds, and that fraction. (0, 0.0) when there is no mass or < 4 entries.

    The longest qualifying K is the fixed stride: every multiple-of-K pattern is also
    K/2-periodic, so shorter periods always tie.
    """
    total = float(mass.sum())
    if total <= 0 or not math.isfinite(total) or len(mass) < 4:
        return 0, 0.0
    best = {}
    for k in range(2, min(max_period, len(mass) // 2) + 1):
        padded = np.zeros(math.ceil(len(mass) / k) * k)
        padded[:len(mass)] = mass
        best[k] = float(padded.reshape(-1, k).sum(0).max()) / total
    if not best:
        return 0, 0.0
    top = max(best.values())
    period = max(k for k, f in best.items() if f >= 0.99 * top)
    return period, best[period]


def tile_concentration(err2d: np.ndarray, tile: int = TILE) -> float:
    """Largest fraction of the error mass inside one aligned ``tile`` x ``tile`` tile."""
    total = float(err2d.sum())
    if total <= 0 or not math.isfinite(total):
        return 0.0
    rows, cols = (math.ceil(s / tile) * tile for s in err2d.shape)
    padded = np.zeros((rows, cols))
    padded[:err2d.shape[0], :err2d.shape[1]] = err2d
    tiles = padded.reshape(rows // tile, tile, cols // tile, tile).sum(axis=(1, 3))
    return float(tiles.max()) / total


def downsample(m: np.ndarray, size: int = MAP_SIZE) -> np.ndarray:
    """``m`` summed into at most ``size`` x ``size`` blocks (an error map small enough to keep)."""
    for axis in (0, 1):
        if m.shape[axis] > size:
            edges = np.linspace(0, m.shape[axis], size + 1).round().astype(int)[:-1]
            m = np.add.reduceat(m, edges, axis=axis)
    return m


def spatial(err: torch.Tensor) -> dict:
    """Error mass per row and per column of the matrix view, periodicity, tile concentration and a
    downsampled error map (``map``, flattened, shape in ``map_rows`` x ``map_cols``)."""
    m = np.nan_to_num(matrix(err).double().numpy(), nan=0.0, posinf=0.0)
    rows, cols = m.sum(1), m.sum(0)
    small = downsample(m)
    col_period, col_frac = periodicity(cols)
    row_period, row_frac = periodicity(rows)
    return {"row_mass": rows, "col_mass": cols, "col_period": col_period, "col_period_frac": col_frac,
            "row_period": row_period, "row_period_frac": row_frac, "tile_frac": tile_concentration(m),
            "map": small.reshape(-1), "map_rows": small.shape[0], "map_cols": small.shape[1]}


def tensor_scores(candidate: torch.Tensor, golden: torch.Tensor, reference: torch.Tensor,
                  noise: dict | None = None, err: torch.Tensor | None = None,
                  golden_bits: torch.Tensor | None = None) -> dict:
    """All scores of one candidate tensor; ``reference`` is the float64 result on the same inputs.

    ``rel_*`` divide by the same score of |golden - reference|: 1 means "as far from golden as
    float32 rounding itself", PEAT's yardstick. ``noise`` (that summary), ``err``
    (|candidate - golden|) and ``golden_bits`` (``ordered_bits(golden)``) may be passed in
    when already computed: one golden serves many candidates.
    """
    err = abs_error(candidate, golden) if err is None else err
    noise = summary(abs_error(golden, reference)) if noise is None else noise
    abs_scores = summary(err)
    ulp = ulp_distance(candidate, golden, golden_bits).reshape(-1).numpy()
    xor = xor_bits(candidate, golden)
    out = {f"err_{k}": v for k, v in abs_scores.items()}
    out |= {f"noise_{k}": v for k, v in noise.items()}
    out |= {f"rel_{k}": abs_scores[k] / max(noise[k], TINY) for k in abs_scores}
    out |= {
        "ulp_median": float(np.partition(ulp, ulp.size // 2)[ulp.size // 2]), "ulp_max": float(ulp.max()),
        "frac_diff": float((xor != 0).double().mean()),
        "nonfinite": int((~torch.isfinite(candidate) & torch.isfinite(golden)).sum()),
        "bits": bit_histogram(candidate, golden, xor),
    }
    return out | spatial(err)
