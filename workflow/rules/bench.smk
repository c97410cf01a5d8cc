# Benchmarks of every stage (issue 8): `snakemake bench` runs benchmarks/run.py, the same as
# `make bench`. Not part of the default target: it times the whole workflow itself. With
# --configfile config/test.yaml it is the smoke run (--quick).


rule bench:
    output:
        "reports/benchmarks/results.json",
    log:
        "logs/bench.log",
    conda:
        "../../envs/peat.yaml"
    # Read when the job is made: `snakemake --report` takes no --cores, and workflow.cores raised.
    # The SLURM profile sets none either (a WorkflowError at the preflight): this machine's CPUs.
    threads: lambda wildcards: workflow.resource_settings.cores or os.cpu_count()
    resources:
        **CPU_RESOURCES,
    params:
        runner=os.path.join(workflow.basedir, "benchmarks/run.py"),
        quick=config["name"] == "test",
    script:
        "../scripts/bench.py"
