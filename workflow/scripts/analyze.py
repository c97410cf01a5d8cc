import sys
from pathlib import Path

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.analyze import run_job

run_job(snakemake.input.table, snakemake.input.context, Path(snakemake.output.layers).parent, dpi=snakemake.params.dpi,
        record=snakemake.input.record)
