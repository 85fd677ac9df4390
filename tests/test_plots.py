"""plots.curves: a static matplotlib figure always, a plotly twin only when someone is watching."""
import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import EllipseCollection, PolyCollection  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from workbench import plots  # noqa: E402

X = np.arange(0, 50, 10)


def test_curves_draws_one_line_per_series_and_a_band_over_runs():
    runs = np.array([[0.0, 1, 2, 3, 4], [2.0, 3, 4, 5, 6]])       # 2 runs x 5 points
    fig = plots.curves({"a": runs, "b": np.ones(5)}, x=X, title="T", xlabel="step", ylabel="y")
    ax = fig.axes[0]
    assert ax.get_title() == "T" and ax.get_xlabel() == "step" and ax.get_ylabel() == "y"
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"a (n=2)", "b"}
    np.testing.assert_allclose(lines["a (n=2)"].get_ydata(), runs.mean(0))   # the mean of runs
    np.testing.assert_allclose(lines["a (n=2)"].get_xdata(), X)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1                                        # only the series with runs
    assert ax.get_legend() is not None


def test_curves_takes_a_dataframe_with_an_x_column_and_panels():
    df = pd.DataFrame({"step": X, "loss": np.linspace(1, 0.1, 5), "norm": np.linspace(1, 3, 5)})
    fig = plots.curves(df, x="step", title="T", xlabel="step", ylabel="value", logy=True)
    assert [ln.get_label() for ln in fig.axes[0].get_lines()] == ["loss", "norm"]
    assert fig.axes[0].get_yscale() == "log"
    panels = {"left": {"a": np.ones(5)}, "right": df.set_index("step")}
    fig = plots.curves(panels, x=X, title="both", xlabel="step", ylabel={"left": "L", "right": "R"})
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["left", "right"]
    assert [ax.get_ylabel() for ax in visible] == ["L", "R"]
    assert fig._suptitle.get_text() == "both"


def test_curves_rejects_mismatched_or_unknown_input():
    with pytest.raises(ValueError, match="shape"):
        plots.curves({"a": np.ones(4)}, x=X, title="T", xlabel="x", ylabel="y")
    with pytest.raises(KeyError, match="columns"):
        plots.curves(pd.DataFrame({"a": [1.0]}), x="step", title="T", xlabel="x", ylabel="y")
    with pytest.raises(TypeError, match="DataFrame or a dict"):
        plots.curves([1, 2, 3], title="T", xlabel="x", ylabel="y")


def test_curves_saves_the_static_figure_into_the_run(tmp_path):
    class FakeRun:
        saved = []

        def savefig(self, fig, name, twin=True):
            self.saved.append((fig, name, twin))
    run = FakeRun()
    fig = plots.curves({"a": np.ones(5)}, x=X, title="T", xlabel="x", ylabel="y", run=run, name="c")
    assert run.saved == [(fig, "c", False)]        # curves shows its own plotly figure


def test_curves_shows_plotly_only_when_interactive(monkeypatch):
    shown = []
    monkeypatch.setattr(plots, "display", lambda obj: shown.append(obj))
    data = {"a": np.vstack([np.zeros(5), np.ones(5)]), "b": np.arange(5.0)}
    monkeypatch.setattr(plots, "interactive", lambda: False)
    fig = plots.curves(data, x=X, title="T", xlabel="x", ylabel="y")
    assert shown == [] and fig.axes                               # batch runs: matplotlib only
    monkeypatch.setattr(plots, "interactive", lambda: True)
    fig = plots.curves(data, x=X, title="T", xlabel="x", ylabel="y")
    assert len(shown) == 1 and fig.axes                           # the static figure is still returned
    pfig = shown[0]
    named = [t for t in pfig.data if t.showlegend is not False]
    assert [t.name for t in named] == ["a (n=2)", "b"]
    np.testing.assert_allclose(named[0].y, [0.5] * 5)
    assert sum(t.fill == "tonexty" for t in pfig.data) == 1       # one band, for the runs
    assert pfig.layout.title.text == "T"


