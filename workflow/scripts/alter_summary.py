import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.alter_study import summarize

summarize(
    list(snakemake.input),
    snakemake.output.sensitivity,
    snakemake.output.absorbed,
    snakemake.output.heatmap,
    snakemake.params.max_loss_pct,
    snakemake.params.tolerance,
    dpi=snakemake.params.dpi,
)
