"""Playback FI, Detector verdicts, Analyzer outputs and the detector benchmark on real recorded
contexts: a tiny model trained a few steps under the real Profiler, and the test workflow."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.text import Text
from torch import nn

from conftest import DEVICES, REPO, needs_gpu, tiny_gpt2_golden
from peat import analyze, detect, errors, kernels, playback
from peat.io import PeatError
from peat.profiler import Profiler, read_layer

torch.set_num_threads(1)
LAYERS = ["0", "1", "4", "5", "6"]  # conv2d, batch_norm, linear, layer_norm, linear
OPS = {"0": "conv2d", "1": "batch_norm", "4": "linear", "5": "layer_norm", "6": "linear"}
ERRORS = ["rv:2", "lane:4", "nan:1"]


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """A real context: 3 recorded training steps of a small conv/bn/linear/ln network."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 24), nn.LayerNorm(24), nn.Linear(24, 5))
    return recorded(model, tmp_path_factory.mktemp("ctx") / "context.h5", LAYERS, steps=3, batch=16,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def recorded(model: nn.Module, path, layers: list[str], *, steps: int, batch: int, optimizer=None):
    """``path``: ``layers`` of ``model`` recorded over ``steps`` training steps on random 3 x 6 x 6
    images of 5 classes (updated by ``optimizer``, if given)."""
    prof = Profiler(path, layers, every=1, meta={"model": "tiny", "config_hash": "h1", "vendor": "cpu"})
    prof.attach(model)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        prof.begin_step(step, 1)
        model.zero_grad()
        x, y = torch.randn(batch, 3, 6, 6, generator=g), torch.randint(0, 5, (batch,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        prof.end_step()
        if optimizer is not None:
            optimizer.step()
    prof.close()
    return path


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def replay(context, op="linear", kernel=None, **kw):
    plan = playback.Plan(context=context, kernel=kernel or kernels.golden(op), errors=kw.pop("errors", ERRORS),
                         meta={"model": "tiny", "vendor": "cpu", "kernel": "k"}, **kw)
    return playback.replay(plan)


def test_one_row_per_tensor_per_case_and_context_untouched(context):
    before, mtime = digest(context), context.stat().st_mtime_ns
    table, record = replay(context, "linear")
    assert digest(context) == before and context.stat().st_mtime_ns == mtime
    cases = ["kernel", *ERRORS, "ref:fp16", "ref:bf16", "ref:tf32", "ref:fp64"]
    # Layers 4 and 6 (linear) x 3 steps x 3 computations x cases, all at the kernel output.
    assert len(table) == 2 * 3 * 3 * len(cases)
    assert set(table["case"]) == set(cases) and set(table["fop"]) == {"output"}
    assert table.groupby(["layer", "step", "computation", "case"]).size().eq(1).all()
    assert dict(zip(table["computation"], table["tensor"])) == {"forward": "O", "input_grad": "dA", "weight_grad": "dW"}
    assert record["layers"] == ["4", "6"] and record["outcome"]["status"] == "ok"
    t = record["timings"]
    assert t["kernel_s"] > 0 and t["kernel_s"] + t["score_s"] + t["io_s"] <= t["wall_s"]
    assert t["kernel_fraction"] == pytest.approx(t["kernel_s"] / t["wall_s"], rel=1e-3)
    # Golden replayed on the recorded inputs reproduces the recorded forward output.
    own = table[(table["case"] == "kernel") & (table["computation"] == "forward")]
    assert (own["golden_vs_recorded"] == 0).all() and (own["err_max"] == 0).all()
    ref = table[table["case"] == "ref:fp64"]
    assert ((ref["rel_top10"] > 0.2) & (ref["rel_top10"] < 5)).all()


@pytest.mark.parametrize("given, said", [
    ({"computations": ("forward", "fwd")}, "playback.Plan: computations holds 'fwd'; each is one of forward, "),
    ({"max_samples": 0}, "playback.Plan: max_samples=0: steps replayed per layer need an integer >= 1"),
    ({"max_samples": 1.5}, "playback.Plan: max_samples=1.5: "),
    ({"layers": "fc"}, "playback.Plan: layers='fc': a list is expected, e.g. ['fc']"),
    ({"errors": "rv:1"}, "playback.Plan: errors='rv:1': a list is expected"),
    ({"layers": []}, "playback.Plan: layers is empty: nothing would be replayed (None: every recorded layer"),
    ({"computations": ()}, "playback.Plan: computations is empty: nothing would be replayed"),
    ({"timeout": 0}, "playback.Plan: timeout=0: seconds per kernel call need a number > 0"),
    ({"timeout": None}, "playback.Plan: timeout=None: "),
    ({"timeout": math.inf}, "playback.Plan: timeout=inf: seconds per kernel call need a number > 0 and <= 31536000"),
    ({"timeout": 1e12}, "playback.Plan: timeout=1000000000000.0: seconds per kernel call need a number > 0 and <= "),
    ({"memory_mb": 0}, "playback.Plan: memory_mb=0: extra MiB the isolated first call may map need an integer >= 16"),
])
def test_a_plan_refuses_bad_settings_in_one_line(context, given, said):
    """Unchecked outside the workflow's config schema: a misspelt computation ended the replay in a
    KeyError, max_samples=0, layers=[] or computations=() replayed nothing and its verdict passed as
    not applicable, a string was read letter by letter (layers="fc": no recorded layer matches 'f'), and
    timeout=0 failed a correct kernel as a timeout (timeout=None: a TypeError after the probes; math.inf,
    "no limit", or 1e12 overflowed the interval timer of each call after the probe: a `crash` verdict)."""
    with pytest.raises(PeatError, match=re.escape(said)):
        playback.Plan(context=context, kernel=kernels.golden("linear"), **given)


def test_a_plan_refuses_a_faulty_kernel_whose_computation_it_does_not_replay(context):
    """A kernel faulty in its weight gradient, replayed in its forward alone, passed as none: its
    error was never injected, and no record field said so."""
    faulty = errors.faulty(kernels.golden("linear"), "rv:3", "weight_grad")
    with pytest.raises(PeatError, match=re.escape(
            "playback.Plan: kernel 'mine' (kernels.mine.computation): weight_grad is not in playback.computations "
            "(forward, input_grad), so playback never injects its error 'rv:3'; playback.computations must include it")):
        playback.Plan(context=context, kernel=faulty, computations=("forward", "input_grad"), meta={"kernel": "mine"})
    assert playback.Plan(context=context, kernel=faulty, computations=("weight_grad",)).kernel is faulty


def test_first_layer_has_no_input_gradient_rows(context):
    table, _ = replay(context, "conv2d", errors=[])
    assert set(table.loc[table["layer"] == "0", "computation"]) == {"forward", "weight_grad"}


def test_a_verdict_on_nothing_replayed_says_why(context, tmp_path):
    """The first layer alone, its input gradient alone: the layer is recorded, nothing applies."""
    table, record = replay(context, "conv2d", errors=[], computations=("input_grad",))
    assert table.empty and record["layers"] == ["0"]
    playback.write(table, record, tmp_path / "t.parquet", tmp_path / "t.json")
    got = detect.run_job(tmp_path / "t.parquet", tmp_path / "t.json", tmp_path / "v.json")
    assert got["verdict"] == "pass" and got["evidence"]["applicable"] is False
    assert "(0)" in got["evidence"]["reason"] and "no sample" in got["evidence"]["reason"]


def branchy_context(path):
    """A recorded layer on a conditional branch: of steps 0, 1 and 2, ``b`` runs at 1 only. The
    Profiler keeps its weights at every recorded step, its inputs only where it ran."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(4, 4)

        def forward(self, x, use_b):
            return self.b(self.a(x)) if use_b else self.a(x)

    torch.manual_seed(0)
    model = Branchy()
    prof = Profiler(path, ["a", "b"], every=1, meta={"model": "tiny", "config_hash": "h1", "vendor": "cpu"})
    prof.attach(model)
    for step in range(3):
        prof.begin_step(step, 1)
        model.zero_grad()
        model(torch.randn(3, 8), use_b=step == 1).sum().backward()
        prof.end_step()
    prof.close()
    return path


def test_steps_at_which_a_layer_did_not_run_are_not_replayed(tmp_path):
    table, _ = replay(branchy_context(tmp_path / "context.h5"), "linear", errors=["rv:1"])
    assert sorted(set(table.loc[table["layer"] == "b", "step"])) == [1]
    assert sorted(set(table.loc[table["layer"] == "a", "step"])) == [0, 1, 2]


@pytest.mark.parametrize("max_samples", [1, 2])
def test_the_steps_replayed_are_spaced_over_those_at_which_the_layer_ran(tmp_path, max_samples):
    """Spaced over every recorded step, b's were 0 (and 2), where it did not run: nothing was
    replayed, and a faulty kernel passed as not applicable."""
    table, record = replay(branchy_context(tmp_path / "context.h5"), "linear", errors=[], layers=["b"],
                           max_samples=max_samples, kernel=errors.faulty(kernels.golden("linear"), "rv:2"))
    assert sorted(set(table["step"])) == [1]
    assert detect.judge(table, record)["verdict"] == "fail"


def test_one_step_replayed_is_the_last_where_a_bias_added_twice_shows(tmp_path):
    """With max_samples_per_layer: 1 the one step replayed was the first, whose bias is still zero
    (as a freshly built network's norm biases are): a kernel adding it twice computed golden's
    values exactly and passed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 5))
    nn.init.zeros_(model[1].bias)
    context = recorded(model, tmp_path / "context.h5", ["1"], steps=3, batch=16,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    kernel = tmp_path / "twice.py"
    kernel.write_text("import torch\ndef forward(x, weight, bias):\n"
                      "    return torch.nn.functional.linear(x, weight, bias) + bias\n")
    table, record = replay(context, kernel=kernels.load(str(kernel), "linear"), errors=[],
                           computations=("forward",), max_samples=1)
    assert set(table["step"]) == {2}
    got = detect.judge(table, record)
    assert got["verdict"] == "fail" and got["error_model"] == "block_structured"


def test_replay_reads_one_recorded_step_at_a_time(context, monkeypatch):
    """A layer's samples are read as they are replayed, not all its steps at once: with
    max_samples_per_layer: null those are every recorded step's weight and activations."""
    read = []

    def spy(path, layer, steps=None, derive=True):
        read.append(math.inf if steps is None else len(steps))
        return playback_read_layer(path, layer, steps, derive)

    playback_read_layer = playback.read_layer
    monkeypatch.setattr(playback, "read_layer", spy)
    table, _ = replay(context, "linear", errors=[])
    assert len(set(table["step"])) == 3 and read and max(read) <= 1


def test_replay_is_deterministic(context):
    a, _ = replay(context, "layer_norm")
    b, _ = replay(context, "layer_norm")
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("op", ["conv2d", "batch_norm", "linear", "layer_norm"])
def test_verdicts_on_golden_and_faulty_kernels(context, op):
    table, _ = replay(context, op)
    ok = detect.verdict(table)
    assert ok["verdict"] == "pass" and ok["error_model"] == "none" and 0 < ok["confidence"] <= 1
    assert ok["evidence"]["pseudo_errors"]["lane:4"]["forward"] == "periodic_lane"
    assert ok["evidence"]["pseudo_errors"]["nan:1"] == {c: "non_finite" for c in ok["evidence"]["pseudo_errors"]["nan:1"]}
    bad, _ = replay(context, kernel=errors.faulty(kernels.golden(op), "rz:2", "weight_grad", seed=1), errors=[])
    got = detect.verdict(bad)
    assert got["verdict"] == "fail" and got["error_model"] == "random_zero"
    assert {(r["pass"], r["error_model"]) for r in got["layers"]} >= {("weight_grad", "random_zero"),
                                                                     ("forward", "none")}
    assert got["evidence"]["baselines"]["allclose"]["verdict"] == "fail"


def test_reduced_precision_is_accepted_unless_configured(context):
    table, _ = replay(context, kernel=kernels.load("peat.alt_kernels.bf16_gemm", "linear"), errors=[])
    assert detect.verdict(table)["error_model"] == "reduced_precision"
    assert detect.verdict(table)["verdict"] == "pass"
    assert detect.verdict(table, detect.Rules(accept_reduced_precision=False))["verdict"] == "fail"


def test_a_verdict_judges_with_the_rules_playback_scored_the_table_with(context):
    """judge(table, record, rules=Rules(k32=16)) on a table scored with k32 = 8 named k32 = 16 in
    its evidence and applied 8 (the envelopes, S and G are measured in playback); judge(table,
    record) named the defaults whatever playback had used. The record keeps its rules now."""
    wide = detect.Rules(k32=16)
    table, record = replay(context, errors=[], layers=["4"], computations=("forward",), rules=wide)
    assert record["rules"] == dataclasses.asdict(wide)
    assert detect.judge(table, record)["evidence"]["rules"] == dataclasses.asdict(wide)
    strict = dataclasses.replace(wide, accept_reduced_precision=False)  # the verdict's own setting may differ
    assert detect.judge(table, record, strict)["evidence"]["rules"]["accept_reduced_precision"] is False
    with pytest.raises(PeatError, match=r"scored with detect.k32=16 \(given 8.0\); replay with playback.Plan"):
        detect.judge(table, record, detect.Rules())
    record.pop("rules")  # a record written before playback kept them: the rules asked, as before
    assert detect.judge(table, record, detect.Rules(cover=0.95))["evidence"]["rules"]["cover"] == 0.95


# A batch norm forward as F.batch_norm's, but for its update of the running statistics.
BN_FORWARD = ("import torch\ndef forward(x, weight, bias, *, running_mean, running_var, training, momentum, eps):\n"
              "    out = torch.nn.functional.batch_norm(x, running_mean.clone(), running_var.clone(), weight, bias, "
              "training, momentum, eps)\n")


@pytest.mark.parametrize("update, fails", [
    ("", None),  # golden's own
    ("    pass\n", {"running_mean", "running_var"}),  # never updated
    ("    running_mean.lerp_(x.mean((0, 2, 3)), momentum)\n"  # the biased variance
     "    running_var.lerp_(x.var((0, 2, 3), unbiased=False), momentum)\n", {"running_var"}),
])
def test_a_training_batch_norm_forward_is_scored_on_the_running_statistics_it_updates(context, tmp_path, update,
                                                                                      fails):
    """Playback compared the forward's output only: a kernel updating the running statistics
    wrongly or not at all passed as none, and training then evaluated with them."""
    if update:
        (tmp_path / "bn.py").write_text(BN_FORWARD + update + "    return out\n")
    kernel = kernels.load(str(tmp_path / "bn.py"), "batch_norm") if update else kernels.golden("batch_norm")
    table, _ = replay(context, kernel=kernel, errors=["rv:2", "bf16"])
    forward = table[table["computation"] == "forward"]
    assert forward.groupby(["step", "case"])["tensor"].agg(set).eq({"O", "running_mean", "running_var"}).all()
    assert set(table.loc[table["computation"] != "forward", "tensor"]) == {"dA", "dW"}
    stats = forward[forward["tensor"] != "O"]
    assert stats["golden_vs_recorded"].isna().all() and (forward.loc[forward["tensor"] == "O", "golden_vs_recorded"] == 0).all()
    got = detect.verdict(table)
    failing = {r["tensor"] for r in got["layers"] if not detect.passes(r["error_model"])}
    if fails is None:
        assert got["verdict"] == "pass" and got["error_model"] == "none" and not failing
        # rv:2 injects into the output alone: the statistics are the kernel's; bf16 rounds the batch only.
        own = stats[stats["case"] == "kernel"].drop(columns="case").reset_index(drop=True)
        rv = stats[stats["case"] == "rv:2"].drop(columns="case").reset_index(drop=True)
        pd.testing.assert_frame_equal(own.drop(columns="map"), rv.drop(columns="map"))
        assert set(stats.loc[stats["case"] == "bf16", "error_model"]) <= {"none", "reduced_precision"}
    else:
        assert got["verdict"] == "fail" and failing == fails
    welford = replay(context, kernel=kernels.load("peat.alt_kernels.welford_norm", "batch_norm"), errors=[])[0]
    assert detect.verdict(welford)["error_model"] == "none"


def zero_mean_norm_context(path):
    """A batch norm (layer 3) fed by a batch norm through a bias-free 1 x 1 convolution, as in
    EfficientNet and MobileNetV2: its input has zero mean per channel by construction."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 32, 1, bias=False),
                          nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 36, 5))
    return recorded(model, path, ["3"], steps=2, batch=8)


@pytest.mark.parametrize("alt", ["onepass_norm", "welford_norm"])
def test_a_correct_batch_norm_passes_strict_rules_on_a_running_mean_of_cancelling_values(tmp_path, alt):
    """Golden's float32 sum of the zero-mean channels landed on the exact result (|golden - fp64|
    1e-16), so the fp32 envelope was 1e-15 and the shipped one-pass and Welford norms, off by 1e-9 as
    any other summation order is, read as reduced_precision there: a fail with
    accept_reduced_precision false (EfficientNet-B0's features.2.0.block.0.1 at batch 8)."""
    path = zero_mean_norm_context(tmp_path / "context.h5")
    strict = detect.Rules(accept_reduced_precision=False)
    kernel = kernels.load(f"peat.alt_kernels.{alt}", "batch_norm")
    table, record = replay(path, kernel=kernel, errors=[], computations=("forward",), rules=strict)
    got = detect.judge(table, record)
    assert (got["verdict"], got["error_model"]) == ("pass", "none")
    means = table[(table["tensor"] == "running_mean") & (table["case"] == "kernel")]
    assert len(means) == 2 and (means["err_max"] > 0).all()
    # The floor is float32's resolution of the summed values, far below a stale statistic's error.
    x = torch.cat([s["A"] for s in read_layer(path, "3", [0, 1])[1]])
    assert (means["tau32"] <= strict.k32 * 0.1 * 2.0 ** -23 * float(x.abs().max()) * (1 + 1e-9)).all()


def test_batch_norms_that_update_no_running_statistics_get_no_rows_for_them(tmp_path):
    """In eval mode, or without running statistics (normalising with the batch's), a batch norm's
    forward updates nothing: its output alone is scored."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 8),
                          nn.BatchNorm1d(8), nn.Linear(8, 3))
    path = tmp_path / "context.h5"
    prof = Profiler(path, ["1", "3"], every=1, meta={"model": "tiny", "config_hash": "h1", "vendor": "cpu"})
    prof.attach(model)
    for step in range(2):
        for norm in model[1], model[3]:  # frozen at step 1 (the Profiler records a training model only)
            norm.train(step == 0)
        prof.begin_step(step, 1)
        model.zero_grad()
        model(torch.randn(16, 4)).sum().backward()
        prof.end_step()
    prof.close()
    table, _ = replay(path, "batch_norm", errors=[], computations=("forward",))
    updated = table.groupby(["layer", "step"])["tensor"].agg(set).to_dict()
    assert updated == {("1", 0): {"O"}, ("1", 1): {"O"}, ("3", 0): {"O", "running_mean", "running_var"},
                       ("3", 1): {"O"}}


def test_analyzer_keeps_a_batch_norms_running_statistics_out_of_its_summaries(context, tmp_path):
    """They are rows of the forward's output as well: lane:4's range over layers started at 0 (its
    running statistics, the kernel's own) instead of its output's error."""
    table, _ = replay(context, "batch_norm", errors=["lane:4"], computations=("forward",))
    summary = analyze.analyze(table, context, tmp_path)
    output = analyze.analyze(table[table["tensor"] == "O"], context, tmp_path / "output")
    assert json.dumps(summary, sort_keys=True) == json.dumps(output, sort_keys=True)
    assert set(pd.read_csv(tmp_path / "layers.csv")["tensor"]) == {"O", "running_mean", "running_var"}


def test_bad_contexts_fail_with_one_line(context):
    with pytest.raises(PeatError, match=r"context config_hash is 'h1' but this workflow expects 'h2'") as err:
        replay(context, expect={"config_hash": "h2"})
    assert str(context) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PeatError) as err:
        replay(context, expect={"torch_version": "1.0"})
    assert str(err.value) == (f"{context}: context torch_version is '{torch.__version__}' but this workflow "
                              "expects '1.0'; re-run golden training for this config")
    # Cross-vendor replay: the same torch release built for another GPU stack reads the context.
    release = str(torch.__version__).split("+")[0]
    assert len(replay(context, expect={"torch_version": release + "+rocm6.4"}, errors=[])[0])
    with pytest.raises(PeatError, match=r"no recorded layer matches 'fc'.*kernels.k.layers"):
        replay(context, layers=["fc"])
    with pytest.raises(PeatError, match=r"layer '5' .* is layer_norm, the kernel is linear"):
        replay(context, layers=["5"])
    with pytest.raises(PeatError) as err:
        replay(context.with_name("missing.h5"))
    assert str(err.value) == f"{context.with_name('missing.h5')}: no such file"


def test_crashing_and_hanging_kernels_fail_with_their_outcome(context, tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("def forward(x, weight, bias):\n    raise RuntimeError('boom')\n")
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ndef weight_grad(grad_out, x):\n    time.sleep(30)\n")
    for path, status in ((crash, "crash"), (hang, "timeout")):
        table, record = replay(context, kernel=kernels.load(str(path), "linear"), timeout=2, errors=[])
        assert record["outcome"]["status"] == status
        playback.write(table, record, tmp_path / f"{status}.parquet", tmp_path / f"{status}.json")
        got = detect.run_job(tmp_path / f"{status}.parquet", tmp_path / f"{status}.json", tmp_path / "v.json")
        assert got["verdict"] == "fail" and got["error_model"] == status
        assert got["evidence"]["outcome"]["status"] == status
    assert "boom" in json.loads((tmp_path / "crash.json").read_text())["outcome"]["message"]
    later = tmp_path / "later.py"  # passes its isolated probe, then fails on a later recorded step
    later.write_text("import torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                     "    if len(CALLS) > 1:\n        raise ValueError('step two')\n"
                     "    return torch.nn.functional.linear(x, weight, bias)\n")
    table, record = replay(context, kernel=kernels.load(str(later), "linear"), errors=[], layers=["4"],
                           computations=("forward",))
    playback.write(table, record, tmp_path / "later.parquet", tmp_path / "later.json")
    got = detect.run_job(tmp_path / "later.parquet", tmp_path / "later.json", tmp_path / "v.json")
    assert got["verdict"] == "fail" and got["error_model"] == "crash"
    assert "step two" in got["evidence"]["outcome"]["message"]
    assert detect.judge(table, record) == got  # a library user's verdict, without the files


def test_a_kernel_hanging_after_its_probe_is_a_timeout_not_a_job_waiting_on_it(context, tmp_path):
    """Only the probe was bounded: a kernel hanging at a later step held the job until it returned
    (forever, for a real hang), and one that did return passed. Once it timed out, it is not called
    again (fp16 would call it on rounded operands; step 2 would): each call would wait it out."""
    later = tmp_path / "later.py"
    later.write_text("import time, torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                     "    if len(CALLS) > 2:\n        time.sleep(30)\n"  # step 0's kernel and fp16 cases return
                     "    return torch.nn.functional.linear(x, weight, bias)\n")
    start = time.monotonic()
    table, record = replay(context, kernel=kernels.load(str(later), "linear"), errors=["fp16"], layers=["4"],
                           computations=("forward",), timeout=2)
    assert time.monotonic() - start < 10
    hung = table[table["error"].notna()]
    assert list(hung["status"]) == ["timeout"] and list(hung["step"]) == [1] and list(hung["case"]) == ["kernel"]
    assert set(table["step"]) == {0, 1} and table.loc[table["case"] == "fp16", "step"].tolist() == [0]
    got = detect.judge(table, record)
    assert got["verdict"] == "fail" and got["error_model"] == "timeout"
    assert got["evidence"]["outcome"]["message"] == "4 step 1 kernel: CallTimeout: no result after 2 s"


def test_a_kernels_own_timeout_overrides_playbacks(context, tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time, torch\ndef forward(x, weight, bias):\n    time.sleep(1.5)\n"
                    "    return torch.nn.functional.linear(x, weight, bias)\n")
    outcomes = {}
    for name, kspec in (("default", {}), ("patient", {"timeout": 20})):
        playback.run_job("tiny", "cpu", name, {"op": "linear", "impl": str(slow), **kspec}, context,
                         tmp_path / f"{name}.parquet", tmp_path / f"{name}.json", errors_=[],
                         settings={"timeout": 1, "computations": ["forward"], "max_samples_per_layer": 1},
                         rules={}, config_hash="h1")
        outcomes[name] = json.loads((tmp_path / f"{name}.json").read_text())["outcome"]["status"]
    assert outcomes == {"default": "timeout", "patient": "ok"}


def test_run_job_takes_the_config_schemas_playback_defaults(context, tmp_path, monkeypatch):
    """A library call leaving settings out got others than a workflow job (whose config the schema fills):
    without propagate_samples every step was followed, without memory_mb the first call had no limit."""
    import yaml

    from peat import propagate
    from peat.config import validate

    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    schema = REPO / "workflow/schemas/config.schema.yaml"
    workflow = validate({key: value for key, value in config.items() if key != "playback"}, schema)["playback"]
    seen = {}

    class Planned(Exception):
        """Raised instead of replaying: the plan is what this test reads."""

    def replay(plan):
        seen["plan"] = plan
        raise Planned

    monkeypatch.setattr(playback, "replay", replay)
    monkeypatch.setattr(propagate, "Propagator", lambda **kwargs: seen.setdefault("propagator", kwargs))
    with pytest.raises(Planned):
        playback.run_job("tiny", "cpu", "golden", {"op": "linear"}, context, tmp_path / "t.parquet",
                         tmp_path / "t.json", errors_=[], settings={}, rules={}, propagate_from={})
    plan = seen["plan"]
    assert {"max_samples_per_layer": plan.max_samples, "computations": list(plan.computations),
            "timeout": plan.timeout, "memory_mb": plan.memory_mb, "propagate": plan.propagate is not None,
            "propagate_samples": seen["propagator"]["samples"]} == workflow
    assert workflow["memory_mb"] is not None and workflow["propagate_samples"] is not None  # what differed


@pytest.mark.parametrize("importable", [False, True], ids=["file", "module"])
@pytest.mark.parametrize("body, error", [("def forward(x, weight, bias)\n    return x\n", "SyntaxError"),
                                         ("raise RuntimeError('needs a GPU')\n", "RuntimeError: needs a GPU")])
def test_a_kernel_that_does_not_load_fails_its_job_with_one_line(context, tmp_path, monkeypatch, body, error,
                                                                  importable):
    # A bad file (issue: reliability): one line naming it, no output a later job could take for a result.
    name = f"peat_test_broken_{error[:3].lower()}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    impl = name if importable else str(tmp_path / f"{name}.py")
    assert kernels.source_files(impl)  # validation finds it without running it
    with pytest.raises(PeatError) as err:
        playback.run_job("tiny", "cpu", "broken", {"op": "linear", "impl": impl}, context, tmp_path / "b.parquet",
                         tmp_path / "b.json", errors_=[], settings={"computations": ["forward"]}, rules={})
    message = str(err.value)
    assert "\n" not in message and name in message and error in message
    assert not (tmp_path / "b.parquet").exists() and not (tmp_path / "b.json").exists()


def test_probes_run_in_process_leave_a_stateful_kernel_as_they_found_it(context, monkeypatch):
    """Under CUDA the probes run in this process (no fork after CUDA starts): they must not
    advance a faulty kernel's draws, or its table would differ from the one a forked probe gives."""
    make = lambda: errors.faulty(kernels.golden("linear"), "rv:2", "forward", seed=5)  # noqa: E731
    forked, _ = replay(context, kernel=make(), errors=[], computations=("forward",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    inline, _ = replay(context, kernel=make(), errors=[], computations=("forward",))
    assert (forked.loc[forked["case"] == "kernel", "err_max"] > 0).all()  # the fault is there
    pd.testing.assert_frame_equal(forked, inline)


def test_a_pseudo_error_that_cannot_act_on_the_op_is_not_the_kernels_crash(context, tmp_path):
    # Split-K tiles need a reduction to split: on a norm layer the injection itself raises.
    kernel = kernels.load("peat.alt_kernels.welford_norm", "layer_norm")
    table, record = replay(context, kernel=kernel, errors=["tile:4:splitk", "rv:2"], computations=("forward",))
    assert (table.loc[table["case"] == "tile:4:splitk", "status"] == "not_applicable").all()
    playback.write(table, record, tmp_path / "t.parquet", tmp_path / "t.json")
    got = detect.run_job(tmp_path / "t.parquet", tmp_path / "t.json", tmp_path / "v.json")
    assert got["verdict"] == "pass" and got["error_model"] == "none"
    assert got["evidence"]["pseudo_errors"] == {"rv:2": {"forward": "random_value"}}
    # The kernel's own code failing inside an injected case is still the kernel's crash (an error
    # on the operands calls the kernel again; one in its result reuses the kernel case's result).
    flaky = tmp_path / "flaky.py"
    flaky.write_text("import torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                     "    if len(CALLS) == 2:\n        raise ValueError('second call')\n"
                     "    return torch.nn.functional.linear(x, weight, bias)\n")
    table, record = replay(context, kernel=kernels.load(str(flaky), "linear"), errors=["bf16"], layers=["4"],
                           computations=("forward",), max_samples=1)
    playback.write(table, record, tmp_path / "f.parquet", tmp_path / "f.json")
    got = detect.run_job(tmp_path / "f.parquet", tmp_path / "f.json", tmp_path / "v.json")
    assert got["verdict"] == "fail" and "second call" in got["evidence"]["outcome"]["message"]


def test_a_pseudo_error_that_changes_nothing_is_a_not_applicable_row_not_an_injected_case(context, tmp_path):
    """rz:1 on an all-zero result left it as it was: the case was scored, and labeled, as injected
    while it held the kernel's own values. Such a sample is a not_applicable row now."""
    zeros = tmp_path / "zeros.py"  # a broken kernel whose every output is zero
    zeros.write_text("import torch\ndef forward(x, weight, bias):\n"
                     "    return torch.zeros(x.shape[0], weight.shape[0])\n")
    table, record = replay(context, kernel=kernels.load(str(zeros), "linear"), errors=["rz:1", "rv:2"], layers=["4"],
                           computations=("forward",), max_samples=2)
    rz = table[table["case"] == "rz:1"]
    assert len(rz) == 2 and (rz["status"] == "not_applicable").all() and rz["fop"].isna().all()
    assert rz["error"].str.startswith("NotInjected: error spec 'rz:1' changes nothing in this result").all()
    assert len(table[table["case"] == "rv:2"]) == 2 and table.loc[table["case"] == "rv:2", "status"].isna().all()
    playback.write(table, record, tmp_path / "z.parquet", tmp_path / "z.json")
    got = detect.run_job(tmp_path / "z.parquet", tmp_path / "z.json", tmp_path / "v.json")
    # The kernel's own wrong output fails it; the case that injected nothing is no crash of it.
    assert got["verdict"] == "fail" and got["error_model"] == "block_structured"
    assert set(got["evidence"]["pseudo_errors"]) == {"rv:2"}


def test_variants_injecting_into_results_reuse_the_kernels_result(context, tmp_path):
    counting = tmp_path / "counting.py"
    counting.write_text("import torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                        "    return torch.nn.functional.linear(x, weight, bias)\n")
    kernel = kernels.load(str(counting), "linear")
    table, _ = replay(context, kernel=kernel, errors=["rv:2", "lane:4", "bf16"], layers=["4"],
                      computations=("forward",), max_samples=2)
    module = kernel.forward.__globals__
    assert len(module["CALLS"]) == 2 * 2  # per sample: the kernel case and bf16 (on its operands)
    assert set(table["case"]) >= {"kernel", "rv:2", "lane:4", "bf16"} and "status" not in table  # no failed row
    assert set(table.loc[table["case"] == "rv:2", "error_model"]) == {"random_value"}


@pytest.mark.parametrize("returned, message", [
    ("bfloat16()", "returned (16, 24) torch.bfloat16, expected (16, 24) torch.float32"),
    ("double()", "returned (16, 24) torch.float64, expected (16, 24) torch.float32"),
    ("to('meta')", "ShapeMismatch: kernel 'later' forward returned (16, 24) torch.float32 on meta, "
                   "expected (16, 24) torch.float32 on cpu"),
    ("__class__ and None", "ShapeMismatch: kernel 'later' forward returned NoneType, expected a tensor")])
def test_a_result_in_another_dtype_or_device_after_the_probe_is_a_shape_mismatch(context, tmp_path, returned, message):
    """The probe judges the first sample alone: a later bfloat16 result ended the job in the
    scoring (TypeError), a float64 one was scored as if it were float32, one on another
    device was moved to the CPU (or, from meta, failed there as a crash), and a later None was a
    crash in torch's AttributeError."""
    later = tmp_path / "later.py"
    later.write_text(f"import torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                     f"    out = torch.nn.functional.linear(x, weight, bias)\n"
                     f"    return out if len(CALLS) == 1 else out.{returned}\n")
    table, record = replay(context, kernel=kernels.load(str(later), "linear"), errors=[], layers=["4"],
                           computations=("forward",), max_samples=2)
    own = table[table["case"] == "kernel"]
    assert record["outcome"]["status"] == "ok" and own["status"].isna().sum() == 1  # the first sample, scored
    assert own["error"].dropna().tolist() == [message] and set(own["status"].dropna()) == {"shape_mismatch"}
    playback.write(table, record, tmp_path / "t.parquet", tmp_path / "t.json")
    got = detect.run_job(tmp_path / "t.parquet", tmp_path / "t.json", tmp_path / "v.json")
    assert got["verdict"] == "fail" and got["error_model"] == "shape_mismatch"
    # The table alone, as judge without the record: a TypeError on the failed row's missing scores, or
    # (a failed call's row, which has no fop) a pass on the rows scored.
    alone = detect.verdict(table)
    assert (alone["verdict"], alone["error_model"], alone["evidence"]["outcome"]["message"]) == \
        ("fail", "shape_mismatch", f"4 step 2 kernel: {message}")


def test_a_kernel_returning_one_buffer_does_not_change_the_result_variants_inject_into(context, tmp_path):
    """rv:2 and lane:4 inject into the kernel case's result; bf16 calls the kernel again before them,
    which overwrote a persistent output buffer: they were scored on bf16's output."""
    buffered = tmp_path / "buffered.py"
    buffered.write_text("import torch\nBUF = {}\ndef forward(x, weight, bias):\n"
                        "    out = BUF.setdefault(x.shape, torch.empty(x.shape[0], weight.shape[0]))\n"
                        "    return out.copy_(torch.nn.functional.linear(x, weight, bias))\n")
    specs = dict(errors=["bf16", "rv:2", "lane:4"], layers=["4"], computations=("forward",), max_samples=2)
    fresh, _ = replay(context, **specs)
    table, _ = replay(context, kernel=kernels.load(str(buffered), "linear"), **specs)
    cols = ["step", "case", "err_max", "err_mean"]
    pd.testing.assert_frame_equal(table[cols], fresh[cols])


def test_each_case_is_scored_and_dropped_before_the_next_is_computed(context, monkeypatch):
    """Playback held every case's result of a computation (golden, fp64, the rounded references,
    the kernel, every error model) until all were scored: 4 GB per computation of a 45M-element
    LLM layer. Now the references alone are held together (for their envelopes), then golden and
    the kernel's own result (for the variants injecting into it) while each case is computed."""
    import weakref

    made, alive = [], []

    def spying(real):
        def spy(*args, **kwargs):
            alive.append(sum(ref() is not None for ref in made))
            out = real(*args, **kwargs)
            made.extend(weakref.ref(t) for t in (out.values() if isinstance(out, dict) else [out]))
            return out
        return spy

    monkeypatch.setattr(playback, "_call", spying(playback._call))
    monkeypatch.setattr(playback, "_injected", spying(playback._injected))
    replay(context, errors=["bf16", "rv:2", "lane:4", "fp16"], layers=["4"], computations=("forward",), max_samples=1)
    # golden, fp64, fp16, bf16, tf32; the kernel, bf16 (called), rv:2 and lane:4 (injected), fp16 (called,
    # once lane:4, the last to inject into the kernel's result, has it)
    assert alive == [0, 1, 2, 3, 4, 1, 2, 2, 2, 1]

def test_analyzer_tables_and_figures(context, tmp_path):
    table, _ = replay(context, "linear")
    summary = analyze.analyze(table, context, tmp_path)
    for name in analyze.FIGURES:
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    layers = pd.read_csv(tmp_path / "layers.csv")
    assert {"err_top10_mean", "err_top10_std", "rel_top10_mean", "iterations"} <= set(layers.columns)
    assert (layers["iterations"] == 3).all()
    assert all(r["xmin"] <= r["xmax"] and r["rmin"] <= r["rmax"] for r in summary["ranges"])
    assert {r["against"] for r in summary["spearman"]} <= {"W_mean", "W_var", "act_mean", "act_var"}
    assert all(-1 <= r["rho"] <= 1 for r in summary["spearman"])
    assert analyze.block_role("transformer.h.3.mlp.c_fc") == "transformer.h.*.mlp.c_fc"
    assert analyze.block_role("layer2.1.conv1") == "layer*.*.conv1"
    lane = next(r for r in summary["forward_backward"] if r["case"] == "lane:4")
    assert set(lane["median_rel_top10"]) == {"forward", "input_grad", "weight_grad"}


def test_repeated_blocks_keep_positions_inside_a_block_apart():
    """MobileNetV2's conv.0.0 (1x1 expansion) and conv.1.0 (3x3 depthwise) in blocks 2 and 3: two
    roles of two blocks each (every index was starred: one role mixing both kinds of convolution)."""
    names = ["features.2.conv.0.0", "features.2.conv.1.0", "features.3.conv.0.0", "features.3.conv.1.0"]
    layers = pd.DataFrame({"case": "kernel", "fop": "output", "computation": "forward", "layer": names,
                           "err_top10_mean": [1.0, 100.0, 1.0, 100.0]})
    blocks = {r["role"]: r for r in analyze.repeated_blocks(layers)}
    assert set(blocks) == {"features.*.conv.0.0", "features.*.conv.1.0"}
    assert all(len(r["blocks"]) == 2 and r["cv"] == 0 for r in blocks.values())
    assert analyze.block_role("features.2.1.block.3.0") == "features.*.*.block.3.0"  # EfficientNet


def test_analyzer_counts_the_iterations_its_means_leave_out(context):
    """A result without a finite error (all NaN) has NaN err_* scores, which the mean skips: the
    layer said 3 iterations for a mean over 2."""
    table, _ = replay(context, "linear", errors=[], layers=["4"], computations=("forward",))
    nan_step = (table["case"] == "kernel") & (table["step"] == 1)
    table.loc[nan_step, ["err_max", "err_mean", "err_top10", "err_var", "rel_top10"]] = np.nan
    row = analyze.per_layer(table).set_index("case").loc["kernel"]
    assert (row["iterations"], row["unscored"]) == (3, 1)


def test_analyzer_reads_the_context_summaries_of_the_replayed_steps_only(context, monkeypatch):
    """The summaries hold every training step of every layer: a long training's millions of rows
    were read whole (3.6M rows: 19 s, 1.8 GB) to correlate a few replayed steps."""
    whole = analyze.summaries(context)
    monkeypatch.setattr(analyze, "SUMMARY_SLICE", 5)  # several slices, one cut inside a step
    some = analyze.summaries(context, {0, 2})
    assert set(whole["step"]) == {0, 1, 2} and set(some["step"]) == {0, 2}
    pd.testing.assert_frame_equal(some, whole[whole["step"] != 1].reset_index(drop=True), check_like=True)


def test_spearman_ranks_an_infinite_error_highest_instead_of_leaving_it_out():
    table = pd.DataFrame({"case": "kernel", "computation": "forward", "fop": "output", "layer": "4",
                          "step": [0, 1, 2, 3], "err_top10": [1.0, 2.0, 3.0, np.inf]})
    (row,) = analyze.spearman(table, pd.DataFrame({"layer": "4", "step": [0, 1, 2, 3], "W_var": [1.0, 2.0, 3.0, 4.0]}))
    assert row["points"] == 4 and row["rho"] == pytest.approx(1.0)


def test_forward_over_backward_does_not_depend_on_which_backward_median_is_nan():
    """A computation whose every score is NaN (all-NaN results) has a NaN median: the ratio is then
    over the other backward one, whichever of the two it is (Python's max() kept a leading NaN)."""
    layers = pd.DataFrame({"case": "kernel", "fop": "output", "layer": "4",
                           "computation": ["forward", "input_grad", "weight_grad"]})
    for back in ([np.nan, 5.0], [5.0, np.nan]):
        (row,) = analyze.forward_backward(layers.assign(rel_top10_mean=[10.0, *back]))
        assert row["forward_over_backward"] == 2.0


def test_propagation_compares_the_output_at_the_steps_followed_downstream():
    """propagate_samples follows 1 of 4 replayed steps: the output's median over the 4 (163, fp16 at
    the test config's conv1) sat beside the loss at the one followed, where the output was 982."""
    rows = [{"case": "fp16", "computation": "forward", "layer": "conv1", "fop": "output", "step": s, "rel_top10": v}
            for s, v in zip((0, 2, 4, 6), (982.0, 170.0, 156.0, 115.0))]
    rows += [{"case": "fp16", "computation": "forward", "layer": "conv1", "fop": "loss", "step": 0, "rel_top10": 149.0},
             {"case": "fp16", "computation": "forward", "layer": "fc", "fop": "output", "step": 0, "rel_top10": 5.0},
             {"case": "fp16", "computation": "forward", "layer": "fc", "fop": "output", "step": 2, "rel_top10": 7.0}]
    got = {r["layer"]: r for r in analyze.propagation(pd.DataFrame(rows))}
    assert got["conv1"] == {"case": "fp16", "layer": "conv1", "output": 982.0, "loss": 149.0}
    assert got["fc"] == {"case": "fp16", "layer": "fc", "output": 6.0}  # not followed: every replayed step


def test_score_vs_iteration_panel_titles_do_not_overlap(context, tmp_path, monkeypatch):
    table, _ = replay(context, "linear", errors=[], max_samples=1)
    titles = []
    monkeypatch.setattr(analyze, "_save", lambda fig, path, *a, **k: titles.append(
        [ax.title.get_window_extent(fig.canvas.get_renderer()) for ax in fig.axes if ax.get_title()]))
    analyze.figures(table, tmp_path)
    boxes = titles[0]  # score_vs_iteration: a row of two layers per computation
    assert len(boxes) == 6 and not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_analyzer_on_a_kernel_that_fails_after_its_probe(context, tmp_path):
    """The probe passes in its child process; every later call fails: only the references score."""
    kernel = tmp_path / "parent_fails.py"
    kernel.write_text("import os\nimport torch\nPID = os.getpid()\ndef forward(x, weight, bias):\n"
                      "    if os.getpid() == PID:\n        raise RuntimeError('outside the probe')\n"
                      "    return torch.nn.functional.linear(x, weight, bias)\n")
    table, record = replay(context, kernel=kernels.load(str(kernel), "linear"), errors=[], computations=("forward",))
    assert record["outcome"]["status"] == "ok" and (table.loc[table["case"] == "kernel", "status"] == "crash").all()
    analyze.analyze(table, context, tmp_path / "analyze")
    for name in analyze.FIGURES:
        assert (tmp_path / "analyze" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyzer_figures_name_a_computation_in_which_the_kernel_crashed(context, tmp_path, monkeypatch):
    """A kernel crashing at its weight-gradient probe leaves no weight_grad row: that panel was just missing."""
    kernel = tmp_path / "wg.py"
    kernel.write_text("def weight_grad(grad_out, x):\n    raise RuntimeError('boom')\n")
    table, record = replay(context, kernel=kernels.load(str(kernel), "linear"), errors=[], layers=["4"], max_samples=1)
    assert "weight_grad" not in set(table["computation"])
    playback.write(table, record, tmp_path / "t.parquet", tmp_path / "t.json")
    drawn, save = {}, analyze._save

    def spy(fig, path, dpi, failed=()):
        save(fig, path, dpi, failed)
        drawn[path.stem] = " ".join(t.get_text() for t in fig.findobj(Text))
    monkeypatch.setattr(analyze, "_save", spy)
    analyze.run_job(tmp_path / "t.parquet", context, tmp_path / "analyze", record=tmp_path / "t.json")
    assert set(drawn) == set(analyze.FIGURES)
    assert all("weight_grad (layer 4) crash:" in text and "boom" in text for text in drawn.values()), drawn
    # With no scored row at all, the figures said the context had no layer of the kernel's op.
    analyze.figures(table.iloc[:0], tmp_path / "none", outcomes=record["outcomes"])
    assert all("no recorded layer" not in text and "weight_grad (layer 4) crash:" in text for text in drawn.values())


def test_analyzer_on_a_kernel_whose_every_result_is_nan(context, tmp_path):
    """A kernel returning NaN everywhere has no score (NaN) in any row of its own: the heatmap of
    its scores has nothing to show, and said so instead of failing the job."""
    kernel = tmp_path / "nan.py"
    kernel.write_text("import torch\ndef forward(x, weight, bias):\n"
                      "    return torch.full((*x.shape[:-1], weight.shape[0]), float('nan'))\n")
    table, _ = replay(context, kernel=kernels.load(str(kernel), "linear"), errors=[], computations=("forward",))
    assert table.loc[table["case"] == "kernel", "rel_top10"].isna().all()
    analyze.analyze(table, context, tmp_path / "analyze")
    for name in analyze.FIGURES:
        assert (tmp_path / "analyze" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_detector_benchmark_smoke(context, tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "detector.py"), "--smoke", "--seeds", "1",
                           "--context", str(context), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = pd.read_csv(tmp_path / "cases.csv")
    summary = json.loads((tmp_path / "summary.json").read_text())
    confusion = pd.read_csv(tmp_path / "confusion.csv")
    assert set(cases["truth"]) == set(detect.CLASSES)  # every class, "none" (the correct kernels) too
    assert summary["cases"] == len(cases)
    for method in ("detector", "allclose", "peat_rule_of_thumb"):
        assert confusion.loc[confusion["method"] == method, "count"].sum() == len(cases)
    bugs = cases["truth"].isin(detect.BUGS)
    assert summary["detector"]["binary_detection"] == pytest.approx((cases.loc[bugs, "detector_verdict"] == "fail").mean())
    assert summary["allclose"]["false_alarm_rate"] == pytest.approx((cases.loc[~bugs, "allclose"] == "fail").mean())
    assert (tmp_path / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    assert set(pd.read_csv(tmp_path / "metrics.csv")["method"]) == {"detector", "allclose", "peat_rule_of_thumb"}



def test_detector_benchmark_judges_by_the_rules_given(context, tmp_path, monkeypatch):
    """With detect.accept_reduced_precision false the Detector fails reduced_precision, as it
    should there: the fp16 pseudo-error and the bf16/fp16/tf32 kernels count as detected bugs,
    not as false alarms (on correct kernels or at all)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import detector

    summary = detector.run([context], tmp_path, seeds=1, steps=1, layers=["4"], specs=["fp16", "rv:2"],
                           rules=detect.Rules(accept_reduced_precision=False))
    cases = pd.read_csv(tmp_path / "cases.csv")
    assert (cases.loc[cases["case"] == "fp16", "detector_verdict"] == "fail").all()
    assert summary["detector"]["false_alarm_rate"] == 0 and summary["detector"]["false_alarms_on_correct_kernels"] == 0
    assert summary["detector"]["bug_cases"] == (cases["truth"] != "none").sum() == 15  # 3 computations x 5
    assert (cases["should_pass"] == (cases["truth"] == "none")).all()
    assert summary["allclose"]["false_alarm_rate"] == (cases.loc[cases["should_pass"], "allclose"] == "fail").mean()
    assert detector.combine([tmp_path], tmp_path / "again")["detector"] == summary["detector"]  # kept in cases.csv
    # The rules the rates were judged by are said: a non-default run's false alarms are not the default's.
    written = json.loads((tmp_path / "summary.json").read_text())["rules"]
    assert written == {**vars(detect.Rules()), "accept_reduced_precision": False}
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["rules"] == written

def test_detector_benchmark_injects_the_specs_given(context, tmp_path):
    """--spec replaces the default grid (the alternatives stay); a spec it cannot parse stops the
    run with one line before any replay, and nothing is written."""
    run = [sys.executable, str(REPO / "benchmarks" / "detector.py"), "--smoke", "--seeds", "1", "--context", str(context)]
    proc = subprocess.run(run + ["--out", str(tmp_path / "a"), "--spec", "rv:2", "--spec", "lane:2:row"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = pd.read_csv(tmp_path / "a" / "cases.csv")
    assert set(cases.loc[~cases["correct_kernel"], "case"]) == {"rv:2", "lane:2:row"}
    assert set(cases.loc[cases["correct_kernel"], "case"]) == {"kernel:im2col", "kernel:blocked_gemm",
                                                               "kernel:onepass_norm"}
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["specs"] == ["rv:2", "lane:2:row"]
    proc = subprocess.run(run + ["--out", str(tmp_path / "b"), "--spec", "rv:2", "--spec", "lane:0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.startswith("detector benchmark: error: error spec 'lane:0': not understood")
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "b").exists()


@pytest.mark.parametrize(("args", "said"), [
    (["--seeds", "0"], "--seeds=0: "), (["--steps", "0"], "--steps=0: "), (["--steps", "-1"], "--steps=-1: "),
    (["--layer", "fc*"], "no recorded layer of "),
])
def test_detector_benchmark_refuses_a_run_of_nothing(context, tmp_path, monkeypatch, capsys, args, said):
    """--seeds 0 ran the correct kernels alone (no bug case), --steps 0 and a --layer glob that
    matches no recorded layer ended in a KeyError traceback after replaying: one line, nothing written."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import detector

    assert detector.main(["--context", str(context), "--out", str(tmp_path / "out"), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"detector benchmark: error: {said}")
    if "--layer" in args:
        assert str(context) in captured.err and "'fc*'" in captured.err and "recorded: 0, 1, 4, 5, 6" in captured.err
    assert not (tmp_path / "out").exists()



def test_detector_benchmark_smoke_keeps_the_first_layer_of_each_op_the_layer_globs_keep(context, tmp_path, monkeypatch):
    """--smoke --layer 6 (the second linear layer) counted layer 4 as the op's one smoke layer
    though --layer left it out, and ran nothing."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import detector

    detector.run([context], tmp_path, seeds=1, steps=1, smoke=True, layers=["6"], specs=["rv:2"])
    cases = pd.read_csv(tmp_path / "cases.csv", keep_default_na=False)
    assert set(cases["layer"].astype(str)) == {"6"}
    assert set(cases["case"]) == {"rv:2", "kernel:blocked_gemm"}



def test_detector_benchmark_says_what_it_replayed(context, tmp_path, monkeypatch):
    """--steps 5 on a context of 3 recorded steps replays those 3, and summary.json said 5; the
    cases did not say which context they came from (a CPU and a GPU run of one model look alike)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import detector

    summary = detector.run([context], tmp_path, seeds=1, steps=5, smoke=True, layers=["6"], specs=["rv:2"])
    cases = pd.read_csv(tmp_path / "cases.csv")
    assert summary["steps"] == 5 and summary["replayed_steps"] == {"min": 3, "max": 3}
    assert set(cases["steps"]) == {3} and set(cases["context"]) == {str(context)}
    assert detector.combine([tmp_path], tmp_path / "again")["replayed_steps"] == {"min": 3, "max": 3}


def test_detector_benchmark_refuses_a_context_given_twice(context, tmp_path, monkeypatch, capsys):
    """The same context twice (say as a relative and an absolute path) replayed every case twice
    and counted both in every rate."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.chdir(context.parent)
    import detector

    assert detector.main(["--context", str(context), "--context", context.name, "--layer", "4",
                          "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"detector benchmark: error: --context {context.name}: given twice (its cases would count twice)\n"
    assert not (tmp_path / "out").exists()


# -- the workflow ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.xdist_group("workflow")
def test_workflow_verdicts(workflow_run):
    verdicts = {p.stem: json.loads(p.read_text()) for p in (workflow_run / "results" / "detect").glob("*/cpu/*.json")}
    assert verdicts["lane_fc"]["verdict"] == "fail" and verdicts["lane_fc"]["error_model"] == "periodic_lane"
    for name in ("im2col", "my_gemm", "welford_ln"):
        assert verdicts[name]["verdict"] == "pass", verdicts[name]
    for v in verdicts.values():
        assert set(v) == {"verdict", "error_model", "confidence", "evidence", "layers", "provenance"}
        assert 0 <= v["confidence"] <= 1
    table = pd.read_parquet(workflow_run / "results" / "playback" / "resnet18" / "cpu" / "lane_fc.parquet")
    assert set(table["fop"]) == {"output"}  # test.yaml turns the later observing points off
    assert set(table.loc[table["case"] == "kernel", "error_model"]) >= {"periodic_lane", "none"}
    record = json.loads((workflow_run / "results" / "playback" / "resnet18" / "cpu" / "lane_fc.json").read_text())
    assert record["timings"]["kernel_s"] > 0 and record["outcome"]["status"] == "ok"
    for name in analyze.FIGURES:
        assert (workflow_run / "results" / "analyze" / "resnet18" / "cpu" / "lane_fc" / f"{name}.png").stat().st_size


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory):
    """A real (tiny) golden training of GPT-2 with the Profiler: context, checkpoints, data."""
    root = tmp_path_factory.mktemp("golden")
    spec, data = tiny_gpt2_golden(root)
    return root, spec, data


def test_the_rebuilt_network_reads_the_recorded_weights_alone(golden_run):
    """model_at reads a recorded step's weights (and bias) without its input and output gradient, which
    were most of what it read: the same tensors as the whole sample's, in the network as recorded."""
    from peat.profiler import read_layer, recorded_steps
    from peat.propagate import WEIGHTS, Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints")
    for layer in prop.order:
        step = recorded_steps(context, layer, ran=True)[-1]
        attrs, (whole,) = read_layer(context, layer, [step], derive=False)
        _, (weights,) = read_layer(context, layer, [step], derive=False, tensors=WEIGHTS)
        assert set(weights) == set(whole) - {"A", "dO"} and {"A", "dO"} <= set(whole)
        assert all(torch.equal(weights[k], whole[k]) if torch.is_tensor(whole[k]) else weights[k] == whole[k]
                   for k in weights)
        module = prop.model_at(step).get_submodule(layer)
        assert torch.equal(module.weight, whole["W"].t() if attrs.get("transposed") else whole["W"])
        assert torch.equal(module.bias, whole["B"])


def test_propagation_to_next_layer_and_loss(golden_run):
    from peat.propagate import Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=None)
    table, _ = replay(context, "linear", errors=["lane:4"], computations=("forward",), propagate=prop)
    down = table[table["fop"] != "output"]
    # 6 steps (3 per epoch) x 5 cases (kernel, lane:4, fp16/bf16/tf32 references) x 2 observing points.
    assert len(down) == 6 * 5 * 2 and set(down["fop"]) == {"next:transformer.h.1.ln_1", "loss"}
    # Exact rebuilds: step 0 (initial weights) and step 3 (the epoch-1 checkpoint); others approximate.
    recon = down.groupby("step")["recon_error"].max()
    assert recon[0] == 0 and recon[3] == 0 and (recon > 0).any()
    lane = down[down["case"] == "lane:4"]
    assert (lane["err_max"] > 0).all()
    assert (down.loc[down["case"] == "kernel", "err_max"] == 0).all()  # golden through golden: no error
    fp16 = down[(down["case"] == "ref:fp16") & (down["fop"] == "loss")]
    assert (fp16["err_max"] < lane[lane["fop"] == "loss"]["err_max"].to_numpy()).all()


def test_playback_reads_a_transposed_layers_weight_in_the_layout_training_hands_a_kernel(golden_run):
    """GPT-2's Conv1D weight, laid out once per sample read, so that each call's copy is a plain
    one (a transposing copy per call cost 6 ms on a 2304 x 768 weight)."""
    root, _, _ = golden_run
    plan = playback.Plan(context=root / "run" / "context.h5", kernel=kernels.golden("linear"), errors=[])
    attrs, samples = playback._samples(plan, playback.Timer(), "transformer.h.0.mlp.c_fc")
    assert attrs["transposed"] and {(s["W"].shape, s["W"].stride()) for s in samples} == {((64, 16), (1, 64))}


def test_the_steps_followed_downstream_are_chosen_among_the_replayed_ones(golden_run):
    """propagate_samples steps are followed even when max_samples_per_layer replays a subset:
    chosen among all 6 recorded steps, 4 of them were [0, 2, 3, 5], and 3 was never replayed."""
    from peat.propagate import Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=4)
    table, _ = replay(context, "linear", errors=[], computations=("forward",), max_samples=5,
                      layers=["transformer.h.0.mlp.c_fc"], propagate=prop)
    replayed = sorted(set(table["step"]))
    followed = sorted(set(table.loc[table["fop"] == "loss", "step"]))
    assert len(replayed) == 5 and len(followed) == 4 and set(followed) <= set(replayed)


def test_every_forward_of_the_layer_downstream_is_timed_as_a_kernel_call(golden_run, monkeypatch):
    """On the way to the later observing points, the layer's own forward in golden's and fp64's
    runs is a kernel call as much as the references' and the candidates' are: one each per run."""
    from contextlib import contextmanager

    from peat.propagate import Propagator

    class Counting(playback.Timer):
        def __init__(self, device="cpu"):
            super().__init__(device)
            self.open, self.downstream = [], 0

        @contextmanager
        def __call__(self, category):
            self.downstream += category == "kernel" and "propagate" in self.open
            self.open.append(category)
            try:
                with super().__call__(category):
                    yield
            finally:
                self.open.pop()

    timers = []
    monkeypatch.setattr(playback, "Timer", lambda device="cpu": timers.append(Counting(device)) or timers[-1])
    root, spec, data = golden_run
    prop = Propagator(context=root / "run" / "context.h5", spec=spec, data=data,
                      checkpoints=root / "run" / "checkpoints", samples=1)
    table, _ = replay(root / "run" / "context.h5", "linear", errors=["lane:4", "rv:2"], computations=("forward",),
                      layers=["transformer.h.0.mlp.c_fc"], propagate=prop)
    assert table.loc[table["fop"] == "loss", "step"].nunique() == 1
    # golden, fp64, the fp16/bf16/tf32 references, the kernel, lane:4 and rv:2 (injected into its result)
    assert timers[-1].downstream == 2 + 3 + 3


def test_later_observing_points_see_the_fault_seen_at_the_output(golden_run):
    """Downstream runs repeat each case's injection (same draws, same stale tile) without
    advancing it: the output rows are those of a replay without propagation."""
    from peat.propagate import Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=None)
    table, _ = replay(context, "linear", errors=["tile:4", "rv:2"], computations=("forward",), propagate=prop)
    alone, _ = replay(context, "linear", errors=["tile:4", "rv:2"], computations=("forward",))
    pd.testing.assert_frame_equal(table.loc[table["fop"] == "output", alone.columns].reset_index(drop=True), alone)
    # A stale tile (zeros on the first call) at the steps rebuilt exactly: there, downstream too.
    stale = table[(table["case"] == "tile:4") & (table["fop"] == "loss") & table["step"].isin([0, 3])]
    assert len(stale) == 2 and (stale["err_max"] > 0).all()


@pytest.fixture(scope="module")
def resnet_run(digits, tmp_path_factory):
    """A real golden training of the test config's ResNet-18 (8 steps, steps 0, 2, 4, 6 recorded)."""
    import yaml

    from conftest import TEST_CONFIG
    from peat.train import train_model

    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"]
    out = tmp_path_factory.mktemp("resnet")
    train_model("resnet18", spec, digits, out, seed=0, threads=1, config_hash="h", progress=False)
    return out, spec, digits


def test_the_network_after_the_injected_layer_runs_channels_last_and_nothing_before_it_does(resnet_run):
    """Downstream convolutions take channels-last weights (oneDNN's fast layout), every run of a step
    alike: golden through golden is still exact there, L's input is still golden training's at the
    exactly rebuilt steps, and the rebuilt network is handed back in its own layout."""
    from peat.propagate import Propagator

    root, spec, data = resnet_run
    prop = Propagator(context=root / "context.h5", spec=spec, data=data, checkpoints=root / "checkpoints", samples=None)
    layouts = []
    real = prop.observe

    def observing(model, layer, *args, **kwargs):
        if model.conv1.weight.dtype == torch.float32:
            layouts.append({name: m.weight.is_contiguous(memory_format=torch.channels_last)
                            for name, m in model.named_modules() if isinstance(m, nn.Conv2d)})
        return real(model, layer, *args, **kwargs)

    prop.observe = observing
    table, _ = replay(root / "context.h5", "conv2d", errors=["rv:2"], computations=("forward",), propagate=prop)
    down = table[table["fop"] != "output"]
    assert set(down["layer"]) == {"conv1", "layer1.0.conv2"} and set(down["step"]) == {0, 2, 4, 6}
    assert (down.loc[down["case"] == "kernel", "err_max"] == 0).all()
    assert (down.loc[down["case"] == "rv:2", "err_max"] > 0).all()
    recon = down.groupby("step")["recon_error"].max()
    assert recon[0] == 0 and recon[4] == 0  # step 0 and the epoch-1 checkpoint's: exact
    # conv1 runs first: every later conv is channels-last; layer1.0.conv2 keeps the four before it and itself.
    first, second = layouts[0], layouts[-1]
    assert not first["conv1"] and all(v for k, v in first.items() if k != "conv1")
    kept = {"conv1", "layer1.0.conv1", "layer1.0.conv2"}
    assert all(second[k] != (k in kept) for k in second)
    for model, *_ in prop._models.values():
        assert all(m.weight.is_contiguous() and "forward" not in m.__dict__
                   for m in model.modules() if isinstance(m, nn.Conv2d))



def test_the_rebuild_draws_training_dropout_masks_at_an_epochs_first_step(digits, tmp_path):
    """MobileNet's classifier drops its input (as EfficientNet's, which also drops blocks): the rebuilt
    forward draws what training drew there, so at step 0 and after a checkpoint L's input is exact."""
    from peat.propagate import Propagator
    from peat.train import train_model

    spec = {"arch": "mobilenet_v2", "dataset": "digits", "epochs": 2, "batch_size": 16, "max_train_samples": 32,
            "optimizer": {"name": "sgd", "lr": 0.05}, "checkpoint_epochs": [1],
            "record": {"layers": ["classifier.1"], "every": 1}}
    train_model("mobilenet", spec, digits, tmp_path, seed=0, threads=1, config_hash="h", progress=False)
    prop = Propagator(context=tmp_path / "context.h5", spec=spec, data=digits, checkpoints=tmp_path / "checkpoints",
                      samples=None)
    table, _ = replay(tmp_path / "context.h5", "linear", errors=[], computations=("forward",), propagate=prop)
    recon = table[table["fop"] == "loss"].groupby("step")["recon_error"].max()
    assert recon[0] == 0 and recon[2] == 0 and recon[1] > 0

def test_a_kernel_drawing_random_numbers_leaves_the_dropout_masks_downstream_alone(digits, tmp_path):
    """MobileNet's classifier drops its input after the last conv: a conv kernel drawing one number
    from the global generator shifted that mask, and golden's own results scored an error at the loss."""
    from peat.propagate import Propagator
    from peat.train import train_model

    spec = {"arch": "mobilenet_v2", "dataset": "digits", "epochs": 1, "batch_size": 16, "max_train_samples": 16,
            "optimizer": {"name": "sgd", "lr": 0.05}, "record": {"layers": ["features.18.0"], "every": 1}}
    train_model("mobilenet", spec, digits, tmp_path, seed=0, threads=1, config_hash="h", progress=False)

    def drawing(x, weight, bias, **hp):
        torch.rand(())
        return nn.functional.conv2d(x, weight, bias, **hp)

    kernel = kernels.Kernel("drawing", "conv2d", **(kernels.GOLDEN["conv2d"] | {"forward": drawing}),
                            custom=("forward",))
    prop = Propagator(context=tmp_path / "context.h5", spec=spec, data=digits, checkpoints=tmp_path / "checkpoints",
                      samples=None)
    table, _ = replay(tmp_path / "context.h5", kernel=kernel, errors=[], computations=("forward",), propagate=prop)
    own = table[table["case"] == "kernel"].set_index("fop")
    assert set(own.index) == {"output", "loss"} and (own["err_max"] == 0).all()


def test_downstream_variants_injecting_into_results_reuse_the_kernels_output_there(golden_run, tmp_path):
    from peat.propagate import Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=1)
    counting = tmp_path / "counting.py"
    counting.write_text("import torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                        "    return torch.nn.functional.linear(x, weight, bias)\n")
    kernel = kernels.load(str(counting), "linear")
    table, _ = replay(context, kernel=kernel, errors=["rv:2", "lane:4"], layers=["transformer.h.0.mlp.c_fc"],
                      computations=("forward",), max_samples=1, propagate=prop)
    assert len(kernel.forward.__globals__["CALLS"]) == 2  # at the output and downstream, once each
    loss = table[table["fop"] == "loss"].set_index("case")
    assert (loss.loc[["rv:2", "lane:4"], "err_max"] > loss.loc["kernel", "err_max"]).all()  # carried downstream


def test_a_correct_result_in_column_major_layout_carries_downstream_as_golden(golden_run):
    """Training hands a kernel's forward result on contiguous; downstream it went on as returned,
    and GPT-2's next Conv1D (c_proj, which views its input) crashed the kernel case there."""
    from peat.propagate import Propagator

    def column_major(x, weight, bias):
        return nn.functional.linear(x, weight, bias).transpose(-1, -2).contiguous().transpose(-1, -2)

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=1)
    kernel = kernels.Kernel("column_major", "linear", **(kernels.GOLDEN["linear"] | {"forward": column_major}),
                            custom=("forward",))
    table, _ = replay(context, kernel=kernel, errors=[], layers=["transformer.h.0.mlp.c_fc"],
                      computations=("forward",), max_samples=1, propagate=prop)
    own = table[table["case"] == "kernel"].set_index("fop")
    assert set(own.index) == {"output", "next:transformer.h.1.ln_1", "loss"} and (own["err_max"] == 0).all()


def test_downstream_twins_of_variants_on_a_faulty_kernels_operands_repeat_their_own_call(golden_run, monkeypatch):
    """A faulty kernel (a config ``error:``) draws at every call, and a variant on its operands
    calls it after the kernel case: its downstream twin, copied before the kernel case's call,
    drew what the kernel case drew instead of what the variant's output rows saw."""
    from peat.propagate import Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=None)
    kernel = errors.faulty(kernels.golden("linear"), "lane:4", seed=7)
    seen, real = {}, kernels.call  # (case, step) -> L's output, at the output and downstream

    def spying(kernel, computation, sample, attrs, dtype=torch.float32, updated=None):
        out = real(kernel, computation, sample, attrs, dtype, updated)
        if "lane" in kernel.name:
            seen.setdefault((kernel.name, int(sample["step"])), []).append(out.clone())
        return out

    monkeypatch.setattr(kernels, "call", spying)
    replay(context, kernel=kernel, errors=["bf16", "fp16"], layers=["transformer.h.0.mlp.c_fc"],
           computations=("forward",), propagate=prop)
    for step in (0, 3):  # rebuilt exactly: L's input downstream is the recorded one
        for case in ("golden+lane:4", "golden+lane:4+bf16", "golden+lane:4+fp16"):
            output, downstream = seen[case, step]
            assert torch.equal(output, downstream), (case, step)


@pytest.mark.parametrize("samples", [0, -1, 1.5, True])
def test_a_propagator_refuses_a_bad_number_of_steps_in_one_line(samples, tmp_path):
    """Unchecked outside the config schema (playback.propagate_samples): samples=0 followed no step, a
    replay with propagation silently without its later observing points, and -1 or 1.5 ended the replay
    in numpy's ValueError or TypeError at the first forward sample, naming no setting."""
    from peat.propagate import Propagator

    with pytest.raises(PeatError, match=re.escape(f"peat.propagate.Propagator: samples={samples!r}: steps followed "
                                                  "per layer need an integer >= 1 (None: every replayed step)")):
        Propagator(context=tmp_path / "context.h5", spec={}, data=tmp_path / "data.h5", checkpoints=tmp_path,
                   samples=samples)


def test_a_kernel_failing_downstream_is_a_row_not_a_failed_job(golden_run, tmp_path):
    from peat.propagate import Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"

    def propagator():
        return Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=1)

    # Passes its probe (a forked child) and its own output, then fails on its next call: the downstream one.
    later = tmp_path / "later.py"
    later.write_text("import torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                     "    if len(CALLS) > 1:\n        raise ValueError('downstream')\n"
                     "    return torch.nn.functional.linear(x, weight, bias)\n")
    table, record = replay(context, kernel=kernels.load(str(later), "linear"), errors=[], computations=("forward",),
                           max_samples=1, propagate=propagator())
    failed = table[table["error"].notna()]
    assert set(failed["fop"]) == {"next:transformer.h.1.ln_1", "loss"} and set(failed["case"]) == {"kernel"}
    playback.write(table, record, tmp_path / "t.parquet", tmp_path / "t.json")
    got = detect.run_job(tmp_path / "t.parquet", tmp_path / "t.json", tmp_path / "v.json")
    assert got["verdict"] == "fail" and "downstream" in got["evidence"]["outcome"]["message"]
    # An injection that cannot act on a norm layer fails at the output only, and is not followed downstream.
    table, _ = replay(context, kernel=kernels.golden("layer_norm"), errors=["tile:4:splitk"], computations=("forward",),
                      max_samples=1, propagate=propagator())
    assert set(table.loc[table["error"].notna(), "status"]) == {"not_applicable"}
    assert set(table.loc[table["case"] == "kernel", "fop"]) == {"output", "loss"}

def test_a_kernel_hanging_downstream_is_a_timeout_not_a_job_waiting_on_it(golden_run, tmp_path):
    """The calls at the kernel's output were bounded by playback.timeout, its calls in the network
    rebuilt for the later observing points were not: a kernel hanging on its downstream call (a pool
    deadlocking on its n-th call) held the job until it returned, forever for a real hang."""
    from peat.propagate import Propagator

    root, spec, data = golden_run
    context = root / "run" / "context.h5"
    prop = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=None)
    # Returns at the output of step 0 (its probe ran in a forked child), hangs on the call after it.
    later = tmp_path / "later.py"
    later.write_text("import time, torch\nCALLS = []\ndef forward(x, weight, bias):\n    CALLS.append(1)\n"
                     "    if len(CALLS) > 1:\n        time.sleep(30)\n"
                     "    return torch.nn.functional.linear(x, weight, bias)\n")
    start = time.monotonic()
    table, record = replay(context, kernel=kernels.load(str(later), "linear"), errors=[], computations=("forward",),
                           timeout=1, propagate=prop)
    assert time.monotonic() - start < 15
    hung = table[table["error"].notna()]
    # One call waited out, at the first observing point, and no later step's (each would wait it out again).
    assert list(hung["status"]) == ["timeout", "timeout"] and set(hung["case"]) == {"kernel"}
    assert list(hung["fop"]) == ["next:transformer.h.1.ln_1", "loss"] and set(table["step"]) == {0}
    got = detect.judge(table, record)
    assert (got["verdict"], got["error_model"]) == ("fail", "timeout")
    # Named as downstream: there the layer's input is the live one, not the recorded one.
    assert got["evidence"]["outcome"]["message"] == ("transformer.h.0.mlp.c_fc step 0 kernel at "
                                                     "next:transformer.h.1.ln_1: CallTimeout: no result after 1 s")


# -- speed machinery: exact by construction ------------------------------------------------------------
def test_timer_categories_are_exclusive(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 7.0, 8.0, 20.0])  # start, outer in, inner in, inner out, outer out, record
    monkeypatch.setattr(playback.time, "perf_counter", lambda: next(clock))
    timer = playback.Timer()
    with timer("propagate"):
        with timer("kernel"):
            pass
    t = timer.record()
    assert (t["kernel_s"], t["propagate_s"], t["wall_s"]) == (4.0, 3.0, 20.0)
    assert (t["kernel_fraction"], t["compute_fraction"]) == (0.2, 0.35)


def test_the_probes_time_inside_the_kernel_counts_as_kernel_time():
    """A probe's call runs in a child while the parent waits inside ``probe``: Outcome.called is the
    call alone (a sleep of 0.3 s: at least 0.3, less than the wait with the child's start and the
    result's way back), for a call that raises too, and the Timer counts it in ``kernel``."""
    slept = kernels.run_isolated(time.sleep, 0.3)
    assert slept.ok and 0.3 <= slept.called < slept.seconds
    failed = kernels.run_isolated(lambda: time.sleep(0.2) or 1 / 0)
    assert failed.status == "crash" and 0.2 <= failed.called < failed.seconds
    timer = playback.Timer()
    with timer("probe"):
        time.sleep(0.05)
    timer.spent_in("kernel", 0.03, within="probe")
    assert timer.seconds["kernel"] == 0.03 and 0.02 <= timer.seconds["probe"] < 0.05


@needs_gpu
def test_timer_counts_queued_gpu_work_in_the_category_that_queued_it():
    # Unsynchronized, the matmuls' run time would land in "score", whose copy to the host waits for them.
    timer = playback.Timer(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    with timer("kernel"):
        for _ in range(50):
            b = a @ a
    with timer("score"):
        b.cpu()
    t = timer.record()
    assert t["kernel_s"] > 5 * t["score_s"]


@pytest.mark.parametrize("compiled", [True, False], ids=["c-loop", "numpy"])
def test_bit_scores_match_their_elementwise_definitions(compiled, monkeypatch):
    from peat import scores, tensor_stats

    if not compiled:
        monkeypatch.setattr(tensor_stats, "_LIB", [None])
    golden = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(0))
    golden[0, 0, 0, 0] = 0.0
    dense = golden + 1e-6 * torch.randn(golden.shape, generator=torch.Generator().manual_seed(1))
    sparse = golden.clone()
    sparse.view(-1)[[0, 5, 9]] = torch.tensor([-0.0, math.inf, 7.0])
    nan_golden = golden.clone()
    nan_golden.view(-1)[[3, 4]] = torch.tensor([math.nan, -math.inf])
    extremes = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, math.nan] * 192).reshape(golden.shape)
    cases = [(c, golden) for c in (golden.clone(), dense, sparse, -golden, extremes)]
    cases += [(nan_golden.clone(), nan_golden), (dense, nan_golden), (nan_golden, extremes)]
    for cand, golden in cases:
        got = scores.difference(cand, scores.Golden.of(golden)).bits
        ulp = (_ulp_ordered(cand) - _ulp_ordered(golden)).abs().reshape(-1).sort().values
        xor = cand.view(torch.int32) ^ golden.view(torch.int32)
        assert got["ulp_median"] == float(ulp[ulp.numel() // 2]) and got["ulp_max"] == float(ulp.max())
        assert got["frac_diff"] == float((xor != 0).double().mean())
        assert got["nonfinite"] == int((~torch.isfinite(cand) & torch.isfinite(golden)).sum())
        assert got["bits"].tolist() == [int(((xor >> b) & 1).sum()) for b in range(32)]


def _ulp_ordered(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns as int64 in ULP order: adjacent floats differ by one, -0.0 is 0.0."""
    bits = t.contiguous().view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


class _Block(nn.Module):
    """A residual block with one in-place ReLU called twice, as in ResNet's BasicBlock."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.relu = nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.b(self.relu(self.a(x)))
        out += x
        return self.relu(out)


def test_prefix_replay_equals_the_whole_forward():
    from peat.propagate import Prefix

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Block(), nn.Linear(8, 4))
    x = torch.randn(5, 8)
    prefix = Prefix(model, "1.b")
    with prefix.recording():
        golden = model(x)
    assert prefix.valid and {n: set(v) for n, v in prefix.outputs.items()} == {"0": {0}, "1.a": {0}, "1.relu": {0}}
    hook = model[1].b.register_forward_hook(lambda m, i, o: o * 3)  # a wrong kernel at L
    whole = model(x)
    with prefix.replaying():
        replayed = model(x)
    hook.remove()
    assert torch.equal(replayed, whole) and not torch.equal(whole, golden)
    assert "forward" not in model[1].relu.__dict__  # the modules are restored


class _Spoiler(nn.Module):
    """Writes into its input in place after L (``b``): on replay, into a record."""

    def __init__(self):
        super().__init__()
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        out = self.b(x)
        x.mul_(2)
        return out + x


def test_replayed_records_are_not_copied_and_a_forward_writing_into_one_invalidates_the_prefix():
    from peat.propagate import Prefix

    def replays(model, times):
        torch.manual_seed(0)
        x = torch.randn(5, 8)
        prefix = Prefix(model, "1.b")
        with torch.no_grad():
            with prefix.recording():
                golden = model(x)
            outs = []
            for _ in range(times):
                with prefix.replaying():
                    outs.append(model(x))
        return prefix, golden, outs

    torch.manual_seed(0)
    prefix, golden, outs = replays(nn.Sequential(nn.Linear(8, 8), _Block(), nn.Linear(8, 4)), 3)
    assert prefix.valid and all(torch.equal(out, golden) for out in outs)  # `out += x`: not a record
    torch.manual_seed(0)
    prefix, golden, (out,) = replays(nn.Sequential(nn.Linear(8, 8), _Spoiler(), nn.Linear(8, 4)), 1)
    assert torch.equal(out, golden)  # this forward is still golden's ...
    assert not prefix.valid  # ... but the record is spoilt: no more replays


class _Masked(nn.Module):
    """A mask (a bool record) computed before L (``b``) and flipped in place after it."""

    def __init__(self):
        super().__init__()
        self.sign, self.b = _Sign(), nn.Linear(8, 8)

    def forward(self, x):
        mask = self.sign(x)
        out = self.b(x)
        mask.logical_not_()
        return out * mask


class _Sign(nn.Module):
    def forward(self, x):
        return x > 0


def test_the_float64_replay_never_spoils_the_shared_records():
    """The float64 twin's records are copies, floats or not: its forward wrote into an uncopied
    bool record, and the next float32 replay (still valid) started from the flipped mask."""
    import copy

    from peat.propagate import Prefix

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), _Masked()), torch.randn(5, 8)
    model64 = copy.deepcopy(model).double()
    prefix = Prefix(model, "1.b")
    with torch.no_grad():
        with prefix.recording():
            golden = model(x)
        with prefix.on(model64, torch.float64).replaying():
            model64(x.double())
        with prefix.replaying():
            assert torch.equal(model(x), golden)


def test_float64_reference_runs_from_the_layer_on_the_golden_input():
    """The later observing points' fp64 reference: the golden float32 prefix, cast, then every
    module from L on in float64."""
    import copy

    from peat.propagate import Prefix

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Block(), nn.Linear(8, 4))
    model64 = copy.deepcopy(model).double()
    x = torch.randn(5, 8)
    prefix = Prefix(model, "1.b")
    with prefix.recording():
        model(x)
    seen = {}
    model64[1].b.register_forward_pre_hook(lambda m, i: seen.setdefault("input", i[0]))
    with prefix.on(model64, torch.float64).replaying():
        got = model64(x.double())
    a = model[1].relu(model[1].a(model[0](x)))  # L's golden float32 input
    block = model64[1].relu(model64[1].b(a.double()) + model[0](x).double())
    assert seen["input"].dtype == torch.float64 and torch.equal(seen["input"], a.double())
    assert torch.equal(got, model64[2](block))
    assert not torch.equal(got, model64(x.double()))  # not the whole network in float64


