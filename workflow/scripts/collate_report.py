import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "w")

from pathlib import Path

from peat.report import build

p = snakemake.params
build(snakemake.input, Path(snakemake.output.html).parent, name=p.name, models=p.models, vendors=p.vendors,
      title=p.title, captions=p.captions, dpi=p.dpi, injected=p.injected)
