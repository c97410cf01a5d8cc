"""Pseudo-error models checked against the README's words by an independent computation: split-K
tiles, casts of every op's operands, and results in any memory layout."""

from __future__ import annotations

import copy
import math
import struct

import pytest
import torch
import torch.nn.functional as F

from peat import errors, kernels

torch.set_num_threads(1)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def changed(old, new):
    """The README's change: NaN left NaN, or +0 made -0, is none."""
    return ~((old == new) | (old.isnan() & new.isnan()))


def one_tile(mask: torch.Tensor, size: int) -> tuple[slice, slice]:
    """The aligned ``size`` x ``size`` tile holding every True of a 2-D ``mask`` (asserted)."""
    rows, cols = mask.any(1).nonzero().view(-1), mask.any(0).nonzero().view(-1)
    assert len(rows), "nothing changed"
    r0, c0 = int(rows[0]) // size * size, int(cols[0]) // size * size
    assert int(rows[-1]) < r0 + size and int(cols[-1]) < c0 + size, "changes outside one aligned tile"
    return slice(r0, r0 + size), slice(c0, c0 + size)


# -- split-K -----------------------------------------------------------------------------------
def _absorbing_linear():
    """K = 8 in chunks of 4: chunk 0's operands 1e-9 of chunk 1's, so missing its partial sum
    leaves every output element as it was (below half a unit in the last place)."""
    x = torch.cat([torch.randn(6, 4, generator=gen(1)) * 1e-9, torch.randn(6, 4, generator=gen(2))], 1)
    w = torch.randn(5, 8, generator=gen(3))
    golden = F.linear(x, w)
    assert torch.equal(golden - F.linear(x[:, :4], w[:, :4]), golden)  # chunk 0 is absorbed
    return (x, w, None), {}, golden, (x[:, 4:].double() @ w[:, 4:].double().t()).float()


def _absorbing_conv():
    """A conv whose input channels 0-1 (chunk 0 of tile:2) hold values 1e-9 of channels 2-3's; a bias of
    100 keeps every output element far from zero, where no sum is absorbed."""
    x = torch.randn(2, 4, 5, 5, generator=gen(4))
    x[:, :2] *= 1e-9
    w, b = torch.randn(3, 4, 3, 3, generator=gen(5)), torch.full((3,), 100.0)
    hp = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    golden = F.conv2d(x, w, b, **hp)
    assert torch.equal(golden - F.conv2d(x[:, :2], w[:, :2], None, **hp), golden)
    return (x, w, b), hp, golden, F.conv2d(x[:, 2:].double(), w[:, 2:].double(), None, **hp).float()


@pytest.mark.parametrize("op, make, size", [("linear", _absorbing_linear, 4), ("conv2d", _absorbing_conv, 2)])
def test_splitk_never_misses_a_partial_sum_the_result_absorbs(op, make, size):
    """README: split-K never misses a partial sum that leaves the result as it was; another chunk is
    drawn. A chunk whose sum the rounding absorbed (not exactly zero) was kept: about half the seeds
    returned golden's values (a NotInjected row in playback, a clean run in training)."""
    args, hp, golden, other = make()
    for seed in range(16):
        out = errors.faulty(kernels.golden(op), f"tile:{size}:splitk", seed=seed).forward(*args, **hp)
        m, g, o = (errors.matrix(a) for a in (out, golden, other))
        tile = one_tile(changed(g, m), size)
        # The other chunk's partial sum, missed: within float32 rounding of golden minus it.
        assert torch.allclose(m[tile], g[tile] - o[tile], rtol=1e-5, atol=1e-5), seed


def test_splitk_of_an_empty_reduction_leaves_the_result_as_it_was():
    """A linear weight gradient over no rows (K = 0) has no partial sum to miss: the result is returned
    as it is, or NotInjected where asked. It raised torch's RuntimeError ('random_ expects from < to'),
    a crash of the faulty kernel in training."""
    grad_out, x = torch.zeros(0, 3), torch.zeros(0, 4)
    golden = kernels.golden("linear")
    out = errors.faulty(golden, "tile:2:splitk", "weight_grad").weight_grad(grad_out, x)
    assert torch.equal(out, torch.zeros(3, 4))
    with pytest.raises(errors.NotInjected):
        errors.faulty(golden, "tile:2:splitk", "weight_grad", strict=True).weight_grad(grad_out, x)


