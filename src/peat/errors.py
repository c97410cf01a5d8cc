"""Pseudo-error models: what a wrong GPU kernel does to its output, each doing exactly what it says.

Spec grammar (also the schema's pattern, see ``SPEC_PATTERN``):

    fp16 | bf16 | tf32 | fp64          operands rounded to that precision (fp64: computed in float64);
                                       ``apply`` on an output rounds the output itself
    rv:N                               N distinct positions set to values drawn from N(mean, std) of the tensor
    rz:N                               N distinct non-zero positions set to zero
    nan:N | inf:N                      N distinct finite positions set to NaN / to inf with the element's sign
    bit_flip:WHERE[xB][:N]             N distinct elements each get B adjacent bits (default 1) flipped in
                                       the float32 pattern; WHERE is sign|exponent|mantissa|any or a bit 0-31
                                       (the burst starts there and runs towards the sign bit)
    lane:K[:offset|stuck][:col|row]    every K-th column (or row), from a random lane l < K, offset by the
                                       tensor's std (default; at least to the next value up) or stuck at
                                       the lane's first value (each column's first row; in a one-row view,
                                       the lane's first element)
    tile:T[:stale|zero|splitk]         one random TxT tile keeps the previous call's values (stale, zeros on
                                       the first call), is zeroed, or misses one split-K partial sum
                                       (K chunks of T; GEMM-like computations via ``faulty`` only)

Columns and rows are those of the output's matrix view: the last dimension against the rest,
except 4-D (NCHW) tensors, whose columns are the channels (implicit-GEMM convention).
Every model is seeded through the ``torch.Generator`` it is given.

Each changes values, never bits alone (a NaN left NaN, +0.0 made -0.0, is none, as every score
counts it): elements, flips, lanes, tiles and split-K chunks are drawn where the error changes
one, the same as ever where all qualify (flips, lanes, tiles, chunks: wherever the seed's draw
lands on one that does). A result with nothing the error can change is returned as it was, or
raises ``NotInjected`` where asked (``strict``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import sys
from dataclasses import dataclass, field

import torch

from .io import PeatError
from . import kernels
from .kernels import COMPUTATIONS

CASTS = ("fp16", "bf16", "tf32", "fp64")
REGIONS = {"sign": (31, 31), "exponent": (23, 30), "mantissa": (0, 22), "any": (0, 31)}
SPEC_PATTERN = (r"^(fp16|bf16|tf32|fp64|(rv|rz|nan|inf):[1-9][0-9]*"
                r"|bit_flip:(sign|exponent|mantissa|any|[0-9]|[12][0-9]|3[01])(x[1-9][0-9]?)?(:[1-9][0-9]*)?"
                r"|lane:[1-9][0-9]*(:(offset|stuck))?(:(col|row))?"
                r"|tile:[1-9][0-9]*(:(stale|zero|splitk))?)$")
# Ground truth for the detector (docs/design.md).
TRUTH = {"fp16": "reduced_precision", "bf16": "reduced_precision", "tf32": "reduced_precision",
         "fp64": "reduced_precision", "rv": "random_value", "rz": "random_zero", "bit_flip": "bit_flip",
         "lane": "periodic_lane", "tile": "block_structured", "nan": "non_finite", "inf": "non_finite"}


# Where tile:T:splitk finds a reduction to split; a faulty kernel's split-K elsewhere is refused by the config check.
SPLITK = {("linear", c) for c in COMPUTATIONS} | {("conv2d", "forward")}
SPLITK_WHERE = "the linear op's three computations and the conv2d forward"


class NotApplicable(PeatError):
    """An error model that cannot act on this computation (a split-K tile on a norm layer):
    a limit of the injection, not a failure of the kernel it is injected into."""


class NotInjected(NotApplicable):
    """An error model that finds nothing to change in this result (``rz`` on an all-zero output, a
    zero tile where every tile is zero already): raised where asked (``strict``, playback's cases),
    as the result, golden's own values, would be counted as injected."""


@dataclass
class ErrorModel:
    """A parsed spec; ``apply`` returns a corrupted copy and never changes its input."""

    spec: str
    kind: str
    count: int = 1          # rv, rz, nan, inf, bit_flip: elements; lane: period K; tile: size T
    mode: str = ""          # lane: offset|stuck; tile: stale|zero|splitk; bit_flip: region or bit
    burst: int = 1
    axis: str = "col"
    strict: bool = False    # raise NotInjected where the result is left as it was
    _previous: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def truth(self) -> str:
        return TRUTH[self.kind]

    @property
    def on_operands(self) -> bool:
        return self.kind in CASTS

    def apply(self, t: torch.Tensor, generator: torch.Generator, operands=None) -> torch.Tensor:
        """A corrupted copy of ``t``. ``operands`` = (op, computation, args, kwargs) for tile splitk."""
        if self.kind in CASTS:
            out = round_to(t, self.kind) if self.kind != "fp64" else t.clone()
        elif self.kind in ("rv", "rz", "nan", "inf"):
            out = _positions(self, t, generator)
        elif self.kind == "bit_flip":
            out = _bit_flip(self, t, generator)
        elif self.kind == "lane":
            out = _lane(self, t, generator)
        else:
            out = _tile(self, t, generator, operands)
        out = _laid_out_as(out, t)
        if self.mode == "stale":  # what a stale tile would still hold next call; a copy of every result else
            self._previous = t.detach().clone()
        if self.strict and not self.on_operands and bool(_kept(t.detach(), out).all()):
            raise NotInjected(f"error spec {self.spec!r} changes nothing in this result (shape {tuple(t.shape)}): "
                              "every element it can act on already holds what it would set")
        return out


def _laid_out_as(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` in the memory layout of ``like``, the result the error went into: an error changes values,
    not the strides the rest of the model reads. A (N, C, 1, 1) result rebuilt from its matrix view had
    channels-last strides, which pass as contiguous, and a batch norm after it took its channels-last
    backward: training beside the error differed from golden's in the last bits."""
    if out.stride() == like.stride():
        return out
    laid = torch.empty_like(like)  # like's strides where dense, else contiguous ones
    return out if laid.stride() == out.stride() else laid.copy_(out)


def parse(spec: str) -> ErrorModel:
    """An ErrorModel from a spec such as ``rv:3``, ``bit_flip:exponentx2:4`` or ``tile:16:zero``."""
    if not isinstance(spec, str) or not re.match(SPEC_PATTERN, spec):
        raise PeatError(f"error spec {spec!r}: not understood; e.g. fp16, bf16, tf32, fp64, rv:3, rz:1, "
                        "bit_flip:exponent, bit_flip:30x2:4, lane:16, lane:8:stuck:row, tile:16:splitk, nan:1, inf:1")
    kind, *rest = spec.split(":")
    if kind in CASTS:
        return ErrorModel(spec, kind)
    if kind in ("rv", "rz", "nan", "inf"):
        return ErrorModel(spec, kind, count=int(rest[0]))
    if kind == "bit_flip":
        where, burst = re.fullmatch(r"(sign|exponent|mantissa|any|\d+)(?:x(\d+))?", rest[0]).groups()
        model = ErrorModel(spec, kind, count=int(rest[1]) if len(rest) > 1 else 1, mode=where, burst=int(burst or 1))
        lo, hi = _bit_range(model)
        if hi - lo + 1 < model.burst:
            raise PeatError(f"error spec {spec!r}: a burst of {model.burst} bits does not fit in bits {lo}-{hi}")
        return model
    if kind == "lane":
        opts = set(rest[1:])
        return ErrorModel(spec, kind, count=int(rest[0]), mode="stuck" if "stuck" in opts else "offset",
                          axis="row" if "row" in opts else "col")
    return ErrorModel(spec, kind, count=int(rest[0]), mode=rest[1] if len(rest) > 1 else "stale")


# -- precision -----------------------------------------------------------------------------
def round_to(t: torch.Tensor, precision: str) -> torch.Tensor:
    """``t`` rounded to fp16, bf16 or tf32 (10 mantissa bits, nearest-even), kept in its dtype."""
    if precision == "fp16":
        return _single(t).half().to(t.dtype)
    if precision == "bf16":
        return _single(t).bfloat16().to(t.dtype)
    if precision == "tf32":
        single = _single(t)
        bits = single.view(torch.int32)
        # Round-to-nearest-even at bit 13, then clear the 13 low mantissa bits.
        rounded = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
        out = torch.where(torch.isfinite(single), rounded, bits).view(torch.float32)
        return out.to(t.dtype)
    if precision == "fp64":
        return t.double()
    raise PeatError(f"unknown precision {precision!r}; allowed: {', '.join(CASTS)}")


def _single(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32 to round again, float64 rounded to odd (as ``alter._f32_round_to_odd``): rounding
    to nearest twice turns a float64 just past a halfway point into a float32 tie, then the wrong way."""
    single = t.float()
    if t.dtype != torch.float64:
        return single
    back = single.double()
    inexact = torch.isfinite(t) & (back != t)
    bits = single.view(torch.int32)
    bits = torch.where(inexact & (back.abs() > t.abs()), bits - 1, bits)  # towards zero
    return torch.where(inexact, bits | 1, bits).view(torch.float32)


# -- element errors ------------------------------------------------------------------------
def _choose(n: int, k: int, generator) -> torch.Tensor:
    """``k`` distinct positions out of ``n``, uniformly, drawn on the CPU (same draws on every device)."""
    if 8 * k >= n:  # a large share of n: one permutation costs less than k Python-level draws
        return torch.randperm(n, generator=generator)[:k]
    # Floyd's algorithm: k draws instead of a permutation of all n (5 ms for a million elements).
    chosen: dict[int, None] = {}
    for j in range(n - k, n):
        t = int(torch.randint(j + 1, (1,), generator=generator))
        chosen[j if t in chosen else t] = None
    return torch.tensor(list(chosen), dtype=torch.long)


def _positions(model: ErrorModel, t: torch.Tensor, generator) -> torch.Tensor:
    out = _flat_copy(t)
    flat = out.view(-1)
    # Only positions the error changes: zeroing a zero, or NaN/inf over a NaN or inf (a diverged
    # call's output under RFI), changed fewer than N elements. Where all qualify, the draws are
    # those of the whole tensor: the same seed picks the same positions.
    eligible = (flat != 0) if model.kind == "rz" else torch.isfinite(flat) if model.kind in ("nan", "inf") else None
    if eligible is None or bool(eligible.all()):
        idx = _choose(flat.numel(), model.count, generator).to(flat.device)
    else:
        candidates = torch.nonzero(eligible).view(-1).cpu()
        idx = candidates[_choose(len(candidates), model.count, generator)].to(flat.device)
    if model.kind == "rz":
        flat[idx] = 0
    elif model.kind == "nan":
        flat[idx] = float("nan")
    elif model.kind == "inf":
        # The sign bit, not < 0: a negative zero (a ReLU's gradient, an underflow) is negative too.
        flat[idx] = torch.where(torch.signbit(flat[idx]), -math.inf, math.inf).to(flat.dtype)
    else:
        mean, std = _finite_stats(t)
        values = (mean + std * torch.randn(len(idx), generator=generator, dtype=torch.float64)).to(flat.dtype).to(flat.device)
        # A draw equal to the old value would change nothing: nudge it by one std.
        values = torch.where(values == flat[idx], _nudged(values, std), values)
        flat[idx] = values
    return out


def _kept(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Where ``new`` holds ``old``'s value: equal (-0.0 and +0.0 alike) or both NaN, as every score of
    an error counts them (``scores.abs_error``, RFI's ``changed``)."""
    return (old == new) | (torch.isnan(old) & torch.isnan(new))


def _nudged(values: torch.Tensor, std: float) -> torch.Tensor:
    up = values + std
    if not values.is_floating_point():
        return up
    # One std below the dtype's spacing rounds back (bf16 near 300 is spaced by 2): the next value up.
    return torch.where(up == values, torch.nextafter(values, torch.full_like(values, math.inf)), up)


def _flat_copy(t: torch.Tensor) -> torch.Tensor:
    # Contiguous, so that positions index it flat: a plain clone keeps a kernel's transposed strides.
    return t.detach().clone(memory_format=torch.contiguous_format)


def _finite_stats(t: torch.Tensor) -> tuple[float, float]:
    # Contiguous: a strided float64 view would be summed in another order than the masked copy below.
    finite = t.detach().double().contiguous().view(-1)
    mean = float(finite.mean()) if finite.numel() else math.nan
    if not math.isfinite(mean):  # float32 values cannot overflow a float64 sum: some are NaN or inf
        finite = finite[torch.isfinite(finite)]
        mean = float(finite.mean()) if finite.numel() else math.nan
    if finite.numel() == 0:
        return 0.0, 1.0
    std = float(finite.std()) if finite.numel() > 1 else 0.0
    return mean, std if std > 0 else 1.0


def _bit_range(model: ErrorModel) -> tuple[int, int]:
    if model.mode in REGIONS:
        return REGIONS[model.mode]
    return int(model.mode), 31


def _bit_flip(model: ErrorModel, t: torch.Tensor, generator) -> torch.Tensor:
    if t.dtype != torch.float32:
        raise PeatError(f"error spec {model.spec!r}: bit flips act on float32 tensors, got {t.dtype}")
    out = _flat_copy(t)
    bits = out.view(-1).view(torch.int32)
    lo, hi = _bit_range(model)
    starts = range(lo, hi - model.burst + 2) if model.mode in REGIONS else range(lo, lo + 1)
    width = (1 << model.burst) - 1
    masks = torch.tensor([_int32(width << s) for s in starts], dtype=torch.int32, device=bits.device)
    # A flip that leaves the value (a zero's sign bit alone, a NaN's mantissa or sign) changed nothing:
    # a case labeled bit_flip that was golden. Only zeros and NaN have such flips.
    magnitude = bits & 0x7FFFFFFF
    special = ((magnitude == 0) | (magnitude > 0x7F800000)).cpu()
    eligible = None
    if bool(special.any()):
        eligible = ~special
        eligible[special] = _flips_changing(bits[special.to(bits.device)], masks).any(1).cpu()
    idx = _pick_changing(bits.numel(), model.count, eligible, generator)
    if model.mode in REGIONS:
        start = torch.randint(lo, hi - model.burst + 2, (len(idx),), generator=generator)
    else:
        start = torch.full((len(idx),), lo)
    if eligible is not None:  # a start that leaves the chosen element's value: one that changes it instead
        changing = _flips_changing(bits[idx.to(bits.device)], masks).cpu()
        for i in (~changing[torch.arange(len(idx)), start - lo]).nonzero().view(-1).tolist():
            options = changing[i].nonzero().view(-1)
            start[i] = lo + int(options[int(torch.randint(len(options), (1,), generator=generator))])
    idx = idx.to(bits.device)
    bits[idx] ^= masks[(start - lo).to(bits.device)]
    return out


def _flips_changing(bits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Per element of ``bits`` (int32 patterns), per flip mask: whether the flip changes its value."""
    old = bits.view(torch.float32)[:, None]
    new = (bits[:, None] ^ masks[None, :]).view(torch.float32)
    return ~_kept(old, new)


def _pick_changing(n: int, k: int, eligible: torch.Tensor | None, generator) -> torch.Tensor:
    """``k`` distinct positions of ``n`` where the error can change the value (``eligible``, a CPU
    mask; None: all): the whole tensor's draw, so the same positions as ever where it lands on
    such positions, each one it cannot change replaced by a draw among the others it can (still
    uniform over them)."""
    idx = _choose(n, k, generator)
    if eligible is None or bool(eligible[idx].all()):
        return idx
    keep = idx[eligible[idx]]
    rest = eligible.clone()
    rest[keep] = False
    candidates = torch.nonzero(rest).view(-1)
    return torch.cat([keep, candidates[_choose(len(candidates), len(idx) - len(keep), generator)]])


def _int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


# -- structured errors ----------------------------------------------------------------------
def matrix(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``t`` as a matrix: channels as columns for NCHW tensors, else the last dimension. A copy,
    unless ``copy`` is False (then a view where the layout allows one)."""
    t = t.movedim(1, -1) if t.dim() == 4 else t if t.dim() else t.reshape(1)
    # Rows counted, not -1: a reshape cannot infer them beside an empty tensor's 0 columns.
    m = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    return m.clone() if copy else m


def unmatrix(m: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dim() == 4:
        n, c, h, w = like.shape
        return m.reshape(n, h, w, c).movedim(-1, 1).contiguous()
    return m.reshape(like.shape)


def _lane(model: ErrorModel, t: torch.Tensor, generator) -> torch.Tensor:
    m = matrix(t.detach())
    if model.axis == "row":
        m = m.t()
    # A period past the width hits one lane, as the width does (a longer one past int64 wrapped in the slice).
    # At least one lane to draw: an empty tensor's selects nothing.
    period = max(1, min(model.count, m.shape[1]))
    lane = int(torch.randint(period, (1,), generator=generator))
    std = None if model.mode == "stuck" else _finite_stats(t)[1]

    def corrupted(cols: slice) -> torch.Tensor:  # the faulty values of columns ``cols``
        if model.mode != "stuck":
            # Where one std is below the dtype's spacing (bf16 near 300), the lane would round back, unchanged.
            return _nudged(m[:, cols], std)
        # One row (a norm's weight gradient is a vector): each column's first value is itself, so the
        # lane is stuck at its own first element instead.
        return m[:1, cols].expand_as(m[:, cols]) if len(m) > 1 else \
            m[:, torch.arange(m.shape[1], device=m.device)[cols] % period]

    # The drawn lane alone first: the whole matrix only where it is left as it was (one lane in `period`).
    new = corrupted(slice(lane, None, period))
    if not bool((~_kept(m[:, lane::period], new)).any()):
        # A lane it leaves as it was (all inf or NaN under an offset; dead channels, constant down their
        # columns, stuck at that value) was a case labeled periodic_lane that was golden.
        every = corrupted(slice(None))
        changing = (~_kept(m, every)).any(0)
        lanes = torch.zeros(math.ceil(len(changing) / period) * period, dtype=torch.bool)
        lanes[:len(changing)] = changing.cpu()
        lane = _redrawn(lane, lanes.view(-1, period).any(0), generator)
        new = every[:, lane::period]
    m[:, lane::period] = new
    return unmatrix(m.t() if model.axis == "row" else m, t)


def _redrawn(drawn: int, changing: torch.Tensor, generator) -> int:
    """``drawn`` (a lane, a tile) if ``changing`` says the error changes a value there, else one drawn
    among those where it does, uniform over them all the same (each of c such places out of n has
    1/n + (n - c)/n * 1/c = 1/c); ``drawn`` where there is none (``apply`` changed nothing)."""
    if bool(changing[drawn]) or not bool(changing.any()):
        return drawn
    options = changing.nonzero().view(-1)
    return int(options[int(torch.randint(len(options), (1,), generator=generator))])


def _tile(model: ErrorModel, t: torch.Tensor, generator, operands) -> torch.Tensor:
    size = model.count
    m = matrix(t.detach())
    # At least one tile each way: an empty tensor's selects nothing.
    grid = tuple(max(1, math.ceil(n / size)) for n in m.shape)
    pick = int(torch.randint(grid[0] * grid[1], (1,), generator=generator))
    if model.mode == "zero":
        new = torch.zeros_like(m)
    elif model.mode == "stale":
        previous = model._previous
        fresh = previous is None or previous.shape != t.shape
        new = torch.zeros_like(m) if fresh else matrix(previous.to(t.dtype))
    else:
        new = m - matrix(_splitk_partial(model, t, generator, operands))
    at = _tile_at(pick, size, grid)
    if bool(_kept(m[at], new[at]).all()):
        # A tile it leaves as it was (zeroing a tile a ReLU or padding left zero, a split-K partial sum
        # of zeros) was a case labeled block_structured that was golden: one where it changes a value.
        # The whole matrix is compared only then: the drawn tile alone is the usual case's cost.
        where = (~_kept(m, new)).nonzero()
        tiles = torch.zeros(grid[0] * grid[1], dtype=torch.bool)
        tiles[((where[:, 0] // size) * grid[1] + where[:, 1] // size).cpu()] = True
        pick = _redrawn(pick, tiles, generator)
        at = _tile_at(pick, size, grid)
    m[at] = new[at]
    return unmatrix(m, t)


def _tile_at(pick: int, size: int, grid: tuple[int, int]) -> tuple[slice, slice]:
    """The rows and columns of tile ``pick`` (row-major over ``grid``) in the matrix view."""
    return (slice((pick // grid[1]) * size, (pick // grid[1] + 1) * size),
            slice((pick % grid[1]) * size, (pick % grid[1] + 1) * size))


def _splitk_partial(model: ErrorModel, t, generator, operands) -> torch.Tensor:
    """The contribution of one K chunk (of ``model.count`` elements) to the whole output: a random
    one, unless missing it changes nothing (its operands a ReLU or padding zeroed, or its sum below
    half a unit in the last place of every element it adds to), then one whose missing does."""
    chunks, partial = _splitk_chunks(model, t, operands)
    if not chunks:  # an empty reduction (a weight gradient of no rows): no partial sum to miss
        return torch.zeros_like(t)
    chunk = int(torch.randint(chunks, (1,), generator=generator))
    out = partial(chunk)
    # Judged on the result, not on the partial sum alone: one the result's rounding absorbs (1e-9 beside
    # 1), or that adds only to NaN or inf, left it as it was, a case labeled a bug that was golden.
    result = t.detach()

    def changes(p: torch.Tensor) -> bool:  # missing the partial sum p changes the result
        return bool((~_kept(result, result - p)).any())

    if not changes(out):
        changing = torch.tensor([changes(partial(c)) for c in range(chunks)])
        out = partial(_redrawn(chunk, changing, generator))
    return out


def _splitk_chunks(model: ErrorModel, t, operands):
    """How many K chunks (of ``model.count`` elements) the computation's reduction has, and the
    contribution of chunk i to the whole output."""
    if operands is None:
        raise PeatError(f"error spec {model.spec!r}: needs the kernel's operands; use peat.errors.faulty")
    op, computation, args, kwargs = operands
    if (op, computation) not in SPLITK:
        raise NotApplicable(f"error spec {model.spec!r}: split-K applies to {SPLITK_WHERE}, not the {op} {computation}")
    size = model.count
    if op == "linear":
        a, b = args[0], args[1]
        if computation == "forward":
            k = a.shape[-1]
            func = lambda s: torch.nn.functional.linear(a[..., s], b[:, s])  # noqa: E731
        elif computation == "input_grad":
            k = a.shape[-1]
            func = lambda s: a[..., s] @ b[s, :]  # noqa: E731
        else:
            a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
            k = a2.shape[0]
            func = lambda s: a2[s].t() @ b2[s]  # noqa: E731
    else:
        x, w, groups = args[0], args[1], kwargs.get("groups", 1)
        # Each group reduces over its own in/groups channels: the chunk is the same slice of every group's
        # (a depthwise conv's K of 1 is one chunk, so the race loses the whole sum).
        k = w.shape[1]
        hp = {n: kwargs[n] for n in ("stride", "padding", "dilation")}
        grouped = x.unflatten(1, (groups, k))
        func = lambda s: torch.nn.functional.conv2d(grouped[:, :, s].flatten(1, 2), w[:, s], None,  # noqa: E731
                                                    groups=groups, **hp)
    return math.ceil(k / size), lambda i: func(slice(i * size, (i + 1) * size)).to(t.dtype)


# -- faulty kernels --------------------------------------------------------------------------
def never_replayed(error: str | None, computation: str | None, replayed) -> str | None:
    """Why playback would never inject a faulty kernel's ``error`` (None where it would): its
    ``computation`` is not among the ``replayed`` ones, so the verdict judged golden's results, a pass.
    The config check and ``playback.Plan`` both ask, each naming its own key."""
    if not error or computation in replayed:
        return None
    return (f"{computation} is not in playback.computations ({', '.join(replayed)}), "
            f"so playback never injects its error {error!r}")


def warn_never_injected(kernel_name: str, error: str, layer: str, why: str) -> None:
    """One line on stderr: a faulty kernel's error has nothing to act on at ``layer``, so what
    reads as the error absorbed there (candidate training) or a clean verdict (playback) is golden's."""
    print(f"warning: kernels.{kernel_name}.error {error!r} is never injected at layer {layer!r}: {why}",
          file=sys.stderr, flush=True)


def seeded(seed: int) -> torch.Generator:
    """A CPU generator whose draws depend on every bit of ``seed`` (0 to 2**64 - 1, as the config takes).

    torch seeds its Mersenne Twister with a seed's low 32 bits only, so seeds 2**32 apart drew the same
    faults (2**32 as 0, 2**63 as 0): a seed past 32 bits is hashed to 32 first. One within 32 bits
    seeds it as ever, its draws unchanged."""
    if seed >= 2**32:
        seed = int.from_bytes(hashlib.sha256(seed.to_bytes(8, "little")).digest()[:4], "little")
    return torch.Generator().manual_seed(seed)


def faulty(kernel, error, computation: str = "forward", seed: int = 0, strict: bool = False):
    """``kernel`` with ``error`` injected into one computation (casts act on its operands).

    The generator and the model's state (a stale tile) persist across calls, so consecutive
    calls see consecutive draws, reproducibly from ``seed``. ``strict``: a call whose result the
    error leaves as it was raises ``NotInjected`` (a case that reports an injection); else it
    returns that result (training goes on, as with a real fault that did not show).
    """
    kernels.require(kernel, "errors.faulty")
    model = dataclasses.replace(parse(error) if isinstance(error, str) else error, strict=strict)
    wrapped = _injecting(kernel.computation(computation), model, seeded(seed), kernel.op, computation)
    custom = tuple(c for c in COMPUTATIONS if c in kernel.custom or c == computation)
    return dataclasses.replace(kernel, name=f"{kernel.name}+{model.spec}", **{computation: wrapped}, custom=custom,
                               meta=kernel.meta | {"error": model.spec, "computation": computation, "seed": seed})


def _injecting(func, model: ErrorModel, generator: torch.Generator, op: str, computation: str):
    def wrapped(*args, **kwargs):
        if model.on_operands:
            return _cast_call(func, model.kind, args, kwargs, computation)
        out = func(*args, **kwargs)
        if _refused(out, _operand_dtype(args)):
            return out
        return model.apply(out, generator, operands=(op, computation, args, kwargs))

    wrapped.error, wrapped.inner, wrapped.generator, wrapped.where = model, func, generator, (op, computation)
    # The same fault (model state, draws) around another base: golden as on a transposed layer (kernels.on_layer).
    wrapped.around = lambda inner: _injecting(inner, model, generator, op, computation)
    return wrapped


def reuses(kernel, computation: str, base) -> bool:
    """Whether ``kernel`` is ``base`` with an error injected into its result (not its operands):
    then ``inject`` gives what it returns from ``base``'s own result, without calling ``base``."""
    func = kernel.computation(computation)
    model = getattr(func, "error", None)
    return model is not None and not model.on_operands and func.inner is base.computation(computation)


def inject(kernel, computation: str, result: torch.Tensor, args, kwargs) -> torch.Tensor:
    """What a call of ``kernel`` (see ``reuses``) on operands ``args, kwargs`` returns when its
    base returns ``result`` there: the same draws, and the same state left for the next call."""
    func = kernel.computation(computation)
    return func.error.apply(result, func.generator, operands=(*func.where, args, kwargs))


def replica(kernel, computation: str):
    """A copy of ``kernel`` whose next ``computation`` call injects exactly what the next call of
    ``kernel`` will (the same draws, the same stale tile) without advancing ``kernel``: the same
    fault, observed once more elsewhere (playback's later observing points)."""
    return dataclasses.replace(kernel, **{computation: _replica(kernel.computation(computation))})


def _replica(func):
    model = getattr(func, "error", None)
    if model is None:  # not injected (a faulty kernel may wrap another: each level is copied)
        return func
    generator = torch.Generator().set_state(func.generator.get_state())
    return _injecting(_replica(func.inner), dataclasses.replace(model), generator, *func.where)


def _operand_dtype(args) -> torch.dtype:
    return next(a.dtype for a in args if torch.is_tensor(a))


def _refused(out, dtype: torch.dtype) -> bool:
    """Whether ``out`` is a result the caller refuses (``kernels.wrong_result``): not a tensor (a kernel
    that forgot its ``return``, a NumPy prototype's array) or of another dtype than its operands. The
    error leaves it as it is, so that the caller names it a shape_mismatch as without the error: applied,
    it crashed on it ("'NoneType' object has no attribute 'detach'") or, cast back, hid its dtype."""
    return not torch.is_tensor(out) or out.dtype != dtype


def _cast_call(func, precision: str, args, kwargs, computation: str):
    """Call ``func`` (a ``computation``) on operands rounded to ``precision``; the result keeps the input
    dtype (fp64's, computed in float64, cast back; another cast's as the kernel returned it)."""
    dtype = _operand_dtype(args)
    cast = lambda a: round_to(a, precision) if torch.is_tensor(a) and a.is_floating_point() else a  # noqa: E731
    # A training batch norm's output never reads its running statistics: it only updates them, and
    # they stay float32 buffers (nn.BatchNorm's, under autocast too). Rounding them would widen the
    # envelope of the updated statistics by the rounding of the old ones (200x: 0.7 % of running_var).
    # Only the training forward updates them: a backward's float64 copies written back changed nothing but
    # the buffers' version, which training's router takes for the kernel writing into its inputs.
    state = ("running_mean", "running_var") if kwargs.get("training") and computation == "forward" else ()
    new = {k: _unrounded(v, precision) if k in state else cast(v) for k, v in kwargs.items()}
    out = func(*map(cast, args), **new)
    # Statistics a training call updates in place, under fp64 in a copy: written back. Elsewhere they are
    # only read, and writing back their rounded copy rounded the layer's buffers for good.
    for key in state:
        if new.get(key) is not kwargs.get(key):
            kwargs[key].copy_(new[key])
    return out.to(dtype) if precision == "fp64" and torch.is_tensor(out) else out


def _unrounded(value, precision: str):
    # fp64's op refuses float32 statistics beside float64 operands: a float64 copy, exact.
    return value.double() if precision == "fp64" and torch.is_tensor(value) else value
