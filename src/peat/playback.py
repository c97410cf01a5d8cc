"""Playback fault injection: replay a recorded training context through a kernel.

For every recorded (layer, step) of the golden context, each computation of the layer
(forward, input gradient, weight gradient) runs through:

- golden float32 (PyTorch's op) and the float64 reference on the same inputs: the fp32
  reordering noise of that tensor (``ref:fp64`` rows);
- the golden op on operands rounded to fp16, bf16 and tf32 (``ref:fp16`` ... rows): the
  reduced-precision envelopes the Detector calibrates against;
- the kernel under test (``kernel`` rows) and the kernel with each configured pseudo-error
  model injected into that computation (one row set per error spec).

Fault injecting point = fault observing point gives ``fop == "output"`` rows. Forward
passes are also observed later (``peat.propagate``): at the next recorded layer's output and
at the loss of that step. One row per tensor per case goes to a tidy table; the time spent
inside kernel calls is accounted apart from reading the context and scoring.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from . import detect, errors, evidence, kernels, provenance, scores
from .io import PeatError, atomic_path, check_int, open_h5, write_json
from .profiler import read_layer, recorded_steps

ROW_BINS = 256  # the per-row error profile is summed into at most this many bins


class Timer:
    """Wall time per category; ``kernel`` is time inside kernel calls only.

    Categories are exclusive: time in a nested category (the kernel calls made while
    propagating, say) counts there and not in the enclosing one. ``kernel_fraction`` is the
    share of the kernel calls in the wall time; ``compute_fraction`` adds the forward passes of
    the rest of the network that carry a fault to the later observing points (``propagate``),
    leaving out only reading, probing, rebuilding and scoring.

    On a GPU each category waits for the device at its start and end: work is queued, and
    without that a kernel's run time would land in whatever next reads a result back (the
    scoring's copies to the host), not in ``kernel``.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.seconds: dict[str, float] = defaultdict(float)
        device = torch.device(device)
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.start = time.perf_counter()
        self._nested: list[float] = []  # per open category: seconds spent in categories inside it

    @contextmanager
    def __call__(self, category: str):
        self._sync()
        t0 = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            self._sync()
            spent = time.perf_counter() - t0
            self.seconds[category] += spent - self._nested.pop()
            if self._nested:
                self._nested[-1] += spent

    def spent_in(self, category: str, seconds: float, within: str) -> None:
        """``seconds`` of the time counted in ``within`` that were spent in ``category``: the probes'
        kernel calls run in a child, which the parent waits for inside ``probe``."""
        self.seconds[within] -= seconds
        self.seconds[category] += seconds

    def record(self) -> dict:
        self._sync()
        wall = time.perf_counter() - self.start
        share = (lambda seconds: seconds / wall if wall else 0.0)
        return {"wall_s": wall, **{f"{k}_s": v for k, v in sorted(self.seconds.items())},
                "kernel_fraction": share(self.seconds["kernel"]),
                "compute_fraction": share(self.seconds["kernel"] + self.seconds["propagate"])}


@dataclass
class Plan:
    """What one playback job replays."""

    context: Path
    kernel: kernels.Kernel
    layers: list[str] | None = None          # globs; None = every recorded layer of the kernel's op
    errors: list[str] = field(default_factory=list)
    computations: tuple[str, ...] = kernels.COMPUTATIONS
    max_samples: int | None = None           # per layer, evenly spaced over the recorded steps (1: the last)
    seed: int = 0
    timeout: float = 60.0                    # seconds per kernel call; the first of each custom computation runs isolated
    memory_mb: int | None = None             # ... with this much more address space than the parent
    expect: dict = field(default_factory=dict)  # context root attrs the workflow expects
    meta: dict = field(default_factory=dict)    # constant columns (model, vendor, kernel)
    propagate: object = None                    # peat.propagate.Propagator or None
    rules: detect.Rules = detect.Rules()
    device: torch.device = torch.device("cpu")

    def __post_init__(self):
        # The config schema checks these for the workflow; a library call's were not checked.
        _check_kernel(self)
        _check_lists(self)
        _check_limits(self)
        _check_injected(self)


