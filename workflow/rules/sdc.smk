# Silent-data-corruption drills: real multi-process training (one process per rank), one fault each.


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
    conda:
        "../../envs/peat.yaml"
    # One process per rank, each with the config's torch threads.
    threads: config["sdc"]["world_size"] * config["threads"]
    resources:
        **CPU_RESOURCES,
    params:
        config=lambda w: drill_config(config, w.model),
    script:
        "../scripts/sdc_drill.py"
