"""The batch report from run directories written by hand (no notebook runs): the long
aggregate.csv, per-notebook tables, and escaping of every string that comes from a notebook."""
import json

import pandas as pd
import pytest

from workbench import report


def _job(root, slug, params, seed, metrics, claims, status="ok", error="", error_cell=""):
    tag = ",".join(f"{k}={v}" for k, v in params.items())
    d = root / slug / ("smoke" + (f"-{tag}" if tag else "")) / f"seed-{seed}"
    d.mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({
        "job": {"slug": slug, "params": params, "scale": "smoke", "seed": seed},
        "status": status, "duration_s": 3.0, "error": error, "error_cell": error_cell}))
    if status == "ok":
        (d / "metrics.json").write_text(json.dumps({
            "notebook": slug, "scale": "smoke", "seed": seed, "duration_s": 2.0,
            "metrics": metrics, "claims": claims, "figures": []}))
    return d


def test_aggregate_is_long_with_mean_std_n_seeds(tmp_path):
    c = lambda holds: [{"id": "C1", "text": "t", "holds": holds, "robust": True}]
    for seed, (loss, holds) in enumerate([(1.0, True), (2.0, False), (4.0, True)]):
        _job(tmp_path, "12-nfi", {"lr": 0.1}, seed, {"loss": loss, "name": "text"}, c(holds))
    _job(tmp_path, "12-nfi", {"lr": 0.3}, 0, {"loss": 9.0}, c(True))
    _job(tmp_path, "09-dormant", {}, 0, {"acc": 0.5, "ok": True}, [])
    _job(tmp_path, "09-dormant", {}, 1, {}, [], status="failed", error="boom")
    (tmp_path / "12-nfi/smoke-lr=0.1/.seed-9.partial").mkdir()    # staging: never read
    (tmp_path / "12-nfi/smoke-lr=0.1/.seed-9.partial/metrics.json").write_text("{\"metr")
    report.build(tmp_path, html=False)
    agg = pd.read_csv(tmp_path / "aggregate.csv")
    assert list(agg.columns) == ["notebook", "params", "metric", "mean", "std", "n", "seeds"]
    key = agg.set_index(["notebook", "params", "metric"])
    loss = key.loc[("12-nfi", "lr=0.1, scale=smoke", "loss")]
    assert (loss["mean"], loss["n"], loss["seeds"]) == (pytest.approx(7 / 3), 3, "0,1,2")
    assert loss["std"] == pytest.approx(pd.Series([1.0, 2.0, 4.0]).std())
    assert key.loc[("12-nfi", "lr=0.1, scale=smoke", "claim:C1"), "mean"] == pytest.approx(2 / 3)
    assert key.loc[("12-nfi", "lr=0.3, scale=smoke", "loss"), "std"] == 0.0
    # one failed seed is not averaged in; text metrics are not numbers; a bool is
    assert key.loc[("09-dormant", "scale=smoke", "acc"), "n"] == 1
    assert key.loc[("09-dormant", "scale=smoke", "ok"), "mean"] == 1.0
    assert "name" not in set(agg["metric"])
    assert len(agg) == 2 + 2 + 2        # (loss, C1) x 2 grid points of 12, (acc, ok) of 09
    wide = agg.pivot_table(index=["notebook", "params"], columns="metric", values="mean")
    assert wide.loc[("12-nfi", "lr=0.3, scale=smoke"), "loss"] == 9.0
    res = pd.read_csv(tmp_path / "results.csv")
    assert len(res) == 6 and "seed-9" not in "".join(res.astype(str).sum())
    # the HTML has one table per notebook, metrics down and grid points across
    page = (tmp_path / "index.html").read_text()
    nfi = page.split('id="12-nfi"')[1].split('<h2 id=')[0]
    assert "<th>lr=0.1, scale=smoke</th><th>lr=0.3, scale=smoke</th>" in nfi
    assert "2.333 ± 1.528 (3)" in nfi and "acc" not in nfi


