"""SDC checks: fingerprint / majority / ring logic, and real multi-process drills (torchrun and srun-style)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch

from peat import sdc
from peat.config import validate
from peat.data import prepare
from peat.io import PeatError, write_json
from conftest import TEST_CONFIG, needs_gpu, snakemake
from peat.sdc_drill import (EXIT_OOM, EXIT_PEER, PEER_FAILED, RankEnd, check_config, drill_config, drill_end, launch,
                             validated)

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


# --- pure logic ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n, offset", [(1001, 0), (1000, 0), (1000, 1)])  # element-wide words; 64-bit words; unaligned view
def test_checksum_catches_every_single_bit_flip(dtype, n, offset):
    store = torch.randn(n + offset, generator=torch.Generator().manual_seed(0)).to(dtype)
    t = store[offset:]
    base = sdc.checksum([t])
    bits = 8 * t.element_size()
    for bit in range(bits):
        for where in (0, bit * 7 % n, n - 1):
            flipped = store.clone()
            as_int = flipped.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            as_int[offset + where] ^= (1 << bit) if bit < bits - 1 else -(1 << bit)
            assert not torch.equal(sdc.checksum([flipped[offset:]]), base), f"bit {bit} of element {where} missed"
    assert torch.equal(sdc.checksum([t.clone()]), base)


@pytest.mark.parametrize("fresh", [lambda: False,  # CPU: a Python bool
                                   lambda: []])  # the GPU path (device sums), run on CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_local_nonfinite_gradient_is_marked_at_its_first_element(fresh, dtype):
    def mark(grad, bad=None):
        bad = fresh() if bad is None else bad
        return sdc._mark_nonfinite_host(grad, bad) if isinstance(bad, bool) else [*bad, sdc._mark_nonfinite_on_device(grad)]

    finite = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    finite[0, 0] = -0.0  # a healthy gradient keeps every bit, the sign of a zero too
    g = finite.clone()
    assert not sdc._flagged(mark(g)) and torch.equal(g.view(torch.int8), finite.view(torch.int8))
    top = torch.finfo(dtype).max
    overflow = torch.full((3, 3), top, dtype=dtype)  # finite values whose sum overflows: not flagged
    assert not sdc._flagged(mark(overflow)) and torch.equal(overflow, torch.full((3, 3), top, dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = finite.clone()
        g[3, 2] = bad
        assert sdc._flagged(mark(g))
        expected = finite.clone()
        expected[3, 2], expected[0, 0] = bad, float("nan")
        torch.testing.assert_close(g, expected, rtol=0, atol=0, equal_nan=True)
    flag = mark(finite.clone() * float("nan"))  # the step's flag stays set by a later healthy one
    assert sdc._flagged(mark(finite.clone(), flag))


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group in this process (DDP and the guard's hooks without torchrun)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def healthy_step(guard, model, x, step: int) -> None:
    """One guarded step of a one-rank model on ``x`` (loss: the output's sum) that every check passes."""
    guard.begin_step(step)
    model.zero_grad(set_to_none=True)
    guard.ddp(x).sum().backward()
    assert guard.check_gradients(replay=lambda r: guard.module(x).sum())
    guard.check_weights()


def _guarded_step(after_check=None, **guard_options):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    guard = sdc.Guard(DistributedDataParallel(model), **{"policy": "log", **guard_options})
    if after_check is not None:  # runs after the guard's own check, before the all-reduce
        model[0].weight.register_post_accumulate_grad_hook(after_check)
    guard.begin_step(0)
    model.zero_grad(set_to_none=True)
    guard.ddp(torch.randn(5, 4)).sum().backward()
    return guard, guard.check_gradients()


def test_guard_flags_only_nonfinite_steps_and_exchanges_no_flags_otherwise(one_rank, monkeypatch):
    gathers = []
    monkeypatch.setattr(sdc.Guard, "_all_gather", lambda self, t, what: gathers.append(what) or [t])
    guard, ok = _guarded_step()
    assert ok and guard.alarms == [] and gathers == []  # healthy step: no extra collective
    guard, ok = _guarded_step(_overflow_in_the_sum)
    # Only the reduced gradient is non-finite: the flags are exchanged, no rank is to blame.
    assert not ok and gathers == ["gradient flags"]
    (alarm,) = guard.alarms
    assert alarm.check == "nonfinite" and alarm.localized is False and alarm.detail["flags"] == [0]


def _fused_or_not_step(fused: bool, layers: int = 2, nan_at: int | None = None, steps: int = 3, audit_every: int = 0,
                       guard: bool = True, keep: bool = True, dtype: torch.dtype = torch.float32, ddp_options=None):
    """A few guarded steps of a stack of linear layers; per step: healthy, its gradients (copies:
    ``keep``), its audit report. ``guard`` False: the same DDP steps unguarded (with the comm hook
    a fused guard would add)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).to(dtype)
    ddp = DistributedDataParallel(model, **(ddp_options or {}))
    if guard:
        guard = sdc.Guard(ddp, policy="log", fused=fused, audit_every=audit_every)
    elif fused:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    out = []
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step)).to(dtype)
        if step == nan_at:
            x[0, 0] = float("nan")
        if guard:
            guard.begin_step(step)
        model.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        if not guard:
            continue
        healthy = guard.check_gradients(replay=lambda r: guard.module(x).sum())
        reported = guard._reported_fingerprint() if guard._auditing else None
        out.append((healthy, [p.grad.clone() for p in model.parameters()] if keep else None, reported))
        guard.check_weights()
    if guard:
        guard.finish()
    return out, guard


@pytest.mark.parametrize("dtype, ddp_options", [
    (torch.float32, {}),
    (torch.bfloat16, {}),  # every reduced element read
    (torch.float32, {"bucket_cap_mb": 1e-4, "gradient_as_bucket_view": True}),  # a bucket each, rebuilt after step 0
    (torch.float32, {"static_graph": True}),  # step 0's buckets reduced at the end of its backward
])
def test_fused_checks_give_the_gradients_verdicts_and_audit_reports_of_the_per_parameter_ones(one_rank, dtype,
                                                                                           ddp_options):
    for nan_at in (None, 1):
        (apart, by_param), (fused, by_bucket) = (_fused_or_not_step(f, nan_at=nan_at, audit_every=1, dtype=dtype,
                                                                    ddp_options=ddp_options) for f in (False, True))
        assert (by_param.fused, by_bucket.fused) == (False, True)
        for (ok_a, grads_a, report_a), (ok_f, grads_f, report_f) in zip(apart, fused):
            assert ok_a == ok_f
            # A skipped step's gradients are garbage, marked in other places: only healthy ones must agree.
            assert not ok_a or all(torch.equal(a, f) for a, f in zip(grads_a, grads_f))
            assert (report_a is None) == (report_f is None) and (report_a is None or torch.equal(report_a, report_f))
        assert [(e.step, e.check) for e in by_param.alarms] == [(e.step, e.check) for e in by_bucket.alarms]
        assert [ok for ok, _, _ in fused] == [nan_at != step for step in range(3)]


def _dispatched(fn) -> int:
    """The aten ops ``fn`` runs that compute (views aside): on a GPU, about its kernel launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not func.is_view
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_fused_checks_cost_as_many_ops_whatever_the_parameter_count(one_rank):
    # On a GPU a small model's step is bound by kernel launches: per parameter, the gradient hooks
    # launched two and the weight checksums one (H200: the checks added 27-47 % to a step).
    def added(fused: bool, layers: int, dtype=torch.float32) -> int:
        # Three steady steps (the first is DDP's bucket rebuild; setup aside), less the same without the guard.
        def steady(guard: bool) -> int:
            return (_dispatched(lambda: _fused_or_not_step(fused, layers, steps=4, guard=guard, keep=False, dtype=dtype))
                    - _dispatched(lambda: _fused_or_not_step(fused, layers, steps=1, guard=guard, keep=False, dtype=dtype)))
        return steady(True) - steady(False)

    assert added(True, 16) == added(True, 2)
    assert added(False, 16) - added(False, 2) >= 3 * 3 * 2 * 14  # 3 steps x 3 ops x 28 more parameters
    # bfloat16 gradients may overflow the all-reduce: every reduced element is read, per bucket when fused.
    assert added(True, 16, torch.bfloat16) == added(True, 2, torch.bfloat16)


def test_group_checksums_catch_every_single_bit_flip(monkeypatch):
    monkeypatch.setattr(sdc.tensor_stats, "BATCH_ELEMENTS", 50)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g).double(), torch.randn(40, generator=g),
               torch.randn(9, generator=g).bfloat16(), torch.randn(60, generator=g)]
    base = sdc.group_checksums(tensors)
    # Consecutive tensors of alike words (int64 where their bytes allow, as checksum's), up to 50 elements
    # (a larger one alone): the float64 vector and the 40 float32 share 64-bit words and a group.
    assert len(base) == 4 and sdc.group_checksums([tensors[0], tensors[2][:15]]).numel() == 1
    for i, t in enumerate(tensors):
        words = t.view(sdc._INT_OF_SIZE[t.element_size()]).view(-1)
        for bit in range(8 * t.element_size()):
            flipped = [u.clone() for u in tensors]
            flipped[i].view(words.dtype).view(-1)[bit % t.numel()] ^= torch.tensor(1, dtype=words.dtype) << bit
            assert not torch.equal(sdc.group_checksums(flipped), base), (i, bit)
    assert sdc.group_checksums([]).numel() == 0


def test_fused_is_refused_in_one_line_where_ddp_has_a_comm_hook_or_sparse_gradients(one_rank):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(PeatError, match=r"^sdc\.Guard: fused=True needs DDP's comm hook, but the DDP model has a comm "
                                        r"hook already: pass fused=False$"):
        sdc.Guard(ddp, fused=True)
    assert sdc.Guard(ddp).fused is False
    sparse = DistributedDataParallel(torch.nn.Embedding(10, 3, sparse=True))
    with pytest.raises(PeatError, match=r"but the model has sparse gradients: pass fused=False$"):
        sdc.Guard(sparse, fused=True)
    # Reduced outside DDP's buckets, after the comm hook: a NaN in one rank's reached every replica unseen.
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    delayed = DistributedDataParallel(model, delay_all_reduce_named_params=list(model[1].named_parameters("1")),
                                      param_to_hook_all_reduce=model[0].weight)
    with pytest.raises(PeatError, match=r"but DDP reduces trainable parameters outside its buckets \(1\.weight, "
                                        r"1\.bias\): pass fused=False$"):
        sdc.Guard(delayed, fused=True)


def test_a_comm_hook_registered_after_a_fused_guard_is_one_line(one_rank):
    # DDP takes one comm hook, the fused guard's: a user's registered after it failed with DDP's 'register_comm_hook
    # or register_builtin_comm_hook can only be called once', which names no guard (the default on a GPU).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    sdc.Guard(ddp, fused=True)
    taken = (r"^sdc\.Guard: the guard's fused checks hold DDP's comm hook, which DDP takes once: register yours before "
             r"building the guard \(it then checks per parameter\), or build the guard with fused=False$")
    with pytest.raises(PeatError, match=taken):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(PeatError, match=taken):
        ddp._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.FP16_COMPRESS)
    plain = DistributedDataParallel(torch.nn.Linear(4, 2))
    assert sdc.Guard(plain, fused=False).fused is False
    plain.register_comm_hook(None, default_hooks.allreduce_hook)  # per parameter: the comm hook stays the user's


# Three steps of one model with each DDP setting, guarded fused and plain; prints the settings whose
# reduced gradients differ from plain DDP's.
FUSED_MEAN = """
import json
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from peat import sdc

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
settings = [{}, {"gradient_as_bucket_view": True}, {"batched_grad_copy": True}]


class Net(torch.nn.Sequential):
    def forward(self, x, last=True):
        return super().forward(x) if last else self[:-1](x)


differ = []
for setting in settings:
    runs = []
    for guarded in (True, False):
        torch.manual_seed(0)
        model = Net(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        ddp = DistributedDataParallel(model, find_unused_parameters=True, **setting)
        guard = sdc.Guard(ddp, fused=True) if guarded else None
        grads = []
        for step in range(3):
            guard and guard.begin_step(step)
            model.zero_grad(set_to_none=False)  # .grad kept: DDP accumulates it in its bucket view
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            # The last layer unused at step 0: with .grad kept, one bucket holds both kinds of gradient.
            ddp(x, last=step > 0).square().mean().backward()
            if guard:
                assert guard.check_gradients()
                guard.check_weights()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        guard and guard.finish()
        runs.append(grads)
    fused, plain = runs
    if not all(torch.equal(f, p) for fs, ps in zip(fused, plain) for f, p in zip(fs, ps)):
        differ.append(setting)
if rank == 0:
    print("DIFFER", json.dumps(differ))
dist.destroy_process_group()
"""


def _torchrun(script: Path, world: int, *args: str) -> subprocess.CompletedProcess:
    """``script`` under torchrun with ``world`` local ranks (one torch thread each); asserts it succeeded."""
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(world),
                           str(script), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_fused_mean_is_ddps_own_bit_for_bit_with_its_settings(tmp_path):
    # With three ranks x / 3 and x * (1 / 3) round apart: DDP divides a gradient accumulated in its
    # bucket view (gradient_as_bucket_view, .grad kept), and a whole bucket with batched_grad_copy;
    # the guard's hook multiplied every bucket by the reciprocal.
    script = tmp_path / "mean.py"
    script.write_text(FUSED_MEAN)
    proc = _torchrun(script, 3)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("DIFFER ")]
    assert json.loads(line[len("DIFFER "):]) == []


