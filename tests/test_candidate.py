"""Candidate-kernel training and frequency-based runtime FI: routing, schedules, outputs, bad kernels."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from torch import nn

from conftest import REPO, TEST_CONFIG, snakemake
from peat import candidate, errors, kernels
from peat.config import validate
from peat.io import PeatError
from peat.models import build

torch.set_num_threads(1)


def tiny_gpt2():
    return build({"arch": "gpt2", "size": {"hidden": 16, "layers": 1, "heads": 2}}, {"vocab_size": 40, "seq_len": 8}, 0)


def gpt2_step(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(40, (4, 8), generator=gen)
    logits = model(input_ids=ids).logits
    loss = nn.functional.cross_entropy(logits.reshape(-1, 40), ids.reshape(-1))
    loss.backward()
    return logits.detach()


def test_route_touches_only_the_chosen_layers():
    model = tiny_gpt2()
    names = kernels.route(model, kernels.load("peat.alt_kernels.blocked_gemm", "linear"), ["*.mlp.*"])
    assert names == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    routed = {n for n, m in model.named_modules() if "forward" in vars(m)}
    assert routed == set(names)
    with pytest.raises(PeatError, match=r"kernels\.x\.layers.*matches no layer_norm layer"):
        kernels.route(model, kernels.golden("layer_norm"), ["*.mlp.*"], key="kernels.x.layers")


def test_gpt2_conv1d_is_served_by_the_linear_kernel():
    plain = tiny_gpt2()
    routed = copy.deepcopy(plain)
    kernels.route(routed, kernels.load("kernels/my_gemm.py", "linear"), ["transformer.h.0.attn.c_attn"])
    out_plain, out_routed = gpt2_step(plain), gpt2_step(routed)
    assert not torch.equal(out_plain, out_routed)  # really computed by the candidate
    assert torch.allclose(out_plain, out_routed, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(plain.named_parameters(), routed.parameters()):
        assert a.grad.shape == b.grad.shape and torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


def test_a_kernel_output_in_another_memory_layout_trains_as_golden():
    """GPT-2's next Conv1D views its input: a correct forward result laid out transposed (a
    column-major GEMM's) crashed candidate training with 'view size is not compatible', naming
    neither the kernel nor the layer, while playback passed it."""
    golden = kernels.golden("linear")
    strided = kernels.Kernel("strided", "linear", lambda x, w, b: golden.forward(x, w, b).mT.contiguous().mT,
                             golden.input_grad, golden.weight_grad, custom=("forward",))
    plain = tiny_gpt2()
    routed = copy.deepcopy(plain)
    kernels.route(routed, strided, ["transformer.h.0.mlp.c_fc"])
    assert torch.equal(gpt2_step(plain), gpt2_step(routed))


def test_active_switches_between_kernel_and_golden():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32))
    plain = copy.deepcopy(model)
    flag = {"on": False}
    kernels.route(model, errors.faulty(kernels.golden("linear"), "lane:8"), active=lambda: flag["on"])
    x = torch.randn(3, 6)
    assert torch.equal(model(x), plain(x))
    flag["on"] = True
    diff = (model(x) - plain(x)).abs() > 0
    assert diff.any(0).sum() == 4 and diff[:, diff.any(0)].all()  # 32 columns, period 8


def test_schedules():
    state = {"step": 0}
    half, every = candidate.schedule_predicate("f0.5", state, 8), candidate.schedule_predicate("every3", state, 8)
    active = [(state.update(step=s), half(), every())[1:] for s in range(8)]
    assert [s for s, (h, _) in enumerate(active) if h] == [0, 1, 2, 3]
    assert [s for s, (_, e) in enumerate(active) if e] == [0, 3, 6]
    assert candidate.rfi_cases({"fractions": [0.25, 0.5], "every": [4]}) == ["f0.25", "f0.5", "every4"]


def test_a_fraction_schedule_rounds_halves_up_of_the_fraction_as_written():
    """round() went to even (f0.25 of 10 steps routed 2) and multiplied the float, just below 0.7."""
    def routed(case, total):
        state = {"step": 0}
        active = candidate.schedule_predicate(case, state, total)
        return [s for s in range(total) if (state.update(step=s), active())[1]]

    assert routed("f0.25", 10) == [0, 1, 2] and routed("f0.25", 6) == [0, 1]
    assert len(routed("f0.7", 45)) == 32 and routed("f1e-05", 10) == [0]


def test_monitored_kernel_scores_every_call_against_golden():
    rows, state = [], {"step": 7, "epoch": 2}
    kernel = candidate.monitored(errors.faulty(kernels.golden("linear"), "rz:3"), "fc", rows.append, state)
    x, w = torch.randn(4, 5) + 3, torch.randn(6, 5)
    for _ in range(2):
        kernel.forward(x, w, None)
    kernel.weight_grad(torch.randn(4, 6), x)
    assert [(r["computation"], r["call"], r["changed"], r["step"], r["layer"]) for r in rows] == [
        ("forward", 0, 3, 7, "fc"), ("forward", 1, 3, 7, "fc"), ("weight_grad", 0, 0, 7, "fc")]
    assert rows[0]["max"] > 0 and rows[2]["max"] == 0


def test_monitored_scores_a_kernel_that_writes_into_its_inputs_on_the_inputs_it_got():
    """Golden ran after the kernel, on the inputs the kernel had overwritten: a kernel with a
    correct output that then zeroed its input showed every element changed."""
    def forward(x, weight, bias):
        out = nn.functional.linear(x, weight, bias)
        x.zero_()
        return out

    golden = kernels.golden("linear")
    clobbers = kernels.Kernel("clobbers", "linear", forward, golden.input_grad, golden.weight_grad, custom=("forward",))
    rows = []
    candidate.monitored(clobbers, "fc", rows.append, {"step": 0, "epoch": 0}).forward(torch.randn(4, 5) + 3, torch.randn(6, 5), None)
    assert rows[0]["changed"] == 0 and rows[0]["max"] == 0


def test_monitored_runs_what_a_kernel_leaves_to_golden_as_golden_on_a_transposed_layer():
    """GPT-2's Conv1D gets x^T dO from PyTorch as its weight gradient; RFI of a kernel defining
    the forward alone trained on dO^T x there, and calls.csv showed that product's other
    rounding (an AMD EPYC) as the kernel's weight_grad error."""
    golden, transposed = kernels.golden("linear"), kernels.golden("linear", {"transposed": True})
    forward_only = kernels.Kernel("fwd", "linear", golden.forward, golden.input_grad, golden.weight_grad,
                                  custom=("forward",))
    rows = []
    kernel = candidate.monitored(forward_only, "proj", rows.append, {"step": 0, "epoch": 0}, {"transposed": True})
    torch.manual_seed(0)
    x, grad_out = torch.randn(37, 48), torch.randn(37, 10)
    assert torch.equal(kernel.weight_grad(grad_out, x), transposed.weight_grad(grad_out, x))
    assert rows[0]["changed"] == 0 and rows[0]["max"] == 0


