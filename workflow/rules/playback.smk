# Playback FI, Analyzer and Detector: every configured kernel replays the reference vendor's
# golden context of every model that has its op; the Analyzer and the Detector read the table.


rule playback:
    input:
        unpack(propagation_inputs),
        context=reference_context,
        kernel=kernel_sources,
    output:
        table=playback_path("{model}", "{vendor}", "{kernel}", "parquet"),
        record=playback_path("{model}", "{vendor}", "{kernel}", "json"),
    log:
        "logs/playback/{model}/{vendor}/{kernel}.log",
    conda:
        "../../envs/peat.yaml"
    threads: config["threads"]
    resources:
        **VENDOR_RESOURCES,
    params:
        spec=lambda w: config["models"][w.model],
        kernel=lambda w: kernel_spec(w.kernel, "train_timeout"),
        errors=config["errors"],
        settings=playback_settings(),
        rules=detect_rules("accept_reduced_precision"),
        seed=config["seed"],
        config_hash=lambda w: model_hash(w.model),
    script:
        "../scripts/playback.py"


rule detect:
    input:
        table=playback_path("{model}", "{vendor}", "{kernel}", "parquet"),
        record=playback_path("{model}", "{vendor}", "{kernel}", "json"),
    output:
        "results/detect/{model}/{vendor}/{kernel}.json",
    log:
        "logs/detect/{model}/{vendor}/{kernel}.log",
    conda:
        "../../envs/peat.yaml"
    resources:
        **CPU_RESOURCES,
    params:
        rules=detect_rules(),
    script:
        "../scripts/detect.py"


rule analyze:
    input:
        table=playback_path("{model}", "{vendor}", "{kernel}", "parquet"),
        record=playback_path("{model}", "{vendor}", "{kernel}", "json"),
        context=reference_context,
    output:
        **{
            name.split(".")[0]: report(
                analyze_path("{model}", "{vendor}", "{kernel}", name),
                caption=f"../report/{caption}",
                category="Kernel validation",
                subcategory="{model}",
                labels={
                    "vendor": "{vendor}",
                    "kernel": "{kernel}",
                    "figure": name.split(".")[0],
                },
            )
            for name, caption in ANALYZE_FIGURES.items()
        },
        layers=analyze_path("{model}", "{vendor}", "{kernel}", "layers.csv"),
        summary=analyze_path("{model}", "{vendor}", "{kernel}", "summary.json"),
    log:
        "logs/analyze/{model}/{vendor}/{kernel}.log",
    conda:
        "../../envs/peat.yaml"
    resources:
        **CPU_RESOURCES,
    params:
        dpi=config["report"]["dpi"],
    script:
        "../scripts/analyze.py"


rule detector_benchmark:
    # Not part of `all`: `snakemake detector_benchmark` (or `python benchmarks/detector.py`).
    input:
        contexts=expand(
            golden("{model}", config["reference_vendor"], "context.h5"), model=MODELS
        ),
    output:
        confusion="reports/benchmarks/detector/confusion.csv",
        metrics="reports/benchmarks/detector/metrics.csv",
        summary="reports/benchmarks/detector/summary.json",
        figure=report(
            "reports/benchmarks/detector/confusion.png",
            caption="../report/detector_benchmark.rst",
            category="Kernel validation",
            subcategory="Detector benchmark",
        ),
    log:
        "logs/benchmarks/detector.log",
    conda:
        "../../envs/peat.yaml"
    # The benchmark replays on one torch thread (benchmarks/detector.py), whatever the config's.
    threads: 1
    resources:
        **CPU_RESOURCES,
    params:
        seeds=DETECT["benchmark_seeds"],
        rules=DETECT,
    script:
        "../../benchmarks/detector.py"
