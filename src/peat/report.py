"""The collated report: one self-contained HTML page per configuration, tables also as CSV.

``build(files, out_dir, ...)`` sorts the files the workflow hands it (the targets of every
stage) into sections by their place in the results tree (docs/design.md) and renders whichever
sections have data, so the page keeps working while stages are added. Figures are embedded as
base64 PNG, so ``index.html`` can be mailed or archived on its own. No timestamps: the same
inputs give a byte-identical page.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from . import provenance
from .io import PeatError, atomic_path, read_csv, read_json, write_csv

# What the verdict and candidate sections say of layers_not_injected (playback record, outcome.json).
NOT_INJECTED_NOTE = ("<b>not injected</b> names the computation and the layers where the kernel's error was never "
                     "injected, as that computation never runs there (the input gradient of a layer fed by data, "
                     "a frozen weight's gradient)")
# Section key -> (title, caption shown when a figure has no caption file of its own).
SECTIONS = {
    "verdicts": ("Kernel verdicts", (
        "One row per candidate kernel run on one model and vendor. <b>verdict</b> is the Detector's "
        "pass/fail; <b>error model</b> is the kind of error the kernel's errors look most like "
        "(none passes, and reduced_precision unless detect.accept_reduced_precision is false; random_value, "
        "random_zero, bit_flip, periodic_lane, block_structured, non_finite fail; crash, oom and timeout mean the kernel did not finish, "
        "shape_mismatch that it returned a result of the wrong shape, dtype or device; "
        "not_applicable: the model records no layer of the kernel's op, so nothing was replayed); "
        "<b>confidence</b> (0..1) is how consistently the tensors of the failing layers point to "
        "that error model. <b>injected</b> names the error a test kernel injects on purpose (config "
        "key kernels.&lt;name&gt;.error), so its row shows whether the Detector recognized it; "
        f"{NOT_INJECTED_NOTE}: the verdict there comes from golden rows.")),
    "golden": ("Golden training", (
        "Training curves of the trusted golden runs that every other stage compares against. "
        "Left: loss per optimizer step (line, training batches) and on the validation split after "
        "each epoch (dots), on a log scale where the losses span more than two decades. Right: "
        "validation accuracy (classifiers) or perplexity (language "
        "models) per epoch. A healthy run has a falling loss; one whose loss turned NaN or inf "
        "stopped with an error instead (a diverged golden is no reference). The table gives the "
        "last validation point of each run.")),
    "candidate": ("Candidate-kernel training", (
        "Training with the candidate kernel routed into the recorded layers, compared with the "
        "golden run step by step (left: training loss of both; right: their absolute difference, "
        "log scale). A candidate curve that leaves the golden one means the kernel's errors change "
        "what the model learns; differences near 1e-7 are float32 rounding. <b>candidate.csv</b> "
        "gives each run's outcome (status ok, crash, oom, timeout or shape_mismatch, final validation loss and accuracy of "
        "candidate and golden); <b>rfi.csv</b> the same for frequency-based runtime fault "
        "injection, where the faulty kernel is active only in the first fraction of the steps or every "
        "N-th step, golden otherwise (<b>case</b>: f0.5 the first half, every4 every fourth step). "
        f"{NOT_INJECTED_NOTE}: those layers trained as golden.")),
    "analyze": ("Analyzer", (
        "The Analyzer's characterization of each candidate kernel against the golden kernel on "
        "the replayed training context: per layer and computation (forward, input gradient, "
        "weight gradient), the top-10 % error against iteration, per layer and as its ratio to "
        "float32 rounding noise, which bits differ and how the differences are laid out in the "
        "tensor. Errors near the fp16/bf16/tf32 references are numerics; errors far beyond them, "
        "or with structure (lanes, tiles, single bits), point to a bug. Counts of elements beyond "
        "the Detector's envelopes (n32, ngross) are columns of the playback table.")),
    "alter": ("Checkpoint alteration", (
        "Sensitivity of training to bit flips in a checkpoint: each cell is one kind of flip "
        "(bit position or field) in one group of tensors, colored by how far the resumed run "
        "ends from the unaltered one. Light cells are absorbed by training; dark cells are "
        "flips the model does not recover from (usually exponent bits). In the tables, <b>nan</b> is a "
        "NaN loss, or no final value where the resumed training stopped with the error its "
        "<b>reason</b> names (either way the run counts as diverged, † in the heatmap); a blank cell "
        "was not measured.")),
    "sdc": ("Silent data corruption drills", (
        "Each drill injects one fault into distributed data-parallel training and checks that "
        "the SDC checks catch it: <b>detected</b> says whether an alarm came at or after the injection, "
        "<b>detection_step</b> at which step, <b>localized</b> whether that alarm named suspect ranks and "
        "<b>right_rank</b> whether it named the faulty rank alone; <b>false_alarms</b> counts alarms raised "
        "before the injection, not naming the faulty rank, or localized to a healthy rank too (an unlocalized "
        "alarm naming the faulty rank among others, as both of two replicas, is a detection). The drill "
        "without an injected fault (clean) is the "
        "false-alarm control: its <b>false_alarms</b> must be 0; with no faulty rank to find, its "
        "<b>detected</b> and <b>right_rank</b> are False, as they should be.")),
    "benchmarks": ("Benchmarks", (
        "From <code>make bench</code>: each benchmark is a ratio of two things measured in the same "
        "run (<b>measured_as</b> says which, for example playback time over retraining time). In "
        "the figures each point is one repeat, the bar the median and the dashed line the goal; "
        "<b>met</b> says whether the median meets the goal.")),
}

# The CSV tables written beside index.html (always, header-only when a stage has no data yet),
# with the columns they start with; a stage's own columns follow.
TABLES = {
    "verdicts.csv": ["model", "vendor", "kernel", "verdict", "error_model", "confidence", "injected", "not_injected"],
    "golden.csv": ["model", "vendor", "epochs", "steps", "val_loss", "val_accuracy", "val_perplexity"],
    "alter_sensitivity.csv": ["model", "vendor"],
    "alter_absorbed.csv": ["model", "vendor"],
    "candidate.csv": ["model", "vendor", "kernel"],
    "rfi.csv": ["model", "vendor", "kernel", "case"],
    "sdc.csv": ["model", "drill"],
    "benchmarks.csv": ["benchmark"],
}
MAX_ROWS = 40
# What a candidate or RFI run's outcome.json, and a drill's result, is, with the key it always holds.
RUN, DRILL = ("a run's result", "status"), ("a drill's result", "detected")
# The columns both tables of an alteration study (sensitivity.csv, absorbed.csv) start their rows with.
STUDY_COLUMNS = ("cls", "region")
# The columns of a golden run's metrics.csv that its row in golden.csv reads.
GOLDEN_COLUMNS = ("epoch", "split", "loss", "accuracy", "perplexity")
# A JSON result's columns that lead its row, where it has them: a candidate or RFI run's, a drill's.
OUTCOME_COLUMNS = ("status", "steps_trained", "max_abs_loss_diff", "nonfinite_loss", "message", "not_injected",
                   "outcome", "detected", "detection_step", "localized", "right_rank", "false_alarms")
# Caption files are named <rule file>_<figure>.rst; these stages' figures come from another file.
CAPTION_ALIASES = {"analyze": ("playback",), "detect": ("playback",), "candidate": ("kernels",)}
TABLE_SECTION = {"verdicts.csv": "verdicts", "golden.csv": "golden", "alter_sensitivity.csv": "alter",
                 "alter_absorbed.csv": "alter", "sdc.csv": "sdc", "benchmarks.csv": "benchmarks",
                 "candidate.csv": "candidate", "rfi.csv": "candidate"}

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }}
h1 {{ border-bottom: 2px solid #444; }} h2 {{ margin-top: 2em; border-bottom: 1px solid #aaa; }}
p.caption {{ color: #333; max-width: 60em; }} p.meta {{ color: #666; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; }} th {{ background: #eee; }}
tr.pass td.verdict {{ background: #d4f4d4; }} tr.fail td.verdict {{ background: #f8d0d0; }}
figure {{ margin: 1.5em 0; }} figure img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ color: #333; max-width: 60em; }} div.wide {{ overflow-x: auto; }} nav a {{ margin-right: 1em; }}
</style></head><body>
<h1>{title}</h1>
<p class="meta">Configuration <b>{name}</b>: models {models}; vendors {vendors}.
Tables are also beside this page as CSV: {csvs}.</p>
<nav>{nav}</nav>
{body}
</body></html>
"""


