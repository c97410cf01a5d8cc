"""The golden ops compiled by ``torch.compile`` (Inductor generates and fuses its own kernels).

Compilation happens per op, computation and input shape on first use (seconds on a CPU; cached
by Inductor afterwards). Where it cannot work (no C++ compiler, unsupported platform) or
``PEAT_NO_COMPILE=1`` is set, the eager golden op runs instead and ``FALLBACK`` says why, once,
on stderr: the kernel then equals golden, which a comparison shows plainly (but for a transposed
linear layer's weight gradient, which the eager op computes in ``nn.Linear``'s orientation: the
last bits may then differ where the BLAS rounds the two products differently).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

from ..kernels import COMPUTATIONS, GOLDEN, OPS

FALLBACK: dict[str, str] = {}  # "reason" once compilation failed
_cache: dict[tuple[str, str], object] = {}


def _configure() -> None:
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._inductor.config.compile_threads = 1  # the machine is shared; one process compiles


def _compiled(op: str, computation: str):
    golden = GOLDEN[op][computation]

    def run(*args, **kwargs):
        if FALLBACK or os.environ.get("PEAT_NO_COMPILE") == "1":
            return golden(*args, **kwargs)
        if (op, computation) not in _cache:
            _configure()
            _cache[op, computation] = torch.compile(golden, dynamic=False)
        try:
            return _cache[op, computation](*args, **kwargs)
        except Exception as err:  # compilation unavailable: golden must still work (else it re-raises)
            FALLBACK["reason"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            print(f"peat.alt_kernels.compiled: torch.compile unavailable ({FALLBACK['reason']}); "
                  "running the eager golden op", file=sys.stderr)
            return golden(*args, **kwargs)

    return run


for _op in OPS:
    globals()[_op] = SimpleNamespace(**{c: _compiled(_op, c) for c in COMPUTATIONS})
