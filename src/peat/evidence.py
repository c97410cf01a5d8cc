"""Tensor evidence for the Detector's rules (``peat.detect``): measured envelopes, the sets of
wrong elements and their shapes in the matrix view of ``peat.errors.matrix``."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch
from scipy import ndimage

from .detect import Rules, shape_class
from .errors import matrix, unmatrix
from .scores import abs_error, popcount

PRECISIONS = ("fp16", "bf16", "tf32")
EPS32 = 2.0 ** -23


class Envelopes(dict):
    """The scalar envelopes of one tensor (what playback writes into its table row), with two
    attributes that are not written, needed only while the candidates of that output are scored:
    ``local``, the per-element reduced-precision envelope, and ``footprints``, for each of
    fp16/bf16/tf32 the elements where rounding to it moves the result beyond ``tau32 / BAND``
    (may) and beyond ``tau32 * BAND`` (must)."""

    local: torch.Tensor | None = None
    footprints: dict[str, tuple[torch.Tensor, torch.Tensor, int, int]] = {}  # may, must and their sizes


def envelopes(golden: torch.Tensor, reference: torch.Tensor, rounded: dict[str, torch.Tensor],
              rules: Rules = Rules()) -> Envelopes:
    """The fp32 and reduced-precision envelopes of one tensor, measured on its own inputs.

    ``taurp`` is the worst over the tensor; ``local`` holds, for every element, KRP times the
    worst fp16/bf16/tf32 error in its aligned TILE x TILE tile of the matrix view (floored at
    ``tau32``): rounding errors scale with the magnitudes around them (outlier channels, a
    gradient block much larger than its neighbours). ``footprints`` are the S sets the
    references themselves have: where, on these inputs, a correct reduced-precision result
    leaves the fp32 envelope.
    """
    ref = reference.double()
    absmax = float(torch.nan_to_num(golden.double().abs(), posinf=0.0).max()) if golden.numel() else 0.0
    noise32 = _finite_max((golden.double() - ref).abs())
    diffs = {p: (t.double() - ref).abs() for p, t in rounded.items()}
    rp = {p: _finite_max(d) for p, d in diffs.items()}
    tau32 = rules.k32 * max(noise32, EPS32 * absmax, 1e-38)
    taurp = rules.krp * max([*rp.values(), tau32 / rules.krp])
    env = Envelopes({"noise32_max": noise32, **{f"noise_{p}_max": v for p, v in rp.items()}, "tau32": tau32,
                     "taurp": taurp})
    if diffs and golden.numel():
        worst = torch.stack([torch.nan_to_num(d, nan=0.0, posinf=0.0) for d in diffs.values()]).amax(0)
        env.local = torch.clamp(rules.krp * tile_max(worst, rules.tile), min=tau32)
        moved = {p: abs_error(t, golden) for p, t in rounded.items()}
        env.footprints = {p: _footprint(d > tau32 / rules.band, d > tau32 * rules.band) for p, d in moved.items()}
    return env


def _footprint(may: torch.Tensor, must: torch.Tensor) -> tuple:
    return may, must, int(may.sum()), int(must.sum())


def tile_max(t: torch.Tensor, tile: int) -> torch.Tensor:
    """Each element replaced by the largest value of its aligned ``tile`` x ``tile`` tile of the
    matrix view (``peat.errors.matrix``), in the shape of ``t``."""
    m = matrix(t)
    rows, cols = m.shape
    pooled = torch.nn.functional.max_pool2d(m[None, None], tile, ceil_mode=True)[0, 0]
    full = pooled.repeat_interleave(tile, 0)[:rows].repeat_interleave(tile, 1)[:, :cols]
    return unmatrix(full, t)


def rounding_footprint(over32: torch.Tensor, n: int, env: dict, cover: float) -> str:
    """The reference precision whose footprint S matches, or "": >= ``cover`` of S lies where
    rounding to it may leave the fp32 envelope, and S holds >= ``cover`` of where it must
    (the band between is where another rounding order falls either side). Then S's layout is
    the one rounding to that precision gives these inputs, not a fault's."""
    for p, (may, must, n_may, n_must) in getattr(env, "footprints", {}).items():
        if n_may < cover * n or n < cover * n_must:  # the sizes alone rule it out
            continue
        if (over32 & may).sum() >= cover * n and (over32 & must).sum() >= cover * n_must:
            return p
    return ""


