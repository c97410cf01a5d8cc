import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

import os
import runpy

# benchmarks/run.py is a script (not part of the peat package): run it as one.
sys.argv = [snakemake.params.runner, "--out", os.path.dirname(snakemake.output[0])]
sys.argv += ["--quick"] if snakemake.params.quick else []
runpy.run_path(snakemake.params.runner, run_name="__main__")