def test_a_faulty_golden_weight_gradient_on_a_transposed_layer_differs_from_golden_by_the_fault_alone():
    """A deliberately faulty kernel (impl golden, error rv:1 on weight_grad) computed GPT-2's Conv1D
    weight gradient as dO^T x, not as PyTorch's x^T dO: on this AMD EPYC calls.csv counted ~250
    changed elements for rv:1, and candidate training trained on that other rounding too."""
    transposed = kernels.golden("linear", {"transposed": True})
    faulty = errors.faulty(kernels.golden("linear"), "rv:1", "weight_grad")
    rows = []
    kernel = candidate.monitored(faulty, "proj", rows.append, {"step": 0, "epoch": 0}, {"transposed": True})
    torch.manual_seed(0)
    x, grad_out = torch.randn(37, 48), torch.randn(37, 10)
    out = kernel.weight_grad(grad_out, x)
    assert int((out != transposed.weight_grad(grad_out, x)).sum()) == 1 and rows[0]["changed"] == 1
    # Routed in candidate training (hidden 10: a 10-wide weight gradient, which MKL rounds differently here).
    model = build({"arch": "gpt2", "size": {"hidden": 10, "layers": 1, "heads": 2}}, {"vocab_size": 40, "seq_len": 8}, 0)
    routed = copy.deepcopy(model)
    kernels.route(routed, faulty, ["transformer.h.0.mlp.c_proj"])
    gpt2_step(model), gpt2_step(routed)
    grads = [m.get_submodule("transformer.h.0.mlp.c_proj").weight.grad for m in (model, routed)]
    assert int((grads[0] != grads[1]).sum()) == 1


def test_monitored_counts_no_error_where_the_kernel_reproduces_golden_nan_or_inf():
    """Once a faulty forward's NaN reached the weights, every later call of every computation had
    NaN inputs: a kernel matching golden bit for bit there (its golden input_grad) showed every
    element non-finite and changed in calls.csv (inf - inf and NaN - NaN are NaN)."""
    rows = []
    kernel = candidate.monitored(kernels.golden("linear"), "fc", rows.append, {"step": 0, "epoch": 0})
    weight = torch.randn(6, 5)
    weight[0, 0], weight[1, 1] = float("nan"), float("inf")
    kernel.input_grad(torch.randn(4, 6), weight)
    assert rows[0]["nonfinite"] == 0 and rows[0]["changed"] == 0 and rows[0]["max"] == 0
    candidate.monitored(errors.faulty(kernels.golden("linear"), "nan:1"), "fc", rows.append,
                        {"step": 0, "epoch": 0}).forward(torch.randn(4, 5), torch.randn(6, 5), None)
    assert rows[1]["nonfinite"] == 1 and rows[1]["changed"] == 1  # a NaN of its own still counts


def test_partial_rows_read_back_complete_rows_only_and_exactly(tmp_path):
    """Rows are appended one write each (the whole file was rewritten after every row); a kill in
    the middle of a write tears only the last line, which reading drops."""
    path = tmp_path / ".rows.csv"
    rows = [{"step": i, "layer": "fc", "max": 0.1 * 3 ** -i} for i in range(3)]
    with candidate.PartialRows(path) as partial:
        for row in rows:
            partial.add(row)
    with open(path, "a") as f:
        f.write("3,fc,0.0123")
    assert candidate.PartialRows.read(path).to_dict("records") == rows  # floats to the last bit
    path.write_text("step,lay")
    assert candidate.PartialRows.read(path) is None and candidate.PartialRows.read(tmp_path / "none.csv") is None


