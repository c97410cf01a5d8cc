"""Tensor evidence for the Detector's rules (``peat.detect``): measured envelopes, the sets of
wrong elements and their shapes, all in the matrix view of ``peat.scores.as_matrix``."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage

from . import tensor_stats
from .detect import Rules, s_class
from .scores import QUIET, Diff, Golden, abs_error, as_matrix, difference, masked, per_tile, summary

PRECISIONS = ("fp16", "bf16", "tf32")  # golden rounded so: the reduced-precision envelope
EPS32 = 2.0 ** -23


@dataclass(frozen=True)
class TileBound:
    """A bound per element of a matrix of ``shape`` that is one value per aligned ``tile`` x
    ``tile`` tile (``tiles``). Held per element it would be as large as two float32 tensors,
    alive while every candidate of an output is scored; held so, 1/tile² of that."""

    tiles: np.ndarray  # float64, (ceil(rows / tile), ceil(cols / tile))
    tile: int
    shape: tuple[int, int]

    def __getitem__(self, mask: np.ndarray) -> np.ndarray:
        """The bounds of the elements a boolean ``mask`` of ``shape`` picks, in its (row-major) order."""
        rows, cols = np.nonzero(mask)
        return self.tiles[rows // self.tile, cols // self.tile]

    def full(self) -> np.ndarray:
        return per_element(self.tiles, self.tile, self.shape)


class Envelopes(dict):
    """The scalar envelopes of one tensor (what playback writes into its table row), with two
    attributes that are not written, needed only while the candidates of that output are scored:
    ``local``, the per-element reduced-precision envelope (a ``TileBound``), and ``footprints``,
    for each of fp16/bf16/tf32 the elements where rounding to it moves the result beyond
    ``tau32 / BAND`` (may) and beyond ``tau32 * BAND`` (must). Both are in the matrix view. And
    ``noise``, the ``peat.scores.summary`` of |golden - reference| that every candidate's
    ``rel_*`` scores divide by (the envelope measures that same difference). And ``overflowed``
    (None where there is none), the elements where golden is NaN or Inf and the reference
    rounds to a finite float32: float32's own overflow (partial sums past its largest value,
    Inf - Inf), no result to judge a candidate by."""

    local: TileBound | None = None
    noise: dict | None = None
    overflowed: np.ndarray | None = None
    footprints: dict[str, tuple[np.ndarray, np.ndarray, int, int]] = {}  # may, must and their sizes


@QUIET
def envelopes(golden: torch.Tensor, reference: torch.Tensor, rounded: dict[str, torch.Tensor],
              rules: Rules = Rules(), gold: Golden | None = None, footprints: bool = True,
              floor: float = 0.0) -> Envelopes:
    """The fp32 and reduced-precision envelopes of one tensor, measured on its own inputs.

    ``taurp`` is the worst over the tensor; ``local`` holds, for every aligned TILE x TILE tile
    of the matrix view, KRP times the worst fp16/bf16/tf32 error in it (floored at ``tau32``),
    the bound of each of its elements: rounding errors scale with the magnitudes around them
    (outlier channels, a gradient block much larger than its neighbours). ``footprints`` are
    the S sets the references themselves have: where, on these inputs, a correct
    reduced-precision result leaves the fp32 envelope. ``gold`` (``Golden.of(golden)``) may be
    passed in when known. Without ``footprints``, they are left to ``scored_references``:
    playback scores the rounded references as candidates and so finds their errors anyway,
    one at a time. ``floor``: float32's rounding where |golden - reference| cannot show it (see
    ``peat.playback.summed_floor``), a lower bound of the noise the fp32 envelope scales.
    """
    gold = Golden.of(golden) if gold is None else gold
    ref = as_matrix(reference)
    absmax = max(abs(gold.lo), abs(gold.hi)) if math.isfinite(gold.lo) else 0.0
    noise = abs_error(ref, golden, gold)
    noise32 = float(noise.max(initial=0.0))
    # abs_error's NaN as inf and inf as the largest float64 (no float32 difference comes near it):
    # counted from scratch, else one golden overflow made tau32 infinite and every error in the tensor none.
    if not noise32 < np.finfo(np.float64).max:
        noise32 = _finite_max(_distance(gold.matrix, ref))
    # rel_*'s divisor, float32's rounding where golden holds a value: one overflowed element made it
    # the largest float64, and every candidate's rel_* 0 or NaN.
    noise = summary(noise if gold.finite else judged(noise, ~np.isfinite(gold.matrix)))
    overflowed = None if gold.finite else ~np.isfinite(gold.matrix) & np.isfinite(ref.astype(np.float32))
    tau32 = rules.k32 * max(noise32, EPS32 * absmax, floor, 1e-38)
    rp, tiles, prints = {}, [], {}
    for p, t in rounded.items():  # one matrix view (an NCHW tensor's is a copy) and float64 difference at a time
        m = as_matrix(t)
        d = _distance(m, ref)
        top = float(d.max(initial=0.0))  # NaN or inf where a difference is
        rp[p] = top if math.isfinite(top) else _finite_max(d)
        if gold.matrix.size:
            # NaN and inf count as 0; a difference without them is used as it is, not copied. Each is
            # reduced to its tiles: the envelope is a tile's worst times KRP, so the worst over
            # precisions, the scaling and the floor need one value per tile, not per element.
            tiles.append(per_tile(d if math.isfinite(top) else np.nan_to_num(d, nan=0.0, posinf=0.0), rules.tile,
                                  np.maximum))
            del d  # before the footprint's arrays are made
            if footprints:
                prints[p] = footprint(judged(abs_error(m, golden, gold), overflowed), tau32, rules)
        del m
    taurp = rules.krp * max([*rp.values(), tau32 / rules.krp])
    env = Envelopes({"noise32_max": noise32, **{f"noise_{p}_max": v for p, v in rp.items()}, "tau32": tau32,
                     "taurp": taurp})
    env.noise, env.footprints = noise, prints
    env.overflowed = overflowed if overflowed is not None and overflowed.any() else None
    if tiles:
        env.local = TileBound(np.maximum(rules.krp * functools.reduce(np.maximum, tiles), tau32), rules.tile,
                              gold.matrix.shape)
    return env


def footprint(err: np.ndarray, tau32: float, rules: Rules = Rules()) -> tuple[np.ndarray, np.ndarray, int, int]:
    """A reference's footprint (``Envelopes.footprints``) from its error against golden."""
    return _beyond(err, tau32 / rules.band, tau32 * rules.band)[:4]


