# Helpers shared by all stages (config validation, paths, inputs and target lists), so that
# the stage files (data, golden, kernels, ...) hold only rules.
import os
import re
import sys

# This checkout's peat, as its jobs import it (PYTHONPATH below): a peat installed from another
# checkout (a shared venv, a second worktree) checked the config and tracked its own kernel sources.
sys.path.insert(0, os.path.join(workflow.basedir, "src"))

import peat.alter
import peat.alter_study
import peat.config
import peat.device
import peat.report
import peat.slurm
from peat.candidate import check as check_kernels, models_for, rfi_cases
from peat.config import check_is_config, check_unique_keys, config_hash, validate
from peat.data import local_files
from peat.io import PeatError
from peat.kernels import source_files
from peat.sdc_drill import check_config as check_sdc, drill_config

# Jobs import peat from this checkout, also inside a --use-conda environment (envs/peat.yaml).
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        p for p in (os.path.join(workflow.basedir, "src"), os.getenv("PYTHONPATH")) if p
    )
)

# Every config problem stops the workflow here, before any job, with one line naming the key.
SCHEMA = os.path.join(workflow.basedir, "workflow/schemas/config.schema.yaml")
try:
    for path in workflow.configfiles:
        check_is_config(path, SCHEMA)
        check_unique_keys(path)
    validate(config, SCHEMA)
    check_kernels(config)
    peat.alter_study.check_config(config)
    check_sdc(config)
except PeatError as err:
    sys.exit(f"peat: {err}")


def _sorted_keys(value):
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


# Snakemake compares params as text: without one key order, a reordered or reformatted config
# (or a default written out) would rerun every job, golden training included. The order of the
# models, datasets and kernels themselves is kept: it is the order of the report.
for section, value in config.items():
    if section in ("datasets", "models", "kernels"):
        config[section] = {name: _sorted_keys(spec) for name, spec in value.items()}
    elif isinstance(value, dict):
        config[section] = _sorted_keys(value)

MODELS = list(config["models"])
VENDORS = config["vendors"]
KERNELS = config["kernels"]
RFI = config["rfi"]
PLAYBACK = config["playback"]
DETECT = config["detect"]
ALTER = config["alter"]
REPORT_DIR = f"reports/{config['name']}"
# The figures' RST captions (Snakemake's report and the collated page quote them).
CAPTIONS = os.path.join(workflow.basedir, "workflow/report")
REPORT_TABLES = list(peat.report.TABLES)
BENCHMARKS = "reports/benchmarks"
ANALYZE_FIGURES = {
    "score_vs_iteration.png": "playback_score_vs_iteration.rst",
    "distributions.png": "playback_distributions.rst",
    "heatmap.png": "playback_heatmap.rst",
    "bits.png": "playback_bits.rst",
    "spatial.png": "playback_spatial.rst",
}


# Model and dataset names are the user's: escaped, a name such as "gpt2+ln" matches itself.
wildcard_constraints:
    model="|".join(map(re.escape, MODELS)),
    vendor="|".join(VENDORS),
    dataset="|".join(map(re.escape, config["datasets"])),
    kernel="|".join(KERNELS) or "no-kernel-configured",
    case=r"f[0-9.]+(e-[0-9]+)?|every[0-9]+",  # rfi_cases: f{fraction:g} is 5e-05 below 1e-4
    epoch=r"\d+",
    cls="|".join(peat.alter.CLASSES),


# --- Paths of each stage's outputs.
def golden(model, vendor, name):
    return f"results/golden/{model}/{vendor}/{name}"


def candidate(model, vendor, kernel, name):
    return f"results/candidate/{model}/{vendor}/{kernel}/{name}"


def rfi_path(model, vendor, kernel, case, name):
    return f"results/rfi/{model}/{vendor}/{kernel}/{case}/{name}"


def playback_path(model, vendor, kernel, ext):
    return f"results/playback/{model}/{vendor}/{kernel}.{ext}"


def analyze_path(model, vendor, kernel, name):
    return f"results/analyze/{model}/{vendor}/{kernel}/{name}"


def alter_path(model, vendor, name):
    return f"results/alter/{model}/{vendor}/{name}"


# --- Inputs and parameters computed from wildcards.
def dataset_file(wildcards):
    return f"results/data/{config['models'][wildcards.model]['dataset']}.h5"


def dataset_sources(wildcards):
    return local_files(wildcards.dataset, config["datasets"][wildcards.dataset])


