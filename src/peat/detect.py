"""PEAT's Detector: is a kernel correct-but-different, or buggy, and what kind of bug is it?

The tensor features the rules read (envelopes, the sets S and G and their shapes) are
computed by ``peat.evidence``; this module holds the rules, the kernel verdict and the
baselines, and needs no torch (the detect and analyze jobs stay light).

Every rule compares a candidate result with golden float32 *on the same recorded inputs*,
against envelopes measured on those inputs, never against a fixed absolute tolerance
(upper-case names are the fields of ``Rules`` below, config ``detect.<name in lower case>``):

- fp32 envelope ``tau32 = K32 * max|golden - fp64|`` (floored at one float32 ULP of the
  tensor's largest value): what reordering a float32 sum can do to this tensor.
- reduced-precision envelope ``taurp = KRP * max_p max|golden_p - fp64|`` over p in fp16,
  bf16, tf32, where ``golden_p`` is the golden op on operands rounded to p; measured per
  aligned TILE x TILE tile of the matrix view (the max over the tile's elements, floored at
  ``tau32``), since rounding errors follow the magnitudes around them.

``S`` is the set of elements beyond ``tau32``, ``G`` those beyond the reduced-precision
envelope of their tile. The footprint of precision p is where rounding to p moves the result
beyond ``tau32`` on these inputs: ``|golden_p - golden|`` beyond ``tau32 / BAND`` where it may,
beyond ``tau32 * BAND`` where it must (in between, a kernel rounding to p in another order
falls on either side of ``tau32``). The classes are
documented sufficient conditions on these sets, in the matrix view of ``peat.errors.matrix``;
the first that holds wins (the priority order of ``CLASSES``):

non_finite         candidate NaN/Inf where golden is finite.
block_structured   >= COVER of S lies in at most MAX_TILES connected tiles (both sides >= 2,
                   >= 4 elements, bounding box filled >= FILL; in a vector a run of >= 4)
                   covering <= BLOCK_AREA of the tensor; or G is too large to be sparse and
                   in no block or lane (one tile: the whole output).
periodic_lane      >= COVER of S lies in the columns (or rows) of one lane or a whole progression
                   of stride >= 2, >= COVER of them holding S; the progression runs through its
                   lanes filled >= FILL (of their length where S is sparse, else of the fullest
                   lane: a lane stuck at a value golden often holds is wrong only where golden
                   differs; a lane alone, of its length), at their spacing or a stride dividing it;
                   a lane without S where golden spans no more than tau32 (a dead channel; an
                   input gradient's row of a sample the network gets right), which a stuck lane
                   cannot move beyond it, counts neither way; so does, in a vector, the first lane
                   of a progression whose others hold S, >= 4 of them or all at golden's first
                   value, nonzero (a lane stuck at its first element).
bit_flip           S is sparse (<= max(SPARSE_MIN, SPARSE x size) elements, < half) and >= COVER
                   of it differs from golden in 1 or 2 bits above the bits fp32 noise may touch
                   (where they stop below golden's exponent), or comes back within that noise,
                   with golden's sign and binade, when one of its bits flips (a kernel's own
                   summation order is a few ULPs off golden, and their carry runs up the bits).
random_zero        S is sparse and >= COVER of it is exactly 0 where golden is not.
random_value       S is sparse (any other few scattered wrong values).
reduced_precision  S is unstructured or a precision's footprint, and G is empty: every error
                   is within the fp16/bf16/tf32 rounding envelope measured in its tile.
none               S is empty: within float32 reordering noise.

When S matches the footprint of a precision (>= COVER of S lies where it may, S holds >=
COVER of where it must), S has the
layout rounding to that precision gives these inputs, so its shape is no evidence of a fault:
rounding to bf16 leaves the fp32 envelope only where the values are large (one block of a
weight gradient, outlier channels), a tile or lane rule would fire on a correct kernel. The
shape rules then apply to G, as they do when S is dense and unstructured (bit_flip then
counts the bits above those the tile's reduced-precision envelope reaches). A fault that
errs in a block or lane of such a footprint still differs from it: it leaves the rest of
the footprint exact.

Nor are a few scattered elements of S (bit_flip, random_value) evidence when S is only the
tail of a spread (``s_tail``): the candidate moves 1 / (1 - COVER) times as many elements
beyond golden's own worst rounding (tau32 / K32) as beyond tau32. A fault leaves the rest
of the result at the kernel's usual few ULPs; an algorithm that rounds worse than golden
everywhere (Winograd F(4x4, 3x3)) crosses tau32 in a few elements of a broad spread. G is
then judged alone, as for a footprint.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .io import PeatError, json_safe, read_json, read_parquet_scalars, write_json

CLASSES = ("non_finite", "block_structured", "periodic_lane", "bit_flip", "random_zero", "random_value",
           "reduced_precision", "none")
BUGS = CLASSES[:6]


@dataclass(frozen=True)
class Rules:
    """Calibration of the rules (multiples of measured envelopes and shape fractions)."""

    k32: float = 8.0            # fp32 envelope: multiple of the measured max fp32-vs-fp64 error
    krp: float = 4.0            # reduced-precision envelope: multiple of the worst fp16/bf16/tf32 error
    sparse: float = 0.01        # "a few elements": at most this fraction of the tensor ...
    sparse_min: int = 16        # ... or this many (and less than half of it), whichever is more
    fill: float = 0.5           # a tile / lane counts when this fraction of it is wrong
    cover: float = 0.9          # a shape explains S when it holds this fraction of S
    block_area: float = 0.5     # tiles covering more than this of the tensor are not "confined"
    max_tiles: int = 8          # more tiles than this is a dense random pattern, not a tile fault
    tile: int = 16              # edge of the tiles the reduced-precision envelope is measured in
    band: float = 2.0           # a rounding error within this factor of tau32 may fall either side of it
    accept_reduced_precision: bool = True

    def __post_init__(self):
        # The config schema's bounds, for Rules made in code: tile=0 or k32=0 ended a replay in a
        # ZeroDivisionError, cover=0.3 let a shape explain S with a third of it, and
        # accept_reduced_precision="no" (a true string) failed in pandas.
        for name, (least, above, most, integer) in _BOUNDS.items():
            value = getattr(self, name)
            kind = numbers.Integral if integer else numbers.Real
            if (isinstance(value, bool) or not isinstance(value, kind) or not (value > least if above else value >= least)
                    or (most is not None and value > most)):
                bound = f"{'>' if above else '>='} {least}" + (f" and <= {most}" if most is not None else "")
                raise PeatError(f"detect.{name}={value!r}: {'an integer' if integer else 'a number'} {bound} expected")
        if not isinstance(self.accept_reduced_precision, (bool, np.bool_)):
            raise PeatError(f"detect.accept_reduced_precision={self.accept_reduced_precision!r}: true or false expected")


# Each numeric setting's bounds, as the config schema has them: (least, exclusive, most, integer).
_BOUNDS = {"k32": (1, True, None, False), "krp": (0, True, None, False), "sparse": (0, True, 1, False),
           "sparse_min": (1, False, None, True), "fill": (0, True, 1, False), "cover": (0.5, True, 1, False),
           "block_area": (0, True, 1, False), "max_tiles": (1, False, None, True), "tile": (1, False, None, True),
           "band": (1, False, None, False)}


# -- rules ---------------------------------------------------------------------------------------
def shape_class(f: dict, prefix: str, rules: Rules) -> tuple[str, float] | None:
    if (f[f"{prefix}block_cover"] >= rules.cover and 0 < f[f"{prefix}block_area"] <= rules.block_area
            and f[f"{prefix}block_tiles"] <= rules.max_tiles):
        return "block_structured", f[f"{prefix}block_cover"]
    if f[f"{prefix}lane_cover"] >= rules.cover:
        return "periodic_lane", f[f"{prefix}lane_cover"]
    if f[f"{prefix}sparse"]:
        if f[f"{prefix}bit_frac"] >= rules.cover:
            return "bit_flip", f[f"{prefix}bit_frac"]
        if f[f"{prefix}zero_frac"] >= rules.cover:
            return "random_zero", f[f"{prefix}zero_frac"]
        return "random_value", 1.0 - max(f[f"{prefix}bit_frac"], f[f"{prefix}zero_frac"])
    return None


# Classes of a few scattered values that say nothing once S is only the tail of a spread (``s_tail``).
SCATTERED = ("bit_flip", "random_value")


def s_class(f: dict, rules: Rules = Rules()) -> tuple[str, float] | None:
    """The class S's layout gives, or None where it is no evidence of a fault: S matches a
    precision's footprint, or is a few scattered values that are only the tail of an error spread
    the candidate has everywhere (``s_tail``: a correct algorithm that rounds worse than golden,
    such as Winograd F(4x4, 3x3), crosses the fp32 envelope in a few elements, 1-2 bits beyond it,
    which read as bit flips). Zeros, blocks and lanes stay evidence."""
    if rounding_footprint(f):
        return None
    found = shape_class(f, "s_", rules)
    if found and found[0] in SCATTERED and _flag(f.get("s_tail")):
        return None
    return found


def _flag(value) -> bool:
    """A boolean feature of a dict or a table row (NaN or None in a row of a table without it)."""
    return isinstance(value, (bool, np.bool_)) and bool(value)


def classify(f: dict, rules: Rules = Rules()) -> tuple[str, float]:
    """(class, confidence in 0..1) of one tensor's evidence ``f`` (a dict or a table row)."""
    if f["nonfinite"] > 0:
        return "non_finite", 1.0
    if f["n32"] == 0:
        return "none", float(np.clip(1.0 - f["err_over_tau32"], 0.0, 1.0))
    found = s_class(f, rules)
    if found:
        return found
    if f["ngross"] == 0:
        return "reduced_precision", float(np.clip(1.0 - f["err_over_taurp"], 0.0, 1.0))
    return shape_class(f, "g_", rules) or ("block_structured", float(f["g_n"] / f["numel"]))


