import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.detect import run_job

run_job(snakemake.input.table, snakemake.input.record, snakemake.output[0], snakemake.params.rules)
