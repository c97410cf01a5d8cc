# Collated report under reports/<name>/: golden training curves and one page over the outputs
# of every stage. The report takes the union of the stages' targets as input, so any upstream
# change (a kernel source, a config section) regenerates the page without rerunning golden
# training, and a stage without targets simply has no section.


# Seconds of plotting: not worth a trip through a cluster's queue.
localrules:
    golden_curves,
    collate_report,


rule golden_curves:
    input:
        golden("{model}", "{vendor}", "metrics.csv"),
    output:
        report(
            golden("{model}", "{vendor}", "training_curves.png"),
            caption="../report/golden_training_curves.rst",
            category="Golden training",
            subcategory="{model}",
            labels={
                "model": "{model}",
                "vendor": "{vendor}",
                "figure": "training curves",
            },
        ),
    log:
        "logs/report/curves/{model}/{vendor}.log",
    conda:
        "../../envs/peat.yaml"
    params:
        dpi=config["report"]["dpi"],
    script:
        "../scripts/golden_curves.py"


rule collate_report:
    input:
        golden_targets()
        + curve_targets()
        + kernel_targets()
        + playback_targets()
        + alter_targets()
        + sdc_targets()
        + benchmark_files(),
        captions=caption_files(),
    output:
        html=f"{REPORT_DIR}/index.html",
        tables=expand(f"{REPORT_DIR}/{{table}}", table=REPORT_TABLES),
    log:
        # Per configuration, as the page: another configuration's report overwrote a failed one's log.
        f"logs/report/{config['name']}/collate.log",
    conda:
        "../../envs/peat.yaml"
    params:
        name=config["name"],
        title=config["report"]["title"],
        models=MODELS,
        vendors=VENDORS,
        # Their folder, from the inputs: --lint calls a path param beside its files hardcoded.
        captions=lambda wildcards, input: os.path.dirname(input.captions[0]),
        dpi=config["report"]["dpi"],
        injected={k: v.get("error") or "" for k, v in config["kernels"].items()},
    script:
        "../scripts/collate_report.py"
