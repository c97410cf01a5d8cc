"""GEMM with fp16 operands and fp32 accumulation (tensor-core style)."""

from ._gemm import as_linear, rounded

linear = as_linear(rounded("fp16"))
