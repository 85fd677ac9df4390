"""Explorers: static default picture under papermill/nbval, live controls that redraw."""
import matplotlib.pyplot as plt
import pandas as pd
import pytest

from workbench import explore as E


def _draw_log():
    calls = []

    def draw(**v):
        calls.append(v)
        fig, ax = plt.subplots()
        ax.set_title(repr(v))
        return fig
    return calls, draw


@pytest.fixture
def shown(monkeypatch):
    figs = []
    monkeypatch.setattr(E, "_show", figs.append)
    return figs


def test_static_fallback_draws_the_default_state_once(capsys, shown):
    calls, draw = _draw_log()
    out = E.explore(draw, bits=[2, 3, 4], mode=["rtn", "gptq"], tail=E.range_(1.0, 3.0, 0.5),
                    show=True)
    assert out is None                      # shown once, not again as the cell's value
    assert calls == [{"bits": 2, "mode": "rtn", "tail": 1.0, "show": True}]
    assert len(shown) == 1 and isinstance(shown[0], plt.Figure)
    text = capsys.readouterr().out
    assert "default (bits=2, mode=rtn, tail=1.0, show=True)" in text
    assert "bits {2, 3, 4}; mode {'rtn', 'gptq'}; tail 1.0..3.0 in steps of 0.5; show on or off" \
        in text
    E.explore(draw, sigma=E.choice_([0.0, 0.1, 0.5], 0.1),
              family=E.choice_(["add", "sub, mul"], "sub, mul"))
    assert calls[-1] == {"sigma": 0.1, "family": "sub, mul"}
    assert "family {'add', 'sub, mul'}" in capsys.readouterr().out


def test_live_controls_redraw_when_moved(monkeypatch):
    monkeypatch.setattr(E, "interactive", lambda: True)
    boxes = []
    monkeypatch.setattr(E, "display", boxes.append)
    calls, draw = _draw_log()
    E.explore(draw, bits=[2, 3, 4], mode=["rtn", "gptq"], tail=E.range_(1.0, 3.0, 0.5, 2.0))
    box = boxes[-1]
    controls = {c.description: c for c in box.children[0].children}
    assert type(controls["bits"]).__name__ == "SelectionSlider"
    assert type(controls["mode"]).__name__ == "Dropdown"
    assert type(controls["tail"]).__name__ == "FloatSlider" and controls["tail"].value == 2.0
    assert calls[-1] == {"bits": 2, "mode": "rtn", "tail": 2.0}
    controls["bits"].value = 4
    controls["mode"].value = "gptq"
    assert calls[-1] == {"bits": 4, "mode": "gptq", "tail": 2.0}
    E.explore(draw, block=E.range_(1, 8, 1, 4))
    slider = boxes[-1].children[0].children[0]
    assert type(slider).__name__ == "IntSlider" and slider.value == 4
    slider.value = 6
    assert calls[-1] == {"block": 6} and isinstance(calls[-1]["block"], int)
    E.explore(draw, sigma=E.choice_([0.0, 0.1, 0.5], 0.1))
    assert boxes[-1].children[0].children[0].value == 0.1 and calls[-1] == {"sigma": 0.1}


def test_bad_knobs_are_refused_with_what_to_give():
    _, draw = _draw_log()
    with pytest.raises(ValueError, match="at least one knob"):
        E.explore(draw)
    with pytest.raises(ValueError, match="no values"):
        E.explore(draw, bits=[])
    with pytest.raises(TypeError, match="range_"):
        E.explore(draw, bits={2, 3})
    with pytest.raises(ValueError, match="outside"):
        E.range_(0.0, 1.0, 0.1, 2.0)
    with pytest.raises(ValueError, match="not one of"):
        E.choice_([1, 2], 3)


def test_explore_table_picks_rows_by_the_knobs(shown):
    t = pd.DataFrame({"bits": [2, 2, 3, 3, 2, 2], "group": [8, 32, 8, 32, 8, 32],
                      "method": ["rtn", "rtn", "rtn", "rtn", "gsq", "gsq"],
                      "ppl": [30.0, 40.0, 12.0, 14.0, 20.0, 25.0]})
    E.explore_table(t, x="group", y="ppl", knobs=["bits"], by="method", title="ppl",
                    ylabel="perplexity")
    fig = shown[-1]
    assert fig.axes[0].get_ylabel() == "perplexity"
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    assert lines == {"rtn": [30.0, 40.0], "gsq": [20.0, 25.0]}          # bits=2, the default
    with pytest.raises(KeyError, match="no column"):
        E.explore_table(t, x="group", y="loss", knobs=["bits"])