def test_every_string_from_a_notebook_is_escaped(tmp_path):
    evil = "<script>alert(1)</script>"
    _job(tmp_path, "12-nfi", {"label": "<b>bold</b>"}, 0, {"<i>m</i>": 1.0},
         [{"id": "C1", "text": f"claim {evil}", "holds": True, "robust": False}])
    _job(tmp_path, "12-nfi", {"label": "x"}, 1, {}, [], status="failed",
         error="ValueError: <img src=x onerror=alert(2)>", error_cell=f"cell 3: {evil}")
    page = report.build(tmp_path, html=False).read_text()
    for raw in (evil, "<b>bold</b>", "<i>m</i>", "<img src=x"):
        assert raw not in page
    assert "claim &lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "&lt;img src=x onerror=alert(2)&gt;" in page


def test_report_of_a_missing_directory_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="--out directory"):
        report.build(tmp_path / "nothing")


def test_a_truncated_metrics_json_is_not_ok(tmp_path):
    # job.json says ok but metrics.json was cut short: the report must not say ok
    d = _job(tmp_path, "12-nfi", {}, 0, {"loss": 1.0}, [])
    (d / "metrics.json").write_text('{"notebook": "12-nfi", "metr')
    _job(tmp_path, "12-nfi", {}, 1, {"loss": 1.0}, [])
    (rec0, rec1) = sorted(report.collect(tmp_path), key=lambda r: r["seed"])
    assert rec0["status"] == "failed" and "not readable" in rec0["error"]
    assert rec1["status"] == "ok"


def test_report_of_an_empty_folder_says_so(tmp_path, capsys):
    # `workbench report` on an empty folder must fail and say why, not exit 0 silently
    from workbench import cli
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "holds no results" in capsys.readouterr().err
    assert not (tmp_path / "index.html").exists()


def test_report_names_date_commit_titles_and_explains_its_columns(tmp_path):
    # the report names the run's date, commit and titles; seed columns read "seed 0"
    from workbench import batch
    from workbench.notebooks import NotebookInfo
    c = [{"id": "C1", "text": "t", "holds": True, "robust": False}]
    d = _job(tmp_path, "12-nfi", {}, 0, {"loss": 1.0}, c)
    (d / "env.json").write_text(json.dumps({"git": {"commit": "abcdef0123456789", "dirty": True}}))
    info = NotebookInfo("12", "12-nfi", tmp_path / "12-nfi.ipynb", "Numerical Feature Inflation")
    plan = {"started": "2026-12-05 06:00:00 +0000", "command": "workbench run 12-nfi",
            "git": {"commit": None}, "titles": {info.slug: info.title}, "jobs": []}
    (tmp_path / batch.PLAN_NAME).write_text(json.dumps(plan))
    page = report.build(tmp_path, html=False).read_text()
    assert "started 2026-12-05 06:00:00" in page and "<code>abcdef0123</code>" in page
    assert "uncommitted changes" in page and "12-nfi: Numerical Feature Inflation" in page
    assert "<th>seed 0</th>" in page and "- · seed 0" not in page
    assert "job time (s)" in page and "notebook time (s)" in page and "run.finish()" in page


def test_report_writes_nothing_outside_its_folder(tmp_path, monkeypatch, capsys):
    # a three-seed smoke run of a notebook the checkout has: `report` used to record it into
    # the tracked notebooks/results/ unless told not to; recording is `workbench record` now
    from workbench import cli
    home, run = tmp_path / "home", tmp_path / "home" / "runs" / "r"
    (home / "notebooks").mkdir(parents=True)
    (home / "notebooks" / "12-nfi.ipynb").write_text(json.dumps(
        {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    monkeypatch.setenv("WORKBENCH_HOME", str(home))
    c = [{"id": "C1", "text": "t", "holds": True, "robust": False}]
    for seed in (0, 1, 2):
        _job(run, "12-nfi", {}, seed, {"loss": 1.0 + seed}, c)
    before = {p for p in home.rglob("*") if run not in p.parents}
    assert cli.main(["report", str(run), "--no-html"]) == 0
    assert {p for p in home.rglob("*") if run not in p.parents} == before
    assert {"results.csv", "aggregate.csv", "index.html"} <= {p.name for p in run.iterdir()}
    assert "recorded" not in capsys.readouterr().out
