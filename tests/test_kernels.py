"""The kernel interface on a real recorded context: golden replay, shipped alternatives, loading, isolation."""

from __future__ import annotations

import collections
import copy
import dataclasses
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from peat import kernels
from peat.io import PeatError
from peat.profiler import Profiler, read_layer

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


class Tiny(nn.Module):
    """Every op PEAT knows, GPT-2's Conv1D included, small enough to record in milliseconds."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8 * 4 * 4, 48)
        self.ln = nn.LayerNorm(48)
        self.rms = nn.RMSNorm(48)
        self.proj = Conv1D(10, 48)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = self.conv2(x).flatten(1)
        return self.proj(self.rms(self.ln(self.fc(x))))


def train_steps(model, steps=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(6, 3, 6, 6, generator=gen), torch.randint(10, (6,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Tiny()
    path = tmp_path_factory.mktemp("ctx") / "context.h5"
    prof = Profiler(path, ["*"], every=1)
    prof.attach(model)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        prof.begin_step(step, 1)
        x, y = torch.randn(6, 3, 6, 6, generator=gen), torch.randint(10, (6,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        prof.end_step()
        opt.step()
    prof.close()
    return path


def cases(context, op=None):
    """(layer, attrs, sample, computation) for every recorded computation of ``op``."""
    out = []
    for layer in ("conv1", "bn", "conv2", "fc", "ln", "rms", "proj"):
        attrs, samples = read_layer(context, layer)
        if op is None or attrs["op"] == op:
            out += [(layer, attrs, s, c) for s in samples for c in kernels.COMPUTATIONS
                    if c != "input_grad" or "dA" in s]
    return out


def rel_err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max())


# -- golden ------------------------------------------------------------------------------------
def test_golden_replays_the_recorded_context_bit_exactly(context):
    seen = set()
    for layer, attrs, sample, computation in cases(context):
        got = kernels.call(kernels.golden(attrs["op"], attrs), computation, sample, attrs)
        assert torch.equal(got, kernels.expected(computation, sample)), (layer, computation)
        seen.add((attrs["op"], computation))
    assert len(seen) == 15  # 5 ops x 3 computations
    assert read_layer(context, "proj")[0]["transposed"] is True


def test_float64_reference_is_close_but_not_identical(context):
    for layer, attrs, sample, computation in cases(context):
        ref = kernels.call(kernels.golden(attrs["op"]), computation, sample, attrs, dtype=torch.float64)
        assert ref.dtype == torch.float64
        assert rel_err(kernels.expected(computation, sample), ref) < 1e-5, (layer, computation)
    fwd = [c for c in cases(context) if c[3] == "forward"]
    assert any(not torch.equal(kernels.call(kernels.golden(a["op"]), "forward", s, a, torch.float64).float(),
                               kernels.expected("forward", s)) for _, a, s, _ in fwd)


def test_call_leaves_recorded_running_stats_alone(context):
    attrs, samples = read_layer(context, "bn")
    before = samples[0]["running_mean"].clone()
    kernels.call(kernels.golden("batch_norm"), "forward", samples[0], attrs)
    assert torch.equal(samples[0]["running_mean"], before)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_replayed_batch_norm_updates_running_stats_as_training_did(tmp_path, momentum):
    """With ``momentum=None`` (a cumulative average) the factor changes every step: golden's
    replay raised on the -1 the context held for it, having no float to pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.Flatten(), nn.Linear(144, 2))
    prof = Profiler(tmp_path / "context.h5", ["1"], every=1)
    prof.attach(model)
    for step in range(4):
        prof.begin_step(step, 1)
        model(torch.randn(5, 3, 8, 8)).square().sum().backward()
        prof.end_step()
    prof.close()
    attrs, samples = read_layer(tmp_path / "context.h5", "1", derive=False)
    for sample, after in zip(samples, samples[1:]):  # each step's running statistics, before it
        args, kwargs = kernels.arguments("batch_norm", "forward", sample, attrs)
        kwargs |= {k: kwargs[k].clone() for k in ("running_mean", "running_var")}
        kernels.golden("batch_norm").forward(*args, **kwargs)
        assert torch.equal(kwargs["running_mean"], after["running_mean"]), sample["step"]
        assert torch.equal(kwargs["running_var"], after["running_var"]), sample["step"]


def cumulative_bn(model):
    model.bn.momentum = None


def stateless_bn(model):
    model.bn = nn.BatchNorm2d(8, track_running_stats=False)


def frozen_bn(model):
    model.eval()  # batch norm normalises with its running statistics (and the deep copy stays in eval)


@pytest.mark.parametrize("variant", [None, cumulative_bn, stateless_bn, frozen_bn])
def test_golden_routing_is_bit_identical_to_pytorch(variant):
    torch.manual_seed(0)
    plain = Tiny()
    if variant is not None:
        variant(plain)
    routed = copy.deepcopy(plain)
    names = sum((kernels.route(routed, kernels.golden(op)) for op in kernels.OPS), [])
    assert sorted(names) == ["bn", "conv1", "conv2", "fc", "ln", "proj", "rms"]
    train_steps(plain)
    train_steps(routed)
    for (name, a), b in zip(plain.state_dict().items(), routed.state_dict().values()):
        assert torch.equal(a, b), name


def test_golden_routing_of_a_layer_norm_without_affine_is_bit_identical():
    """Its input grad was computed with a weight of ones, which PyTorch's backward (no weight)
    rounds differently over a normalized shape of more than one dimension."""
    torch.manual_seed(0)
    x, grad_out, grads = torch.randn(4, 4, 6, 6), torch.randn(4, 4, 6, 6), []
    for route in (False, True):
        norm = nn.Sequential(nn.LayerNorm([6, 6], elementwise_affine=False))
        if route:
            kernels.route(norm, kernels.golden("layer_norm"))
        leaf = x.clone().requires_grad_()
        norm(leaf).backward(grad_out)
        grads.append(leaf.grad)
    assert torch.equal(*grads)


def test_golden_linear_weight_grad_is_pytorchs_for_either_weight_layout():
    """nn.Linear's weight gradient is dO^T x; GPT-2's Conv1D (x W + b, W stored (in, out)) gets
    x^T dO. Some BLAS (MKL on AMD CPUs) round the two products differently: golden follows the layer."""
    torch.manual_seed(0)
    x, grad_out = torch.randn(37, 48), torch.randn(37, 10)
    linear, conv1d = torch.randn(10, 48, requires_grad=True), torch.randn(48, 10, requires_grad=True)
    nn.functional.linear(x, linear).backward(grad_out)
    torch.addmm(torch.zeros(10), x, conv1d).backward(grad_out)
    assert torch.equal(kernels.golden("linear").weight_grad(grad_out, x), linear.grad)
    assert torch.equal(kernels.golden("linear", {"transposed": True}).weight_grad(grad_out, x), conv1d.grad.t())


@pytest.mark.parametrize("impl", ["golden", "forward only"])
def test_playback_replays_what_a_kernel_leaves_to_golden_as_golden_on_a_transposed_layer(context, impl):
    """Golden as the candidate (impl: golden), or the computations a kernel does not define: on
    GPT-2's Conv1D (proj) their weight gradient is the transposed layer's golden one, so the
    kernel case scores no error there (dO^T x differed from x^T dO on an AMD EPYC)."""
    from peat import playback

    plan = playback.Plan(context=context, kernel=kernels.load(impl, "linear") if impl == "golden" else
                         dataclasses.replace(kernels.golden("linear"), custom=("forward",)), errors=["rz:2"],
                         layers=["proj"], meta={"model": "tiny", "vendor": "cpu", "kernel": "k"})
    table, _ = playback.replay(plan)
    kernel = table[table["case"] == "kernel"]
    assert set(kernel["computation"]) == set(kernels.COMPUTATIONS) and (kernel["err_max"] == 0).all()


