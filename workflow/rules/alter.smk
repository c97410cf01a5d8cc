# Checkpoint alteration study (issue: checkpoint alteration).


def alter_targets():
    return []
