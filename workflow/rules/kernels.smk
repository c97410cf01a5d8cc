# Candidate-kernel training and frequency-based runtime FI: golden training with the chosen
# layers routed through a kernel (always, or part of the time).


rule candidate_train:
    input:
        **routed_inputs(),
    output:
        outcome=candidate("{model}", "{vendor}", "{kernel}", "outcome.json"),
        compare=candidate("{model}", "{vendor}", "{kernel}", "compare.csv"),
    log:
        "logs/candidate/{model}/{vendor}/{kernel}.log",
    conda:
        "../../envs/peat.yaml"
    threads: config["threads"]
    resources:
        **VENDOR_RESOURCES,
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
    conda:
        "../../envs/peat.yaml"
    threads: config["threads"]
    resources:
        **VENDOR_RESOURCES,
    params:
        **routed_params(),
    script:
        "../scripts/candidate_train.py"