@needs_gpu
def test_check_costs_on_a_gpu_leave_out_the_wait_for_the_backward(tmp_path):
    # Work is queued on a GPU: the checks' first reads waited for the step's backward, and their
    # timers counted it (the fingerprint's, resolved in the next step's check, too).
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
        guard = sdc.Guard(DistributedDataParallel(model, device_ids=[0]), policy="raise")
        x = torch.randn(4096, 4096, device="cuda")
        steps = []
        for step in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            guard.begin_step(step)
            model.zero_grad(set_to_none=True)
            guard.ddp(x).square().mean().backward()  # about 1.6 TFLOP queued
            assert guard.check_gradients()
            guard.check_weights()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
        guard.finish()
        step_s, costs = sorted(steps)[len(steps) // 2], guard.costs()
        assert costs["nonfinite"] < 0.2 * step_s and costs["fingerprint"] < 0.2 * step_s, (costs, steps)
    finally:
        dist.destroy_process_group()


def _overflow_in_the_sum(param):
    # After the guard's local check: as if the all-reduce's sum overflowed there.
    param.grad.view(-1)[0] = float("inf")


def test_unlocalized_stop_exits_with_its_own_code_and_drains_nothing(one_rank, tmp_path, capsys):
    # It exited 75 like a localized stop: the README's batch script requeued a diverging run forever.
    saved = []
    with pytest.raises(SystemExit) as stop:
        _guarded_step(_overflow_in_the_sum, policy="stop", save=saved.append, checkpoint=tmp_path / "stop.pt",
                      drain_marker=str(tmp_path / "drain-{node}.json"))
    assert stop.value.code == sdc.EXIT_SDC_UNLOCALIZED == 65
    assert saved == [tmp_path / "stop.pt"] and list(tmp_path.glob("drain-*")) == []
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"peat sdc: stopping; no faulty node localized among {sdc.node_name()}: a human must read the events; "
        "do not requeue (exit code 65)")


def test_one_rank_with_a_nonfinite_gradient_is_not_localized(one_rank):
    # It was counted as localized: policy stop drained the node and requeued a diverging run. With no
    # peer, a faulty device and a diverged run look the same.
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    model[2].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("inf")))
    guard = sdc.Guard(DistributedDataParallel(model), policy="log")
    guard.begin_step(3)
    guard.ddp(torch.randn(5, 4)).sum().backward()
    assert guard.check_gradients() is False
    (alarm,) = guard.alarms
    assert (alarm.step, alarm.check, alarm.suspect_ranks, alarm.localized) == (3, "nonfinite", [0], False)
    assert alarm.detail["note"] == "one rank: no peer to tell a faulty device from a diverged run or bad data"


def test_majority_outliers():
    a, b, c = torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([4, 2])
    assert sdc.majority_outliers([a, a, a]) == ([], True)
    assert sdc.majority_outliers([a, b, a]) == ([1], True)
    assert sdc.majority_outliers([a, b, a, a, b]) == ([1, 4], True)
    assert sdc.majority_outliers([a, b]) == ([0, 1], False)  # two replicas: cannot localize
    assert sdc.majority_outliers([a, b, c]) == ([0, 1, 2], False)
    assert sdc.majority_outliers([a, a, b, b]) == ([0, 1, 2, 3], False)


@pytest.mark.parametrize("world", [3, 4, 5, 8])
def test_ring_localizes_a_persistent_fault(world):
    for k in range(world):
        failed = [((k - 1) % world, k), (k, (k + 1) % world)]
        assert sdc.ring_suspects(failed, world) == ([k], True)
    assert sdc.ring_suspects([], world) == ([], True)


def test_ring_cannot_localize_with_two_ranks_or_disjoint_failures():
    assert sdc.ring_suspects([(0, 1), (1, 0)], 2) == ([0, 1], False)
    assert sdc.ring_suspects([(0, 1)], 2) == ([0, 1], False)
    assert sdc.ring_suspects([(0, 1), (2, 3)], 5) == ([0, 1, 2, 3], False)
    # Every audit failed (e.g. diverged replicas everywhere): no common rank.
    assert sdc.ring_suspects([(0, 1), (1, 2), (2, 0)], 3) == ([0, 1, 2], False)


def test_shards_partition_the_global_batch():
    for n in (3, 10, 11, 32):
        for world in (2, 3, 4):
            if n < world:
                continue
            idx = list(range(100, 100 + n))
            parts = [sdc.shard(idx, r, world) for r in range(world)]
            assert sum(parts, []) == idx
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_fingerprint_tolerance():
    g = [torch.randn(50, generator=torch.Generator().manual_seed(1))]
    exact = sdc.gradient_fingerprint(g)
    other = sdc.gradient_fingerprint([g[0] * (1 + 1e-6)])
    assert sdc.fingerprints_match(exact, exact.clone())
    assert not sdc.fingerprints_match(exact, other)  # bit-exact by default
    assert sdc.fingerprints_match(exact, other, tolerance=1e-4)
    assert not sdc.fingerprints_match(exact, sdc.gradient_fingerprint([g[0] * 1.01]), tolerance=1e-4)
    # The tolerance is on the norm (here 1e-6 apart), not on the sum of squares (2e-6 apart).
    assert sdc.fingerprints_match(exact, other, tolerance=1.5e-6)
    assert not sdc.fingerprints_match(exact, other, tolerance=0.5e-6)


# --- config -------------------------------------------------------------------------------------

def make_config(**sdc_cfg) -> dict:
    config = raw_config(**sdc_cfg)
    validate(config, SCHEMA)
    check_config(config)
    return config