def test_compare_lines_up_curves():
    golden = pd.DataFrame({"step": [1, 2, 2], "epoch": [1, 1, 1], "split": ["train", "train", "val"],
                           "loss": [2.0, 1.5, 1.6], "accuracy": [0.1, 0.2, 0.3], "perplexity": [float("nan")] * 3})
    cand = golden.assign(loss=[2.0, 1.75, 1.5])
    frame = candidate.compare(golden, cand)
    assert frame["loss_diff"].round(6).tolist() == [0.0, 0.25, -0.1]
    crashed = candidate.compare(golden, None)
    assert len(crashed) == 3 and crashed["loss_candidate"].isna().all()


def test_a_loss_gone_nan_has_no_max_loss_difference():
    """A kernel whose NaN first reached the loss at step 1 (a weight gradient's) had
    max_abs_loss_diff 0.0, as if it trained as golden: the maximum skipped the NaN steps."""
    golden = pd.DataFrame({"step": [0, 1, 2], "epoch": 1, "split": ["train", "train", "val"],
                           "loss": [2.0, 1.5, 1.6], "accuracy": 0.1, "perplexity": float("nan")})
    diverged = golden.assign(loss=[2.0, float("nan"), float("nan")])
    summary = candidate._summary(candidate.compare(golden, diverged), diverged)
    assert summary["nonfinite_loss"] and math.isnan(summary["max_abs_loss_diff"])
    crashed = diverged.iloc[:1]  # the steps a crashed run never reached do not count
    assert candidate._summary(candidate.compare(golden, crashed), crashed)["max_abs_loss_diff"] == 0.0


def train_crashing_kernel(digits, tmp_path,
                          source: str = "def forward(x, weight, bias):\n    raise RuntimeError('boom')\n",
                          **kw) -> dict:
    """Candidate training of ResNet-18's fc, one step, through a kernel that raises on its first call
    (or through ``source``); outcome.json is in tmp_path/out. ``kw`` goes to train_candidate."""
    golden = tmp_path / "golden"
    golden.mkdir()
    pd.DataFrame({"step": [1], "epoch": [1], "split": ["val"], "loss": [2.0], "accuracy": [0.1],
                  "perplexity": [float("nan")], "wall_time": [0.0]}).to_csv(golden / "metrics.csv", index=False)
    path = tmp_path / "raises.py"
    path.write_text(source)
    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"] | {"epochs": 1, "max_train_samples": 32}
    return candidate.train_candidate("resnet18", spec, "raises", {"op": "linear", "impl": str(path), "layers": ["fc"]},
                                     digits, golden, tmp_path / "out", seed=0, **kw)


def test_an_error_aimed_at_a_gradient_autograd_never_computes_is_named_not_silently_clean(digits, tmp_path, capfd):
    """conv1 is fed by data: autograd computes no input gradient there, so its nan:1 was never
    injected and the run trained clean, read as the error absorbed. One line names the layer and
    the pass; the layer after it still gets the error (the run is not failed)."""
    golden = tmp_path / "golden"
    golden.mkdir()
    pd.DataFrame({"step": [1], "epoch": [1], "split": ["val"], "loss": [2.0], "accuracy": [0.1],
                  "perplexity": [float("nan")], "wall_time": [0.0]}).to_csv(golden / "metrics.csv", index=False)
    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"] | {"epochs": 1, "max_train_samples": 32}
    kspec = {"op": "conv2d", "error": "nan:1", "computation": "input_grad", "layers": ["conv1", "layer1.0.conv1"]}
    out = candidate.train_candidate("resnet18", spec, "nan_dx", kspec, digits, golden, tmp_path / "out", seed=0)
    assert out["status"] == "ok" and out["layers"] == ["conv1", "layer1.0.conv1"]
    assert (out["layers_not_injected"], out["computation"]) == (["conv1"], "input_grad")  # the report names both
    assert out["nonfinite_loss"]  # layer1.0.conv1 got it
    warnings = [line for line in capfd.readouterr().err.splitlines() if "never injected" in line]
    assert warnings == ["warning: kernels.nan_dx.error 'nan:1' is never injected at layer 'conv1': the backward pass "
                        "computes no input_grad there, as its input needs no gradient (data, or only frozen layers "
                        "before it)"]
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_a_damaged_golden_curve_is_one_line_before_training(digits, tmp_path, monkeypatch):
    """Golden's metrics.csv was read after the whole training, and an emptied one ended the job
    in pandas' 'No columns to parse from file', naming no file."""
    (tmp_path / "golden").mkdir()
    (tmp_path / "golden" / "metrics.csv").write_text("")
    monkeypatch.setattr(candidate.kernels, "run_isolated", lambda *a, **k: pytest.fail("trained"))
    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"]
    with pytest.raises(PeatError, match=rf"^{re.escape(str(tmp_path / 'golden' / 'metrics.csv'))}: not a readable CSV"):
        candidate.train_candidate("resnet18", spec, "golden", {"op": "linear", "layers": ["fc"]}, digits,
                                  tmp_path / "golden", tmp_path / "out")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_a_missing_gpu_fails_the_job_not_the_kernel(digits, tmp_path):
    """On a node without the vendor's GPU the training child's device error was the kernel's
    outcome: status crash, a kernel failed on nvidia in the report, and the job succeeded."""
    with pytest.raises(PeatError, match=r"^vendor 'nvidia': no CUDA GPU visible"):
        train_crashing_kernel(digits, tmp_path, vendor="nvidia")
    assert not (tmp_path / "out").exists()