def _check_kernel(plan: Plan) -> None:
    """None stays allowed: a plan that only scores (peat.evidence, the scoring benchmark) has no kernel."""
    if plan.kernel is not None:
        kernels.require(plan.kernel, "playback.Plan")


def _check_lists(plan: Plan) -> None:
    """A string was taken as a list of its letters (layers="fc": the globs 'f' and 'c'), an empty list
    (and max_samples=0) replayed nothing and passed as not applicable, a misspelt computation ended
    the replay in a KeyError."""
    for name in ("layers", "errors", "computations"):
        if isinstance(getattr(plan, name), str):
            raise PeatError(f"playback.Plan: {name}={getattr(plan, name)!r}: a list is expected, "
                            f"e.g. [{getattr(plan, name)!r}]")
    for name in ("layers", "computations"):
        if getattr(plan, name) is not None and len(getattr(plan, name)) == 0:
            raise PeatError(f"playback.Plan: {name} is empty: nothing would be replayed"
                            + (" (None: every recorded layer of the kernel's op)" if name == "layers" else ""))
    for computation in plan.computations:
        if computation not in kernels.COMPUTATIONS:
            raise PeatError(f"playback.Plan: computations holds {computation!r}; "
                            f"each is one of {', '.join(kernels.COMPUTATIONS)}")


def _check_limits(plan: Plan) -> None:
    """A limit no call can meet failed every kernel as a timeout (or oom): the verdict blamed the kernel."""
    if plan.max_samples is not None:
        check_int("playback.Plan: max_samples", plan.max_samples, 1,
                  "steps replayed per layer need an integer >= 1 (None: every step)")
    kernels.check_timeout("playback.Plan: timeout", plan.timeout)  # kernels.deadline bounds each call after the probe
    if plan.memory_mb is not None:
        check_int("playback.Plan: memory_mb", plan.memory_mb, 16,
                  "extra MiB the isolated first call may map need an integer >= 16 (None: no limit)")


def _check_injected(plan: Plan) -> None:
    """A faulty kernel whose faulty computation is not replayed was judged on golden results alone: a pass."""
    meta = getattr(plan.kernel, "meta", None) or {}
    if why := errors.never_replayed(meta.get("error"), meta.get("computation"), plan.computations):
        name = plan.meta.get("kernel", plan.kernel.name)
        raise PeatError(f"playback.Plan: kernel {name!r} (kernels.{name}.computation): {why}; "
                        "playback.computations must include it")


# -- the context ---------------------------------------------------------------------------
# The torch build tag (+cu130, +rocm6.4, +cpu) names the GPU stack, which cross-vendor replay
# changes on purpose; the release itself must match.
_COMPARED_AS = {"torch_version": lambda v: str(v).split("+", 1)[0]}


def check_context(path: str | Path, expect: dict) -> dict:
    """Root attrs and layer ops of a context, after checking it matches what the workflow expects."""
    with open_h5(path) as f:
        if "layers" not in f:  # a checkpoint (final.h5 lies beside context.h5) replayed nothing and passed
            raise PeatError(f"{path}: not a training context (no 'layers' group, which peat's Profiler writes); "
                            "give a golden run's context.h5")
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        ops = {name: str(group.attrs.get("op", "")) for name, group in f["layers"].items()}
    for key, want in expect.items():
        have = attrs.get(key)
        if have is None:
            raise PeatError(f"{path}: context has no attribute '{key}' (expected {want!r}); re-run golden training")
        same = _COMPARED_AS.get(key, str)
        if same(have) != same(want):
            raise PeatError(f"{path}: context {key} is {have!r} but this workflow expects {want!r}; "
                            "re-run golden training for this config")
    order = [str(n) for n in attrs.get("layers", [])] or sorted(ops)
    return {"attrs": attrs, "ops": {n: ops[n] for n in order if n in ops}}