def raw_config(**sdc_cfg) -> dict:
    """A config as yaml.safe_load gives it: no defaults filled in."""
    return {
        "name": "sdc_test", "seed": 0, "threads": 1, "vendors": ["cpu"],
        "datasets": {"digits": {"source": "digits", "image_size": 8, "val_fraction": 0.2}},
        "models": {"resnet18": {"arch": "resnet18", "dataset": "digits", "epochs": 1, "batch_size": 12,
                                "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                                "record": {"layers": ["fc"]}}},
        "sdc": {"models": ["resnet18"], "steps": 5, "audit_every": 2, "injection_step": 2, "timeout_s": 20,
                **sdc_cfg},
    }


@pytest.mark.parametrize("bad, message", [
    ({"injected_rank": 3}, "config key 'sdc.injected_rank': 3 is not below sdc.world_size (3)"),
    ({"injection_step": 5}, "config key 'sdc.injection_step': 5 is not below sdc.steps (5)"),
    ({"models": ["nope"]}, "config key 'sdc.models': unknown model 'nope'; defined: resnet18"),
    ({"faults": {"lane_fault": "lane:x"}}, "config key 'sdc.faults.lane_fault': error spec 'lane:x': not understood; "
                                           "e.g. fp16, bf16, tf32, fp64, rv:3, rz:1, bit_flip:exponent, "
                                           "bit_flip:30x2:4, lane:16, lane:8:stuck:row, tile:16:splitk, nan:1, inf:1"),
    ({"drills": ["melt"]}, "config key 'sdc.drills.0': 'melt' is not allowed; "
                           "allowed: clean, nan_grad, lane_fault, weight_flip, transient, dead, hang"),
    ({"policy": "panic"}, "config key 'sdc.policy': 'panic' is not allowed; allowed: log, raise, stop"),
    # YAML's .inf and .nan pass the schema: every rank died converting the timeout (OverflowError, ValueError).
    ({"timeout_s": float("inf")}, "config key 'sdc.timeout_s': inf: every collective needs a finite timeout in seconds"),
    ({"timeout_s": float("nan")}, "config key 'sdc.timeout_s': nan: every collective needs a finite timeout in seconds"),
    ({"audit_tolerance": float("nan")}, "config key 'sdc.audit_tolerance': nan: a relative tolerance needs a finite "
                                        "number >= 0 (0 = bit-exact)"),
    # The Trainer refused it only after torchrun had started every rank.
    ({"batch_size": 2000}, "config key 'sdc.batch_size': 2000 is not between sdc.world_size (3) and the "
                           "1438 training examples of dataset 'digits' (model 'resnet18')"),
])
def test_config_errors_name_the_key(bad, message):
    with pytest.raises(PeatError) as err:
        make_config(**bad)
    assert str(err.value) == message


def test_drill_params_hold_only_what_the_drills_read():
    """The drills' params held the config's name, which only names the report, the keys that
    only shape golden training and the vendors: a renamed copy of a config, a new record.every or
    another GPU vendor reran every drill (torchrun, one process per rank)."""
    config = make_config()
    model = config["models"]["resnet18"]
    edited = {**config, "name": "mine", "vendors": ["cpu", "nvidia"], "reference_vendor": "nvidia", "models": {"resnet18": {
        **model, "epochs": 3, "checkpoint_epochs": [3], "record": {"layers": ["conv1"], "every": 2},
        "max_train_samples": 100, "max_val_samples": 50}}}
    assert drill_config(edited, "resnet18") == drill_config(config, "resnet18")
    for changed in ({"batch_size": 6}, {"optimizer": {"name": "sgd", "lr": 0.1}}):
        assert drill_config({**config, "models": {"resnet18": {**model, **changed}}}, "resnet18") != \
            drill_config(config, "resnet18")
    validated(drill_config(edited, "resnet18"))  # what the ranks load



def test_drill_params_leave_out_the_bench_and_the_faults_of_drills_not_run():
    """The drills' params held the whole sdc section: a new sdc.bench_steps (read by --bench only),
    or the fault of a drill not in sdc.drills, reran every drill (torchrun, one process per rank)."""
    config = make_config(drills=["clean", "nan_grad"])
    params = drill_config(config, "resnet18")
    faults = config["sdc"]["faults"]
    for edit in ({"bench_steps": 40}, {"faults": faults | {"transient": "rv:2"}}):
        assert drill_config({**config, "sdc": config["sdc"] | edit}, "resnet18") == params, edit
    for edit in ({"steps": 6}, {"faults": faults | {"nan_grad": "inf:1"}}, {"drills": ["clean"]}):
        assert drill_config({**config, "sdc": config["sdc"] | edit}, "resnet18") != params, edit
    assert params["sdc"]["faults"] == {"nan_grad": "nan:1"}
    validated(params)  # what the ranks load

# --- real multi-process runs --------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "digits.h5"
    prepare("digits", {"source": "digits", "image_size": 8, "val_fraction": 0.2, "labels": "class", "seed": 0}, path)
    return path


@pytest.fixture(scope="module")
def drills(digits, tmp_path_factory) -> dict:
    """All five drills, one torchrun launch of 3 gloo ranks (resnet18: BatchNorm buffers, convs).

    A module fixture runs once per xdist worker: its users share the group "drills", so one worker."""
    out = tmp_path_factory.mktemp("sdc") / "resnet18"
    launch(make_config(), "resnet18", digits, out, timeout=300)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")} | {"_dir": out}


@pytest.fixture(scope="module")
def fused_drills(digits, tmp_path_factory) -> dict:
    """The same drills with the guard's fused checks (comm hook, grouped checksums): a GPU's default."""
    out = tmp_path_factory.mktemp("sdc_fused") / "resnet18"
    launch(make_config(fused=True), "resnet18", digits, out, timeout=300)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.xdist_group("drills")
def test_fused_checks_raise_the_alarms_of_the_per_parameter_ones(drills, fused_drills):
    def alarms(result):
        return [{k: v for k, v in a.items() if k != "time"} for a in result["alarms"]]

    assert set(fused_drills) == set(drills) - {"_dir"}
    for drill, result in fused_drills.items():
        assert result["fused"] is True and drills[drill]["fused"] is None
        assert alarms(result) == alarms(drills[drill]), drill
        assert result["false_alarms"] == 0 and result["detected"] is (drill != "clean")
    # The grouped checksums say which ranks differ; each tensor's, gathered after, which parameter.
    flip = next(a for a in fused_drills["weight_flip"]["alarms"] if a["check"] == "fingerprint")
    assert flip["step"] == 2 and flip["suspect_ranks"] == [1] and flip["detail"]["first_differing_parameter"]


@pytest.mark.xdist_group("drills")
def test_clean_run_has_no_alarm(drills):
    clean = drills["clean"]
    assert clean["injected_rank"] is None and clean["world_size"] == 3 and clean["backend"] == "gloo"
    assert clean["detected"] is False and clean["alarms"] == [] and clean["false_alarms"] == 0
    assert not (drills["_dir"] / "events" / "clean.jsonl").exists()
    cost = clean["cost"]
    assert cost["plain_step_s"] > 0 and len(cost["relative"]) == 3
    assert all(v > 0 for v in cost["relative"].values())


@pytest.mark.xdist_group("drills")
@pytest.mark.parametrize("drill, check, latency", [
    ("nan_grad", "nonfinite", 0),
    ("lane_fault", "audit", 0),       # injected at step 2, an audit step
    ("weight_flip", "fingerprint", 0),
    ("transient", "audit", 0),        # one failed audit, settled by a third rank's replay
])
def test_fault_is_detected_on_the_right_rank(drills, drill, check, latency):
    result = drills[drill]
    assert result["drill"] == drill and result["injected_rank"] == 1 and result["injection_step"] == 2
    assert result["detected"] is True
    assert result["check"] == check
    assert result["latency_steps"] == latency and result["detection_step"] == 2
    assert result["suspect_ranks"] == [1] and result["right_rank"] is True and result["localized"] is True
    assert result["false_alarms"] == 0
    lines = (drills["_dir"] / "events" / f"{drill}.jsonl").read_text().splitlines()
    assert len(lines) == len(result["alarms"]) >= 1
    assert json.loads(lines[0])["suspect_ranks"] == [1]


@pytest.mark.xdist_group("drills")
def test_persistent_lane_fault_fails_two_audits_every_time(drills):
    audits = [a for a in drills["lane_fault"]["alarms"] if a["check"] == "audit"]
    assert [a["step"] for a in audits] == [2, 4]
    assert all(a["detail"]["failed_audits"] == [[0, 1], [1, 2]] for a in audits)
    # The faulty rank still shares averaged gradients: the replicas stay identical.
    assert all(a["check"] == "audit" for a in drills["lane_fault"]["alarms"])


@pytest.mark.xdist_group("drills")
def test_transient_fault_is_seen_once(drills):
    (alarm,) = drills["transient"]["alarms"]
    assert alarm["detail"]["failed_audits"] == [[0, 1]] and "rerun" in alarm["detail"]


def _srun_like(script_args: list[str], world: int, tmp: Path, timeout: float,
               stalled: int | None = None, entry: tuple[str, ...] = ("-m", "peat.sdc_drill")) -> list[subprocess.CompletedProcess]:
    """Start ``world`` ranks of ``python *entry *script_args`` the way srun does (SLURM_* variables,
    one node name per rank).

    The ``stalled`` rank is waited for last and killed once the others have ended.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID="0", SLURMD_NODENAME=f"node{rank}",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *entry, *script_args], env=env, cwd=tmp,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    done = {}
    deadline = time.monotonic() + timeout
    for rank in sorted(range(world), key=lambda r: r == stalled):
        p = procs[rank]
        if rank == stalled:
            p.kill()
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        done[rank] = subprocess.CompletedProcess(p.args, p.returncode, out)
    return [done[r] for r in range(world)]


def _config_file(tmp: Path, **sdc_cfg) -> Path:
    path = tmp / "config.json"
    write_json(path, make_config(**sdc_cfg))
    return path


def test_stop_policy_exits_with_the_sdc_code_and_names_the_node(digits, tmp_path):
    config = _config_file(tmp_path, policy="stop", drills=["lane_fault"], drain_marker=str(tmp_path / "drain-{node}.json"))
    ranks = _srun_like(["--config", str(config), "--model", "resnet18", "--data", str(digits), "--out", str(tmp_path / "out")],
                       3, tmp_path, timeout=300)
    assert [r.returncode for r in ranks] == [sdc.EXIT_SDC] * 3, ranks[0].stdout[-2000:]
    assert "drain node(s) node1" in ranks[0].stdout
    assert [p.name for p in tmp_path.glob("drain-*.json")] == ["drain-node1.json"]
    event = json.loads((tmp_path / "drain-node1.json").read_text())
    assert event["suspect_ranks"] == [1] and event["hosts"] == ["node1"] and event["step"] == 2
    with h5py.File(tmp_path / "out" / "lane_fault.stop.h5") as saved:  # peat checkpoint from a healthy rank
        assert saved.attrs["step"] == 2 and saved.attrs["sdc_drill"] == "lane_fault" and "model/conv1.weight" in saved
    recorded = json.loads((tmp_path / "out" / "lane_fault.json").read_text())  # by rank 0, before it exits
    assert (recorded["outcome"], recorded["exit_code"], recorded["suspect_ranks"]) == ("stopped", sdc.EXIT_SDC, [1])



# Policy stop in a loop that goes on after an error (it logs it, cleans up): the healthy rank's save raises.
SAVE_RAISES_IN_A_LOOP = """
import json, os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from peat import sdc

out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
if rank == 1:  # a NaN in rank 1's local gradient: a localized alarm, rank 0 saves
    model.bias.register_hook(lambda g: g * float("nan"))

def save(path):
    raise OSError(28, "No space left on device")

guard = sdc.Guard(DistributedDataParallel(model), policy="stop", save=save, checkpoint=out / "stop.pt")
guard.begin_step(0)
guard.ddp(torch.ones(3, 4)).sum().backward()
start = time.monotonic()
try:
    guard.check_gradients()
except Exception as err:
    (out / f"rank{rank}.json").write_text(json.dumps([type(err).__name__, str(err), time.monotonic() - start]))
while time.monotonic() - start < 40 and not all((out / f"rank{r}.json").exists() for r in range(3)):
    time.sleep(0.2)  # every rank stays up (its process group too) until each has said how it ended
os._exit(0)  # past gloo's teardown, which aborted a rank whose peers had gone (SIGABRT, 1 fresh-clone CI in 3)
"""


def test_a_save_that_raises_at_a_stop_reaches_every_rank_at_once(tmp_path):
    # The saving rank raised the save's error alone; its peers waited for it in the stop's barrier until the
    # process group's timeout (30 s here), then failed as if a rank had died or hung.
    script = tmp_path / "stop.py"
    script.write_text(SAVE_RAISES_IN_A_LOOP)
    _torchrun(script, 3, str(tmp_path))
    ends = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    saving = f"saving the checkpoint {tmp_path / 'stop.pt'} failed (OSError: [Errno 28] No space left on device)"
    assert [end[:2] for end in ends] == [["StopFailed", f"rank 0: policy stop at step 0: {saving}"]] + [
        ["StopFailed", f"rank {r}: policy stop at step 0: rank 0 on node {sdc.node_name()} failed "
                       f"{saving.replace(' failed (', ' (')}"] for r in (1, 2)]
    assert max(end[2] for end in ends) < 10  # seconds: at once, not at the timeout

# The drill worker, the disk full when a stop saves its checkpoint.
SAVE_FAILS = """
import errno, os, sys
from peat import checkpoint, sdc_drill

def full(path, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
checkpoint.save = full
sys.exit(sdc_drill.main())
"""


def test_a_save_that_fails_at_a_stop_fails_every_rank_at_once(digits, tmp_path):
    # The saving rank ended in the save's traceback, and its peers failed as if it had died ("collective 'stop'
    # failed: a peer rank died or hung"): the one line the launcher shows named no failed save.
    config = _config_file(tmp_path, policy="stop", drills=["nan_grad"], steps=2, injection_step=1, timeout_s=40)
    out = tmp_path / "out"
    ranks = _srun_like(["--config", str(config), "--model", "resnet18", "--data", str(digits), "--out", str(out)],
                       3, tmp_path, timeout=300, entry=("-c", SAVE_FAILS))
    assert [r.returncode for r in ranks] == [1, EXIT_PEER, EXIT_PEER], ranks[0].stdout[-2000:]
    saving = f"saving the checkpoint {out / 'nan_grad.stop.h5'}"
    why = f"OSError: [Errno 28] No space left on device: '{out / 'nan_grad.stop.h5'}'"
    assert ranks[0].stdout.splitlines()[-1] == f"peat sdc drill: error: rank 0: policy stop at step 1: {saving} failed ({why})"
    for rank in (1, 2):
        assert ranks[rank].stdout.splitlines()[-1] == (f"peat sdc drill: error: rank {rank}: policy stop at step 1: "
                                                       f"rank 0 on node node0 failed {saving} ({why})")

def test_sdc_rule_records_the_documented_ends_of_stop_dead_and_hang(tmp_path):
    # The rule failed on each: torchrun exited 1 when a rank exited 75 or 13, and it killed the
    # peers of a dead rank before they could report it. The ends are the documented ones: the rule
    # succeeds and each drill's JSON records its end. As a user runs it: the test config, one overlay.
    extra = tmp_path / "sdc.yaml"
    extra.write_text("sdc: {policy: stop, drills: [nan_grad, dead, hang], steps: 3, injection_step: 1, timeout_s: 8}\n")
    snakemake(tmp_path, *(f"results/sdc/gpt2/{d}.json" for d in ("nan_grad", "dead", "hang")),
              "--configfile", str(TEST_CONFIG), str(extra), configfile=None)
    out = tmp_path / "results/sdc/gpt2"
    stop, dead, hang = (json.loads((out / f"{d}.json").read_text()) for d in ("nan_grad", "dead", "hang"))
    assert (stop["outcome"], stop["exit_code"], stop["exit_codes"]) == ("stopped", sdc.EXIT_SDC, [sdc.EXIT_SDC] * 3)
    assert stop["check"] == "nonfinite" and stop["suspect_ranks"] == [1] and stop["localized"] is True
    with h5py.File(out / stop["checkpoint"]) as saved:
        assert saved.attrs["step"] == 1 and saved.attrs["sdc_drill"] == "nan_grad"
    assert (dead["outcome"], dead["exit_codes"]) == ("peers_failed", [EXIT_PEER, 13, EXIT_PEER])
    assert (hang["outcome"], hang["exit_codes"]) == ("peers_failed", [EXIT_PEER, None, EXIT_PEER])  # None: killed, hung
    for result in (dead, hang):
        assert [e.split(":")[1] for e in result["peer_errors"]] == [" error"] * 2
        assert all("a peer rank died or hung past the timeout" in e for e in result["peer_errors"])


def _ends(*codes, output="") -> list:
    return [RankEnd(code, output) for code in codes]


@pytest.mark.parametrize("drill, policy, ends, expected", [
    ("nan_grad", "stop", _ends(75, 1, 75), "rank exit codes [75, 1, 75], expected every rank 75 and nan_grad.stop.h5"),
    ("dead", "log", _ends(EXIT_PEER, 13, 0, output=PEER_FAILED),
     f"rank exit codes [3, 13, 0], expected rank 1 exits 13, every other rank 3 ('{PEER_FAILED}')"),
    ("hang", "log", _ends(EXIT_PEER, 13, EXIT_PEER, output=PEER_FAILED), "rank exit codes [3, 13, 3], expected rank 1 hangs"),
    ("dead", "log", _ends(EXIT_PEER, 13, EXIT_PEER, output="Traceback"), "rank exit codes [3, 13, 3], expected rank 1 exits 13"),
    ("clean", "log", _ends(EXIT_OOM, EXIT_PEER, EXIT_PEER), "rank exit codes [4, 3, 3], expected every rank 0"),
    # A rank killed mid-step (the OOM killer, kill -9): "[3, -9, 3]" left the user to know Popen's convention.
    ("clean", "log", _ends(EXIT_PEER, -9, EXIT_PEER), "rank exit codes [3, -9, 3] (rank 1 killed by SIGKILL), "
                                                      "expected every rank 0"),
])
def test_unexpected_end_of_a_drill_is_one_line(tmp_path, drill, policy, ends, expected):
    cfg = make_config(policy=policy)["sdc"]
    if policy == "stop":  # rank 0 recorded the stop; the stop checkpoint was saved
        write_json(tmp_path / f"{drill}.json", {"outcome": "stopped", "exit_code": 75})
        (tmp_path / f"{drill}.stop.h5").touch()
    with pytest.raises(PeatError) as err:
        drill_end(drill, "resnet18", cfg, ends, tmp_path, seed=0)
    assert f"sdc drill {drill!r} of model 'resnet18': unexpected end: {expected}" in str(err.value)
    assert "\n" not in str(err.value)


def test_unexpected_end_of_a_stop_drill_names_both_documented_ends(tmp_path):
    # Under policy stop a drill ends with every rank 0 or with the guard's code: the line said "every rank 0".
    with pytest.raises(PeatError) as err:
        drill_end("nan_grad", "resnet18", make_config(policy="stop")["sdc"], _ends(1, 3, 3), tmp_path, seed=0)
    assert str(err.value) == ("sdc drill 'nan_grad' of model 'resnet18': unexpected end: rank exit codes [1, 3, 3], "
                              "expected every rank 0, or every rank 75 or 65 and nan_grad.stop.h5 (see the log above)")

def test_a_drill_that_ends_its_launch_says_where_it_came_from(tmp_path):
    """A dead or hung rank's record, written by the launcher, lacked the provenance every drill JSON
    has (docs/reliability.md: torch_version, backend, hosts, seed), which rank 0 writes for the others."""
    cfg = make_config()["sdc"]
    peer = f"peat sdc drill: error: rank 0: collective 'x' failed: {PEER_FAILED}"
    record = drill_end("dead", "resnet18", cfg, [RankEnd(EXIT_PEER, peer), RankEnd(13, ""), RankEnd(EXIT_PEER, peer)],
                       tmp_path, seed=7)
    assert record["outcome"] == "peers_failed" and record["seed"] == 7 and record["backend"] == "gloo"
    assert record["hosts"] == [sdc.node_name()] * 3 and record["torch_version"] == str(torch.__version__)
    assert record["provenance"]["vendor"] == "cpu"


# The drill worker, with rank 1 out of GPU memory in its training forward at step 1.
OUT_OF_MEMORY = """
import sys, torch
from peat import sdc_drill

loss = sdc_drill.Trainer.loss
def failing(self, module, step, rank):
    if self.rank == 1 and step == 1 and module is self.ddp:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return loss(self, module, step, rank)
sdc_drill.Trainer.loss = failing
sys.exit(sdc_drill.main())
"""


@pytest.mark.parametrize("bench, task", [(False, "drill 'clean'"), (True, "the benchmark")])
def test_out_of_memory_names_itself_not_a_dead_peer(digits, tmp_path, bench, task):
    # The rank out of memory said 'a peer rank died' (an OutOfMemoryError is a RuntimeError). Under --bench
    # (two twin models: twice the memory) its peer then died in a plain step with torch's traceback, exit 1.
    config = _config_file(tmp_path, world_size=2, steps=2, injection_step=1, drills=["clean"], bench_steps=4)
    ranks = _srun_like(["--config", str(config), "--model", "resnet18", "--data", str(digits), "--out", str(tmp_path / "out"),
                        *(["--bench"] if bench else [])], 2, tmp_path, timeout=300, entry=("-c", OUT_OF_MEMORY))
    assert [r.returncode for r in ranks] == [EXIT_PEER, EXIT_OOM], ranks[0].stdout[-2000:]
    assert ranks[1].stdout.splitlines()[-1] == (f"peat sdc drill: error: rank 1: out of memory in {task} "
                                                "(CUDA out of memory. Tried to allocate 2.00 GiB): lower sdc.batch_size")
    assert ranks[0].stdout.splitlines()[-1].startswith(
        f"peat sdc drill: error: rank 0: collective 'DDP gradient all-reduce at step 1' failed: {PEER_FAILED} (")



# The drill worker, rank 1 dying (kill -9, a node lost) as the ranks build DDP or the guard, before any step.
DIES_BEFORE_THE_FIRST_STEP = """
import os, sys
import torch.distributed as dist
from peat import sdc, sdc_drill

module, name = (sdc_drill, "DistributedDataParallel") if sys.argv[1] == "ddp" else (sdc, "Guard")
built = getattr(module, name)
def dying(*args, **kwargs):
    if dist.get_rank() == 1:
        os._exit(13)
    return built(*args, **kwargs)
setattr(module, name, dying)
sys.exit(sdc_drill.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("where, collective", [("ddp", "DDP's broadcast of the model"), ("guard", "guard settings")])
def test_a_peer_dying_before_the_first_step_fails_its_peers_as_documented(digits, tmp_path, where, collective):
    # The peers died in DDP's (or the guard's) first collective with torch's traceback, exit 1: not the
    # documented 'a peer rank died', exit 3, which the launcher and a batch script read.
    config = _config_file(tmp_path, world_size=2, steps=2, injection_step=1, drills=["clean"])
    ranks = _srun_like([where, "--config", str(config), "--model", "resnet18", "--data", str(digits), "--out",
                        str(tmp_path / "out")], 2, tmp_path, timeout=300, entry=("-c", DIES_BEFORE_THE_FIRST_STEP))
    assert [r.returncode for r in ranks] == [EXIT_PEER, 13], ranks[0].stdout[-2000:]
    assert ranks[0].stdout.splitlines()[-1].startswith(
        f"peat sdc drill: error: rank 0: collective '{collective}' failed: {PEER_FAILED} (")

def test_two_replicas_detect_but_cannot_localize(digits, tmp_path):
    out = tmp_path / "resnet18"
    config = make_config(world_size=2, steps=3, injection_step=1, drills=["weight_flip"])
    launch(config, "resnet18", digits, out, timeout=300)
    result = json.loads((out / "weight_flip.json").read_text())
    assert result["world_size"] == 2 and result["detected"] is True and result["check"] == "fingerprint"
    assert result["detection_step"] == 1 and result["suspect_ranks"] == [0, 1] and result["localized"] is False
    assert result["right_rank"] is False
    first = result["alarms"][0]
    assert first["detail"]["note"] == "two replicas: detected but cannot localize"
    assert first["detail"]["first_differing_parameter"] == "conv1.weight"


# A guarded loop on a small MLP under torchrun; prints the alarms of the guard's rank 0 as JSON.
GUARDED_LOOP = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from peat import sdc

options = json.loads(sys.argv[1])
seed_per_rank, global_batch, audit_every = options["seed_per_rank"], options["global_batch"], options["audit_every"]
frozen_flip, transient_in_subgroup = options["frozen_flip"], options["transient_in_subgroup"]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
# Subgroup: the guarded data-parallel group is ranks 1.. (rank 0 stands for another parallel dimension).
group = dist.new_group(list(range(1, dist.get_world_size()))) if transient_in_subgroup else None


def train():
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(rank if seed_per_rank else 0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))
    if options["spectral_norm"]:  # its power iteration updates buffers in each forward, and uses them
        nn.utils.parametrizations.spectral_norm(model[0])
    if frozen_flip:
        model[0].requires_grad_(False)
    armed = []  # one faulty forward of the last layer on the guard's rank 1
    faulty_rows = []  # rank 1 computes wrongly on these inputs only, every time (data-dependent fault)
    if options["data_dependent"] and rank == 1:
        model[0].register_forward_hook(
            lambda module, inputs, out: out * 1.01 if any(torch.equal(inputs[0][0], r) for r in faulty_rows) else out)
    if transient_in_subgroup and rank == 1:
        model[3].register_forward_hook(lambda module, inputs, out: out * 1.01 if armed and armed.pop() else out)
    model.to(getattr(torch, options["dtype"]))
    if options["ignored"]:  # DDP leaves the last layer to each rank: trained on local gradients, it differs
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["3.weight", "3.bias"])
    if options["ignored"] == "nan" and rank == 1:  # at step 1, rank 1's local gradient of the ignored bias
        model[3].bias.register_hook(lambda g: g * float("nan") if guard.step == 1 else g)
    ddp = DistributedDataParallel(model, process_group=group)
    if options["comm_hook"]:
        ddp.register_comm_hook(None, getattr(default_hooks, options["comm_hook"]))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(100, 8, generator=data).to(model[0].weight.dtype), torch.randint(0, 2, (100,), generator=data)
    guard = sdc.Guard(ddp, policy="log", audit_every=audit_every, group=group, fused=options["fused"])
    if options["transient_checksum"] and rank == 1:  # one wrong read of rank 1's weights, at step 1
        read = sdc.group_checksums
        sdc.group_checksums = lambda tensors: read(tensors) + int(guard.step == 1)
    if options["huge"] is not None:  # at step 1, a finite local gradient, huge at its element 1 on every rank
        model[3].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), options["huge"]) if guard.step == 1 else g)
    for step in range(4):
        idx = list(range(step * global_batch, (step + 1) * global_batch))
        def loss_of(module, r):
            part = sdc.shard(idx, r, world)
            return nn.functional.cross_entropy(module(x[part]), y[part])
        guard.begin_step(step)
        armed[:] = [step == 2]
        if step == 2:
            faulty_rows.append(x[sdc.shard(idx, 1, world)][0])  # rank 1's own micro-batch of step 2
        optimizer.zero_grad(set_to_none=True)
        (loss_of(ddp, rank) * (float("inf") if options["diverge"] and step == 1 else 1.0)).backward()
        if guard.check_gradients(replay=lambda r: loss_of(guard.module, r)):
            optimizer.step()
        if frozen_flip and rank == 1 and step == 2:
            with torch.no_grad():
                model[0].weight.view(-1)[3] *= 2  # memory corruption of a frozen weight on one replica
        guard.check_weights()
    guard.finish()
    if rank == 0:
        print("ALARMS", json.dumps([[e.step, e.check, e.suspect_ranks, e.detail] for e in guard.alarms]))