def _finite_max(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    top = float(t.max())
    if math.isfinite(top):  # the common case, without a masked copy
        return top
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else 0.0


def evidence(candidate: torch.Tensor, golden: torch.Tensor, env: dict, rules: Rules = Rules(),
             diff: torch.Tensor | None = None, nonfinite: int | None = None) -> dict:
    """Scalar features the rules use, for one candidate tensor against golden.

    ``diff`` (|candidate - golden|, ``peat.scores.abs_error``) and ``nonfinite`` (the count of
    non-finite values where golden is finite) may be passed in when already computed. With
    ``env`` from ``envelopes``, G is measured against its per-tile envelope and S is compared
    with the references' footprints; with a plain dict (a table row), against ``taurp`` and
    no footprint. The layout of S and of G is only worked out when the rules can need it.
    """
    diff = abs_error(candidate, golden) if diff is None else diff
    if nonfinite is None:
        nonfinite = int((~torch.isfinite(candidate) & torch.isfinite(golden)).sum())
    bound = getattr(env, "local", None)
    bound = env["taurp"] if bound is None else bound
    top = _finite_max(diff)
    out = {"numel": candidate.numel(), "nonfinite": nonfinite, "err_over_tau32": top / env["tau32"],
           "err_over_taurp": _finite_max(diff / bound) if torch.is_tensor(bound) else top / bound}
    over32, gross = diff > env["tau32"], diff > bound
    out["n32"], out["ngross"] = int(over32.sum()), int(gross.sum())
    out["s_rounding"] = rounding_footprint(over32, out["n32"], env, rules.cover) if out["n32"] else ""
    s = shape(over32, candidate, golden, env["tau32"], rules, layout=not out["s_rounding"])
    out |= {f"s_{k}": v for k, v in s.items()}
    needs_gross = out["ngross"] > 0 and out["n32"] > 0 and (out["s_rounding"] or shape_class(out, "s_", rules) is None)
    g = shape(gross, candidate, golden, bound[gross] if torch.is_tensor(bound) else bound, rules, layout=needs_gross)
    out |= {f"g_{k}": v for k, v in g.items()}
    return out


def shape(mask: torch.Tensor, candidate: torch.Tensor, golden: torch.Tensor, noise, rules: Rules,
          layout: bool = True) -> dict:
    """How the wrong elements ``mask`` are laid out and what they look like; ``noise`` is the
    envelope they are beyond (a number, or one per element of the mask). Without ``layout``,
    only their count."""
    n = int(mask.sum())
    few = max(rules.sparse_min, rules.sparse * mask.numel())
    out = {"n": n, "sparse": 0 < n <= few and n < mask.numel() / 2, "block_cover": 0.0, "block_area": 0.0,
           "block_tiles": 0, "lane_cover": 0.0, "lane_stride": 0, "lane_axis": "", "zero_frac": 0.0,
           "bit_frac": 0.0, "inrange_frac": 0.0}
    if n == 0 or mask.numel() == 0 or not layout:
        return out
    m = matrix(mask).numpy()
    if n * rules.cover <= rules.block_area * m.size:  # else no tiles within block_area can explain S
        out |= _blocks(m, rules)
    out |= _lanes(m, rules)
    if not out["sparse"]:
        return out
    c, g = candidate[mask], golden[mask]
    out["zero_frac"] = float(((c == 0) & (g != 0)).double().mean())
    out["bit_frac"] = float(_few_bits(c, g, noise).double().mean())
    fin = golden[torch.isfinite(golden)]
    if fin.numel():
        out["inrange_frac"] = float(((c >= fin.min()) & (c <= fin.max())).double().mean())
    return out


def _blocks(m: np.ndarray, rules: Rules) -> dict:
    labels, count = ndimage.label(m, structure=np.ones((3, 3)))
    n = int(m.sum())
    # Tiles (>= 4 elements each) holding COVER of S leave at most this many components.
    if count > (1 - rules.cover) * n + rules.cover * n / 4:
        return {"block_cover": 0.0, "block_area": 0.0, "block_tiles": 0}
    rows, cols = np.nonzero(labels)
    comp = pd.DataFrame({"label": labels[rows, cols], "row": rows, "col": cols}).groupby("label")
    box = comp.agg(r0=("row", "min"), r1=("row", "max"), c0=("col", "min"), c1=("col", "max"), size=("row", "size"))
    height, width = box["r1"] - box["r0"] + 1, box["c1"] - box["c0"] + 1
    flat = min(m.shape) == 1  # a vector: a tile is a run of >= 4 wrong elements
    wide = (height >= 2) & (width >= 2) if not flat else (height * width >= 4)
    tiles = box[wide & (box["size"] >= 4) & (box["size"] >= rules.fill * height * width)]
    area = float((height * width)[tiles.index].sum())
    return {"block_cover": float(tiles["size"].sum() / len(rows)), "block_area": area / m.size,
            "block_tiles": int(len(tiles))}


def _lanes(m: np.ndarray, rules: Rules) -> dict:
    """Columns (or rows) filled >= FILL that form a whole arithmetic progression of stride >= 2
    (a single filled lane counts when the view has >= 2 rows; a vector needs >= 3 lanes)."""
    best = {"lane_cover": 0.0, "lane_stride": 0, "lane_axis": ""}
    for axis, view in (("col", m), ("row", m.T)):
        rows, cols = view.shape
        if cols < 2:
            continue
        lanes = np.flatnonzero(view.sum(0) >= rules.fill * rows)
        if len(lanes) == 0 or (rows < 2 and len(lanes) < 3):  # in a vector, 2 wrong elements are no period
            continue
        stride = int(np.gcd.reduce(np.diff(lanes))) if len(lanes) > 1 else cols
        expected = len(range(lanes[0] % stride, cols, stride)) if stride < cols else 1
        if stride < 2 or len(lanes) < rules.cover * expected:
            continue
        cover = float(view[:, lanes].sum() / view.sum())
        if cover > best["lane_cover"]:
            best = {"lane_cover": cover, "lane_stride": stride, "lane_axis": axis}
    return best


def _few_bits(c: torch.Tensor, g: torch.Tensor, noise) -> torch.Tensor:
    """Elements that differ from golden in 1 or 2 bits above those the ``noise`` envelope can
    reach (a number, or one per element)."""
    xor = (c.float().view(torch.int32) ^ g.float().view(torch.int32)).long() & 0xFFFFFFFF
    _, exponent = torch.frexp(g.float())
    ulp = torch.ldexp(torch.ones_like(g, dtype=torch.float64), exponent.long() - 24)
    low = torch.clamp(torch.floor(torch.log2(noise / ulp)), 0, 23).long()
    high = xor & ~(torch.bitwise_left_shift(torch.ones_like(low), low) - 1)
    bits = popcount(high)
    return (bits >= 1) & (bits <= 2)



def allclose(candidate: torch.Tensor, golden: torch.Tensor) -> bool:
    """``torch.allclose`` with its default tolerances (rtol=1e-5, atol=1e-8), the usual unit test."""
    return bool(torch.allclose(candidate.float(), golden.float()))