def scored_references(env: Envelopes, rounded: dict[str, torch.Tensor], gold: Golden,
                      rules: Rules = Rules()) -> Iterator[tuple[str, Diff]]:
    """Each rounded reference's ``Diff`` against golden, once its footprint is in ``env`` (made
    with ``footprints=False``): the references are candidates as well, so one error serves both
    the footprint and the reference's row, and the errors come one by one. A reference's row
    sees the footprints so far; its own matches it, so the first footprint to match is the one
    it would find among all three."""
    for p in PRECISIONS:
        diff = difference(rounded[p], gold)
        env.footprints[p] = footprint(judged(diff.err, env.overflowed), env["tau32"], rules)
        yield p, diff
        del diff  # before the next one is made (the caller lets go of it too)


def judged(err: np.ndarray, overflowed: np.ndarray | None) -> np.ndarray:
    """``err`` (``abs_error``'s) with 0 where golden overflowed (``Envelopes.overflowed``): there a
    correct kernel summing in another order gives golden's Inf, a NaN (Inf - Inf) or a finite value
    near the reference alike, and each read as an infinite error: the fp64 reference itself failed."""
    if overflowed is None:
        return err
    err = err.copy()
    err[overflowed] = 0
    return err


def _distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = np.subtract(a, b, dtype=np.float64)  # inf - inf: NaN, which _finite_max and the envelopes skip
    return np.abs(d, out=d)


def per_element(tiles: np.ndarray, tile: int, shape: tuple) -> np.ndarray:
    """One value per aligned ``tile`` x ``tile`` tile spread over every element of a matrix of
    ``shape`` (the last tiles may be partial)."""
    rows, cols = shape
    return np.repeat(np.repeat(tiles, tile, 0)[:rows], tile, 1)[:, :cols]