if group is None or dist.get_rank() > 0:
    train()
dist.barrier()
dist.destroy_process_group()
"""


def _run_guarded_loop(tmp_path: Path, world: int = 3, **options) -> list:
    script = tmp_path / "loop.py"
    script.write_text(GUARDED_LOOP)
    options = {"seed_per_rank": False, "global_batch": 12, "audit_every": 1, "frozen_flip": False,
               "transient_in_subgroup": False, "spectral_norm": False, "diverge": False, "data_dependent": False,
               "dtype": "float32", "comm_hook": None, "huge": None, "fused": None, "transient_checksum": False,
               "ignored": False, **options}
    proc = _torchrun(script, world, json.dumps(options))
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("ALARMS ")]
    return json.loads(line[len("ALARMS "):])


@pytest.mark.parametrize("seed_per_rank, global_batch", [
    (False, 10),  # shards of 3, 3, 4 rows: rank 2 draws more dropout bits, its random stream runs ahead
    (True, 12),   # ranks seeded apart: their dropout masks differ from the first step
])
def test_audit_replays_dropout_with_the_peers_random_state(tmp_path, seed_per_rank, global_batch):
    assert _run_guarded_loop(tmp_path, seed_per_rank=seed_per_rank, global_batch=global_batch) == []


def test_weight_fingerprint_covers_frozen_parameters(tmp_path):
    # A frozen layer's weight changes on rank 1 after step 2; the audit is off.
    alarms = _run_guarded_loop(tmp_path, frozen_flip=True, audit_every=0)
    assert alarms[0] == [2, "fingerprint", [1], {"first_differing_parameter": "0.weight"}]


@pytest.mark.parametrize("fused, ignored, alarms", [
    (False, True, []),
    (True, True, []),
    # Unchecked, the NaN reaches rank 1's ignored bias, and through it each later step's shared gradients.
    (False, "nan", [[step, "nonfinite", [1], {"flags": [0, 1, 0]}] for step in (2, 3)]),
])
def test_parameters_ddp_ignores_are_left_out_of_the_checks(tmp_path, fused, ignored, alarms):
    # DDP never syncs them, so each rank's differ after the first step: every step was an unlocalized fingerprint
    # alarm (policy stop: exit 65 at step 0), and a NaN in one rank's local gradient, never all-reduced, sent that
    # rank alone into the flag exchange: the process group crashed. fused=True was refused.
    assert _run_guarded_loop(tmp_path, audit_every=0, fused=fused, ignored=ignored) == alarms


def test_fused_weight_alarm_whose_tensors_agree_when_read_again(tmp_path):
    # The groups' checksums differ, each tensor's (gathered to name it) agree: the guard raised
    # StopIteration from check_gradients looking for the first differing tensor.
    alarms = _run_guarded_loop(tmp_path, fused=True, transient_checksum=True, audit_every=0)
    assert alarms == [[1, "fingerprint", [1], {"first_differing_parameter": None, "transient": (
        "each tensor's checksum agrees when read again: a wrong read or sum of the weights, not their bits")}]]


def test_events_file_is_written_into_a_new_folder(one_rank, tmp_path):
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    model.bias.register_hook(lambda g: g * float("nan"))
    events = tmp_path / "logs" / "sdc.jsonl"
    guard = sdc.Guard(DistributedDataParallel(model), policy="log", events=events)
    guard.begin_step(0)
    guard.ddp(torch.ones(3, 4)).sum().backward()
    assert guard.check_gradients() is False
    (line,) = events.read_text().splitlines()
    assert json.loads(line)["check"] == "nonfinite" and json.loads(line)["suspect_ranks"] == [0]


def test_guard_refuses_a_plain_module_and_bad_intervals(one_rank):
    # A plain module failed with AttributeError ('module'); fingerprint_every=0 passed, then the
    # first check_weights divided by zero.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    with pytest.raises(PeatError, match=r"^sdc.Guard: pass the DistributedDataParallel wrapper, DDP\(model\), "
                                        r"not a Linear$"):
        sdc.Guard(model)
    ddp = DistributedDataParallel(model)
    for options, message in [({"fingerprint_every": 0}, "fingerprint_every=0: every N steps needs an integer N >= 1"),
                             ({"audit_every": -1}, r"audit_every=-1: every N steps needs an integer N >= 0 \(0 = off\)"),
                             ({"audit_every": 2.5}, "audit_every=2.5: every N steps needs an integer N >= 0")]:
        with pytest.raises(PeatError, match=rf"^sdc.Guard: {message}"):
            sdc.Guard(ddp, **options)
    guard = sdc.Guard(ddp, audit_every=torch.tensor(2).numpy()[()], fingerprint_every=1)  # any integer type
    assert guard.audit_every == 2


def test_guard_refuses_a_save_that_is_no_function(one_rank, tmp_path):
    # A path given as save= was called at the first stop only: a TypeError on the saving rank while its peers
    # waited in the stop's barrier until the process group's timeout.
    from torch.nn.parallel import DistributedDataParallel

    with pytest.raises(PeatError, match=r"^sdc.Guard: save='ckpt.pt': pass a function that writes the checkpoint to "
                                        r"the path it is given \(checkpoint= names that path\)$"):
        sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)), policy="stop", save="ckpt.pt")


def test_guard_refuses_files_it_could_not_write_at_an_alarm(one_rank, tmp_path):
    # Found at the first alarm only, on the rank writing it: an OSError (a KeyError for an unknown placeholder of the
    # drain marker) while its peers went on to the next collective, until the process group's timeout.
    from torch.nn.parallel import DistributedDataParallel

    blocked = tmp_path / "file"
    blocked.write_text("")
    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    for options, message in [
        ({"events": blocked / "sdc.jsonl"}, rf"events={str(blocked / 'sdc.jsonl')!r}: cannot create its folder"),
        ({"drain_marker": str(blocked / "drain-{node}.json")},
         rf"drain_marker={str(blocked / 'drain-{node}.json')!r}: cannot create its folder"),
        ({"events": tmp_path}, rf"events={str(tmp_path)!r}: is a folder; name the file"),
        ({"drain_marker": str(tmp_path / "drain-{host}.json")},
         rf"drain_marker={str(tmp_path / 'drain-{host}.json')!r}: the only placeholder is {{node}}"),
    ]:
        with pytest.raises(PeatError, match=rf"^sdc.Guard: {re.escape(message)}"):
            sdc.Guard(ddp, policy="stop", **options)
    sdc.Guard(ddp, events=tmp_path / "new" / "sdc.jsonl", drain_marker=str(tmp_path / "m" / "drain-{node}.json"))
    assert not (tmp_path / "new" / "sdc.jsonl").exists()  # written at the first alarm only


def test_guard_resolves_its_drain_marker_once_and_writes_the_one_it_checked(one_rank, tmp_path, monkeypatch):
    # Each build resolved the node's marker twice (its check, then the path to check) besides naming the node
    # for the peers, and a stop resolved it once more: three names of the node per build, one per stop.
    from torch.nn.parallel import DistributedDataParallel

    names = []
    monkeypatch.setattr(sdc, "node_name", lambda: names.append(f"node{len(names)}") or names[-1])
    guard = sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)), policy="stop",
                      drain_marker=str(tmp_path / "{node}" / "drain.json"))
    assert names == ["node0"] and guard.hosts == ["node0"]
    with pytest.raises(SystemExit) as stop:
        guard._alarm("fingerprint", [0], True, {})  # as a localized alarm naming this rank
    assert stop.value.code == sdc.EXIT_SDC and names == ["node0"]
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("drain.json")] == ["node0/drain.json"]

def test_policy_stop_makes_the_checkpoints_folder_or_refuses_it_when_built(one_rank, tmp_path):
    # A checkpoint= in a folder not made yet: torch.save failed at the first stop, on the saving rank alone
    # (FileNotFoundError, exit 1), while its peers waited in the stop's barrier until the timeout: no exit 75.
    def save(path):
        torch.save({"w": 1}, path)

    checkpoint = tmp_path / "ckpt" / "sdc_stop.pt"
    with pytest.raises(SystemExit) as stop:
        _guarded_step(_overflow_in_the_sum, policy="stop", save=save, checkpoint=checkpoint)
    assert stop.value.code == sdc.EXIT_SDC_UNLOCALIZED and torch.load(checkpoint) == {"w": 1}
    blocked = tmp_path / "file"
    blocked.write_text("")
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    for where, message in [(blocked / "stop.pt", "cannot create its folder"), (tmp_path, "is a folder; name the file")]:
        with pytest.raises(PeatError, match=rf"^sdc.Guard: checkpoint={re.escape(repr(str(where)))}: {message}"):
            sdc.Guard(ddp, policy="stop", save=save, checkpoint=where)
    sdc.Guard(ddp, policy="log", save=save, checkpoint=blocked / "stop.pt")  # saved by policy stop only


UNWRITABLE_ON_ONE_RANK = """
import sys
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from peat import sdc
from peat.io import PeatError

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
try:  # rank 1's folder is a file there (a node without the mount)
    sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)), events=f"{sys.argv[1]}/r{dist.get_rank()}/sdc.jsonl")
