"""im2col convolution: unfold the input into columns and run one GEMM per group (and per image).

The input gradient is the transposed GEMM folded back (col2im); the weight gradient a GEMM of
the output gradient with the columns, summed over the batch in order. Any stride, padding,
dilation and groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import output_shape

OP = "conv2d"


def _columns(x, kernel_size, stride, padding, dilation, groups):
    cols = F.unfold(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
    return cols.view(x.shape[0], groups, -1, cols.shape[-1])  # (n, g, c/g*kh*kw, L)


def forward(x, weight, bias, *, stride, padding, dilation, groups):
    oc, kernel = weight.shape[0], tuple(weight.shape[2:])
    cols = _columns(x, kernel, stride, padding, dilation, groups)
    out = weight.reshape(1, groups, oc // groups, -1) @ cols  # (n, g, oc/g, L)
    hp = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    out = out.reshape(output_shape("conv2d", x, weight, hp))
    return out + bias.view(1, -1, 1, 1) if bias is not None else out


def input_grad(grad_out, weight, *, input_shape, stride, padding, dilation, groups):
    n, oc = grad_out.shape[:2]
    kernel = tuple(weight.shape[2:])
    dout = grad_out.reshape(n, groups, oc // groups, -1)
    dcols = weight.reshape(groups, oc // groups, -1).transpose(1, 2) @ dout  # (n, g, c/g*kh*kw, L)
    return F.fold(dcols.reshape(n, -1, dcols.shape[-1]), tuple(input_shape[2:]), kernel,
                  dilation=dilation, padding=padding, stride=stride)


def weight_grad(grad_out, x, *, weight_shape, stride, padding, dilation, groups):
    n, oc = grad_out.shape[:2]
    cols = _columns(x, tuple(weight_shape[2:]), stride, padding, dilation, groups)
    dout = grad_out.reshape(n, groups, oc // groups, -1)
    acc = torch.zeros(groups, oc // groups, cols.shape[2], dtype=x.dtype, device=x.device)
    for i in range(n):  # one image at a time, as a batched im2col kernel accumulates
        acc += dout[i] @ cols[i].transpose(1, 2)
    return acc.reshape(weight_shape)