def rounding_footprint(f: dict) -> str:
    """The reference precision whose footprint S matches ("" if none, or not measured)."""
    found = f.get("s_rounding")
    return found if isinstance(found, str) else ""


def passes(error_model: str, rules: Rules = Rules()) -> bool:
    return error_model == "none" or (error_model == "reduced_precision" and rules.accept_reduced_precision)


def worst(classes) -> str:
    """The first class in priority order among ``classes`` ("none" if empty)."""
    present = set(classes)
    return next((c for c in CLASSES if c in present), "none")


# -- baselines -------------------------------------------------------------------------------------
def peat_rule_of_thumb(table: pd.DataFrame) -> dict:
    """PEAT's published rules of thumb on one kernel's FIP=FOP rows (per layer, computation and tensor).

    Conv/linear: a correct kernel's top-10 % error (relative to fp64 noise, log10) varies by
    less than 1 decade across iterations; RV/RZ-like bugs swing more. BN/LN: zero-like bugs
    keep a high floor of error variance: log10 of the variance relative to fp64 noise above
    10 at every iteration. Any non-finite value also fails.
    """
    failed = []
    if "numel" in table:  # an output without elements has NaN scores and nothing wrong: no iteration to judge
        table = table[table["numel"] != 0]
    # Per result tensor: a batch norm forward's running statistics are judged apart from its output.
    for (layer, comp, op, tensor), rows in table.groupby(["layer", "computation", "op", "tensor"], sort=True):
        top = np.log10(np.maximum(rows["rel_top10"].to_numpy(float), 1.0))
        var = np.log10(np.maximum(rows["rel_var"].to_numpy(float), 1.0))
        finite = top[np.isfinite(top)]
        swing = float(finite.max() - finite.min()) if len(finite) else 0.0
        # Not np.nanmin: an all-NaN result (no finite error) has no floor, and its warning went to every such job's log.
        scored = var[~np.isnan(var)]
        floor = float(scored.min()) if len(scored) else float("nan")
        bad = (rows["nonfinite"] > 0).any() or not np.isfinite(top).all()
        bad = bad or (swing > 1.0 if op in ("linear", "conv2d") else floor > 10.0)
        if bad:
            failed.append({"layer": layer, "pass": comp, "tensor": tensor, "log10_top10_swing": swing,
                           "log10_var_floor": floor})
    return {"verdict": "fail" if failed else "pass", "failed": failed}


