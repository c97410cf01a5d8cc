# Helpers shared by the rule files: config validation, paths and target lists.
import os
import sys

from peat.config import config_hash, validate
from peat.io import PeatError

try:
    validate(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.yaml"))
except PeatError as err:
    sys.exit(f"peat: {err}")

MODELS = list(config["models"])
VENDORS = config["vendors"]


wildcard_constraints:
    model="|".join(MODELS),
    vendor="|".join(VENDORS),
    dataset="|".join(config["datasets"]),


def golden(model, vendor, name):
    return f"results/golden/{model}/{vendor}/{name}"


def dataset_file(wildcards):
    return f"results/data/{config['models'][wildcards.model]['dataset']}.h5"


def init_checkpoint(wildcards):
    base = config["models"][wildcards.model].get("init_from")
    return [golden(base, wildcards.vendor, "final.h5")] if base else []


def model_hash(model):
    """What a model's golden results depend on: its spec, its dataset and the seed."""
    spec = config["models"][model]
    return config_hash(
        {"model": spec, "dataset": config["datasets"][spec["dataset"]], "seed": config["seed"]}
    )


def golden_targets():
    return expand(
        golden("{model}", "{vendor}", "{name}"),
        model=MODELS,
        vendor=VENDORS,
        name=["metrics.csv", "context.h5"],
    )


def final_targets():
    # Each stage's rule file defines its *_targets(); the report depends on all of them.
    return (
        golden_targets()
        + kernel_targets()
        + playback_targets()
        + alter_targets()
        + sdc_targets()
        + report_targets()
    )


# --- SLURM (issue 7): vendor -> partition and GPU request, from the config's slurm: section.
# Every rule adds `resources: slurm_partition=slurm_partition, gres=slurm_gres, gpu_jobs=gpu_jobs`;
# a rule without a {vendor} wildcard is a CPU-only stage and goes to slurm.cpu_partition.
import peat.slurm


def _job_vendor(wildcards):
    return getattr(wildcards, "vendor", None)


def slurm_partition(wildcards):
    return peat.slurm.resources(config, _job_vendor(wildcards))["slurm_partition"]


def slurm_gres(wildcards):
    return peat.slurm.resources(config, _job_vendor(wildcards))["gres"]


# CPU-only stages that still carry a {vendor} wildcard (plots, tables) use this one.
CPU_PARTITION = peat.slurm.resources(config, None)["slurm_partition"]


def gpu_jobs(wildcards):
    # 1 for a GPU vendor's job: the workstation profile caps these at one at a time.
    return int(_job_vendor(wildcards) in peat.slurm.GPU_VENDORS)


onstart:
    # Before the first sbatch: a partition the cluster lacks fails here, with one line.
    if workflow.executor_plugin.name == "slurm":
        try:
            peat.slurm.preflight(config, workflow.dag.needrun_jobs())
        except PeatError as err:
            sys.exit(f"peat: {err}")
