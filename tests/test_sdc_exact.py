"""SDC checks re-derived from the README's words and checked case by case: each alarm's check, step,
suspect ranks and localization, on real gloo process groups of 2 and 3 ranks (one launch each)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from peat import sdc
from test_sdc import _torchrun, digits  # noqa: F401  (digits: a fixture, the prepared data set)

# One launch of W ranks runs every case, one step (or one guard) each, and prints what each rank saw.
EXACT_LOOP = r"""
import json, sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from peat import sdc

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1))
y = torch.randn(4 * world, 3, generator=torch.Generator().manual_seed(2))
out = {"nonfinite": [], "fingerprint": [], "audit": [], "every": [], "tolerant": []}


def build(fused, audit_every, **options):
    torch.manual_seed(0)
    # Weights of 30 and 15 elements (64-bit words), biases of 5 and 3 (one word per element).
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ddp = DistributedDataParallel(model)
    guard = sdc.Guard(ddp, policy="log", fused=fused, audit_every=audit_every, **options)
    return model, ddp, guard, torch.optim.SGD(model.parameters(), lr=0.01)


def loss_of(module, r, step, part=None):
    idx = sdc.shard(list(range(4 * world)), r, world)
    if part is not None:  # one of two micro-batches
        idx = idx[:len(idx) // 2] if part == 0 else idx[len(idx) // 2:]
    return ((module(x[idx]) - y[idx]) ** 2).sum() * (1 + step % 3)


def alarms(guard, since):
    return [[e.step, e.check, e.suspect_ranks, e.localized, e.detail] for e in guard.alarms[since:]]


def poke(tensor, position, value):
    flat = tensor.view(-1)
    flat[{"first": 0, "middle": flat.numel() // 2, "last": flat.numel() - 1}[position]] = value


# --- non-finite gradients: NaN/Inf in one parameter's local gradient of one rank ---
for fused in (False, True):
    model, ddp, guard, opt = build(fused, audit_every=1)
    params = list(model.parameters())
    case = {}
    for i, p in enumerate(params):
        def hook(g, i=i):
            if case.get("param") == i and rank in case["ranks"] and case["micro"] == case["now"]:
                g = g.clone()
                poke(g, case["position"], case["value"])
            return g
        p.register_hook(hook)
    cases = [(i, pos, val, ranks, micro)
             for i in range(len(params))
             for pos, val in (("first", "nan"), ("last", "inf"), ("middle", "-inf"), ("last", "nan"))
             for ranks, micro in [([i % world], None), ([(i + 1) % world], 0), ([(i + 2) % world], 1)]]
    cases.append((0, "last", "nan", list(range(world)), None))  # every rank: the run's fault
    for step, (i, pos, val, ranks, micro) in enumerate(cases):
        guard.begin_step(step)
        opt.zero_grad(set_to_none=True)
        since = len(guard.alarms)
        case = {"param": i, "position": pos, "value": float(val), "ranks": ranks, "micro": micro}
        if micro is None:
            case["now"] = None
            loss_of(ddp, rank, step).backward()
            replay = lambda r: loss_of(guard.module, r, step)
        else:  # two micro-batches, the first under no_sync
            with ddp.no_sync():
                case["now"] = 0
                loss_of(ddp, rank, step, 0).backward()
            case["now"] = 1
            loss_of(ddp, rank, step, 1).backward()
            replay = lambda r: loss_of(guard.module, r, step, 0) + loss_of(guard.module, r, step, 1)
        healthy = guard.check_gradients(replay=replay)
        if healthy:
            opt.step()
        guard.check_weights()
        out["nonfinite"].append([fused, [i, pos, val, ranks, micro], healthy, alarms(guard, since)])
    guard.finish()

# --- weight fingerprints: one flipped bit of one rank's weights after optimizer.step() ---
for fused in (False, True):
    model, ddp, guard, opt = build(fused, audit_every=0)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    step = 0
    for i, p in enumerate(params):
        for position in ("first", "middle", "last"):
            for bit in (0, 22, 23, 30, 31):
                k = (i + bit + len(position)) % world
                guard.begin_step(step)
                opt.zero_grad(set_to_none=True)
                loss_of(ddp, rank, step).backward()
                assert guard.check_gradients()
                opt.step()
                words = p.data.view(torch.int32).view(-1)
                where = {"first": 0, "middle": words.numel() // 2, "last": words.numel() - 1}[position]
                mask = (1 << bit) if bit < 31 else -(1 << 31)  # bit 31: the sign
                if rank == k:
                    words[where] ^= mask
                guard.check_weights()
                since = len(guard.alarms)
                guard.finish()  # the comparison settled with the flip in place
                if rank == k:
                    words[where] ^= mask
                out["fingerprint"].append([fused, [names[i], position, bit, k], alarms(guard, since)])
                step += 1

# --- fingerprint_every 2: a flip after step 1 is compared at step 2, and kept there on ---
model, ddp, guard, opt = build(False, audit_every=0, fingerprint_every=2)
for step in range(5):
    guard.begin_step(step)
    opt.zero_grad(set_to_none=True)
    loss_of(ddp, rank, step).backward()
    assert guard.check_gradients()
    opt.step()
    if step == 1 and rank == 1:
        model[0].bias.data.view(torch.int32)[-1] ^= 1 << 3
    guard.check_weights()
guard.finish()
out["every"] = [[e.step, e.check, e.suspect_ranks, e.localized] for e in guard.alarms]

# --- ring audit: wrong local gradients (finite) on one rank, or a wrong replay ---
for fused in (False, True):
    model, ddp, guard, opt = build(fused, audit_every=1)
    armed = {"report": False, "replay": False, "forward": False}
    model[2].weight.register_hook(  # this rank's own backward, or its replay, once
        lambda g: g * (1 + 2 ** -20) if armed.pop("now", False) else g)
    model[0].register_forward_hook(lambda m, i, o: o * 1.001 if armed["forward"] else o)
    scale = 1024.0
    cases = [(kind, k) for kind in ("report", "replay", "persistent", "accumulated") for k in range(world)]
    cases += [("clean", None), ("scaled", None), ("unscaled", None), ("two micro-batches", None)]
    for step, (kind, k) in enumerate(cases):
        guard.begin_step(step)
        opt.zero_grad(set_to_none=True)
        mine = rank == k
        armed["forward"] = mine and kind == "persistent"
        if mine and kind in ("report", "accumulated"):  # accumulated: the first of two micro-batches
            armed["now"] = True
        s = scale if kind in ("scaled", "unscaled") else 1.0
        if kind in ("accumulated", "two micro-batches"):
            with ddp.no_sync():
                loss_of(ddp, rank, step, 0).backward()
            loss_of(ddp, rank, step, 1).backward()
        else:
            (loss_of(ddp, rank, step) * s).backward()
        if mine and kind == "replay":
            armed["now"] = True
        since = len(guard.alarms)
        replay_scale = 1.0 if kind == "unscaled" else s
        if kind in ("accumulated", "two micro-batches"):  # one loss, the sum of the rank's micro-batches'
            replay = lambda r: loss_of(guard.module, r, step, 0) + loss_of(guard.module, r, step, 1)
        else:
            replay = lambda r: loss_of(guard.module, r, step) * replay_scale
        assert guard.check_gradients(replay=replay)
        armed["forward"] = False
        armed.pop("now", None)
        opt.step()
        guard.check_weights()
        out["audit"].append([fused, [kind, k], alarms(guard, since)])
    guard.finish()

# --- audit_tolerance 1e-4 on the gradient norms: a change of 1e-6 passes, one of 1e-3 does not ---
model, ddp, guard, opt = build(False, audit_every=1, audit_tolerance=1e-4)
armed = {}
model[2].weight.register_hook(lambda g: g * (1 + 2 ** -20) if armed.pop("now", False) else g)
model[0].register_forward_hook(lambda m, i, o: o * 1.001 if armed.get("forward") else o)
for step, kind in enumerate(["report", "persistent"]):
    guard.begin_step(step)
    opt.zero_grad(set_to_none=True)
    armed["now"] = rank == 1 and kind == "report"
    armed["forward"] = rank == 1 and kind == "persistent"
    loss_of(ddp, rank, step).backward()
    guard.check_gradients(replay=lambda r: loss_of(guard.module, r, step))
    armed["forward"] = False
    opt.step()
    guard.check_weights()
guard.finish()
out["tolerant"] = [[e.step, e.check, e.suspect_ranks, e.localized] for e in guard.alarms]

with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:  # long lines on one stdout would interleave
    json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module", params=[2, 3])
def exact(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """Every case on ``world`` ranks: what each rank saw."""
    world = request.param
    folder = tmp_path_factory.mktemp("exact")
    script = folder / "exact.py"
    script.write_text(EXACT_LOOP)
    _torchrun(script, world, str(folder))
    return world, [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def _alike(ranks: list[dict], check: str) -> list:
    """The cases of ``check``, which every rank must have seen alike (same verdict, same alarms)."""
    first = ranks[0][check]
    for other in ranks[1:]:
        assert other[check] == first
    return first


def test_nonfinite_gradient_is_named_on_every_rank(exact):
    world, ranks = exact
    cases = _alike(ranks, "nonfinite")
    assert len(cases) == 2 * (4 * 4 * 3 + 1)
    for fused, (_, _, _, bad, _), healthy, alarms in cases:
        assert not healthy
        localized = len(bad) < world  # not when every rank had one
        assert [a[1:4] for a in alarms] == [["nonfinite", bad, localized]], (fused, bad, alarms)
        assert alarms[0][4]["flags"] == [int(r in bad) for r in range(world)]


def test_flipped_weight_bit_is_named_by_the_majority(exact):
    world, ranks = exact
    cases = _alike(ranks, "fingerprint")
    assert len(cases) == 2 * 4 * 3 * 5
    for fused, (name, position, bit, k), alarms in cases:
        expected = ([k], True) if world >= 3 else (list(range(world)), False)
        assert len(alarms) == 1, (fused, name, position, bit, alarms)
        step, check, suspects, localized, detail = alarms[0]
        assert (check, suspects, localized) == ("fingerprint", *expected)
        assert detail["first_differing_parameter"] == name
        assert detail.get("note") == ("two replicas: detected but cannot localize" if world == 2 else None)


def test_fingerprint_every_and_audit_tolerance(exact):
    world, ranks = exact
    named = ([1], True) if world >= 3 else (list(range(world)), False)
    # Compared at steps 0, 2 and 4 only: the flip after step 1 shows at step 2, and stays.
    assert _alike(ranks, "every") == [[step, "fingerprint", *named] for step in (2, 4)]
    # Only the persistent fault (1e-3 on the norms) fails the tolerant audits, on the rank that made it.
    assert _alike(ranks, "tolerant") == [[1, "audit", *named]]


def test_audit_names_the_rank_whose_gradients_were_wrong(exact):
    world, ranks = exact
    cases = _alike(ranks, "audit")
    for fused, (kind, k), alarms in cases:
        if kind in ("clean", "scaled", "two micro-batches"):
            assert alarms == [], (fused, kind, alarms)
            continue
        assert len(alarms) == 1, (fused, kind, k, alarms)
        _, check, suspects, localized, detail = alarms[0]
        failed = _failed_audits(kind, k, world)
        assert check == "audit" and sorted(detail["failed_audits"]) == sorted(failed), (fused, kind, k, detail)
        if kind == "unscaled" or world == 2:
            assert (suspects, localized) == (list(range(world)), False), (fused, kind, k, alarms)
            why = "two replicas" if world == 2 else "failed audits have no common rank"
            assert detail["note"] == f"{why}: detected but cannot localize"
        else:
            assert (suspects, localized) == ([k], True), (fused, kind, k, alarms)


def _failed_audits(kind: str, k: int | None, world: int) -> list:
    """The audits (auditor, audited) that fail on the ring r -> r+1: the faulty rank's report fails its
    auditor's replay, its own wrong replay fails its audit of the next rank; a replay of a loss not
    scaled as for the backward fails every audit."""
    if kind == "unscaled":
        return [[r, (r + 1) % world] for r in range(world)]
    wrong_report, wrong_replay = [[(k - 1) % world, k]], [[k, (k + 1) % world]]
    return {"report": wrong_report, "accumulated": wrong_report, "replay": wrong_replay,
            "persistent": wrong_report + wrong_replay}[kind]


# --- pure rules, every case ---------------------------------------------------------------------

def _labelings(world: int):
    """Every assignment of fingerprints to ``world`` ranks, up to renaming (restricted growth strings)."""
    for labels in itertools.product(range(world), repeat=world):
        if all(labels[i] <= max(labels[:i], default=-1) + 1 for i in range(world)):
            yield labels


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_majority_rule_every_pattern(world):
    for labels in _labelings(world):
        prints = [torch.tensor([7, label]) for label in labels]
        counts = {label: labels.count(label) for label in labels}
        top = max(counts.values())
        if top == world:
            expected = ([], True)
        elif 2 * top > world:  # a strict majority: the others are outside it
            common = next(label for label, n in counts.items() if n == top)
            expected = ([r for r, label in enumerate(labels) if label != common], True)
        else:  # no strict majority (two replicas that differ included): detected, not localized
            expected = (list(range(world)), False)
        assert sdc.majority_outliers(prints) == expected, labels


# --- the drills' records, recomputed from their own events -------------------------------------

def _recomputed(events: list[dict], injected: int | None, step0: int | None) -> dict:
    """A drill record's verdict columns from its alarms, by the README's words: the first alarm at or after
    the injection step is the detection; false alarms are any in ``clean``, and otherwise those before the
    injection, not naming the faulty rank, or localized to a healthy rank too."""
    hits = [e for e in events if injected is not None and e["step"] >= step0]
    first = hits[0] if hits else None

    def false(e):
        return (injected is None or e["step"] < step0 or injected not in e["suspect_ranks"]
                or (e["localized"] and e["suspect_ranks"] != [injected]))

    return {"detected": first is not None, "check": first["check"] if first else None,
            "detection_step": first["step"] if first else None,
            "latency_steps": first["step"] - step0 if first else None,
            "suspect_ranks": first["suspect_ranks"] if first else [],
            "localized": first["localized"] if first else None,
            "right_rank": first is not None and first["suspect_ranks"] == [injected],
            "false_alarms": sum(map(false, events))}


def test_drill_records_match_their_events_and_the_documented_first_check(digits, tmp_path, capsys):  # noqa: F811
    from peat.sdc_drill import launch
    from test_sdc import make_config

    # Injected at step 1, audited at steps 0 and 2: the lane fault is found one step late, the transient never.
    config = make_config(drills=["clean", "nan_grad", "lane_fault", "weight_flip", "transient"], steps=3,
                         injection_step=1, audit_every=2)
    out = tmp_path / "resnet18"
    launch(config, "resnet18", digits, out, timeout=300)
    log = capsys.readouterr().out
    expected = {"clean": None, "nan_grad": ("nonfinite", 1), "lane_fault": ("audit", 2),
                "weight_flip": ("fingerprint", 1), "transient": None}
    # What the ranks printed, in drill order: each alarm once, by the rank that wrote it to the events.
    printed = [[int(step), check, json.loads(f"[{ranks}]"), where == "localized"] for step, check, ranks, where in
               re.findall(r"\]: peat sdc: silent data corruption suspected at step (\d+) by check '(\w+)': "
                          r"rank\(s\) \[([\d, ]*)\] on node\(s\) .*? \((localized|NOT localized)", log)]
    logged = []
    for drill, first in expected.items():
        record = json.loads((out / f"{drill}.json").read_text())
        written = out / "events" / f"{drill}.jsonl"  # none where the drill raised no alarm
        events = [json.loads(line) for line in written.read_text().splitlines()] if written.exists() else []
        logged += [[e["step"], e["check"], e["suspect_ranks"], e["localized"]] for e in events]
        assert [{k: v for k, v in e.items() if k != "time"} for e in events] == record["alarms"], drill
        injected = None if drill == "clean" else 1
        mine = _recomputed(events, injected, None if injected is None else 1)
        assert {k: record[k] for k in mine} == mine, drill
        if first is None:
            assert not mine["detected"] and mine["false_alarms"] == 0, (drill, events)
        else:
            assert (mine["check"], mine["detection_step"], mine["suspect_ranks"], mine["right_rank"],
                    mine["false_alarms"]) == (*first, [1], True, 0), (drill, events)
    assert printed == logged


# --- the ring audit on larger rings, each rank's part played in turn ---------------------------

class _Rank(sdc.Guard):
    """One rank of a simulated ring: the guard's own ``_audit`` and ``_second_opinion``, its collectives
    answered from every rank's replays (rank r's true fingerprint: [r]; a wrong report or replay: other)."""

    def __init__(self, rank: int, world: int, wrong_report: set, wrong_replay: set):
        self.rank, self.world, self.tolerance, self.group = rank, world, 0.0, "ring"
        self.wrong_report, self.wrong_replay, self.alarms, self.spent = wrong_report, wrong_replay, [], 0.0
        self.step, self.device = 5, torch.device("cpu")

    def reported(self) -> list:
        return [torch.tensor([r + 100 * (r in self.wrong_report)]) for r in range(self.world)]

    def replayed(self, by: int, rank: int) -> torch.Tensor:
        return torch.tensor([rank + 1000 * (by in self.wrong_replay)])

    def _replay(self, replay, rank, rng):
        return self.replayed(self.rank, rank)

    def _all_gather(self, tensor, what):  # the audit verdicts of every rank
        assert what == "audit verdicts"
        reported = self.reported()
        return [torch.tensor([int(torch.equal(self.replayed(r, (r + 1) % self.world), reported[(r + 1) % self.world]))])
                for r in range(self.world)]

    def _collective(self, what, fn, same, src, group):  # the third rank's verdict, broadcast
        assert what == "audit second opinion" and group == "ring"
        audited = (src - 1) % self.world
        same[0] = int(torch.equal(self.replayed(src, audited), self.reported()[audited]))

    def _timed(self, check, seconds, same_step=False):
        pass

    def _alarm(self, check, suspects, localized, detail, step=None):
        self.alarms.append((check, suspects, localized))


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_ring_audit_names_the_faulty_rank_on_every_rank(world, monkeypatch):
    monkeypatch.setattr(sdc.dist, "get_global_rank", lambda group, rank: rank)
    for k in range(world):
        for kind, report, replay in (("report", {k}, set()), ("replay", set(), {k}), ("persistent", {k}, {k})):
            views = []
            for rank in range(world):
                me = _Rank(rank, world, report, replay)
                me._audit(None, me.reported(), [None] * world)
                views.append(me.alarms)
            assert all(view == views[0] for view in views), (kind, k, views)
            expected = ([k], True) if world >= 3 else ([0, 1], False)
            assert views[0] == [("audit", *expected)], (world, kind, k, views[0])
        for rank in range(world):  # a clean ring
            me = _Rank(rank, world, set(), set())
            me._audit(None, me.reported(), [None] * world)
            assert me.alarms == []


# --- the drills' faults are the error models' own values ----------------------------------------

@pytest.mark.parametrize("drill, spec", [("weight_flip", "bit_flip:exponent"), ("weight_flip", "bit_flip:any"),
                                         ("transient", "rv:4"), ("nan_grad", "nan:1")])
def test_drill_fault_injects_the_error_models_values_bit_for_bit(drill, spec):
    from peat import errors
    from peat.sdc_drill import Fault

    for seed in range(12):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 30))
        if drill == "nan_grad":  # one parameter whose gradient is w, -0.0 included
            model = torch.nn.Module()
            model.p = torch.nn.Parameter(torch.ones(30))
        fault = Fault(drill, model, 1, {drill: spec}, seed)
        x = torch.randn(1, 6, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        if drill == "weight_flip":
            clean = model[0].weight.detach().clone()
            fault.after_step(1)
            got = model[0].weight.detach()
        elif drill == "transient":
            with torch.no_grad():
                clean = model(x)
            fault.before(1)
            got = model(x)
            got.sum().backward()
            assert x.grad.abs().sum() > 0  # the gradient flows through the faulty output
        else:
            w = torch.randn(30, generator=torch.Generator().manual_seed(seed))
            w[::3] = -0.0
            captured = []
            model.p.register_hook(lambda g: captured.append(g) or g)  # sees the fault's output
            fault.before(1)
            (model.p * w).sum().backward()
            clean, got = w, captured[0]
        wrong = errors.parse(spec).apply(clean, errors.seeded(seed))
        assert torch.equal(got.detach().view(torch.int32), wrong.view(torch.int32)), (seed, spec)


# --- the checksum is the README's formula --------------------------------------------------------

def _readme_checksum(t: torch.Tensor) -> int:
    """Wrap-around sum of the tensor's bytes (in element order) read as 64-bit words, or as words one
    element wide where its byte count is not a multiple of 8; as a signed 64-bit integer."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    width = 8 if len(raw) % 8 == 0 else t.element_size()
    total = sum(int.from_bytes(raw[i:i + width], "little", signed=True) for i in range(0, len(raw), width))
    total %= 1 << (8 * width)
    return total - (1 << (8 * width)) if total >= 1 << (8 * width - 1) else total


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_checksum_is_the_documented_wrap_around_sum(dtype):
    g = torch.Generator().manual_seed(3)
    store = (torch.randn(301, generator=g) * 1e4).to(dtype)
    views = [store[:1], store[:3], store[:4], store[:8], store[1:5], store[3:300], store[:300].view(20, 15).t(),
             store[0], store[:0], store[1:301:2]]
    for t in views:
        expected = _readme_checksum(t)
        assert int(sdc.checksum([t])[0]) == expected, (dtype, t.shape, t.stride(), t.storage_offset())
        assert int(sdc.checksum([t.clone()])[0]) == expected  # the same values laid out anew: the same sum


# --- policy stop: who writes, who saves, who drains, how every rank exits ------------------------

class _Stopping(sdc.Guard):
    """One rank of a simulated group under policy stop, each rank on a node of its own (n0, n1, ...)."""

    def __init__(self, rank: int, world: int, folder, saved: list):
        self.rank, self.world, self.group, self.policy, self.alarms = rank, world, "group", "stop", []
        self.hosts = [f"n{r}" for r in range(world)]
        self.events, self.checkpoint = folder / "events.jsonl", folder / "stop.pt"
        self.save = lambda path: saved.append((rank, path))
        self._marker = folder / f"drain-{self.hosts[rank]}.json"
        self.step = 7

    def _collective(self, what, fn, out, mine, group):  # every rank's part of the stop went well
        assert what == "stop"
        out[:] = [None] * self.world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_policy_stop_acts_on_every_rank_as_documented(world, tmp_path, capsys):
    cases = [([k], True) for k in range(world)] + [(list(range(world)), False)]
    if world == 4:
        cases.append(([0, 1, 2], False))  # an audit whose failures have no common rank
    for n, (suspects, localized) in enumerate(cases):
        folder, saved = tmp_path / str(n), []
        folder.mkdir()
        codes = []
        for rank in range(world):
            me = _Stopping(rank, world, folder, saved)
            with pytest.raises(SystemExit) as stop:
                me._alarm("audit", suspects, localized, {})
            codes.append(stop.value.code)
        err = capsys.readouterr().err
        healthy = [r for r in range(world) if r not in suspects]
        writer = min(healthy, default=0)  # the lowest healthy rank; rank 0 when none is known healthy
        (event,) = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
        assert (event["suspect_ranks"], event["localized"], event["hosts"]) == (
            suspects, localized, [f"n{r}" for r in suspects])
        assert saved == [(writer, folder / "stop.pt")]
        drained = sorted(p.name for p in folder.glob("drain-*.json"))
        assert drained == ([f"drain-n{r}.json" for r in suspects] if localized else [])
        code = sdc.EXIT_SDC if localized else sdc.EXIT_SDC_UNLOCALIZED
        assert codes == [code] * world
        advice = (f"drain node(s) {', '.join(f'n{r}' for r in suspects)} and requeue" if localized
                  else "a human must read the events; do not requeue")
        assert err.count("peat sdc: stopping; ") == world and err.count(advice) == world
        assert err.count("peat sdc: silent data corruption suspected at step 7") == 1
