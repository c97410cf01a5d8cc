import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.device import job_threads
from peat.alter_study import run_cells

w = snakemake.wildcards
run_cells(
    w.model,
    snakemake.params.spec,
    w.vendor,
    int(w.epoch),
    w.cls,
    snakemake.params.regions,
    snakemake.params.flips,
    snakemake.params.seeds,
    checkpoints=snakemake.input.checkpoints,
    data=snakemake.input.data,
    golden_metrics=snakemake.input.metrics,
    run_seed=snakemake.params.seed,
    threads=job_threads(snakemake),
    config_hash=snakemake.params.config_hash,
    out_csv=snakemake.output.table,
    log_dir=snakemake.output.logs,
)