@pytest.mark.parametrize("custom", [("forward",), ("input_grad",), ("weight_grad",), kernels.COMPUTATIONS])
def test_golden_functions_called_as_a_kernel_are_bit_identical_too(custom):
    """The same golden functions declared as the kernel's own: each goes through the kernel path
    (for the norms, a backward without the forward's saved statistics)."""
    torch.manual_seed(0)
    plain = Tiny()
    routed = copy.deepcopy(plain)
    # GPT-2's Conv1D (proj) stores its weight transposed, and PyTorch's weight gradient is then another product.
    kernels.route(routed, dataclasses.replace(kernels.golden("linear", {"transposed": True}), custom=custom), ["proj"])
    for op in kernels.OPS:
        kernels.route(routed, dataclasses.replace(kernels.golden(op), custom=custom), ["fc"] if op == "linear" else None)
    train_steps(plain)
    train_steps(routed)
    for (name, a), b in zip(plain.state_dict().items(), routed.state_dict().values()):
        assert torch.equal(a, b), name


def test_golden_routing_lets_an_in_place_op_follow_a_linear_layer():
    """F.linear on a 3-D input with a bias returns a view, and autograd forbids in-place ops on a
    custom Function's output that is one: the routed layer crashed the ReLU(inplace=True) after it."""
    x, grads = torch.randn(2, 3, 4), []
    for route in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))
        if route:
            kernels.route(model, kernels.golden("linear"))
        model(x).sum().backward()
        grads.append(model[0].weight.grad)
    assert torch.equal(*grads)


def test_a_routed_layer_called_with_a_keyword_input_runs():
    """The routed forward took the input as its first positional argument: TypeError."""
    x, outs = torch.randn(3, 4), []
    for active in (None, lambda: True, lambda: False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5))
        kernels.route(model, kernels.golden("linear"), active=active)
        outs.append(model[0](input=x))
    assert all(torch.equal(out, nn.functional.linear(x, model[0].weight, model[0].bias)) for out in outs)


def test_a_routed_conv_refuses_an_unbatched_input_naming_the_layer():
    """nn.Conv2d takes a (C, H, W) input as a batch of one; routed, its golden input gradient
    raised "Expected 4-dimensional input" in the backward, naming no layer."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    kernels.route(model, kernels.golden("conv2d"))
    with pytest.raises(PeatError, match=r"^layer '0' got an input of shape \(3, 8, 8\); "
                                        r"a conv2d layer is routed on batched \(N, C, H, W\) inputs$"):
        model(torch.randn(3, 8, 8))


RETURNED = {"its result reshaped": lambda out, x: out.reshape(x.shape), "its input": lambda out, x: x,
            "a view of its input": lambda out, x: x.view(x.shape)}


@pytest.mark.parametrize("returned", list(RETURNED))
def test_a_kernel_forward_may_return_a_view_or_its_input(returned):
    """A view returned by the kernel's forward (im2col's GEMM result reshaped, an identity kernel's
    input) crashed the in-place ReLU after the layer: autograd forbids in-place ops on such outputs."""
    def forward(x, weight, bias, **hp):
        out = kernels.golden("batch_norm").forward(x, weight, bias, **hp).flatten()
        return RETURNED[returned](out, x)

    kernel = dataclasses.replace(kernels.golden("batch_norm"), forward=forward, custom=("forward",))
    x, grads = torch.randn(2, 3, 6, 6), []
    for inplace in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=inplace), nn.Conv2d(4, 2, 1))
        kernels.route(model, kernel)
        model(x).sum().backward()
        grads.append(model[0].weight.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize("computation, training", [("forward", False), ("input_grad", True)])
def test_a_batch_norm_kernel_writing_into_running_statistics_it_may_only_read_fails_naming_them(computation, training):
    """Only a training forward updates them: an eval forward computing 1/sqrt(var + eps) in place
    (validation in candidate training) changed the layer's running_var for good, with no error."""
    gold = kernels.golden("batch_norm")

    def slip(*args, **kwargs):
        kwargs["running_var"].add_(0.0)
        return gold.computation(computation)(*args, **kwargs)

    kernel = dataclasses.replace(gold, custom=(computation,), **{computation: slip})
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    kernels.route(model, kernel)
    model.train(training)
    with pytest.raises(kernels.WroteInput, match=rf"^kernel 'golden' {computation} at layer '1' wrote into its input "
                                                 "running_var in place"):
        model(torch.randn(2, 3, 6, 6)).sum().backward()


def layout_spy(seen: set) -> list[kernels.Kernel]:
    """Golden kernels of every op that note (op, computation, (shape, strides) of each tensor argument)."""
    def spy(op, computation):
        def run(*args, **kwargs):
            seen.add((op, computation, tuple((tuple(a.shape), a.stride()) for a in args if torch.is_tensor(a))))
            return kernels.golden(op).computation(computation)(*args, **kwargs)
        return run

    return [kernels.Kernel("spy", op, custom=kernels.COMPUTATIONS, **{c: spy(op, c) for c in kernels.COMPUTATIONS})
            for op in kernels.OPS]


def test_playback_hands_a_kernel_the_memory_layout_training_does(context):
    """GPT-2's Conv1D weight reached a kernel as a transposed (non-contiguous) view in training but
    contiguous in playback: a kernel assuming either layout was checked on one and trained on the other."""
    trained, replayed = set(), set()
    torch.manual_seed(0)
    model = Tiny()
    for kernel in layout_spy(trained):
        kernels.route(model, kernel)
    train_steps(model, steps=1)
    spies = {k.op: k for k in layout_spy(replayed)}
    for _, attrs, sample, computation in cases(context):
        kernels.call(spies[attrs["op"]], computation, sample, attrs)
    assert ("linear", "forward", (((6, 48), (48, 1)), ((10, 48), (1, 10)), ((10,), (1,)))) in trained  # proj
    assert replayed == trained
    replayed.clear()
    for _, attrs, sample, computation in cases(context):  # as playback reads them: laid out once per sample
        kernels.call(spies[attrs["op"]], computation, kernels.as_trained(sample, attrs), attrs)
    assert replayed == trained


def test_a_routed_kernel_gets_a_contiguous_input_as_playback_does():
    seen = set()
    layer = nn.Linear(4, 3)
    kernels.route(nn.Sequential(layer), layout_spy(seen)[kernels.OPS.index("linear")])
    layer(torch.randn(4, 5, requires_grad=True).t()).sum().backward()
    assert {args[1 if c == "weight_grad" else 0] for _, c, args in seen} == {((5, 3), (3, 1)), ((5, 4), (4, 1))}


