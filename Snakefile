# peat: kernel validation in training, checkpoint alteration and SDC checks.
# Thin entry point: one rule file per stage; common.smk, first, validates the config.
from snakemake.utils import min_version

min_version("9.0")


# The default config, unless the user names another with --configfile: configs are
# complete descriptions of a study, so they replace the default instead of merging into it.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/golden.smk"
include: "workflow/rules/kernels.smk"
include: "workflow/rules/playback.smk"
include: "workflow/rules/alter.smk"
include: "workflow/rules/sdc.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"


rule all:
    default_target: True
    input:
        final_targets(),
