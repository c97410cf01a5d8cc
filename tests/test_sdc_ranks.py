"""SDC guard as a DDP user sees it: which check each cost and alarm is charged to."""

from __future__ import annotations

import time

import torch

from peat import sdc
from test_sdc import one_rank  # noqa: F401  (a fixture: a one-rank gloo group in this process)

REPORT_S = 0.02  # an audit report's fingerprint of one gradient, slowed down to be seen in the timers


def test_audit_reports_are_charged_to_the_audit_not_the_nonfinite_check(one_rank, monkeypatch):  # noqa: F811
    # On audit steps each local gradient is fingerprinted for the audit in the gradient hooks: that time
    # went to 'nonfinite', so a drill's cost with audit_every 1 or 2 showed the non-finite check at a
    # third of a step (3 ranks, resnet18) and the audit cheaper than it is.
    from torch.nn.parallel import DistributedDataParallel

    fingerprint = sdc.gradient_fingerprint

    def slow(grads):
        time.sleep(REPORT_S * len(grads))
        return fingerprint(grads)

    monkeypatch.setattr(sdc, "gradient_fingerprint", slow)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    guard = sdc.Guard(DistributedDataParallel(model), policy="raise", audit_every=1)
    x = torch.randn(5, 4)
    for step in range(3):
        guard.begin_step(step)
        model.zero_grad(set_to_none=True)
        guard.ddp(x).sum().backward()
        assert guard.check_gradients(replay=lambda r: guard.module(x).sum())
        guard.check_weights()
    guard.finish()
    costs, params = guard.costs(), len(guard.params)
    assert costs["nonfinite"] < REPORT_S, costs  # what the check itself costs: no report
    # Every report (one per gradient) and the replay's own fingerprint of all gradients.
    assert costs["audit"] >= 2 * params * REPORT_S, costs
    assert guard.spent >= 3 * 2 * params * REPORT_S  # nothing dropped from the guard's total