def test_a_routed_kernel_returning_golden_in_channels_last_strides_trains_as_golden():
    """An (N, C, 1, 1) result with channels-last strides passes as contiguous: the router handed it on
    so, the batch norm after it took its channels-last backward, and every gradient before it differed
    from golden's though the kernel computed golden's values."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(16, 512, 3), nn.BatchNorm2d(512), nn.Flatten(), nn.Linear(512, 2))
    routed = copy.deepcopy(plain)
    golden = kernels.golden("conv2d")

    def forward(*args, **kwargs):
        out = golden.forward(*args, **kwargs)
        return torch.empty_strided(out.shape, (out.shape[1], 1, out.shape[1], out.shape[1])).copy_(out)
    kernels.route(routed, dataclasses.replace(golden, name="channels_last", forward=forward, custom=("forward",)))
    x = torch.randn(8, 16, 3, 3)
    for net in (plain, routed):
        net(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), routed.parameters()))


def test_a_routed_kernel_may_send_its_inputs_to_a_worker_pool_as_in_playback():
    """A pool's calls pickle their arguments with multiprocessing's pickler, which refuses a tensor
    with autograd history: a kernel sending its inputs to a pool for a CPU reference passed
    playback (fresh copies) and crashed its candidate training at the first call with
    "Cowardly refusing to serialize non-leaf tensor which requires_grad"."""
    from multiprocessing.reduction import ForkingPickler

    def pooled(computation):
        def run(*args, **kwargs):
            for arg in args:
                ForkingPickler.dumps(arg)  # what Pool.apply does with each argument
            return kernels.GOLDEN["linear"][computation](*args, **kwargs)
        return run

    kernel = kernels.Kernel("pooled", "linear", **{c: pooled(c) for c in kernels.COMPUTATIONS},
                            custom=kernels.COMPUTATIONS)
    plain = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    routed = copy.deepcopy(plain)
    kernels.route(routed, kernel, ["2"])
    x = torch.randn(6, 8)
    plain(x).sum().backward()
    routed(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), routed.parameters()))


@pytest.mark.parametrize("computation, shape", [("forward", "(6, 2)"), ("input_grad", "(6, 4)")])
def test_a_routed_kernel_returning_its_result_on_another_device_fails_naming_it(computation, shape):
    """A CUDA layer's kernel returning a CPU tensor (meta here) trained on into torch's device error at
    the next op, or autograd's, a crash naming neither kernel nor layer."""
    own = {computation: lambda *args, **kw: kernels.GOLDEN["linear"][computation](*args, **kw).to("meta")}
    kernel = kernels.Kernel("elsewhere", "linear", **(kernels.GOLDEN["linear"] | own), custom=(computation,))
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    kernels.route(model, kernel, ["2"])
    message = f"kernel 'elsewhere' {computation} returned {shape} torch.float32 on meta, expected {shape} torch.float32 on cpu"
    with pytest.raises(kernels.ShapeMismatch, match=f"^{re.escape(message)}$"):
        model(torch.randn(6, 8)).sum().backward()


def buffered(key) -> kernels.Kernel:
    """Golden linear whose forward returns one buffer per ``key(x, weight)``, written as C++ writes
    it (no version bump for autograd to notice)."""
    buffers = {}

    def forward(x, weight, bias):
        out = nn.functional.linear(x, weight, bias)
        buffer = buffers.setdefault(key(x, weight), torch.empty_like(out))
        buffer.data.copy_(out)
        return buffer

    return dataclasses.replace(kernels.golden("linear"), name="buffered", forward=forward, custom=("forward",))


def test_a_kernel_returning_one_buffer_every_call_fails_naming_it():
    """The second call overwrote the first layer's output, which the GELU after it saved for its
    backward: the first layer's gradients came out wrong, with no error."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    kernels.route(model, buffered(lambda x, weight: x.shape))
    with pytest.raises(kernels.ReusedOutput, match=r"^kernel 'buffered' forward at layer '2' returned the memory of "
                                                   r"its output at layer '0', still held"):
        model(torch.randn(4, 8))


def test_memory_handed_out_again_once_free_is_not_taken_for_a_held_buffer():
    """The same memory may come back once nothing holds the earlier output: in a no_grad evaluation
    (nothing saved for a backward), or a layer's own buffer in the next pass (its backward has run)."""
    memory = np.zeros((4, 8), np.float32)

    def forward(x, weight, bias):  # a new tensor on the same memory at every call
        return torch.from_numpy(memory).copy_(nn.functional.linear(x, weight, bias))

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    kernels.route(model, dataclasses.replace(kernels.golden("linear"), name="shared", forward=forward,
                                             custom=("forward",)))
    with torch.no_grad():
        model(torch.randn(4, 8))
    with pytest.raises(kernels.ReusedOutput, match="kernel 'shared' forward at layer '2'"):
        model(torch.randn(4, 8))  # with autograd, the GELU holds layer 0's output for its backward
    per_layer = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    kernels.route(per_layer, buffered(lambda x, weight: weight.data_ptr()))
    for _ in range(2):
        per_layer(torch.randn(4, 8)).sum().backward()


def test_a_copy_of_a_routed_model_tracks_its_own_outputs():
    """The copy's weak references were the original's: each would have been released twice."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    kernels.route(model, dataclasses.replace(kernels.golden("linear"), custom=("forward",)))
    model(torch.randn(2, 4))
    twin = copy.deepcopy(model)
    assert len(model._peat_kernel_outputs.held) == 2 and not twin._peat_kernel_outputs.held
    twin._forward_pre_hooks.popitem()[1]()  # the copy's hook empties the copy's tracker, not the original's
    assert len(model._peat_kernel_outputs.held) == 2


def test_a_copy_of_a_routed_model_runs_on_its_own_weights():
    """The routed forward was a closure on the original's modules, which deepcopy shares: the copy
    computed with the original's weights and sent its gradients there."""
    torch.manual_seed(0)
    plain = Tiny()
    model = copy.deepcopy(plain)
    for op in ("linear", "conv2d", "batch_norm", "layer_norm"):  # fc and GPT-2's transposed Conv1D among them
        kernels.route(model, dataclasses.replace(kernels.golden(op), custom=kernels.COMPUTATIONS))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for params in (plain.parameters(), twin.parameters()):
            for p in params:
                p.mul_(0.5)
    x = torch.randn(6, 3, 6, 6)
    out = twin(x)
    assert torch.equal(out, plain(x))
    out.sum().backward()
    assert all(p.grad is not None for p in twin.parameters()) and all(p.grad is None for p in model.parameters())


