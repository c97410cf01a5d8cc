import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.data import prepare

prepare(snakemake.wildcards.dataset, snakemake.params.spec, snakemake.output[0])
