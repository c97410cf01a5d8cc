# Checkpoint alteration study (issue 5): flip bits in golden checkpoints over a grid of
# location class x bit region x flips x seeds, resume training, compare with golden.
import peat.alter
import peat.alter_study

ALTER = config["alter"]
try:
    peat.alter_study.check_config(config)
except PeatError as err:
    sys.exit(f"peat: {err}")


wildcard_constraints:
    epoch=r"\d+",
    cls="|".join(peat.alter.CLASSES),


def alter_path(model, vendor, name):
    return f"results/alter/{model}/{vendor}/{name}"


rule alter_cells:
    input:
        checkpoints=golden("{model}", "{vendor}", "checkpoints"),
        metrics=golden("{model}", "{vendor}", "metrics.csv"),
        data=dataset_file,
    output:
        table=alter_path("{model}", "{vendor}", "cells/epoch{epoch}/{cls}.csv"),
        logs=directory(
            alter_path("{model}", "{vendor}", "cells/epoch{epoch}/{cls}_injections")
        ),
    log:
        "logs/alter/{model}/{vendor}/epoch{epoch}_{cls}.log",
    threads: config["threads"]
    resources:
        slurm_partition=slurm_partition,
        gres=slurm_gres,
        gpu_jobs=gpu_jobs,
    params:
        spec=lambda w: config["models"][w.model],
        regions=ALTER["regions"],
        flips=ALTER["flips"],
        seeds=ALTER["seeds"],
        tolerance=ALTER["tolerance"],
        seed=config["seed"],
        config_hash=lambda w: model_hash(w.model),
    script:
        "../scripts/alter_cells.py"


def alter_cell_tables(wildcards):
    return expand(
        alter_path(wildcards.model, wildcards.vendor, "cells/epoch{epoch}/{cls}.csv"),
        epoch=ALTER["epochs"],
        cls=ALTER["classes"],
    )


rule alter_summary:
    input:
        alter_cell_tables,
    output:
        sensitivity=report(
            alter_path("{model}", "{vendor}", "sensitivity.csv"),
            caption="../report/alter_sensitivity.rst",
            category="Checkpoint alteration",
            subcategory="{model}",
        ),
        absorbed=report(
            alter_path("{model}", "{vendor}", "absorbed.csv"),
            caption="../report/alter_absorbed.rst",
            category="Checkpoint alteration",
            subcategory="{model}",
        ),
        heatmap=report(
            alter_path("{model}", "{vendor}", "heatmap.png"),
            caption="../report/alter_heatmap.rst",
            category="Checkpoint alteration",
            subcategory="{model}",
        ),
    log:
        "logs/alter/{model}/{vendor}/summary.log",
    resources:
        slurm_partition=CPU_PARTITION,
    params:
        max_loss_pct=ALTER["absorbed_loss_pct"],
    script:
        "../scripts/alter_summary.py"


def alter_targets():
    return expand(
        alter_path("{model}", "{vendor}", "{name}"),
        model=ALTER["models"],
        vendor=VENDORS,
        name=["sensitivity.csv", "absorbed.csv", "heatmap.png"],
    )