def test_float64_reference_after_a_random_draw_still_starts_from_the_golden_input():
    """Dropout before L (MobileNetV2's classifier): the replay check fails and the float64 twin
    runs the whole network, drawing golden's masks, but L still takes golden's input, cast."""
    import copy
    from types import SimpleNamespace

    from peat.propagate import Prefix, Propagator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4)).train()
    model64 = copy.deepcopy(model).double()
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    prop = Propagator.__new__(Propagator)
    prop.dataset = SimpleNamespace(kind="image")
    prefix = Prefix(model, "2")
    gold = prop.observe(model, "2", "4", x, y, prefix=prefix, seed=3)
    ref = prop.observe(model64, "2", "4", x.double(), y, prefix=prefix.on(model64, torch.float64), seed=3)
    assert torch.equal(ref["A"], gold["A"].double())
    torch.manual_seed(3)
    model64[:2](x.double())  # the draws before L
    assert torch.equal(ref["next"], model64[2:](gold["A"].double()))  # and after it, golden's masks


@pytest.mark.parametrize("size, conv", [
    (1, dict(kernel_size=3, padding=1)),                    # 1x1 maps: one GEMM over the batch
    (4, dict(kernel_size=3, stride=2, padding=1, bias=False)),
    (5, dict(kernel_size=(3, 1), dilation=2, padding=(1, 0), stride=(3, 4))),
    (8, dict(kernel_size=3, padding=1)),                    # larger maps: PyTorch's own
    (2, dict(kernel_size=1, groups=2)),                     # grouped: PyTorch's own
])
def test_float64_copy_convolves_like_pytorch_in_float64(size, conv):
    from peat.propagate import _fast_modules, _float64

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, **conv), nn.ReLU())
    x = torch.randn(3, 4, size, size, dtype=torch.float64)
    got = _float64(model, _fast_modules(model))(x)
    want = nn.functional.relu(nn.functional.conv2d(x, model[0].weight.double(),
                                                   None if model[0].bias is None else model[0].bias.double(),
                                                   model[0].stride, model[0].padding, model[0].dilation, model[0].groups))
    assert got.shape == want.shape and got.dtype == torch.float64 and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-13)
    assert model[0].weight.dtype == torch.float32  # the float32 network is left as it was


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_downstream_convolutions_leave_out_only_products_with_padding(layout, device):
    """``_conv`` (the float64 copy's and the downstream float32 convolutions): every output as
    PyTorch's (the same sums in another order), a NaN input reaching exactly the outputs that read
    it, on maps smaller than the kernel (one matrix product), with cropped taps and neither."""
    import itertools

    from peat.propagate import _conv

    torch.manual_seed(0)
    paths = set()
    for size, k, s, p, d, g in itertools.product([1, 2, 5], [2, 3, (3, 1)], [1, 2, 3], [0, 1, 2, (1, 0)], [1, 2],
                                                 [1, 2]):
        conv = nn.Conv2d(4, 6, k, stride=s, padding=p, dilation=d, groups=g, bias=(s == 2)).double().to(device)
        x = torch.randn(3, 4, size, size + 1, dtype=torch.float64).to(device).contiguous(memory_format=layout)
        for poisoned in (False, True):
            if poisoned:
                x[1, 1 + g // 2, size // 2, 0] = float("nan")
            try:
                want = nn.functional.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, g)
            except RuntimeError:  # no output: the kernel reaches past the padded input
                break
            cache = {}
            got = _conv(conv, cache, x)
            assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan()), (size, k, s, p, d, g)
            assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-12, atol=1e-12), (size, k, s, p, d, g)
            if not poisoned:
                dense = (x.shape[2], x.shape[3]) in cache
                cropped = not dense and cache[x.shape[2], x.shape[3], "crop"][1] != conv.kernel_size
                paths.add("dense" if dense else "cropped" if cropped else "plain")
            assert ((x.shape[2], x.shape[3]) in cache) == (g == 1 and size * (size + 1) < conv.weight[0, 0].numel()
                                                           and not poisoned)
    assert paths == {"dense", "cropped", "plain"}


