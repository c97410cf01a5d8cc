"""Later fault observing points for playback: a forward error carried to the next recorded layer
that reads it (``next_readers``) and to the loss of the same training step.

The context holds only the recorded layers, so the rest of the network is rebuilt at the
step being replayed, honestly and cheaply:

- the model is built from its config (seeded init, plus the ``init_from`` checkpoint) and
  loaded from the latest golden checkpoint taken at or before the step (exact at step 0 and
  at the first step of an epoch that follows a checkpoint, approximate in between);
- every recorded layer gets the weights recorded at that very step (exact);
- the batch of that step is rebuilt from the dataset with the training loop's own
  deterministic batch order (``peat.train.epoch_batches``).

Golden float32 and reduced-precision runs of this rebuilt network and one run per candidate
(the kernel, or a faulty kernel, computing layer L's forward on L's live input) differ only in
layer L, so the downstream error is the kernel's alone. The float64 reference runs from L on,
on the same input of L (the golden prefix, replayed; where the replay check fails, the whole
network in float64 with L fed golden's input): as at the kernel's own output, the yardstick is
float32's rounding noise from the injecting to the observing point. How faithful the
rebuilt network is appears as ``recon_error``: the max relative difference between L's live
input and the input recorded at that step (0 when the rebuilt state is exact).
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import checkpoint, errors, kernels, scores
from .evidence import PRECISIONS, envelopes, scored_references
from .io import check_int, open_h5
from .models import build, loss_and_metrics
from .playback import score_row, subsample
from .profiler import match_layers, read_layer, recorded_steps
from .train import Run, _subset, epoch_batches, epoch_seed

KEEP_MODELS = 4  # steps whose rebuilt networks (a float32 and float64 pair each) are kept: steps recur across layers
WEIGHTS = ("W", "B", "running_mean", "running_var")  # what model_at reads of a recorded step
GEMM_MAP = 16  # float64 convolutions with output maps this small run as one GEMM (see _conv)


@dataclass
class Propagator:
    context: Path
    spec: dict
    data: str | Path
    checkpoints: str | Path
    init: str | Path | None = None
    seed: int = 0
    samples: int | None = 2          # propagated steps per layer (evenly spaced); None = all replayed
    device: torch.device = torch.device("cpu")
    # step -> (model, its float64 copy, the names of its _fast modules, what _downstream keeps for the model)
    _models: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self):
        from .data import load

        # The config schema checks playback.propagate_samples; a library call's was not: 0 followed no step.
        if self.samples is not None:
            check_int("peat.propagate.Propagator: samples", self.samples, 1,
                      "steps followed per layer need an integer >= 1 (None: every replayed step)")
        self.dataset = load(self.data)
        with open_h5(self.context) as f:
            self.order = [str(n) for n in f.attrs["layers"]]
        run = Run.from_spec(self.spec, seed=self.seed)
        self.x, self.y = _subset(self.dataset.train, run.max_train_samples)
        self.batch_size = run.batch_size
        self.per_epoch = len(epoch_batches(len(self.x), self.batch_size, self.seed, 0))
        self.saved = sorted((int(_attrs(p)["step"]), p) for p in Path(self.checkpoints).glob("epoch*.h5"))
        self.steps: dict[str, list[int]] = {}
        self.chosen: dict[str, set] = {}
        self.readers: dict[str, str | None] | None = None  # layer -> its next observing point
        self.before: dict[str, set[str]] = {}  # layer -> the modules whose forward starts before it
        self.contiguous: set[str] = set()  # layers whose later network fails in channels-last memory (see rows)

    # -- the rebuilt network ------------------------------------------------------------------
    def _steps(self, layer: str) -> list[int]:
        if layer not in self.steps:
            self.steps[layer] = recorded_steps(self.context, layer)
        return self.steps[layer]

    def models_at(self, step: int) -> tuple[torch.nn.Module, torch.nn.Module]:
        """``model_at(step)`` and its float64 copy, rebuilt once per step for every layer and case.

        Forwards in training mode change only batch-norm running statistics, which no
        training-mode output reads, so a rebuilt network serves any number of observations.
        """
        if step not in self._models:
            model = self.model_at(step)
            fast = _fast_modules(model)
            self._models[step] = (model, _float64(model, fast), fast, {})
            while len(self._models) > KEEP_MODELS:
                self._models.popitem(last=False)
        self._models.move_to_end(step)
        return self._models[step][:2]

    def fast_at(self, step: int) -> set[str]:
        """The modules of ``models_at(step)``'s float32 network that ``_conv`` computes (``_fast``),
        found once with it: checking every weight is finite took a pass over the whole network
        (45 MB for ResNet-18) at every layer followed. Its weights never change after it is built."""
        self.models_at(step)
        return self._models[step][2]

    def model_at(self, step: int) -> torch.nn.Module:
        """The network as it was before ``step``: checkpoint weights, recorded layers exact."""
        torch.manual_seed(self.seed)
        model = build(self.spec, self.dataset.attrs, self.seed)
        if self.init is not None:
            checkpoint.load(self.init, model, new_head=True)
        before = [p for s, p in self.saved if s <= step]
        if before:
            checkpoint.load(before[-1], model)
        modules = match_layers(model, self.order)
        for name, module in modules.items():
            if step not in self._steps(name):
                continue
            # The weights alone: with the step's input and output gradient, ResNet-18's 8 recorded layers took 43 ms
            # to read, against 3.5.
            attrs, (sample,) = read_layer(self.context, name, [step], derive=False, tensors=WEIGHTS)
            with torch.no_grad():
                w = sample["W"].t() if attrs.get("transposed") else sample["W"]
                module.weight.copy_(w)
                if sample.get("B") is not None and getattr(module, "bias", None) is not None:
                    module.bias.copy_(sample["B"])
                for key in ("running_mean", "running_var"):
                    if key in sample:
                        getattr(module, key).copy_(sample[key])
        return model.to(self.device).train()

    def batch(self, step: int, epoch: int):
        idx = epoch_batches(len(self.x), self.batch_size, self.seed, epoch)[step - (epoch - 1) * self.per_epoch]
        return self.x[idx].to(self.device), self.y[idx].to(self.device)

    # -- one step ------------------------------------------------------------------------------
    def wanted(self, layer: str, step: int, steps: list[int]) -> bool:
        if layer not in self.chosen:
            self.chosen[layer] = set(subsample(steps, self.samples))
        return step in self.chosen[layer]

    def observe(self, model, layer: str, nxt: str | None, x, y, replace=None, prefix=None, *,
                seed: int) -> dict[str, torch.Tensor]:
        """Forward one batch; return L's input, the next recorded layer's output and the loss.

        ``replace(input)`` computes L's output instead of the module (a candidate kernel, or
        the module's own forward, timed).
        ``prefix`` (a ``Prefix``) records what comes before L in this forward, or, once
        recorded, replays it instead of computing it again (falling back to the whole forward
        when the replay would not be exact).
        """
        if prefix is not None and prefix.recorded and prefix.valid:
            try:
                with prefix.replaying():
                    return self.observe(model, layer, nxt, x, y, replace, seed=seed)
            except PrefixMismatch:
                prefix.valid = False
        if prefix is not None and not prefix.recorded:
            with prefix.recording():
                return self.observe(model, layer, nxt, x, y, replace, seed=seed)
        seen, modules = {}, dict(model.named_modules())

        def at_layer(module, inputs):
            # The first call's: the Profiler records a layer called twice in a step at its first, and the
            # last one's input made recon_error of an exact rebuild the distance between two calls' inputs.
            seen.setdefault("A", inputs[0].detach())

        def at_next(module, inputs, output):
            seen["next"] = (output if torch.is_tensor(output) else output[0]).detach()

        hooks = [modules[layer].register_forward_pre_hook(at_layer)]
        if nxt is not None:
            hooks.append(modules[nxt].register_forward_hook(at_next))
        try:
            _seed(seed, x)  # the same dropout masks in every run
            with torch.no_grad(), _computed_by(modules[layer], replace), \
                    prefix.feeding() if prefix is not None else nullcontext():
                loss, _ = loss_and_metrics(model, self.dataset.kind, x, y)
        finally:
            for h in hooks:
                h.remove()
        seen["loss"] = loss.detach().reshape(1)
        return seen

    def rows(self, layer: str, sample: dict, variants: dict, base: dict, rules, timer=None,
             replayed: list[int] | None = None, timeout: float | None = None) -> list[dict]:
        """Playback rows at the later observing points for the forward of ``layer`` at this sample;
        ``timer`` (a ``peat.playback.Timer``) accounts the kernel calls and the scoring apart.
        The steps followed are chosen among ``replayed`` (the layer's steps playback replays;
        every recorded one when None): chosen among all, some could be steps never replayed.
        ``timeout``: seconds each call of the variants may take, as at the output (None: no limit);
        past them a ``timeout`` row, and the variants after it are not run."""
        step = int(sample["step"])
        if not self.wanted(layer, step, self._steps(layer) if replayed is None else replayed):
            return []
        timed = (lambda category: timer(category)) if timer is not None else (lambda category: nullcontext())
        attrs, _ = read_layer(self.context, layer, [])  # the layer's attributes alone
        with timed("rebuild"):
            model, model64 = self.models_at(step)
        x, y = self.batch(step, int(sample["epoch"]))
        # Training's draws at an epoch's first step (dropout, stochastic depth): exact there, like the weights.
        seed = epoch_seed(self.seed, int(sample["epoch"]))
        if self.readers is None:
            self.readers, self.before = call_graph(model, self.order, self.dataset.kind, x, y, self.seed)
        nxt = self.readers[layer]

        def itself(net):  # the layer's own forward in ``net``: a kernel call, timed as the candidates' are
            forward = net.get_submodule(layer).forward

            def run(a):
                with timed("kernel"):
                    return forward(a)
            return run

        def downstream(channels_last):
            return _downstream(model, layer, self.before[layer], channels_last=channels_last, fast=self.fast_at(step),
                               kept=self._models[step][3])

        gold, channels_last, prefix = self._golden(model, layer, nxt, x, y, itself(model), seed, downstream)
        with downstream(channels_last):
            ref64 = self.observe(model64, layer, nxt, x if not x.is_floating_point() else x.double(), y,
                                 itself(model64), prefix=prefix.on(model64, torch.float64), seed=seed)
            recorded = sample["A"].cpu()
            recon = _recon_error(gold["A"].cpu(), recorded)

            own, kept = variants.get("kernel"), {}  # the kernel itself; its output at L, and its input there

            def call(kernel, live, a):
                # Under a forked generator: a kernel drawing from the global one (stochastic rounding)
                # shifted the dropout masks after L, an error at the loss that was none of its results'.
                with timed("kernel"), kernels.deadline(timeout), torch.random.fork_rng(devices=[a.device] if a.is_cuda else []):
                    if kept and kernel is not own and torch.equal(kept["A"], a) and errors.reuses(kernel, "forward", own):
                        # As at the kernel's output (playback._injected): the variant's error on the kernel's result.
                        return errors.inject(kernel, "forward", kept["O"], *kernels.operands(attrs["op"], "forward",
                                                                                             live | {"A": a}, attrs))
                    out = kernels.call(kernel, "forward", live | {"A": a}, attrs)
                    if kernel is own:  # copies: the network may write into L's input or output in place
                        kept.update(A=a.clone(), O=out.clone())
                    return out

            def through(kernel):
                live = dict(sample)
                # Contiguous, as a routed layer hands it on (kernels._kernel_forward): a correct result in
                # another layout (a column-major GEMM's) crashed GPT-2's next Conv1D, which views its input.
                return self.observe(model, layer, nxt, x, y, replace=lambda a: call(kernel, live, a).contiguous(),
                                    prefix=prefix, seed=seed)

            golden_kernel = kernels.golden(attrs["op"], attrs)
            rounded = {p: through(errors.faulty(golden_kernel, p, "forward")) for p in PRECISIONS}
            runs, failed = {}, {}
            for case, kernel in variants.items():
                try:
                    runs[case] = through(kernel)
                except Exception as err:  # a kernel failing here, later than its probe: rows saying so
                    failed[case] = (_status(err), f"{type(err).__name__}: {err}")
                    if isinstance(err, kernels.CallTimeout):  # each further call would wait it out again
                        break
        out = []
        for point in (["next", "loss"] if nxt is not None else ["loss"]):
            with timed("score"):
                out += self._score(point, nxt, gold, ref64, rounded, runs, rules, base | {"recon_error": recon})
            fop, tensor = _observing_point(point, nxt)
            out += [{**base, "fop": fop, "tensor": tensor, "case": case, "status": status, "error": message}
                    for case, (status, message) in failed.items()]
        return out

    def _golden(self, model, layer: str, nxt, x, y, forward, seed: int, downstream):
        """Golden's run of a step (``observe``) inside ``downstream(channels_last)``; returns it, the
        layout every other run of the step takes, and the ``Prefix`` it recorded."""
        channels_last = x.device.type == "cpu" and layer not in self.contiguous
        prefix = Prefix(model, layer)
        try:
            with downstream(channels_last):
                return self.observe(model, layer, nxt, x, y, forward, prefix=prefix, seed=seed), channels_last, prefix
        except RuntimeError:
            # A model viewing a convolution's output after L (x.view(len(x), -1)) cannot take it in
            # channels-last memory, which training never gave it: that layer's runs keep the default.
            if not channels_last:
                raise
        self.contiguous.add(layer)
        prefix = Prefix(model, layer)  # the failed run's record stopped part way
        with downstream(False):
            return self.observe(model, layer, nxt, x, y, forward, prefix=prefix, seed=seed), False, prefix

    @staticmethod
    def _score(point: str, nxt, gold: dict, ref64: dict, rounded: dict, runs: dict, rules, base: dict) -> list[dict]:
        """Rows at one later observing point (``next`` or ``loss``): the rounded references',
        then those of ``runs`` (the kernel and its variants)."""
        g, r = gold[point].cpu(), ref64[point].cpu()
        gold_point = scores.Golden.of(g)
        refs = {p: rounded[p][point].cpu().float() for p in PRECISIONS}
        env = envelopes(g, r, refs, rules, gold_point, footprints=False)
        fop, tensor = _observing_point(point, nxt)

        def row(case: str, seen: torch.Tensor, diff: scores.Diff | None = None) -> dict:
            return {**base, "fop": fop, "tensor": tensor, "case": case,
                    **score_row(seen, g, r, env, rules, env.noise, gold_point, diff)}

        # The rounded references first: their rows and their footprints come from one error each.
        return ([row(f"ref:{p}", refs[p], diff) for p, diff in scored_references(env, refs, gold_point, rules)]
                + [row(case, seen[point].cpu().float()) for case, seen in runs.items()])


def _recon_error(live: torch.Tensor, recorded: torch.Tensor) -> float:
    """``recon_error``: the largest difference between L's live input and the recorded one, over the
    recorded one's largest finite magnitude. Equal elements differ by 0, inf and NaN included (inf - inf
    made an exact rebuild of a diverged training's input NaN); a non-finite element rebuilt otherwise, by inf."""
    if not recorded.numel():
        return 0.0
    recorded = recorded.to(live.dtype)
    same = (live == recorded) | (live.isnan() & recorded.isnan())
    diff = torch.where(same, 0.0, (live - recorded).abs()).nan_to_num(nan=float("inf"), posinf=float("inf"))
    scale = torch.where(recorded.isfinite(), recorded.abs(), 0.0).max().clamp_min(1e-30)
    return float(diff.max() / scale)


