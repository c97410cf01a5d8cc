rule prepare_dataset:
    input:
        dataset_sources,
    output:
        "results/data/{dataset}.h5",
    log:
        "logs/data/{dataset}.log",
    # Shareable across workflows and users with `snakemake --cache` (SNAKEMAKE_OUTPUT_CACHE).
    cache: "omit-software"
    conda:
        "../../envs/peat.yaml"
    resources:
        **CPU_RESOURCES,
    params:
        spec=lambda w: config["datasets"][w.dataset],
    script:
        "../scripts/prepare_dataset.py"