# -- casts of every op's operands ---------------------------------------------------------------
def _tf32(t: torch.Tensor) -> torch.Tensor:
    """TF32 rounding written out on each float32's bits: 13 low mantissa bits, to nearest, ties to even."""
    def one(v: float) -> float:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        if not math.isfinite(v):
            return v
        low, kept = bits & 0x1FFF, bits & ~0x1FFF & 0xFFFFFFFF
        if low > 0x1000 or (low == 0x1000 and kept & 0x2000):
            kept += 0x2000
        return struct.unpack("<f", struct.pack("<I", kept))[0]

    values = torch.tensor([one(v) for v in t.contiguous().view(-1).tolist()]).reshape(t.shape)
    return torch.empty_like(t).copy_(values)  # the operand's own memory layout


CASTS = {"fp16": lambda t: t.half().float(), "bf16": lambda t: t.bfloat16().float(), "tf32": _tf32,
         "fp64": lambda t: t.double()}


def _calls():
    """(op, computation, args, kwargs) of each op's three computations on small operands."""
    r = lambda *shape, seed: torch.randn(*shape, generator=gen(seed))  # noqa: E731
    x4, go4 = r(2, 3, 4, 4, seed=10), r(2, 3, 4, 4, seed=11)
    conv = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    bn = dict(running_mean=r(3, seed=12), running_var=r(3, seed=13).abs() + 0.5, training=True, eps=1e-5)
    norm = dict(normalized_shape=(6,), eps=1e-5)
    x2, go2, w6 = r(4, 6, seed=14), r(4, 6, seed=15), r(6, seed=16)
    calls = {
        "linear": [(r(4, 6, seed=17), r(5, 6, seed=18), r(5, seed=19)), {}, (r(4, 5, seed=20), r(5, 6, seed=18)), {},
                   (r(4, 5, seed=20), r(4, 6, seed=17)), {}],
        "conv2d": [(x4, r(3, 3, 3, 3, seed=21), r(3, seed=22)), conv, (go4, r(3, 3, 3, 3, seed=21)),
                   conv | {"input_shape": (2, 3, 4, 4)}, (go4, x4), conv | {"weight_shape": (3, 3, 3, 3)}],
        "batch_norm": [(x4, r(3, seed=23), r(3, seed=24)), bn | {"momentum": 0.1}, (go4, x4, r(3, seed=23)), bn,
                       (go4, x4), bn],
        "layer_norm": [(x2, w6, r(6, seed=25)), norm, (go2, x2, w6), norm, (go2, x2), norm],
        "rms_norm": [(x2, w6, None), norm, (go2, x2, w6), norm, (go2, x2), norm],
    }
    return [(op, c, *each[2 * i:2 * i + 2]) for op, each in calls.items() for i, c in enumerate(kernels.COMPUTATIONS)]


def _copied(kwargs):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("op, computation, args, kwargs", _calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_casts_compute_golden_on_operands_torch_rounds(op, computation, args, kwargs):
    """README: fp16, bf16, tf32 (operands rounded), fp64 (computed in float64), for every op and
    computation: bit for bit golden on operands cast as torch casts them (TF32 written out here), a
    float32 result; a training batch norm's statistics updated as that computation updates them."""
    gold = kernels.golden(op).computation(computation)
    for spec, cast in CASTS.items():
        got_kw, want_kw = _copied(kwargs), _copied(kwargs)
        got = errors.faulty(kernels.golden(op), spec, computation).computation(computation)(*args, **got_kw)
        # The statistics a training forward updates are state, not operands: float32 kept (float64 under fp64).
        state = ("running_mean", "running_var") if "momentum" in kwargs else ()
        round_ = lambda k, v: (v.double() if spec == "fp64" else v) if k in state else \
            cast(v) if torch.is_tensor(v) else v  # noqa: E731
        want_kw = {k: round_(k, v) for k, v in want_kw.items()}
        want = gold(*(cast(a) if a is not None else a for a in args), **want_kw).float()
        assert got.dtype == torch.float32 and torch.equal(got, want), spec
        for key in state:
            assert torch.equal(got_kw[key], want_kw[key].float()), (spec, key)


# -- memory layout ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["rv:3", "rz:2", "nan:2", "inf:2", "bit_flip:any:3", "lane:2", "lane:2:stuck:row",
                                  "tile:2", "tile:2:zero"])
