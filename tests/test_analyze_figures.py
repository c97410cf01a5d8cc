"""What a reader of the Analyzer's figures needs on them: scales said, panels comparable, floors
named. On a small synthetic playback table (no replay: the figures read only these columns)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.image import AxesImage

from peat import analyze, detect, report


def _row(case, computation, layer, step, err, rel, scale):
    m = np.full((4, 6), scale)
    m[:, ::3] = 0.0  # blocks without error
    return {"case": case, "computation": computation, "layer": layer, "fop": "output", "tensor": "O",
            "step": step, "err_top10": err, "rel_top10": rel, "bits": np.arange(32) % 3,
            "map": m.reshape(-1), "map_rows": 4, "map_cols": 6}


@pytest.fixture
def table():
    """Two layers, the first without an input gradient (as a network's first layer); a kernel
    matching golden exactly (rel 0) beside a lane fault a billion times larger than rounding."""
    rows = []
    for step in (0, 2):
        for case, rel, scale in (("kernel", 0.0, 1e-8), ("ref:fp64", 1.0, 1e-8), ("lane:4", 1e9, 1.0)):
            for computation, layer in (("forward", "a"), ("forward", "b"), ("input_grad", "b"),
                                      ("weight_grad", "a"), ("weight_grad", "b")):
                factor = 1e6 if computation == "weight_grad" else 1.0  # a backward scale far from the forward's
                rows.append(_row(case, computation, layer, step, 1e-7 * rel, rel * factor, scale))
    return pd.DataFrame(rows)


@pytest.fixture
def drawn(monkeypatch):
    """Each figure by name, kept open after ``analyze._save`` wrote it."""
    figs, save = {}, analyze._save

    def spy(fig, path, dpi, failed=()):
        figs[path.stem] = fig
        save(fig, path, dpi, failed)
    monkeypatch.setattr(analyze, "_save", spy)
    return figs


def test_spatial_maps_share_one_colour_scale_with_a_colorbar(table, tmp_path, drawn):
    """Each panel had its own scale (its max - 8 decades) and no colorbar: a rounding-sized error
    looked as bright as a lane fault's."""
    analyze.figures(table, tmp_path)
    fig = drawn["spatial"]
    images = [a for ax in fig.axes for a in ax.get_children() if isinstance(a, AxesImage)]
    assert len(images) == 3 and len({im.get_clim() for im in images}) == 1
    assert images[0].get_clim() == (-8.0, 0.0)
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and "log10 |error|" in bars[0].get_ylabel() and "no error" in bars[0].get_ylabel()
    assert all(im.get_array().mask[:, ::3].all() for im in images)  # zero error: no logarithm, drawn apart


def test_an_inf_error_leaves_the_shared_scale_to_the_finite_ones_and_titles_count_nan(table, tmp_path, drawn):
    """An Inf error counts as the largest float: its block set the shared scale to 309 decades."""
    inf = _row("inf:1", "forward", "a", 0, 1.0, 1.0, 1e-8) | {"nonfinite": 1}
    inf["map"][5] = np.finfo(np.float64).max
    nan = _row("nan:1", "forward", "a", 0, 1.0, 1.0, 1e-8) | {"nonfinite": 2}  # NaN: no mass in the map
    analyze.figures(pd.concat([table, pd.DataFrame([inf, nan])], ignore_index=True), tmp_path)
    fig = drawn["spatial"]
    images = {ax.get_title().split(",")[0]: a for ax in fig.axes for a in ax.get_children()
              if isinstance(a, AxesImage)}
    assert {im.get_clim() for im in images.values()} == {(-8.0, 0.0)}
    assert images["inf:1"].get_array()[0, 5] > 300  # above the scale: the colorbar's green extension
    titles = [ax.get_title() for ax in fig.axes]
    assert any(t.startswith("inf:1, 1 NaN/Inf\n") for t in titles)
    assert any(t.startswith("nan:1, 2 NaN/Inf\n") for t in titles)
    assert "green: an Inf error" in [ax for ax in fig.axes if ax.get_label() == "<colorbar>"][0].get_ylabel()


def test_a_case_that_made_nan_or_inf_is_named_so_not_drawn_as_an_exact_match(table, tmp_path, drawn):
    """The default run's nan:1 in an otherwise exact gradient: its scores (of the finite elements)
    are 0, so it sat at the exact-match floor of the score and distribution figures unsaid, and a
    kernel cell holding a NaN looked like its finite elements alone in the heatmap."""
    nan = [_row("nan:1", "weight_grad", layer, step, 0.0, 0.0, 1e-8) | {"nonfinite": 1}
           for layer in ("a", "b") for step in (0, 2)]
    table = pd.concat([table.assign(nonfinite=0), pd.DataFrame(nan)], ignore_index=True)
    table.loc[(table["case"] == "kernel") & (table["layer"] == "b") & (table["computation"] == "forward")
              & (table["step"] == 2), "nonfinite"] = 3
    analyze.figures(table, tmp_path)
    labels = {t.get_text() for ax in drawn["distributions"].axes for t in ax.get_yticklabels()}
    assert "nan:1 (NaN/Inf)" in labels and "nan:1" not in labels and "kernel (NaN/Inf)" in labels
    legend = {t.get_text() for t in drawn["score_vs_iteration"].legends[0].get_texts()}
    assert {"nan:1 (NaN/Inf)", "kernel (NaN/Inf)", "lane:4"} <= legend
    heat = [ax for ax in drawn["heatmap"].axes if ax.get_label() != "<colorbar>"][0]
    marked = [(t.get_text(), t.get_position()) for t in heat.texts if t.get_text()]
    rows = [t.get_text() for t in heat.get_yticklabels()]
    assert marked == [("NaN/Inf", (1.5, rows.index("b-forward") + 0.5))]  # step 2: the second column
    analyze.figures(table.assign(nonfinite=0), tmp_path)
    assert not any(t.get_text() for ax in drawn["heatmap"].axes for t in ax.texts)


def test_heatmap_keeps_and_marks_the_kernels_all_nan_results(table, tmp_path, drawn):
    """A result without a finite element has no score: a layer whose every result of the kernel was
    all NaN lost its heatmap row, and such a cell beside scored ones lost its "NaN/Inf" (seaborn
    annotates no cell without a value)."""
    table = table.assign(nonfinite=0)
    nan = (table["case"] == "kernel") & (table["layer"] == "b") & (table["computation"] == "forward")
    table.loc[nan, ["err_top10", "rel_top10"]] = np.nan
    table.loc[nan, "nonfinite"] = 24
    analyze.figures(table, tmp_path)
    heat = [ax for ax in drawn["heatmap"].axes if ax.get_label() != "<colorbar>"][0]
    rows = [t.get_text() for t in heat.get_yticklabels()]
    assert "b-forward" in rows
    marked = [t.get_position() for t in heat.texts if t.get_text() == "NaN/Inf"]
    assert marked == [(0.5, rows.index("b-forward") + 0.5), (1.5, rows.index("b-forward") + 0.5)]
    table.loc[nan & (table["step"] == 0), ["err_top10", "rel_top10"]] = 1e-7, 1.0  # one cell scored
    analyze.figures(table, tmp_path)
    heat = [ax for ax in drawn["heatmap"].axes if ax.get_label() != "<colorbar>"][0]
    assert [t.get_text() for t in heat.texts if t.get_position() == (1.5, rows.index("b-forward") + 0.5)] == ["NaN/Inf"]


def test_heatmap_rows_follow_the_networks_layer_order_not_their_names(table, tmp_path, drawn):
    """Sorted by name, a network's classifier came first and features.10 before features.2."""
    names = {"a": "features.2.conv", "b": "features.10.conv"}
    deep = pd.concat([table.assign(layer=table["layer"].map(names)),
                      table[table["layer"] == "b"].assign(layer="classifier")], ignore_index=True)
    analyze.figures(deep, tmp_path)
    heat = [ax for ax in drawn["heatmap"].axes if ax.get_label() != "<colorbar>"][0]
    assert [t.get_text() for t in heat.get_yticklabels()] == [
        "features.2.conv-forward", "features.2.conv-weight_grad", "features.10.conv-forward",
        "features.10.conv-input_grad", "features.10.conv-weight_grad", "classifier-forward", "classifier-input_grad",
        "classifier-weight_grad"]
    # The spatial maps show the first layer too, not the first by name (GPT-2's lm_head).
    titles = {ax.get_title().split("\n")[1] for ax in drawn["spatial"].axes if ax.get_title()}
    assert titles == {"features.2.conv forward step 0"}


def test_heatmap_colours_run_from_exact_match_to_beyond_fp16_rounding(table, tmp_path, drawn):
    """Scaled to its data alone, the test run's im2col (1.0 to 1.4 times fp32 noise: 0 to 0.15
    decades) spanned the whole colour range, a noise-level cell as bright yellow as a lane fault's.
    The scale runs from the floor (-3) to at least HEAT_TOP decades over the noise."""
    def limits(kernel_rel):
        analyze.figures(table.assign(rel_top10=table["rel_top10"].where(table["case"] != "kernel", kernel_rel)),
                        tmp_path)
        heat = [ax for ax in drawn["heatmap"].axes if ax.get_label() != "<colorbar>"][0]
        return heat.collections[0].get_clim()

    assert limits(np.where(table["step"] == 0, 1.0, 1.4)) == (-3.0, analyze.HEAT_TOP)
    # Beside exact matches (-3), noise-level cells (0) were the top colour of a -3..0 scale.
    assert limits(np.where(table["computation"] == "forward", 1.0, 0.0)) == (-3.0, analyze.HEAT_TOP)
    assert limits(np.where(table["computation"] == "forward", 10 ** 6.3, 0.0)) == (-3.0, 7.0)


def test_ratio_figures_name_their_floor_and_share_one_x_scale(table, tmp_path, drawn):
    """Ratios are floored at 1e-3 (an exact match has no logarithm): shown as -3 without a word;
    the distributions' panels each had their own x range, forward and backward not comparable."""
    analyze.figures(table, tmp_path)
    boxes = [ax for ax in drawn["distributions"].axes if ax.get_xlabel()]
    assert boxes and all("exact match: -3" in ax.get_xlabel() for ax in boxes)
    assert len({ax.get_xlim() for ax in boxes}) == 1
    heat_bar = [ax for ax in drawn["heatmap"].axes if ax.get_label() == "<colorbar>"]
    assert "exact match: -3" in heat_bar[0].get_ylabel()
    assert all("exact match: -30" in ax.get_ylabel() for ax in drawn["score_vs_iteration"].axes if ax.get_ylabel())


def test_distributions_cut_the_axis_and_say_what_lies_beyond(table, tmp_path, drawn):
    """A flipped exponent bit (38 decades over noise) squeezed every other box into the left
    tenth of the shared axis; now it ends at REL_CUT and a row beyond it says its largest value."""
    analyze.figures(table, tmp_path)  # the lane fault's weight gradient lies 15 decades over noise
    panels = {ax.get_title(): ax for ax in drawn["distributions"].axes}
    assert {ax.get_xlim()[1] for ax in panels.values()} == {analyze.REL_CUT}
    said = [(t.get_text(), t.get_position()) for t in panels["weight_grad"].texts]
    assert said == [("15 \u25b8", (analyze.REL_CUT, 2))]  # the lane fault's row, third case of the table
    assert not panels["forward"].texts and not panels["input_grad"].texts
    analyze.figures(table[table["computation"] != "weight_grad"], tmp_path)  # nothing beyond 9: no cut
    assert all(ax.get_xlim()[1] < 10 and not ax.texts for ax in drawn["distributions"].axes)


def test_distributions_axis_labels_do_not_run_into_each_other(table, tmp_path, drawn):
    """The test run's im2col: "bit_flip:exponent (NaN/Inf)" widened the case labels and narrowed the
    panels, and each panel's two-line label ran into its neighbour's ("noiselog10 top-10% err")."""
    long = table.assign(case=table["case"].replace({"lane:4": "bit_flip:exponent"}),
                        nonfinite=(table["case"] == "lane:4").astype(int))
    analyze.figures(long, tmp_path)
    fig = drawn["distributions"]
    FigureCanvasAgg(fig)  # laid out again at the dpi it was saved at
    fig.set_dpi(80)
    fig.canvas.draw()
    labels = [ax.xaxis.label.get_window_extent() for ax in fig.axes if ax.get_xlabel()]
    assert len(labels) == 3 and not any(a.overlaps(b) for a, b in zip(labels, labels[1:]))


def test_distributions_titles_do_not_run_into_each_other(table, tmp_path, drawn):
    """A kernel crashing in its forward on GPT-2 (one layer, its long name in the legend): the two
    backward panels, narrowed by the legend, ran their titles together ("computation =
    input_gradcomputation = weight_grad")."""
    backward = table[(table["layer"] == "b") & (table["computation"] != "forward")]
    analyze.figures(backward.assign(layer="transformer.h.0.mlp.c_fc", case=backward["case"].replace(
        {"lane:4": "bit_flip:exponent"})), tmp_path)  # the test config's longest case name
    fig = drawn["distributions"]
    FigureCanvasAgg(fig)  # laid out again at the dpi it was saved at: Agg's text is wider there
    fig.set_dpi(80)
    fig.canvas.draw()
    titles = [ax.title.get_window_extent() for ax in fig.axes]
    assert [ax.get_title() for ax in fig.axes] == ["input_grad", "weight_grad"]
    assert not titles[0].overlaps(titles[1])


def test_computations_keep_one_order_in_every_run(table, tmp_path, drawn):
    """Panels followed the table's order: the test run's im2col, whose first layer has no input
    gradient, put weight_grad before input_grad, other runs after it (as the heatmap always does)."""
    analyze.figures(table.iloc[::-1].reset_index(drop=True), tmp_path)
    rows = list(dict.fromkeys(ax.get_title().split("\n")[0] for ax in drawn["score_vs_iteration"].axes))
    cols = [ax.get_title() for ax in drawn["distributions"].axes]
    assert rows == ["forward", "input_grad", "weight_grad"]
    assert cols == rows


def test_score_vs_iteration_says_which_panel_has_nothing_replayed(table, tmp_path, drawn):
    """The first layer's input-gradient panel was empty with a 0..1 axis; a lone step was ticked
    -0.05..0.05; cases differed by colour only."""
    analyze.figures(table, tmp_path)
    texts = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in drawn["score_vs_iteration"].axes}
    assert texts["input_grad\na"] == ["not replayed"]
    assert all(not t for title, t in texts.items() if title != "input_grad\na")
    ax = drawn["score_vs_iteration"].axes[0]
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert len({line.get_marker() for line in ax.get_lines()}) == 3  # a dozen hues alone were hard to tell apart


