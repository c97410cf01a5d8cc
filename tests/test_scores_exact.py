"""The playback table's score columns against their definitions (docs/playback.md, the
table's columns), computed here a second time, independently and plainly: float64,
one element at a time where that is clearer, exactly rounded sums (``math.fsum``). Both of peat's
paths (the C loops of ``peat.tensor_stats`` and numpy without them) must give them.

Columns whose value does not depend on the order of a float sum (maxima, ULP distances, bit counts,
counts, periods on exact masses) are compared exactly everywhere. Sums are compared exactly on
"dyadic" tensors, whose errors are small multiples of one power of two, so that every order of
addition is exact; on tensors of random floats they are compared within 1e-12 relative (peat
adds in its own order, the reference rounds once), as are variances everywhere (their mean is rounded).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from peat import detect, evidence, playback, scores, tensor_stats

LARGEST = np.finfo(np.float64).max
ROW_BINS, MAP_EDGE, TILE, MAX_PERIOD = 256, 32, 16, 64


# ----------------------------------------------------------- the reference, from docs/playback.md

def matrix_view(t: torch.Tensor) -> np.ndarray:
    """Rows x columns: channels as columns for NCHW, else the last dimension; a scalar is 1 x 1."""
    a = t.detach().cpu().numpy()
    if a.ndim == 4:
        a = np.moveaxis(a, 1, -1)
    a = a.reshape(1, 1) if a.ndim == 0 else a
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def element_error(c: float, g: float) -> float:
    """|c - g| in float64; a reproduced NaN or inf of golden is exact (0); a NaN is left out of the
    scores (returned as NaN); an infinite error counts as the largest float64."""
    if (math.isnan(c) and math.isnan(g)) or (math.isinf(g) and c == g):
        return 0.0
    e = abs(float(c) - float(g))
    return LARGEST if math.isinf(e) else e


def errors_of(c: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``element_error`` of every element, in the matrix view."""
    return np.array([element_error(x, y) for x, y in zip(c.ravel().tolist(), g.ravel().tolist())]).reshape(c.shape)


