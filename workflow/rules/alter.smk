# Checkpoint alteration study: flip bits in golden checkpoints over a grid of location
# class x bit region x flips x seeds, resume training, compare with golden.


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
    conda:
        "../../envs/peat.yaml"
    threads: config["threads"]
    resources:
        **VENDOR_RESOURCES,
    params:
        spec=lambda w: config["models"][w.model],
        regions=ALTER["regions"],
        flips=ALTER["flips"],
        seeds=ALTER["seeds"],
        seed=config["seed"],
        config_hash=lambda w: model_hash(w.model),
    script:
        "../scripts/alter_cells.py"


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
    conda:
        "../../envs/peat.yaml"
    resources:
        **CPU_RESOURCES,
    params:
        max_loss_pct=ALTER["absorbed_loss_pct"],
        tolerance=ALTER["tolerance"],
        dpi=config["report"]["dpi"],
    script:
        "../scripts/alter_summary.py"
