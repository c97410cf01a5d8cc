"""The Detector on extreme but real tensors: golden's own overflow, NaN and Inf, values near
float32's largest, all-zero and subnormal outputs (see docs/playback.md, Extreme tensors)."""

from __future__ import annotations

import math

import pytest
import torch

from peat import detect, errors, evidence, kernels, playback, scores

torch.set_num_threads(1)
RULES = detect.Rules()


def linear(a: torch.Tensor, w: torch.Tensor, computation: str = "forward") -> dict:
    """Golden, fp64 and the rounded references of one linear computation (bias 0, dO random)."""
    g = torch.Generator().manual_seed(1)
    sample = {"A": a, "W": w, "B": torch.zeros(w.shape[0]), "dO": torch.randn(a.shape[0], w.shape[0], generator=g),
              "input_grad": True}
    gold = kernels.golden("linear")
    out = {"golden": kernels.call(gold, computation, sample, {"op": "linear"}),
           "fp64": kernels.call(gold, computation, sample, {"op": "linear"}, torch.float64)}
    return out | {p: kernels.call(errors.faulty(gold, p, computation), computation, sample, {"op": "linear"})
                  for p in evidence.PRECISIONS}


def judge(ref: dict, candidates: dict) -> dict:
    """Each candidate's class as playback gives it: the envelopes, the references' footprints one
    at a time, then the candidates (and the references' own classes, as ``ref:p``)."""
    gold = scores.Golden.of(ref["golden"])
    env = evidence.envelopes(ref["golden"], ref["fp64"], {p: ref[p] for p in evidence.PRECISIONS}, RULES, gold,
                             footprints=False)
    found = {}
    for p, diff in evidence.scored_references(env, ref, gold, RULES):
        found[f"ref:{p}"] = playback.score_row(ref[p], ref["golden"], None, env, RULES, env.noise, gold, diff)
    for name, candidate in candidates.items():
        found[name] = playback.score_row(candidate, ref["golden"], None, env, RULES, env.noise, gold)
    return {name: row["error_model"] for name, row in found.items()}


def test_golden_overflowing_in_its_partial_sums_leaves_those_elements_unjudged():
    """One row's terms of +-3e38 overflow golden's float32 partial sums (Inf) while the sum, about
    1e37, fits: the fp64 reference rounded to float32 (finite there) read as periodic_lane, and a
    blocked GEMM (NaN there: Inf - Inf) too. Those elements are float32's overflow, not a result."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 48, generator=g)
    a[2, :24], a[2, 24:] = 3e38, -3e38
    w = 0.5 + 0.1 * torch.rand(40, 48, generator=g)
    ref = linear(a, w)
    assert not torch.isfinite(ref["golden"][2]).any() and torch.isfinite(ref["fp64"].float()).all()
    blocked = kernels.call(kernels.load("peat.alt_kernels.blocked_gemm", "linear"), "forward",
                           {"A": a, "W": w, "B": torch.zeros(40)}, {"op": "linear"})
    assert torch.isnan(blocked[2]).all()
    wrong = ref["golden"].clone()
    wrong[10, 3], wrong[20, 30] = 5.0, -7.0
    got = judge(ref, {"fp64": ref["fp64"].float(), "blocked": blocked, "golden": ref["golden"].clone(),
                      "wrong": wrong, "nan": errors.parse("nan:1").apply(ref["golden"], torch.Generator())})
    assert got == {"ref:fp16": "reduced_precision", "ref:bf16": "reduced_precision", "ref:tf32": "reduced_precision",
                   "fp64": "none", "blocked": "none", "golden": "none", "wrong": "random_value", "nan": "non_finite"}
    env = evidence.envelopes(ref["golden"], ref["fp64"], {p: ref[p] for p in evidence.PRECISIONS})
    assert env.overflowed.nonzero()[0].tolist() == [2] * 40
    # rel_*'s divisor is float32's rounding on the other elements (it was the largest float64: every rel_* 0 or NaN)
    finite = torch.isfinite(ref["golden"])
    rounding = (ref["golden"][finite].double() - ref["fp64"][finite]).abs()
    assert env.noise["max"] == float(rounding.max())
    row = playback.score_row(wrong, ref["golden"], None, env, RULES, env.noise, gold=scores.Golden.of(ref["golden"]))
    assert row["rel_max"] == row["err_max"] / env.noise["max"] and row["rel_max"] > 1e5


@pytest.mark.parametrize("spec", ["lane:16", "lane:8:stuck"])
def test_a_lane_through_goldens_nan_column_is_a_lane(spec):
    """A NaN input feature (A[3, 5]) makes the weight gradient's column 5 NaN throughout; a lane fault
    leaves it NaN (offset or stuck at its first value), as reproduced NaN is no error, so the
    progression 5, 21, 37 held S in 2 of 3 lanes and read as block_structured. Such a lane counts
    neither way, as a dead channel does."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 48, generator=g)
    a[3, 5] = math.nan
    ref = linear(a, 0.1 * torch.randn(40, 48, generator=g), "weight_grad")
    assert torch.isnan(ref["golden"][:, 5]).all() and int(torch.isnan(ref["golden"]).sum()) == 40
    faulty = errors.parse(spec).apply(ref["golden"], torch.Generator().manual_seed(1))
    changed = (~errors._kept(ref["golden"], faulty)).any(0).nonzero().view(-1).tolist()
    assert 5 not in changed and changed[0] % int(spec.split(":")[1]) == 5
    assert judge(ref, {"lane": faulty})["lane"] == "periodic_lane"


def flipped(t: torch.Tensor, where: list[tuple[int, int]], bits: list[int]) -> torch.Tensor:
    """``t`` (float32) with bit ``bits[i]`` of element ``where[i]`` flipped."""
    out = t.clone()
    for (i, j), bit in zip(where, bits):
        out.view(torch.int32)[i, j] ^= -(1 << 31) if bit == 31 else 1 << bit
    return out


def test_flips_of_goldens_own_inf_are_bit_flips():
    """An Inf input (A[3, 5]) makes the forward's row 3 +-Inf, in fp64 too, beside values of 1e7
    (a diverging step). Flipping a bit of one (-Inf for +Inf, NaN, 2^127) read as random_value:
    frexp gives Inf the exponent 0, as 0.5's, so a noise of 0.5 or more (here 8) seemed to reach
    all its bits. No other value rounds to Inf: each bit counts."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 48, generator=g)
    a[3, 5] = math.inf
    ref = linear(a, 1e6 * torch.randn(40, 48, generator=g))
    assert torch.isinf(ref["golden"][3]).all() and torch.isinf(ref["fp64"][3]).all()
    assert evidence.envelopes(ref["golden"], ref["fp64"], {p: ref[p] for p in evidence.PRECISIONS})["tau32"] > 1
    where = [(3, 0), (3, 7), (3, 11)]
    faulty = flipped(ref["golden"], where, [31, 22, 23])
    assert float(faulty[3, 0]) == -float(ref["golden"][3, 0]) and math.isnan(faulty[3, 7])
    assert float(faulty[3, 11].abs()) == 2.0 ** 127
    got = judge(ref, {"flips": faulty, "golden": ref["golden"].clone()})
    assert (got["flips"], got["golden"]) == ("bit_flip", "none")