except PeatError as err:  # a file each: the ranks' stdout lines may interleave
    (Path(sys.argv[1]) / f"refused{dist.get_rank()}").write_text(str(err))
"""


def test_a_file_one_rank_cannot_write_is_refused_on_every_rank(tmp_path):
    (tmp_path / "r1").write_text("")
    script = tmp_path / "unwritable.py"
    script.write_text(UNWRITABLE_ON_ONE_RANK)
    _torchrun(script, 2, str(tmp_path))
    first, second = ((tmp_path / f"refused{r}").read_text() for r in range(2))
    assert first == second
    assert first.startswith(f"sdc.Guard: events={str(tmp_path / 'r1' / 'sdc.jsonl')!r}: cannot create its folder (")
    assert first.endswith(f") (rank 1 on node {sdc.node_name()})")


@pytest.mark.parametrize("tolerance", ["1e-5", -1.0, float("nan"), float("inf"), True])
def test_guard_refuses_a_tolerance_that_is_no_number_at_least_0(one_rank, tolerance):
    # '1e-5' (as YAML reads it) crashed the first audit step with a TypeError, -1 failed every audit (an unlocalized
    # alarm each time), NaN was said to differ between ranks (with one rank).
    from torch.nn.parallel import DistributedDataParallel

    with pytest.raises(PeatError, match=rf"^sdc.Guard: audit_tolerance={tolerance!r}: a relative tolerance needs a "
                                        r"finite number >= 0 \(0 = bit-exact\)$"):
        sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)), audit_every=1, audit_tolerance=tolerance)
    guard = sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)), audit_tolerance=torch.tensor(1e-5).numpy()[()])
    assert guard.tolerance == pytest.approx(1e-5)


def test_guards_that_differ_between_ranks_are_one_line(one_rank, monkeypatch):
    # audit_every differing on one rank: gloo aborted both ranks on a collective size mismatch
    # (SIGABRT, "Invalid mt19937 state"); nccl may hang.
    from torch.nn.parallel import DistributedDataParallel

    def gather_with_a_peer(out, mine, group=None):  # rank 1 built its guard with audit_every=3
        out[:] = [mine, (mine[0], {**mine[1], "audit_every": 3}, *mine[2:])]

    monkeypatch.setattr(sdc.dist, "all_gather_object", gather_with_a_peer)
    with pytest.raises(PeatError, match=r"^sdc.Guard: audit_every differs between ranks \(rank 0: 2, rank 1: 3\): "
                                        r"build the guard alike on every rank$"):
        sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)), audit_every=2)


def test_guard_calls_out_of_order_are_one_line(one_rank):
    # No begin_step: an AttributeError from inside backward. check_gradients before backward: every audit
    # compared no report with the replay, an unlocalized alarm naming every rank at every step.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
    replay = lambda r: guard.module(torch.ones(3, 4)).sum()  # noqa: E731
    before_begin = r"^sdc.Guard: a gradient arrived before begin_step\(\): call guard.begin_step\(step\) before each"
    with pytest.raises(PeatError, match=before_begin):
        guard.ddp(torch.ones(3, 4)).sum().backward()
    guard.begin_step(0)
    with pytest.raises(PeatError, match=r"^sdc.Guard: check_gradients\(\) at step 0 saw no gradient of this step: "
                                        r"call guard.begin_step\(step\) before backward and check_gradients\(\) after it$"):
        guard.check_gradients(replay=replay)
    guard.begin_step(1)
    model.zero_grad(set_to_none=True)
    guard.ddp(torch.ones(3, 4)).sum().backward()
    assert guard.check_gradients(replay=replay) and guard.alarms == []
    # A second backward after check_gradients was also said to come "before begin_step()".
    with pytest.raises(PeatError, match=r"^sdc.Guard: a gradient arrived after check_gradients\(\) of step 1: every "
                                        r"backward of a step comes before its check_gradients\(\); call "
                                        r"guard.begin_step\(step\) before the next step's$"):
        guard.ddp(torch.ones(3, 4)).sum().backward()


@pytest.mark.parametrize("fused", [False, True])
def test_a_second_backward_after_the_check_is_one_line(one_rank, fused):
    # Through a retained graph DDP shares nothing (it all-reduces once per forward). Fused: unseen, the
    # rank's own gradients were added after the check and the next weight fingerprint was a false alarm
    # naming every rank; per parameter: refused as if the next step lacked its begin_step.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model), fused=fused)
    guard.begin_step(0)
    loss = guard.ddp(torch.ones(3, 4)).sum()
    loss.backward(retain_graph=True)
    assert guard.check_gradients()
    with pytest.raises(PeatError, match=r"^sdc.Guard: a second backward in step 0 after its check_gradients\(\): its "
                                        r"gradients were never checked, nor shared \(DDP all-reduces once per "
                                        r"forward\); backpropagate each step's loss once, before check_gradients\(\)$"):
        loss.backward()


@pytest.mark.parametrize("fused", [False, True])
def test_two_backwards_through_one_forward_are_one_line(one_rank, fused):
    # DDP all-reduces the first only: each rank added its own gradients of the second, the replicas parted,
    # and the next weight fingerprint raised a false alarm naming every rank (with 3 ranks: no majority).
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    guard = sdc.Guard(DistributedDataParallel(model), fused=fused)
    guard.begin_step(0)
    out = guard.ddp(torch.ones(3, 4))
    out[:, 0].sum().backward(retain_graph=True)
    with pytest.raises(PeatError, match=r"^sdc.Guard: a second backward through one forward with gradient sync in "
                                        r"step 0: DDP all-reduces only the first, so the replicas would part; add "
                                        r"the losses and call backward\(\) once$"):
        out[:, 1].pow(2).sum().backward()
    # Under no_sync a retained graph's second backward stays local, shared with the step's last micro-batch.
    model.zero_grad(set_to_none=True)
    guard = sdc.Guard(DistributedDataParallel(model), fused=fused)
    guard.begin_step(1)
    with guard.ddp.no_sync():
        out = guard.ddp(torch.ones(3, 4))
        out[:, 0].sum().backward(retain_graph=True)
        out[:, 1].sum().backward()
    guard.ddp(torch.ones(3, 4)).sum().backward()
    assert guard.check_gradients() and guard.alarms == []


@pytest.mark.parametrize("fused", [False, True])
def test_a_forward_under_no_sync_before_the_check_is_allowed(one_rank, fused):
    # A forward for logging (autograd on, no backward) between the step's backward and its check was
    # taken for the step's last micro-batch: the check refused the step as run under no_sync().
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    guard = sdc.Guard(DistributedDataParallel(model), fused=fused, audit_every=1)
    loss = lambda module: module(torch.ones(3, 4)).sum()  # noqa: E731
    guard.begin_step(0)
    out = guard.ddp(torch.ones(3, 4))
    out[:, 0].sum().backward(retain_graph=True)
    with guard.ddp.no_sync():
        logged = loss(guard.ddp)
    assert logged.requires_grad
    assert guard.check_gradients(replay=lambda r: guard.module(torch.ones(3, 4))[:, 0].sum())
    guard.check_weights()
    assert guard.alarms == []
    # A second backward through the synced forward's graph after it is still refused: its gradients
    # are taken for the last forward's, run under no_sync().
    model.zero_grad(set_to_none=True)
    guard.begin_step(1)
    out = guard.ddp(torch.ones(3, 4))
    out[:, 0].sum().backward(retain_graph=True)
    with guard.ddp.no_sync():
        loss(guard.ddp)
    out[:, 1].sum().backward()
    with pytest.raises(PeatError, match=r"^sdc.Guard: step 1's last backward ran under ddp.no_sync\(\)"):
        guard.check_gradients()


def test_a_second_check_gradients_in_a_step_is_one_line(one_rank, tmp_path):
    # It ran every check again: the step's non-finite alarm was raised and written to the events file twice.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model), events=tmp_path / "events.jsonl")
    guard.begin_step(0)
    guard.ddp(torch.full((3, 4), float("nan"))).sum().backward()
    assert not guard.check_gradients()
    with pytest.raises(PeatError, match=r"^sdc.Guard: check_gradients\(\) called twice in step 0: call it once per "
                                        r"step, and keep its verdict$"):
        guard.check_gradients()
    assert len(guard.alarms) == 1 and len((tmp_path / "events.jsonl").read_text().splitlines()) == 1


def test_a_step_without_its_checks_is_one_line(one_rank):
    # Forgetting check_gradients trained a rank's NaN into every replica (then equal: no fingerprint
    # alarm) and never ran the audit; forgetting check_weights never compared the weights. Both passed
    # without a word.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model))
    guard.begin_step(0)
    guard.ddp(torch.ones(3, 4)).sum().backward()
    with pytest.raises(PeatError, match=r"^sdc.Guard: begin_step\(1\) after step 0 had gradients but no "
                                        r"check_gradients\(\): call it after each step's backward, before "
                                        r"optimizer.step\(\)$"):
        guard.begin_step(1)
    assert guard.check_gradients()
    for call, name in [(lambda: guard.begin_step(1), r"begin_step\(1\)"), (guard.finish, r"finish\(\)")]:
        with pytest.raises(PeatError, match=rf"^sdc.Guard: {name} after step 0 had no check_weights\(\): call it "
                                            r"after each step's optimizer.step\(\)$"):
            call()
    guard.check_weights()
    guard.begin_step(1)
    model.zero_grad(set_to_none=True)
    (guard.ddp(torch.ones(3, 4)).sum() * float("nan")).backward()
    assert not guard.check_gradients()  # a skipped step changed no weight: its check_weights may be left out
    guard.finish()


def test_check_weights_twice_is_one_line(one_rank):
    # A second call settled the first gather at once (a stall) and started another: a replica that
    # differed raised the fingerprint alarm twice for one step.
    from torch.nn.parallel import DistributedDataParallel

    guard = sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)))
    guard.begin_step(0)
    guard.ddp(torch.ones(3, 4)).sum().backward()
    assert guard.check_gradients()
    guard.check_weights()
    pending = guard._weights
    with pytest.raises(PeatError, match=r"^sdc.Guard: check_weights\(\) called twice in step 0: call it once per "
                                        r"step, after optimizer.step\(\)$"):
        guard.check_weights()
    assert guard._weights is pending  # the first exchange untouched, still compared in the next step
    guard.finish()


def test_accumulation_without_no_sync_is_one_line(one_rank):
    # Each micro-batch's backward was all-reduced: every audit failed on every rank (an unlocalized alarm
    # at each audit step) and a rank's NaN reached every rank's local check.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
    loss = lambda module, half: module(torch.arange(12.0).view(3, 4)[half]).sum()  # noqa: E731
    guard.begin_step(0)
    with guard.ddp.no_sync():
        loss(guard.ddp, slice(0, 2)).backward()
    loss(guard.ddp, slice(2, 3)).backward()
    assert guard.check_gradients(replay=lambda r: loss(guard.module, slice(0, 2)) + loss(guard.module, slice(2, 3)))
    guard.check_weights()
    assert guard.alarms == []
    guard.begin_step(1)
    loss(guard.ddp, slice(0, 2)).backward()
    with pytest.raises(PeatError, match=r"^sdc.Guard: a second DDP forward with gradient sync in step 1: accumulate "
                                        r"micro-batches under ddp.no_sync\(\), all but the last$"):
        guard.ddp(torch.ones(1, 4))


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_only_under_no_sync_is_one_line(one_rank, fused):
    # Per parameter, each rank read its own unshared gradients as reduced ones: a healthy verdict, and a
    # rank's NaN sent that rank alone into the flag exchange (gloo aborted). Fused: "saw no gradient".
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model), fused=fused)
    guard.begin_step(0)
    for _ in range(2):
        with guard.ddp.no_sync():
            guard.ddp(torch.ones(3, 4)).sum().backward()
    with pytest.raises(PeatError, match=r"^sdc.Guard: step 0's last backward ran under ddp.no_sync\(\): its gradients "
                                        r"were never shared between ranks, so no check can compare them; run each "
                                        r"step's last micro-batch outside no_sync\(\)$"):
        guard.check_gradients()
    guard.ddp(torch.ones(3, 4)).sum().backward()  # the step's last micro-batch, as it should be
    assert guard.check_gradients() and guard.alarms == []


def test_two_forwards_before_one_backward_are_one_all_reduce(one_rank):
    # A siamese or contrastive loss calls the model twice and backpropagates once: one all-reduce, as DDP
    # allows. The guard refused it as gradient accumulation without no_sync.
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
    x = torch.randn(3, 4)
    loss = lambda module: (module(x) - module(x.flip(0))).square().sum()  # noqa: E731
    guard.begin_step(0)
    loss(guard.ddp).backward()
    assert guard.check_gradients(replay=lambda r: loss(guard.module))
    guard.check_weights()
    guard.finish()
    assert guard.alarms == []


def test_audit_step_without_a_replay_is_one_line(one_rank):
    # The audit was skipped without a word: a user who set audit_every believed it ran.
    with pytest.raises(PeatError, match=r"^sdc.Guard: step 0 is an audit step \(audit_every=2\) but check_gradients\(\) "
                                        r"got no replay: pass replay=lambda r: <rank r's loss>, or audit_every=0$"):
        _guarded_step(audit_every=2)


def test_audit_after_freezing_a_layer_once_the_guard_was_built(one_rank):
    # Fine-tuning freezes a layer mid-run: every audit failed with autograd's "One of the differentiated
    # Tensors does not require grad".
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    guard = sdc.Guard(DistributedDataParallel(model, find_unused_parameters=True), audit_every=1)
    x = torch.randn(5, 4)
    for step in range(2):
        model[0].requires_grad_(step == 0)
        healthy_step(guard, model, x, step)
    assert guard.alarms == []


def test_audit_with_gradients_zeroed_in_place(one_rank):
    # zero_grad(set_to_none=False) accumulates into zeros: autograd's -0.0 (a zero input times a negative
    # output gradient) became 0 + -0.0 = +0.0 in .grad but stayed -0.0 in the replay, so every audit
    # after the first step failed (an audit alarm at each audit step of a healthy run).
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(3, 2)
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
    loss = lambda module: (module(torch.tensor([[1.0, 0.0, 2.0]])) * torch.tensor([1.0, -1.0])).sum()  # noqa: E731
    for step in range(2):
        guard.begin_step(step)
        model.zero_grad(set_to_none=False)
        loss(guard.ddp).backward()
        assert guard.check_gradients(replay=lambda r: loss(guard.module))
        guard.check_weights()
    assert guard.alarms == []


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("layer_before", [False, True])
def test_audit_of_a_model_with_reentrant_checkpointing(one_rank, fused, layer_before):
    # torch.utils.checkpoint(use_reentrant=True) (DDP with static_graph) runs a backward of its own:
    # autograd.grad refused it (the first audit crashed every rank) or, with no parameter before the
    # checkpoint, skipped it (zeros for the parameters inside: an audit alarm at every audit step).
    # The replay must leave .grad as it was.
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Sequential):
        def forward(self, x):
            return self[2](checkpoint(self[1], self[0](x), use_reentrant=True))

    torch.manual_seed(0)
    model = Net(torch.nn.Linear(4, 4) if layer_before else torch.nn.Identity(), torch.nn.Linear(4, 4),
                torch.nn.Linear(4, 2))
    guard = sdc.Guard(DistributedDataParallel(model, static_graph=True), audit_every=1, fused=fused)
    x = torch.randn(3, 4, requires_grad=True)  # checkpoint's reentrant backward needs an input with a gradient
    loss = lambda module: module(x).square().sum()  # noqa: E731
    for step in range(3):
        guard.begin_step(step)
        model.zero_grad(set_to_none=True)
        loss(guard.ddp).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        assert guard.check_gradients(replay=lambda r: loss(guard.module))
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        guard.check_weights()
    guard.finish()
    assert guard.alarms == []


def _nan_at_step_one_is_the_one_alarm(guard, model, loss, param, poison) -> None:
    """Two audited steps, ``param``'s gradient poisoned in the second: one non-finite alarm there."""
    for step in range(2):
        if step == 1:
            param.register_hook(poison)
        guard.begin_step(step)
        model.zero_grad(set_to_none=True)
        loss(guard.ddp).backward()
        assert guard.check_gradients(replay=lambda r: loss(guard.module)) is (step == 0)
        guard.check_weights()
    (alarm,) = guard.alarms
    assert (alarm.step, alarm.check, alarm.detail["flags"]) == (1, "nonfinite", [1])


