"""Peak host memory of scoring one output tensor as playback does, in multiples of its size.

A golden float32 NCHW tensor (random values), its float64 reference (a rounding-sized distance
away), its fp16/bf16/tf32-rounded copies and a candidate with one wrong element in 1,000 are
made first; then they are scored as a playback job scores one output (``peat.playback._Scored``:
the envelopes and the references' rows, then the candidate's row). The peak resident memory of
the scoring alone is read from Linux's VmHWM, reset just before it (``/proc/self/clear_refs``).

    python benchmarks/scoring_memory.py [--shape 32 64 112 112] [--out FILE.json]
"""

import argparse
import json
import time
from pathlib import Path

import torch

import harness
from peat import detect, evidence, playback
from peat.io import PeatError, write_json


def resident_mb(field: str = "VmHWM") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def tensors(shape: tuple[int, ...], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    golden = torch.randn(shape, generator=g)
    tf32 = (golden.view(torch.int32) & ~0x1FFF).view(torch.float32)  # 10 mantissa bits kept
    candidate = golden.clone()
    candidate.view(-1)[::1000] += 1.0
    return {"golden": golden, "fp64": golden.double() + torch.randn(shape, generator=g, dtype=torch.float64) * 1e-8,
            "fp16": golden.half().float(), "bf16": golden.bfloat16().float(), "tf32": tf32, "candidate": candidate}


def measure(shape: tuple[int, ...]) -> dict:
    t = tensors(shape)
    plan = playback.Plan(context=Path("-"), kernel=None, rules=detect.Rules())
    size_mb = t["golden"].numel() * 4 / 2**20
    with open("/proc/self/clear_refs", "w") as f:  # peak := current, so the peak below is the scoring's
        f.write("5")
    before, start = resident_mb("VmRSS"), time.perf_counter()
    scored = playback._Scored(plan, {}, {k: t[k] for k in ("golden", "fp64", *evidence.PRECISIONS)})
    scored.add("candidate", t["candidate"])
    seconds, peak = time.perf_counter() - start, resident_mb()
    # 4 significant digits, not 0.1 MB: a 0.25 MB tensor read 0.2 beside a ratio of the true size
    return {"shape": list(shape), "tensor_mb": _digits(size_mb), "peak_above_inputs_mb": _digits(peak - before),
            "peak_over_tensor": _digits((peak - before) / size_mb), "seconds": round(seconds, 2),
            "rows": len(scored.rows)}


def _digits(value: float) -> float:
    return float(f"{value:.4g}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[32, 64, 112, 112])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if min(args.shape) < 1:
        parser.error(f"--shape {' '.join(map(str, args.shape))}: every dimension must be at least 1")
    if args.out:
        check_out_file(parser, args.out)
    result = measure(tuple(args.shape))
    print(json.dumps(result))
    if args.out:
        write_json(args.out, result)  # its folder made where missing
    return result


def check_out_file(parser: argparse.ArgumentParser, out: Path) -> None:
    """A folder, or a file where a folder above it should be, is refused before the measurement
    (at the default shape over a GB of memory), not as a traceback after it."""
    if out.is_dir():
        parser.error(f"--out: {out}: a folder, not a file")
    try:
        harness.check_out_folder(out.parent)
    except PeatError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