def test_a_saved_routed_model_loads_in_a_new_process(tmp_path):
    """Since the routed forward is an object, torch.save of a routed model succeeds; after a pass
    it pickled the tracker's weak references, raw pointers into this process: torch.load in
    another process failed ('StorageType' object has no attribute '_free_weak_ref')."""
    import subprocess
    import sys

    model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))
    kernels.route(model, dataclasses.replace(kernels.golden("layer_norm"), custom=kernels.COMPUTATIONS))
    model(torch.randn(4, 8)).sum().backward()
    torch.save(model, tmp_path / "model.pt")
    script = (f"import torch; twin = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False); "
              "twin(torch.randn(4, 8)).sum().backward(); print(len(twin._peat_kernel_outputs.held))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    # The loaded routes track into the loaded model's own tracker: 2 outputs, 1 input and 2 weight gradients.
    assert run.returncode == 0 and run.stdout == "5\n", run.stderr


def grad_buffered(computation: str, handed_out: str) -> kernels.Kernel:
    """Golden linear whose ``computation`` writes into one buffer per result shape and hands out the
    buffer itself ("same") or a new view of it ("view", as a C++ kernel wraps a static buffer)."""
    golden, buffers = kernels.golden("linear"), {}

    def run(*args):
        out = golden.computation(computation)(*args)
        buffer = buffers.setdefault(tuple(out.shape), torch.empty_like(out))
        buffer.data.copy_(out)
        return buffer if handed_out == "same" else buffer.view(buffer.shape)

    return dataclasses.replace(golden, name="buffered", custom=(computation,), **{computation: run})


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.c(h + self.b(torch.relu(h)))


@pytest.mark.parametrize("computation, handed_out, message", [
    ("input_grad", "same", "kernel 'buffered' input_grad at layer 'b' returned the memory of its input_grad result at "
                           "layer 'c', still held by autograd in this backward pass"),
    ("weight_grad", "view", "kernel 'buffered' weight_grad at layer 'b' returned the memory of its weight_grad result "
                            "at layer 'c', now that layer's accumulated weight .grad")])
def test_a_gradient_kernel_returning_one_buffer_every_call_fails_naming_it(computation, handed_out, message):
    """Only forward outputs were checked: layer b's input gradient overwrote c's, which autograd
    still held for the residual branch, and a weight gradient autograd had taken as c's .grad was
    overwritten by b's; both trained on wrong gradients with no error."""
    model = Residual()
    kernels.route(model, grad_buffered(computation, handed_out))
    with pytest.raises(kernels.ReusedOutput, match="^" + re.escape(message)):
        model(torch.randn(4, 8)).sum().backward()


def test_a_weight_gradient_buffer_autograd_copies_trains_as_golden():
    """A weight gradient handed out as the kernel's own buffer is copied by autograd into .grad:
    its memory is free again at once, so reusing it is no fault."""
    torch.manual_seed(0)
    golden = Residual()
    model = copy.deepcopy(golden)
    kernels.route(model, grad_buffered("weight_grad", "same"))
    for net in (golden, model):
        train_steps_linear(net)
    assert all(torch.equal(a, b) for a, b in zip(golden.parameters(), model.parameters()))


def test_a_weight_gradient_on_its_own_accumulated_grad_fails():
    """Backward twice before the optimizer steps (micro-batches): the second call wrote into the
    .grad autograd had taken from the first, which then doubled."""
    model = nn.Sequential(nn.Linear(8, 8))
    kernels.route(model, grad_buffered("weight_grad", "view"))
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(kernels.ReusedOutput, match=r"weight_grad at layer '0' returned the memory of its weight_grad "
                                                   r"result at layer '0', now that layer's accumulated weight .grad"):
        model(torch.randn(4, 8)).sum().backward()


@pytest.mark.filterwarnings("error")
def test_a_computed_weight_routes_without_a_non_leaf_grad_warning():
    """A weight computed from a parametrization (weight_norm) has no .grad: looking for one there
    warned at every weight gradient (the .grad of a non-leaf tensor), an error under -W error."""
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)))
    kernels.route(model, dataclasses.replace(kernels.golden("linear"), custom=("weight_grad",)))
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    assert model[0].parametrizations.weight.original1.grad is not None


def train_steps_linear(model, steps=2):
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
        opt.step()


HEAVY_OPS = {"convolution", "convolution_backward", "native_batch_norm", "native_batch_norm_backward",
             "native_layer_norm", "native_layer_norm_backward", "mm", "addmm"}


def heavy_ops(model) -> collections.Counter:
    """The compute-bound aten ops one training step runs (what golden routing must not add to)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if name in HEAVY_OPS:
                seen[name] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        train_steps(model, steps=1)
    return seen


def test_golden_routing_runs_the_same_ops_as_pytorch():
    """One fused backward per layer, and the norms' statistics computed once (in the forward)."""
    torch.manual_seed(0)
    plain = Tiny()
    routed = copy.deepcopy(plain)
    for op in kernels.OPS:
        kernels.route(routed, kernels.golden(op))
    expected = heavy_ops(plain)
    assert expected["native_batch_norm"] == 1 and expected["convolution_backward"] == 2
    assert heavy_ops(routed) == expected


# -- shipped alternatives ---------------------------------------------------------------------
EXACT = 1e-5  # different accumulation order only: within a few float32 ulps of the reference
ALTERNATIVES = [  # impl, op, max relative error to float64, min relative error (0: any)
    ("peat.alt_kernels.im2col", "conv2d", EXACT, 0), ("peat.alt_kernels.winograd", "conv2d", EXACT, 0),
    ("peat.alt_kernels.blocked_gemm", "linear", EXACT, 0), ("peat.alt_kernels.splitk_gemm", "linear", EXACT, 0),
    ("kernels/my_gemm.py", "linear", EXACT, 0),
    ("peat.alt_kernels.onepass_norm", "batch_norm", EXACT, 0), ("peat.alt_kernels.onepass_norm", "layer_norm", EXACT, 0),
    ("peat.alt_kernels.welford_norm", "batch_norm", EXACT, 0), ("peat.alt_kernels.welford_norm", "layer_norm", EXACT, 0),
    ("peat.alt_kernels.rms_norm", "rms_norm", EXACT, 0),
    ("peat.alt_kernels.tf32", "linear", 3e-3, 2e-5), ("peat.alt_kernels.tf32", "conv2d", 3e-3, 2e-5),
    ("peat.alt_kernels.fp16_gemm", "linear", 3e-3, 2e-5), ("peat.alt_kernels.bf16_gemm", "linear", 3e-2, 2e-4),
]


@pytest.mark.parametrize("impl, op, bound, floor", ALTERNATIVES, ids=[f"{a[0].split('.')[-1]}-{a[1]}" for a in ALTERNATIVES])
def test_alternative_is_correct_and_numerically_different(context, impl, op, bound, floor):
    kernel, golden = kernels.load(impl, op), kernels.golden(op)
    assert set(kernel.custom) >= {"forward"}
    differs = False
    for layer, attrs, sample, computation in cases(context, op):
        ref = kernels.call(golden, computation, sample, attrs, dtype=torch.float64)
        got = kernels.call(kernel, computation, sample, attrs)
        assert got.shape == ref.shape and got.dtype == torch.float32
        err = rel_err(got, ref)
        assert err < bound, (layer, computation, err)
        if computation in kernel.custom:
            assert err >= floor, (layer, computation, err)  # low precision must show
        differs |= not torch.equal(got, kernels.call(golden, computation, sample, attrs))
    assert differs


@pytest.mark.parametrize("impl, op", [a[:2] for a in ALTERNATIVES], ids=[f"{a[0].split('.')[-1]}-{a[1]}" for a in ALTERNATIVES])
def test_alternative_computes_on_the_device_of_its_operands(context, impl, op):
    """A GPU vendor's run hands kernels CUDA tensors (meta ones stand in here): the example
    kernels/my_gemm.py made its accumulator on the CPU, and every call of it crashed there."""
    kernel = kernels.load(impl, op)
    for layer, attrs, sample, computation in cases(context, op):
        if computation in kernel.custom:
            meta = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in sample.items()}
            assert kernels.call(kernel, computation, meta, attrs).is_meta, (layer, computation)


@pytest.mark.parametrize("impl", ["peat.alt_kernels.onepass_norm", "peat.alt_kernels.welford_norm"])
def test_alternative_layer_norm_serves_a_weight_without_bias(impl):
    """LayerNorm(bias=False) passes bias None with a weight: the forward added None and crashed."""
    x, w = torch.randn(4, 6, 16) * 3 + 2, torch.randn(16)
    got = kernels.load(impl, "layer_norm").forward(x, w, None, normalized_shape=(16,), eps=1e-5)
    ref = nn.functional.layer_norm(x.double(), (16,), w.double(), None, 1e-5)
    assert rel_err(got, ref) < EXACT


