# Playback FI, Analyzer and Detector (issue: playback and detection).
# Every configured kernel replays the reference vendor's golden context of every model that
# has its op; the Analyzer and the Detector read the resulting table.
PLAYBACK = config["playback"]
DETECT = config["detect"]


def playback_path(model, vendor, kernel, ext):
    return f"results/playback/{model}/{vendor}/{kernel}.{ext}"


def analyze_path(model, vendor, kernel, name):
    return f"results/analyze/{model}/{vendor}/{kernel}/{name}"


def reference_context(wildcards):
    return golden(wildcards.model, config["reference_vendor"], "context.h5")


def propagation_inputs(wildcards):
    # The later observing points rebuild the model at the step: data, initial weights, checkpoints.
    if not PLAYBACK["propagate"]:
        return {}
    ref = config["reference_vendor"]
    base = config["models"][wildcards.model].get("init_from")
    return {
        "data": dataset_file(wildcards),
        "checkpoints": golden(wildcards.model, ref, "checkpoints"),
        "init": [golden(base, ref, "final.h5")] if base else [],
    }


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
    threads: config["threads"]
    resources:
        slurm_partition=slurm_partition,
        gres=slurm_gres,
        gpu_jobs=gpu_jobs,
    params:
        spec=lambda w: config["models"][w.model],
        kernel=lambda w: KERNELS[w.kernel],
        errors=config["errors"],
        settings=PLAYBACK,
        rules=DETECT,
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
    resources:
        slurm_partition=CPU_PARTITION,
    params:
        rules=DETECT,
    script:
        "../scripts/detect.py"


ANALYZE_FIGURES = {
    "score_vs_iteration.png": "playback_score_vs_iteration.rst",
    "distributions.png": "playback_distributions.rst",
    "heatmap.png": "playback_heatmap.rst",
    "bits.png": "playback_bits.rst",
    "spatial.png": "playback_spatial.rst",
}


rule analyze:
    input:
        table=playback_path("{model}", "{vendor}", "{kernel}", "parquet"),
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
    resources:
        slurm_partition=CPU_PARTITION,
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
    threads: config["threads"]
    params:
        seeds=DETECT["benchmark_seeds"],
        rules=DETECT,
    script:
        "../../benchmarks/detector.py"


def playback_targets():
    return [
        path
        for kernel in KERNELS
        for model in models_for(config, kernel)
        for vendor in VENDORS
        for path in [
            f"results/detect/{model}/{vendor}/{kernel}.json",
            *[
                analyze_path(model, vendor, kernel, name)
                for name in ["layers.csv", "summary.json", *ANALYZE_FIGURES]
            ],
        ]
    ]
