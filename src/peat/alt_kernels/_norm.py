"""Batch and layer normalisation written once around a pluggable statistics routine.

``stats(rows)`` gets a 2-D tensor whose rows are the groups normalised together (a channel for
batch norm, a token for layer norm) and returns their mean and biased variance. Gradients use
the same statistics, with the textbook formulas
``dx = invstd/N * (N*g - sum(g) - xhat*sum(g*xhat))``, ``g = weight * grad_out``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _bn_rows(x):
    """(C, N*H*W) rows, sample-major within a row, so a row can be reduced per image too."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _bn_view(t, x):
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _ln_rows(x, normalized_shape):
    return x.reshape(-1, int(torch.Size(normalized_shape).numel()))


def _ln_view(t, x, normalized_shape):
    return t.view(*x.shape[:x.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))


def _dx(g, xhat, invstd, dims):
    n = 1
    for d in dims:
        n *= g.shape[d]
    return invstd / n * (n * g - g.sum(dims, keepdim=True) - xhat * (g * xhat).sum(dims, keepdim=True))


def make(stats, chunk_of) -> tuple[SimpleNamespace, SimpleNamespace]:
    """batch_norm and layer_norm namespaces; ``chunk_of(x, op)`` tells ``stats`` its reduction chunk."""

    def bn_stats(x, running_mean, running_var, training, eps):
        if training or running_mean is None:
            mean, var = stats(_bn_rows(x), chunk_of(x, "batch_norm"))
        else:
            mean, var = running_mean, running_var
        return _bn_view(mean, x), _bn_view(torch.rsqrt(var + eps), x), mean, var

    def bn_forward(x, weight, bias, *, running_mean, running_var, training, momentum, eps):
        mean, invstd, m, v = bn_stats(x, running_mean, running_var, training, eps)
        if training and running_mean is not None:
            n = x.numel() // x.shape[1]
            running_mean.mul_(1 - momentum).add_(momentum * m)
            running_var.mul_(1 - momentum).add_(momentum * v * n / max(n - 1, 1))
        y = (x - mean) * invstd
        return y * _bn_view(weight, x) + _bn_view(bias, x) if weight is not None else y

    def bn_input_grad(grad_out, x, weight, *, running_mean, running_var, training, eps):
        mean, invstd, _, _ = bn_stats(x, running_mean, running_var, training, eps)
        g = grad_out * _bn_view(weight, x) if weight is not None else grad_out
        if not (training or running_mean is None):
            return g * invstd
        dims = [d for d in range(x.dim()) if d != 1]
        return _dx(g, (x - mean) * invstd, invstd, dims)

    def bn_weight_grad(grad_out, x, *, running_mean, running_var, training, eps):
        mean, invstd, _, _ = bn_stats(x, running_mean, running_var, training, eps)
        return (grad_out * (x - mean) * invstd).sum([d for d in range(x.dim()) if d != 1])

    def ln_stats(x, normalized_shape, eps):
        mean, var = stats(_ln_rows(x, normalized_shape), chunk_of(x, "layer_norm"))
        return _ln_view(mean, x, normalized_shape), _ln_view(torch.rsqrt(var + eps), x, normalized_shape)

    def ln_forward(x, weight, bias, *, normalized_shape, eps):
        mean, invstd = ln_stats(x, normalized_shape, eps)
        y = (x - mean) * invstd
        y = y * weight if weight is not None else y
        return y + bias if bias is not None else y  # LayerNorm(bias=False) has a weight alone

    def ln_input_grad(grad_out, x, weight, *, normalized_shape, eps):
        mean, invstd = ln_stats(x, normalized_shape, eps)
        g = grad_out * weight if weight is not None else grad_out
        dims = list(range(x.dim() - len(normalized_shape), x.dim()))
        return _dx(g, (x - mean) * invstd, invstd, dims)

    def ln_weight_grad(grad_out, x, *, normalized_shape, eps):
        mean, invstd = ln_stats(x, normalized_shape, eps)
        keep = len(normalized_shape)
        return (grad_out * (x - mean) * invstd).reshape(-1, *grad_out.shape[grad_out.dim() - keep:]).sum(0)

    return (SimpleNamespace(forward=bn_forward, input_grad=bn_input_grad, weight_grad=bn_weight_grad),
            SimpleNamespace(forward=ln_forward, input_grad=ln_input_grad, weight_grad=ln_weight_grad))