def test_winograd_falls_back_to_golden_where_it_does_not_apply():
    kernel, golden = kernels.load("peat.alt_kernels.winograd", "conv2d"), kernels.golden("conv2d")
    x, w = torch.randn(2, 4, 9, 9), torch.randn(5, 4, 3, 3)
    for hp in (dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=1),
               dict(stride=(1, 1), padding=(1, 1), dilation=(2, 2), groups=1)):
        assert torch.equal(kernel.forward(x, w, None, **hp), golden.forward(x, w, None, **hp))
    assert "weight_grad" not in kernel.custom


def test_compiled_kernel_once(context):
    from peat.alt_kernels import compiled

    kernel = kernels.load("peat.alt_kernels.compiled", "layer_norm")
    attrs, samples = read_layer(context, "ln")
    got = kernels.call(kernel, "forward", samples[0], attrs)
    golden = kernels.expected("forward", samples[0])
    if compiled.FALLBACK:  # no compiler here: the documented fallback is exactly golden
        assert torch.equal(got, golden)
    else:
        ref = kernels.call(kernels.golden("layer_norm"), "forward", samples[0], attrs, torch.float64)
        assert rel_err(got, ref) < EXACT


# -- loading ------------------------------------------------------------------------------------
def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_file_namespace_and_golden_fallback(tmp_path):
    path = write(tmp_path, "half.py", "def forward(x, weight, bias):\n    return x @ weight.t() * 2\n")
    kernel = kernels.load(path, "linear")
    assert kernel.name == "half" and kernel.custom == ("forward",) and kernel.source == path
    assert kernels.load("peat.alt_kernels.im2col", "conv2d").name == "im2col"  # was "alt_kernels"
    assert kernel.input_grad is kernels.GOLDEN["linear"]["input_grad"]
    ns = write(tmp_path, "multi.py", "class conv2d:\n    pass\n\nclass linear:\n"
                                     "    def weight_grad(grad_out, x):\n        return grad_out.t() @ x\n")
    assert kernels.load(ns, "linear").custom == ("weight_grad",)
    with pytest.raises(PeatError) as err:
        kernels.load(ns, "conv2d")
    assert str(err.value) == f"{ns}: defines none of forward, input_grad, weight_grad for op 'conv2d'"


@pytest.mark.parametrize("impl, op, message", [
    ("kernels/does_not_exist.py", "linear",
     f"kernel impl 'kernels/does_not_exist.py': no such file (relative to {kernels.REPO})"),
    ("peat.alt_kernels.nope", "linear",
     "kernel impl 'peat.alt_kernels.nope': cannot import (No module named 'peat.alt_kernels.nope')"),
    ("golden", "softmax", "op: unknown op 'softmax'; allowed: linear, conv2d, batch_norm, layer_norm, rms_norm"),
    ("peat.alt_kernels.im2col", "linear", "peat.alt_kernels.im2col: is a conv2d kernel (OP = 'conv2d'), not linear"),
    ("peat.alt_kernels.onepass_norm", "conv2d",
     "peat.alt_kernels.onepass_norm: defines none of forward, input_grad, weight_grad for op 'conv2d'")])
def test_load_rejects_bad_kernels_in_one_line(impl, op, message):
    with pytest.raises(PeatError) as err:
        kernels.load(impl, op)
    assert str(err.value) == message


def test_a_missing_kernel_file_names_each_folder_searched_once(tmp_path, monkeypatch):
    # Run from the checkout, the message read "(relative to /repo or /repo)".
    monkeypatch.chdir(kernels.REPO)
    with pytest.raises(PeatError) as err:
        kernels.load("kernels/does_not_exist.py", "linear")
    assert str(err.value).endswith(f"no such file (relative to {kernels.REPO})")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PeatError) as err:
        kernels.load("kernels/does_not_exist.py", "linear")
    assert str(err.value).endswith(f"no such file (relative to {tmp_path} or {kernels.REPO})")


def test_load_reports_import_errors_with_the_file(tmp_path):
    path = write(tmp_path, "broken.py", "import numpy\nraise ValueError('half written')\n")
    with pytest.raises(PeatError, match=r"broken.py: import failed: ValueError: half written"):
        kernels.load(path, "linear")
    path = write(tmp_path, "chatty.py", "raise RuntimeError('no device\\nCompile with TORCH_USE_CUDA_DSA')\n")
    with pytest.raises(PeatError) as err:  # a multi-line message was passed on whole
        kernels.load(path, "linear")
    assert str(err.value).endswith("chatty.py: import failed: RuntimeError: no device")


def test_load_a_file_that_a_plain_import_would_load(tmp_path):
    """The file's module was not in sys.modules while it ran, as an import puts it: a dataclass
    under postponed annotations failed with "import failed: AttributeError: 'NoneType' ..."."""
    path = write(tmp_path, "tiled.py", "from __future__ import annotations\nfrom dataclasses import dataclass\n\n"
                                       "@dataclass\nclass Tile:\n    size: int = 32\n\n"
                                       "def forward(x, weight, bias):\n    return x @ weight.t() + bias\n")
    assert kernels.load(path, "linear").custom == ("forward",)


def test_a_kernel_file_with_a_dot_in_its_name_pickles_its_own_functions(tmp_path):
    """A worker pool sends the kernel's functions by name (pickle imports their module): the file
    gemm.v2.py was registered as module 'peat_kernel_gemm.v2_<digest>', a submodule of a package
    that does not exist, and every pool call failed with "Can't pickle <function _row ...>"."""
    path = write(tmp_path, "gemm.v2.py", "import pickle\n\ndef _row(x, w):\n    return x @ w.t()\n\n"
                                         "def forward(x, weight, bias):\n"
                                         "    return pickle.loads(pickle.dumps(_row))(x, weight) + bias\n")
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    assert torch.equal(kernels.load(path, "linear").forward(x, w, b), x @ w.t() + b)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_kernel_files_own_functions_run_in_a_pool_it_starts_by_spawn_or_forkserver(tmp_path, monkeypatch, method):
    """Such a pool's workers import what they run by its module's name in a fresh interpreter: the
    kernel file's functions stopped every worker with "No module named 'peat_kernel_...'" and the
    pool's call never returned (a timeout after train_timeout). No torch in the file: a fast worker."""
    monkeypatch.setenv("PEAT_KERNEL_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path, "pooled.py", "import multiprocessing as mp\n\ndef _scale(k):\n    return 2 * k\n\n"
                                        "def forward(x, weight, bias):\n"
                                        f"    with mp.get_context({method!r}).Pool(1) as pool:\n"
                                        "        scale = pool.apply_async(_scale, (3,)).get(timeout=30)\n"
                                        "    return (x @ weight.t() + bias) * scale\n")
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    assert torch.equal(kernels.load(path, "linear").forward(x, w, b), (x @ w.t() + b) * 6)