def test_sparse_gradients_are_audited_and_checked(one_rank):
    # nn.Embedding(sparse=True): every audit failed with "reshape is not implemented for sparse tensors",
    # and a non-finite sparse gradient crashed its rank (isfinite has no sparse kernel) instead of an alarm.
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
    loss = lambda module: module(torch.tensor([1, 2, 2])).sum()  # noqa: E731
    _nan_at_step_one_is_the_one_alarm(guard, model, loss, model[0].weight, lambda g: g * float("nan"))


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("fused", [False, True])
def test_complex_gradients_are_audited_and_checked(one_rank, fused):
    # Fused, every audit failed: DDP's bucket view of a complex gradient holds half of it. On a GPU, a
    # NaN in an imaginary part passed the check: a complex sum cast to float64 keeps the real part.
    from torch.nn.parallel import DistributedDataParallel

    class Complex(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.complex64)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Complex(), torch.nn.Linear(4, 4).to(torch.complex64))
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1, fused=fused)
    loss = lambda module: module(torch.ones(3, 4)).abs().sum()  # noqa: E731
    # NaN in one imaginary part
    nan = lambda g: g + torch.tensor([0, float("nan")]).view(torch.complex64)  # noqa: E731
    _nan_at_step_one_is_the_one_alarm(guard, model, loss, model[2].weight, nan)
    imaginary_nan = torch.ones(3, dtype=torch.complex64)
    imaginary_nan.imag[1] = float("nan")
    assert sdc._flagged([sdc._mark_nonfinite_on_device(imaginary_nan)]) and imaginary_nan.real[0].isnan()


def test_guard_rebuilt_after_unfreezing_replaces_the_last_one(one_rank):
    # Unfreezing a layer needs a new DDP and a new guard: the first guard's hooks, still on the
    # parameters, refused the new guard's first backward ("a gradient arrived after check_gradients()").
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    for step in range(2):
        model[0].requires_grad_(step == 1)
        guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
        healthy_step(guard, model, x, step)
        guard.finish()
        assert guard.alarms == []


def test_alarm_is_printed_without_an_events_file(one_rank, capsys):
    # Policy log without events used to skip the step without a word.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    model.bias.register_hook(lambda g: g * float("nan"))
    guard = sdc.Guard(DistributedDataParallel(model))
    guard.begin_step(5)
    guard.ddp(torch.ones(3, 4)).sum().backward()
    assert guard.check_gradients() is False
    assert capsys.readouterr().err == (f"peat sdc: silent data corruption suspected at step 5 by check 'nonfinite': "
                                       f"rank(s) [0] on node(s) {sdc.node_name()} (NOT localized: one rank: no peer "
                                       f"to tell a faulty device from a diverged run or bad data)\n")


def test_policy_raise_at_the_first_step_still_writes_the_drill(digits, tmp_path):
    # The alarm ends the drill before any step finished: no plain step time to compare costs with.
    config = make_config(policy="raise", steps=2, injection_step=0, drills=["nan_grad"])
    (tmp_path / "nan_grad.stop.h5").touch()  # an earlier policy-stop run's: it would vouch for a later stop
    launch(config, "resnet18", digits, tmp_path, timeout=300)
    assert not (tmp_path / "nan_grad.stop.h5").exists()
    result = json.loads((tmp_path / "nan_grad.json").read_text())
    assert result["detected"] is True and result["detection_step"] == 0 and result["suspect_ranks"] == [1]
    assert result["cost"]["plain_step_s"] is None and result["cost"]["relative"]["nonfinite"] is None


def test_audit_rerun_in_a_subgroup_names_the_faulty_rank(tmp_path):
    # Guard ranks 0, 1, 2 are global ranks 1, 2, 3: the second opinion's broadcast must come from the
    # third rank's global rank (guard rank 2, global rank 3).
    (alarm,) = _run_guarded_loop(tmp_path, transient_in_subgroup=True, world=4)
    assert alarm[:3] == [2, "audit", [1]] and alarm[3]["failed_audits"] == [[0, 1]]


def test_audit_replays_from_the_buffers_the_step_started_with(tmp_path):
    assert _run_guarded_loop(tmp_path, spectral_norm=True) == []


def test_launch_time_limit_stops_the_workers(digits, tmp_path):
    # A stalled rank and a long collective timeout: the launcher's own limit ends the drill.
    out = tmp_path / "stalled"
    with pytest.raises(PeatError, match="the ranks did not finish within the launcher's time limit"):
        launch(make_config(drills=["hang"], timeout_s=600), "resnet18", digits, out, timeout=15)
    left = subprocess.run(["pgrep", "-f", f"sdc_drill.*{out}"], capture_output=True, text=True).stdout.split()
    for pid in left:  # do not leave them running on failure
        os.kill(int(pid), 9)
    assert left == [], "worker ranks still running after the launcher gave up"


def _launcher(tmp: Path, digits: Path, config: dict, **popen) -> subprocess.Popen:
    """``launch`` of the drills of ``config`` in a process of its own, ``tmp/out`` its output folder."""
    path = tmp / "config.json"
    write_json(path, config)
    code = (f"import json; from peat.sdc_drill import launch; "
            f"launch(json.load(open({str(path)!r})), 'resnet18', {str(digits)!r}, {str(tmp / 'out')!r})")
    return subprocess.Popen([sys.executable, "-c", code], **popen)


def test_rank_output_is_streamed_while_the_launch_runs(digits, tmp_path):
    # It was printed only when every rank had ended: here 15 s after the peers' errors, the time the
    # launcher waits before it kills the hung rank; in a long drill, nothing for hours.
    launcher = _launcher(tmp_path, digits, make_config(world_size=2, drills=["hang"], timeout_s=5, steps=3,
                                                       injection_step=1), stdout=subprocess.PIPE, text=True)
    error = next((line for line in launcher.stdout if PEER_FAILED in line), "")
    try:  # the launcher waits timeout_s + 10 s after it before it kills the hung rank
        code = launcher.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    assert code is None, "the peer's error came only as the launcher ended"
    launcher.communicate(timeout=60)
    assert launcher.returncode == 0
    assert error.startswith("[rank0]: peat sdc drill: error: rank 0: collective"), error  # as torchrun --tee