# -- kernel verdict ------------------------------------------------------------------------------
def after_probe(table: pd.DataFrame, outcome: dict) -> tuple[dict, pd.DataFrame]:
    """The kernel's outcome given the rows of its calls that failed after the probe (a row with an
    ``error``: a crash, a timeout, a result of another shape or dtype), and the table without them."""
    if "error" not in table or not table["error"].notna().any():
        return outcome, table
    # A pseudo-error model that cannot act on this op (tile:T:splitk on a norm) says
    # nothing about the kernel; any other failure, in whichever case it came, is its own.
    own = table[table["error"].notna() & (table["status"] != "not_applicable")]
    if len(own) and outcome.get("status", "ok") == "ok":  # a failed probe's outcome stays the kernel's
        bad = own.iloc[0]
        outcome = {"status": bad.get("status") or "crash",
                   "message": f"{bad['layer']} step {bad['step']} {bad['case']}{_downstream(bad)}: {bad['error']}"}
    return outcome, table[table["error"].isna()]


def _downstream(row: pd.Series) -> str:
    """The observing point of a call that failed in the network rebuilt for it (" at loss"), whose
    input at the layer is the live one, not the recorded one of the calls at the output ("" there)."""
    fop = row.get("fop")
    return f" at {fop}" if isinstance(fop, str) and fop != "output" else ""