def test_a_spawn_pool_finds_the_kernel_file_where_it_is_now_after_a_copy_elsewhere_was_deleted(tmp_path, monkeypatch):
    """The module the workers import is named by the file's digest: one written for the same file in
    a checkout (or a test's folder) since deleted sent every worker to a missing file."""
    import shutil

    monkeypatch.setenv("PEAT_KERNEL_CACHE", str(tmp_path / "cache"))
    text = ("import multiprocessing as mp\n\ndef _scale(k):\n    return 2 * k\n\n"
            "def forward(x, weight, bias):\n"
            "    with mp.get_context('spawn').Pool(1) as pool:\n"
            "        scale = pool.apply_async(_scale, (3,)).get(timeout=30)\n"
            "    return (x @ weight.t() + bias) * scale\n")
    (tmp_path / "old").mkdir()
    kernels.load(write(tmp_path / "old", "pooled.py", text), "linear")
    shutil.rmtree(tmp_path / "old")
    (tmp_path / "new").mkdir()
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    kernel = kernels.load(write(tmp_path / "new", "pooled.py", text), "linear")
    assert torch.equal(kernel.forward(x, w, b), (x @ w.t() + b) * 6)


@pytest.mark.parametrize("call", ["kernels.run_isolated(k.forward, None, None, None, timeout=90).value",
                                  "k.forward(None, None, None)"])
def test_a_spawn_pool_of_a_kernel_never_reruns_the_jobs_script(tmp_path, monkeypatch, call):
    """A spawn worker runs its parent's main script again (as __mp_main__) unless it is guarded, and a
    Snakemake job's script is not: each worker of a candidate or playback job's spawn pool died on
    the script's first line ("name 'snakemake' is not defined") and was replaced, and the call was a
    timeout (after train_timeout in training). Here the script notes each run of its top level."""
    monkeypatch.setenv("PEAT_KERNEL_CACHE", str(tmp_path / "cache"))
    kernel = write(tmp_path, "pooled.py", "import multiprocessing as mp\n\ndef _scale(k):\n    return 2 * k\n\n"
                                          "def forward(x, weight, bias):\n"
                                          "    with mp.get_context('spawn').Pool(1) as pool:\n"
                                          "        return pool.apply_async(_scale, (3,)).get(timeout=60)\n")
    runs = tmp_path / "runs.txt"
    body = (f"with open({str(runs)!r}, 'a') as f:\n    f.write(__name__ + '\\n')\n"
            "if __name__ == '__main__':  # the rest only once, to end either way\n"
            "    from peat import kernels\n"
            f"    k = kernels.load({kernel!r}, 'linear')\n"
            f"    print({call})\n")
    # As Snakemake runs a job's script: a copy under .snakemake/scripts/ with a preamble naming the
    # workflow's own script as __file__, which is what a worker runs.
    (tmp_path / "scripts").mkdir()
    own = write(tmp_path, "scripts/job.py", body)
    (tmp_path / ".snakemake" / "scripts").mkdir(parents=True)
    script = write(tmp_path, ".snakemake/scripts/tmp1a2b.job.py",
                   f"__real_file__ = __file__; __file__ = {own!r}\n{body}")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "6", done.stderr[-2000:]
    assert runs.read_text().splitlines() == ["__main__"]


def test_a_guarded_script_of_ones_own_still_runs_its_functions_in_a_spawn_pool_after_loading_a_kernel(tmp_path):
    script = write(tmp_path, "mine.py", "import multiprocessing as mp\n\ndef f(k):\n    return k + 1\n\n"
                                        "if __name__ == '__main__':\n"
                                        "    from peat import kernels\n"
                                        f"    kernels.load({str(REPO / 'kernels' / 'my_gemm.py')!r}, 'linear')\n"
                                        "    with mp.get_context('spawn').Pool(1) as pool:\n"
                                        "        print(pool.apply_async(f, (1,)).get(timeout=60))\n")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "2", done.stderr[-2000:]


def test_a_kernel_package_that_fails_to_import_is_one_line_for_its_sources(tmp_path, monkeypatch):
    """Finding ``mypkg.kern`` runs ``mypkg/__init__.py``: an error there (a missing toolkit) ended the
    config check and the workflow's parse with its traceback, where loading it says so in one line."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("raise RuntimeError('no toolkit')\n")
    (tmp_path / "mypkg" / "kern.py").write_text("def forward(x, weight, bias):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for find in (kernels.source_files, lambda impl: kernels.load(impl, "linear")):
        with pytest.raises(PeatError) as caught:
            find("mypkg.kern")
        assert str(caught.value) == "kernel impl 'mypkg.kern': import failed: RuntimeError: no toolkit"
    sys.modules.pop("mypkg", None)


def test_source_files_list_what_should_rerun_jobs():
    assert kernels.source_files("golden") == []
    files = [Path(f).name for f in kernels.source_files("peat.alt_kernels.blocked_gemm")]
    assert files[0] == "blocked_gemm.py" and "_gemm.py" in files and "__init__.py" not in files
    assert Path(kernels.source_files("kernels/my_gemm.py")[0]).resolve() == REPO / "kernels/my_gemm.py"


def test_a_kernel_module_reruns_on_the_helpers_it_imports_only(tmp_path, monkeypatch):
    """Every ``_*.py`` beside a dotted kernel was a source of it: editing the norm kernels' ``_norm.py``
    reran im2col's candidate training and playback, which never import it."""
    def names(impl):
        return [Path(f).name for f in kernels.source_files(impl)]

    assert names("peat.alt_kernels.im2col") == ["im2col.py"]
    assert names("peat.alt_kernels.welford_norm") == ["welford_norm.py", "_norm.py"]
    assert names("peat.alt_kernels.tf32") == ["tf32.py", "_gemm.py"]
    pkg = tmp_path / "rerunpkg"
    pkg.mkdir()
    files = {"__init__.py": "", "kern.py": "from . import _a\nimport rerunpkg._d\n",
             "_a.py": "from ._b import f\n", "_b.py": "f = 1\n", "_c.py": "", "_d.py": "",
             "broken.py": "def (\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert names("rerunpkg.kern") == ["kern.py", "_a.py", "_b.py", "_d.py"]  # through _a; not _c
    # One that does not parse fails at load in words; until then every helper counts, as it may import any.
    assert names("rerunpkg.broken") == ["broken.py", "_a.py", "_b.py", "_c.py", "_d.py"]


def test_cpp_kernel_compiles_once_and_serves_linear(context, monkeypatch):
    kernel = kernels.load("kernels/naive_gemm.cpp", "linear")
    assert kernel.custom == kernels.COMPUTATIONS
    for layer, attrs, sample, computation in cases(context, "linear"):
        ref = kernels.call(kernels.golden("linear"), computation, sample, attrs, dtype=torch.float64)
        assert rel_err(kernels.call(kernel, computation, sample, attrs), ref) < EXACT
    from torch.utils import cpp_extension

    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built.append(kwargs["name"]))
    again = kernels.load("kernels/naive_gemm.cpp", "linear")  # the same source: the build in this process
    assert built == [] and again.forward is kernel.forward
    # Tensors on a GPU (here meta, which has no memory at all) are refused in words: on an H200 the
    # kernel read CUDA memory as host memory and the playback job died of SIGSEGV.
    x, w = torch.ones(2, 3, device="meta"), torch.ones(4, 3, device="meta")
    with pytest.raises(RuntimeError, match="^naive_gemm: a CPU kernel, given tensors on meta and meta$"):
        kernel.forward(x, w, None)


