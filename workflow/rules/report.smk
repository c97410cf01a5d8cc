# Collated report under reports/<name>/ (issue 7): golden training curves and one page over the
# outputs of every stage. The report rule takes the union of the stages' targets as input, so
# any upstream change (a kernel source, a config section) regenerates the page without
# rerunning golden training, and a stage without targets simply has no section.
import peat.report

REPORT_DIR = f"reports/{config['name']}"
REPORT_TABLES = list(peat.report.TABLES)
BENCHMARKS = "reports/benchmarks"


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
            caption="../report/golden_curves.rst",
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
    params:
        dpi=config["report"]["dpi"],
    script:
        "../scripts/golden_curves.py"


def curve_targets():
    return expand(
        golden("{model}", "{vendor}", "training_curves.png"),
        model=MODELS,
        vendor=VENDORS,
    )


def benchmark_files():
    # Written by `make bench`, not by this workflow: included when present.
    if not os.path.isdir(BENCHMARKS):
        return []
    names = sorted(os.listdir(BENCHMARKS))
    return [
        f"{BENCHMARKS}/{n}" for n in names if n == "results.json" or n.endswith(".png")
    ]


rule collate_report:
    input:
        golden_targets()
        + curve_targets()
        + kernel_targets()
        + playback_targets()
        + alter_targets()
        + sdc_targets()
        + benchmark_files(),
    output:
        html=f"{REPORT_DIR}/index.html",
        tables=expand(f"{REPORT_DIR}/{{table}}", table=REPORT_TABLES),
    log:
        "logs/report/collate.log",
    params:
        name=config["name"],
        title=config["report"]["title"],
        models=MODELS,
        vendors=VENDORS,
        captions=os.path.join(workflow.basedir, "workflow/report"),
        dpi=config["report"]["dpi"],
        injected={k: v.get("error") or "" for k, v in config["kernels"].items()},
    script:
        "../scripts/collate_report.py"


def report_targets():
    return [f"{REPORT_DIR}/index.html"]
