# Silent-data-corruption drills with torchrun (issue: SDC checks).
from peat.sdc_drill import check_config as sdc_check_config, drill_config

try:
    sdc_check_config(config)
except PeatError as err:
    sys.exit(f"peat: {err}")


rule sdc_drill:
    input:
        data=dataset_file,
    output:
        drills=expand(
            "results/sdc/{{model}}/{drill}.json", drill=config["sdc"]["drills"]
        ),
        events=directory("results/sdc/{model}/events"),
    log:
        "logs/sdc/{model}.log",
    threads: config["sdc"]["world_size"]
    params:
        config=lambda w: drill_config(config, w.model),
    script:
        "../scripts/sdc_drill.py"


def sdc_targets():
    return expand(
        "results/sdc/{model}/{drill}.json",
        model=config["sdc"]["models"],
        drill=config["sdc"]["drills"],
    )