def test_candidate_training_leaves_no_empty_checkpoints_folder(digits, tmp_path):
    """train.fit makes checkpoints/ (golden training's directory output); a candidate run writes no
    epoch checkpoint, so the folder was left behind, empty."""
    record = train_crashing_kernel(digits, tmp_path, "import torch.nn.functional as F\n\n"
                                   "def forward(x, weight, bias):\n    return F.linear(x, weight, bias)\n")
    assert record["status"] == "ok" and (tmp_path / "out" / "final.h5").is_file()
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("computation, source, written", [
    ("forward", "def forward(x, weight, bias):\n    x.mul_(2.0)\n    return F.linear(x, weight, bias)\n", "x"),
    ("weight_grad", "def weight_grad(grad_out, x):\n    grad_out.mul_(1.0)\n    return grad_out.t() @ x\n", "grad_out"),
])
def test_a_kernel_writing_into_its_input_fails_its_run_naming_it(digits, tmp_path, computation, source, written):
    """In training the input is another layer's output: a kernel scaling it in place trained on
    with the residual stream and the saved tensors changed, status ok (playback's copies hid it)."""
    record = train_crashing_kernel(digits, tmp_path, "import torch.nn.functional as F\n\n" + source)
    assert record["status"] == "crash"
    assert record["message"] == (f"WroteInput: kernel 'raises' {computation} at layer 'fc' wrote into its input "
                                 f"{written} in place, which training reads again: leave the inputs as they are and "
                                 "return a new tensor")


def test_a_crashed_kernel_reports_no_nonfinite_loss(digits, tmp_path):
    """A crash leaves the candidate curve empty, NaN after the merge: outcome.json said
    nonfinite_loss: true, the flag meant for a kernel whose training went NaN."""
    record = train_crashing_kernel(digits, tmp_path)
    assert record["status"] == "crash" and record["nonfinite_loss"] is False


@pytest.mark.parametrize("source, where, raised", [
    ("def forward(x, weight, bias):\n    raise RuntimeError('boom')\n", "forward", "RuntimeError: boom"),
    ("def weight_grad(grad_out, x, transposed):\n    return grad_out.t() @ x\n", "weight_grad",
     "TypeError: weight_grad() missing 1 required positional argument: 'transposed'"),
])
def test_a_kernel_that_raises_is_a_crash_naming_its_computation_and_layer(digits, tmp_path, source, where, raised):
    """The crash said only what the kernel raised ("TypeError: weight_grad() missing ..."): not
    which computation nor which of the routed layers, as a shape mismatch or an input written says."""
    record = train_crashing_kernel(digits, tmp_path, source)
    assert (record["status"], record["message"]) == ("crash", f"kernel 'raises' {where} at layer 'fc' raised {raised}")


def test_a_kernel_that_raises_in_an_isolated_call_is_named_as_before():
    """Outside a routed training run (playback's calls, a load) the message is the exception's own."""
    assert kernels._failure(RuntimeError("boom\nmore")) == ("crash", "RuntimeError: boom")


def test_a_crashed_kernels_outcome_is_strict_json(digits, tmp_path):
    """The crash's missing candidate losses were written as a bare NaN, which jq and
    JavaScript's JSON.parse reject; they are null."""
    train_crashing_kernel(digits, tmp_path)

    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")

    saved = json.loads((tmp_path / "out" / "outcome.json").read_text(), parse_constant=no_constants)
    assert saved["status"] == "crash" and saved["final_val_loss_candidate"] is None


def test_a_kernel_returning_one_buffer_every_call_fails_its_run_naming_it(digits, tmp_path):
    """ResNet-18's layer1 convs all give one output shape: a kernel returning one buffer per shape
    overwrote outputs the backward still read, and trained on with wrong gradients, status ok."""
    golden = tmp_path / "golden"
    golden.mkdir()
    pd.DataFrame({"step": [1], "epoch": [1], "split": ["val"], "loss": [2.0], "accuracy": [0.1],
                  "perplexity": [float("nan")], "wall_time": [0.0]}).to_csv(golden / "metrics.csv", index=False)
    path = tmp_path / "buffered.py"
    path.write_text("import torch.nn.functional as F\nOP = 'conv2d'\nBUFFERS = {}\n\n"
                    "def forward(x, weight, bias, **hp):\n    out = F.conv2d(x, weight, bias, **hp)\n"
                    "    buffer = BUFFERS.setdefault(out.shape, out)\n    buffer.data.copy_(out)\n    return buffer\n")
    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"] | {"epochs": 1, "max_train_samples": 32}
    record = candidate.train_candidate("resnet18", spec, "buffered", {"op": "conv2d", "impl": str(path), "layers": ["layer1.*"]},
                                       digits, golden, tmp_path / "out", seed=0)
    assert record["status"] == "crash"
    assert record["message"] == ("ReusedOutput: kernel 'buffered' forward at layer 'layer1.0.conv2' returned the "
                                 "memory of its output at layer 'layer1.0.conv1', still held from earlier in this "
                                 "forward pass (a persistent output buffer overwrites what the backward reads): "
                                 "return a new tensor per call")


