"""Pseudo-error models do exactly what their spec says: counts, bits, periods, tiles, seeds."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from peat import errors, kernels
from peat.io import PeatError

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def t():
    return torch.randn(12, 40, generator=gen(1)) * 3 + 0.5


def bits(x):
    return x.contiguous().view(torch.int32)


def changed(a, b):
    return bits(a) != bits(b)


# -- precision -------------------------------------------------------------------------------
def test_fp16_bf16_round_trip_exactly(t):
    assert torch.equal(errors.parse("fp16").apply(t, gen()), t.half().float())
    assert torch.equal(errors.parse("bf16").apply(t, gen()), t.bfloat16().float())


def test_tf32_keeps_10_mantissa_bits_rounding_to_nearest_even(t):
    out = errors.round_to(t, "tf32")
    assert (bits(out) & 0x1FFF).eq(0).all()
    down = (bits(t) & ~0x1FFF).view(torch.float32)
    up = (bits(down) + 0x2000).view(torch.float32)
    nearest = torch.minimum((down - t).abs(), (up - t).abs())
    assert torch.equal((out - t).abs(), nearest)
    # Exact ties go to the even neighbour: 0x3F801000 -> 0x3F800000, 0x3F803000 -> 0x3F804000.
    ties = torch.tensor([0x3F801000, 0x3F803000], dtype=torch.int32).view(torch.float32)
    assert bits(errors.round_to(ties, "tf32")).tolist() == [0x3F800000, 0x3F804000]
    special = torch.tensor([float("inf"), float("nan"), 0.0])
    assert bits(errors.round_to(special, "tf32")).tolist() == bits(special).tolist()


@pytest.mark.parametrize("spec, ulp", [("fp16", 2**-10), ("bf16", 2**-7), ("tf32", 2**-10)])
def test_float64_is_rounded_once_to_nearest_even(spec, ulp):
    """Just past a halfway point by less than float32 resolves: through float32 it became a tie, then went down."""
    past = 1 + ulp / 2 + 2**-40
    t = torch.tensor([past, -past, 1 + ulp / 2, 1e300, 2.0**-140], dtype=torch.float64)
    want = [1 + ulp, -1 - ulp, 1.0, math.inf, 0.0]
    assert errors.round_to(t, spec).tolist() == want


def test_casts_act_on_operands_in_faulty_kernels():
    x, w, b = torch.randn(5, 33, generator=gen(2)), torch.randn(7, 33, generator=gen(3)), torch.randn(7, generator=gen(4))
    golden = kernels.golden("linear")
    for spec in ("fp16", "bf16", "tf32"):
        got = errors.faulty(golden, spec).forward(x, w, b)
        want = torch.nn.functional.linear(*(errors.round_to(a, spec) for a in (x, w, b)))
        assert torch.equal(got, want) and not torch.equal(got, golden.forward(x, w, b))
    got = errors.faulty(golden, "fp64").forward(x, w, b)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.nn.functional.linear(x.double(), w.double(), b.double()).float())


def test_faulty_refuses_a_kernel_given_by_its_impl_in_one_line():
    """faulty("kernels/my_gemm.py", ...) (the impl, not the loaded kernel) failed in
    AttributeError: 'str' object has no attribute 'computation'."""
    with pytest.raises(PeatError, match=re.escape(
            "errors.faulty: kernel='kernels/my_gemm.py' is not a kernel; load one with peat.kernels.load(impl, op)")):
        errors.faulty("kernels/my_gemm.py", "lane:4")


def bn_operands():
    x = torch.randn(4, 3, 5, 5, generator=gen(12))
    w, b = torch.rand(3, generator=gen(13)) + 0.5, torch.randn(3, generator=gen(14))
    return x, w, b, [torch.randn(3, generator=gen(15)), torch.rand(3, generator=gen(16)) + 0.5]


def test_fp64_batch_norm_in_training_updates_its_running_statistics_in_float64():
    x, w, b, stats = bn_operands()
    mean, var = (s.clone() for s in stats)
    out = errors.faulty(kernels.golden("batch_norm"), "fp64").forward(
        x, w, b, running_mean=mean, running_var=var, training=True, momentum=0.1, eps=1e-5)
    wide = [s.double() for s in stats]
    want = torch.nn.functional.batch_norm(x.double(), *wide, w.double(), b.double(), True, 0.1, 1e-5)
    assert out.dtype == torch.float32 and torch.equal(out, want.float())
    assert torch.equal(mean, wide[0].float()) and torch.equal(var, wide[1].float())


def test_casts_leave_the_running_statistics_an_eval_batch_norm_only_reads():
    x, w, b, stats = bn_operands()
    for spec in errors.CASTS:
        mean, var = (s.clone() for s in stats)
        out = errors.faulty(kernels.golden("batch_norm"), spec).forward(
            x, w, b, running_mean=mean, running_var=var, training=False, momentum=0.1, eps=1e-5)
        assert torch.equal(mean, stats[0]) and torch.equal(var, stats[1])
        rounded = (errors.round_to(a, spec) for a in (x, *stats, w, b))
        want = torch.nn.functional.batch_norm(*rounded, False, 0.1, 1e-5)
        assert torch.equal(out, want.to(torch.float32))


@pytest.mark.parametrize("computation", ["input_grad", "weight_grad"])
def test_fp64_batch_norm_gradients_in_training_leave_the_running_statistics_alone(computation):
    """A training batch norm's backward does not update its statistics, but fp64 wrote its float64
    copies back there too: each candidate and RFI run of a faulty kernel with error fp64 on a batch norm
    gradient was a 'crash', the kernel said to write into its input running_mean."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    routed = copy.deepcopy(plain)
    kernels.route(routed, errors.faulty(kernels.golden("batch_norm"), "fp64", computation), ["1"])
    x = torch.randn(4, 3, 8, 8)
    for model in (plain, routed):
        model(x).square().sum().backward()
    assert torch.equal(plain[1].running_mean, routed[1].running_mean)
    assert torch.equal(plain[1].running_var, routed[1].running_var)
    grads = [(m[0].weight.grad, m[1].weight.grad) for m in (plain, routed)]
    changed_grad = grads[1][0] if computation == "input_grad" else grads[1][1]
    assert torch.allclose(changed_grad, grads[0][0] if computation == "input_grad" else grads[0][1], rtol=1e-4)