def rounding_footprint(over32: np.ndarray, n: int, env: dict, cover: float) -> str:
    """The reference precision whose footprint S matches, or "": >= ``cover`` of S lies where
    rounding to it may leave the fp32 envelope, and S holds >= ``cover`` of where it must
    (the band between is where another rounding order falls either side). Then S's layout is
    the one rounding to that precision gives these inputs, not a fault's."""
    for p, (may, must, n_may, n_must) in getattr(env, "footprints", {}).items():
        if n_may < cover * n or n < cover * n_must:  # the sizes alone rule it out
            continue
        if np.count_nonzero(over32 & may) >= cover * n and np.count_nonzero(over32 & must) >= cover * n_must:
            return p
    return ""


def _finite_max(t: np.ndarray) -> float:
    if t.size == 0:
        return 0.0
    top = float(t.max())
    if math.isfinite(top):  # the common case, without a masked copy
        return top
    t = t[np.isfinite(t)]
    return float(t.max()) if t.size else 0.0


@QUIET
def evidence(candidate: torch.Tensor, golden: torch.Tensor, env: dict, rules: Rules = Rules(),
             diff: np.ndarray | None = None, nonfinite: int | None = None, gold: Golden | None = None,
             top: float | None = None) -> dict:
    """Scalar features the rules use, for one candidate tensor against golden.

    ``diff`` (``peat.scores.abs_error(candidate, golden)``), ``nonfinite`` (the count of
    non-finite values where golden is finite) and ``gold`` (``Golden.of(golden)``) may be
    passed in when already computed, and ``top``, ``diff``'s largest value. With ``env`` from
    ``envelopes``, G is measured against its per-tile envelope and S is compared with the
    references' footprints; with a plain dict (a table row), against ``taurp`` and no
    footprint. The layout of S and of G is only worked out when the rules can need it.
    """
    gold = Golden.of(golden) if gold is None else gold
    diff = abs_error(candidate, golden, gold) if diff is None else diff
    if (overflowed := getattr(env, "overflowed", None)) is not None:
        diff, top = judged(diff, overflowed), None
    if nonfinite is None:
        nonfinite = int(np.count_nonzero(~np.isfinite(as_matrix(candidate)) & np.isfinite(gold.matrix)))
    bound = getattr(env, "local", None)
    bound = env["taurp"] if bound is None else bound
    top = _finite_max(diff) if top is None or not math.isfinite(top) else top
    over32, gross, n32, ngross, ratio = _beyond(diff, env["tau32"], bound)
    out = {"numel": int(diff.size), "nonfinite": nonfinite, "err_over_tau32": top / env["tau32"],
           "err_over_taurp": ratio if isinstance(bound, TileBound) else top / bound, "n32": n32, "ngross": ngross}
    out["s_rounding"] = rounding_footprint(over32, n32, env, rules.cover) if n32 else ""
    s = shape(over32, candidate, gold, env["tau32"], rules, layout=not out["s_rounding"])
    out |= {f"s_{k}": v for k, v in s.items()}
    out["s_tail"] = bool(s["sparse"] and not out["s_rounding"]) and spread_tail(diff, n32, env["tau32"], rules)
    needs_gross = ngross > 0 and n32 > 0 and s_class(out, rules) is None
    g = shape(gross, candidate, gold, bound, rules, layout=needs_gross, lone=True)
    out |= {f"g_{k}": v for k, v in g.items()}
    return out


def spread_tail(diff: np.ndarray, n32: int, tau32: float, rules: Rules) -> bool:
    """Whether the ``n32`` elements of S are only the tail of an error spread the candidate has
    everywhere: S is at most 1 - COVER of the elements beyond golden's own worst rounding,
    tau32 / K32 (measured: Winograd F(4x4, 3x3) moves 10-25 % of a convolution's output beyond
    it and a few dozen beyond tau32; a fault on golden's result moves only its own elements)."""
    return n32 <= (1 - rules.cover) * np.count_nonzero(diff > tau32 / rules.k32)


def _beyond(diff: np.ndarray, tau32: float, bound: float | TileBound) -> tuple:
    """S and G (``diff`` beyond ``tau32``, beyond ``bound``: a number or a ``TileBound``), their
    sizes and the largest finite diff / bound: ``tensor_stats.beyond``'s one pass, or numpy's.
    (The footprints are two such sets of a reference: beyond tau32 / BAND and tau32 * BAND.)"""
    tiled = isinstance(bound, TileBound)
    found = (tensor_stats.beyond(diff, tau32, bound.tiles if tiled else bound, bound.tile if tiled else 0)
             if diff.size else None)
    if found is not None:
        return found
    bound = bound.full() if tiled else bound
    over32, gross = diff > tau32, diff > bound
    ratio = _finite_max(diff / bound) if tiled else math.nan  # unused for a number
    return over32, gross, int(np.count_nonzero(over32)), int(np.count_nonzero(gross)), ratio


