"""Benchmarks that time the stages through their own code: playback, SDC checks, alteration."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

from harness import Goal, Result, clock, clock_note, paired, paired_details, ratios
from training import MODEL, Case, case, dataset, default_config, record_spec, recording

from peat import candidate, errors, kernels, playback
from peat.profiler import recorded_steps

# The paper's pseudo-errors, used when the default config lists none.
PAPER_ERRORS = ["fp16", "rv:3", "rz:1"]
OP = "conv2d"  # the op of the campaign: conv/GEMM kernels are what the paper validates first


# -- playback -------------------------------------------------------------------------------------
def campaign_kernel(config: dict) -> tuple[str, dict]:
    """The default config's first kernel for ``OP`` on ``MODEL`` (name, spec); golden if it has none."""
    for name, spec in (config.get("kernels") or {}).items():
        if spec.get("op") == OP and MODEL in spec.get("models", [MODEL]) and not spec.get("error"):
            return name, spec
    return "golden", {"op": OP, "impl": "golden"}


def configured_case(settings) -> Case:
    """``MODEL`` trained as the default config defines it (every epoch and sample, its
    checkpoints and validation): the golden run whose context the workflow replays, and what
    one runtime-FI training costs. --quick cuts it to the 2-step case to keep the smoke run short."""
    if settings.quick:
        return case(settings)
    config = default_config()
    spec = recording(config["models"][MODEL], settings)
    return Case(MODEL, spec, dataset(settings, config, MODEL), settings.workdir / "train", settings.vendor)


def training_text(c: Case, steps: int, quick: bool) -> str:
    cut = "truncated to one epoch (--quick)" if quick else "as the default config defines it"
    return (f"{MODEL} {cut}: {c.spec['epochs']} epochs, {steps} steps of batch {c.spec['batch_size']}, "
            f"validation and checkpoints {c.spec.get('checkpoint_epochs', [])} included")


def playback_runs(settings) -> dict:
    """Campaigns interleaved with runtime-FI trainings; shared by both playback benchmarks."""
    if "playback" in settings.cache:
        return settings.cache["playback"]
    config = default_config()
    c = configured_case(settings)
    golden_dir = c.train("golden", record=True)
    context = golden_dir / "context.h5"
    name, kspec = campaign_kernel(config)
    specs = list(config.get("errors") or PAPER_ERRORS)
    layers = candidate.target_layers(kspec, context)
    sidecars, steps = [], []

    def campaign(propagate: bool = bool(config["playback"].get("propagate"))):
        # Exactly the workflow's playback job (peat.playback.run_job), with the default config's
        # playback, detect and error settings, on the context of the configured golden training.
        out = settings.workdir / "playback"
        later = {"spec": c.spec, "data": c.data, "checkpoints": golden_dir / "checkpoints", "init": None,
                 "seed": config["seed"]}
        playback.run_job(MODEL, settings.vendor, name, kspec, context, out / "table.parquet", out / "record.json",
                         errors_=specs, settings=config["playback"], rules=config["detect"], seed=config["seed"],
                         threads=1, propagate_from=later if propagate else None)
        sidecars.append(json.loads((out / "record.json").read_text()))

    def runtime_fi():
        # One runtime-FI case: the configured training with the first error model injected into
        # the forward computation of the first of those layers, for the whole run.
        faulty = errors.faulty(candidate.build(name, kspec), specs[0], "forward", seed=0)
        out = c.train("rfi", record=False, prepare_model=lambda m: kernels.route(m, faulty, [layers[0]]))
        steps.append(int((pd.read_csv(out / "metrics.csv")["split"] == "train").sum()))

    campaign_s, training_s = paired(campaign, runtime_fi, settings.repeats)
    timings = [s["timings"] for s in sidecars[-settings.repeats:]]  # the warm-up dropped
    for _ in range(settings.repeats):  # the same campaign without the later observing points, for its split
        campaign(propagate=False)
    at_output = [s["timings"] for s in sidecars[-settings.repeats:]]
    recorded = len(recorded_steps(context, layers[0]))
    runs = {"campaign": campaign_s, "rfi_training": training_s, "cases": len(specs) * len(layers),
            "errors": specs, "layers": layers, "kernel": name, "playback_settings": config["playback"],
            "recorded_steps_per_layer": recorded,
            "replayed_steps_per_layer": min(recorded, config["playback"].get("max_samples_per_layer") or recorded),
            "training": training_text(c, steps[-1], settings.quick), "training_steps": steps[-1],
            "epochs": c.spec["epochs"], "record": record_spec(settings, c),
            "timings": timings, "output_only_timings": at_output}
    settings.cache["playback"] = runs
    return runs


def playback_vs_retraining(settings) -> Result:
    r = playback_runs(settings)
    replaced = [t * r["cases"] for t in clock(r["rfi_training"], settings.vendor)]
    return Result("playback_vs_retraining",
                  f"one playback campaign as the workflow's playback job runs it (peat.playback.run_job: kernel "
                  f"{r['kernel']}, {len(r['layers'])} recorded {OP} layers of {MODEL}, the default config's errors "
                  f"{', '.join(r['errors'])} and playback settings {r['playback_settings']}: "
                  f"{r['replayed_steps_per_layer']} of {r['recorded_steps_per_layer']} recorded steps per layer; "
                  f"context of the golden training of {r['training']}, recording {r['record']}) / the runtime-FI "
                  f"trainings it replaces: one training of {r['training']}, with the first error model routed into "
                  f"the forward of the first layer, measured in every repeat next to the campaign, x {r['cases']} "
                  f"error-model x layer cases; {clock_note(settings.vendor)}",
                  Goal("<=", 0.01, "<= 0.01"), samples=ratios(clock(r["campaign"], settings.vendor), replaced),
                  details=paired_details(r["campaign"], r["rfi_training"], ("campaign", "rfi_training"), r["cases"])
                  | {k: r[k] for k in ("kernel", "cases", "errors", "layers", "playback_settings",
                                       "recorded_steps_per_layer", "replayed_steps_per_layer", "training",
                                       "training_steps", "epochs")})


