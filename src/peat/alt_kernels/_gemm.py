"""The linear op's three computations written once in terms of one GEMM ``gemm(a, b) = a @ b``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..errors import round_to


def as_linear(gemm) -> SimpleNamespace:
    """forward / input_grad / weight_grad of a linear layer that all run on ``gemm``."""

    def forward(x, weight, bias):
        out = gemm(x.reshape(-1, x.shape[-1]), weight.t())
        out = out + bias if bias is not None else out
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def input_grad(grad_out, weight):
        return gemm(grad_out.reshape(-1, grad_out.shape[-1]), weight).reshape(*grad_out.shape[:-1], weight.shape[1])

    def weight_grad(grad_out, x):
        return gemm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]))

    return SimpleNamespace(forward=forward, input_grad=input_grad, weight_grad=weight_grad)


def k_chunks(k: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, k)) for i in range(0, k, size)]


def blocked(block: int = 32):
    """Accumulate the K dimension block by block, in order (a register-tiled GEMM's order)."""

    def gemm(a, b):
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        for s in k_chunks(a.shape[1], block):
            acc += a[:, s] @ b[s]
        return acc

    return gemm


def split_k(splits: int = 4):
    """Split K into ``splits`` slices, each its own GEMM, summed at the end (split-K reduction)."""

    def gemm(a, b):
        size = -(-a.shape[1] // splits)
        partials = [a[:, s] @ b[s] for s in k_chunks(a.shape[1], size)]
        return torch.stack(partials).sum(0)

    return gemm


def rounded(precision: str):
    """Operands rounded to ``precision``; products and accumulation in fp32, as tensor cores do."""

    def gemm(a, b):
        return round_to(a, precision) @ round_to(b, precision)

    return gemm