def shape(mask: np.ndarray, candidate: torch.Tensor, gold: Golden, noise, rules: Rules, layout: bool = True,
          lone: bool = False) -> dict:
    """How the wrong elements ``mask`` (matrix view) are laid out and what they look like;
    ``noise`` is the envelope they are beyond (a number, or a ``TileBound``). Without
    ``layout``, only their count. ``lone``: the wrong value of a one-element tensor (a loss)
    counts as scattered, since it has no layout and only its value can say what went wrong;
    for G alone, as S's lone value may still be rounding that no footprint caught."""
    n = int(np.count_nonzero(mask))
    few = max(rules.sparse_min, rules.sparse * mask.size)
    scattered = n < mask.size / 2 or (lone and mask.size == 1)
    out = {"n": n, "sparse": 0 < n <= few and scattered, "block_cover": 0.0, "block_area": 0.0,
           "block_tiles": 0, "lane_cover": 0.0, "lane_stride": 0, "lane_axis": "", "zero_frac": 0.0,
           "bit_frac": 0.0, "inrange_frac": 0.0}
    if n == 0 or mask.size == 0 or not layout:
        return out
    if n * rules.cover <= rules.block_area * mask.size:  # else no tiles within block_area can explain S
        out |= _blocks(mask, rules)
    # A vector's values, for a stuck lane: a row's (a norm's weight gradient) or a column's (a one-output
    # linear layer's forward, a depthwise convolution's weight gradient), whose row lanes are its elements.
    vector = as_matrix(candidate).reshape(-1) if 1 in mask.shape else None
    out |= _lanes(mask, rules, out["sparse"], gold.matrix, 0.0 if isinstance(noise, TileBound) else noise, vector)
    if not out["sparse"]:
        return out
    c, g = masked(candidate, mask).astype(np.float32, copy=False), gold.matrix[mask]
    out["zero_frac"] = float(np.mean((c == 0) & (g != 0)))
    out["bit_frac"] = float(np.mean(_few_bits(c, g, noise[mask] if isinstance(noise, TileBound) else noise)))
    if math.isfinite(gold.lo):
        out["inrange_frac"] = float(np.mean((c >= gold.lo) & (c <= gold.hi)))
    return out


def _blocks(m: np.ndarray, rules: Rules) -> dict:
    n = int(np.count_nonzero(m))
    # Tiles (>= 4 elements each) holding COVER of S leave at most this many components.
    most = (1 - rules.cover) * n + rules.cover * n / 4
    none = {"block_cover": 0.0, "block_area": 0.0, "block_tiles": 0}
    # Each isolated element is a component of its own: a scattered S has too many to label at all.
    if tensor_stats.isolated(m) > most:
        return none
    labels, count = ndimage.label(m, structure=np.ones((3, 3)))
    if count > most:
        return none
    size = np.bincount(labels.reshape(-1), minlength=count + 1)[1:]
    boxes = ndimage.find_objects(labels)
    height = np.array([rows.stop - rows.start for rows, _ in boxes])
    width = np.array([cols.stop - cols.start for _, cols in boxes])
    flat = min(m.shape) == 1  # a vector: a tile is a run of >= 4 wrong elements
    wide = (height >= 2) & (width >= 2) if not flat else (height * width >= 4)
    tiles = wide & (size >= 4) & (size >= rules.fill * height * width)
    return {"block_cover": float(size[tiles].sum() / n), "block_area": float((height * width)[tiles].sum()) / m.size,
            "block_tiles": int(np.count_nonzero(tiles))}