STOPS = {"crash": "os.kill(os.getpid(), signal.SIGSEGV)", "timeout": "time.sleep(600)"}


@pytest.mark.parametrize("status, schedule", [("crash", None), ("timeout", None), ("crash", "f1")])
def test_a_run_that_dies_keeps_its_curve_up_to_where_it_stopped(digits, tmp_path, status, schedule):
    """A candidate or RFI run that crashed or timed out lost its whole curve: compare.csv had no
    candidate loss at all, so the steps it did train were not shown."""
    golden = tmp_path / "golden"
    golden.mkdir()
    pd.DataFrame({"step": [0, 1, 2, 3, 4], "epoch": 1, "split": ["train"] * 4 + ["val"], "loss": 2.0,
                  "accuracy": 0.1, "perplexity": float("nan"), "wall_time": 0.0}).to_csv(golden / "metrics.csv",
                                                                                       index=False)
    path = tmp_path / "stops.py"  # dies in its third call: the third training step
    path.write_text("import os, signal, time\nimport torch.nn.functional as F\nCALLS = [0]\n\n"
                    "def forward(x, weight, bias):\n"
                    f"    CALLS[0] += 1\n    if CALLS[0] == 3:\n"  # as a kill in the middle of a curve write leaves it:
                    f"        open({str(tmp_path / 'out' / candidate.PARTIAL_CURVE)!r}, 'a').write('2,1,train,2.3')\n"
                    f"        {STOPS[status]}\n"
                    "    return F.linear(x, weight, bias)\n")
    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"] | {"epochs": 1}
    record = candidate.train_candidate("resnet18", spec, "stops", {"op": "linear", "impl": str(path), "layers": ["fc"],
                                                                   "train_timeout": 20},
                                       digits, golden, tmp_path / "out", seed=0, schedule=schedule)
    assert record["status"] == status and record["steps_trained"] == 2 and record["nonfinite_loss"] is False
    assert record["layers"] == ["fc"]  # were [], as if nothing had been routed
    frame = pd.read_csv(tmp_path / "out" / "compare.csv")
    assert frame["loss_candidate"].notna().tolist() == [True, True, False, False, False]
    for partial in candidate.PARTIALS:  # compare.csv, calls.csv and outcome.json hold them now
        assert not (tmp_path / "out" / partial).exists()
    if schedule is not None:  # RFI lost the calls it had recorded: calls.csv was empty
        calls = pd.read_csv(tmp_path / "out" / "calls.csv")
        assert calls[["step", "computation"]].values.tolist() == [
            [step, computation] for step in (0, 1) for computation in ("forward", "input_grad", "weight_grad")]


@pytest.mark.parametrize("result, returned", [
    ("x[:, :3]", "forward returned (32, 3) torch.float32, expected (32, 10)"),
    ("F.linear(x, weight, bias).to('meta')",  # a CPU result from a CUDA layer, say
     "forward returned (32, 10) torch.float32 on meta, expected (32, 10) torch.float32 on cpu")])
def test_rfi_reports_a_wrong_shape_or_device_as_shape_mismatch(digits, tmp_path, result, returned):
    """Under RFI the per-call error score ran before the router's shape check: a result of another
    shape was a broadcasting 'crash' instead of a shape_mismatch, one on another device torch's
    device error."""
    golden = tmp_path / "golden"
    golden.mkdir()
    pd.DataFrame({"step": [1], "epoch": [1], "split": ["val"], "loss": [2.0], "accuracy": [0.1],
                  "perplexity": [float("nan")], "wall_time": [0.0]}).to_csv(golden / "metrics.csv", index=False)
    path = tmp_path / "narrow.py"
    path.write_text(f"import torch.nn.functional as F\n\ndef forward(x, weight, bias):\n    return {result}\n")
    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"] | {"epochs": 1, "max_train_samples": 32}
    record = candidate.train_candidate("resnet18", spec, "narrow", {"op": "linear", "impl": str(path), "layers": ["fc"]},
                                       digits, golden, tmp_path / "out", seed=0, schedule="f0.5")
    assert record["status"] == "shape_mismatch", record["message"]
    assert returned in record["message"]


