"""The collated page read as a user reads it (the text of its tables), cell by cell against the result
files it is made from, independently of how report.py builds it."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import TEST_CONFIG
from peat.report import build

REPORT = Path("reports/test")


class _Tables(HTMLParser):
    """Each <table id=...> of a page as rows of cell texts (its header row first); every id and href."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.ids: set[str] = set()
        self.hrefs: list[str] = []
        self._rows = self._row = self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.ids.update([attrs["id"]] if "id" in attrs else [])
        self.hrefs.extend([attrs["href"]] if tag == "a" and "href" in attrs else [])
        if tag == "table":
            self._rows = self.tables.setdefault(attrs.get("id", ""), [])
        elif tag == "tr" and self._rows is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self._rows.append(self._row)
            self._row = None
        elif tag == "table":
            self._rows = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _read(page: Path) -> _Tables:
    parser = _Tables()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def _records(rows: list[list[str]]) -> list[dict[str, str]]:
    return [dict(zip(rows[0], row)) for row in rows[1:]]


def _shown(value) -> str:
    """A result value as a reader should see it: JSON null blank, a number to 4 significant digits."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    return str(value)


@pytest.mark.xdist_group("workflow")
def test_every_verdict_cell_is_its_detector_result(workflow_run):
    page = _read(workflow_run / REPORT / "index.html")
    kernels = yaml.safe_load(TEST_CONFIG.read_text())["kernels"]
    rows = _records(page.tables["verdicts"])
    files = sorted((workflow_run / "results/detect").glob("*/*/*.json"))
    # One row per result, in the order of model, vendor, kernel (stable from run to run).
    assert [(r["model"], r["vendor"], r["kernel"]) for r in rows] == \
        [tuple(f.relative_to(workflow_run / "results/detect").with_suffix("").parts) for f in files]
    for row in rows:
        result = json.loads((workflow_run / "results/detect" / row["model"] / row["vendor"] / f"{row['kernel']}.json").read_text())
        untested = result.get("evidence", {}).get("applicable") is False
        assert row["verdict"] == ("not_applicable" if untested else result["verdict"]), row
        assert row["error model"] == result["error_model"], row
        assert row["confidence"] == f"{result['confidence']:.3f}", row
        assert row["injected"] == (kernels[row["kernel"]].get("error") or ""), row
    # The faulty test kernel is a red fail of the error it injects (lane:4 reads as periodic_lane).
    assert {(r["kernel"], r["verdict"], r["error model"]) for r in rows if r["injected"]} == \
        {("lane_fc", "fail", "periodic_lane")}


@pytest.mark.xdist_group("workflow")
def test_every_run_and_drill_cell_is_its_result_file(workflow_run):
    """Candidate, RFI and SDC rows: each cell the JSON's value (nested detail aside), none left out."""
    page = _read(workflow_run / REPORT / "index.html")
    for table, pattern, keys in (("candidate", "candidate/*/*/*/outcome.json", ("model", "vendor", "kernel")),
                                 ("rfi", "rfi/*/*/*/*/outcome.json", ("model", "vendor", "kernel", "case")),
                                 ("sdc", "sdc/*/*.json", ("model", "drill"))):
        rows = _records(page.tables[table])
        files = sorted((workflow_run / "results").glob(pattern))
        assert len(rows) == len(files) > 0, table
        for row in rows:
            path = workflow_run / "results" / pattern.replace("*", "{}").format(*(row[k] for k in keys))
            result = json.loads(path.read_text())
            scalars = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
            assert set(scalars) <= set(row), (path, set(scalars) - set(row))
            for key, value in scalars.items():
                assert row[key] == _shown(value), (path, key)


@pytest.mark.xdist_group("workflow")
def test_golden_rows_are_the_last_validation_point_and_links_resolve(workflow_run):
    out = workflow_run / REPORT
    page = _read(out / "index.html")
    for row in _records(page.tables["golden"]):
        metrics = pd.read_csv(workflow_run / "results/golden" / row["model"] / row["vendor"] / "metrics.csv")
        last = metrics[metrics.split == "val"].iloc[-1]
        assert row["epochs"] == str(metrics.epoch.max()) and row["steps"] == str((metrics.split == "train").sum())
        assert [row["val_loss"], row["val_accuracy"], row["val_perplexity"]] == \
            [_shown(float(last[c])) for c in ("loss", "accuracy", "perplexity")], row
    assert page.hrefs and all(h[1:] in page.ids if h.startswith("#") else (out / h).is_file() for h in page.hrefs)


def test_a_benchmark_median_just_past_its_goal_does_not_read_as_the_goal(tmp_path):
    """A median of 1.10004 against "<= 1.10" showed "1.1" beside met False (and 1200.4 s against
    "< 1200 s" showed "1200"): as many digits as it takes to see that it misses; others stay at 4."""
    bench = tmp_path / "reports/benchmarks/results.json"
    bench.parent.mkdir(parents=True)
    entry = {"measured_as": "a / b", "unit": "ratio", "repeats": 5, "goal_op": "<="}
    bench.write_text(json.dumps({"machine": {}, "benchmarks": [
        {**entry, "name": "profiler_overhead", "median": 1.10004, "goal": "<= 1.10", "goal_value": 1.1, "met": False},
        {**entry, "name": "end_to_end", "median": 1200.4, "goal": "< 20 minutes (1200 s)", "goal_value": 1200.0,
         "met": False, "unit": "seconds"},
        {**entry, "name": "sdc_checks", "median": 1.0123456, "goal": "<= 1.02", "goal_value": 1.02, "met": True},
        {**entry, "name": "context_storage", "median": 0.02, "goal": "<= 0.02", "goal_value": 0.02, "met": True},
        {**entry, "name": "incremental_rerun", "median": None, "goal": "<= 0.25", "goal_value": 0.25, "met": False,
         "error": "failed"}]}))
    build([bench], tmp_path / "out", name="t", models=["m"], vendors=["cpu"])
    rows = _records(_read(tmp_path / "out/index.html").tables["benchmarks"])
    assert [(r["benchmark"], r["median"], r["met"]) for r in rows] == [
        ("profiler_overhead", "1.10004", "False"), ("end_to_end", "1200.4", "False"),
        ("sdc_checks", "1.012", "True"), ("context_storage", "0.02", "True"), ("incremental_rerun", "", "False")]
    # The CSV keeps the measured numbers as they are.
    assert pd.read_csv(tmp_path / "out/benchmarks.csv")["median"].tolist()[:2] == [1.10004, 1200.4]