def init_checkpoint(wildcards):
    base = config["models"][wildcards.model].get("init_from")
    return [golden(base, wildcards.vendor, "final.h5")] if base else []


def model_hash(model):
    return peat.config.model_hash(config, model)


def kernel_sources(wildcards):
    # A kernel's source files are inputs of every job that uses it: editing one reruns only
    # that kernel's jobs, never data prep or golden training.
    return source_files(KERNELS[wildcards.kernel]["impl"])


def kernel_spec(kernel, other_stage):
    # Only the keys a stage reads are its params: a playback timeout reran the candidate
    # training (a whole training), train: true reran the playback. models and train only
    # choose which jobs exist; other_stage is the other stage's own setting; seed and
    # computation place the injected error, and a kernel without one reads neither.
    spec = KERNELS[kernel]
    unread = {"models", "train", other_stage}
    if spec.get("error") is None:
        unread |= {"seed", "computation"}
    return without(spec, unread)


def playback_settings():
    # propagate_samples reran every playback where nothing propagates.
    return without(PLAYBACK, () if PLAYBACK["propagate"] else ("propagate_samples",))


def without(settings, unread):
    # A job's params are the settings it reads: any other reran it when edited.
    return {key: value for key, value in settings.items() if key not in unread}


def kernel_hash(wildcards):
    return config_hash(
        {
            "model": model_hash(wildcards.model),
            "kernel": kernel_spec(wildcards.kernel, "timeout"),
        }
    )


def detect_rules(*unread):
    # The Detector settings a stage reads: benchmark_seeds (the on-demand benchmark's) reran
    # every playback and detection, accept_reduced_precision (the verdict's) every playback.
    return without(DETECT, ("benchmark_seeds", *unread))


def routed_inputs():
    """Inputs of a training with a kernel routed in (candidate training and runtime FI)."""
    return {
        "data": dataset_file,
        "init": init_checkpoint,
        "golden_metrics": golden("{model}", "{vendor}", "metrics.csv"),
        "context": golden("{model}", "{vendor}", "context.h5"),
        "kernel": kernel_sources,
    }


def routed_params():
    return {
        "spec": lambda w: config["models"][w.model],
        "kernel": lambda w: kernel_spec(w.kernel, "timeout"),
        "seed": config["seed"],
        "config_hash": kernel_hash,
    }


def reference_context(wildcards):
    # Playback replays the reference vendor's recording (cross-vendor validation).
    return golden(wildcards.model, config["reference_vendor"], "context.h5")


def propagation_inputs(wildcards):
    # The later observing points rebuild the model at the step: data, initial weights, checkpoints.
    if not PLAYBACK["propagate"]:
        return {}
    ref = config["reference_vendor"]
    base = config["models"][wildcards.model].get("init_from")
    return {
        "data": dataset_file(wildcards),
        "checkpoints": golden(wildcards.model, ref, "checkpoints"),
        "init": [golden(base, ref, "final.h5")] if base else [],
    }


def alter_cell_tables(wildcards):
    return expand(
        alter_path(wildcards.model, wildcards.vendor, "cells/epoch{epoch}/{cls}.csv"),
        epoch=ALTER["epochs"],
        cls=ALTER["classes"],
    )


def benchmark_files():
    # Written by `make bench`, not by this workflow: included in the report when present.
    if not os.path.isdir(BENCHMARKS):
        return []
    names = sorted(os.listdir(BENCHMARKS))
    return [
        f"{BENCHMARKS}/{n}" for n in names if n == "results.json" or n.endswith(".png")
    ]


def caption_files():
    # The collated page quotes them: as its rule's inputs, an edited caption reruns the report
    # (it reran nothing without --forcerun collate_report).
    return [
        os.path.join(CAPTIONS, n)
        for n in sorted(os.listdir(CAPTIONS))
        if n.endswith(".rst")
    ]


# --- Where jobs go on SLURM (issue 7): vendor -> partition and GPU request, from the config's
# slurm section. Jobs of a vendor take VENDOR_RESOURCES; CPU-only stages, with or without
# a {vendor} wildcard (plots, tables, drills), take CPU_RESOURCES.
def _job_vendor(wildcards):
    return getattr(wildcards, "vendor", None)


def slurm_partition(wildcards):
    return peat.slurm.resources(config, _job_vendor(wildcards))["slurm_partition"]


def slurm_gres(wildcards):
    return peat.slurm.resources(config, _job_vendor(wildcards))["gres"]