def test_config_cross_checks():
    config = validate(yaml.safe_load(TEST_CONFIG.read_text()), REPO / "workflow/schemas/config.schema.yaml")
    assert candidate.models_for(config, "im2col") == ["resnet18"]
    config["kernels"]["ln_all"] = {"op": "layer_norm"}
    assert candidate.models_for(config, "ln_all") == ["gpt2"]  # resnets have no layer norm
    bad = copy.deepcopy(config)
    bad["kernels"]["im2col"]["models"] = ["vgg"]
    with pytest.raises(PeatError) as err:
        candidate.check(bad)
    assert str(err.value) == ("config key 'kernels.im2col.models': unknown model 'vgg'; "
                              "defined: resnet18, resnet18_parity, gpt2")
    bad = copy.deepcopy(config)
    bad["rfi"]["kernels"] = ["nope"]
    with pytest.raises(PeatError) as err:
        candidate.check(bad)
    assert str(err.value) == "config key 'rfi.kernels': unknown kernel 'nope'; defined: im2col, my_gemm, welford_ln, lane_fc, ln_all"
    bad = copy.deepcopy(config)
    bad["kernels"]["im2col"]["impl"] = "kernels/missing.py"
    with pytest.raises(PeatError) as err:
        candidate.check(bad)
    assert str(err.value) == (f"config key 'kernels.im2col.impl': kernel impl 'kernels/missing.py': "
                              f"no such file (relative to {REPO})")
    # A frozen or built-in module has no file: a FileNotFoundError traceback of the config check.
    for module, kind in (("os.path", "frozen"), ("sys", "built-in")):
        bad["kernels"]["im2col"]["impl"] = module
        with pytest.raises(PeatError) as err:
            candidate.check(bad)
        assert str(err.value) == (f"config key 'kernels.im2col.impl': kernel impl {module!r}: a {kind} module "
                                  "without a source file; a kernel is a Python or C++ file, or a module or package of them")
    # Every call would raise (a norm has no reduction to split): each of its jobs a crash, after golden training.
    bad = copy.deepcopy(config)
    bad["kernels"]["welford_ln"]["error"] = "tile:4:splitk"
    with pytest.raises(PeatError, match=r"kernels\.welford_ln\.error.*'tile:4:splitk'.*not the layer_norm forward"):
        candidate.check(bad)
    bad["kernels"]["welford_ln"] |= {"op": "linear", "impl": "golden", "computation": "input_grad"}
    candidate.check(bad)
    # Playback would replay the kernel unharmed and the verdict say pass for a faulty kernel.
    bad["playback"] = {"computations": ["forward", "weight_grad"]}
    with pytest.raises(PeatError) as err:
        candidate.check(bad)
    assert str(err.value) == ("config key 'kernels.welford_ln.computation': input_grad is not in playback.computations "
                              "(forward, weight_grad), so playback never injects its error 'tile:4:splitk'; add it "
                              "there or inject into a replayed computation")


def test_config_refuses_a_kernel_seed_its_generator_cannot_take():
    """torch.Generator takes 64 bits: a larger seed passed the schema, and each candidate and RFI run
    of the kernel was its 'crash' (ValueError: Overflow when unpacking long long) after golden training."""
    config = yaml.safe_load(TEST_CONFIG.read_text())
    config["kernels"]["lane_fc"]["seed"] = 2**64 - 1
    errors.faulty(kernels.golden("linear"), "lane:4", seed=2**64 - 1)
    validate(copy.deepcopy(config), REPO / "workflow/schemas/config.schema.yaml")
    config["kernels"]["lane_fc"]["seed"] = 2**64
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow/schemas/config.schema.yaml")
    assert str(err.value) == ("config key 'kernels.lane_fc.seed': 18446744073709551616 is greater than the maximum "
                              "of 18446744073709551615")


def test_config_refuses_a_kernel_file_defining_none_of_the_computations(tmp_path):
    """A misspelt function (def fwd) loaded as all-golden nowhere: load() refused it in the playback
    job, after golden training. Sources that may bind the names dynamically are let through."""
    config = validate(yaml.safe_load(TEST_CONFIG.read_text()), REPO / "workflow/schemas/config.schema.yaml")
    sources = {"typo.py": 'OP = "linear"\n\ndef fwd(x, weight, bias):\n    return F.linear(x, weight, bias)\n',
               "ok.py": 'OP = "linear"\n\ndef input_grad(grad_out, weight):\n    return grad_out @ weight\n',
               "dynamic.py": 'globals()["line" + "ar"] = object()\n',
               # Its jobs failed, the first after golden training.
               "unparsable.py": "def forward(x, weight, bias)\n    return x\n", "nul.py": "def forward\0",
               # Named after the op, as load() does not read it: refused in the job, after golden training.
               "opname.py": "def linear(x, weight, bias):\n    return x @ weight.t() + bias\n",
               "namespace.py": "class linear:\n    def forward(x, weight, bias):\n        return x @ weight.t() + bias\n",
               "other_op.py": "class conv2d:\n    def forward(x, weight, bias, **hp):\n        return x\n",
               # Another op's namespace as an object (the README's form; peat.alt_kernels.tf32's conv2d) passed.
               "other_ns.py": "from types import SimpleNamespace\nconv2d = SimpleNamespace(forward=lambda x, w, b: x)\n",
               "other_ns_str.py": 'conv2d = dict(**{c: None for c in ("forward", "input_grad")})\n',
               "own_ns.py": "from types import SimpleNamespace\nlinear = SimpleNamespace(forward=lambda x, w, b: x)\n"}
    errors = {"typo.py": "defines none of forward, input_grad, weight_grad for op 'linear'",
              "opname.py": "defines none of forward, input_grad, weight_grad for op 'linear' (def linear is not one "
                           "of them: name it after the computation)",
              "other_op.py": "defines none of forward, input_grad, weight_grad for op 'linear'",
              "other_ns.py": "defines none of forward, input_grad, weight_grad for op 'linear'",
              "other_ns_str.py": "defines none of forward, input_grad, weight_grad for op 'linear'",
              "unparsable.py": "SyntaxError: expected ':' (line 1)",
              "nul.py": "SyntaxError: source code string cannot contain null bytes"}
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
        config["kernels"]["my_gemm"]["impl"] = str(tmp_path / name)
        if name in errors:
            with pytest.raises(PeatError) as err:
                candidate.check(config)
            gap = " " if errors[name].startswith("defines") else ": "
            assert str(err.value) == f"config key 'kernels.my_gemm.impl': {tmp_path / name}{gap}{errors[name]}"
        else:
            candidate.check(config)


