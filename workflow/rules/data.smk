rule prepare_dataset:
    output:
        "results/data/{dataset}.h5",
    log:
        "logs/data/{dataset}.log",
    # Shareable across workflows and users with `snakemake --cache` (SNAKEMAKE_OUTPUT_CACHE).
    cache: "omit-software"
    resources:
        slurm_partition=slurm_partition,
        gres=slurm_gres,
        gpu_jobs=gpu_jobs,
    params:
        spec=lambda w: config["datasets"][w.dataset],
    script:
        "../scripts/prepare_dataset.py"