def total(values) -> float:
    """The exactly rounded sum of values >= 0 (+inf past the largest float64)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


def four(err: np.ndarray) -> dict:
    """max, mean, mean of the largest 10 % (ceil(n / 10) of them, at least one) and variance (over
    n) of the errors that are not left out (NaN); all NaN when none is left."""
    x = np.sort(err[~np.isnan(err)].ravel())
    n = x.size
    if n == 0:
        return dict.fromkeys(("max", "mean", "top10", "var"), math.nan)
    k = max(1, -(-n // 10))
    mean = total(x.tolist()) / n
    with np.errstate(over="ignore", invalid="ignore"):
        var = total(((x - mean) ** 2).tolist()) / n
    return {"max": float(x[-1]), "mean": mean, "top10": total(x[n - k:].tolist()) / k, "var": var}


def ordered(bits: int) -> int:
    """A float32 bit pattern as its position in the order of floats (+0 and -0 both at 0)."""
    return -(bits & 0x7FFFFFFF) if bits & 0x80000000 else bits


def bit_columns(c: np.ndarray, g: np.ndarray) -> dict:
    """ULP distance (median: the (n // 2)-th smallest, counting from 0; max), fraction of elements
    whose bits differ, non-finite candidates where golden is finite, per bit b the elements whose
    bit b differs."""
    cb = c.astype(np.float32).view(np.uint32).ravel().tolist()
    gb = g.astype(np.float32).view(np.uint32).ravel().tolist()
    ulp = sorted(abs(ordered(x) - ordered(y)) for x, y in zip(cb, gb))
    n = len(ulp)
    counts = np.array([sum((x ^ y) >> b & 1 for x, y in zip(cb, gb)) for b in range(32)])
    finite = [math.isfinite(v) for v in g.ravel().tolist()]
    bad = sum(not math.isfinite(v) and f for v, f in zip(c.ravel().tolist(), finite))
    return {"ulp_median": float(ulp[n // 2]) if n else 0.0, "ulp_max": float(ulp[-1]) if n else 0.0,
            "frac_diff": sum(x != y for x, y in zip(cb, gb)) / n if n else math.nan,
            "nonfinite": bad, "bits": counts}


def period(mass: list) -> tuple[int, float]:
    """The longest period K in 2..min(64, len / 2) whose heaviest residue class holds at least 99 %
    of what the heaviest class of any such period holds, and that class's share of the mass."""
    whole = total(mass)
    longest = min(MAX_PERIOD, len(mass) // 2)
    if len(mass) < 4 or longest < 2 or not 0 < whole < math.inf:
        return 0, 0.0
    best = {k: max(total(mass[r::k]) for r in range(k)) / whole for k in range(2, longest + 1)}
    top = max(best.values())
    k = max(k for k, b in best.items() if b >= 0.99 * top)
    return k, best[k]


def edges(n: int, bins: int) -> list:
    """Near-equal bins: the edges round(i * n / bins) (half to even), at most ``bins`` of them."""
    if n <= bins:
        return list(range(n + 1))
    return [int(np.round(i * n / bins)) for i in range(bins + 1)]


def binned(values: list, bins: int) -> list:
    e = edges(len(values), bins)
    return [total(values[a:b]) for a, b in zip(e[:-1], e[1:])]


def spatial(err: np.ndarray) -> dict:
    """The error mass (a NaN carries none) per row, summed into <= 256 bins, per column, their
    periods, the share of the heaviest aligned 16 x 16 tile, and the <= 32 x 32 map of block sums."""
    m = np.nan_to_num(err, nan=0.0)
    rows = [total(r) for r in m.tolist()]
    cols = [total(c) for c in m.T.tolist()]
    whole = total(m.ravel().tolist())
    tiles = [total(m[i:i + TILE, j:j + TILE].ravel().tolist())
             for i in range(0, m.shape[0], TILE) for j in range(0, m.shape[1], TILE)] or [0.0]
    re, ce = edges(m.shape[0], MAP_EDGE), edges(m.shape[1], MAP_EDGE)
    small = [[total(m[a:b, p:q].ravel().tolist()) for p, q in zip(ce[:-1], ce[1:])]
             for a, b in zip(re[:-1], re[1:])]
    (cp, cf), (rp, rf) = period(cols), period(rows)
    return {"row_mass": np.array(binned(rows, ROW_BINS)), "col_mass": np.array(cols),
            "col_period": cp, "col_period_frac": cf, "row_period": rp, "row_period_frac": rf,
            "tile_frac": max(tiles) / whole if 0 < whole < math.inf else 0.0,
            "map": np.array(small).ravel(), "map_rows": len(re) - 1, "map_cols": len(ce) - 1}


def reference(cand: torch.Tensor, golden: torch.Tensor, fp64: torch.Tensor) -> dict:
    c, g = matrix_view(cand.float()), matrix_view(golden.float())
    err = errors_of(c, g)
    noise = four(errors_of(matrix_view(fp64.double()), g))
    mine = four(err)
    out = {f"err_{k}": v for k, v in mine.items()} | {f"noise_{k}": v for k, v in noise.items()}
    out |= {f"rel_{k}": mine[k] / max(noise[k], 1e-30) for k in mine}
    return out | bit_columns(c, g) | spatial(err)


# ------------------------------------------------------------------------------ peat's side

ORDER_FREE = ("err_max", "noise_max", "ulp_median", "ulp_max", "frac_diff", "nonfinite", "bits",
              "map_rows", "map_cols")


def peat_row(cand: torch.Tensor, golden: torch.Tensor, fp64: torch.Tensor) -> dict:
    gold = scores.Golden.of(golden)
    rounded = {p: golden * (1 + 10.0 ** -k) for k, p in enumerate(evidence.PRECISIONS, start=2)}
    env = evidence.envelopes(golden, fp64, rounded, gold=gold)
    return playback.score_row(cand, golden, fp64, env, detect.Rules(), gold=gold)


def same(got, want, exact: bool, key: str):
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    assert got.shape == want.shape, (key, got.shape, want.shape)
    if exact:
        assert np.array_equal(got, want, equal_nan=True), (key, got, want)
    else:
        assert np.allclose(got, want, rtol=1e-12, atol=0, equal_nan=True), (key, got, want)


def check(cand, golden, fp64, dyadic: bool):
    want, got = reference(cand, golden, fp64), peat_row(cand, golden, fp64)
    for key, value in want.items():
        same(got[key], value, (dyadic and not key.endswith("_var")) or key in ORDER_FREE, key)
    if dyadic or got["col_period"] == 0:  # periods of inexact masses may tie differently
        for key in ("col_period", "row_period"):
            assert got[key] == want[key], (key, got[key], want[key])


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    """Each case on both of peat's paths: the C loops (from any size on) and numpy's."""
    if request.param == "compiled":
        if not tensor_stats.compiled():
            pytest.skip("no C compiler here")
        monkeypatch.setattr(tensor_stats, "SELECT_MIN", 0)
    else:
        monkeypatch.setattr(tensor_stats, "_LIB", [None])
    return request.param


# ------------------------------------------------------------------------------------ the cases

SHAPES = [(1,), (7,), (33,), (1, 1), (5, 3), (17, 40), (300, 2), (1, 1, 1, 1), (2, 5, 3, 3), (1, 16, 6, 7),
          (4, 3, 17, 17), (3, 40, 12), (5, 70, 70)]   # the last > tensor_stats.SMALL_MIN elements


def dyadic(shape, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Golden and a candidate whose values are small multiples of 2^-12 and errors of 2^-20:
    every sum of errors is exact in float64, whatever its order. Exact ties in the top 10 %."""
    golden = torch.randint(-2048, 2048, shape, generator=gen).float() * 2.0 ** -12
    delta = torch.randint(-3, 4, shape, generator=gen).float() * 2.0 ** -20
    return golden + delta * (torch.rand(shape, generator=gen) < 0.6), golden


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dyadic_tensors_score_as_defined(path, shape):
    gen = torch.Generator().manual_seed(len(shape) * 1000 + math.prod(shape))
    cand, golden = dyadic(shape, gen)
    fp64 = golden.double() + torch.randint(-1, 2, shape, generator=gen).double() * 2.0 ** -30
    check(cand, golden, fp64, dyadic=True)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_tensors_score_as_defined(path, shape):
    gen = torch.Generator().manual_seed(math.prod(shape))
    golden = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-20, 20, shape, generator=gen)
    cand = golden * (1 + 2e-7 * torch.randn(shape, generator=gen))
    cand.view(-1)[::4] = golden.view(-1)[::4]
    fp64 = golden.double() * (1 + 1e-8 * torch.randn(shape, generator=gen, dtype=torch.float64))
    check(cand, golden, fp64, dyadic=False)


def edge_cases():
    """(name, candidate, golden) of the edge cases; the fp64 reference is golden's, nudged."""
    f = torch.tensor
    g = f([[1.0, -2.0, 0.0, 3.5], [0.25, -0.0, 5.0, -7.0]])
    out = {"equal": (g.clone(), g), "single": (g + f([[0, 0, 0, 0], [0, 0, 2.0 ** -10, 0]]), g),
           "signed zeros": (f([[1.0, -2.0, -0.0, 3.5], [0.25, 0.0, 5.0, -7.0]]), g),
           "opposite sign": (-g, g), "across zero": (f([[2.0 ** -149, -2.0 ** -149, -2.0 ** -140, 1e-45],
                                                         [-1e-38, 1e-38, 0.0, -0.0]]),
                                                      f([[-2.0 ** -149, 2.0 ** -149, 2.0 ** -140, -1e-45],
                                                         [1e-38, -1e-38, -0.0, 0.0]])),
           "denormals": (g * 2.0 ** -130, g * 2.0 ** -131),
           "golden zero": (f([[0.0, 1.0, -0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]), torch.zeros(2, 4)),
           "nan inf in candidate": (f([[math.nan, -2.0, math.inf, 3.5], [0.25, -math.inf, 5.0, -7.0]]), g),
           "one inf": (f([[1.0, -2.0, 0.0, math.inf], [0.25, -0.0, 5.0, -7.0]]), g),
           "all nan": (torch.full((2, 4), math.nan), g)}
    own = f([[math.nan, -2.0, math.inf, 3.5], [0.25, -math.inf, 5.0, -7.0]])
    out |= {"golden's own nan inf": (own.clone(), own),
            "golden nan inf missed": (f([[1.0, -2.0, 3.0, math.inf], [0.25, math.inf, 5.0, math.nan]]), own)}
    ties = torch.arange(40.0).reshape(4, 10)
    hit = ties.clone()
    hit.view(-1)[[3, 9, 17, 22, 31, 38]] += 0.5  # 6 equal errors, the top 10 % holds 4 of them
    out["ties"] = (hit, ties)
    big = torch.arange(48 * 48, dtype=torch.float32).reshape(48, 48) / 64
    column, tile = big.clone(), big.clone()
    column[:, 13] += 0.25
    tile[16:32, 32:48] += 0.125
    out |= {"one column": (column, big), "one tile": (tile, big)}
    lanes = torch.zeros(2, 24, 5, 5)
    lanes[:, 3::8] = 0.5
    out["conv lanes"] = (lanes, torch.zeros(2, 24, 5, 5))
    wide = torch.zeros(4, 150)
    wide[:, [5, 53, 101, 149]] = 0.75  # lanes 48 apart: a period past 32, under 64
    out["long period"] = (wide, torch.zeros(4, 150))
    gen = torch.Generator().manual_seed(9)
    conv, matrix = (dyadic(s, gen) for s in ((3, 8, 5, 6), (30, 20)))
    infs = torch.zeros(40, 40)
    infs[[3, 7, 9, 1], [5, 5, 9, 1]] = f([math.inf, -math.inf, math.inf, 1.0])  # two Inf errors in one column
    out |= {"channels-last candidate": (conv[0].to(memory_format=torch.channels_last), conv[1]),
            "channels-last golden": (conv[0], conv[1].to(memory_format=torch.channels_last)),
            "transposed candidate": (matrix[0].t().contiguous().t(), matrix[1]),
            "strided candidate": (torch.cat([matrix[0], matrix[0]], 1)[:, ::2], matrix[1]),
            "float64 candidate": (matrix[1].double() + 1e-9, matrix[1]),
            "scalar": (f(1.5), f(1.25)), "scalar nan": (f(math.nan), f(1.25)),
            "empty": (torch.zeros(0, 5), torch.zeros(0, 5)), "no channels": (torch.zeros(2, 0, 3, 3),) * 2,
            "nan of the other sign": (f([-math.nan, 1.0, 2.0, 3.0]), f([math.nan, 1.0, 2.0, 3.0])),
            "infs in a column": (infs, torch.zeros(40, 40)),
            "largest of opposite signs": (f([3.4028235e38, -3.4028235e38]), f([-3.4028235e38, 3.4028235e38]))}
    return out


@pytest.mark.parametrize("name", list(edge_cases()))
def test_edge_cases_score_as_defined(path, name):
    cand, golden = edge_cases()[name]
    finite = torch.nan_to_num(golden, nan=0.0, posinf=0.0, neginf=0.0)
    fp64 = torch.where(torch.isfinite(golden), finite.double() + 2.0 ** -40, golden.double())
    check(cand, golden, fp64, dyadic=True)


SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38],
                    dtype=np.float32)


def fuzzed(rng) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A random shape (0-d to 4-d), dyadic or random values, a few special values on either side,
    sometimes half the elements exact. Returns candidate, golden and whether it is dyadic."""
    dims = int(rng.integers(0, 5))
    shape = tuple(int(x) for x in rng.integers(1, 9 if dims >= 3 else 40, dims))
    exact = bool(rng.integers(0, 2))
    if exact:
        golden = np.asarray(rng.integers(-64, 64, shape) / 16, dtype=np.float32)
        cand = golden + np.asarray(rng.integers(-2, 3, shape) * (rng.random(shape) < rng.random()) / 1024,
                                   dtype=np.float32)
    else:
        golden = np.asarray(rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, shape), dtype=np.float32)
        cand = golden * np.asarray(1 + rng.standard_normal(shape) * 1e-6, dtype=np.float32)
    cand, golden = (torch.from_numpy(np.array(a, dtype=np.float32).reshape(shape)) for a in (cand, golden))
    for t in (cand, golden):
        if rng.random() < 0.4:
            k = int(rng.integers(1, 4))
            t.view(-1)[torch.from_numpy(rng.integers(0, t.numel(), k))] = torch.from_numpy(rng.choice(SPECIALS, k))
    if rng.random() < 0.2:
        cand.view(-1)[::2] = golden.view(-1)[::2]
    return cand, golden, exact


def test_fuzzed_tensors_score_as_defined(path):
    rng = np.random.default_rng(2026)
    for _ in range(60):
        cand, golden, exact = fuzzed(rng)
        fp64 = torch.where(torch.isfinite(golden), golden.double() * (1 + 1e-9), golden.double())
        check(cand, golden, fp64, dyadic=exact)
