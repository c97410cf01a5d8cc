"""Batch and layer norm with Welford statistics, merged chunk by chunk (Chan et al.).

Layer norm runs the classic one-element-at-a-time Welford update along each row; batch norm
computes each image's mean and M2 per channel and merges the images in order, as a GPU kernel
with one thread block per image slice does.
"""

import torch

from ._norm import make


def welford(rows, chunk):
    count = 0
    mean = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    m2 = torch.zeros_like(mean)
    for start in range(0, rows.shape[1], chunk):
        part = rows[:, start:start + chunk]
        n = part.shape[1]
        part_mean = part.mean(1)
        part_m2 = (part - part_mean[:, None]).square().sum(1)
        delta = part_mean - mean
        total = count + n
        mean = mean + delta * (n / total)
        m2 = m2 + part_m2 + delta.square() * (count * n / total)
        count = total
    return mean, m2 / count


def _chunk(x, op):
    return 1 if op == "layer_norm" else x[0, 0].numel()


batch_norm, layer_norm = make(welford, _chunk)
