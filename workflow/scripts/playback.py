import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.device import job_threads
from peat.playback import run_job

inp, params = snakemake.input, snakemake.params
run_job(
    snakemake.wildcards.model,
    snakemake.wildcards.vendor,
    snakemake.wildcards.kernel,
    params.kernel,
    inp.context,
    snakemake.output.table,
    snakemake.output.record,
    errors_=params.errors,
    settings=params.settings,
    rules=params.rules,
    seed=params.seed,
    threads=job_threads(snakemake),
    config_hash=params.config_hash,
    propagate_from=(
        {"spec": params.spec, "data": inp.data, "checkpoints": inp.checkpoints,
         "init": inp.init[0] if inp.init else None, "seed": params.seed}
        if "data" in inp.keys() else None
    ),
)