def _lanes(m: np.ndarray, rules: Rules, sparse: bool = True, golden: np.ndarray | None = None,
           noise: float = 0.0, candidate: np.ndarray | None = None) -> dict:
    """Columns (or rows) of a whole arithmetic progression of stride >= 2 (or one lane) that hold S.

    The progression runs through the filled lanes, those >= FILL wrong (a single one counts when
    it holds >= 2 wrong elements; lanes of one wrong element, a vector's or a 2-row view's, need
    >= 3 of them), at their spacing or a stride dividing it, and >= COVER of its lanes must hold S.

    Where S is not ``sparse``, a lane is filled at FILL of the fullest lane: a lane stuck at one
    value is wrong only where golden differs from it, in a ReLU's output or a trained gradient as
    little as a fifth of the lane (measured). A lane of the progression without S where
    ``golden`` (the matrix view) spans no more than ``noise`` (the envelope S is beyond) then
    counts neither way: it cannot show a lane stuck at one of its values. Such are a dead
    channel (one value throughout) and, in an input gradient, the row of a sample the network
    already gets right, near 0 throughout (measured: 5 of 16 stuck row lanes of ResNet-18's
    fc). A sparse S stays with the rules for a few scattered wrong elements, and a lane alone
    must be filled itself: rounding that leaves the fp32 envelope in one outlier channel, and not
    in most of it, is no lane fault. In a vector (lanes of one element), a progression whose
    first element is right and whose others all hold S counts that first one neither way when
    there are >= 4 others, or when ``candidate`` (the vector's values) holds golden's first value,
    nonzero, at every other: a lane stuck at its first value, where random values would differ."""
    best = {"lane_cover": 0.0, "lane_stride": 0, "lane_axis": ""}
    # Lanes are the columns, then the rows: counts holds each one's wrong elements, of ``length``.
    for axis, counts, length in (("col", np.count_nonzero(m, axis=0), m.shape[0]),
                                 ("row", np.count_nonzero(m, axis=1), m.shape[1])):
        n_lanes = len(counts)
        if n_lanes < 2:
            continue
        lanes = np.flatnonzero(counts >= rules.fill * (length if sparse else counts.max()))
        # One or two lanes of one wrong element each (a vector, or half of a 2-long lane) are no period.
        if len(lanes) == 0 or (len(lanes) < 3 and counts[lanes].max() < 2):
            continue
        if len(lanes) == 1 and counts[lanes[0]] < rules.fill * length:
            continue
        watch = golden is not None and not sparse and length > 1  # for lanes that cannot show S
        # The coarsest first: a progression may pass through lanes filled less than the fullest's half.
        strides = _divisors(int(np.gcd.reduce(np.diff(lanes)))) if len(lanes) > 1 else [n_lanes]
        for stride in strides:
            index = np.arange(lanes[0] % stride, n_lanes, stride) if stride < n_lanes else lanes
            held = counts[index]
            blind = _flat(golden, axis, index[held == 0], noise) if watch else 0
            # Lanes of one element (a vector's): a lane stuck at its first value leaves that element,
            # the progression's first, right; it counts neither way where >= 4 others hold S (3 evenly
            # spaced scattered values already read as a lane by chance: 0.85 % of 3 positions in 32).
            blind += int(length == 1 and held[0] == 0 and (np.count_nonzero(held) >= 4 or _stuck_at_first(
                index, held, golden, candidate)))
            if np.count_nonzero(held) < rules.cover * (len(held) - blind):
                continue
            cover = float(held.sum() / counts.sum())
            if cover > best["lane_cover"]:
                best = {"lane_cover": cover, "lane_stride": stride, "lane_axis": axis}
    return best


def _stuck_at_first(index: np.ndarray, held: np.ndarray, golden: np.ndarray | None,
                    candidate: np.ndarray | None) -> bool:
    """Whether every lane of the vector's progression ``index`` but its first holds S, at golden's
    first value (nonzero: zeros are random_zero's): >= 2 wrong elements equal to one another and
    to a value golden has, which random values never are."""
    if candidate is None or golden is None or len(index) < 3 or not held[1:].all():
        return False
    # Lanes of one element are a vector's elements, in its flat order whichever way it lies.
    first = golden.reshape(-1)[index[0]]
    return bool(first != 0 and np.all(candidate[index[1:]] == first))