@pytest.mark.parametrize("name", ["bad_kernel.cpp", "bad kernel.cpp"])
def test_cpp_compile_error_shows_the_compilers_first_error(tmp_path, monkeypatch, name):
    """A space in the file's name failed the build before compiling, with ninja's "'bad', needed by ..."."""
    monkeypatch.setenv("PEAT_KERNEL_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path, name, '#include "no_such_header.h"\nint main() { return 0; }\n')
    with pytest.raises(PeatError) as err:
        kernels.load(path, "linear")
    message = str(err.value)
    assert message.startswith(f"{path}: compile failed: {path}:1:") and "no_such_header.h" in message
    assert "error" in message and str(tmp_path / "cache") not in message


# -- isolation -----------------------------------------------------------------------------------
def _raise(*args, **kwargs):
    raise ValueError("kernel bug at tile 3")


def _hang(*args, **kwargs):
    time.sleep(60)


def _segfault(*args, **kwargs):
    import ctypes

    ctypes.string_at(0)


def _wrong_shape(x, weight, bias):
    return (x @ weight.t())[:, :-1]


def _nan(x, weight, bias):
    return torch.full((x.shape[0], weight.shape[0]), float("nan"))


def _huge(*args, **kwargs):
    return torch.empty(2**33)


def _numpy(x, weight, bias):  # a prototype written in NumPy: a crash "Weights only load failed" in a child
    return (x @ weight.t() + bias).numpy()


def _elsewhere(x, weight, bias):  # a CPU result from CUDA operands, say (meta stands in for the other device)
    return (x @ weight.t() + bias).to("meta")


ON_META = "returned (6, 48) torch.float32 on meta, expected (6, 48) torch.float32 on cpu"


@pytest.mark.parametrize("func, status, message", [
    (_raise, "crash", "ValueError: kernel bug at tile 3"), (_hang, "timeout", "no result after 2 s"),
    (_segfault, "crash", "killed by SIGSEGV"), (_wrong_shape, "shape_mismatch", "returned (6, 47)"),
    (_nan, "ok", "288 non-finite values"), (_huge, "oom", "allocate"),
    (_numpy, "shape_mismatch", "returned ndarray, expected a tensor"), (_elsewhere, "shape_mismatch", ON_META)])
def test_run_isolated_records_outcomes(context, func, status, message):
    attrs, samples = read_layer(context, "fc")
    kernel = kernels.Kernel("bad", "linear", func, func, func, custom=kernels.COMPUTATIONS)
    outcome = kernels.run_isolated(kernels.call, kernel, "forward", samples[0], attrs, timeout=2, memory_mb=1024,
                                   expect=samples[0]["O"])
    assert outcome.status == status and message in outcome.message
    assert set(outcome.record()) == {"status", "message", "seconds"}
    assert outcome.seconds < 10


def test_a_result_on_another_device_than_its_operands_is_a_shape_mismatch_unrecorded_too(context):
    """Where the context holds no result (record.derived: false), the result is expected on meta
    tensors: a result on another device than the operands passed as ok (a CPU one from a CUDA
    kernel was then moved to the CPU and scored)."""
    attrs, samples = read_layer(context, "fc", derive=False)
    sample = next(s for s in samples if s.get("A") is not None)
    kernel = kernels.Kernel("elsewhere", "linear", _elsewhere, _elsewhere, _elsewhere, custom=kernels.COMPUTATIONS)
    outcome = kernels.run_isolated(kernels.call, kernel, "forward", sample, attrs, timeout=10,
                                   expect=kernels.expected("forward", sample, attrs))
    assert "O" not in sample and (outcome.status, outcome.message) == ("shape_mismatch", ON_META)


def test_a_result_on_another_device_is_judged_in_the_child_and_never_loaded_here(context, monkeypatch):
    """Loaded back, a CUDA result of a CPU layer started CUDA in the job: no kernel could then run
    in a child (CUDA does not survive a fork), and the later probes ran unisolated."""
    attrs, samples = read_layer(context, "fc")
    kernel = kernels.Kernel("elsewhere", "linear", _elsewhere, _elsewhere, _elsewhere, custom=kernels.COMPUTATIONS)
    loads, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: loads.append(1) or load(*args, **kwargs))
    outcome = kernels.run_isolated(kernels.call, kernel, "forward", samples[0], attrs, timeout=10,
                                   expect=samples[0]["O"])
    assert (outcome.status, outcome.message, loads) == ("shape_mismatch", ON_META, [])


def test_run_isolated_returns_the_value(context):
    attrs, samples = read_layer(context, "conv1")
    golden = kernels.golden("conv2d")
    outcome = kernels.run_isolated(kernels.call, golden, "forward", samples[0], attrs, expect=samples[0]["O"])
    assert outcome.ok and outcome.message == "" and torch.equal(outcome.value, samples[0]["O"])


def _value(v):
    return torch.tensor([v])


def _leak_then_return(v):
    _leak_then_return.kept = torch.ones(2**26)  # 256 MB kept alive in the child
    return torch.tensor([v])


def test_calls_isolated_together_keep_their_own_outcomes():
    """One child runs the calls in order; a call that kills or hangs it costs the calls after it nothing."""
    calls = [kernels.Call(_value, (1,)), kernels.Call(_segfault), kernels.Call(_value, (2,)), kernels.Call(_hang),
             kernels.Call(_value, (3,), expect=torch.zeros(1, dtype=torch.int64)), kernels.Call(_raise),
             kernels.Call(_value, (4,), expect=torch.zeros(2))]
    start = time.perf_counter()
    outcomes = kernels.run_isolated_many(calls, timeout=2)
    elapsed = time.perf_counter() - start
    assert [o.status for o in outcomes] == ["ok", "crash", "ok", "timeout", "ok", "crash", "shape_mismatch"]
    assert [int(outcomes[i].value) for i in (0, 2, 4)] == [1, 2, 3]
    assert "SIGSEGV" in outcomes[1].message and "tile 3" in outcomes[5].message
    # Each call's seconds are its own: the hang's 2 s are charged to it alone, whatever the machine's load.
    assert outcomes[3].seconds >= 2 and sum(o.seconds for o in outcomes) <= elapsed


def test_memory_limit_holds_for_each_call_in_a_shared_child():
    """What an earlier call keeps does not eat into the next call's allowance."""
    calls = [kernels.Call(_leak_then_return, (1,)), kernels.Call(_huge), kernels.Call(_leak_then_return, (2,))]
    outcomes = kernels.run_isolated_many(calls, timeout=10, memory_mb=300)
    assert [o.status for o in outcomes] == ["ok", "oom", "ok"]


def _fork_then_die(*args, **kwargs):
    import os

    if os.fork() == 0:  # a helper process (a fork-started worker pool): it inherits the result pipe
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.05)
        time.sleep(10)  # outlives the kernel a while, then goes
        os._exit(0)
    os._exit(5)


def test_a_kernel_that_dies_is_a_crash_even_when_a_process_it_forked_holds_the_pipe():
    outcomes = kernels.run_isolated_many([kernels.Call(_fork_then_die), kernels.Call(_value, (1,))], timeout=5)
    assert [(o.status, o.message) for o in outcomes] == [("crash", "exited with code 5 without a result"), ("ok", "")]
    assert outcomes[0].seconds < 4


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # killed, not yet reaped by its new parent
    except FileNotFoundError:
        return True