def test_an_error_is_the_same_whatever_the_results_memory_layout(spec):
    """README: a result may come in any memory layout, and an NCHW tensor's columns are its channels.
    The same values in channels-last or transposed memory get the same error, bit for bit, as the
    same seed's on contiguous memory: positions, lanes and tiles are those of the values."""
    t = torch.randn(2, 5, 3, 3, generator=gen(30))
    t[0, 1] = 0  # a dead channel, zeros for rz and a zero tile to avoid
    contiguous = errors.inject(errors.faulty(kernels.golden("conv2d"), spec, seed=4), "forward", t, (), {})
    assert changed(t, contiguous).any()
    for layout in (t.contiguous(memory_format=torch.channels_last), t.transpose(2, 3).contiguous().transpose(2, 3)):
        assert not layout.is_contiguous()
        out = errors.inject(errors.faulty(kernels.golden("conv2d"), spec, seed=4), "forward", layout, (), {})
        assert torch.equal(out.contiguous().view(torch.int32), contiguous.contiguous().view(torch.int32))


@pytest.mark.parametrize("spec", ["lane:4", "lane:2:stuck:row", "tile:2", "tile:2:zero", "tile:2:splitk", "rz:2",
                                  "bit_flip:any:2"])
def test_an_error_leaves_the_results_memory_layout_as_it_was(spec):
    """An (N, C, 1, 1) convolution result rebuilt from its matrix view had channels-last strides (they pass
    as contiguous), so the batch norm after it in candidate or RFI training took its channels-last
    backward, and the run differed from golden beside the error in the last bits (ResNet-18's layer4 at
    32 x 32 images). The faulty result keeps golden's strides, and training around it is golden's but
    for the error's values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 512, 3), torch.nn.BatchNorm2d(512), torch.nn.Flatten(),
                                torch.nn.Linear(512, 2))
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16, 3, 3, generator=gen(40))
    kernels.route(model, errors.faulty(kernels.golden("conv2d"), spec, seed=2), ["0"])
    hp = dict(stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1)
    replayed = errors.faulty(kernels.golden("conv2d"), spec, seed=2)

    def hook(module, args, golden):  # the same faulty values, in the layout golden gives them
        out = replayed.forward(args[0], module.weight.detach(), module.bias.detach(), **hp)
        assert out.stride() == golden.stride()
        return out.clone(memory_format=torch.contiguous_format) + (golden - golden.detach())

    twin[0].register_forward_hook(hook)
    for net in (model, twin):
        net(x).square().sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_stale_tile_after_a_result_of_another_shape_is_zero_then_that_results():
    """README: in training, the previous call is whatever layer the faulty kernel computed last: zeros
    where that result had another shape, its values where it had the same."""
    faulty = errors.faulty(kernels.golden("linear"), "tile:2", "forward", seed=1)
    w = torch.randn(3, 4, generator=gen(31))
    faulty.forward(torch.randn(6, 4, generator=gen(32)), w, None)  # a (6, 3) result
    second_in, third_in = torch.randn(4, 4, generator=gen(33)), torch.randn(4, 4, generator=gen(34))
    second, golden2 = faulty.forward(second_in, w, None), F.linear(second_in, w)
    tile = one_tile(changed(golden2, second), 2)
    assert (second[tile] == 0).all()
    third, golden3 = faulty.forward(third_in, w, None), F.linear(third_in, w)
    tile = one_tile(changed(golden3, third), 2)
    assert torch.equal(third[tile], golden2[tile])