@dataclass
class Figure:
    png: bytes
    title: str
    caption: str
    group: tuple[str, ...] = ()  # the run it belongs to: (model, vendor[, kernel])


@dataclass
class Section:
    key: str
    figures: list[Figure] = field(default_factory=list)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # CSV name -> table

    def empty(self) -> bool:
        return not self.figures and not any(len(t) for t in self.tables.values())


def build(files: list[str | Path], out_dir: str | Path, *, name: str, models: list[str], vendors: list[str],
          title: str | None = None, captions: str | Path | None = None, dpi: int = 80,
          injected: dict[str, str] | None = None) -> Path:
    """Write ``out_dir/index.html`` and one CSV per table from the stage outputs ``files``.

    ``captions`` is the folder of RST captions (workflow/report): a figure ``X.png`` of stage
    ``S`` gets the text of ``X.rst`` or ``S_X.rst`` (the file Snakemake's report uses too); every
    section also opens with a paragraph on how to read it.
    """
    out_dir = Path(out_dir)
    paths = sorted(_expand(files), key=_reading_order)
    sections = {key: Section(key) for key in SECTIONS}
    for path in paths:
        _classify(path, sections, Path(captions) if captions else None, dpi, injected or {})
    for csv_name, columns in TABLES.items():
        table = sections[TABLE_SECTION[csv_name]].tables.get(csv_name, pd.DataFrame(columns=columns))
        write_csv(out_dir / csv_name, table)
    page = _render(sections, title or f"peat report - {name}", name, models, vendors)
    with atomic_path(out_dir / "index.html") as tmp:
        tmp.write_text(page, encoding="utf-8")  # as the page declares, not the locale's
    return out_dir / "index.html"


