import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.device import job_threads
from peat.candidate import train_candidate

train_candidate(
    snakemake.wildcards.model,
    snakemake.params.spec,
    snakemake.wildcards.kernel,
    snakemake.params.kernel,
    snakemake.input.data,
    snakemake.input.golden_metrics.rsplit("/", 1)[0],
    snakemake.output.outcome.rsplit("/", 1)[0],
    vendor=snakemake.wildcards.vendor,
    seed=snakemake.params.seed,
    threads=job_threads(snakemake),
    init=snakemake.input.init[0] if snakemake.input.init else None,
    config_hash=snakemake.params.config_hash,
    schedule=snakemake.wildcards.get("case"),
)