def test_a_convolution_with_a_non_finite_weight_keeps_pytorchs_own_forward():
    """A NaN weight times a padded zero is NaN in PyTorch's convolution: the products with padding
    then count, so the float64 copy leaves such a convolution as it is."""
    from peat.propagate import _fast, _fast_modules, _float64

    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1))
    with torch.no_grad():
        model[1].weight[0, 0, 0, 0] = float("inf")
    twin = _float64(model, _fast_modules(model))
    assert _fast(model[0]) and not _fast(model[1])
    assert "forward" in twin[0].__dict__ and "forward" not in twin[1].__dict__
    x = torch.randn(1, 2, 1, 1, dtype=torch.float64)
    assert torch.equal(twin(x).isnan(), nn.functional.conv2d(twin[0](x), twin[1].weight, twin[1].bias,
                                                             padding=1).isnan())


def test_prefix_refuses_to_replay_a_skipped_random_draw():
    from peat.propagate import Prefix, PrefixMismatch

    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4)).train()
    x = torch.randn(5, 8)
    prefix = Prefix(model, "2")
    torch.manual_seed(0)
    with prefix.recording():
        model(x)
    torch.manual_seed(0)
    with pytest.raises(PrefixMismatch), prefix.replaying():
        model(x)


def test_allclose_settled_from_the_scores_equals_torch_allclose():
    """playback decides torch.allclose from the scores where they settle it; it must agree."""
    from peat import detect, evidence

    g = torch.Generator().manual_seed(3)
    golden = torch.randn(8, 16, 4, 4, generator=g)
    ref = golden.double()
    env = evidence.envelopes(golden, ref, {p: golden for p in evidence.PRECISIONS})
    cases = [golden.clone(), golden * (1 + 1e-7), golden * (1 + 1e-5), golden + 1e-3, golden.neg()]
    for spec in ("rv:3", "rz:1", "bit_flip:exponent", "nan:1", "lane:4"):
        cases.append(errors.parse(spec).apply(golden.clone(), torch.Generator().manual_seed(0)))
    with_inf = golden.clone()
    with_inf.view(-1)[0] = math.inf
    for gold, cand in [(golden, c) for c in cases] + [(with_inf, with_inf.clone()), (with_inf, golden)]:
        env_g = env if gold is golden else evidence.envelopes(gold, gold.double(), {p: gold for p in evidence.PRECISIONS})
        row = playback.score_row(cand, gold, gold.double(), env_g, detect.Rules())
        assert row["allclose"] == evidence.allclose(cand, gold), (cand.flatten()[:3], row["err_max"])


