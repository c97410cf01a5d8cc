"""RMSNorm as a fused kernel may compute it: the mean square accumulated in float64 and rounded
once, the weight folded into the scale, and the textbook gradients.

``forward``: ``y = x * (weight * rstd)``, ``rstd = 1 / sqrt(mean(x^2) + eps)``, where golden (PyTorch,
LlamaRMSNorm) rounds ``x * rstd`` first and multiplies by the weight after: correct, and a few
float32 ulps from golden. ``input_grad``: ``dx = rstd * (g - xhat * mean(g * xhat))`` with
``g = weight * grad_out`` (autograd goes through the ops one by one). ``weight_grad``: the sum of
``grad_out * xhat`` over the rows. ``bias`` is always None (RMSNorm has none, see ``peat.kernels``).
"""

from __future__ import annotations

import torch

OP = "rms_norm"


def _dims(x, normalized_shape) -> list[int]:
    return list(range(x.dim() - len(normalized_shape), x.dim()))


def _rstd(x, normalized_shape, eps):
    """1 / sqrt(mean(x^2) + eps) over the normalized dimensions, in float64 rounded to x's dtype."""
    wide = x.double()
    return torch.rsqrt(wide.square().mean(_dims(x, normalized_shape), keepdim=True) + eps).to(x.dtype)


def forward(x, weight, bias=None, *, normalized_shape, eps):
    rstd = _rstd(x, normalized_shape, eps)
    return x * (rstd * weight) if weight is not None else x * rstd


def input_grad(grad_out, x, weight, *, normalized_shape, eps):
    rstd = _rstd(x, normalized_shape, eps)
    xhat = x * rstd
    g = grad_out * weight if weight is not None else grad_out
    return rstd * (g - xhat * (g * xhat).mean(_dims(x, normalized_shape), keepdim=True))


def weight_grad(grad_out, x, *, normalized_shape, eps):
    xhat = x * _rstd(x, normalized_shape, eps)
    return (grad_out * xhat).reshape(-1, *normalized_shape).sum(0)