def playback_efficiency(settings) -> Result:
    r = playback_runs(settings)
    return Result("playback_efficiency",
                  "time inside kernel calls (kernel under test, faulty variants, golden, fp64 and reduced-precision "
                  "references, at the kernel's output and on the propagated input of the later observing points) / "
                  "wall time of the playback campaign (reading the context, scoring, rebuilding the network and its "
                  "forwards for the later observing points included); the campaign of playback_vs_retraining",
                  Goal(">=", 0.5, ">= 0.5"), samples=[t["kernel_s"] / t["wall_s"] for t in r["timings"]],
                  # The concern in its own words: reading the context and scoring must not dominate.
                  details={"timings": r["timings"], "reading_and_scoring_over_kernel": [
                      (t.get("io_s", 0.0) + t.get("score_s", 0.0)) / t["kernel_s"] for t in r["timings"]],
                      # The kernel calls plus the network's own forward passes to the later observing points.
                      "compute_fraction": [t["compute_fraction"] for t in r["timings"]],
                      # The same campaign observed at the kernel's output alone (playback.propagate: false).
                      "output_only_kernel_fraction": [t["kernel_fraction"] for t in r["output_only_timings"]],
                      "output_only_timings": r["output_only_timings"]})


# -- SDC checks -----------------------------------------------------------------------------------
def sdc_checks(settings) -> Result:
    """The SDC stage's own benchmark (peat.sdc_drill --bench, one local process per rank), once per repeat.

    Each launch interleaves plain DDP steps with guarded ones (non-finite check + weight
    fingerprint; audit steps excluded) on twin models fed the same batches.
    """
    from peat import sdc_drill

    config = default_config()
    cfg = config["sdc"]
    model = cfg["models"][0]
    if settings.quick:
        cfg["bench_steps"] = 4
    data = dataset(settings, config, model)
    benches = []
    for i in range(settings.repeats):
        out = settings.workdir / "sdc" / str(i)
        sdc_drill.launch(config, model, data, out, bench=True)
        benches.append(json.loads((out / "bench.json").read_text()))
    return Result("sdc_checks",
                  f"median guarded DDP step (non-finite gradient check + weight fingerprint) / median plain DDP step, "
                  f"{model}, world size {cfg['world_size']} ({cfg.get('backend')}), {benches[0]['steps']} steps per launch, "
                  "both timed in the same non-audit steps (every other), alternating which goes first; one sample "
                  "per torchrun launch (wall time; details.cpu_ratios: the same "
                  "in rank 0's CPU time, less sensitive to other load)",
                  Goal("<=", 1.02, "<= 1.02"), samples=[b["ratio"] for b in benches],
                  details={"cpu_ratios": [b["cpu_ratio"] for b in benches], "launches": benches})


# -- checkpoint alteration ---------------------------------------------------------------------
def synthetic_checkpoint(path: Path, mb: float) -> Path:
    """A peat checkpoint of about ``mb`` MB: a stack of linear layers with SGD momentum state."""
    from torch import nn

    from peat import checkpoint

    width = 512
    # weights + momentum: 2 float32 copies of each parameter
    layers = max(1, round(mb * 2**20 / (2 * 4 * (width * width + width))))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    checkpoint.save(path, model, optimizer, step=1, epoch=1, meta={"model": "bench"}, history=[])
    return path


def alteration_sweep(settings) -> list[dict]:
    from peat import alter

    sizes = [4, 40] if settings.quick else [4, 40, 200]
    counts = [10**3, 10**5] if settings.quick else [10**3, 10**4, 10**5, 10**6]
    rows = []
    for mb in sizes:
        src = synthetic_checkpoint(settings.workdir / "alter" / f"ckpt{mb}.h5", mb)
        real_mb = src.stat().st_size / 2**20
        for flips in counts:
            for repeat in range(settings.repeats):
                dst = settings.workdir / "alter" / "out.h5"
                res = alter.alter(src, dst, alter.Plan(count=flips, seed=repeat))
                beyond = res.timings["total"] - res.timings["copy"]
                rows.append({"mb": mb, "file_mb": real_mb, "flips": flips, "done": res.flips, "repeat": repeat,
                             **{f"{k}_s": v for k, v in res.timings.items()}, "seconds_beyond_copy": beyond,
                             "flips_per_s": res.flips / beyond, "mb_per_s": real_mb / res.timings["total"]})
                dst.unlink(missing_ok=True)
        src.unlink()
    return rows


def checkpoint_alteration(settings) -> Result:
    rows = alteration_sweep(settings)
    goal = [r["seconds_beyond_copy"] for r in rows if r["mb"] == 40 and r["flips"] == 10**5]
    return Result("checkpoint_alteration",
                  "seconds beyond the file copy (select + draw + flip + rename; no injection log, which peat alter "
                  "--log adds) to flip 100,000 random bits in a 40 MB peat checkpoint, via peat.alter.alter; details.sweep: flips/s and MB/s for 10^3..10^6 flips on "
                  "4..200 MB", Goal("<=", 1.0, "100,000 flips on 40 MB in under 1 s beyond the copy"),
                  unit="seconds", samples=goal, details={"sweep": rows})
