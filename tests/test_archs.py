"""Every built-in architecture, as the workflow builds it (peat.models), through peat's own machinery.

The workflow's tests train resnet18 and gpt2 only; the other architectures bring what those two lack:
depthwise and grouped convolutions (mobilenet_v2, efficientnet_b0), squeeze-and-excitation 1 x 1
convolutions on 1 x 1 maps and stochastic depth (efficientnet_b0), strided 1 x 1 downsampling and
bottlenecks (resnet50), gate/up projections fed one input (llama), a decoder tied to the word
embeddings and a layer norm over embeddings (bert).
"""

from __future__ import annotations

import copy

import pytest
import torch

from peat import kernels, models
from peat.profiler import op_of

IMAGE = {"num_classes": 10}
TEXT = {"vocab_size": 256, "seq_len": 16}
ARCHS = [*models.IMAGE_ARCHS, "gpt2", "llama", "bert"]


def _model_and_batch(arch: str):
    if arch in models.IMAGE_ARCHS:
        model = models.build({"arch": arch}, IMAGE, seed=0)
        gen = torch.Generator().manual_seed(1)
        return model, "image", torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    model = models.build({"arch": arch, "size": {"hidden": 16, "layers": 1, "heads": 2}}, TEXT, seed=0)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    return model, "text", tokens[:, :-1], tokens[:, 1:]


def _step(model, kind, x, y):
    """One seeded training step's loss, parameter gradients and buffers (batch-norm running statistics)."""
    model.train()
    torch.manual_seed(2)  # the same dropout masks and stochastic-depth draws in both runs
    loss, _ = models.loss_and_metrics(model, kind, x, y)
    loss.backward()
    return (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            {n: b.clone() for n, b in model.named_buffers()})


@pytest.mark.parametrize("arch", ARCHS)
def test_golden_kernel_routed_trains_bit_identically(arch):
    """Candidate training's routing with the golden kernel on every recordable layer of every op is
    PyTorch's own step, bit for bit: measured whole (2 epochs, final.h5 compared tensor by tensor) on
    all eight architectures; this checks one step of each, forward, gradients and running statistics."""
    torch.set_num_threads(1)
    model, kind, x, y = _model_and_batch(arch)
    routed = copy.deepcopy(model)
    ops = {op_of(m) for m in routed.modules()} - {None}
    names = [name for op in sorted(ops) for name in kernels.route(routed, kernels.golden(op))]
    assert len(names) == sum(op_of(m) is not None for m in model.modules())
    loss, grads, buffers = _step(model, kind, x, y)
    loss_r, grads_r, buffers_r = _step(routed, kind, x, y)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys()
    assert [n for n in grads if not torch.equal(grads[n], grads_r[n])] == []
    assert [n for n in buffers if not torch.equal(buffers[n], buffers_r[n])] == []
