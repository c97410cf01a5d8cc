"""Per-tensor error scores of a candidate result against the golden float32 result.

PEAT's scores (max, mean, mean of the top 10 % and variance of the absolute error), the
same relative to the float32-vs-float64 rounding noise of that very tensor, ULP distances,
the fraction of differing elements, a histogram of the bit positions where golden and
candidate differ, a spatial profile in the matrix view of ``peat.errors.matrix`` (rows x
columns; channels are the columns of NCHW tensors) and the count of non-finite values
where golden is finite. Everything works on plain tensors; nothing here knows about files.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from . import tensor_stats
from .errors import matrix

TOP_FRACTION = 0.10
TILE = 16           # tile edge for the tile-concentration score
MAX_PERIOD = 64     # longest column/row period searched by the periodicity score
TINY = 1e-30
MAP_SIZE = 32       # edge of the downsampled spatial error map kept per tensor


@dataclass(frozen=True)
class Golden:
    """What every candidate's scores need from one golden tensor, worked out once per tensor
    (one golden serves the kernel, every error model and every reference)."""

    matrix: np.ndarray     # float32, the matrix view (``as_matrix``)
    bits: np.ndarray       # float32 bit patterns, flat int32, in the tensor's own order
    finite: bool           # every element finite
    lo: float              # smallest and largest finite element (nan when none is finite)
    hi: float

    @classmethod
    def of(cls, golden: torch.Tensor) -> "Golden":
        g = golden.detach().float().cpu().contiguous()
        bits = g.view(torch.int32).reshape(-1).numpy()
        m = as_matrix(g)
        finite = bool(np.isfinite(m.max(initial=0.0)) and np.isfinite(m.min(initial=0.0)))
        values = m if finite else m[np.isfinite(m)]
        lo, hi = (float(values.min()), float(values.max())) if values.size else (math.nan, math.nan)
        return cls(m, bits, finite, lo, hi)

    @functools.cached_property
    def close_bound(self) -> np.ndarray:
        """Per element (flat, the tensor's own order), the largest difference ``torch.allclose``
        accepts with its defaults, worked out as torch does, in float32: atol + |rtol * golden|.
        The same for every candidate, so only once (a frozen dataclass caches it all the same)."""
        g = self.bits.view(np.float32)
        return np.float32(1e-8) + np.abs(np.float32(1e-5) * g)


@dataclass(frozen=True)
class Diff:
    """One candidate against golden: ``abs_error`` and what its scores read from it, found
    together (``difference``)."""

    err: np.ndarray               # abs_error(candidate, golden)
    top: float                    # its largest value
    bits: dict                    # the bit-level scores (_bits_found)


def difference(candidate: torch.Tensor, gold: Golden) -> Diff:
    """``Diff`` of a candidate against golden: one pass of ``tensor_stats.compare`` reads the
    candidate in the matrix view (no transposed copy) and finds its error, its largest value
    and the bit-level scores; numpy and torch ops without the C loop,
    and ``abs_error``'s rules where a difference is not finite."""
    candidate = candidate.detach().float().cpu()
    found = tensor_stats.compare(candidate, gold.matrix, gold.finite)
    bits = _bits_found(candidate, gold, found)
    if found is None or not found["finite"]:
        err = abs_error(candidate, None, gold)
        return Diff(err, float(err.max(initial=0.0)), bits)
    return Diff(found["err"], found["top"], bits)


def as_matrix(t) -> np.ndarray:
    """A tensor's matrix view (``peat.errors.matrix``: channels as columns for NCHW tensors,
    else the last dimension) as a numpy array. Every score and Detector rule works in it."""
    return matrix(torch.as_tensor(t).detach().cpu(), copy=False).numpy()


def masked(t: torch.Tensor, mask: np.ndarray) -> np.ndarray:
    """``as_matrix(t)[mask]`` without the transposed copy of a whole NCHW tensor: the mask picks
    from a strided view, in the same (row-major) order."""
    t = torch.as_tensor(t).detach().cpu()
    if t.dim() != 4:
        return as_matrix(t)[mask]
    view = t.movedim(1, -1).numpy()
    return view[mask.reshape(view.shape)]


def abs_error(candidate: torch.Tensor, golden: torch.Tensor, gold: Golden | None = None) -> np.ndarray:
    """|candidate - golden| in float64 in the matrix view, with NaN differences as inf (an
    infinite one becomes the largest float64, ``numpy.nan_to_num``'s default); 0 where the
    candidate holds golden's own NaN or inf."""
    gold = Golden.of(golden) if gold is None else gold
    c = as_matrix(candidate)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, made inf below
        err = np.subtract(c, gold.matrix, dtype=np.float64)
    np.abs(err, out=err)
    if not np.isfinite(err.max(initial=0.0)):  # NaN or inf inside: one pass spared otherwise
        np.nan_to_num(err, copy=False, nan=math.inf)
        if not gold.finite:  # golden's own NaN or inf, reproduced, is no error (inf - inf is NaN)
            err[(c == gold.matrix) | (np.isnan(c) & np.isnan(gold.matrix))] = 0
    return err


# Infinite differences are kept as the largest float64 (``abs_error``): sums and ratios over them
# overflow to inf on purpose, as torch's did, without numpy's warnings.
QUIET = np.errstate(over="ignore", invalid="ignore")


@QUIET
def summary(err, largest: float | None = None) -> dict:
    """PEAT's four scores of an absolute-error array (``err`` >= 0, NaN-free as ``abs_error``
    gives it): max, mean, top-10 % mean, variance. ``largest``: ``err.max(initial=0.0)``, when
    known (``Diff.top``): two passes over ``err`` spared."""
    flat = np.asarray(err, dtype=np.float64).reshape(-1)
    largest = flat.max(initial=0.0) if largest is None else largest
    finite = flat if np.isfinite(largest) else flat[np.isfinite(flat)]
    if finite.size == 0:
        return {"max": math.nan, "mean": math.nan, "top10": math.nan, "var": math.nan}
    k = max(1, math.ceil(TOP_FRACTION * finite.size))
    # Summed in ascending order: a float64 sum depends on the order of its terms, and the score
    # must not depend on where in the tensor the largest errors lie.
    known = largest if finite is flat else None
    top = tensor_stats.top_ascending(finite.reshape(-1), k, known)
    top = _ascending(_top(finite, k, known)) if top is None else top
    largest, top10 = float(top[-1]) if top.size else 0.0, float(top.sum() / k)
    mean = float(finite.mean())
    spread = tensor_stats.squared_deviation_sum(finite, mean)  # not np.dot: BLAS threads would spin
    return {"max": largest, "mean": mean, "top10": top10, "var": spread / finite.size}


def _top(values: np.ndarray, k: int, largest: float | None = None) -> np.ndarray:
    """The ``k`` largest of ``values`` (finite float64 >= 0), less the zeros among them: those
    above the k-th largest, then that value as often as it is among them. ``tensor_stats.top``
    (a radix select on the bit patterns, which order as the values; ``largest``, the largest
    value when known, spares it a pass), else ``np.partition``."""
    flat = np.ascontiguousarray(values).reshape(-1)
    found = tensor_stats.top(flat, k, largest)
    if found is not None:
        return found
    kth = np.partition(flat, flat.size - k)[flat.size - k]
    above = flat[flat > kth]
    return above if kth == 0 else np.concatenate([above, np.full(k - above.size, kth)])


def _ascending(values: np.ndarray) -> np.ndarray:
    """``np.sort(values)`` of ``_top``'s values (float64 >= 0): ``tensor_stats.ascending``'s radix
    sort where it applies, the same array."""
    found = tensor_stats.ascending(values)
    return np.sort(values) if found is None else found


# Bit b of every byte value, for the per-bit histogram of a byte histogram.
_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(np.int64)


def _bit_counts(xor: np.ndarray) -> np.ndarray:
    """Per bit ``b`` (0 = mantissa LSB, 31 = sign), how many int32 XOR patterns have it set."""
    # Four byte histograms (one pass each) instead of 32 bit passes, skipping the bytes no
    # element has a bit set in (rounding differences leave sign and exponent bytes clear).
    xor = xor.astype("<i4", copy=False)
    as_bytes = xor.view(np.uint8).reshape(-1, 4)
    seen = int(np.bitwise_or.reduce(xor)) if xor.size else 0
    return np.concatenate([np.bincount(as_bytes[:, k], minlength=256) @ _BYTE_BITS if (seen >> 8 * k) & 0xFF
                           else np.zeros(8, dtype=np.int64) for k in range(4)])


def periodicity(mass: np.ndarray, max_period: int = MAX_PERIOD) -> tuple[int, float]:
    """The longest period K (>= 2) whose best residue class holds at least 99 % of the mass
    that any period holds, and that fraction. (0, 0.0) when there is no mass or < 4 entries.

    The longest qualifying K is the fixed stride: every multiple-of-K pattern is also
    K/2-periodic, so shorter periods always tie.
    """
    total = float(mass.sum())
    kmax = min(max_period, len(mass) // 2)
    if total <= 0 or not math.isfinite(total) or len(mass) < 4 or kmax < 2:
        return 0, 0.0
    maxima = tensor_stats.class_maxima(mass, kmax)
    best = (maxima if maxima is not None else _class_maxima(mass, kmax))[2:] / total  # best[k - 2]: period k
    period = int(np.flatnonzero(best >= 0.99 * best.max())[-1])
    return period + 2, float(best[period])


def _class_maxima(mass: np.ndarray, kmax: int) -> np.ndarray:
    """``tensor_stats.class_maxima`` with numpy (a class sum down a reshaped column adds in
    index order too)."""
    best = np.zeros(kmax + 1)
    for k in range(2, kmax + 1):
        whole = len(mass) // k * k
        classes = mass[:whole].reshape(-1, k).sum(0)
        classes[:len(mass) - whole] += mass[whole:]
        best[k] = classes.max()
    return best


def per_tile(m: np.ndarray, tile: int = TILE, reduce: np.ufunc = np.add, bands: np.ndarray | None = None) -> np.ndarray:
    """``reduce`` (``np.add``, ``np.maximum``) of a matrix of values >= 0 over each of its
    aligned ``tile`` x ``tile`` tiles (the last ones may be partial). ``bands``: the first
    step (each band of ``tile`` rows reduced down its columns) when already known."""
    rows, cols = (math.ceil(s / tile) * tile for s in m.shape)
    # Zeros in the last partial tiles change no sum or maximum of values >= 0.
    if bands is None:
        if (rows, cols) != m.shape:
            m = _padded(m, rows, cols)
        # Rows of a tile first (contiguous), then columns: faster than one reduction over both axes.
        bands = reduce.reduce(m.reshape(rows // tile, tile, cols), axis=1)
    elif bands.shape[1] != cols:
        bands = _padded(bands, rows // tile, cols)
    return reduce.reduce(bands.reshape(rows // tile, cols // tile, tile), axis=2)


def _padded(m: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), dtype=m.dtype)
    out[:m.shape[0], :m.shape[1]] = m
    return out


def tile_concentration(err2d: np.ndarray, tile: int = TILE, total: float | None = None,
                       bands: np.ndarray | None = None) -> float:
    """Largest fraction of the error mass (``total``, when known) inside one aligned ``tile`` x
    ``tile`` tile (``bands``: ``per_tile``'s first step, when known)."""
    total = float(err2d.sum()) if total is None else total
    if total <= 0 or not math.isfinite(total):
        return 0.0
    return float(per_tile(err2d, tile, bands=bands).max()) / total


def downsample(m: np.ndarray, size: int = MAP_SIZE, blocks: np.ndarray | None = None) -> np.ndarray:
    """``m`` summed into at most ``size`` x ``size`` blocks (an error map small enough to keep).
    ``blocks``: the first step (``m`` summed down each block of ``bin_edges`` rows), when known."""
    if m.shape[0] > size:  # a sum per block of whole rows: contiguous, unlike a reduction down columns
        if blocks is None:
            edges = bin_edges(m.shape[0], size)
            blocks = np.stack([m[a:b].sum(0) for a, b in zip(edges[:-1], edges[1:])])
        m = blocks
    if m.shape[1] > size:
        m = np.add.reduceat(m, bin_edges(m.shape[1], size)[:-1], axis=1)
    return m


@functools.lru_cache(maxsize=256)
def bin_edges(n: int, bins: int) -> np.ndarray:
    """Edges of ``bins`` near-equal bins of ``n`` items (read-only: one array serves every
    tensor of the same shape, which spares a linspace per candidate)."""
    edges = np.linspace(0, n, bins + 1).round().astype(int)
    edges.flags.writeable = False
    return edges


def _down_columns(m: np.ndarray) -> tuple:
    """``m.sum(0)``, ``per_tile``'s bands and ``downsample``'s row blocks (None when it keeps
    every row), all sums down the columns: one pass of ``tensor_stats.column_sums`` where it
    applies (the same sums, added in the same order), else numpy's."""
    edges = bin_edges(m.shape[0], MAP_SIZE) if m.shape[0] > MAP_SIZE else None
    found = tensor_stats.column_sums(m, TILE, edges)
    return found if found is not None else (m.sum(0), None, None)


@QUIET
def spatial(m, top: float | None = None) -> dict:
    """Error mass per row and per column of an error matrix (``abs_error``'s matrix view),
    periodicity, tile concentration and a downsampled error map (``map``, flattened, shape in
    ``map_rows`` x ``map_cols``). Non-finite errors carry no mass here. ``top``: the matrix's
    largest value, when known."""
    # Row-major whatever the layout (abs_error's of an N = 1 NCHW tensor is column-major): numpy's sums
    # down and across the matrix round alike then, and as tensor_stats.column_sums does.
    m = np.ascontiguousarray(m, dtype=np.float64)
    # Rows counted, not -1: a reshape cannot infer them beside an empty tensor's 0 columns.
    m = m.reshape(math.prod(m.shape[:-1]), m.shape[-1]) if m.ndim else m.reshape(1, 1)
    if not math.isfinite(m.max(initial=0.0) if top is None else top):
        m = np.nan_to_num(m, nan=0.0, posinf=0.0)
    cols, bands, blocks = _down_columns(m)
    rows = m.sum(1)
    small = downsample(m, blocks=blocks)
    col_period, col_frac = periodicity(cols)
    row_period, row_frac = periodicity(rows)
    return {"row_mass": rows, "col_mass": cols, "col_period": col_period, "col_period_frac": col_frac,
            "row_period": row_period, "row_period_frac": row_frac,
            "tile_frac": tile_concentration(m, total=float(cols.sum()), bands=bands),
            "map": small.reshape(-1), "map_rows": small.shape[0], "map_cols": small.shape[1]}


def _bits_found(candidate: torch.Tensor, gold: Golden, found: dict | None) -> dict:
    """The bit-level scores from the float32 bit patterns: ULP distance (median, max), fraction of
    differing elements, non-finite count (where golden is finite) and the histogram of differing
    bit positions (``_bit_counts``), from what ``tensor_stats.compare`` found (None: without
    the C loop, numpy's)."""
    if found is None:
        return _bit_scores_numpy(candidate.contiguous().view(torch.int32).reshape(-1).numpy(), gold)
    return _bit_scores_of(found["counts"], found["ulp"])


def _bit_scores_of(counts: np.ndarray, ulp: np.ndarray) -> dict:
    """``_bits_found`` from ``tensor_stats.compare``'s counts and ULP distances."""
    n = ulp.size
    ndiff = int(counts[32])
    median = 0  # when most elements agree
    if n - ndiff <= n // 2:
        median = tensor_stats.select(ulp, n // 2)
        median = np.partition(ulp, n // 2)[n // 2] if median is None else median
    return {"ulp_median": float(median), "ulp_max": float(counts[34]), "frac_diff": ndiff / n,
            "nonfinite": int(counts[33]), "bits": counts[:32].copy()}


def _bit_scores_numpy(bits: np.ndarray, gold: Golden) -> dict:
    """``_bits_found`` without the C loop. Elements whose bits agree contribute zeros only, so
    the rest works on the differing elements alone unless they are most of the tensor."""
    xor = bits ^ gold.bits
    n = xor.size
    where = np.flatnonzero(xor)
    if where.size > n // 2:
        cand, golden = bits, gold.bits
    else:
        cand, golden, xor = bits[where], gold.bits[where], xor[where]
    ulp = np.subtract(_ordered(cand), _ordered(golden), dtype=np.int64)
    ulp = np.abs(ulp, out=ulp)
    below = n - ulp.size  # agreeing elements left out: all at ULP distance 0, the smallest
    exponent = np.int32(0x7F800000)
    nonfinite = (cand & exponent) == exponent
    if not gold.finite:
        nonfinite &= (golden & exponent) != exponent
    return {"ulp_median": float(_order_statistic(ulp, n // 2 - below)), "ulp_max": float(ulp.max()) if ulp.size else 0.0,
            "frac_diff": where.size / n if n else math.nan, "nonfinite": int(np.count_nonzero(nonfinite)),
            "bits": _bit_counts(xor)}


def _ordered(bits: np.ndarray) -> np.ndarray:
    """int32 float32 patterns mapped so that adjacent floats differ by one (ULP order), still
    int32 (they fit; their differences need int64): a negative pattern -2^31 + L maps to -L,
    branch-free (sign = -1 there)."""
    sign = bits >> 31
    return (bits ^ (sign & 0x7FFFFFFF)) - sign


def _order_statistic(values: np.ndarray, i: int):
    """The ``i``-th smallest of ``values`` (>= 0); 0 when ``i`` < 0 (an omitted zero) or past
    the end (an empty tensor's median)."""
    if not 0 <= i < values.size or values.size - np.count_nonzero(values) > i:
        return 0
    return np.partition(values, i)[i]


def tensor_scores(candidate: torch.Tensor, golden: torch.Tensor, reference: torch.Tensor,
                  noise: dict | None = None, diff: Diff | None = None, gold: Golden | None = None) -> dict:
    """All scores of one candidate tensor; ``reference`` is the float64 result on the same inputs.

    ``rel_*`` divide by the same score of |golden - reference|: 1 means "as far from golden as
    float32 rounding itself", PEAT's yardstick. ``noise`` (that summary), ``diff``
    (``difference(candidate, gold)``) and ``gold`` (``Golden.of(golden)``) may be passed in
    when already computed: one golden serves many candidates.
    """
    gold = Golden.of(golden) if gold is None else gold
    diff = difference(candidate, gold) if diff is None else diff
    noise = summary(abs_error(reference, golden, gold)) if noise is None else noise
    abs_scores = summary(diff.err, diff.top)
    out = {f"err_{k}": v for k, v in abs_scores.items()}
    out |= {f"noise_{k}": v for k, v in noise.items()}
    out |= {f"rel_{k}": abs_scores[k] / max(noise[k], TINY) for k in abs_scores}
    return out | diff.bits | spatial(diff.err, diff.top)
