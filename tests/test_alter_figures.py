"""What a reader of the checkpoint alteration heatmap needs on it: its colour scale said."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from peat import alter_study as S


def test_the_heatmaps_colour_bar_names_its_unit(tmp_path, monkeypatch):
    """Unlabelled, its 0-100 read as a count beside the panel's "10 flipped values"."""
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)  # kept open to read back
    cell = dict(model="m", vendor="cpu", epoch=1, cls="embedding", region="sign", flips=10, seed=0, status="ok",
                accuracy_loss_pct=0.0, diverged=False)
    S.heatmap(pd.DataFrame([cell], columns=list(S.COLUMNS)), tmp_path / "h.png")
    bars = [ax for ax in closed[0].axes if ax.get_label() == "<colorbar>"]
    assert [ax.get_ylabel() for ax in bars] == ["accuracy loss vs golden (%)"]
