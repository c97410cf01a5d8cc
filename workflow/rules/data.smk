rule prepare_dataset:
    output:
        "results/data/{dataset}.h5",
    params:
        spec=lambda w: config["datasets"][w.dataset],
    log:
        "logs/data/{dataset}.log",
    script:
        "../scripts/prepare_dataset.py"