def verdict(table: pd.DataFrame, rules: Rules = Rules(), outcome: dict | None = None) -> dict:
    """The Detector's JSON for one kernel from its playback rows (case == "kernel", fop == "output"),
    failed by a row of a call that failed (``after_probe``) as by a failed probe's ``outcome``; ``judge``
    also reads the outcome playback recorded beside them."""
    # A failed row has no scores: the verdict on a table holding one ended in a TypeError.
    outcome, table = after_probe(table, outcome or {"status": "ok"})
    if outcome.get("status", "ok") != "ok":
        return {"verdict": "fail", "error_model": outcome["status"],  # crash | oom | timeout | shape_mismatch
                "confidence": 1.0, "evidence": {"outcome": outcome}, "layers": []}
    own = table[(table["case"] == "kernel") & (table["fop"] == "output")]
    if own.empty:
        raise PeatError("playback table has no rows of the kernel itself (case 'kernel', fop 'output')")
    classes = [classify(r, rules) for r in own.to_dict("records")]
    own = own.assign(error_model=[c for c, _ in classes], confidence=[p for _, p in classes])
    model = worst(own["error_model"])
    agreeing = own[own["error_model"] == model]
    ok = passes(model, rules)
    confidence = float(agreeing["confidence"].mean()) if ok else \
        float(len(agreeing) / max(1, (~own["error_model"].map(lambda c: passes(c, rules))).sum()) *
              agreeing["confidence"].mean())
    return {"verdict": "pass" if ok else "fail", "error_model": model, "confidence": round(confidence, 6),
            "evidence": _evidence(own, table, rules), "layers": _layers(own)}


def _layers(own: pd.DataFrame) -> list[dict]:
    out = []
    for (layer, comp, tensor), rows in own.groupby(["layer", "computation", "tensor"], sort=False):
        out.append({"layer": layer, "pass": comp, "tensor": tensor, "error_model": worst(rows["error_model"]),
                    "score": float(rows["rel_top10"].median()), "steps": int(rows["step"].nunique()),
                    "classes": rows["error_model"].value_counts().to_dict()})
    return out


def _evidence(own: pd.DataFrame, table: pd.DataFrame, rules: Rules) -> dict:
    # By the verdict's rules: with accept_reduced_precision false, a reduced_precision case fails the
    # kernel, and a fail naming no first bug left nothing to look at.
    bugs = own[~own["error_model"].map(lambda c: passes(c, rules))]
    first = bugs.iloc[0] if len(bugs) else None
    # bool, not the object column a table with failed rows has (NaN there): ~True is -2 in Python, and
    # failed_cases summed to -30 beside a pseudo-error's not_applicable rows.
    close = own["allclose"].astype(bool)
    ev = {
        "rules": asdict(rules),
        "cases": int(len(own)),
        "classes": own["error_model"].value_counts().to_dict(),
        "max_err_over_fp32_envelope": float(own["err_over_tau32"].max()),
        "max_err_over_reduced_precision_envelope": float(own["err_over_taurp"].max()),
        "median_rel_top10": float(own["rel_top10"].median()),
        "worst_cases": worst_cases(own),
        "baselines": {
            "allclose": {"verdict": "pass" if close.all() else "fail",
                         "failed_cases": int((~close).sum()), "rtol": 1e-5, "atol": 1e-8},
            "peat_rule_of_thumb": peat_rule_of_thumb(own),
        },
    }
    if first is not None:
        ev["first_bug"] = {"layer": first["layer"], "computation": first["computation"], "tensor": first["tensor"],
                           "step": int(first["step"]),
                           "error_model": first["error_model"], "wrong_elements": int(first["s_n"])}
    faults = table[(table["case"] != "kernel") & (table["fop"] == "output") & ~table["case"].str.startswith("ref:")]
    if len(faults):
        ev["pseudo_errors"] = {
            spec: {comp: worst(classify(r, rules)[0] for r in rows.to_dict("records"))
                   for comp, rows in by_spec.groupby("computation", sort=False)}
            for spec, by_spec in faults.groupby("case", sort=True)}
    return ev


WORST_CASES = 3