def test_score_vs_iteration_legend_clears_a_long_layer_names_titles(table, tmp_path, drawn):
    """One layer, named as GPT-2's: its panels' titles, wider than the panels, ran under the legend."""
    table = table[table["layer"] == "a"].assign(layer="transformer.h.0.mlp.c_fc")
    analyze.figures(table, tmp_path)
    fig = drawn["score_vs_iteration"]
    legend = fig.legends[0].get_window_extent()
    assert not any(ax.title.get_window_extent().overlaps(legend) for ax in fig.axes)


def test_score_vs_iteration_titles_and_step_ticks_do_not_overlap(table, tmp_path, drawn):
    """Two GPT-2 layers replayed at 9 steps (the default run's bf16_gemm): "input_grad |
    transformer.h.0.mlp.c_fc" ran into its neighbour's title, and ticks 105 and 120 into each other."""
    names = {"a": "transformer.h.0.mlp.c_fc", "b": "transformer.h.1.attn.c_attn"}
    steps = pd.concat([table[table["step"] == 0].assign(step=s) for s in range(0, 121, 15)], ignore_index=True)
    analyze.figures(steps.assign(layer=steps["layer"].map(names)), tmp_path)
    fig = drawn["score_vs_iteration"]
    FigureCanvasAgg(fig)  # laid out again at the dpi it was saved at: Agg's text is wider there
    fig.set_dpi(80)
    fig.canvas.draw()
    titles = [ax.title.get_window_extent() for ax in fig.axes]
    assert not any(a.overlaps(b) for i, a in enumerate(titles) for b in titles[i + 1:])
    # Nor another panel, its tick marks (3.5 pt, under 4 px at 80 dpi) included: a two-line title's
    # first line ran into the marks of the panel above.
    panels = [ax.get_window_extent().padded(4) for ax in fig.axes]
    assert not any(t.overlaps(p) for i, t in enumerate(titles) for j, p in enumerate(panels) if i != j)
    labelled = [[t.get_window_extent() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
                for ax in fig.axes]  # the bottom row's (the steps are shared)
    labelled = [ticks for ticks in labelled if ticks]
    assert len(labelled) == 2 and all(len(ticks) >= 2 for ticks in labelled)
    assert not any(a.overlaps(b) for ticks in labelled for a, b in zip(ticks, ticks[1:]))


def test_analyzer_section_caption_claims_no_count_its_figures_lack():
    """It said the figures showed how many elements differ beyond the envelope; none does."""
    caption = report.SECTIONS["analyze"][1]
    assert "how many elements differ" not in caption and "n32" in caption


@pytest.mark.parametrize("figure, said", [
    ("score_vs_iteration", '"(NaN/Inf)" after a case'), ("distributions", '"(NaN/Inf)" after a case'),
    ("heatmap", 'a cell marked "NaN/Inf"')])
def test_captions_explain_the_nan_inf_marks_their_figures_draw(figure, said):
    """The figures name a case that made a NaN or Inf "<case> (NaN/Inf)" and mark such a heatmap cell;
    their captions, on the report's page, never said what that means (a legend of "kernel (NaN/Inf)")."""
    from conftest import REPO

    caption = (REPO / "workflow/report" / f"playback_{figure}.rst").read_text()
    assert said in " ".join(caption.split())


def test_many_layers_stay_readable_in_bounded_figures(table, tmp_path, drawn):
    """20 layers made score_vs_iteration one row of 20 panels (4,709 px wide, ~1 s a panel to draw)
    and packed 20 boxes a case into the distributions' 3.2 in. A few layers still look as they did."""
    analyze.figures(table, tmp_path)
    assert drawn["score_vs_iteration"]._suptitle is None and drawn["distributions"].legends
    many = pd.concat([table.assign(layer=table["layer"] + str(i)) for i in range(10)], ignore_index=True)
    many.loc[(many["layer"] == "b7") & (many["case"] == "kernel"), "rel_top10"] = 1e3  # its worst layer
    # A layer where every result of the kernel was all NaN has no score: it was ranked last.
    many.loc[(many["layer"] == "b3") & (many["case"] == "kernel"), ["rel_top10", "err_top10", "nonfinite"]] = \
        [np.nan, np.nan, 8]
    analyze.figures(many, tmp_path)
    fig = drawn["score_vs_iteration"]
    shown = {ax.get_title().split("\n")[1] for ax in fig.axes}
    assert len(shown) == analyze.MAX_LAYERS and {"b7", "b3"} <= shown
    assert len(fig.axes) <= 3 * analyze.MAX_LAYERS and fig.get_figwidth() < 20
    note = fig._suptitle.get_text().replace("\n", " ")
    assert f"{analyze.MAX_LAYERS} of 20 layers" in note
    assert all(f" {name}," in note or note.endswith(f" {name}") for name in set(many["layer"]) - shown)
    dist = drawn["distributions"]
    assert not dist.legends and "all 20 layers pooled" in dist._suptitle.get_text()
    assert [len(ax.patches) for ax in dist.axes] == [3, 3, 3]  # one box a case


def test_heatmap_of_every_step_of_a_long_training_stays_report_wide(table, tmp_path, drawn):
    """max_samples_per_layer: null replays every recorded step: half an inch a step made 200 steps a
    heatmap 5,571 px wide and 269 tall, a strip in the report's 1,200 px. A few steps look as they did."""
    steps = pd.concat([table[table["step"] == 0].assign(step=s) for s in range(0, 2000, 10)], ignore_index=True)
    analyze.figures(steps, tmp_path)
    assert drawn["heatmap"].get_figwidth() < 20
    analyze.figures(table, tmp_path)
    assert drawn["heatmap"].get_figwidth() == 2.0 + 0.5 * 2


def test_jobs_read_the_list_columns_only_for_the_figures_drawing_them(table, tmp_path, monkeypatch):
    """Both jobs read the whole playback table: its list columns (bits, row_mass, col_mass, map),
    80 % of it in pandas (+3.7 GB a job at 72k rows), which no rule and two figures read."""
    import h5py

    from peat import detect

    table = table.assign(**{s: table["rel_top10"] for s in analyze.SCORES if s not in table}, op="conv2d",
                         row_mass=list(table["map"]), col_mass=list(table["map"]))
    table.to_parquet(tmp_path / "t.parquet")
    h5py.File(tmp_path / "context.h5", "w").close()
    (tmp_path / "record.json").write_text('{"outcomes": []}')
    crashed = tmp_path / "crashed.parquet"  # every row failed: the verdict needs no evidence columns
    table.assign(error="boom", status="crash").to_parquet(crashed)
    read, lists = [], []
    read_parquet, iter_list_rows = pd.read_parquet, analyze.iter_list_rows
    monkeypatch.setattr(pd, "read_parquet", lambda path, columns=None: read.append(columns) or
                        read_parquet(path, columns=columns))
    monkeypatch.setattr(analyze, "iter_list_rows", lambda path, column, index: lists.append(column) or
                        iter_list_rows(path, column, index))
    analyze.run_job(tmp_path / "t.parquet", tmp_path / "context.h5", tmp_path / "job", record=tmp_path / "record.json")
    assert detect.run_job(crashed, tmp_path / "record.json", tmp_path / "v.json")["error_model"] == "crash"
    assert read[0] == [*analyze.KEYS, "step", *analyze.SCORES, "map_rows", "map_cols"]
    assert "error" in read[1] and not {"bits", "row_mass", "col_mass", "map"} & set(read[1])
    assert sorted(set(lists)) == ["bits", "map"]
    monkeypatch.undo()
    analyze.analyze(table, tmp_path / "context.h5", tmp_path / "whole")  # the same, from the whole table
    for name in ("layers.csv", "summary.json", "bits.png", "spatial.png", "distributions.png"):
        assert (tmp_path / "job" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_figures_name_a_crash_of_the_kernel_under_an_operand_pseudo_error(table, tmp_path, drawn):
    """fp16 calls the kernel again on rounded operands: a kernel crashing there failed its verdict
    (detect.judge: "crash") while every figure named no failure, its fp16 forward line just missing.
    A pseudo-error that cannot act on the op is no failure of the kernel."""
    from matplotlib.text import Text

    table = table.assign(error=None, status=None)
    crashed = {"case": "fp16", "computation": "forward", "layer": "b", "fop": None, "tensor": None, "step": 0,
               "error": "RuntimeError: late crash", "status": "crash"}
    skipped = {**crashed, "case": "tile:4:splitk", "error": "ValueError: no K", "status": "not_applicable"}
    table = pd.concat([table, pd.DataFrame([crashed, skipped])], ignore_index=True)
    assert analyze.failures(table) == ["forward (layer b, case fp16) crash: RuntimeError: late crash"]
    analyze.figures(table, tmp_path)
    for name, fig in drawn.items():
        text = " ".join(t.get_text() for t in fig.findobj(Text))
        assert "case fp16) crash: RuntimeError: late crash" in text and "no K" not in text, name


def test_figures_of_a_context_whose_layers_the_computations_skip_say_so(table, tmp_path, drawn):
    """The kernel's only recorded layer is the network's first, replayed for its input gradient
    alone: no row. The figures said the context had no recorded layer of the kernel's op, where the
    Detector's verdict (evidence.reason) names the layer and why."""
    import h5py
    from matplotlib.text import Text

    table.iloc[:0].to_parquet(tmp_path / "t.parquet")
    h5py.File(tmp_path / "context.h5", "w").close()
    record = {"context": "context.h5", "layers": ["conv1"], "outcomes": []}
    (tmp_path / "record.json").write_text(json.dumps(record))
    analyze.run_job(tmp_path / "t.parquet", tmp_path / "context.h5", tmp_path / "job", record=tmp_path / "record.json")
    assert set(drawn) == set(analyze.FIGURES)
    for name, fig in drawn.items():
        text = " ".join(t.get_text() for t in fig.findobj(Text)).replace("\n", " ")
        assert "no recorded layer" not in text and "(conv1)" in text and "no sample" in text, (name, text)
    assert "(conv1)" in detect.judge(table.iloc[:0], record)["evidence"]["reason"]


def test_a_kernel_failure_message_with_dollar_signs_is_written_as_it_is(table, tmp_path, drawn):
    """The failures under the panels were parsed as mathtext: a kernel's message holding "$x^$" ended
    the analyze job in a ParseSyntaxException (and "$A_{ij}$" was drawn as a formula)."""
    from matplotlib.text import Text

    message = "RuntimeError: bad shape for $A_{ij}$ and $x^$"
    outcomes = [{"computation": "weight_grad", "layer": "a", "status": "crash", "message": message}]
    analyze.figures(table, tmp_path, outcomes=outcomes)
    analyze.figures(table.iloc[:0], tmp_path / "none", outcomes=outcomes)  # nothing scored: the "no rows" figures
    for name, fig in drawn.items():  # as matplotlib draws them: plain text, the message whole
        drawn_texts = [t._preprocess_math(t.get_text()) for t in fig.findobj(Text)]
        assert any(message in text and not math for text, math in drawn_texts), name
    assert (tmp_path / "none" / "heatmap.png").exists()


def test_the_first_panel_says_when_its_layer_was_not_replayed_there(table, tmp_path, drawn):
    """A first layer replayed only in backward: its forward panel, the grid's first, was drawn empty
    on a 0..1 axis without a word (seaborn's legend handles live there, so it seemed to have data)."""
    back = table[(table["layer"] == "a") & (table["computation"] == "weight_grad")].assign(layer="z")
    analyze.figures(pd.concat([back, table[table["layer"] == "b"]], ignore_index=True), tmp_path)
    texts = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in drawn["score_vs_iteration"].axes}
    assert texts["forward\nz"] == ["not replayed"] and texts["input_grad\nz"] == ["not replayed"]
    assert all(not t for title, t in texts.items() if title not in ("forward\nz", "input_grad\nz"))


def test_results_without_a_finite_error_say_so_and_draw_every_figure(table, tmp_path, drawn):
    """An output without elements (a zero-size batch) or all NaN has NaN scores: its panels were
    blank without a word, and a table of such results alone ended the job in seaborn's ValueError
    ("Could not interpret value `_y`") or UnboundLocalError."""
    unscored = table["computation"] == "weight_grad"
    table = table.assign(err_top10=table["err_top10"].where(~unscored), rel_top10=table["rel_top10"].where(~unscored))
    analyze.figures(table, tmp_path)
    score = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in drawn["score_vs_iteration"].axes}
    assert score["weight_grad\na"] == score["weight_grad\nb"] == [analyze.NO_SCORE]
    assert score["input_grad\na"] == ["not replayed"] and not score["forward\na"]
    boxes = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in drawn["distributions"].axes}
    assert boxes == {"forward": [], "input_grad": [],
                     "weight_grad": [analyze.NO_SCORE]}
    analyze.figures(table.assign(err_top10=np.nan, rel_top10=np.nan), tmp_path / "none")
    assert sorted(p.stem for p in (tmp_path / "none").glob("*.png")) == sorted(analyze.FIGURES)
    for name in ("score_vs_iteration", "distributions"):
        assert [t.get_text() for t in drawn[name].axes[0].texts] == [analyze.NO_SCORE_ANYWHERE]