def _running(pid: str) -> bool:
    """Whether a process runs (a zombie does not: the parent of an orphan may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_a_terminating_signal_is_noted_and_acted_on_where_the_launcher_looks():
    """The SIGTERM handler raised SystemExit, which could land in Popen.poll between taking its waitpid
    lock and the try that releases it: killing the ranks then waited on that lock for good (a CI run,
    the launcher and a rank still up minutes after the kill). It only notes the signal now."""
    from peat.sdc_drill import Launch

    ranks = Launch({"sdc": {"world_size": 1, "timeout_s": 5}}, "test", time.monotonic() + 60)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ranks._terminated(signal.SIGTERM, None) is None  # nothing raised inside what it interrupted
        with pytest.raises(SystemExit) as stop:
            ranks._wait([rank])
        assert stop.value.code == 128 + signal.SIGTERM and rank.poll() is None
    finally:
        rank.kill()
        rank.wait()


@pytest.mark.parametrize("signum, exit_code, ranks_up", [
    (signal.SIGTERM, 128 + 15, 3),  # the launcher ends its ranks itself
    # As they start: the handler came after the last rank, so the launcher died of the signal (-15).
    (signal.SIGTERM, 128 + 15, 1),
    # It cannot: they die with it (Linux's parent-death signal). They kept running, the hung one for good.
    pytest.param(signal.SIGKILL, -9, 3, marks=pytest.mark.skipif(sys.platform != "linux", reason="Linux prctl")),
])
def test_killed_launcher_takes_its_ranks_with_it(digits, tmp_path, signum, exit_code, ranks_up):
    # kill <launcher> (or a job's time limit) left every rank running, the hung one for 11 days.
    log = tmp_path / "launcher.log"  # what it said, should it end before its ranks start
    with open(log, "w") as out:
        launcher = _launcher(tmp_path, digits, make_config(drills=["hang"], timeout_s=600), stdout=out, stderr=out)
    # Its children running the rank module: on a CI machine the launcher had another child, gone a moment later,
    # taken for its first rank (the test then signalled it before any rank and found none started).
    ranks = lambda: subprocess.run(["pgrep", "-P", str(launcher.pid), "-f", "[-]m peat[.]sdc_drill"], capture_output=True,
                                   text=True).stdout.split()
    # Generous: on a loaded machine (CI with other work) the launcher took over 120 s to start its ranks.
    deadline = time.monotonic() + 600
    while len(ranks()) < ranks_up and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.01)
    assert len(ranks()) >= ranks_up, f"launcher ended ({launcher.poll()}) before its ranks: {log.read_text()[-2000:]}"
    started = ranks()
    launcher.send_signal(signum)
    code = launcher.wait(timeout=60)
    deadline = time.monotonic() + 5
    while any(_running(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in started if _running(pid)]
    for pid in left:  # do not leave them running on failure
        os.kill(int(pid), 9)
    assert len(started) >= ranks_up and code == exit_code
    assert left == [], "worker ranks still running 5 s after the launcher was killed"


def test_every_rank_refusing_to_start_fails_with_their_own_error(digits, tmp_path):
    # It was the 'unexpected end' of the first drill, 'rank exit codes [2, 2]': the cause only in the log.
    config = make_config(world_size=2)
    with pytest.raises(PeatError) as err:
        launch(config, "resnet18", tmp_path / "nope.h5", tmp_path / "out", timeout=300)
    assert str(err.value) == f"sdc drill of model 'resnet18': {tmp_path / 'nope.h5'}: no such file"


def test_launch_takes_a_raw_config_and_validates_it_itself(tmp_path):
    # A raw YAML dict failed with KeyError: 'drills', a default only validation fills in.
    raw = raw_config(world_size=2)
    before = json.dumps(raw, sort_keys=True)
    with pytest.raises(PeatError) as err:  # the ranks started: each refuses the missing data file
        launch(raw, "resnet18", tmp_path / "nope.h5", tmp_path / "out", timeout=300)
    assert str(err.value) == f"sdc drill of model 'resnet18': {tmp_path / 'nope.h5'}: no such file"
    assert json.dumps(raw, sort_keys=True) == before  # validated as a copy: the caller's dict is unchanged
    with pytest.raises(PeatError, match=r"^config key 'sdc.injected_rank': 2 is not below sdc.world_size \(2\)$"):
        launch(raw_config(world_size=2, injected_rank=2), "resnet18", tmp_path / "nope.h5", tmp_path / "out2")


def test_a_drain_marker_no_rank_can_write_fails_with_one_line_naming_it(digits, tmp_path):
    # Every rank's guard refused it at once, but with the peers' exit code 3: the rule's line was the
    # first drill's "unexpected end: rank exit codes [3, 3]", the cause only in the log. A placeholder
    # other than {node} is refused with the config, before any rank starts.
    with pytest.raises(PeatError, match=r"^config key 'sdc.drain_marker': '/x/\{host\}.json': the only placeholder "
                                        r"is \{node\} \(KeyError: 'host'\)$"):
        make_config(policy="stop", drain_marker="/x/{host}.json")
    (tmp_path / "file").touch()
    marker = tmp_path / "file" / "{node}.json"
    with pytest.raises(PeatError) as err:
        launch(make_config(world_size=2, steps=2, injection_step=1, drills=["clean"], policy="stop",
                           drain_marker=str(marker)), "resnet18", digits, tmp_path / "out", timeout=300)
    assert str(err.value) == (f"sdc drill of model 'resnet18': sdc.Guard: drain_marker='{marker}': cannot create "
                              f"its folder ([Errno 17] File exists: '{marker.parent}') (rank 0 on node "
                              f"{sdc.node_name()})")


def test_a_seed_past_32_bits_is_refused_in_one_line_and_faults_draw_as_peats_errors(tmp_path):
    # The top-level seed feeds numpy's global seed (32 bits): refused before any rank starts, as every
    # stage refuses it. A drill's fault draws as every other injected error (peat.errors.seeded): torch's
    # manual_seed keeps a seed's low 32 bits only, so seeds 2**32 apart drew the same fault.
    from peat import errors
    from peat.sdc_drill import Fault

    with pytest.raises(PeatError, match=r"^config key 'seed': 4294967296 is greater than the maximum of 4294967295$"):
        launch(raw_config(world_size=2) | {"seed": 2**32}, "resnet18", tmp_path / "nope.h5", tmp_path / "out")
    t = torch.randn(256, generator=torch.Generator().manual_seed(0))
    spec = {"weight_flip": "bit_flip:mantissa"}
    drawn = {seed: Fault("weight_flip", torch.nn.Linear(2, 2), 0, spec, seed)._corrupt(t) for seed in (0, 2**32)}
    assert torch.equal(drawn[2**32], errors.parse("bit_flip:mantissa").apply(t, errors.seeded(2**32)))
    assert torch.equal(drawn[0], errors.parse("bit_flip:mantissa").apply(t, torch.Generator().manual_seed(0)))
    assert not torch.equal(drawn[0], drawn[2**32])


def test_benchmark_audits_with_the_configured_tolerance(one_rank, digits, monkeypatch):
    # Where replays are not bit-exact (heterogeneous nodes), sdc.audit_tolerance lets the drills pass, but
    # --bench built its guard bit-exact: its first audit raised SDCError, a traceback from every rank.
    from peat import sdc_drill
    from peat.data import load

    config = make_config(audit_tolerance=1e-5)
    loss = sdc_drill.Trainer.loss

    def replayed_one_ulp_off(self, module, step, rank):  # as another node's kernels would round
        value = loss(self, module, step, rank)
        return value if module is self.ddp else value * (1 + 2**-23)

    monkeypatch.setattr(sdc_drill.Trainer, "loss", replayed_one_ulp_off)
    result = sdc_drill.benchmark(config["models"]["resnet18"], load(digits), config["sdc"], 0, torch.device("cpu"),
                                 steps=4)
    assert result["steps"] == 4 and result["audit_s"] > 0


# The drill worker, rank 1 given a data file that does not exist (a node without it).
MISSING_ON_ONE_NODE = """
import os, sys
from peat import sdc_drill
if os.environ["SLURM_PROCID"] == "1":
    sys.argv[sys.argv.index("--data") + 1] = "/nowhere/digits.h5"
sys.exit(sdc_drill.main(sys.argv[1:]))
"""


def test_ranks_left_waiting_for_a_rank_that_refused_to_start_fail_as_its_peers(digits, tmp_path):
    # Rank 0 waited to join the process group, then died with torch's DistStoreError traceback (exit 1):
    # the launcher read [1, 2] as a crash, not rank 1's refusal (as for nccl with fewer GPUs than ranks).
    from peat.sdc_drill import _check_started

    config = _config_file(tmp_path, world_size=2, drills=["clean"], timeout_s=2)
    ranks = _srun_like(["--config", str(config), "--model", "resnet18", "--data", str(digits), "--out",
                        str(tmp_path / "out")], 2, tmp_path, timeout=120, entry=("-c", MISSING_ON_ONE_NODE))
    assert [r.returncode for r in ranks] == [EXIT_PEER, 2], ranks[0].stdout[-2000:]
    assert re.fullmatch(r"peat sdc drill: error: rank 0: joining the process group at 127\.0\.0\.1:\d+ failed: a peer "
                        r"rank did not join within sdc\.timeout_s, or the address cannot be reached \(.+\)",
                        ranks[0].stdout.strip().splitlines()[-1])
    with pytest.raises(PeatError, match=r"^what: /nowhere/digits.h5: no such file$"):
        _check_started("what", [RankEnd(r.returncode, r.stdout) for r in ranks])


def test_a_share_too_small_for_batch_norm_fails_with_one_line_naming_the_batch(digits, tmp_path):
    # Two ranks sharing a batch of 2 train on one example each: batch norm refuses it at the
    # first step, on every rank, with torch's traceback and exit 1 ('unexpected end' of the drill).
    with pytest.raises(PeatError) as err:
        launch(make_config(world_size=2, batch_size=2), "resnet18", digits, tmp_path / "out", timeout=300)
    assert str(err.value).startswith("sdc drill of model 'resnet18': config key 'sdc.batch_size': batches of 1 leave "
                                     "a batch norm layer one value per channel in training (Expected more than 1")


@pytest.mark.parametrize("ends, expected", [
    (_ends(2, 2, 2, output="x\npeat sdc drill: error: bad\n"), "what: bad"),
    ([RankEnd(2, "peat sdc drill: error: local rank 0 sees 0 GPU(s)"), RankEnd(2, "usage: ...\nprog: error: no --out")],
     "what: rank 0: local rank 0 sees 0 GPU(s); rank 1: prog: error: no --out"),
    # Uneven shards of sdc.batch_size 4 on 3 ranks (1, 1, 2): batch norm refuses the two of one example
    # at the first step, and the third fails as their peer; the line was 'unexpected end ... [2, 2, 3]'.
    ([*_ends(2, 2, output="peat sdc drill: error: config key 'sdc.batch_size': batches of 1 leave"),
      RankEnd(EXIT_PEER, f"peat sdc drill: error: rank 2: collective 'x' failed: {PEER_FAILED}")],
     "what: config key 'sdc.batch_size': batches of 1 leave"),
    (_ends(2, 1, 3, output="peat sdc drill: error: bad"), None),  # a crash among them: a drill's end, checked as such
])
def test_refusal_to_start_is_read_from_every_rank(ends, expected):
    from peat.sdc_drill import _check_started

    if expected is None:
        _check_started("what", ends)
        return
    with pytest.raises(PeatError) as err:
        _check_started("what", ends)
    assert str(err.value) == expected


def test_nonfinite_gradients_on_every_rank_blame_the_run_not_a_rank(tmp_path):
    """The loss blows up on every replica at step 1 (divergence): one alarm, not localized, so
    that a stop policy drains no node."""
    (alarm,) = _run_guarded_loop(tmp_path, audit_every=0, diverge=True)
    step, check, suspects, detail = alarm
    assert (step, check, suspects, detail["flags"]) == (1, "nonfinite", [0, 1, 2], [1, 1, 1])
    assert detail["note"].startswith("every rank has non-finite gradients")
    # The printed / raised line says so too, not only the events file.
    message = sdc.Event(step, check, suspects, ["n0"], False, detail).message()
    assert message.endswith("rank(s) [0, 1, 2] on node(s) n0 (NOT localized: every rank has non-finite gradients: "
                            "the run diverged or the data is bad; no faulty rank)")


@pytest.mark.parametrize("world, dtype, comm_hook, huge, fused", [
    (2, "float32", "fp16_compress_hook", 1e5, None),  # the hook's cast to float16 overflows
    (3, "float16", None, 65504.0, None),  # DDP's own mean: 65504 / 3 rounds up to 21840, 3 x 21840 overflows
    (3, "float16", None, 65504.0, True),  # the same mean in the guard's comm hook, read per bucket
])
def test_overflow_in_the_all_reduce_anywhere_skips_the_step(tmp_path, world, dtype, comm_hook, huge, fused):
    """Every rank's local gradient is finite, the all-reduced one is Inf at a non-first element. Only the
    first elements were read: no alarm, ever, and the optimizer wrote -Inf into every replica's bias."""
    alarms = _run_guarded_loop(tmp_path, world, audit_every=0, dtype=dtype, comm_hook=comm_hook, huge=huge,
                               fused=fused)
    assert alarms == [[1, "nonfinite", list(range(world)),
                       {"flags": [0] * world, "note": "only the all-reduced gradient is non-finite (overflow in the sum)"}]]


def test_unknown_drill_on_the_command_line_stops_before_any_rank_trains(tmp_path, monkeypatch, capsys):
    # It used to be found only by the injected rank, after the drills before it had run: its peers
    # then failed with 'a peer rank died', exit code 3.
    from peat.sdc_drill import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    config = _config_file(tmp_path)
    code = main(["--config", str(config), "--model", "resnet18", "--data", str(tmp_path / "d.h5"),
                 "--out", str(tmp_path / "out"), "--drills", "clean,nan_grd"])
    assert code == 2
    assert "--drills: unknown drill 'nan_grd'; allowed: clean, nan_grad" in capsys.readouterr().err


@pytest.mark.parametrize("content, error", [
    (b"sdc: {steps: [1\n", "{path}: not valid YAML (expected ',' or ']', but got '<stream end>' at line 2)"),
    (b"\xff\xfeseed: 0\n", "{path}: not a YAML or JSON config (byte 0xff at offset 0 is not UTF-8 text)"),
    # The workflow refuses it; the worker kept the last without a word.
    (b"seed: 0\nseed: 1\n", "config key 'seed' is given twice in {path} (again at line 2); rename or remove one"),
    (None, "{path}: is a folder; name the config file"),
])
def test_a_config_file_the_worker_cannot_read_is_one_line(tmp_path, monkeypatch, capsys, content, error):
    # Each was a traceback from every rank (srun python -m peat.sdc_drill --config ...).
    from peat.sdc_drill import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    path = tmp_path / "config.yaml"
    path.mkdir() if content is None else path.write_bytes(content)
    code = main(["--config", str(path), "--model", "resnet18", "--data", str(tmp_path / "d.h5"),
                 "--out", str(tmp_path / "out")])
    assert (code, capsys.readouterr().err) == (2, f"peat sdc drill: error: {error.format(path=path)}\n")


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys):
    # Under a file: rank 0 died with a traceback making events/ at the first drill, and its peers with
    # gloo's "Connection closed by peer" traceback from the guard's first gather; launch() with a traceback.
    from peat.sdc_drill import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    (tmp_path / "file").touch()
    out = tmp_path / "file" / "out"
    expected = f"{out}: cannot make the output folder ([Errno 20] Not a directory: '{out}')"
    code = main(["--config", str(_config_file(tmp_path)), "--model", "resnet18", "--data", str(tmp_path / "nope.h5"),
                 "--out", str(out)])
    assert (code, capsys.readouterr().err) == (2, f"peat sdc drill: error: {expected}\n")
    with pytest.raises(PeatError) as err:
        launch(make_config(), "resnet18", tmp_path / "nope.h5", out)
    assert str(err.value) == expected