def worst_cases(own: pd.DataFrame, n: int = WORST_CASES) -> list[dict]:
    """The ``n`` cases of ``own`` (classified kernel rows) most wrong: by class in priority order, then
    by error over the fp32 envelope. That error alone listed a kernel failing on NaN by its correct
    cases: a NaN is left out of the scores, so a case exact but for NaN scores 0."""
    rank = own["error_model"].map(CLASSES.index)
    rows = own.assign(rank=rank).sort_values(["rank", "err_over_tau32"], ascending=[True, False], kind="stable").head(n)
    out = rows[["layer", "computation", "tensor", "step", "err_over_tau32", "err_over_taurp", "error_model"]]
    # Counts beside the scores, as the scores say nothing of NaN/Inf elements.
    counts = {"wrong_elements": rows["s_n"], "nonfinite": rows["nonfinite"]}
    return out.assign(**{k: v.astype(int) for k, v in counts.items()}).to_dict("records")


def rules_from(section: dict | None) -> Rules:
    """Rules from the config's ``detect`` section (other keys there are ignored)."""
    names = Rules.__dataclass_fields__
    return Rules(**{k: v for k, v in (section or {}).items() if k in names})


def not_applicable(record: dict) -> str:
    """Why a playback replayed nothing: no recorded layer of the kernel's op, or layers of it with no
    sample the configured computations apply to (the first layer has no input gradient)."""
    if record.get("layers"):
        return (f"the recorded layers of the kernel's op ({', '.join(record['layers'])}) in {record.get('context')} "
                "have no sample that the replayed computations apply to")
    return f"no recorded layer of the kernel's op in {record.get('context')}"


# The one setting the verdict alone reads: every other shaped the table's evidence in playback.
VERDICT_ONLY = ("accept_reduced_precision",)


def rules_of(record: dict, rules: Rules | None = None) -> Rules:
    """The rules to judge a playback's table with: those it was scored with (the record's ``rules``),
    with ``rules``' ``accept_reduced_precision``. A setting of ``rules`` that differs from the record's
    in any other is refused: the table's envelopes, S, G and their shapes were measured with the
    record's, so the verdict would name settings it did not apply."""
    measured = {k: v for k, v in (record.get("rules") or {}).items() if k in Rules.__dataclass_fields__}
    if rules is None:
        return Rules(**measured)
    differ = [k for k, v in measured.items() if k not in VERDICT_ONLY and getattr(rules, k) != v]
    if differ:
        used = ", ".join(f"detect.{k}={measured[k]!r} (given {getattr(rules, k)!r})" for k in differ)
        raise PeatError(f"playback record of {record.get('context')}: its table was scored with {used}; "
                        "replay with playback.Plan(rules=...) to judge with other settings")
    return rules


def judge(table: pd.DataFrame, record: dict, rules: Rules | None = None) -> dict:
    """The verdict of one kernel from what ``peat.playback.replay`` returns (its table and record):
    unlike ``verdict`` on the table alone, a crash after the probe (a row with an ``error``) fails
    it, and nothing replayed passes as not applicable. ``rules``: by default those playback scored
    the table with (``rules_of``)."""
    if not isinstance(table, pd.DataFrame) or not isinstance(record, dict):  # swapped: an AttributeError on .empty
        raise PeatError(f"detect.judge(table, record): table is replay's DataFrame, record its dict; "
                        f"given {type(table).__name__}, {type(record).__name__}")
    rules = rules_of(record, rules)
    outcome, table = after_probe(table, record.get("outcome", {"status": "ok"}))
    if outcome.get("status", "ok") != "ok" or not table.empty:
        result = verdict(table, rules, outcome=outcome)
    else:
        result = {"verdict": "pass", "error_model": "none", "confidence": 0.0, "layers": [],
                  "evidence": {"applicable": False, "reason": not_applicable(record)}}
    result["evidence"]["outcomes"] = record.get("outcomes", [])
    result["evidence"]["timings"] = record.get("timings", {})
    result["provenance"] = record.get("provenance", {})
    return json_safe(result)


# The columns that say which case a playback row is (peat.analyze groups by them, step aside); the
# rules' own scores are the table's too.
CASE_KEYS = ("case", "computation", "layer", "fop", "tensor")
TABLE_KEYS = (*CASE_KEYS, "step")


def run_job(table_path: str | Path, record_path: str | Path, out: str | Path, section: dict | None = None) -> dict:
    """One workflow job: the verdict JSON of one kernel from its playback table and record."""
    # No rule reads the list columns (bits, maps): 80 % of the table's memory in pandas.
    rules = None if section is None else rules_from(section)  # None: those playback scored the table with
    record = read_json(record_path)  # the small file first: a damaged one is named before the table is read
    result = judge(read_parquet_scalars(table_path, required=TABLE_KEYS), record, rules)
    write_json(out, result)
    print(f"detect: {result['verdict']} ({result['error_model']}, confidence {result['confidence']:.3f})")
    return result
