rule golden_train:
    input:
        data=dataset_file,
        init=init_checkpoint,
    output:
        metrics=golden("{model}", "{vendor}", "metrics.csv"),
        # Reused by every later stage and costly to recompute: read-only once written.
        final=protected(golden("{model}", "{vendor}", "final.h5")),
        context=protected(golden("{model}", "{vendor}", "context.h5")),
        storage=golden("{model}", "{vendor}", "storage.json"),
        checkpoints=protected(directory(golden("{model}", "{vendor}", "checkpoints"))),
    log:
        "logs/golden/{model}/{vendor}.log",
    conda:
        "../../envs/peat.yaml"
    threads: config["threads"]
    resources:
        **VENDOR_RESOURCES,
    params:
        spec=lambda w: config["models"][w.model],
        seed=config["seed"],
        config_hash=lambda w: model_hash(w.model),
    script:
        "../scripts/golden_train.py"