def test_missing_dataset_is_one_line_from_every_rank(tmp_path, monkeypatch, capsys):
    # It was read after the process group was joined, outside the error handling: a traceback per rank.
    from peat.sdc_drill import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    code = main(["--config", str(_config_file(tmp_path)), "--model", "resnet18", "--data", str(tmp_path / "nope.h5"),
                 "--out", str(tmp_path / "out")])
    assert code == 2
    assert capsys.readouterr().err == f"peat sdc drill: error: {tmp_path / 'nope.h5'}: no such file\n"


def test_a_data_file_of_another_dataset_is_one_line(tmp_path, monkeypatch, capsys):
    # srun ... --model resnet18 --data results/data/pydoc.h5: every rank joined, then died building the model
    # (KeyError: 'num_classes'), or trained on whatever images the file held.
    from peat.sdc_drill import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    other = tmp_path / "other.h5"
    prepare("other", {"source": "digits", "image_size": 8, "val_fraction": 0.2, "labels": "class", "seed": 0}, other)
    code = main(["--config", str(_config_file(tmp_path)), "--model", "resnet18", "--data", str(other),
                 "--out", str(tmp_path / "out")])
    assert (code, capsys.readouterr().err) == (2, f"peat sdc drill: error: {other}: dataset 'other', but model "
                                                  "'resnet18' trains on dataset 'digits' (models.resnet18.dataset)\n")


@pytest.mark.parametrize("setting, stale", [
    ({"image_size": 16}, "image_size 8 (config: 16)"),
    ({"labels": "parity"}, "labels 'class' (config: 'parity')"),
    ({"image_size": 16, "labels": "parity"}, "image_size 8 (config: 16); labels 'class' (config: 'parity')"),
    ({"val_fraction": 0.3}, "val_fraction 0.2 (config: 0.3)"),
    ({"seed": 1}, "seed 0 (config: 1)"),  # the file records its settings: another seed passed, shapes alike
])
def test_a_data_file_prepared_with_other_settings_is_one_line(digits, tmp_path, monkeypatch, capsys, setting, stale):
    # srun ... --data results/data/digits.h5 made by an older config: every rank drilled it without a word.
    from peat.sdc_drill import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    config = make_config()
    args = ["--config", str(tmp_path / "config.json"), "--model", "resnet18", "--data", str(digits),
            "--out", str(tmp_path / "out")]
    write_json(tmp_path / "config.json", config)
    assert (main(args), capsys.readouterr().err) == (2, "peat sdc drill: error: not launched by torchrun or srun "
                                                        "(RANK and SLURM_PROCID are unset)\n")  # past the data's check
    config["datasets"]["digits"] |= setting
    write_json(tmp_path / "config.json", config)
    assert (main(args), capsys.readouterr().err) == (2, f"peat sdc drill: error: {digits}: not prepared with the settings of "
                                                    f"dataset 'digits' (datasets.digits): {stale}; prepare it again "
                                                    "from this config\n")

def test_a_data_file_without_recorded_settings_is_refused_in_one_line(digits, tmp_path, monkeypatch, capsys):
    # A file prepared by an older peat records no settings: compared by what it held, one prepared with
    # another seed, path or part was drilled; it is refused, with the command that prepares it again.
    from peat.sdc_drill import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    old = tmp_path / "digits.h5"
    old.write_bytes(digits.read_bytes())
    with h5py.File(old, "r+") as f:
        del f.attrs["settings"]
    config = _config_file(tmp_path)
    code = main(["--config", str(config), "--model", "resnet18", "--data", str(old), "--out", str(tmp_path / "out")])
    assert (code, capsys.readouterr().err) == (
        2, f"peat sdc drill: error: {old}: prepared by an older peat (no 'settings' attribute); prepare it again "
           f"(rule prepare_dataset): snakemake --cores 1 --force results/data/digits.h5 --configfile {config}\n")


def test_a_data_file_whose_text_changed_under_the_same_settings_is_one_line(tmp_path):
    # The path is the same, its file is not: only the split's sizes can tell, and the line says so.
    from peat.data import load
    from peat.sdc_drill import _check_prepared

    text, out = tmp_path / "corpus.txt", tmp_path / "corpus.h5"
    text.write_bytes(bytes(range(32, 127)) * 2)
    spec = {"source": "text", "path": str(text), "seq_len": 8, "val_fraction": 0.25, "seed": 0}
    prepare("corpus", spec, out)
    _check_prepared(out, load(out), "corpus", spec, "config.yaml")
    text.write_bytes(text.read_bytes() * 2)
    with pytest.raises(PeatError) as err:
        _check_prepared(out, load(out), "corpus", spec, "config.yaml")
    assert str(err.value) == (f"{out}: not prepared with the settings of dataset 'corpus' (datasets.corpus): 17 "
                              "training and 6 validation examples (config: 35 and 12; the text it was prepared from "
                              "differs); prepare it again from this config")


def test_nccl_without_a_gpu_for_the_rank_is_one_line(monkeypatch):
    from peat.sdc_drill import init_distributed

    local = torch.cuda.device_count()  # one past the last GPU (0 on a CPU-only machine)
    monkeypatch.setenv("RANK", str(local))
    monkeypatch.setenv("LOCAL_RANK", str(local))
    with pytest.raises(PeatError, match=rf"config key 'sdc.backend': nccl needs one GPU per rank of a node; "
                                         rf"local rank {local} sees {local} GPU\(s\)"):
        init_distributed("nccl", 5)


@pytest.mark.parametrize("env, launched", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "2 rank(s) were launched (WORLD_SIZE)"),  # torchrun --nproc-per-node 2
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1"}, "2 rank(s) were launched (SLURM_NTASKS)"),
])
def test_ranks_launched_unlike_the_configured_world_size_are_one_line(monkeypatch, env, launched):
    # srun --ntasks 2 with sdc.world_size 3 and injected_rank 2: no rank injected the fault, and every
    # drill JSON said "detected": false, "world_size": 2, with no word of the mismatch.
    from peat.sdc_drill import init_distributed

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):  # restored after
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(PeatError) as err:
        init_distributed("gloo", 5, 3)
    assert str(err.value) == (f"config key 'sdc.world_size': 3, but {launched}: launch sdc.world_size ranks, "
                              "or set it to the number launched")
    assert not torch.distributed.is_initialized()


def test_bench_times_as_many_ranks_as_launched(digits, tmp_path):
    # .ci/gpu times one rank per GPU (torchrun --nproc-per-node 1) with the config's sdc.world_size of 3:
    # only the drills, whose injected rank and batch bounds are for sdc.world_size ranks, need that many.
    config = _config_file(tmp_path, bench_steps=4)
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "1",
                           "-m", "peat.sdc_drill", "--bench", "--config", str(config), "--model", "resnet18",
                           "--data", str(digits), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (bench["world_size"], bench["steps"]) == (1, 4)


@pytest.mark.parametrize("gpus, backend", [(0, "gloo"), (1, "gloo"), (2, "gloo"), (3, "nccl"), (4, "nccl")])
def test_auto_backend_takes_nccl_only_with_a_gpu_per_local_rank(monkeypatch, gpus, backend):
    # NCCL refuses two ranks on one GPU: 3 drill ranks on a one-GPU workstation must run on gloo.
    from peat.sdc_drill import _slurm_local_tasks, _uses_cuda

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert ("nccl" if _uses_cuda("auto", 3) else "gloo") == backend
    assert _uses_cuda("nccl", 3) and not _uses_cuda("gloo", 3)
    assert [_slurm_local_tasks(env) for env in ({}, {"SLURM_NTASKS_PER_NODE": "3"},
                                                {"SLURM_NTASKS_PER_NODE": "4(x2),2"},
                                                {"SLURM_NTASKS_PER_NODE": "2(x3),5"})] == [1, 3, 4, 5]


def test_single_failed_audit_blames_a_rank_that_repeats_its_own_fault(tmp_path):
    # Rank 1 computes its own micro-batch wrongly (and would again on a rerun), its peer's rightly:
    # only the audit 0 -> 1 fails. A rerun on rank 1 agreed with its own report and blamed rank 0.
    (alarm,) = _run_guarded_loop(tmp_path, data_dependent=True)
    assert alarm[:3] == [2, "audit", [1]] and alarm[3]["failed_audits"] == [[0, 1]]


def test_ddp_join_for_uneven_inputs_is_one_line(one_rank):
    # The rank with fewer batches joined and shadowed DDP's all-reduces only: its peers waited in the guard's
    # weight gather until the process group's timeout, then failed with gloo's 'Timed out waiting ... recv'.
    from torch.nn.parallel import DistributedDataParallel

    guard = sdc.Guard(DistributedDataParallel(torch.nn.Linear(4, 2)))
    guard.begin_step(0)
    with pytest.raises(PeatError, match=r"^sdc.Guard: DDP's join\(\) \(uneven inputs\) cannot be guarded: a rank that "
                                        r"has joined runs none of the guard's collectives; give every rank the same "
                                        r"number of steps \(drop or pad the last uneven batches\)$"):
        with guard.ddp.join():
            guard.ddp(torch.ones(3, 4)).sum().backward()
    with guard.ddp.join(enable=False):  # off: DDP's plain step
        guard.ddp(torch.ones(3, 4)).sum().backward()
    assert guard.check_gradients()


def test_audit_with_a_grad_scaler_compares_the_scaled_gradients(one_rank):
    # README's recipe: the replay returns the loss scaled as for the backward; the unscaled loss fails the audit.
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = torch.randn(6, 4)
    loss_of = lambda module: module(x).square().mean()  # noqa: E731
    for step, replay in enumerate([lambda r: scaler.scale(loss_of(guard.module)), lambda r: loss_of(guard.module)]):
        guard.begin_step(step)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_of(guard.ddp)).backward()
        assert guard.check_gradients(replay=replay)
        scaler.step(optimizer)
        scaler.update()
        guard.check_weights()
    guard.finish()
    assert [(alarm.step, alarm.check) for alarm in guard.alarms] == [(1, "audit")]


# Two data-parallel groups, {0, 1} and {2, 3}, each training its own model (another parallel dimension's shard).
TWO_GROUPS = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from peat import sdc

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
group = groups[dist.get_rank() // 2]
torch.manual_seed(dist.get_rank() // 2)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
ddp = DistributedDataParallel(model, process_group=group)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
guard = sdc.Guard(ddp, audit_every=1)  # no group: DDP's
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
loss_of = lambda module, r: module(x[sdc.shard(range(8), r, 2)]).square().mean()
for step in range(3):
    guard.begin_step(step)
    optimizer.zero_grad(set_to_none=True)
    loss_of(ddp, guard.rank).backward()
    if guard.check_gradients(replay=lambda r: loss_of(guard.module, r)):
        optimizer.step()
    guard.check_weights()
guard.finish()
with open(f"{sys.argv[1]}/rank{dist.get_rank()}", "w") as f:  # the ranks' stdout lines may interleave
    f.write(f"ALARMS {dist.get_rank()} {guard.rank} {guard.world} {json.dumps([[e.step, e.check] for e in guard.alarms])}")
dist.barrier()
dist.destroy_process_group()
"""


def test_guard_of_a_ddp_over_a_subgroup_checks_that_group(tmp_path):
    # Built without group=, the guard compared the replicas of every rank in the world: the other group's
    # model differs, an unlocalized fingerprint alarm at every step (policy stop: exit 65 at step 0).
    script = tmp_path / "two_groups.py"
    script.write_text(TWO_GROUPS)
    _torchrun(script, 4, str(tmp_path))
    lines = [(tmp_path / f"rank{r}").read_text() for r in range(4)]
    assert lines == [f"ALARMS {r} {r % 2} 2 []" for r in range(4)]


def test_a_guard_kept_for_many_steps_keeps_a_bounded_record_of_its_costs(one_rank):
    # Every check's time of every step was kept for the median: memory growing with the training's length.
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(2, 1)
    guard = sdc.Guard(DistributedDataParallel(model), audit_every=1)
    x = torch.ones(3, 2)
    for step in range(sdc.TIMED_STEPS + 5):
        guard.begin_step(step)
        guard.ddp(x).sum().backward()
        assert guard.check_gradients(replay=lambda r: guard.module(x).sum())
        guard.check_weights()
        model.zero_grad(set_to_none=True)
    guard.finish()
    assert {check: len(times) for check, times in guard.timers.items()} == dict.fromkeys(sdc.CHECKS, sdc.TIMED_STEPS)
    assert guard.alarms == [] and all(cost > 0 for cost in guard.costs().values())
    assert guard.spent > sum(sum(times) for times in guard.timers.values())


def test_launch_time_limit_grows_with_the_steps():
    """The launcher's limit was 600 s + 4 timeouts per drill whatever sdc.steps said: a long healthy
    drill of a large model was stopped as 'did not finish within the launcher's time limit'."""
    from peat.sdc_drill import launch_timeout

    cfg = {"steps": 12, "bench_steps": 20, "timeout_s": 120, "drills": ["nan_grad", "weight_flip"]}
    assert launch_timeout(cfg) == 600 + (4 + 12) * 120 * 2
    assert launch_timeout(cfg | {"steps": 100}) == 600 + (4 + 100) * 120 * 2
    # The drills' limit read sdc.bench_steps, which only --bench reads; --bench, which runs no drill,
    # was allowed its time once per configured drill.
    assert launch_timeout(cfg | {"bench_steps": 400}) == launch_timeout(cfg)
    assert launch_timeout(cfg, bench=True) == 600 + (4 + 40) * 120