def _status(err: BaseException) -> str:
    """The status of a row of a call that failed downstream: a hang cut short is a ``timeout``."""
    return "timeout" if isinstance(err, kernels.CallTimeout) else "crash"


def _float64(model: torch.nn.Module, fast: set[str]) -> torch.nn.Module:
    """A float64 copy of ``model``, for the reference run; its convolutions ``fast``
    (``_fast_modules(model)``: the copy's weights are as finite) compute as ``_conv``."""
    twin = copy.deepcopy(model).double()
    for name, module in twin.named_modules():
        if name in fast:
            module.forward = functools.partial(_conv, module, {})
    return twin


def _fast_modules(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s modules that are ``_fast``."""
    return {name for name, module in model.named_modules() if _fast(module)}


def _fast(module: torch.nn.Module) -> bool:
    """A plain zero-padded Conv2d with finite weights, which ``_conv`` computes exactly (a
    non-finite weight times a padded zero would be NaN, and ``_conv`` leaves such products out)."""
    return (type(module) is torch.nn.Conv2d and module.padding_mode == "zeros"
            and not isinstance(module.padding, str) and bool(torch.isfinite(module.weight).all()))


def _conv(conv: torch.nn.Conv2d, cache: dict, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` without the products of its taps with zero padding, and in float64 on the CPU
    as one GEMM where the output map is small: the same sums, in another order.

    On small maps those products are most of the work: a 3 x 3 convolution with padding 1 does
    9x the products it needs on 1 x 1 maps (ResNet-18's last stage on 32 x 32 images), 2.25x on
    2 x 2. Maps with fewer positions than the kernel has taps run as one matrix product
    (``_matrix``); otherwise the taps that read only padding are cropped (``_cropped``).
    PyTorch convolves float64 one sample at a time; where the output map is small that is a
    matrix-vector product per sample, 2-6x slower than one GEMM over the batch, and the float64
    reference run then cost more than all the float32 runs of a step.
    ``cache`` keeps what is derived from the weight, by input size: the weight must not change.
    """
    if x.dim() != 4 or not len(x):
        return conv._conv_forward(x, conv.weight, conv.bias)
    n, _, h, w = x.shape
    # A non-finite input times a zero of the matrix would spoil every output, not those reading it.
    if conv.groups == 1 and h * w < conv.kernel_size[0] * conv.kernel_size[1] and _all_finite(x):
        if (h, w) not in cache:
            cache[h, w] = _matrix(conv, h, w)
        m, bias, (ho, wo) = cache[h, w]
        rows = x.permute(0, 2, 3, 1).reshape(n, -1)  # (position, channel) order: a view in channels-last memory
        return _maps(rows @ m if bias is None else torch.addmm(bias, rows, m), x, ho, wo)
    if (h, w, "crop") not in cache:
        cache[h, w, "crop"] = _cropped(conv, h, w)
    weight, (kh, kw), padding, (ho, wo) = cache[h, w, "crop"]
    if ho * wo <= GEMM_MAP and x.dtype == torch.float64 and x.device.type == "cpu" and conv.groups == 1:
        cols = F.unfold(x, (kh, kw), dilation=conv.dilation, padding=padding, stride=conv.stride)  # (n, C*kh*kw, ho*wo)
        out = cols.transpose(1, 2).reshape(n * ho * wo, -1) @ weight.reshape(conv.out_channels, -1).t()
        if conv.bias is not None:
            out += conv.bias
        return _maps(out, x, ho, wo)
    return F.conv2d(x, weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)


def _all_finite(x: torch.Tensor) -> bool:
    """Every element of ``x`` finite. A sum holding a NaN or an inf is not finite, so a finite sum
    settles it in one reduction, without isfinite's mask (and the deterministic mode's fill of
    it); an overflowing sum of finite values is checked element by element."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _maps(out: torch.Tensor, x: torch.Tensor, ho: int, wo: int) -> torch.Tensor:
    """A matrix product's result, one row per (sample, output position) or per sample with the
    positions along the row, as the N x C x ho x wo output of a convolution of ``x``, laid out as
    ``x`` is (channels-last or contiguous)."""
    out = out.view(len(x), ho, wo, -1).permute(0, 3, 1, 2)
    return out if x.is_contiguous(memory_format=torch.channels_last) else out.contiguous()


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    """Output positions of a convolution along one dimension (PyTorch's formula)."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _reads(conv: torch.nn.Conv2d, h: int, w: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Per dimension of an ``h`` x ``w`` input: the output size, and per output position the
    (tap, input position) pairs that read the input, not its padding."""
    out = []
    for size, k, s, p, d in zip((h, w), conv.kernel_size, conv.stride, conv.padding, conv.dilation):
        n = _out_size(size, k, s, p, d)
        out.append((n, [[(t, o * s - p + t * d) for t in range(k) if 0 <= o * s - p + t * d < size] for o in range(n)]))
    return out


def _cropped(conv: torch.nn.Conv2d, h: int, w: int) -> tuple:
    """(weight, kernel size, padding, output size) of ``conv`` on an ``h`` x ``w`` input, less the
    outer taps that read only its zero padding: the padding shrinks by as many taps, so that every
    output position reads the same inputs (the weight itself where no crop keeps them)."""
    (ho, rows), (wo, cols) = _reads(conv, h, w)
    crop = []
    for (n, reads), size, k, s, p, d in zip(((ho, rows), (wo, cols)), (h, w), conv.kernel_size, conv.stride,
                                            conv.padding, conv.dilation):
        taps = sorted({t for at in reads for t, _ in at}) or [0, k - 1]
        first, count = taps[0], taps[-1] - taps[0] + 1
        padding = p - first * d
        if padding < 0 or _out_size(size, count, s, padding, d) != n:
            first, count, padding = 0, k, p
        crop.append((first, count, padding))
    (r0, rk, rp), (c0, ck, cp) = crop
    weight = conv.weight if (rk, ck) == conv.kernel_size else conv.weight[:, :, r0:r0 + rk, c0:c0 + ck].contiguous()
    return weight, (rk, ck), (rp, cp), (ho, wo)


def _matrix(conv: torch.nn.Conv2d, h: int, w: int) -> tuple:
    """``conv`` on an ``h`` x ``w`` input as a matrix from the input's (position, channel) to the
    output's, holding only the taps that read the input; the bias repeated per output position
    (or None); the output size."""
    (ho, rows), (wo, cols) = _reads(conv, h, w)
    weight = conv.weight.detach()
    m = weight.new_zeros(h, w, conv.in_channels, ho, wo, conv.out_channels)
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            for ti, a in row:
                for tj, b in col:
                    m[a, b, :, i, j, :] = weight[:, :, ti, tj].t()
    bias = None if conv.bias is None else conv.bias.detach().repeat(ho * wo)
    return m.reshape(h * w * conv.in_channels, -1), bias, (ho, wo)


@contextmanager
def _computed_by(module: torch.nn.Module, replace):
    """``module`` computing its output as ``replace(input)`` (when given) instead of its own
    forward: a candidate's output replaces golden's, which need not be computed first."""
    if replace is None:
        yield
        return
    own = module.__dict__.get("forward")
    module.forward = lambda x, *args, **kwargs: replace(x.detach()).to(x.dtype)
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _observing_point(point: str, nxt) -> tuple[str, str]:
    """The table's ``fop`` and ``tensor`` of a later observing point (``next`` or ``loss``)."""
    return (f"next:{nxt}", "O") if point == "next" else ("loss", "loss")


class PrefixMismatch(Exception):
    """A replayed prefix would not give L the golden forward's input or random state."""


class Prefix:
    """The part of a forward that comes before layer L, recorded once and replayed.

    The candidates' forwards differ from golden only from L on, so every module call that
    finishes before L starts returns what it returned in the golden forward. Recording keeps
    the outputs of the outermost such calls (tensor outputs only; their own sub-calls then
    never run). Replaying returns them as they are (copying every one costs more than the
    skipped modules save in deep layers) and checks, as L starts, that the random state and L's
    input are bitwise the golden ones: a skipped module that drew random numbers (dropout) would
    shift later draws, and then the caller runs the whole forward instead. A forward that writes
    into a returned record in place (its version counter moves) still computes what golden did,
    but the record is spoilt: the prefix is then no longer valid, and later forwards run whole.
    """

    def __init__(self, model: torch.nn.Module, layer: str, dtype: torch.dtype | None = None):
        self.modules = {n: m for n, m in model.named_modules() if n}
        self.layer = layer
        self.dtype = dtype  # replayed floating outputs are cast to it (None: as recorded)
        self.outputs: dict[str, dict[int, torch.Tensor]] = {}  # module -> call index on replay -> output
        self.rng = self.input = None
        self.recorded, self.valid = False, True

    def on(self, model: torch.nn.Module, dtype: torch.dtype) -> "Prefix":
        """This recorded prefix, replayed in a copy of the model that computes in ``dtype``."""
        twin = Prefix(model, self.layer, dtype)
        twin.outputs, twin.rng, twin.input = self.outputs, self.rng, self.input
        # Its outputs are copies, so it never spoils the shared records (see _replayed).
        twin.recorded, twin.valid = self.recorded, self.valid
        return twin

    def _replayed(self, kept: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None:  # a twin (see on): copies, whatever their dtype
            return kept.to(self.dtype, copy=True) if kept.is_floating_point() else kept.clone()
        return kept

    @contextmanager
    def recording(self):
        # Per open call: every call started inside it, and the kept calls inside it.
        started, frames, counts = [], [{"calls": [], "kept": []}], {}

        def pre(name):
            def hook(module, inputs):
                if started:
                    return
                if name == self.layer:
                    started.append(True)
                    self.rng, self.input = _rng_state(inputs[0]), inputs[0].detach().clone()
                    return
                counts[name] = counts.get(name, 0) + 1
                frames.append({"calls": [], "kept": []})
            return hook

        def post(name):
            def hook(module, inputs, output):
                if started or name == self.layer:
                    return
                inner, parent = frames.pop(), frames[-1]
                if torch.is_tensor(output):  # kept: the calls inside it never run on replay
                    for sub in inner["calls"]:
                        counts[sub] -= 1
                    parent["kept"].append((name, counts[name] - 1, output.detach().clone()))
                else:
                    parent["calls"] += inner["calls"]
                    parent["kept"] += inner["kept"]
                parent["calls"].append(name)
            return hook

        hooks = [h for n, m in self.modules.items()
                 for h in (m.register_forward_pre_hook(pre(n)), m.register_forward_hook(post(n)))]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
        self.recorded, self.valid = True, bool(started)  # L never ran: nothing to replay
        for frame in frames if started else []:  # L's callers are still open: kept calls lie in each
            for name, index, output in frame["kept"]:
                self.outputs.setdefault(name, {})[index] = output

    @contextmanager
    def feeding(self):
        """A whole forward (the replay check failed: a module before L drew random numbers) with L
        given golden's input, as a replay gives it: the float64 twin's own prefix made L's input
        differ from golden's by float32's rounding of every module before L, which the reference's
        noise at the later observing points then held (3-160x float32's from L on at MobileNetV2's
        classifier, after its dropout). The prefix still runs: its draws are golden's. A float32
        forward computes golden's input anyway (and may write into it: it is not copied), so
        only a twin (``on``) is fed."""
        if self.dtype is None or self.input is None:
            yield
            return
        fed = []

        def feed(module, inputs):
            if not fed:  # L's first call, the one recorded
                fed.append(True)
                return (self._replayed(self.input), *inputs[1:])

        hook = self.modules[self.layer].register_forward_pre_hook(feed, prepend=True)
        try:
            yield
        finally:
            hook.remove()

    @contextmanager
    def replaying(self):
        patched = {name: self.modules[name].__dict__.get("forward") for name in self.outputs}
        handed = []  # (record, its version) of every record returned uncopied

        def forward(name, original):
            calls = [0]

            def replay(*args, **kwargs):
                calls[0] += 1
                kept = self.outputs[name].get(calls[0] - 1)
                if kept is None:
                    return original(*args, **kwargs)
                out = self._replayed(kept)
                if out is kept:
                    handed.append((kept, kept._version))
                return out
            return replay

        def check(module, inputs):
            if not (_same_rng(_rng_state(inputs[0]), self.rng) and torch.equal(inputs[0], self._replayed(self.input))):
                raise PrefixMismatch(self.layer)

        for name in self.outputs:
            self.modules[name].forward = forward(name, self.modules[name].forward)
        hook = self.modules[self.layer].register_forward_pre_hook(check)
        try:
            yield
        finally:
            hook.remove()
            if any(kept._version != version for kept, version in handed):
                self.valid = False
            for name, own in patched.items():
                if own is None:
                    del self.modules[name].forward
                else:
                    self.modules[name].forward = own


@contextmanager
def _downstream(model: torch.nn.Module, layer: str, before: set[str], channels_last: bool, fast: set[str],
                kept: dict | None = None):
    """``model``'s float32 convolutions after ``layer`` (L) computing faster while inside: without
    the products with zero padding (``_conv``), and where ``channels_last``, in channels-last
    memory (L's 4-d output laid out so, and their weights). L and the modules whose forward
    starts before it (``before``) are untouched. ``fast``: ``_fast_modules(model)``.
    ``kept``: per module, its ``_conv`` cache and channels-last weight, kept from one use to the
    next (``model``'s weights must not change meanwhile): remade at every layer followed, they
    were 60-90 ms of a benchmark campaign (ResNet-18's small-map matrices, 45 MB of weights relaid);
    kept, the weights take that much more memory per network kept (KEEP_MODELS).

    On the CPU these forwards are most of what the later observing points cost. oneDNN's float32
    convolution can be much faster in channels-last memory: ResNet-18's forward on a batch of 64
    images of 32 x 32 took 85 ms against 150 in PyTorch's default layout on an AMD EPYC, though
    the same on an Intel Xeon (56 and 57 ms); channels-last max-pooling took 2 ms against 17 on
    both. Leaving out the products with padding took its last two stages (2 x 2 and 1 x 1 maps)
    from 28 ms to 15 on that EPYC.
    Their results round differently from the default's, but every run of a step (golden,
    references, candidates) computes so, so the downstream error stays the kernel's alone; and
    golden's own computation before L keeps L's input golden training's own.
    """
    modules = dict(model.named_modules())
    after = [m for name, m in modules.items() if name != layer and name not in before
             and name in fast
             and m.weight.dtype == torch.float32 and "forward" not in m.__dict__]
    weights = [m.weight.data for m in after]
    kept = {} if kept is None else kept
    for module in after:
        mine = kept.setdefault(module, [{}, None])  # its _conv cache, its channels-last weight
        module.forward = functools.partial(_conv, module, mine[0])
        if channels_last:
            if mine[1] is None:
                mine[1] = module.weight.data.contiguous(memory_format=torch.channels_last)
            module.weight.data = mine[1]

    def relaid(module, inputs, output):
        if torch.is_tensor(output) and output.dim() == 4:
            return output.contiguous(memory_format=torch.channels_last)

    hooks = [modules[layer].register_forward_hook(relaid)] if channels_last else []
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, data in zip(after, weights):
            del module.forward
            module.weight.data = data


def call_graph(model, order: list[str], kind: str, x, y, seed: int) -> tuple[dict[str, str | None], dict[str, set[str]]]:
    """``next_readers`` and ``started_before`` from one forward: each took a whole forward of the
    network (ResNet-18 on 64 images: 60-70 ms each, once per job)."""
    calls, parents, ran = _traced(model, order, kind, x, y, seed)
    return _readers(order, parents, ran), _started(order, calls)


def started_before(model, order: list[str], kind: str, x, y, seed: int) -> dict[str, set[str]]:
    """For each recorded layer, the modules whose forward starts before its first call (one
    forward; the call order of a model without data-dependent control flow is the same at every step)."""
    return call_graph(model, order, kind, x, y, seed)[1]


def _started(order: list[str], calls: list[str]) -> dict[str, set[str]]:
    """``started_before`` from the names of the modules in the order their forwards start."""
    return {layer: set(calls[:calls.index(layer)] if layer in calls else calls) for layer in order}


def _hooked_forward(model, hooks: list, kind: str, x, y, seed: int, grad: bool = False) -> None:
    """One seeded forward of ``model`` to the loss, ``hooks`` (registered) removed after it."""
    try:
        torch.manual_seed(seed)
        with torch.set_grad_enabled(grad):
            loss_and_metrics(model, kind, x, y)
    finally:
        for h in hooks:
            h.remove()


def next_readers(model, order: list[str], kind: str, x, y, seed: int) -> dict[str, str | None]:
    """For each recorded layer, the first later recorded layer whose output depends on its output.

    The next recorded layer in model order may not read it at all: ResNet's downsample conv
    reads the block's input, Llama's up_proj reads gate_proj's input; an error of 0 there would
    look like masking. One forward with autograd finds the edges: every recorded output is cut
    into a fresh leaf (parameters frozen), so the graph of a layer's output reaches exactly the
    recorded layers it reads directly; their closure gives every dependence. The graph of a
    model without data-dependent control flow is the same at every step.
    """
    return call_graph(model, order, kind, x, y, seed)[0]


def _traced(model, order: list[str], kind: str, x, y, seed: int) -> tuple[list[str], dict[str, set[str]], list[str]]:
    """One forward with autograd (``next_readers``): the modules in the order their forwards start,
    each recorded layer's parents (the recorded layers its output reads directly) and the recorded
    layers in the order of their first calls. Cutting the recorded outputs changes no call order."""
    modules, parents, leaves = dict(model.named_modules()), {name: set() for name in order}, {}
    ran, calls = [], []

    def cut(name):
        def hook(module, inputs, output):
            if name not in ran:
                ran.append(name)
            out = output if torch.is_tensor(output) else output[0]
            parents[name] |= _leaves_behind(out, leaves)
            leaf = out.detach().requires_grad_()
            leaves[id(leaf)] = (leaf, name)  # the tensor kept: its id stays its own
            return leaf.clone() if torch.is_tensor(output) else (leaf.clone(), *output[1:])  # clone: in-place ops follow
        return hook

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        hooks = [m.register_forward_pre_hook(lambda module, inputs, name=name: calls.append(name))
                 for name, m in model.named_modules() if name]
        _hooked_forward(model, hooks + [modules[name].register_forward_hook(cut(name)) for name in order],
                        kind, x, y, seed, grad=True)
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    return calls, parents, ran


def _readers(order: list[str], parents: dict[str, set[str]], ran: list[str]) -> dict[str, str | None]:
    """``next_readers`` from ``_traced``'s parents and recorded layers in the order of their first calls."""
    # "Next" in the order of calls, not of the model's definition: llama defines its norms after the
    # attention and MLP they feed, and input_layernorm was observed after the residual add, not at q_proj.
    calls = ran + [name for name in order if name not in ran]
    readers = {}
    for layer in order:
        reached, grown = {layer}, True
        while grown:  # to a fixed point: registration order need not be the order of calls
            grown = False
            for later in order:
                if later not in reached and parents[later] & reached:
                    reached.add(later)
                    grown = True
        readers[layer] = next((n for n in calls[calls.index(layer) + 1:] if n in reached), None)
    return readers


def _leaves_behind(out: torch.Tensor, leaves: dict) -> set[str]:
    """Names of the cut leaves that ``out``'s autograd graph reaches."""
    found, seen, stack = set(), set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # AccumulateGrad: the graph's leaf
        if leaf is not None and id(leaf) in leaves:
            found.add(leaves[id(leaf)][1])
        stack += [f for f, _ in fn.next_functions]
    return found


def _seed(seed: int, like: torch.Tensor) -> None:
    """``torch.manual_seed(seed)`` for a forward on ``like``'s device. On the CPU, with CUDA not
    started, only the CPU generator is seeded, the one such a forward draws from: torch.manual_seed
    also queues a seeding of each accelerator not yet started (CUDA, XPU, MTIA), formatting the
    caller's stack for each, 0.6 ms a call in a playback job's stack, 16 forwards per step followed."""
    if like.device.type == "cpu" and not torch.cuda.is_initialized():
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def _rng_state(like: torch.Tensor) -> tuple:
    return (torch.get_rng_state(), torch.cuda.get_rng_state(like.device) if like.is_cuda else None)


def _same_rng(a: tuple, b: tuple) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _attrs(path) -> dict:
    with open_h5(path) as f:
        return dict(f.attrs)