def gpu_jobs(wildcards):
    # 1 for a GPU vendor's job: the workstation profile caps these at one at a time.
    return int(_job_vendor(wildcards) in peat.slurm.GPU_VENDORS)


VENDOR_RESOURCES = {
    "slurm_partition": slurm_partition,
    "gres": slurm_gres,
    "gpu_jobs": gpu_jobs,
}
CPU_RESOURCES = {
    "slurm_partition": peat.slurm.resources(config, None)["slurm_partition"],
    "gres": "",
    "gpu_jobs": 0,
}


onstart:
    # A job granted fewer CPUs than the config's threads stops (device.job_threads): here, before
    # any. --touch runs none.
    try:
        if not workflow.touch:
            peat.device.check_granted(
                workflow.dag.needrun_jobs(), config["threads"]
            )
    except PeatError as err:
        sys.exit(f"peat: {err}")
    # Before the first sbatch: a partition the cluster lacks, or a request no node meets, fails here.
    if workflow.executor_plugin.name == "slurm":
        try:
            peat.slurm.preflight(
                config,
                workflow.dag.needrun_jobs(),
                workflow.resource_settings.default_resources.args,
            )
        except PeatError as err:
            sys.exit(f"peat: {err}")
    # Jobs run here: without this, a GPU vendor's jobs failed only after the jobs before them had run.
    elif workflow.executor_plugin.name == "local":
        try:
            for vendor in sorted(
                {
                    job.wildcards.vendor
                    for job in workflow.dag.needrun_jobs()
                    if job.resources.get("gpu_jobs")
                }
            ):
                peat.device.for_vendor(vendor)
        except PeatError as err:
            sys.exit(f"peat: config key 'vendors': {err}")


# --- Targets of each stage; `all` and the report take their union. Intermediate outputs that
# feed a summary (playback tables, alteration cells) are targets too: Snakemake does not redo a
# missing intermediate whose consumers are up to date, so a playback that failed or was killed
# after a kernel edit left the old kernel's verdict in the report, and the next run succeeded.
def golden_targets():
    return expand(
        golden("{model}", "{vendor}", "{name}"),
        model=MODELS,
        vendor=VENDORS,
        name=["metrics.csv", "context.h5"],
    )


def candidate_targets():
    return [
        candidate(model, vendor, kernel, name)
        for kernel, spec in KERNELS.items()
        if spec["train"]
        for model in models_for(config, kernel)
        for vendor in VENDORS
        for name in ("outcome.json", "compare.csv")
    ]


def rfi_targets():
    return [
        rfi_path(model, vendor, kernel, case, name)
        for kernel in RFI["kernels"]
        for model in models_for(config, kernel)
        if not RFI["models"] or model in RFI["models"]
        for vendor in VENDORS
        for case in rfi_cases(RFI)
        for name in ("outcome.json", "compare.csv", "calls.csv")
    ]


def kernel_targets():
    return candidate_targets() + rfi_targets()


def playback_targets():
    return [
        path
        for kernel in KERNELS
        for model in models_for(config, kernel)
        for vendor in VENDORS
        for path in [
            playback_path(model, vendor, kernel, "parquet"),
            playback_path(model, vendor, kernel, "json"),
            f"results/detect/{model}/{vendor}/{kernel}.json",
            *[
                analyze_path(model, vendor, kernel, name)
                for name in ["layers.csv", "summary.json", *ANALYZE_FIGURES]
            ],
        ]
    ]


def alter_targets():
    return expand(
        alter_path("{model}", "{vendor}", "{name}"),
        model=ALTER["models"],
        vendor=VENDORS,
        name=[
            "sensitivity.csv",
            "absorbed.csv",
            "heatmap.png",
            *expand(
                "cells/epoch{epoch}/{cls}.csv",
                epoch=ALTER["epochs"],
                cls=ALTER["classes"],
            ),
        ],
    )


def sdc_targets():
    return expand(
        "results/sdc/{model}/{drill}.json",
        model=config["sdc"]["models"],
        drill=config["sdc"]["drills"],
    )


def curve_targets():
    return expand(
        golden("{model}", "{vendor}", "training_curves.png"),
        model=MODELS,
        vendor=VENDORS,
    )


def report_targets():
    return [f"{REPORT_DIR}/index.html"]


def final_targets():
    return (
        golden_targets()
        + kernel_targets()
        + playback_targets()
        + alter_targets()
        + sdc_targets()
        + report_targets()
    )