def _expand(files) -> set[Path]:
    """Files, with folders (directory() outputs) replaced by the files inside them. A missing one is
    an error naming it: it was left out without a word, its section or row missing from the page."""
    out = set()
    for f in map(Path, files):
        if f.is_dir():
            out.update(p for p in f.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif f.exists():
            out.add(f)
        else:
            raise PeatError(f"{f}: no such file (an input of the report)")
    return out


def _reading_order(path: Path) -> tuple:
    """By folder, a run's Analyzer figures in the order the section's caption reads them (score
    against iteration first), not by name: bits came first, the spatial maps after the scores."""
    from .analyze import FIGURES  # here, as _axes imports matplotlib: importing peat.report stays light

    return path.parent, FIGURES.index(path.stem) if path.stem in FIGURES else len(FIGURES), path.name


# The stage folder under results/ (or reports/) -> the report section its files go to.
STAGES = {"golden": "golden", "candidate": "candidate", "rfi": "candidate", "analyze": "analyze", "alter": "alter",
          "sdc": "sdc", "detect": "verdicts", "benchmarks": "benchmarks"}


def _parts(path: Path) -> list[str]:
    """The path from its results/ or reports/ folder on: ['results', stage, ...] ([] if none).
    The last such folder followed by a stage: the working directory may lie under a 'results'
    folder, and a model or kernel may be named 'results' too."""
    parts = list(path.parts)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in ("results", "reports") and parts[i + 1] in STAGES:
            return parts[i:]
    return []


def _classify(path: Path, sections: dict[str, Section], captions: Path | None, dpi: int,
              injected: dict[str, str]) -> None:
    parts = _parts(path)
    if len(parts) < 3:
        return
    stage = parts[1]
    key = STAGES.get(stage)
    if key is None:
        return
    section = sections[key]
    if path.suffix == ".png":
        label = " / ".join(parts[2:-1] + [path.stem.replace("_", " ")])
        wildcards = dict(zip(("model", "vendor", "kernel"), parts[2:-1]))
        section.figures.append(Figure(_png_file(path), label, _caption(path, stage, captions, wildcards),
                                      tuple(parts[2:-1])))
    elif key == "verdicts" and path.suffix == ".json" and len(parts) == 5:
        _append(section, "verdicts.csv", _verdict_row(path, *parts[2:4], injected.get(path.stem, "")))
    elif key == "golden" and path.name == "metrics.csv" and len(parts) == 5:
        _append(section, "golden.csv", _golden_row(path, *parts[2:4]))
    elif key == "alter" and path.suffix == ".csv" and len(parts) == 5 and f"alter_{path.name}" in TABLES:
        _extend(section, f"alter_{path.name}", _study_table(path), model=parts[2], vendor=parts[3])
    elif stage == "candidate" and path.name == "outcome.json" and len(parts) == 6:
        _append(section, "candidate.csv", _flat_row(path, RUN, **dict(zip(("model", "vendor", "kernel"), parts[2:5]))))
    elif stage == "rfi" and path.name == "outcome.json" and len(parts) == 7:
        _append(section, "rfi.csv", _flat_row(path, RUN, **dict(zip(("model", "vendor", "kernel", "case"), parts[2:6]))))
    elif path.name == "compare.csv" and len(parts) == {"candidate": 6, "rfi": 7}.get(stage):  # whether training recovers
        group, stopped = tuple(parts[2:-1]), _stopped(path.with_name("outcome.json"))
        section.figures.append(Figure(compare_figure(path, title=" / ".join(group) + stopped, dpi=dpi),
                                      " / ".join(group) + " / training vs golden" + stopped, "", group))
    elif key == "sdc" and path.suffix == ".json" and len(parts) == 4:
        _append(section, "sdc.csv", _flat_row(path, DRILL, model=parts[2], drill=path.stem))
    elif key == "benchmarks" and path.name == "results.json":
        section.tables["benchmarks.csv"] = _benchmark_table(path)


# A whole PNG file starts with its signature and ends with its IEND chunk (length 0, type, CRC).
PNG_START, PNG_END = b"\x89PNG\r\n\x1a\n", b"\x00\x00\x00\x00IEND\xaeB`\x82"


def _png_file(path: Path) -> bytes:
    """A figure's bytes; one line naming it where they are no whole PNG image (an empty, cut short or
    foreign file was embedded as it was: a broken image on the page, and nothing said which)."""
    png = path.read_bytes()
    if not (png.startswith(PNG_START) and png.endswith(PNG_END)):
        raise PeatError(f"{path}: not a PNG image (empty or damaged)")
    return png


def _append(section: Section, csv_name: str, row: dict) -> None:
    _extend(section, csv_name, pd.DataFrame([row]))


def _extend(section: Section, csv_name: str, frame: pd.DataFrame, **keys) -> None:
    """Add rows to a section table; ``keys`` become leading columns (which run they are from)."""
    for i, (col, value) in enumerate(keys.items()):
        if col not in frame.columns:
            frame.insert(i, col, value)
    table = section.tables.get(csv_name)
    section.tables[csv_name] = frame if table is None else pd.concat([table, frame], ignore_index=True)


def _study_table(path: Path) -> pd.DataFrame:
    """An alteration study's CSV with its measured NaNs (a diverged run's loss, written "nan") kept as
    "nan": read as NaN they showed blank, as a cell not measured does (see alter_study.MEASURED)."""
    table = read_csv(path, required=STUDY_COLUMNS)  # another CSV gave a row of its columns, nothing said
    measured = read_csv(path, dtype=str, keep_default_na=False).eq("nan")
    for col in measured.columns[measured.any()]:
        table[col] = table[col].astype(object).where(~measured[col], "nan")
    return table


def _verdict_row(path: Path, model: str, vendor: str, injected: str) -> dict:
    data = _json_object(path, "a detector result")
    if "verdict" not in data:
        raise PeatError(f"{path}: missing key 'verdict' (not a detector result?)")
    # Nothing replayed (the model records no layer of the kernel's op): the Detector's pass is no
    # finding, and a green row would read as one.
    untested = isinstance(data.get("evidence"), dict) and data["evidence"].get("applicable") is False
    return {"model": model, "vendor": vendor, "kernel": path.stem,
            "verdict": "not_applicable" if untested else data["verdict"],
            "error_model": data.get("error_model", ""), "confidence": data.get("confidence", float("nan")),
            "injected": injected, "not_injected": _not_injected(_sidecar(path, model, vendor)),
            **provenance.columns(data)}


def _json_object(path: Path, what: str) -> dict:
    """A JSON file's object; one line naming the file where it holds another value (a list or a number
    ended the report in an AttributeError or a TypeError naming none, or gave a row of its keys alone)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise PeatError(f"{path}: not a JSON object (not {what}?)")
    return data


def _sidecar(verdict: Path, model: str, vendor: str) -> dict:
    """The playback record a verdict was judged from (results/playback/<model>/<vendor>/<kernel>.json);
    {} where there is none."""
    path = verdict.parents[3] / "playback" / model / vendor / verdict.name
    data = read_json(path) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def _not_injected(data: dict) -> str:
    """"input_grad at conv1, fc" from a candidate's or RFI case's outcome.json or a playback record
    that lists ``layers_not_injected``; "" where the error was injected everywhere it was aimed."""
    layers = data.get("layers_not_injected") or []
    if not layers:
        return ""
    return f"{data.get('computation') or 'its computation'} at {', '.join(layers)}"


def _golden_row(path: Path, model: str, vendor: str) -> dict:
    # Its columns and a row: other columns ended the report in a KeyError, a header alone in an IndexError.
    metrics = _numbers(read_csv(path, required=GOLDEN_COLUMNS), path, ("epoch", "loss"), whole=("epoch",))
    if metrics.empty:
        raise PeatError(f"{path}: no rows (a golden training's metrics.csv has one per step)")
    val = metrics[metrics["split"] == "val"]
    last = val.iloc[-1] if len(val) else metrics.iloc[-1]
    return {"model": model, "vendor": vendor, "epochs": int(metrics["epoch"].max()),
            "steps": int((metrics["split"] == "train").sum()), "val_loss": last["loss"],
            "val_accuracy": last["accuracy"], "val_perplexity": last["perplexity"]}


def _flat_row(path: Path, kind: tuple[str, str], **keys) -> dict:
    """Top-level scalars of a JSON result (nested detail stays in the JSON file); ``kind``: what it is
    and the key every such result holds."""
    data = _json_object(path, "a run's or drill's result")
    what, key = kind
    if key not in data:  # another object ({}, a verdict) gave a row of the run's keys and blanks, its outcome unsaid
        raise PeatError(f"{path}: missing key {key!r} (not {what}?)")
    scalars = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
    if scalars and "layers_not_injected" in data:  # a list, like the layers it ran in: one cell naming them and the pass
        scalars["not_injected"] = _not_injected(data)
    # The outcome, then details: how far a candidate or RFI run trained (a crash keeps its curve to
    # there), how far its loss went from golden's and a crash's message; what a drill found, as the
    # section's caption explains it (its localized and right_rank sat behind its settings, in
    # alphabetical order, beyond the page's width).
    first = {k: scalars.pop(k) for k in OUTCOME_COLUMNS if k in scalars}
    return {**keys, **first, **scalars}


def _stopped(outcome: Path) -> str:
    """" (crash after 3 steps)" for a candidate or RFI run that did not finish, else "": without it, a
    kernel that crashed at once drew golden's curve alone, its empty difference panel read as NaN losses."""
    data = read_json(outcome) if outcome.exists() else {}
    status = data.get("status", "ok") if isinstance(data, dict) else "ok"
    if status == "ok":
        return ""
    steps = data.get("steps_trained")
    return f" ({status} after {steps} step{'' if steps == 1 else 's'})" if isinstance(steps, int) else f" ({status})"


def _benchmark_table(path: Path) -> pd.DataFrame:
    data = read_json(path)
    items = data.get("benchmarks", data) if isinstance(data, dict) else data
    if isinstance(items, dict):
        items = [{"benchmark": k, **(v if isinstance(v, dict) else {"value": v})} for k, v in items.items()]
    if not isinstance(items, list):  # a number ended the report in a TypeError naming no file
        raise PeatError(f"{path}: not a list of benchmarks (not make bench's results.json?)")
    rows = [{k: v for k, v in item.items() if not isinstance(v, (dict, list))} for item in items if isinstance(item, dict)]
    # No entries still write the key column: a CSV of one empty line cannot be read back.
    table = pd.DataFrame(rows, columns=None if rows else TABLES["benchmarks.csv"]).rename(columns={"name": "benchmark"})
    first = [c for c in ("benchmark", "median", "goal", "met", "unit", "measured_as", "error") if c in table]
    return table[first + [c for c in table.columns if c not in first]]


def _caption(path: Path, stage: str, captions: Path | None, wildcards: dict) -> str:
    """The figure's own RST caption (``X.rst``, ``<stage>_X.rst`` or, for ``X3.png``, ``X.rst``) as text; the
    section's caption above the figures covers the others."""
    if captions is not None:
        prefixes = ("", f"{stage}_", *(f"{alias}_" for alias in CAPTION_ALIASES.get(stage, ())))
        stems = (path.stem, re.sub(r"\d+$", "", path.stem).rstrip("_"))
        for stem in (prefix + s for s in stems for prefix in prefixes):
            rst = captions / f"{stem}.rst"
            if rst.is_file():
                return html.escape(_plain(rst.read_text(), wildcards))
    return ""


def _plain(rst: str, wildcards: dict) -> str:
    """Enough of RST -> text for a caption: substitute the wildcards into Snakemake's Jinja
    expressions, drop markup characters and join lines."""
    text = re.sub(r"\{\{\s*snakemake\.wildcards\.(\w+)\s*\}\}", lambda m: wildcards.get(m[1], m[1]), rst)
    text = re.sub(r"\{\{[^}]*\}\}", "", text)
    text = re.sub(r":[a-z]+:`([^`]*)`", r"\1", text)
    text = text.replace("**", "").replace("``", "")
    return " ".join(text.split())


def _img(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _table_html(name: str, table: pd.DataFrame, analyzed: set[tuple[str, ...]]) -> str:
    prov = [c for c in table.columns if c.startswith("prov_")]
    provenance_note = _provenance_note(table[prov])
    table = table.drop(columns=prov)  # one line under the table instead of ten columns; all in the CSV
    if name == "verdicts.csv":
        return _verdict_html(table, analyzed) + provenance_note
    if name == "benchmarks.csv" and {"median", "goal_value"} <= set(table.columns):
        table = table.assign(median=list(map(_apart_from, table["median"], table["goal_value"])))
    note = ""
    if len(table) > MAX_ROWS:  # tidy tables of whole studies: the CSV has them all
        note = f'<p class="meta">First {MAX_ROWS} of {len(table)} rows; all in <a href="{name}">{name}</a>.</p>'
        table = table.head(MAX_ROWS)
    table = table.map(_cell)
    return (f'<div class="wide"><p class="meta">{name}</p>'
            + table.to_html(index=False, border=0, table_id=name.removesuffix(".csv"), escape=True)
            + note + provenance_note + "</div>")


def _provenance_note(prov: pd.DataFrame) -> str:
    """The provenance columns as one line: each key with its distinct values."""
    if prov.empty:
        return ""
    values = {c.removeprefix("prov_"): sorted(set(map(_cell, prov[c])) - {""}) for c in prov.columns}
    text = "; ".join(f"{k} {', '.join(v)}" for k, v in values.items() if v)
    return f'<p class="meta">Provenance: {html.escape(text)}.</p>'


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and value != value):  # JSON null, NaN: blank
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        # A count in a column with blanks is read as floats: 123456 flipped values showed as "1.235e+05".
        return str(int(value))
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _apart_from(value, goal) -> str:
    """``value`` as a cell, with the further digits it takes not to read as ``goal`` where it is not that:
    a median of 1.10004 showed "1.1" beside its goal "<= 1.10" and met False, as if met were wrong."""
    text = _cell(value)
    if isinstance(value, float) and value == value and pd.api.types.is_number(goal):
        for digits in range(5, 18):
            if float(text) != goal or value == goal:
                break
            text = f"{value:.{digits}g}"
    return text


def _anchor(key: str, group: tuple[str, ...]) -> str:
    return html.escape("-".join((key, *group)))


def _verdict_html(table: pd.DataFrame, analyzed: set[tuple[str, ...]]) -> str:
    """Verdict rows, colored by verdict; a kernel links to its Analyzer figures."""
    cols = list(table.columns)
    head = "".join(f"<th>{html.escape(c.replace('_', ' '))}</th>" for c in cols)
    rows = []
    for rec in table.to_dict("records"):
        cells = []
        for col, value in rec.items():
            text = html.escape(f"{value:.3f}" if isinstance(value, float) and value == value else _cell(value))
            run = (rec["model"], rec["vendor"], rec["kernel"])
            if col == "kernel" and run in analyzed:
                text = f'<a href="#{_anchor("analyze", run)}">{text}</a>'
            cells.append(f'<td class="{col}">{text}</td>')
        cells = "".join(cells)
        rows.append(f'<tr class="{html.escape(str(rec["verdict"]))}">{cells}</tr>')
    return f'<table id="verdicts"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _render(sections: dict[str, Section], title: str, name: str, models, vendors) -> str:
    body, nav, csvs = [], [], []
    analyzed = {fig.group for fig in sections["analyze"].figures}
    for key, section in sections.items():
        heading, caption = SECTIONS[key]
        if section.empty():
            if key == "verdicts":
                body.append(f'<h2 id="verdicts-section">{heading}</h2><p class="caption">No candidate '
                            "kernels in this configuration (config key 'kernels').</p>")
            continue
        nav.append(f'<a href="#{key}-section">{heading}</a>')
        body.append(f'<section id="{key}-section"><h2>{heading}</h2><p class="caption">{caption}</p>')
        for csv_name, table in section.tables.items():
            csvs.append(f'<a href="{csv_name}">{csv_name}</a>')
            body.append(_table_html(csv_name, table, analyzed))
        shown = None
        for fig in section.figures:
            if fig.group and fig.group != shown:  # one heading per run, the target of the verdict table's links
                body.append(f'<h3 id="{_anchor(key, fig.group)}">{html.escape(" / ".join(fig.group))}</h3>')
                shown = fig.group
            body.append(f'<figure><img src="{_img(fig.png)}" alt="{html.escape(fig.title)}">'
                        f"<figcaption><b>{html.escape(fig.title)}.</b> {fig.caption}</figcaption></figure>")
        body.append("</section>")
    return PAGE.format(title=html.escape(title), name=html.escape(name), models=html.escape(", ".join(models)),
                       vendors=html.escape(", ".join(vendors)), csvs=", ".join(csvs) or "none yet",
                       nav="".join(nav), body="\n".join(body))


# -- golden training curves (one figure per run, also flagged for Snakemake's report) -----------
def training_curves(metrics_csv: str | Path, out_png: str | Path, *, title: str, dpi: int = 80) -> Path:
    """Loss per step (train line, val dots) and the validation metric per epoch."""
    metrics = read_csv(metrics_csv)
    if not {"step", "epoch", "split", "loss"} <= set(metrics.columns):
        raise PeatError(f"{metrics_csv}: needs columns step, epoch, split, loss (not a training metrics file?)")
    _numbers(metrics, metrics_csv, ("step", "epoch", "loss", "accuracy", "perplexity"), whole=("step", "epoch"))
    train, val = metrics[metrics["split"] == "train"], metrics[metrics["split"] == "val"]
    text = "perplexity" in val and val["perplexity"].notna().any()
    metric = "perplexity" if text else "accuracy"
    if metric not in val:  # a KeyError naming no file
        raise PeatError(f"{metrics_csv}: needs column accuracy, or perplexity with values (not a training metrics file?)")
    with _axes(dpi) as (fig, (left, right)):
        left.plot(train["step"], train["loss"], lw=1, label="train (per step)")
        left.plot(val["step"], val["loss"], "o", label="validation (per epoch)")
        left.set(xlabel="optimizer step", ylabel="loss", title="loss", yscale=loss_scale(train["loss"], val["loss"]))
        left.legend(fontsize="small")
        right.plot(val["epoch"], val[metric], "o-", color="C1")
        right.set(xlabel="epoch", ylabel=f"validation {metric}", title=f"validation {metric}")
        _whole_ticks(left, right)
        fig.suptitle(title)
    with atomic_path(out_png) as tmp:
        tmp.write_bytes(_png(fig))
    return Path(out_png)


def compare_figure(compare_csv: str | Path, *, title: str, dpi: int = 80) -> bytes:
    """Candidate-kernel training against golden: loss per step, and their difference."""
    compare = read_csv(compare_csv)
    if not {"step", "split", "loss_golden", "loss_candidate"} <= set(compare.columns):
        raise PeatError(f"{compare_csv}: needs columns step, split, loss_golden, loss_candidate")
    _numbers(compare, compare_csv, ("step", "loss_golden", "loss_candidate"), whole=("step",))
    train = compare[compare["split"] == "train"]
    with _axes(dpi) as (fig, (left, right)):
        left.plot(train["step"], train["loss_golden"], lw=1.5, label="golden")
        left.plot(train["step"], train["loss_candidate"], "--", lw=1.5, label="candidate")
        left.set(xlabel="optimizer step", ylabel="training loss", title="loss",
                 yscale=loss_scale(train["loss_golden"], train["loss_candidate"]))
        left.legend(fontsize="small")
        # An infinite loss is no finite difference, as a NaN one: a candidate whose loss went inf made a
        # log axis of inf alone, and the report ended in "Data cannot be log-scaled".
        diff = (train["loss_candidate"] - train["loss_golden"]).abs().replace(float("inf"), float("nan"))
        right.plot(train["step"], diff.where(diff > 0), "o-", ms=3, color="C3")
        right.set(xlabel="optimizer step", ylabel="|candidate - golden|", title="loss difference (0 not shown)",
                  xlim=left.get_xlim())
        _whole_ticks(left, right)
        if (diff > 0).any():
            right.set_yscale("log")
        else:  # blank, ticked -0.04..0.04: it read as a plot that failed to draw
            val = compare[compare["split"] == "val"]
            right.text(0.5, 0.5, _no_difference(diff, (val["loss_candidate"] - val["loss_golden"]).abs()),
                       ha="center", va="center", transform=right.transAxes, color="grey")
            right.set_yticks([])
        fig.suptitle(title)
    return _png(fig)


def _numbers(table: pd.DataFrame, path, columns: tuple[str, ...], whole: tuple[str, ...] = ()) -> pd.DataFrame:
    """``table`` whose ``columns`` (those it has) hold numbers, and the ``whole`` ones a number in every
    row; else one line naming the file and the first bad cell (a damaged cell, or a line cut short,
    ended the report or the figure in pandas' ValueError naming no file). NaN is a number: a
    diverged loss, a language model's accuracy."""
    for column in (c for c in columns if c in table):
        cells = table[column]
        bad = pd.to_numeric(cells, errors="coerce").isna() & (cells.notna() | (column in whole))
        if bad.any():
            row = int(bad.to_numpy().argmax())
            said = "is empty" if pd.isna(cells.iloc[row]) else f"holds {cells.iloc[row]!r}"
            raise PeatError(f"{path}: line {row + 2}: column {column} {said}, not a number (damaged?)")
    return table


def _no_difference(diff: pd.Series, val_diff: pd.Series) -> str:
    """What an empty loss-difference panel means: no step differs, or none has both losses. Not
    "equal at every step" where a validation loss (not drawn) differs: the run's max_abs_loss_diff,
    in the table above the figure, counts it."""
    if not (diff == 0).any():
        return "no step with both losses finite"
    val_differs = (val_diff > 0).any()
    return (f"candidate = golden at every {'training ' if val_differs else ''}step"
            + (" with both losses finite" if diff.isna().any() else "")
            + ("\n(not at validation: see max_abs_loss_diff)" if val_differs else ""))


def loss_scale(*losses: pd.Series, decades: float = 2.0) -> str:
    """"log" where the positive losses span more than ``decades`` decades, else "linear": an
    early validation loss of 159 (batch norm's running statistics before they settle) drew a
    training curve falling from 2.6 to 0.003 as a flat line at 0."""
    values = pd.concat(losses).astype(float)
    values = values[values.abs() < float("inf")]  # NaN compares False: dropped too
    if values.empty or values.min() <= 0:
        return "linear"
    return "log" if values.max() / values.min() > 10 ** decades else "linear"


def _whole_ticks(*axes) -> None:
    """Steps and epochs on whole ticks: a one-epoch run was ticked 0.96 to 1.04 (an integer locator
    falls back to fractions below two ticks), a two-step one 0.0, 0.5, ..., 2.0."""
    for ax in axes:
        ax.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)


@contextlib.contextmanager
def _axes(dpi: int):
    """A figure with two panels side by side, closed afterwards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=dpi)
        try:
            yield fig, axes
            fig.tight_layout()
        except BaseException:
            plt.close(fig)
            raise


def _png(fig) -> bytes:
    """PNG bytes without the matplotlib version stamp, so reruns are byte-identical."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