# -- element errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 7])
def test_rv_changes_exactly_n_positions(t, n):
    out = errors.parse(f"rv:{n}").apply(t, gen())
    assert int(changed(out, t).sum()) == n
    assert torch.isfinite(out).all()
    # Drawn from the tensor's own distribution: well inside mean +- 6 std.
    moved = out[changed(out, t)]
    assert ((moved - t.mean()).abs() < 6 * t.std()).all()


# One std below the dtype's spacing: an offset of one std rounds back.
SPACED = [(torch.randn(1000, generator=gen(1)) * 0.5 + 300).bfloat16(),  # spaced by 2
          torch.full((1000,), 1e8)]  # spaced by 8, std taken as 1


@pytest.mark.parametrize("t", SPACED)
def test_rv_changes_n_positions_where_one_std_is_below_the_dtypes_spacing(t):
    out = errors.parse("rv:50").apply(t, gen())
    assert int((out != t).sum()) == 50


def test_rz_zeroes_exactly_n_nonzero_positions(t):
    out = errors.parse("rz:5").apply(t, gen())
    mask = changed(out, t)
    assert int(mask.sum()) == 5 and (out[mask] == 0).all() and (t[mask] != 0).all()


def test_nan_and_inf_exact_counts_and_signs(t):
    out = errors.parse("nan:4").apply(t, gen())
    assert int(out.isnan().sum()) == 4 and int(changed(out, t).sum()) == 4
    out = errors.parse("inf:6").apply(t, gen())
    mask = out.isinf()
    assert int(mask.sum()) == 6 and int(changed(out, t).sum()) == 6
    assert torch.equal(out[mask].sign(), t[mask].sign())


@pytest.mark.parametrize("spec", ["nan:3", "inf:3"])
def test_nan_and_inf_change_n_finite_positions_where_some_are_already_non_finite(t, spec):
    """A NaN or inf drawn over a NaN or inf changed nothing: under RFI, a call on a partly diverged
    output showed fewer changed elements than N. Where all are finite, the positions are those the
    same seed drew before (the whole tensor's)."""
    model = errors.parse(spec)
    assert torch.equal(changed(model.apply(t, gen(3)), t), changed(errors.parse(spec).apply(t, gen(3)), t))
    flat = t.flatten()
    assert torch.equal(changed(model.apply(t, gen(3)), t).flatten().nonzero().view(-1).sort().values,
                       errors._choose(flat.numel(), 3, gen(3)).sort().values)
    bad = t.clone()
    bad.view(-1)[: bad.numel() - 5] = float("nan")
    bad.view(-1)[:4] = -math.inf
    for seed in range(20):
        out = model.apply(bad, gen(seed))
        assert int((~out.isfinite()).sum()) == bad.numel() - 2  # 3 of the 5 finite ones
    assert not model.apply(bad.view(-1)[-2:], gen(0)).isfinite().any()  # fewer finite than N: all of them