def test_config_names_models_that_would_silently_get_no_jobs():
    """A typo in rfi.models, or a kernel listed for a model without its op, ran nothing and said nothing."""
    config = validate(yaml.safe_load(TEST_CONFIG.read_text()), REPO / "workflow/schemas/config.schema.yaml")
    bad = copy.deepcopy(config)
    bad["rfi"]["models"] = ["resnet_18"]
    with pytest.raises(PeatError, match=r"config key 'rfi\.models': unknown model 'resnet_18'; defined: resnet18, "):
        candidate.check(bad)
    bad = copy.deepcopy(config)
    bad["rfi"]["models"] = ["gpt2"]  # a model, but not one lane_fc runs on
    with pytest.raises(PeatError, match=r"config key 'rfi\.models': none of them runs rfi kernel 'lane_fc' "
                                        r"\(it applies to resnet18\)"):
        candidate.check(bad)
    bad["rfi"]["models"] = ["gpt2", "resnet18"]
    candidate.check(bad)
    bad = copy.deepcopy(config)
    bad["kernels"]["im2col"]["models"] = ["resnet18", "gpt2"]
    with pytest.raises(PeatError, match=r"config key 'kernels\.im2col\.models': model 'gpt2' \(gpt2\) has no conv2d layer"):
        candidate.check(bad)
    bad = copy.deepcopy(config)
    bad["kernels"]["bn_all"] = {"op": "batch_norm"}  # every model by default, but GPT-2 has none
    del bad["models"]["resnet18"], bad["models"]["resnet18_parity"]
    for name in ("im2col", "lane_fc"):
        del bad["kernels"][name]
    bad["rfi"]["kernels"] = []
    with pytest.raises(PeatError, match=r"^config key 'kernels\.bn_all\.op': no model has a batch_norm layer "
                                        r"\(gpt2 \(gpt2\)\); the kernel would run no job$"):
        candidate.check(bad)
    # The case name is the schedule: f0.1234567 and f0.1234568 were one job, f0.123457.
    bad = copy.deepcopy(config)
    bad["rfi"]["fractions"] = [0.5, 0.1234567, 0.1234568]
    with pytest.raises(PeatError, match=r"^config key 'rfi\.fractions': 0\.1234567 has more than 6 significant digits; "
                                        r"its case f0\.123457 would run 0\.123457$"):
        candidate.check(bad)
    bad["rfi"]["fractions"] = [1, 0.123457, 5e-05]
    candidate.check(bad)


# -- the test workflow -------------------------------------------------------------------------
def outcome(workdir: Path, *parts) -> dict:
    return json.loads((workdir.joinpath("results", *parts) / "outcome.json").read_text())


@pytest.mark.xdist_group("workflow")
def test_candidate_training_writes_golden_outputs_and_comparison(workflow_run):
    for model, kernel, layers in (("resnet18", "im2col", ["conv1", "layer1.0.conv2"]),
                                  ("gpt2", "my_gemm", ["transformer.h.0.mlp.c_fc"])):
        out = workflow_run / "results/candidate" / model / "cpu" / kernel
        golden = workflow_run / "results/golden" / model / "cpu"
        record = outcome(workflow_run, "candidate", model, "cpu", kernel)
        assert record["status"] == "ok" and record["layers"] == layers
        for name in ("metrics.csv", "final.h5", "context.h5", "storage.json"):
            assert (out / name).is_file(), name
        # Nothing reads a candidate's epoch or resume checkpoints: none is written.
        assert list((golden / "checkpoints").glob("*.h5")) and not list(out.rglob("epoch*.h5"))
        assert not (out / "checkpoints").exists()
        assert not (out / ".partial").exists()
        frame = pd.read_csv(out / "compare.csv")
        assert len(frame) == len(pd.read_csv(golden / "metrics.csv"))
        assert frame["loss_candidate"].notna().all()
        assert (frame["loss_diff"] == frame["loss_candidate"] - frame["loss_golden"]).all()
    # The correct alternatives stay within float32 noise of golden early on.
    frame = pd.read_csv(workflow_run / "results/candidate/gpt2/cpu/my_gemm/compare.csv")
    assert frame["loss_diff"].abs().iloc[0] < 1e-4