def test_plotly_twin_redraws_lines_and_points_and_refuses_what_it_cannot_carry():
    import matplotlib.pyplot as plt
    from workbench import plots
    fig, (a, b) = plt.subplots(1, 2)
    a.plot([1, 10, 100], [3, 2, 1], "o--", color="#1f5a96", label="adam")
    a.plot([1, 10, 100], [2, 2, 2], label="_hidden")
    a.set(xscale="log", xlabel="lr", ylabel="loss", title="sweep")
    b.scatter([0.1, 0.2], [5, 6], color="#d1495b", label="runs")
    twin = plots.plotly_twin(fig)
    names = [t.name for t in twin.data]
    assert names == ["adam", "", "runs"] and [t.showlegend for t in twin.data] == [True, False, True]
    assert twin.data[0].mode == "lines+markers" and twin.data[0].line.dash == "dash"
    assert list(twin.data[0].x) == [1, 10, 100] and twin.data[0].line.color == "#1f5a96"
    assert twin.layout.xaxis.type == "log" and twin.layout.xaxis.title.text == "lr"
    assert twin.data[2].xaxis == "x2" and list(twin.data[2].y) == [5, 6]
    plt.close(fig)
    # bars, a band and an image come along; a mesh or a free span does not (no twin)
    fig, (a, b) = plt.subplots(1, 2)
    a.bar([1, 2], [3, 4], width=0.5, label="acc")
    a.fill_between([1, 2], [0, 0], [1, 1], alpha=0.2, label="_band")
    b.imshow(np.arange(6).reshape(2, 3))
    twin = plots.plotly_twin(fig)
    kinds = sorted(type(t).__name__ for t in twin.data)
    assert kinds == ["Bar", "Heatmap", "Scatter"]
    bar = [t for t in twin.data if type(t).__name__ == "Bar"][0]
    assert list(bar.x) == [1, 2] and list(bar.y) == [3, 4] and bar.name == "acc"
    assert twin.layout.yaxis2.autorange == "reversed"
    plt.close(fig)
    # a mesh, a span, a rectangle and segments come along too, in data coordinates
    fig, ax = plt.subplots()
    ax.plot([0, 4], [0, 4])
    ax.pcolormesh([0, 1, 2], [0, 1, 3], np.arange(4).reshape(2, 2))
    ax.axvspan(1, 2, color="red", alpha=0.3, label="window")
    ax.add_patch(Rectangle((3, 0.5), 0.5, 1, fill=False, ec="red"))
    ax.vlines([0.5, 3.5], 0, 1)
    ax.set_ylim(0, 4)
    twin = plots.plotly_twin(fig)
    mesh = [t for t in twin.data if type(t).__name__ == "Heatmap"][0]
    assert list(mesh.x) == [0.5, 1.5] and list(mesh.y) == [0.5, 2.0]
    assert mesh.z.tolist() == [[0, 1], [2, 3]]
    span = [t for t in twin.data if t.name == "window"][0]
    assert (min(span.x), max(span.x), min(span.y), max(span.y)) == pytest.approx((1, 2, 0, 4))
    assert span.fill == "toself"
    lines = [t for t in twin.data if type(t).__name__ == "Scatter" and t.mode == "lines"]
    rect = [t for t in lines if t.fill is None and None not in t.x and len(t.x) > 2][-1]
    assert (min(rect.x), max(rect.x), min(rect.y), max(rect.y)) == pytest.approx((3, 3.5, 0.5, 1.5))
    seg = [t for t in lines if None in t.x][0]
    assert [None if v is None else round(v, 9) for v in seg.x] == [0.5, 0.5, None, 3.5, 3.5, None]
    assert list(seg.y)[:2] == pytest.approx([0, 1])
    plt.close(fig)
    # what it cannot carry still gives no twin
    fig, ax = plt.subplots()
    ax.add_collection(EllipseCollection([1], [1], [0], offsets=[(0, 0)], offset_transform=ax.transData))
    assert plots.plotly_twin(fig) is None
    plt.close(fig)


def test_savefig_shows_the_twin_only_in_a_live_session(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from workbench import plots, runtime
    shown = []
    monkeypatch.setattr(plots, "display", shown.append)
    run = runtime.Run.__new__(runtime.Run)
    run.out_dir, run.figures = tmp_path, []
    (tmp_path / "figures").mkdir()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0], label="x")
    run.savefig(fig, "a")                            # not live: the png alone
    assert shown == [] and (tmp_path / "figures" / "a.png").exists()
    monkeypatch.setattr(runtime, "interactive", lambda: True)
    monkeypatch.setattr(plots, "interactive", lambda: True)
    run.savefig(fig, "b")
    assert len(shown) == 1 and shown[0].data[0].name == "x"
    plt.close(fig)


def test_a_runner_job_keeps_the_plotly_twins_in_the_executed_notebook(tmp_path, monkeypatch):
    """`workbench run` (WORKBENCH_BATCH) puts each twin into the notebook as plotly's output type,
    JSON-ready, for the book and JupyterLab; nbval and scripts do not."""
    import json

    import matplotlib.pyplot as plt
    from workbench import runtime
    kept = []
    monkeypatch.setattr(plots, "display", lambda obj, raw=False: kept.append((obj, raw)))
    monkeypatch.setattr(plots, "in_ipython", lambda: True)
    monkeypatch.setattr(runtime, "in_ipython", lambda: True)
    monkeypatch.delenv("WORKBENCH_BATCH", raising=False)
    data = {"a": np.vstack([np.zeros(5), np.ones(5)])}
    plots.curves(data, x=X, title="T", xlabel="x", ylabel="y")
    assert kept == []                                              # nbval: the PNG alone
    monkeypatch.setenv("WORKBENCH_BATCH", "1")
    plots.curves(data, x=X, title="T", xlabel="x", ylabel="y")
    run = runtime.Run.__new__(runtime.Run)
    run.out_dir, run.figures = tmp_path, []
    (tmp_path / "figures").mkdir()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0], label="x")
    ax.set_title("saved")
    run.savefig(fig, "a")
    plt.close(fig)
    assert [raw for _, raw in kept] == [True, True]
    curves, saved = (json.loads(json.dumps(b))[plots.PLOTLY_MIME] for b, _ in kept)
    assert curves["layout"]["title"]["text"] == "T" and saved["data"][0]["name"] == "x"
    assert all("text/plain" in b for b, _ in kept)
    value = [0.123456789, {"y": [2.0000000000000004]}, "s"]    # keep_twin: 5 digits
    assert plots.rounded(value, 5) == [0.12346, {"y": [2.0]}, "s"]
