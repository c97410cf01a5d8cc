"""K-blocked GEMM: 32-wide K blocks accumulated in order."""

from ._gemm import as_linear, blocked

linear = as_linear(blocked())