@pytest.mark.parametrize("spec, fill", [("rz:2", 0.0), ("rz:1", -0.0), ("nan:1", math.nan), ("inf:3", math.inf)])
def test_an_element_error_with_nothing_to_change_is_not_injected(spec, fill):
    """rz on an all-zero output (a dead ReLU layer's gradient), nan or inf where all are already
    so, returned golden's values: playback scored such a case as injected (a case labeled
    random_zero that was golden). Strict (playback's cases), it says so; else it leaves the result."""
    x, w = torch.full((6, 10), fill), torch.ones(9, 10)
    base = kernels.golden("linear")
    result = base.forward(x, w, None)
    loose = errors.faulty(base, spec).forward(x, w, None)
    assert torch.equal(bits(loose), bits(result))
    strict = errors.faulty(base, spec, strict=True)
    with pytest.raises(errors.NotInjected) as err:
        strict.forward(x, w, None)
    assert str(err.value) == (f"error spec {spec!r} changes nothing in this result (shape (6, 9)): every element "
                              "it can act on already holds what it would set")
    assert isinstance(err.value, errors.NotApplicable)  # playback's not_applicable row, not the kernel's crash
    with pytest.raises(errors.NotInjected):
        errors.inject(strict, "forward", result, [x, w, None], {})
    live = torch.randn(6, 10, generator=gen(4))  # one element it can change: injected, strict or not
    injected = [errors.faulty(base, spec, strict=s).forward(live, w, None) for s in (True, False)]
    assert torch.equal(bits(injected[0]), bits(injected[1]))
    assert not torch.equal(bits(injected[0]), bits(base.forward(live, w, None)))


def test_inf_keeps_the_sign_of_a_negative_zero():
    t = torch.tensor([-0.0, 0.0] * 3)
    assert errors.parse("inf:6").apply(t, gen()).tolist() == [-math.inf, math.inf] * 3


def test_apply_never_changes_its_input(t):
    before = t.clone()
    for spec in ("rv:3", "rz:2", "nan:1", "bit_flip:any:5", "lane:4", "tile:4:zero"):
        errors.parse(spec).apply(t, gen())
    assert torch.equal(t, before)


@pytest.mark.parametrize("spec, n", [("rv:3", 3), ("rz:2", 2), ("nan:1", 1), ("inf:2", 2), ("bit_flip:any:5", 5)])
def test_element_errors_on_a_non_contiguous_output(t, spec, n):
    """A kernel may return a transposed result (a weight gradient computed as (x^T g)^T)."""
    transposed = t.t()
    assert not transposed.is_contiguous()
    out = errors.parse(spec).apply(transposed, gen())
    assert out.shape == transposed.shape and int(changed(out, transposed).sum()) == n



