"""SDC guard as a DDP user sees it: which check each cost and alarm is charged to."""

from __future__ import annotations

import time

import torch

from peat import sdc
from test_sdc import healthy_step, one_rank  # noqa: F401  (one_rank: a fixture, a one-rank gloo group here)

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
        healthy_step(guard, model, x, step)
    guard.finish()
    costs, params = guard.costs(), len(guard.params)
    assert costs["nonfinite"] < REPORT_S, costs  # what the check itself costs: no report
    # Every report (one per gradient) and the replay's own fingerprint of all gradients.
    assert costs["audit"] >= 2 * params * REPORT_S, costs
    assert guard.spent >= 3 * 2 * params * REPORT_S  # nothing dropped from the guard's total


def _summary(alarms: list[sdc.Event], injected: int | None = 1, world: int = 2) -> dict:
    from types import SimpleNamespace

    from peat.sdc_drill import summarize

    cfg = {"injection_step": 2, "steps": 6, "audit_every": 2, "fingerprint_every": 1, "policy": "log", "fused": False}
    guard = SimpleNamespace(alarms=alarms, costs=lambda: {"nonfinite": 0.01, "fingerprint": 0.01, "audit": 0.1})
    return summarize("lane_fault", "resnet18", world, injected, cfg, guard, [0.1])


def test_an_unlocalized_detection_on_two_replicas_is_no_false_alarm():
    """With two ranks the audit cannot tell which replica is faulty: its alarm names both, the faulty
    one among them. It counted as a false alarm (it named a healthy rank), so a 2-rank drill that
    caught its fault read false_alarms 1 in the report."""
    caught = sdc.Event(2, "audit", [0, 1], ["n", "n"], localized=False, detail={"note": "two replicas"})
    result = _summary([caught])
    assert (result["detected"], result["localized"], result["right_rank"], result["false_alarms"]) == (True, False, False, 0)


def test_false_alarms_still_count_early_misplaced_and_clean_ones():
    early = sdc.Event(1, "audit", [0, 1], ["n", "n"], localized=False)
    healthy = sdc.Event(2, "fingerprint", [0], ["n"], localized=True)            # localized, the wrong rank
    both = sdc.Event(3, "nonfinite", [0, 1], ["n", "n"], localized=True)          # localized, a healthy rank too
    unlocalized_elsewhere = sdc.Event(4, "audit", [0, 2], ["n", "n"], localized=False)  # the faulty rank unnamed
    right = sdc.Event(5, "fingerprint", [1], ["n"], localized=True)
    assert _summary([early, healthy, both, unlocalized_elsewhere, right], world=3)["false_alarms"] == 4
    assert _summary([right], injected=None)["false_alarms"] == 1  # the clean drill: any alarm is false
