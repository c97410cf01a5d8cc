"""Example user kernel for the linear op (see docs/kernels.md).

A GEMM that accumulates each 64-wide K block in float64 and rounds the running sum to float32
after every block, as a kernel with a wide accumulator register and a narrow output buffer
would. It serves nn.Linear layers and GPT-2 Conv1D layers alike (weights arrive in nn.Linear
convention). Any of the three functions may be left out: the golden op is used instead.
"""

import torch

OP = "linear"  # the op this kernel serves (checked when the config names another)
BLOCK = 64


def _gemm(a, b):
    # On the operands' device: a GPU vendor's run hands the kernel CUDA tensors.
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for start in range(0, a.shape[1], BLOCK):
        block = a[:, start:start + BLOCK].double() @ b[start:start + BLOCK].double()
        acc = (acc.double() + block).float()
    return acc


def forward(x, weight, bias):
    out = _gemm(x.reshape(-1, x.shape[-1]), weight.t()).reshape(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


def input_grad(grad_out, weight):
    return _gemm(grad_out.reshape(-1, grad_out.shape[-1]), weight).reshape(*grad_out.shape[:-1], weight.shape[1])


def weight_grad(grad_out, x):
    return _gemm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
