import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from peat.sdc_drill import launch

launch(snakemake.params.config, snakemake.wildcards.model, snakemake.input.data,
       snakemake.output.events.rsplit("/", 1)[0])
