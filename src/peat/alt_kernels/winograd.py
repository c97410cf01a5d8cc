"""Winograd F(2x2, 3x3) convolution (Lavin & Gray): 16 multiplies per 2x2 output tile instead of 36.

Applies to 3x3 kernels with stride 1, dilation 1 and groups 1, for the forward pass and the
input gradient (a 3x3 stride-1 convolution of the output gradient with the flipped, transposed
weights, padding 2 - p, so p <= 2). Everything else, and the weight gradient, falls back to
PyTorch's golden convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import GOLDEN

OP = "conv2d"

BT = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=torch.float64)
G = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=torch.float64)
AT = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=torch.float64)


def applies(weight, stride, padding, dilation, groups) -> bool:
    return (tuple(weight.shape[2:]) == (3, 3) and tuple(stride) == (1, 1) and tuple(dilation) == (1, 1)
            and groups == 1 and max(padding) <= 2)


def winograd_conv(x, weight, padding):
    """3x3 stride-1 correlation of ``x`` with ``weight`` (zero padding ``padding``) by F(2x2,3x3)."""
    bt, g, at = (m.to(dtype=x.dtype, device=x.device) for m in (BT, G, AT))
    x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    out_h, out_w = x.shape[2] - 2, x.shape[3] - 2
    tiles_h, tiles_w = -(-out_h // 2), -(-out_w // 2)
    x = F.pad(x, (0, 2 * tiles_w + 2 - x.shape[3], 0, 2 * tiles_h + 2 - x.shape[2]))
    d = x.unfold(2, 4, 2).unfold(3, 4, 2)                            # (n, c, th, tw, 4, 4)
    v = torch.einsum("ij,nctwjk,lk->nctwil", bt, d, bt)             # B^T d B
    u = torch.einsum("ij,ocjk,lk->ocil", g, weight, g)              # G w G^T
    m = torch.einsum("ocil,nctwil->notwil", u, v)                   # sum over input channels
    y = torch.einsum("ij,notwjk,lk->notwil", at, m, at)             # A^T m A: (n, o, th, tw, 2, 2)
    y = y.permute(0, 1, 2, 4, 3, 5).reshape(y.shape[0], y.shape[1], 2 * tiles_h, 2 * tiles_w)
    return y[:, :, :out_h, :out_w].contiguous()


def forward(x, weight, bias, *, stride, padding, dilation, groups):
    if not applies(weight, stride, padding, dilation, groups):
        return GOLDEN["conv2d"]["forward"](x, weight, bias, stride=stride, padding=padding, dilation=dilation,
                                           groups=groups)
    out = winograd_conv(x, weight, padding)
    return out + bias.view(1, -1, 1, 1) if bias is not None else out


def input_grad(grad_out, weight, *, input_shape, stride, padding, dilation, groups):
    if not applies(weight, stride, padding, dilation, groups):
        return GOLDEN["conv2d"]["input_grad"](grad_out, weight, input_shape=input_shape, stride=stride,
                                              padding=padding, dilation=dilation, groups=groups)
    flipped = weight.flip(2, 3).transpose(0, 1)
    return winograd_conv(grad_out, flipped, [2 - p for p in padding])