def test_random_value_statistics_equal_those_of_the_finite_values_alone():
    """The mean and std drawn from are those of the finite values, in order, as one contiguous
    float64 vector: bit for bit, whatever the output's dtype, strides or non-finite values (a
    strided float64 view summed in place rounds its mean differently)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(1000, 301, generator=g, dtype=torch.float64) * 1e3
    holed = wide.float().clone()
    holed[3, 5], holed[7, 1] = float("nan"), -float("inf")
    for t in (wide[:, 1::2], wide.reshape(-1)[::3], wide.t(), holed, holed.t(), wide.half(), wide.bfloat16(),
              torch.tensor([2.5]), torch.empty(3, 0), torch.full((4,), float("nan"))):
        finite = t.double()[torch.isfinite(t)]
        expected = (float(finite.mean()), float(finite.std()) if finite.numel() > 1 else 0.0) if finite.numel() else (0.0, 1.0)
        assert errors._finite_stats(t) == (expected[0], expected[1] or 1.0)

# -- bit flips -----------------------------------------------------------------------------
def xor_masks(out, t):
    mask = changed(out, t)
    return mask, (bits(out) ^ bits(t))[mask]


@pytest.mark.parametrize("spec, count, lo, hi, burst", [
    ("bit_flip:exponent", 1, 23, 30, 1), ("bit_flip:mantissax3:5", 5, 0, 22, 3), ("bit_flip:sign:2", 2, 31, 31, 1),
    ("bit_flip:any:8", 8, 0, 31, 1), ("bit_flip:exponentx8", 1, 23, 30, 8)])
def test_bit_flip_region_and_burst(t, spec, count, lo, hi, burst):
    mask, xors = xor_masks(errors.parse(spec).apply(t, gen()), t)
    assert int(mask.sum()) == count
    for value in xors.tolist():
        value &= 0xFFFFFFFF
        assert bin(value).count("1") == burst
        low = (value & -value).bit_length() - 1
        assert value == ((1 << burst) - 1) << low  # adjacent bits
        assert lo <= low and low + burst - 1 <= hi


def test_bit_flip_at_a_given_bit(t):
    mask, xors = xor_masks(errors.parse("bit_flip:30x2:4").apply(t, gen()), t)
    assert int(mask.sum()) == 4
    assert [v & 0xFFFFFFFF for v in xors.tolist()] == [0xC0000000] * 4
    mask, xors = xor_masks(errors.parse("bit_flip:0").apply(t, gen()), t)
    assert xors.tolist() == [1]


def value_changes(out, t):
    """Elements whose value differs: -0.0 for +0.0, or one NaN for another, is none (as every score)."""
    return ~((out == t) | (out.isnan() & t.isnan()))


@pytest.mark.parametrize("spec, n", [("bit_flip:sign", 1), ("bit_flip:sign:3", 3), ("bit_flip:31:4", 4),
                                     ("bit_flip:any:6", 6), ("bit_flip:mantissax2:3", 3), ("bit_flip:22:2", 2)])
def test_bit_flip_changes_the_value_of_n_elements_where_golden_holds_zeros_and_nan(spec, n):
    """A sign flip of a zero (half of a ReLU's output) gives -0.0, a mantissa or sign flip of a
    NaN another NaN: the value stayed, and a case labeled bit_flip was golden (bit_flip:sign on a
    ReLU output: 17 of 20 seeds hit one in two calls). Each flip now changes a value; a draw that
    lands on an element it changes is the one it always was."""
    t = torch.relu(torch.randn(12, 40, generator=gen(1)))
    t[::3] = math.nan
    t[1, 3] = -0.0
    for seed in range(20):
        model, g = errors.parse(spec), gen(seed)
        for _ in range(2):  # consecutive calls of a faulty kernel: each changes n values
            out = model.apply(t, g)
            mask = value_changes(out, t)
            assert int(mask.sum()) == n and int(changed(out, t).sum()) == n
    ordinary = torch.randn(12, 40, generator=gen(1))  # no zero, no NaN: the positions the same seed always drew
    positions = changed(errors.parse(spec).apply(ordinary, gen(3)), ordinary).view(-1).nonzero().view(-1)
    assert torch.equal(positions, errors._choose(ordinary.numel(), n, gen(3)).sort().values)


@pytest.mark.parametrize("spec", ["bit_flip:sign", "bit_flip:31:3", "bit_flip:mantissa"])
def test_a_bit_flip_with_no_value_to_change_is_not_injected(spec):
    """Sign flips on an all-zero output (a dead ReLU layer); mantissa flips where all is NaN (of two
    mantissa bits: no single flip clears it to inf)."""
    t = torch.zeros(4, 5) if "mantissa" not in spec else torch.full((4, 5), 0x7FC00001, dtype=torch.int32).view(torch.float32)
    assert torch.equal(bits(errors.parse(spec).apply(t, gen())), bits(t))
    with pytest.raises(errors.NotInjected):
        dataclasses.replace(errors.parse(spec), strict=True).apply(t, gen())
    zeros = torch.zeros(4, 5)  # any bit but the sign changes a zero
    assert int(value_changes(errors.parse("bit_flip:any:20").apply(zeros, gen()), zeros).sum()) == 20


def test_bit_flip_rejects_other_dtypes_and_oversized_bursts():
    with pytest.raises(PeatError) as err:
        errors.parse("bit_flip:exponent").apply(torch.zeros(3, dtype=torch.float64), gen())
    assert str(err.value) == "error spec 'bit_flip:exponent': bit flips act on float32 tensors, got torch.float64"
    with pytest.raises(PeatError) as err:
        errors.parse("bit_flip:signx2")
    assert str(err.value) == "error spec 'bit_flip:signx2': a burst of 2 bits does not fit in bits 31-31"


# -- lanes -----------------------------------------------------------------------------------
def test_lane_offsets_every_kth_column(t):
    out = errors.parse("lane:8").apply(t, gen())
    cols = changed(out, t).all(0).nonzero().view(-1).tolist()
    assert changed(out, t).any(0).nonzero().view(-1).tolist() == cols  # whole columns, nothing else
    assert len(cols) == 5 and cols == list(range(cols[0], 40, 8)) and cols[0] < 8
    delta = (out - t)[:, cols]
    assert torch.allclose(delta, torch.full_like(delta, float(t.double().std())), rtol=1e-5)


@pytest.mark.parametrize("t", SPACED)
@pytest.mark.parametrize("axis", ["col", "row"])
def test_lane_offsets_every_element_of_its_lanes_where_one_std_is_below_the_dtypes_spacing(t, axis):
    t = t.reshape(25, 40)
    dim = 0 if axis == "col" else 1
    out = errors.parse(f"lane:8:{axis}").apply(t, gen())
    lanes = (out != t).any(dim).nonzero().view(-1).tolist()
    assert lanes and lanes == list(range(lanes[0], t.shape[1 - dim], 8))
    assert (out != t).all(dim)[lanes].all() and (out >= t).all()


def test_lane_stuck_rows_and_nchw_channels(t):
    out = errors.parse("lane:5:stuck:row").apply(t, gen())

    def stuck_at(lane):  # rows lane, lane+5, ... each hold their first value; all other rows untouched
        rows = list(range(lane, 12, 5))
        others = [r for r in range(12) if r not in rows]
        return all((out[r] == t[r, 0]).all() for r in rows) and torch.equal(out[others], t[others])

    assert [lane for lane in range(5) if stuck_at(lane)] != [] and len([lane for lane in range(5) if stuck_at(lane)]) == 1
    x = torch.randn(2, 12, 3, 3, generator=gen(5))
    out = errors.parse("lane:4").apply(x, gen())
    channels = changed(out, x).any(0).any(-1).any(-1).nonzero().view(-1).tolist()
    assert len(channels) == 3 and channels == list(range(channels[0], 12, 4))
    assert changed(out, x)[:, channels].all()


@pytest.mark.parametrize("spec", ["lane:64", "lane:99999999999999999999", "lane:99999999999999999999:stuck:row"])
def test_a_lane_period_beyond_the_width_hits_one_lane(t, spec):
    """The schema takes any period: one past int64 wrapped in the slice, and lane:K offset nothing
    (a faulty kernel trained as golden) or lane:K:stuck:row ended its run in as_strided's error."""
    row = spec.endswith("row")
    wrong = changed(out := errors.parse(spec).apply(t, gen()), t)
    lanes = wrong.any(1 if row else 0).nonzero().view(-1).tolist()
    assert len(lanes) == 1
    assert (out[lanes[0]] == t[lanes[0], 0]).all() if row else wrong[:, lanes[0]].all()


@pytest.mark.parametrize("shape", [(40,), (1, 40)])
def test_a_stuck_lane_one_row_tall_is_stuck_at_its_first_element(shape):
    """A norm layer's weight gradient is a vector: each of its lane's columns holds one value, so
    stuck at the column's first value changed nothing, and a deliberately faulty kernel with
    lane:K:stuck on it trained, and played back, exactly as golden."""
    t = torch.randn(shape, generator=gen(2))
    out = errors.parse("lane:8:stuck").apply(t, gen()).reshape(-1)
    flat = t.reshape(-1)
    lanes = changed(out, flat).nonzero().view(-1).tolist()
    assert len(lanes) == 4 and lanes == list(range(lanes[0], 40, 8)) and 8 <= lanes[0] < 16
    assert (out[lanes[0] - 8::8] == flat[lanes[0] - 8]).all()


def test_a_lane_offset_never_falls_on_a_lane_it_leaves_as_it_was(t):
    """inf + std is inf: a lane:K on lanes all inf (or NaN) changed nothing, a case labeled
    periodic_lane that was golden (half the seeds here). A lane it changes is drawn instead."""
    t = t.clone()
    t[:, ::2] = math.inf  # lanes 0 and 2 of 4
    for seed in range(20):
        out = errors.parse("lane:4").apply(t, gen(seed))
        wrong = value_changes(out, t)
        cols = wrong.any(0).nonzero().view(-1).tolist()
        assert int(wrong.sum()) == 12 * 10 and cols == list(range(cols[0], 40, 4)) and cols[0] in (1, 3)
    ordinary = torch.randn(12, 40, generator=gen(1))  # every lane changes: the lane the same seed always drew
    first = changed(errors.parse("lane:8").apply(ordinary, gen(3)), ordinary).any(0).nonzero().view(-1)[0]
    assert int(first) == int(torch.randint(8, (1,), generator=gen(3)))


def test_a_stuck_lane_never_falls_on_dead_channels():
    """A lane stuck at each channel's first value on dead (all-zero) channels, or a vector's lane
    stuck at its own first element where all of it is zero, changed nothing."""
    x = torch.randn(2, 8, 5, 5, generator=gen(5))
    x[:, ::2] = 0  # lanes 0 and 2 of lane:4 are dead channels
    for seed in range(20):
        wrong = value_changes(errors.parse("lane:4:stuck").apply(x, gen(seed)), x)
        channels = wrong.any(0).any(-1).any(-1).nonzero().view(-1).tolist()
        assert channels in ([1, 5], [3, 7]) and int(wrong.sum()) == 2 * (2 * 5 * 5 - 1)
    vector = torch.zeros(40)
    vector[3] = 1.0  # of lane:8's lanes, only lane 3 has an element its first one differs from
    for seed in range(20):
        out = errors.parse("lane:8:stuck").apply(vector, gen(seed))
        assert value_changes(out, vector).nonzero().view(-1).tolist() == [11, 19, 27, 35] and (out[3::8] == 1).all()


@pytest.mark.parametrize("spec, t", [("lane:4:stuck", torch.ones(6, 8)), ("lane:2", torch.full((3, 4), math.inf)),
                                     ("lane:4:stuck:row", torch.zeros(8, 3)), ("tile:4:zero", torch.zeros(6, 6)),
                                     ("tile:2", torch.zeros(4, 4))])
def test_a_structured_error_with_nothing_to_change_is_not_injected(spec, t):
    assert torch.equal(errors.parse(spec).apply(t, gen()), t)
    with pytest.raises(errors.NotInjected):
        dataclasses.replace(errors.parse(spec), strict=True).apply(t, gen())


@pytest.mark.parametrize("spec", ["lane:4", "lane:4:stuck:row", "tile:4", "tile:4:zero"])
@pytest.mark.parametrize("shape", [(0,), (5, 0), (0, 5), (0, 3, 2, 2), (2, 0, 2, 2)])
def test_structured_errors_leave_an_empty_output_empty(spec, shape):
    t = torch.zeros(shape)
    assert errors.parse(spec).apply(t, gen()).shape == t.shape


# -- tiles -----------------------------------------------------------------------------------
def tile_of(mask, size):
    rows, cols = mask.any(1).nonzero().view(-1), mask.any(0).nonzero().view(-1)
    r0, c0 = int(rows[0]) // size * size, int(cols[0]) // size * size
    return rows, cols, r0, c0


def test_tile_zero_is_one_aligned_tile(t):
    out = errors.parse("tile:4:zero").apply(t, gen())
    mask = out != t
    rows, cols, r0, c0 = tile_of(mask, 4)
    assert rows.tolist() == list(range(r0, r0 + 4)) and cols.tolist() == list(range(c0, c0 + 4))
    assert (out[r0:r0 + 4, c0:c0 + 4] == 0).all() and int(mask.sum()) == 16


@pytest.mark.parametrize("spec", ["tile:8:zero", "tile:8"])
def test_a_zero_tile_never_falls_on_a_tile_already_zero(spec):
    """Zero padding (or a ReLU) leaves whole tiles zero: zeroing one, or a stale tile's zeros on
    the first call, changed nothing (12 of 20 seeds here). A tile holding a value is drawn instead."""
    t = torch.randn(24, 24, generator=gen(6))
    t[16:], t[:, 16:] = 0, 0  # 5 of the 9 tiles
    for seed in range(20):
        wrong = value_changes(errors.parse(spec).apply(t, gen(seed)), t)
        rows, cols, r0, c0 = tile_of(wrong, 8)
        assert int(wrong.sum()) == 64 and r0 < 16 and c0 < 16
    ordinary = torch.randn(24, 24, generator=gen(6))  # every tile changes: the tile the same seed always drew
    _, _, r0, c0 = tile_of(changed(errors.parse(spec).apply(ordinary, gen(3)), ordinary), 8)
    assert (r0 // 8) * 3 + c0 // 8 == int(torch.randint(9, (1,), generator=gen(3)))


def test_a_splitk_tile_never_misses_a_partial_sum_of_zeros():
    """Operands a ReLU or padding zeroed over a K chunk sum to zero there: missing it changed nothing
    (chunks 2 and 3 of 6 here). A chunk that contributes is missed instead."""
    x, w = torch.randn(16, 24, generator=gen(8)), torch.randn(12, 24, generator=gen(9))
    x[:, 8:16] = 0
    golden = torch.nn.functional.linear(x, w)
    for seed in range(20):
        out = errors.faulty(kernels.golden("linear"), "tile:4:splitk", seed=seed).forward(x, w, None)
        assert int(value_changes(out, golden).sum()) == 16
    with pytest.raises(errors.NotInjected):
        errors.faulty(kernels.golden("linear"), "tile:4:splitk", strict=True).forward(torch.zeros(16, 24), w, None)


def test_tile_stale_holds_previous_call():
    model = errors.parse("tile:4")
    first, second = torch.randn(8, 8, generator=gen(6)), torch.randn(8, 8, generator=gen(7))
    g = gen()
    out1 = model.apply(first, g)
    assert int((out1 != first).sum()) == 16 and (out1[out1 != first] == 0).all()  # first call: nothing to hold
    out2 = model.apply(second, g)
    mask = out2 != second
    assert int(mask.sum()) == 16 and torch.equal(out2[mask], first[mask])


def test_tile_splitk_misses_one_partial_sum():
    x, w = torch.randn(8, 12, generator=gen(8)), torch.randn(8, 12, generator=gen(9))
    out = errors.faulty(kernels.golden("linear"), "tile:4:splitk").forward(x, w, None)
    golden = x @ w.t()
    mask = (out - golden).abs() > 1e-6
    rows, cols, r0, c0 = tile_of(mask, 4)
    tile = (slice(r0, r0 + 4), slice(c0, c0 + 4))
    partials = [x[:, k:k + 4] @ w[:, k:k + 4].t() for k in (0, 4, 8)]
    assert any(torch.allclose((golden - out)[tile], p[tile], atol=1e-5) for p in partials)
    assert not mask[~_tile_mask(8, 8, *tile)].any()
    with pytest.raises(PeatError) as err:
        errors.parse("tile:4:splitk").apply(golden, gen())
    assert str(err.value) == "error spec 'tile:4:splitk': needs the kernel's operands; use peat.errors.faulty"


def test_tile_splitk_on_a_grouped_conv_misses_one_partial_sum_of_each_group():
    # Depthwise and grouped convs (EfficientNet, MobileNet) reduce over each group's own channels.
    x, w = torch.randn(2, 8, 5, 5, generator=gen(8)), torch.randn(6, 4, 3, 3, generator=gen(9))
    hp = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=2)
    out = errors.faulty(kernels.golden("conv2d"), "tile:2:splitk").forward(x, w, None, **hp)
    missing = errors.matrix(torch.nn.functional.conv2d(x, w, None, **hp) - out)
    _, _, r0, c0 = tile_of(missing.abs() > 1e-6, 2)
    tile = (slice(r0, r0 + 2), slice(c0, c0 + 2))
    partials = [errors.matrix(torch.nn.functional.conv2d(x.unflatten(1, (2, 4))[:, :, k:k + 2].flatten(1, 2),
                                                         w[:, k:k + 2], None, **hp)) for k in (0, 2)]
    assert any(torch.allclose(missing[tile], p[tile], atol=1e-5) for p in partials)
    assert not (missing.abs() > 1e-6)[~_tile_mask(*missing.shape, *tile)].any()


def _tile_mask(rows, cols, r, c):
    m = torch.zeros(rows, cols, dtype=torch.bool)
    m[r, c] = True
    return m


# -- seeding, parsing, ground truth -------------------------------------------------------------
def test_faulty_kernels_are_seeded_and_advance_per_call():
    x, w = torch.randn(6, 10, generator=gen(10)), torch.randn(9, 10, generator=gen(11))
    a, b, c = (errors.faulty(kernels.golden("linear"), "rv:2", seed=s) for s in (0, 0, 1))
    first = [k.forward(x, w, None) for k in (a, b, c)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    assert not torch.equal(a.forward(x, w, None), first[0])  # the next call draws again
    assert a.name == "golden+rv:2" and a.input_grad is kernels.golden("linear").input_grad


@pytest.mark.parametrize("spec", ["rv:1", "bit_flip:30", "tile:4", "lane:2", "fp16", "tf32", "fp64"])
@pytest.mark.parametrize("returned", [None, "numpy", torch.float64, torch.bfloat16])
def test_a_faulty_kernels_result_of_the_wrong_kind_is_left_for_the_caller_to_name(spec, returned):
    """A user kernel that forgot its ``return`` (or returned a NumPy array, or float64) and carried an
    ``error`` crashed inside the error ("'NoneType' object has no attribute 'detach'", "bit flips act
    on float32 tensors"), or a cast hid its dtype, where without the error it is a shape_mismatch that
    names what it returned. The result comes back as the kernel returned it (fp64 alone computes in float64)."""
    x, w = torch.randn(6, 10, generator=gen(10)), torch.randn(9, 10, generator=gen(11))

    def forward(x, weight, bias):
        out = torch.nn.functional.linear(x, weight, bias)
        return None if returned is None else out.numpy() if returned == "numpy" else out.to(returned)

    kernel = kernels.Kernel("user", "linear", forward, *(kernels.GOLDEN["linear"][c] for c in ("input_grad", "weight_grad")),
                            custom=("forward",))
    got = errors.faulty(kernel, spec).forward(x, w, None)
    operands = [errors.round_to(a, spec) if spec in errors.CASTS else a for a in (x, w)]
    want = forward(*operands, None)
    if spec == "fp64" and torch.is_tensor(want):  # computed in float64 by design, then as the operands
        want = want.float()
    assert type(got) is type(want)
    if torch.is_tensor(want):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif want is not None:
        assert got.dtype == want.dtype and (got == want).all()


def test_every_bit_of_a_faulty_kernels_seed_changes_its_draws():
    """torch's generator keeps a seed's low 32 bits: seeds 2**32, 2**63 and 2**40 + 5 injected what
    seeds 0, 0 and 5 did, while the config takes 64-bit seeds. Seeds within 32 bits draw as ever."""
    x, w = torch.randn(6, 10, generator=gen(10)), torch.randn(9, 10, generator=gen(11))
    seeds = (0, 5, 2**32 - 1, 2**32, 2**40 + 5, 2**63, 2**64 - 1)
    outs = {s: errors.faulty(kernels.golden("linear"), "rv:2", seed=s).forward(x, w, None) for s in seeds}
    assert all(not torch.equal(outs[a], outs[b]) for i, a in enumerate(seeds) for b in seeds[i + 1:])
    plain = errors.parse("rv:2").apply(torch.nn.functional.linear(x, w), torch.Generator().manual_seed(5))
    assert torch.equal(outs[5], plain)


def test_a_replica_repeats_the_next_injection_without_advancing():
    x, w = torch.randn(6, 10, generator=gen(10)), torch.randn(9, 10, generator=gen(11))
    inner = errors.faulty(kernels.golden("linear"), "tile:4", seed=1)  # stale: zeros first, then the last output
    kernel = errors.faulty(inner, "rv:2", seed=2)  # a faulty kernel wrapping another
    for _ in range(2):
        twin = errors.replica(kernel, "forward")
        assert torch.equal(twin.forward(x * 2, w, None), kernel.forward(x * 2, w, None))
        twin.forward(x, w, None)  # advances the replica only
    plain = kernels.golden("linear")
    assert errors.replica(plain, "forward").forward is plain.forward


@pytest.mark.parametrize("spec", ["rv:3", "rz:1", "nan:1", "bit_flip:exponent", "lane:4", "tile:2", "tile:2:splitk"])
def test_injecting_into_the_base_kernels_result_equals_calling_the_faulty_kernel(spec):
    x, w = torch.randn(6, 10, generator=gen(10)), torch.randn(9, 10, generator=gen(11))
    base = kernels.golden("linear")
    called, injected = (errors.faulty(base, spec, seed=3) for _ in range(2))
    assert errors.reuses(injected, "forward", base)
    for scale in (1, 2):  # a stale tile holds the previous call's result: the state carries over
        args = [x * scale, w, None]
        want = called.forward(*args)
        got = errors.inject(injected, "forward", base.forward(*args), args, {})
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, NaN included


def test_only_errors_in_the_result_of_that_very_kernel_are_reused():
    base = kernels.golden("linear")
    assert not errors.reuses(errors.faulty(base, "bf16"), "forward", base)  # on its operands: calls it
    assert not errors.reuses(base, "forward", base)
    assert not errors.reuses(errors.faulty(base, "rv:1", "input_grad"), "forward", base)
    other = errors.faulty(base, "tile:4", seed=1)
    assert not errors.reuses(errors.faulty(other, "rv:1"), "forward", base)


@pytest.mark.parametrize("spec", ["fp8", "rv", "rv:0", "lane:0", "tile:x", "bit_flip:32", "bit_flip:exponent:0", "nan:-1"])
def test_bad_specs_name_the_spec(spec):
    with pytest.raises(PeatError, match=re.escape(repr(spec))):
        errors.parse(spec)


def test_ground_truth_classes():
    truth = {s: errors.parse(s).truth for s in ("fp16", "bf16", "tf32", "fp64", "rv:1", "rz:1", "bit_flip:sign",
                                                "lane:2", "tile:2", "nan:1", "inf:1")}
    assert truth == {"fp16": "reduced_precision", "bf16": "reduced_precision", "tf32": "reduced_precision",
                     "fp64": "reduced_precision", "rv:1": "random_value", "rz:1": "random_zero",
                     "bit_flip:sign": "bit_flip", "lane:2": "periodic_lane", "tile:2": "block_structured",
                     "nan:1": "non_finite", "inf:1": "non_finite"}


def test_schema_pattern_is_the_parsers():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    assert schema["$defs"]["error_spec"]["pattern"] == errors.SPEC_PATTERN
    # Both keys that take a spec are checked by that pattern.
    keys = schema["properties"]
    assert keys["errors"]["items"]["$ref"] == "#/$defs/error_spec"
    assert keys["kernels"]["additionalProperties"]["properties"]["error"]["$ref"] == "#/$defs/error_spec"
