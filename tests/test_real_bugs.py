"""The Detector on hand-written kernels, as a kernel developer writes them (not the pseudo-errors
of ``peat.errors``): correct ones must pass, buggy ones fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peat import detect, errors, evidence, kernels

ATTRS = {"op": "conv2d", "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}

# Winograd F(4x4, 3x3) (Lavin & Gray, 2016): a correct convolution that rounds worse than the direct one.
BT = torch.tensor([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                   [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], dtype=torch.float32)
G = torch.tensor([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                  [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], dtype=torch.float32)
AT = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
                  dtype=torch.float32)


def winograd_f4x4(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """3x3, stride 1, padding 1 correlation in float32 by F(4x4, 3x3), on maps a multiple of 4."""
    d = F.pad(x, (1, 1, 1, 1)).unfold(2, 6, 4).unfold(3, 6, 4)         # (n, c, th, tw, 6, 6)
    v = torch.einsum("ij,nctwjk,lk->nctwil", BT, d, BT)
    u = torch.einsum("ij,ocjk,lk->ocil", G, weight, G)
    y = torch.einsum("ij,notwjk,lk->notwil", AT, torch.einsum("ocil,nctwil->notwil", u, v), AT)
    return y.permute(0, 1, 2, 4, 3, 5).reshape(x.shape[0], weight.shape[0], x.shape[2], x.shape[3])


def conv_sample(seed: int, shape=(8, 32, 8, 8)) -> dict:
    """A ReLU'd activation through a square 3x3 conv, with an output gradient."""
    g = torch.Generator().manual_seed(seed)
    return {"A": torch.randn(*shape, generator=g).relu(), "W": torch.randn(shape[1], shape[1], 3, 3, generator=g) * 0.1,
            "B": None, "dO": torch.randn(*shape, generator=g) * 1e-3, "input_grad": True}


def references(sample: dict, computation: str = "forward"):
    """Golden's result of ``computation`` and its envelopes (fp64 and the rounded references)."""
    gold = kernels.golden("conv2d")
    golden = kernels.call(gold, computation, sample, ATTRS)
    ref = kernels.call(gold, computation, sample, ATTRS, torch.float64)
    rounded = {p: kernels.call(errors.faulty(gold, p), computation, sample, ATTRS) for p in evidence.PRECISIONS}
    return golden, evidence.envelopes(golden, ref, rounded)


def conv_case(seed: int):
    """Golden's forward, its envelopes and F(4x4, 3x3)'s result."""
    sample = conv_sample(seed)
    return (*references(sample), winograd_f4x4(sample["A"], sample["W"]))


def classify(candidate, golden, env, rules=detect.Rules()):
    return detect.classify(evidence.evidence(candidate, golden, env, rules), rules)[0]


@pytest.mark.parametrize("seed", range(4))
def test_winograd_f4x4_is_rounding_not_scattered_faults(seed):
    """F(4x4, 3x3) in float32 is correct but rounds worse than direct convolution everywhere:
    10-25 % of its elements lie beyond golden's own worst rounding, and the tail of that spread
    crosses the fp32 envelope in a few elements, 1-2x beyond it and 1,000x within the
    reduced-precision envelope. Those few were read as scattered faults (bit_flip or
    random_value: a fail); a denser spread of the same kind passed as reduced_precision."""
    golden, env, candidate = conv_case(seed)
    f = evidence.evidence(candidate, golden, env)
    assert 0 < f["n32"] <= 32 and f["ngross"] == 0  # a few elements, all within the reduced-precision envelope
    assert detect.classify(f)[0] == "reduced_precision"
    assert f["s_tail"]
    assert not detect.passes("reduced_precision", detect.Rules(accept_reduced_precision=False))


def test_a_few_wrong_values_on_a_kernel_without_such_a_spread_stay_faults():
    """The tail needs a spread: a few values just beyond the fp32 envelope on golden's own result
    (nothing else differs), or a random value beyond the reduced-precision envelope on F(4x4, 3x3)'s,
    are faults as before."""
    golden, env, candidate = conv_case(0)
    small = golden.clone()
    small.view(-1)[[5, 700, 3000]] += 3 * env["tau32"]
    f = evidence.evidence(small, golden, env)
    assert f["n32"] == 3 and f["ngross"] == 0 and not f["s_tail"]
    assert detect.classify(f)[0] in ("bit_flip", "random_value")
    gross = errors.parse("rv:1").apply(candidate, torch.Generator().manual_seed(0))
    assert classify(gross, golden, env) == "random_value"


def _border(sample):
    x = sample["A"].clone()
    x[..., -1] = 0  # bounds check `iw < W - 1`: the last input column read as padding
    return F.conv2d(x, sample["W"], None, 1, 1)


def _race(sample):
    out = F.conv2d(sample["A"], sample["W"], None, 1, 1)
    out[-1, 16:32, 0:4, 0:4] = 0  # the last sample's workgroup exits before its store
    return out


BUGS = {  # hand-written bugs: the computation, the buggy result, the class
    "border column read as padding": ("forward", _border, "block_structured"),
    "one tile of the last sample left zero": ("forward", _race, "block_structured"),
    "batch loop misses the last sample": ("weight_grad", lambda s: torch.nn.grad.conv2d_weight(
        s["A"][:-1], s["W"].shape, s["dO"][:-1], 1, 1), "block_structured"),
    "input gradient without the channel transpose": ("input_grad", lambda s: torch.nn.grad.conv2d_input(
        s["A"].shape, s["W"].transpose(0, 1), s["dO"], 1, 1), "block_structured"),
    "every 32nd channel stores lane 30": ("forward", lambda s: F.conv2d(s["A"], s["W"], None, 1, 1)[
        :, [c - 1 if c % 32 == 31 else c for c in range(32)]], "periodic_lane"),
}


@pytest.mark.parametrize("bug", BUGS)
def test_hand_written_bugs_fail(bug):
    """The tail of a spread (above) needs one everywhere: these bugs keep failing, as what they are."""
    computation, buggy, expect = BUGS[bug]
    sample = conv_sample(0)
    golden, env = references(sample, computation)
    got = classify(buggy(sample), golden, env)
    assert got == expect and not detect.passes(got)