@pytest.mark.xdist_group("workflow")
def test_rfi_records_kernel_output_errors_only_while_active(workflow_run):
    out = workflow_run / "results/rfi/resnet18/cpu/lane_fc/f0.5"
    record = json.loads((out / "outcome.json").read_text())
    assert record["status"] == "ok" and record["layers"] == ["fc"] and record["schedule"] == "f0.5"
    calls = pd.read_csv(out / "calls.csv")
    steps = len(pd.read_csv(workflow_run / "results/golden/resnet18/cpu/metrics.csv").query("split == 'train'"))
    forward = calls[calls["computation"] == "forward"]
    assert forward["step"].tolist() == list(range(steps // 2))  # active in the first half only
    assert forward["call"].tolist() == list(range(len(forward)))
    # lane:4 on a 10-class fc: 2 or 3 whole columns of a 32-image batch offset, nothing else.
    assert set(forward["changed"]) <= {64, 96} and (forward["nonfinite"] == 0).all()
    assert (calls.loc[calls["computation"] != "forward", "max"] == 0).all()
    frame = pd.read_csv(out / "compare.csv")
    assert frame["loss_diff"].abs().iloc[0] > 0
    assert not list(out.glob("checkpoints/*.h5"))  # nothing reads them


@pytest.mark.xdist_group("workflow")
def test_bad_kernels_get_an_outcome_not_a_failed_run(workflow_run, tmp_path):
    config = validate(yaml.safe_load(TEST_CONFIG.read_text()), REPO / "workflow/schemas/config.schema.yaml")
    # One training step is enough: these kernels fail (or go NaN) at the first call.
    spec = config["models"]["resnet18"] | {"epochs": 1, "max_train_samples": 32, "max_val_samples": 32,
                                           "checkpoint_epochs": []}
    golden = workflow_run / "results/golden/resnet18/cpu"
    data = workflow_run / "results/data/digits.h5"
    cases = {
        "raises": ("def forward(x, weight, bias):\n    raise RuntimeError('illegal memory access')\n", {},
                   "crash", "RuntimeError: illegal memory access"),
        "hangs": ("import time\n\ndef forward(x, weight, bias):\n    time.sleep(60)\n", {"train_timeout": 3},
                  "timeout", "no result after 3 s"),
        "wrong_shape": ("def forward(x, weight, bias):\n    return x[:, :3]\n", {}, "shape_mismatch",
                        "kernel 'wrong_shape' forward returned (32, 3) torch.float32, expected (32, 10) torch.float32"),
        "wrong_grad": ("def input_grad(grad_out, weight):\n    return grad_out.double() @ weight.double()\n", {},
                       "shape_mismatch", "input_grad returned (32, 512) torch.float64, expected (32, 512) torch.float32"),
    }
    for name, (source, extra, status, message) in cases.items():
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        kspec = {"op": "linear", "impl": str(path), "layers": ["fc"], **extra}
        out = tmp_path / "out" / name
        record = candidate.train_candidate("resnet18", spec, name, kspec, data, golden, out, seed=0)
        assert record["status"] == status and message in record["message"], record
        saved = json.loads((out / "outcome.json").read_text())
        assert saved["status"] == status
        frame = pd.read_csv(out / "compare.csv")
        assert frame["loss_candidate"].isna().all() and frame["loss_golden"].notna().all()
    # NaN is not a crash: training completes and the comparison shows it.
    path = tmp_path / "nan.py"
    path.write_text("import torch\n\ndef forward(x, weight, bias):\n    return torch.full((x.shape[0], weight.shape[0]), float('nan'))\n")
    record = candidate.train_candidate("resnet18", spec, "nan", {"op": "linear", "impl": str(path), "layers": ["fc"]},
                                       data, golden, tmp_path / "out" / "nan", seed=0)
    assert record["status"] == "ok" and record["nonfinite_loss"] is True


@pytest.mark.xdist_group("workflow")
def test_editing_a_kernel_reruns_only_its_jobs(workflow_run, tmp_path):
    work = tmp_path / "wf"
    shutil.copytree(workflow_run, work, symlinks=True)
    kernel = work / "kernels" / "my_gemm.py"
    kernel.parent.mkdir()
    shutil.copy2(REPO / "kernels" / "my_gemm.py", kernel)  # keeps the old mtime: nothing to do yet
    args = ("-n", "--rerun-triggers", "mtime")
    assert "Nothing to be done" in snakemake(work, *args).stdout
    os.utime(kernel)  # "edit" the kernel
    dry = snakemake(work, *args).stdout
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", dry.split("Job stats:")[1].split("Reasons")[0], re.M))
    assert jobs.get("candidate_train") == "1" and "golden_train" not in jobs and "prepare_dataset" not in jobs
    wildcards = re.findall(r"wildcards: (.*)", dry)
    assert all("kernel=my_gemm" in w for w in wildcards if "kernel=" in w)
    assert not any("kernel=im2col" in w or "kernel=lane_fc" in w for w in wildcards)


def test_predictions_from_non_finite_logits_count_as_wrong():
    """argmax reads NaN as the largest value: a candidate whose loss went NaN reported 0.109, the share
    of class 0 in the validation set, as its final accuracy."""
    from peat import models

    class Logits(torch.nn.Module):
        def forward(self, x):
            return x

    x = torch.tensor([[float("nan"), 0.0], [1.0, 0.0], [0.0, float("inf")], [2.0, 1.0]])
    loss, metrics = models.loss_and_metrics(Logits(), "image", x, torch.tensor([0, 0, 1, 0]))
    assert metrics == {"correct": 2, "count": 4} and loss.isnan()
