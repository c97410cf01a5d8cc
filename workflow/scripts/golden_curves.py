import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.report import training_curves

w = snakemake.wildcards
training_curves(snakemake.input[0], snakemake.output[0], title=f"golden training of {w.model} ({w.vendor})", dpi=snakemake.params.dpi)