def _score_cases():
    """(candidate, golden) pairs that reach every branch of the scores: dense rounding noise with
    exact elements, sparse and gross faults, NaN/inf on either side, a 4-d tensor (strided
    matrix view), a single column (numpy adds it pairwise), a tall matrix (downsampled rows), a
    batch of one (a column-major matrix view) with magnitudes so far apart that sums round."""
    g = torch.Generator().manual_seed(5)
    out = []
    wide = torch.randn(1, 16, 6, 6, generator=g) * 2.0 ** torch.randint(-40, 20, (1, 16, 6, 6), generator=g)
    for golden in (torch.randn(6, 20, 5, 7, generator=g), torch.randn(1000, 3, generator=g) * 1e3,
                   torch.randn(700, 1, generator=g), torch.randn(37, generator=g), wide):
        noise = golden * (1 + 3e-7 * torch.randn(golden.shape, generator=g))
        noise.view(-1)[::3] = golden.view(-1)[::3]  # exact elements: zero errors among the rest
        sparse = golden.clone()
        sparse.view(-1)[[1, 7, 8]] = torch.tensor([0.0, 1e4, -3.0])
        nan = noise.clone()
        nan.view(-1)[[2, 4]] = torch.tensor([math.nan, math.inf])
        own = golden.clone()
        own.view(-1)[[0, 5]] = torch.tensor([math.nan, -math.inf])
        out += [(golden.clone(), golden), (noise, golden), (sparse, golden), (nan, golden), (own.clone(), own),
                (noise, own)]
    return out


