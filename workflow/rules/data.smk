rule prepare_dataset:
    output:
        "results/data/{dataset}.h5",
    log:
        "logs/data/{dataset}.log",
    resources:
        slurm_partition=slurm_partition,
        gres=slurm_gres,
        gpu_jobs=gpu_jobs,
    params:
        spec=lambda w: config["datasets"][w.dataset],
    script:
        "../scripts/prepare_dataset.py"
