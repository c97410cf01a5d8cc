# Candidate-kernel training and frequency-based runtime FI (issue: candidate kernels).


def kernel_targets():
    return []