def test_spatial_maps_skip_outputs_without_elements(table, tmp_path, drawn):
    """A zero-size batch's output has an empty map (0 x 6): the first layer's, it drew a blank panel
    per case while the next layer's errors went unshown. Without any element, the figure says so."""
    empty = table[table["layer"] == "a"]
    empty = empty.assign(layer="empty", map_rows=0, map=[np.zeros(0)] * len(empty), err_top10=np.nan, rel_top10=np.nan)
    analyze.figures(pd.concat([empty, table], ignore_index=True), tmp_path)
    titles = {ax.get_title().split("\n")[1] for ax in drawn["spatial"].axes if ax.get_title()}
    assert titles == {"a forward step 0"}
    analyze.figures(empty, tmp_path / "none")
    text = [t.get_text() for t in drawn["spatial"].axes[0].texts]
    assert text == ["no error map: every result was an output without elements"]


def test_distributions_of_many_cases_keep_their_labels_apart(table, tmp_path, drawn):
    """Every error spec of the labeled benchmark, 28 cases, sat in panels 3.2 in tall: their names ran
    into each other. A few cases keep the size they had."""
    analyze.figures(table, tmp_path)
    assert drawn["distributions"].axes[0].get_window_extent().height / 80 == pytest.approx(3.2, abs=0.5)
    width = drawn["distributions"].get_figwidth()
    many = pd.concat([table.assign(case=table["case"] + f":{i}") for i in range(10)], ignore_index=True)
    analyze.figures(many[many["case"] != "lane:4:9"], tmp_path)
    fig = drawn["distributions"]
    FigureCanvasAgg(fig)  # laid out again at the dpi it was saved at
    fig.set_dpi(80)
    fig.canvas.draw()
    labels = [t.get_window_extent() for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert len(labels) == 29 and not any(a.overlaps(b) for a, b in zip(labels, labels[1:]))
    assert fig.get_figwidth() == pytest.approx(width, rel=0.1)


def test_distributions_of_one_value_keep_their_ticks_apart(table, tmp_path, drawn):
    """One layer, one step, one case at exactly fp32 noise (log 0): the shared axis ran -0.075 to
    0.075 and its seven labels into each other."""
    one = table[(table["case"] == "kernel") & (table["layer"] == "b") & (table["step"] == 0)].assign(rel_top10=1.0)
    analyze.figures(one, tmp_path)
    fig = drawn["distributions"]
    FigureCanvasAgg(fig)  # laid out again at the dpi it was saved at
    fig.set_dpi(80)
    fig.canvas.draw()
    low, high = fig.axes[0].get_xlim()
    assert (low, high) == pytest.approx((-0.5, 0.5))
    for ax in fig.axes:
        ticks = [t.get_window_extent() for t in ax.get_xticklabels() if t.get_text() and low <= t.get_position()[0] <= high]
        assert len(ticks) >= 3 and not any(a.overlaps(b) for a, b in zip(ticks, ticks[1:]))
    analyze.figures(table, tmp_path)  # a decade or more: as it was
    assert drawn["distributions"].axes[0].get_xlim()[1] == analyze.REL_CUT


def test_an_infinite_score_is_drawn_at_the_largest_float_and_leaves_the_heatmap_scale(table, tmp_path, drawn):
    """Inf elements count as the largest float64, and a mean over several overflows to inf: that score
    had no line in the score figure and a blank heatmap cell, while one Inf element (a score of 1e305)
    stretched the heatmap's colours to 306 decades, every other cell one flat colour."""
    table = table.assign(nonfinite=0)
    b = (table["case"] == "kernel") & (table["layer"] == "b") & (table["computation"] == "forward")
    table.loc[b & (table["step"] == 2), ["err_top10", "rel_top10", "nonfinite"]] = [np.inf, np.inf, 3]
    table.loc[b & (table["step"] == 0), ["err_top10", "rel_top10", "nonfinite"]] = [8.8e305, 1e303, 1]
    analyze.figures(table, tmp_path)
    panel = next(ax for ax in drawn["score_vs_iteration"].axes if ax.get_title() == "forward\nb")
    kernel = next(line for line in panel.get_lines() if len(line.get_xdata()) == 2 and line.get_ydata()[0] > 300)
    assert kernel.get_ydata()[1] == pytest.approx(np.log10(np.finfo(np.float64).max))
    heat = [ax for ax in drawn["heatmap"].axes if ax.get_label() != "<colorbar>"][0]
    assert heat.collections[0].get_clim() == (-3.0, analyze.HEAT_TOP)
    assert [t.get_text() for t in heat.texts] == ["NaN/Inf", "NaN/Inf"]
    assert drawn["heatmap"].axes[1].get_label() == "<colorbar>" and heat.collections[0].colorbar.extend == "max"


def test_score_vs_iteration_legend_sits_beside_the_panels_without_a_blank_gap(table, tmp_path, drawn):
    """One GPT-2 layer: the legend sat at the figure's right edge, 1.3 in of blank right of the panels."""
    table = table[table["layer"] == "a"].assign(layer="transformer.h.0.mlp.c_fc")
    analyze.figures(table, tmp_path)
    fig = drawn["score_vs_iteration"]
    fig.canvas.draw()
    right = max(ax.get_tightbbox().x1 for ax in fig.axes)
    gap = (fig.legends[0].get_window_extent().x0 - right) / fig.dpi
    assert 0 < gap < 0.5


def test_bits_list_cases_in_the_tables_order_under_a_title_naming_golden(table, tmp_path, drawn):
    analyze.figures(table, tmp_path)
    ax = drawn["bits"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["kernel", "ref:fp64", "lane:4"]  # not sorted by name
    assert ax.get_title() == analyze.BITS_TITLE and "golden" in ax.get_title()


def test_spatial_titles_of_a_long_layer_name_do_not_run_into_each_other(table, tmp_path, drawn):
    """A GPT-2 layer's tensor line with its NaN/Inf count ran into the neighbouring panels' titles."""
    table = table.assign(layer=table["layer"].map({"a": "transformer.h.11.attn.c_attn", "b": "z"}),
                         step=table["step"] + 120, nonfinite=12)
    analyze.figures(table, tmp_path)
    fig = drawn["spatial"]
    FigureCanvasAgg(fig)  # laid out at the dpi it was saved at
    fig.set_dpi(80)
    fig.canvas.draw()
    titles = [ax.title.get_window_extent() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 3 and not any(a.overlaps(b) for i, a in enumerate(titles) for b in titles[i + 1:])
    assert [ax.get_title().split("\n")[0] for ax in fig.axes if ax.get_title()] == [
        "kernel, 12 NaN/Inf", "ref:fp64, 12 NaN/Inf", "lane:4, 12 NaN/Inf"]


def test_heatmap_axes_say_training_step_as_the_score_figure_does(table, tmp_path, drawn):
    analyze.figures(table, tmp_path)
    ax = drawn["heatmap"].axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("training step", "layer - computation")
    assert drawn["score_vs_iteration"].axes[-1].get_xlabel() == "training step"


def test_distributions_of_one_step_draw_each_layer_in_its_colour(table, tmp_path, drawn):
    """One replayed step (config/test.yaml) makes each box one value, a grey line whatever its layer:
    the layers' legend matched nothing drawn."""
    analyze.figures(table[table["step"] == 0], tmp_path)
    ax = drawn["distributions"].axes[0]
    colours = [{tuple(m.get_color()) for m in c.medians} for c in ax.containers]
    assert colours == [{tuple(c.boxes[0].get_facecolor())} for c in ax.containers] and len(colours) == 2
    assert colours[0] != colours[1]


def test_distributions_of_a_forward_only_table_with_long_layer_names_keep_the_legend_beside(table, tmp_path, drawn):
    """playback.computations [forward] on BERT: one panel, narrowed by the case names, and a legend of
    its long layer names. Seaborn's own legend outside it failed ("left cannot be >= right"), and the
    analyze job, and the report, with it."""
    names = {"a": "bert.encoder.layer.0.output.dense", "b": "bert.encoder.layer.1.attention.self.query"}
    table = table[table["computation"] == "forward"].assign(layer=lambda t: t["layer"].map(names))
    analyze.figures(table, tmp_path)
    fig = drawn["distributions"]
    fig.canvas.draw()
    right = max(ax.get_tightbbox().x1 for ax in fig.axes)
    legend = fig.legends[0]
    assert {t.get_text() for t in legend.get_texts()} == set(names.values())
    assert 0 < (legend.get_window_extent().x0 - right) / fig.dpi < 0.5