def target_layers(path, ops: dict[str, str], op: str, globs: list[str] | None, key: str) -> list[str]:
    """Recorded layers of ``op`` matched by ``globs`` (every one of that op when None)."""
    of_op = [n for n, o in ops.items() if o == op]
    if globs is None:
        return of_op
    chosen = []
    for pattern in globs:
        hits = [n for n in ops if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise PeatError(f"{path}: no recorded layer matches {pattern!r} ({key}); recorded: {', '.join(ops)}")
        wrong = [n for n in hits if ops[n] != op]
        if wrong and len(wrong) == len(hits):
            raise PeatError(f"{path}: layer {wrong[0]!r} ({key}) is {ops[wrong[0]]}, the kernel is {op}")
        chosen += [n for n in hits if ops[n] == op and n not in chosen]
    return [n for n in of_op if n in chosen]


def subsample(samples: list, limit: int | None) -> list:
    if limit is None or len(samples) <= limit:
        return samples
    idx = np.unique(np.linspace(0, len(samples) - 1, limit).round().astype(int))
    return [samples[i] for i in idx]


def replayed_steps(plan: Plan, layer: str) -> list[int]:
    """The steps of ``layer`` replayed: ``max_samples`` of those at which it ran. Spaced over every
    recorded step, a layer on a conditional branch (an idle expert) could get only steps holding
    its weights alone, and then nothing was replayed, which passed as not applicable.

    One step is the last: the first holds the initial weights (norm weights one, biases zero), on
    which a kernel that applies them twice or leaves them out computes golden's values exactly."""
    ran = recorded_steps(plan.context, layer, ran=True)
    return ran[-1:] if plan.max_samples == 1 else subsample(ran, plan.max_samples)


def case_seed(seed: int, *parts) -> int:
    """A seed per (layer, computation, spec): stable across runs and independent of job order."""
    blob = ":".join(map(str, (seed, *parts))).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little")


# -- one computation on one sample ------------------------------------------------------------
def score_row(candidate: torch.Tensor, golden: torch.Tensor, reference: torch.Tensor, env: dict,
              rules: detect.Rules, noise: dict | None = None, gold: scores.Golden | None = None,
              diff: scores.Diff | None = None) -> dict:
    """Scores, detector evidence and baselines of one candidate tensor. ``noise`` (the summary of
    |golden - reference|) and ``gold`` (``scores.Golden.of(golden)``) are shared by every
    candidate of the same golden tensor; ``diff`` (``scores.difference(candidate, gold)``) may
    be passed in when already found. ``reference`` is read only without ``noise``."""
    gold = scores.Golden.of(golden) if gold is None else gold
    diff = scores.difference(candidate, gold) if diff is None else diff
    row = scores.tensor_scores(candidate, golden, reference, noise=noise, diff=diff, gold=gold)
    row["row_mass"] = _bins(row["row_mass"], ROW_BINS)
    row |= env | evidence.evidence(candidate, golden, env, rules, diff=diff.err, nonfinite=row["nonfinite"], gold=gold,
                                   top=diff.top)
    row["allclose"] = _allclose(row, candidate, golden, gold)
    row["error_model"], row["confidence"] = detect.classify(row, rules)
    return row


def _allclose(row: dict, candidate: torch.Tensor, golden: torch.Tensor, gold: scores.Golden) -> bool:
    """``evidence.allclose``, settled from the scores where they decide it: bitwise equal to a
    golden without NaN holds; a non-finite value where golden is finite, or an error more than
    twice the loosest tolerance (atol + rtol * max |golden|; twice covers float32 rounding of
    both sides), fails."""
    if row["frac_diff"] == 0 and gold.finite:
        return True
    if row["nonfinite"] > 0 or (gold.finite and row["err_max"] > 2 * (1e-8 + 1e-5 * max(-gold.lo, gold.hi))):
        return False
    return evidence.allclose(candidate, golden, gold)


def _bins(values: np.ndarray, limit: int) -> np.ndarray:
    if len(values) <= limit:
        return values
    return np.add.reduceat(values, scores.bin_edges(len(values), limit)[:-1])


def _call(timer: Timer, kernel, computation, sample, attrs, dtype=torch.float32,
          timeout: float | None = None) -> dict[str, torch.Tensor]:
    """The call's results by tensor name: the computation's own (``kernels.TARGET``) and the running
    statistics it updated in place (``kernels.updates``), which the rest of training reads too.
    ``timeout``: seconds it may take (``kernels.CallTimeout`` past them)."""
    updated = {}
    with timer("kernel"), kernels.deadline(timeout):
        out = kernels.call(kernel, computation, sample, attrs, dtype, updated=updated)
    device = sample["A"].device
    # Moved to the CPU below, a result on another device would pass (see _Scored.add); a later call
    # returning no tensor (None) failed as a crash in torch's AttributeError, where its probe says shape_mismatch.
    if not torch.is_tensor(out) or out.device != device:
        wrong = kernels.wrong_result(out, getattr(out, "shape", ()), getattr(out, "dtype", None), device)
        raise kernels.ShapeMismatch(f"kernel {kernel.name!r} {computation} {wrong}")
    # A copy even on the CPU (where .cpu() is the result itself): a kernel returning one persistent
    # buffer overwrote the kernel case's result with the next variant's call, and the variants
    # injecting into that result (errors.reuses) were scored on another case's output.
    return {kernels.TARGET[computation]: out.to("cpu", copy=True), **{name: t.cpu() for name, t in updated.items()}}


def _injected(timer: Timer, kernel, computation, result: torch.Tensor, sample, attrs) -> torch.Tensor:
    """A faulty variant's result from the kernel's own on this sample (``errors.reuses``): the
    injected error on top of the very result the kernel case is scored on. Calling the kernel
    again would compute it again (6 of the 10 default error models inject into results)."""
    with timer("kernel"):
        args, kwargs = kernels.operands(attrs["op"], computation, sample, attrs)
        out = errors.inject(kernel, computation, result.to(args[0].device), args, kwargs)
    return out.cpu()


def references(timer: Timer, computation: str, sample: dict, attrs: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Golden fp32, fp64, and the golden op on operands rounded to fp16/bf16/tf32 (each ``_call``'s results)."""
    gold = kernels.golden(attrs["op"], attrs)
    out = {"golden": _call(timer, gold, computation, sample, attrs),
           "fp64": _call(timer, gold, computation, sample, attrs, torch.float64)}
    for p in evidence.PRECISIONS:
        out[p] = _call(timer, errors.faulty(gold, p, computation), computation, sample, attrs)
    return out


def replay(plan: Plan) -> tuple[pd.DataFrame, dict]:
    """Run the whole campaign: the tidy table and a sidecar record (timings, outcomes, context)."""
    timer = Timer(plan.device)
    with timer("io"):
        info = check_context(plan.context, plan.expect)
    op = plan.kernel.op
    key = f"kernels.{plan.meta.get('kernel', plan.kernel.name)}.layers"
    layers = target_layers(plan.context, info["ops"], op, plan.layers, key)
    probed = probe(plan, timer, layers)
    uninjected = _uninjected(plan, layers, probed)
    rows = []
    for layer in layers:
        steps = replayed_steps(plan, layer)
        for computation in plan.computations:
            if (layer, computation) in probed and probed[layer, computation].ok:
                rows += _replay_layer(plan, timer, layer, computation, steps)
    outcomes = [{"layer": layer, "computation": computation, **outcome.record()}
                for (layer, computation), outcome in probed.items()]
    table = pd.DataFrame(rows)
    sidecar = {"context": str(plan.context), "context_attrs": _jsonable(info["attrs"]), "layers": layers,
               "errors": plan.errors, "max_samples": plan.max_samples, "outcomes": outcomes,
               "outcome": _overall(outcomes), "timings": timer.record(), "layers_not_injected": uninjected,
               "rules": asdict(plan.rules),  # what the table's evidence was measured with (detect.rules_of)
               "computation": plan.kernel.meta.get("computation") if plan.kernel.meta.get("error") else None,
               **plan.meta}
    return table, sidecar


def _uninjected(plan: Plan, layers: list[str], probed: dict) -> list[str]:
    """Layers where a faulty kernel's error is never replayed, each named in one line: its
    computation has no recorded sample there (no input gradient at a layer fed by data, no weight
    gradient for a frozen weight), so the verdict judged the kernel clean on rows it left golden."""
    computation = plan.kernel.meta.get("computation")
    if not plan.kernel.meta.get("error"):  # a faulty one's computation is replayed (_check_injected)
        return []
    missing = [layer for layer in layers if (layer, computation) not in probed]
    for layer in missing:
        errors.warn_never_injected(plan.meta.get("kernel", plan.kernel.name), plan.kernel.meta["error"], layer,
                                   f"the context records no {computation} there")
    return missing


def _to(sample: dict, device: torch.device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in sample.items()}


def _samples(plan: Plan, timer: Timer, layer: str, steps: list[int] | None = None) -> tuple[dict, list[dict]]:
    """The layer's attributes and the samples replayed (on the plan's device); of ``steps`` alone
    when given."""
    if steps is None:
        steps = replayed_steps(plan, layer)
    with timer("io"):  # only the steps replayed are read; golden is computed below anyway, so not derived here
        attrs, samples = read_layer(plan.context, layer, steps, derive=False)
    # A step at which the layer did not run (a conditional branch, an idle expert) holds its weights only.
    return attrs, [kernels.as_trained(_to(s, plan.device), attrs) for s in samples if s.get("A") is not None]


def probe(plan: Plan, timer: Timer, layers: list[str]) -> dict[tuple[str, str], kernels.Outcome]:
    """The outcome of each (layer, computation) that has a sample to replay: the kernel's own
    computation on its first such sample, run in a child process, so that a crash or hang is
    an outcome. All of them run in one child (``kernels.run_isolated_many``), and only the
    first samples are held meanwhile."""
    first = {}
    for layer in layers:
        found = {}  # read step by step until each computation has a sample: usually the first serves all
        for step in replayed_steps(plan, layer):
            attrs, samples = _samples(plan, timer, layer, [step])
            for computation in plan.computations:
                if samples and computation not in found and kernels.applies(computation, samples[0]):
                    found[computation] = (samples[0], attrs)
            if len(found) == len(plan.computations):
                break
        first |= {(layer, c): found[c] for c in plan.computations if c in found}
    outcomes = {key: kernels.Outcome("ok", "golden fallback") for key in first}
    own = [key for key in first if key[1] in plan.kernel.custom]
    with timer("probe"):
        # A replica: where the probes run in this process (CUDA), a faulty kernel's draws must not move.
        calls = [kernels.Call(kernels.call, (errors.replica(plan.kernel, computation), computation,
                                             *first[layer, computation]),
                              expect=kernels.expected(computation, *first[layer, computation]))
                 for layer, computation in own]
        isolated = kernels.run_isolated_many(calls, timeout=plan.timeout, memory_mb=plan.memory_mb)
    # Calls of the kernel under test at its output, as those of _cases are: inside kernel calls (the child's
    # start and the results' way back stay the probe's). 0.15-0.25 s of the benchmark campaign's 0.3 s.
    timer.spent_in("kernel", sum(outcome.called for outcome in isolated), within="probe")
    return outcomes | dict(zip(own, isolated))


def _overall(outcomes: list[dict]) -> dict:
    bad = [o for o in outcomes if o["status"] != "ok"]
    if not bad:
        return {"status": "ok", "message": ""}
    return {"status": bad[0]["status"], "message": f"{bad[0]['layer']} {bad[0]['computation']}: {bad[0]['message']}"}


def _recorded_difference(golden: torch.Tensor, recorded: torch.Tensor | None) -> float:
    # Without stored outputs (record.derived: false) the recorded output is golden's by construction.
    return 0.0 if recorded is None else float((golden.double() - recorded.cpu().double()).abs().max())


def _variants(plan: Plan, layer: str, computation: str, attrs: dict) -> dict[str, kernels.Kernel]:
    kernel = kernels.on_layer(plan.kernel, attrs)  # what it leaves to golden, as golden computes it on this layer
    out = {"kernel": kernel}
    for spec in plan.errors:
        # strict: a sample where the error changes nothing (rz on an all-zero output) is a not_applicable
        # row, not a case scored as injected while it holds golden's values.
        out[spec] = errors.faulty(kernel, spec, computation, seed=case_seed(plan.seed, layer, computation, spec),
                                  strict=True)
    return out


def _each_sample(plan: Plan, timer: Timer, layer: str, computation: str, steps: list[int]):
    """The layer's samples at ``steps`` that ``computation`` applies to, read one step at a time:
    all of a layer's recorded steps together (a weight each) can outgrow memory."""
    for step in steps:
        yield from (s for s in _samples(plan, timer, layer, [step])[1] if kernels.applies(computation, s))


def _replay_layer(plan: Plan, timer: Timer, layer: str, computation: str, steps: list[int]) -> list:
    """The rows of one layer and computation at ``steps``: per sample, the references, the cases
    at the kernel's output and, for a forward, at the later observing points."""
    rows = []
    attrs, _ = read_layer(plan.context, layer, [])  # the layer's attributes alone
    variants = _variants(plan, layer, computation, attrs)  # made once: stateful models see consecutive calls
    follow = plan.propagate is not None and computation == "forward"
    for sample in _each_sample(plan, timer, layer, computation, steps):
        base, scored = _scored_references(plan, timer, layer, computation, sample, attrs)
        failed, twins = _cases(plan, timer, variants, base, sample, attrs, scored, follow)
        rows += failed  # a failed case's row comes before the scored ones, as the table has always had it
        for of_tensor in scored.values():
            rows += of_tensor.rows
        if _timed_out(failed):
            break  # as in _cases: the layer's later samples would each wait out the timeout
        if follow:
            with timer("propagate"):
                down = plan.propagate.rows(layer, sample, twins, base, plan.rules, timer, replayed=steps,
                                           timeout=_call_limit(plan, computation))
            rows += down
            if _timed_out(down):  # a hang downstream, as at the output
                break
    return rows


def _timed_out(rows: list[dict]) -> bool:
    return any(row.get("status") == "timeout" for row in rows)


def _call_limit(plan: Plan, computation: str) -> float | None:
    """Seconds each call of the kernel's ``computation`` may take: its own computations are bounded
    (``playback.timeout``), golden's, which a computation it leaves to golden runs, are not."""
    return plan.timeout if computation in plan.kernel.custom else None


def _scored_references(plan: Plan, timer: Timer, layer: str, computation: str, sample: dict,
                       attrs: dict) -> tuple[dict, dict[str, "_Scored"]]:
    """The sample's row base and a ``_Scored`` per result tensor, its references' rows in it.
    The references go when this returns: only golden and the envelopes stay."""
    target = kernels.TARGET[computation]
    ref = references(timer, computation, sample, attrs)
    with timer("score"):
        base = {**plan.meta, "op": attrs["op"], "layer": layer, "step": int(sample["step"]),
                "epoch": int(sample["epoch"]), "computation": computation, "fop": "output", "tensor": target,
                "golden_vs_recorded": _recorded_difference(ref["golden"][target], sample.get(target))}
        # The context holds the running statistics before the step's update only.
        scored = {tensor: _Scored(plan, base if tensor == target else
                                  base | {"tensor": tensor, "golden_vs_recorded": float("nan")},
                                  {name: out[tensor] for name, out in ref.items()}, summed_floor(tensor, sample, attrs))
                  for tensor in ref["golden"]}
    return base, scored


def _cases(plan: Plan, timer: Timer, variants: dict, base: dict, sample: dict, attrs: dict,
           scored: dict[str, "_Scored"], follow: bool) -> tuple[list[dict], dict]:
    """Each variant (the kernel, then each faulty kernel) on ``sample`` (its row ``base``), its
    results scored into ``scored`` as they come and dropped. Returns the rows of the cases that
    failed and, where ``follow``, per case a copy of its kernel taken before its call: downstream,
    each case injects what it injects here (``errors.replica``)."""
    computation, target = base["computation"], kernels.TARGET[base["computation"]]
    # The kernel case's results are kept for the variants injecting into them (see _injected), until the last.
    reusing = [case for case, kernel in variants.items() if errors.reuses(kernel, computation, variants["kernel"])]
    failed, own = [], None
    # A variant that injects into the kernel's result does not call it: its copy from the start serves.
    twins = {case: errors.replica(kernel, computation) for case, kernel in variants.items()} if follow else {}
    for case, kernel in variants.items():
        try:
            if own is not None and case in reusing:
                # Injected into the result alone: the statistics it updated are the kernel case's.
                out = own | {target: _injected(timer, kernel, computation, own[target], sample, attrs)}
            else:
                if follow:  # it calls the kernel again (a faulty one draws anew): copied just before
                    twins[case] = errors.replica(kernel, computation)
                # Bounded as its probe was: a kernel hanging at a later step only held the job forever.
                out = _call(timer, kernel, computation, sample, attrs, timeout=_call_limit(plan, computation))
        except Exception as err:  # a kernel failing later than its probe: a row saying so
            status = ("not_applicable" if isinstance(err, errors.NotApplicable) else
                      "shape_mismatch" if isinstance(err, kernels.ShapeMismatch) else
                      "timeout" if isinstance(err, kernels.CallTimeout) else "crash")
            failed.append({**plan.meta, "layer": base["layer"], "step": base["step"], "computation": computation,
                           "case": case, "status": status, "error": f"{type(err).__name__}: {err}"})
            twins.pop(case, None)  # no row downstream either: its row is above
            if status == "timeout":  # each further call would wait it out again: the verdict is settled
                break
        else:
            with timer("score"):
                for tensor, of_tensor in scored.items():
                    of_tensor.add(case, out[tensor])
            gold = scored[target].golden
            if case == "kernel" and reusing and not kernels.wrong_result(out[target], gold.shape, gold.dtype, gold.device):
                own = out
            del out
        if reusing and case == reusing[-1]:
            own = None
    return failed, twins


def summed_floor(tensor: str, sample: dict, attrs: dict) -> float:
    """float32's rounding of a batch norm's running mean: momentum x EPS32 x max|x| (0 for any other
    tensor). A mean sums values of both signs; where they cancel (a batch norm after a batch norm and a
    bias-free 1 x 1 convolution, whose input has zero mean per channel by construction) golden's float32
    sum can land on the exact result, |golden - fp64| then shows none of float32's rounding (1e-16 on
    EfficientNet-B0's features.2.0.block.0.1), and the shipped one-pass, Welford and compiled batch norms,
    off by 1e-9 as any other summation order is, read as reduced_precision: a fail with
    detect.accept_reduced_precision: false. A running variance sums squares, which do not cancel."""
    if tensor != "running_mean" or not sample["A"].numel():
        return 0.0
    momentum = kernels.arguments("batch_norm", "forward", sample, attrs)[1]["momentum"]
    scale = float(sample["A"].abs().amax())
    return evidence.EPS32 * momentum * scale if math.isfinite(scale) else 0.0


class _Scored:
    """The rows of one result tensor, one per case, each scored when it comes against golden with
    the envelopes its references (``ref``: golden, fp64 and the rounded ones) measure on this
    sample; the references are scored first. Golden and the envelopes alone are kept: the
    cases are not, and the references not past this constructor."""

    def __init__(self, plan: Plan, base: dict, ref: dict[str, torch.Tensor], floor: float = 0.0):
        self.plan, self.base, self.golden, self.rows = plan, base, ref["golden"], []
        self.gold = scores.Golden.of(self.golden)
        self.env = evidence.envelopes(self.golden, ref["fp64"], {p: ref[p] for p in evidence.PRECISIONS},
                                      plan.rules, self.gold, footprints=False, floor=floor)
        for p, diff in evidence.scored_references(self.env, ref, self.gold, plan.rules):
            self.add(f"ref:{p}", ref[p], diff)
            del diff  # one error held at a time: not through the next reference's or fp64's
        self.add("ref:fp64", ref["fp64"])

    def add(self, case: str, cand: torch.Tensor, diff: scores.Diff | None = None) -> None:
        if case == "ref:fp64":  # float64 by design, scored as golden's dtype
            cand = cand.to(self.golden.dtype)
        # The dtype as well as the shape: the probe judges a kernel's first sample only, and a later
        # result in another dtype was scored as golden's (float16, float64) or ended the job (bfloat16).
        if mismatch := kernels.wrong_result(cand, self.golden.shape, self.golden.dtype, self.golden.device):
            self.rows.append({**self.base, "case": case, "status": "shape_mismatch", "error": mismatch})
            return
        # The envelopes hold the noise summary: fp64 itself is not needed again (hence None).
        self.rows.append({**self.base, "case": case, **score_row(cand, self.golden, None, self.env, self.plan.rules,
                                                                 self.env.noise, self.gold, diff)})


def _jsonable(attrs: dict) -> dict:
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in attrs.items()}


# -- files -------------------------------------------------------------------------------------
def write(table: pd.DataFrame, sidecar: dict, out: str | Path, sidecar_path: str | Path) -> None:
    with atomic_path(out) as tmp:
        table.to_parquet(tmp, index=False)
    write_json(sidecar_path, sidecar)


def run_job(model: str, vendor: str, kernel_name: str, kspec: dict, context: str | Path, out: str | Path,
            sidecar: str | Path, *, errors_: list[str], settings: dict, rules: dict, seed: int = 0,
            threads: int = 1, config_hash: str | None = None, propagate_from: dict | None = None) -> pd.DataFrame:
    """One workflow job: replay ``context`` through configured kernel ``kernel_name`` (``kspec``).

    The context must carry this workflow's ``config_hash`` and the running torch release (the
    build tag, such as ``+cu130``, may differ: cross-vendor replay).
    ``settings``: the config's playback section, a key it leaves out taking the schema's default.
    ``propagate_from`` (model spec, data and checkpoint paths) enables the later observing points.
    """
    from .candidate import build
    from .config import section_defaults
    from .device import for_vendor, seed_everything

    # A workflow job's defaults for a library call too: without propagate_samples it followed every
    # step, without memory_mb it had no limit.
    settings = section_defaults("playback") | settings
    timeout = kspec.get("timeout", settings["timeout"])  # a slow kernel may ask for more
    # First, before CUDA starts (no fork after that) and before anything is read or written.
    kernels.check_loads(kspec.get("impl", "golden"), kspec["op"], timeout=timeout)
    seed_everything(seed, threads)
    device = for_vendor(vendor)
    expect = {"model": model, "torch_version": str(torch.__version__)}
    if config_hash is not None:
        expect["config_hash"] = config_hash
    plan = Plan(context=Path(context), kernel=build(kernel_name, kspec), layers=kspec.get("layers"),
                errors=list(errors_), computations=tuple(settings["computations"]),
                max_samples=settings["max_samples_per_layer"], seed=seed, timeout=timeout, memory_mb=settings["memory_mb"],
                expect=expect, meta={"model": model, "vendor": vendor, "kernel": kernel_name},
                rules=detect.rules_from(rules), device=device)
    if propagate_from is not None and settings["propagate"]:
        from .propagate import Propagator

        plan.propagate = Propagator(context=plan.context, device=device, samples=settings["propagate_samples"],
                                    **propagate_from)
    table, record = replay(plan)
    record["provenance"] = provenance.stamp(config_hash, vendor)
    write(table, record, out, sidecar)
    print(f"playback {model}/{vendor}/{kernel_name}: {len(table)} rows, timings {record['timings']}")
    return table
