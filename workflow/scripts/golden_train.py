import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.device import job_threads
from peat.train import stop_if_diverged, train_model

train_model(
    snakemake.wildcards.model,
    snakemake.params.spec,
    snakemake.input.data,
    snakemake.output.checkpoints.rsplit("/", 1)[0],
    vendor=snakemake.wildcards.vendor,
    seed=snakemake.params.seed,
    threads=job_threads(snakemake),
    init=snakemake.input.init[0] if snakemake.input.init else None,
    config_hash=snakemake.params.config_hash,
    on_row=stop_if_diverged(snakemake.wildcards.model),
)
