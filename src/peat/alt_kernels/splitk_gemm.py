"""Split-K GEMM: K cut into 4 slices, each a GEMM, partial sums added at the end."""

from ._gemm import as_linear, split_k

linear = as_linear(split_k())