@QUIET  # a span of golden's infinities is NaN (never within noise), of float32's extremes inf
def _flat(golden: np.ndarray, axis: str, index: np.ndarray, noise: float) -> int:
    """How many of the columns (``axis`` "col") or rows ``index`` of ``golden`` span no more than
    ``noise``, or are NaN throughout (golden's own: a NaN input feature's weight-gradient column,
    which a lane offset or stuck at its first value leaves NaN, as reproduced NaN is no error)."""
    if index.size == 0:
        return 0
    lanes = golden[:, index] if axis == "col" else golden[index].T
    return int(np.count_nonzero((lanes.max(axis=0) - lanes.min(axis=0) <= noise) | np.isnan(lanes).all(axis=0)))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` above 1, largest first."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*low, *(n // d for d in low)} - {1}, reverse=True)


_FLIPS = (np.uint32(1) << np.arange(32, dtype=np.uint32))  # every single bit of a float32


def _few_bits(c: np.ndarray, g: np.ndarray, noise) -> np.ndarray:
    """Elements (float32 arrays) that differ from golden in 1 or 2 bits above those the
    ``noise`` envelope can reach (a number, or one per element), or that flipping one bit
    brings back within ``noise`` of golden, with golden's sign and binade (+-1, a carry across
    a power of two): a kernel summing in its own order is a few ULPs off golden, and their carry
    (0x..3F + 1 = 0x..40) may run through bits far above them. Where the noise reaches golden's
    exponent (golden lies below it), the exponent is noise too and only the second test holds:
    otherwise any value whose exponent is 1 or 2 bits from golden's counts, whatever its
    mantissa (measured: 4 of 146 rv:1 cases). The sign and binade keep a value where golden
    lies below the noise from counting (one exponent bit makes any value tiny); one bit, not
    two, as two flips plus the noise's slack reach a third of a binade where the envelope is
    wide (measured: 1 rv:1 case in 2,631 of the detector benchmark)."""
    xor = (c.view(np.int32) ^ g.view(np.int32)).astype(np.int64) & 0xFFFFFFFF
    _, exponent = np.frexp(g)
    ulp = np.ldexp(1.0, exponent.astype(np.int64) - 24)  # g = m 2^e, m in [0.5, 1); float32 keeps 24 bits of m
    reach = np.floor(np.log2(noise / ulp))  # how many low bits of g the noise reaches (23 or more: its exponent)
    # None of golden's own Inf or NaN (frexp's exponent 0 put the noise above all of it): no other
    # value rounds to it, so every bit counts (a flip of +Inf: -Inf, NaN, 2^127).
    reach = np.where(np.isfinite(g), reach, 0)
    bits = np.bitwise_count(xor & ~((np.int64(1) << np.clip(reach, 0, 23).astype(np.int64)) - 1))
    found = (bits >= 1) & (bits <= 2) & (reach < 23)
    rest = np.flatnonzero(~found)
    if rest.size:  # S is sparse here: a few elements, each tried with every flip
        c, g, binade = c.view(np.uint32)[rest], g[rest].astype(np.float64), exponent[rest]
        noise = noise[rest] if isinstance(noise, np.ndarray) else noise
        back = np.zeros(rest.size, dtype=bool)
        with np.errstate(invalid="ignore", over="ignore"):  # a flip to NaN/inf is never within noise
            for flip in _FLIPS:
                undone = (c ^ flip).view(np.float32).astype(np.float64)
                back |= ((np.abs(undone - g) <= noise) & (np.signbit(undone) == np.signbit(g))
                         & (np.abs(np.frexp(undone)[1] - binade) <= 1))
        found[rest] = back
    return found


def allclose(candidate: torch.Tensor, golden: torch.Tensor, gold: Golden | None = None) -> bool:
    """``torch.allclose`` with its default tolerances (rtol=1e-5, atol=1e-8), the usual unit test.
    With ``gold`` (``Golden.of(golden)``) of a finite golden, the same float32 operations in
    numpy against ``gold.close_bound``: torch's several passes and temporaries per call were
    most of the test's time, and the bound is the same for every candidate."""
    if gold is None or not gold.finite:
        return bool(torch.allclose(candidate.float(), golden.float()))
    c = candidate.detach().float().cpu().contiguous().reshape(-1).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing difference is inf: not close
        d = np.subtract(c, gold.bits.view(np.float32))
    d = np.abs(d, out=d)
    return bool(np.all(d <= gold.close_bound))  # NaN and inf differences compare False, as in torch
