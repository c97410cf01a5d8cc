# Collated report under reports/<name>/ (issue: reports and SLURM).


def report_targets():
    return []
