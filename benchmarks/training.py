"""Training-side benchmarks: Profiler overhead, context storage, kernel-interface overhead.

All three train the default config's ResNet-18 on its dataset for a fixed number of steps
(one epoch over a prefix of the training set), the same way the golden rule does
(``peat.train.train_model``), and compare two variants of that training in the same run.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness import Goal, Result, clock, clock_note, paired, paired_details, ratios

from peat import data, kernels
from peat.config import validate
from peat.models import layer_ops
from peat.profiler import match_layers, match_names, op_of
from peat.train import train_model

REPO = Path(__file__).resolve().parents[1]
MODEL = "resnet18"


@dataclass
class Case:
    """One model of the default config, trained for ``steps`` steps in ``workdir``."""

    name: str
    spec: dict
    data: Path
    workdir: Path
    vendor: str = "cpu"

    def train(self, tag: str, **kwargs) -> Path:
        out = self.workdir / tag
        shutil.rmtree(out, ignore_errors=True)
        train_model(self.name, self.spec, self.data, out, vendor=self.vendor, progress=False, **kwargs)
        return out


def default_config() -> dict:
    """config/config.yaml, validated, with the schema's defaults filled in (as the workflow sees it)."""
    path = REPO / "config" / "config.yaml"
    return validate(yaml.safe_load(path.read_text()), REPO / "workflow" / "schemas" / "config.schema.yaml")


def dataset(settings, config: dict, model: str) -> Path:
    """The prepared dataset of ``model`` (prepared once per benchmark session)."""
    name = config["models"][model]["dataset"]
    path = settings.workdir / "data" / f"{name}.h5"
    if not path.exists():
        data.prepare(name, config["datasets"][name], path)
    return path


def case(settings, model: str = MODEL) -> Case:
    """The default config's ``model``, cut to one epoch of a few steps (quick: 2 steps, else 20)."""
    config = default_config()
    spec = config["models"][model]
    steps = 2 if settings.quick else 20
    spec = dict(spec, epochs=1, checkpoint_epochs=[], max_train_samples=steps * spec["batch_size"],
                max_val_samples=spec["batch_size"])
    return Case(model, recording(spec, settings), dataset(settings, config, model), settings.workdir / "train",
                settings.vendor)


def recording(spec: dict, settings) -> dict:
    """``spec`` recording the --record-layers globs instead of its own layers, when they are given."""
    if not settings.record_layers:
        return spec
    return dict(spec, record=dict(spec["record"], layers=list(settings.record_layers)))


def check_record_layers(globs: list[str]) -> None:
    """Each --record-layers glob against ``MODEL``'s recordable layers, by the Profiler's own matcher,
    before anything runs: one matching none failed only once the recorded trainings began, minutes in."""
    spec = default_config()["models"][MODEL]
    match_names(list(layer_ops(spec)), globs, "--record-layers", where=f" of model {MODEL!r}")


def record_spec(settings, c: Case) -> str:
    """What the recorded trainings record, saying so when --record-layers overrides the default."""
    rec = c.spec["record"]
    which = f"override --record-layers {' '.join(rec['layers'])}" if settings.record_layers else "default config spec"
    return f"{len(rec['layers'])} layers every {rec.get('every', 10)} steps ({which})"


def derived_note(c: Case) -> str:
    """Whether the recorded trainings also store the golden outputs (record.derived)."""
    stored = c.spec["record"].get("derived", False)
    return ", golden outputs O/dA/dW/dB " + ("stored" if stored else "not stored (derived on read)")


def profiler_overhead(settings) -> Result:
    c = case(settings)
    result = Result("profiler_overhead",
                    f"{MODEL} golden training ({c.spec['max_train_samples'] // c.spec['batch_size']} steps), "
                    f"Profiler recording {record_spec(settings, c)}{derived_note(c)} "
                    f"(+ summaries of every layer every step) / the same training without recording; {clock_note(settings.vendor)}",
                    Goal("<=", 1.10, "<= 1.10"))
    with_rec, without = paired(lambda: c.train("recorded", record=True), lambda: c.train("plain", record=False),
                               settings.repeats)
    result.samples = ratios(clock(with_rec, settings.vendor), clock(without, settings.vendor))
    result.details = paired_details(with_rec, without, ("recorded", "plain"))
    settings.storage_files.append(c.workdir / "recorded" / "storage.json")
    return result


def context_storage(settings) -> Result:
    """Bytes of context / a naive dump, one sample per golden run: the runs of a full workflow run
    when one is available (end_to_end or ``--results``), else the recorded runs of profiler_overhead."""
    found = sorted(Path(settings.results).glob("golden/*/*/storage.json")) if settings.results else []
    if found:
        source = f"golden runs of the default workflow in {settings.results}"
        files = {"/".join(f.parts[-3:-1]): f for f in found}
    else:
        if not settings.storage_files:
            c = case(settings)
            c.train("recorded", record=True)
            settings.storage_files.append(c.workdir / "recorded" / "storage.json")
        c = case(settings)
        source = (f"{MODEL} truncated to {c.spec['max_train_samples']} samples, "
                  f"recording {record_spec(settings, c)}{derived_note(c)}")
        files = {MODEL: settings.storage_files[-1]}
    rows = {k: json.loads(f.read_text()) for k, f in files.items()}
    return Result("context_storage",
                  "bytes of the recorded context.h5 / bytes of a naive float32 dump of every layer's A, W and dO "
                  f"at every step (one sample per golden run: {source})",
                  Goal("<=", 0.02, "<= 0.02"), samples=[r["ratio"] for r in rows.values()],
                  details={k: {x: r[x] for x in ("context_bytes", "naive_bytes", "steps", "every")}
                           for k, r in rows.items()})


def route_everything(model) -> list[str]:
    """Route every layer the kernel interface supports through its op's golden kernel."""
    ops = sorted({op_of(m) for m in match_layers(model, ["*"]).values()})
    return [name for op in ops for name in kernels.route(model, kernels.golden(op))]


def kernel_interface_overhead(settings) -> Result:
    c = case(settings)
    routed = []
    result = Result("kernel_interface_overhead",
                    f"{MODEL} training with every conv2d, batch_norm and linear layer routed through the kernel "
                    f"interface (peat.kernels.route with the golden kernels) / plain training, same steps, no recording; {clock_note(settings.vendor)}",
                    Goal("<=", 1.05, "<= 1.05"))
    routed_s, plain_s = paired(lambda: c.train("routed", record=False, prepare_model=lambda m: routed.append(
        route_everything(m))), lambda: c.train("plain", record=False), settings.repeats)
    result.samples = ratios(clock(routed_s, settings.vendor), clock(plain_s, settings.vendor))
    result.details = paired_details(routed_s, plain_s, ("routed", "plain")) | {"routed_layers": len(routed[-1])}
    return result
