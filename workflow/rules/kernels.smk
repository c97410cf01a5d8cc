# Candidate-kernel training and frequency-based runtime FI (issue: candidate kernels).
# A kernel's source files are inputs of every job that uses it: editing one reruns only that
# kernel's jobs (kernel_sources() is also meant for the playback rules).
from peat.candidate import check as check_kernels, models_for, rfi_cases
from peat.kernels import source_files

try:
    check_kernels(config)
except PeatError as err:
    sys.exit(f"peat: {err}")

KERNELS = config["kernels"]
RFI = config["rfi"]


wildcard_constraints:
    kernel="|".join(KERNELS) or "no-kernel-configured",
    case=r"f[0-9.]+|every[0-9]+",


def candidate(model, vendor, kernel, name):
    return f"results/candidate/{model}/{vendor}/{kernel}/{name}"


def rfi_path(model, vendor, kernel, case, name):
    return f"results/rfi/{model}/{vendor}/{kernel}/{case}/{name}"


def kernel_sources(wildcards):
    return source_files(KERNELS[wildcards.kernel]["impl"])


def kernel_hash(wildcards):
    return config_hash(
        {"model": model_hash(wildcards.model), "kernel": KERNELS[wildcards.kernel]}
    )


def routed_inputs():
    return {
        "data": dataset_file,
        "init": init_checkpoint,
        "golden_metrics": golden("{model}", "{vendor}", "metrics.csv"),
        "context": golden("{model}", "{vendor}", "context.h5"),
        "kernel": kernel_sources,
    }


def routed_params():
    return {
        "spec": lambda w: config["models"][w.model],
        "kernel": lambda w: KERNELS[w.kernel],
        "seed": config["seed"],
        "config_hash": kernel_hash,
    }


rule candidate_train:
    input:
        **routed_inputs(),
    output:
        outcome=candidate("{model}", "{vendor}", "{kernel}", "outcome.json"),
        compare=candidate("{model}", "{vendor}", "{kernel}", "compare.csv"),
    log:
        "logs/candidate/{model}/{vendor}/{kernel}.log",
    threads: config["threads"]
    params:
        **routed_params(),
    script:
        "../scripts/candidate_train.py"


rule rfi:
    input:
        **routed_inputs(),
    output:
        outcome=rfi_path("{model}", "{vendor}", "{kernel}", "{case}", "outcome.json"),
        compare=rfi_path("{model}", "{vendor}", "{kernel}", "{case}", "compare.csv"),
        calls=rfi_path("{model}", "{vendor}", "{kernel}", "{case}", "calls.csv"),
    log:
        "logs/rfi/{model}/{vendor}/{kernel}/{case}.log",
    threads: config["threads"]
    params:
        **routed_params(),
    script:
        "../scripts/candidate_train.py"


def candidate_targets():
    return [
        candidate(model, vendor, kernel, name)
        for kernel, spec in KERNELS.items()
        if spec["train"]
        for model in models_for(config, kernel)
        for vendor in VENDORS
        for name in ("outcome.json", "compare.csv")
    ]


def rfi_targets():
    return [
        rfi_path(model, vendor, kernel, case, name)
        for kernel in RFI["kernels"]
        for model in models_for(config, kernel)
        if not RFI["models"] or model in RFI["models"]
        for vendor in VENDORS
        for case in rfi_cases(RFI)
        for name in ("outcome.json", "compare.csv", "calls.csv")
    ]


def kernel_targets():
    return candidate_targets() + rfi_targets()