def _stopped(pids: list[int], within: float = 5.0) -> bool:
    """Whether all of ``pids`` are gone within ``within`` seconds; any left are killed here."""
    deadline = time.monotonic() + within
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if not _gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return not alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_child_does_not_outlive_a_parent_killed_while_it_runs(tmp_path):
    """A playback job killed (SIGTERM) while a probe hangs leaves no child running on, holding its
    memory, nor a worker process the kernel started."""
    told = tmp_path / "pids"
    script = ("import multiprocessing, os, time, pathlib\nfrom peat import kernels\n"
              "def hang():\n"
              "    worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,))\n"
              "    worker.start()\n"
              "    pathlib.Path(os.environ['TOLD']).write_text(f'{os.getpid()} {worker.pid}')\n"
              "    time.sleep(60)\n"
              "kernels.run_isolated_many([kernels.Call(hang)], timeout=60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], env=os.environ | {"TOLD": str(told)})
    try:
        deadline = time.monotonic() + 60
        while not (told.exists() and told.read_text()) and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(pid) for pid in told.read_text().split()]
        parent.send_signal(signal.SIGTERM)
        parent.wait(10)
    finally:
        parent.kill()
    assert _stopped(pids)


def _square(v):
    return v * v


def _pooled(*values):
    """A kernel computing its reference on a worker pool that it keeps from call to call."""
    import concurrent.futures
    import multiprocessing

    if not hasattr(_pooled, "pool"):
        _pooled.pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"))
    print(f"pooled {values}")
    return torch.tensor(list(_pooled.pool.map(_square, values)))


def test_a_kernel_may_run_a_worker_pool_of_its_own(capfd):
    """The child was daemonic, which multiprocessing allows no children: a kernel using a pool was a
    crash, "daemonic processes are not allowed to have children"."""
    start = time.monotonic()
    outcomes = kernels.run_isolated_many([kernels.Call(_pooled, (1, 2, 3)), kernels.Call(_pooled, (4,))], timeout=20)
    assert [(o.status, o.message) for o in outcomes] == [("ok", ""), ("ok", "")]
    assert [o.value.tolist() for o in outcomes] == [[1, 4, 9], [16]]
    assert time.monotonic() - start < 10  # the pool it keeps does not hold the child past its last result
    assert "pooled (4,)" in capfd.readouterr().out  # printed in the child, which is killed, not left to exit


def _hang_with_workers(told):
    """A kernel that starts a worker process and a program, says their ids, and hangs."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    worker.start()
    program = subprocess.Popen(["sleep", "60"])
    Path(told).write_text(f"{worker.pid} {program.pid}")
    time.sleep(60)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_kernel_timed_out_takes_the_processes_it_started_with_it(tmp_path):
    outcome = kernels.run_isolated(_hang_with_workers, str(tmp_path / "pids"), timeout=2)
    assert outcome.status == "timeout"
    assert _stopped([int(pid) for pid in (tmp_path / "pids").read_text().split()])


@pytest.mark.parametrize("func, status, message", [
    (_raise, "crash", "ValueError: kernel bug at tile 3"), (_hang, "timeout", "no result after 1 s"),
    (_wrong_shape, "shape_mismatch", "returned (6, 47)"), (_numpy, "shape_mismatch", "returned ndarray, expected a tensor"),
    (_elsewhere, "shape_mismatch", ON_META)])
def test_inline_runs_used_under_cuda_record_the_same_outcomes(context, func, status, message):
    attrs, samples = read_layer(context, "fc")
    kernel = kernels.Kernel("bad", "linear", func, func, func, custom=kernels.COMPUTATIONS)
    outcome = kernels._run_inline(kernels.call, (kernel, "forward", samples[0], attrs), {}, 1, samples[0]["O"])
    assert outcome.status == status and message in outcome.message


def _disk_full(h5py_style):
    if h5py_style:  # the profiler's growing context.h5, written with h5py: no filename, two lines
        raise OSError(errno.ENOSPC, "Can't synchronously write data (file write failed: time = Wed Dec  2 07:41:40"
                      " 2026\n, filename = 'run/final.h5', file descriptor = 5, errno = 28, ...)")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "run/final.h5")


@pytest.mark.parametrize("h5py_style", [False, True])
def test_a_full_disk_fails_the_job_instead_of_becoming_the_kernels_crash(h5py_style):
    """Candidate training writes in the isolated child: a full disk there was recorded as the kernel's crash."""
    for run in (lambda: kernels.run_isolated(_disk_full, h5py_style),
                lambda: kernels._run_inline(_disk_full, (h5py_style,), {}, 1, None)):
        with pytest.raises(PeatError, match=r"^\[Errno 28\] No space left on device: 'run/final\.h5'$"):
            run()


def test_run_isolated_rejects_results_it_cannot_read_back_safely():
    outcome = kernels.run_isolated(lambda: object())
    assert outcome.status == "crash" and "could not be read back" in outcome.message


@pytest.mark.parametrize("given, expected", [(None, ["1", "True"]), ("0", ["0", "False"])])
def test_importing_peat_makes_torch_ask_nvml_for_cuda_so_forked_children_can_use_it(given, expected):
    # On a GPU machine torch.cuda.is_available() in a job (its vendor check, transformers on import)
    # made every candidate training's forked child fail: "CUDA error: initialization error" (H200).
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    if given is not None:
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = given  # the user's own choice is kept
    code = ("import os, peat, torch.cuda; "
            "print(os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'], torch.cuda._nvml_based_avail())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == expected


def _visible_devices():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_memory_limited_call_sees_no_gpu(monkeypatch):
    # Under the limit CUDA cannot start: on a GPU machine torch.compile's device query failed with
    # "out of memory" and peat.alt_kernels.compiled ran the eager op instead.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert kernels.run_isolated(_visible_devices, memory_mb=256).value == ""
    assert kernels.run_isolated(_visible_devices).value == "0"  # no limit: the job's own devices
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the job itself keeps them


def _one():
    return 1


def _entered(seconds):
    with kernels.deadline(seconds):
        return _one()


@pytest.mark.parametrize("seconds", [1e12, float("inf"), 0, -1, True, "60"])
@pytest.mark.parametrize("entry, what", [
    (lambda s: kernels.run_isolated(_one, timeout=s), "kernels.run_isolated: timeout"),
    (lambda s: kernels.run_isolated_many([kernels.Call(_one)], timeout=s), "kernels.run_isolated_many: timeout"),
    (_entered, "kernels.deadline: seconds"),
])
def test_a_time_limit_no_timer_takes_is_one_line_naming_the_entry_point(entry, what, seconds):
    # Called from Python, deadline(1e12) overflowed the interval timer (an OverflowError traceback), and
    # run_isolated(timeout=math.inf) ran the call under an alarm or wait that could not be set; the
    # config schema and playback.Plan bound timeouts to a year, and so do these, in Plan's words.
    with pytest.raises(PeatError) as err:
        entry(seconds)
    assert str(err.value) == (f"{what}={seconds!r}: seconds per kernel call need a number > 0 and <= 31536000 "
                              "(a year)")


def test_a_year_is_a_time_limit_these_take():
    assert _entered(kernels.MAX_TIMEOUT) == 1 and _entered(None) == 1
    assert kernels.run_isolated(_one, timeout=kernels.MAX_TIMEOUT).value == 1


def _exit_3():
    os._exit(3)


def test_a_call_that_kills_its_child_under_a_long_time_limit_is_its_outcome():
    # Its exit code was awaited as long as the timeout in one poll of int milliseconds: above 24.8 days
    # (the workflow allows a year) a kernel crashing its isolated call ended the job in an OverflowError.
    outcome = kernels.run_isolated(_exit_3, timeout=kernels.MAX_TIMEOUT)
    assert (outcome.status, outcome.message) == ("crash", "exited with code 3 without a result")