def test_compiled_scores_equal_numpys_bit_for_bit(monkeypatch):
    """The C loops behind score_row (tensor_stats.compare, beyond, column_sums, class_maxima,
    squared_deviation_sum, select: here on tensors of any size) give every column exactly as the
    numpy code does."""
    from peat import evidence, scores, tensor_stats

    if not tensor_stats.compiled():
        pytest.skip("no C compiler here")
    monkeypatch.setattr(tensor_stats, "SELECT_MIN", 0)

    def rows():
        out = []
        for cand, golden in _score_cases():
            gold = scores.Golden.of(golden)
            ref = golden.double() + 1e-9
            rounded = {p: golden * (1 + 10.0 ** -k) for k, p in enumerate(evidence.PRECISIONS, start=2)}
            env = evidence.envelopes(golden, ref, rounded, gold=gold)
            out.append(playback.score_row(cand, golden, ref, env, detect.Rules(), gold=gold))
        return out

    compiled = rows()
    monkeypatch.setattr(tensor_stats, "_LIB", [None])
    for got, want in zip(compiled, rows()):
        assert list(got) == list(want)
        for key, value in want.items():
            if isinstance(value, np.ndarray):
                assert value.dtype == got[key].dtype and np.array_equal(value, got[key], equal_nan=True), key
            else:
                same = value == got[key] or value != value and got[key] != got[key]  # NaN is NaN
                assert type(value) is type(got[key]) and same, key



