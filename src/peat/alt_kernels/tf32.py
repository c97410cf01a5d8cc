"""TF32 emulation: operands rounded to 10 mantissa bits (as Ampere+ tensor cores read them), fp32 accumulation."""

from types import SimpleNamespace

from ..errors import round_to
from ..kernels import GOLDEN
from ._gemm import as_linear, rounded

linear = as_linear(rounded("tf32"))


def _tf32_operands(func):
    def run(a, b, *rest, **kwargs):
        return func(round_to(a, "tf32"), round_to(b, "tf32"), *rest, **kwargs)

    return run


conv2d = SimpleNamespace(**{c: _tf32_operands(GOLDEN["conv2d"][c]) for c in ("forward", "input_grad", "weight_grad")})