@pytest.mark.parametrize("n", [1, 2, 3, 4095, 70_000])
def test_select_is_numpys_partition(monkeypatch, n):
    """tensor_stats.select is np.partition(keys, i)[i] for uint32 and uint64 keys and the bit
    patterns of float64 values >= 0: distinct, repeated, all equal, zeros, the highest bits set;
    tensor_stats.top is the largest k errors as scores._top's numpy path gives them."""
    from peat import tensor_stats

    if not tensor_stats.compiled():
        pytest.skip("no C compiler here")
    monkeypatch.setattr(tensor_stats, "SELECT_MIN", 0)
    rng = np.random.default_rng(n)
    errors = np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-30, 5, n)
    errors[: n // 3] = 0.0
    for keys in (rng.integers(0, 2**32, n, dtype=np.uint32), rng.integers(0, 7, n).astype(np.uint32),
                 np.full(n, 5, dtype=np.uint64), np.zeros(n, dtype=np.uint32),
                 rng.integers(2**63, 2**64 - 1, n, dtype=np.uint64), errors.view(np.uint64),
                 np.full(n, 2.0**-1074).view(np.uint64)):
        for i in sorted({0, n // 2, n - 1, int(rng.integers(0, n))}):
            assert tensor_stats.select(keys, i) == np.partition(keys, i)[i], (keys.dtype, i)
    for k in sorted({1, max(1, n // 10), n}):  # top: those above the k-th largest in order, then it
        kth = np.partition(errors, n - k)[n - k]
        above = errors[errors > kth]
        want = above if kth == 0 else np.concatenate([above, np.full(k - above.size, kth)])
        assert np.array_equal(tensor_stats.top(errors, k), want), k
    # Out of range: left to numpy, which raises, rather than read past the buffers.
    assert tensor_stats.select(errors.view(np.uint64), n) is None and tensor_stats.top(errors, n + 1) is None
    assert tensor_stats.top(errors, 0) is None and tensor_stats.select(np.zeros(0, np.uint32), 0) is None


def test_local_envelope_is_the_per_element_worst_of_its_tile():
    """envelopes works out the local envelope on tiles and keeps one value each (a TileBound):
    spread over the elements, it is KRP times the worst fp16/bf16/tf32 error of each element's
    tile, floored at tau32, as worked out element by element, also with partial tiles, NaN and inf."""
    from peat import evidence, scores

    rules = detect.Rules()
    for _, golden in _score_cases()[::6]:
        ref = golden.double() + 1e-9
        rounded = {p: golden * (1 + 10.0 ** -k) for k, p in enumerate(evidence.PRECISIONS, start=2)}
        rounded["bf16"].view(-1)[[1, 3]] = torch.tensor([math.nan, math.inf])
        env = evidence.envelopes(golden, ref, rounded, rules)
        refm = scores.as_matrix(ref)
        worst = np.max([np.nan_to_num(np.abs(scores.as_matrix(t) - refm), nan=0.0, posinf=0.0)
                        for t in rounded.values()], axis=0)
        tiles = scores.per_tile(worst, rules.tile, np.maximum)
        want = np.maximum(rules.krp * evidence.per_element(tiles, rules.tile, worst.shape), env["tau32"])
        assert env.local.shape == want.shape and env.local.tiles.shape == tiles.shape
        assert np.array_equal(env.local.full(), want)


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (37, 70), (64, 16), (200, 1)])
def test_tile_bound_is_its_per_element_array(shape):
    """A TileBound picks, for the elements of a mask, what its per-element array holds there,
    and tensor_stats.beyond against it gives what numpy gives against that array: the same
    sets S and G, their sizes and the largest finite err / bound (with partial tiles, zeros,
    NaN and inf in the error)."""
    from peat import evidence, tensor_stats

    rng = np.random.default_rng(sum(shape))
    tile = 16
    bound = evidence.TileBound(rng.uniform(0.1, 2.0, tuple(-(-s // tile) for s in shape)), tile, shape)
    err = np.abs(rng.standard_normal(shape))
    err.reshape(-1)[::7] = 0.0
    if err.size > 3:
        err.reshape(-1)[[1, 2]] = [np.inf, np.nan]
    full = bound.full()
    mask = rng.random(shape) < 0.3
    assert full.shape == shape and np.array_equal(bound[mask], full[mask])
    found = tensor_stats.beyond(err, 0.5, bound.tiles, tile)
    if found is None:
        pytest.skip("no C compiler here")
    with np.errstate(invalid="ignore"):
        over32, gross, ratio = err > 0.5, err > full, err / full
    ratio = ratio[np.isfinite(ratio)]
    assert np.array_equal(found[0], over32) and np.array_equal(found[1], gross)
    assert found[2:4] == (np.count_nonzero(over32), np.count_nonzero(gross))
    assert found[4] == (ratio.max() if ratio.size else 0.0)


def test_envelopes_share_the_noise_and_footprints_come_from_the_references_scores():
    """envelopes measures |golden - reference| once for tau32 and the candidates' noise
    summary (``noise``); a footprint made from a rounded reference's score (playback's way, one
    error at a time) is the one envelopes makes on its own, also for a golden or a reference
    with NaN and inf."""
    from peat import evidence, scores

    for _, golden in _score_cases()[::3]:
        gold = scores.Golden.of(golden)
        ref = golden.double() + 1e-9
        ref.view(-1)[-1] = math.nan
        rounded = {p: golden * (1 + 10.0 ** -k) for k, p in enumerate(evidence.PRECISIONS, start=2)}
        bare, own = evidence.envelopes(golden, ref, rounded, gold=gold, footprints=False), evidence.envelopes(golden, ref, rounded)
        assert bare == own and bare["noise32_max"] == evidence._finite_max(
            evidence._distance(gold.matrix, scores.as_matrix(ref)))
        np.testing.assert_equal(bare.noise, scores.summary(scores.abs_error(ref, golden)))
        assert bare.footprints == {} and list(own.footprints) == list(evidence.PRECISIONS)
        for p, (may, must, *sizes) in own.footprints.items():
            got = evidence.footprint(scores.difference(rounded[p], gold).err, bare["tau32"])
            assert np.array_equal(got[0], may) and np.array_equal(got[1], must) and list(got[2:]) == sizes
            assert sizes[0] > 0  # the cases reach the footprints' sets


@pytest.mark.parametrize("shape", [(0, 4), (0,), (4, 0), (2, 0, 3, 3)])
def test_an_empty_output_is_scored(shape):
    """A tensor with no elements (a zero-size batch or layer, also one of no columns: a 1-d
    tensor, a layer of width 0) gets its rows, as an exact one: nothing differs, nothing is wrong."""
    from peat import evidence

    golden = torch.randn(shape)
    scored = playback._Scored(playback.Plan(context=Path("-"), kernel=None, rules=detect.Rules()), {"tensor": "O"},
                              {"golden": golden, "fp64": golden.double(), **{p: golden for p in evidence.PRECISIONS}})
    scored.add("kernel", golden.clone())
    assert [r["case"] for r in scored.rows] == ["ref:fp16", "ref:bf16", "ref:tf32", "ref:fp64", "kernel"]
    row = scored.rows[-1]
    assert (row["error_model"], row["ulp_median"], row["ulp_max"], row["nonfinite"], row["allclose"]) == \
        ("none", 0.0, 0.0, 0, True)


def test_allclose_in_numpy_equals_torch_at_the_tolerance_edge():
    """evidence.allclose against a finite golden's cached bound is torch.allclose, also one
    float32 step either side of the tolerance."""
    from peat import evidence, scores

    g = torch.Generator().manual_seed(6)
    for scale in (1e-30, 1e-6, 1.0, 1e6, 1e30):
        golden = torch.randn(4000, generator=g) * scale
        golden[::5] = 0.0
        gold = scores.Golden.of(golden)
        bound = torch.from_numpy(gold.close_bound)
        for edge in (golden + bound, golden - bound):
            for cand in (edge, torch.nextafter(edge, edge + edge.sign() * math.inf + (edge == 0) * math.inf),
                         torch.nextafter(edge, golden), golden + bound * 1.5 * torch.rand(golden.shape, generator=g)):
                single = torch.where(torch.arange(golden.numel()) == 17, cand, golden)
                for c in (cand, single):
                    assert evidence.allclose(c, golden, gold) == bool(torch.allclose(c, golden))
        nan = golden.clone()
        nan[3] = math.nan
        assert not evidence.allclose(nan, golden, gold) and not torch.allclose(nan, golden)


def test_isolated_elements_bound_the_components_from_below():
    """tensor_stats.isolated counts set elements without a set 8-neighbour (what lets _blocks
    skip labelling a scattered S), edges and single rows or columns included."""
    from scipy import ndimage

    from peat import tensor_stats

    if not tensor_stats.compiled():
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(0)
    for rows, cols in [(1, 1), (1, 9), (9, 1), (2, 2), (17, 33), (40, 3)]:
        for density in (0.05, 0.3, 0.9):
            mask = rng.random((rows, cols)) < density
            around = ndimage.convolve(mask.astype(np.int16), np.ones((3, 3), np.int16), mode="constant")
            assert tensor_stats.isolated(mask) == np.count_nonzero(mask & (around == 1))
            assert tensor_stats.isolated(mask) <= ndimage.label(mask, structure=np.ones((3, 3)))[1]


def test_every_exported_c_loop_has_its_ctypes_signature():
    """Without one, ctypes passes and returns C ints: pointers and int64 counts would be cut to 32 bits."""
    from peat import tensor_stats

    exported = re.findall(r"^(?:CLONES )?\w+ (peat_\w+)\(", tensor_stats.SOURCE, re.MULTILINE)
    assert sorted(exported) == sorted(tensor_stats._SIGNATURES)


def test_scores_of_a_candidate_shaped_unlike_golden_raise_with_and_without_the_c_loops(monkeypatch):
    """tensor_stats.compare walks the candidate's elements through golden's buffers: a candidate of
    another shape (here as many elements, which reads in bounds; more would write past them) is
    numpy's broadcast error on either path, not scored."""
    from peat import scores, tensor_stats

    golden = torch.randn(10, 10)
    for lib in (tensor_stats._library(), None):
        monkeypatch.setattr(tensor_stats, "_LIB", [lib])
        with pytest.raises(ValueError, match="broadcast"):
            scores.tensor_scores(torch.randn(5, 20), golden, golden.double())


def test_the_next_observing_point_reads_the_layers_output():
    # The next recorded conv in model order after layer2.0.conv2 is layer2.0.downsample.0, which
    # reads the block's input: an error of 0 there would look like masking. The first conv that
    # reads conv2's output (after the residual add) is layer2.1.conv1.
    import torchvision

    from peat.propagate import next_readers

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    order = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    readers = next_readers(model, order, "image", x, y, seed=0)
    assert readers["layer2.0.conv2"] == "layer2.1.conv1" == readers["layer2.0.downsample.0"]
    assert readers["layer1.1.conv2"] == "layer2.0.conv1" and readers["layer4.1.conv2"] is None  # fc: not recorded
    assert all(p.requires_grad for p in model.parameters())  # left as found


def test_the_next_observing_point_is_next_in_the_order_of_calls():
    """Llama defines its norms after the attention and MLP they feed: "next in model order" observed
    input_layernorm after the residual add (at post_attention_layernorm), not at q_proj, which reads it."""
    from peat import models
    from peat.profiler import op_of
    from peat.propagate import next_readers

    model = models.build({"arch": "llama", "size": {"hidden": 16, "layers": 1, "heads": 2}},
                         {"vocab_size": 64, "seq_len": 8}, seed=0).train()
    order = [n for n, m in model.named_modules() if op_of(m) is not None]
    assert order.index("model.layers.0.input_layernorm") > order.index("model.layers.0.mlp.down_proj")
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    readers = next_readers(model, order, "text", tokens[:, :-1], tokens[:, 1:], seed=0)
    assert readers["model.layers.0.input_layernorm"] == "model.layers.0.self_attn.q_proj"
    assert readers["model.layers.0.post_attention_layernorm"] == "model.layers.0.mlp.gate_proj"
    assert readers["model.layers.0.self_attn.o_proj"] == "model.layers.0.post_attention_layernorm"
    assert readers["model.norm"] == "lm_head" and readers["lm_head"] is None


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 127, 128, 129, 136, 1000, 8193, 100_003])
def test_squared_deviation_sum_is_numpys_sum_bit_for_bit(n):
    """tensor_stats.squared_deviation_sum adds (x - mean) ** 2 in np.sum's pairwise order
    (blocks of 8 lanes, halves at multiples of 8), without the array: the same float64 bits, on
    deviations many orders of magnitude apart, where adding them one after another rounds
    differently."""
    from peat import tensor_stats

    if not tensor_stats.compiled():
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)
    mean = float(x.mean()) if n else 0.0
    spread = x - mean
    spread *= spread
    assert tensor_stats.squared_deviation_sum(x, mean) == float(spread.sum())
    assert n < 129 or float(spread.sum()) != float(np.cumsum(spread)[-1])  # the order shows
