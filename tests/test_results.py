"""Recorded results (workbench.results) and the run comparison (workbench.compare)."""
import json
from pathlib import Path

import pytest

from workbench import compare, results


def notebook(root: Path, slug: str, code: str, md: str = "# title") -> Path:
    nb = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": [md]},
                    {"cell_type": "code", "id": "b", "metadata": {}, "source": [code],
                     "outputs": [], "execution_count": None},
                    {"cell_type": "code", "id": "c", "metadata": {"tags": ["results"]},
                     "source": [f'results.show("{slug}")'], "outputs": [], "execution_count": None}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    p = root / "notebooks" / f"{slug}.ipynb"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(nb))
    return p


def job(run: Path, slug: str, seed: int, acc: float, holds: bool, status="ok", params="smoke",
        zoo=None):
    d = run / slug / params / f"seed-{seed}"
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({
        "notebook": slug, "seed": seed, "duration_s": 10.0 + seed,
        "metrics": {"acc": acc, "train_s": 3.0 * seed, "curve": [acc, acc / 2]},
        "claims": [{"id": "C1", "text": "acc is high", "holds": holds, "robust": True,
                    "evidence": {"acc": acc}}], **({"zoo": zoo} if zoo is not None else {})}))
    (d / "job.json").write_text(json.dumps({"status": status}))


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    notebook(tmp_path, "99-demo", "x = 1\n")
    return tmp_path


def test_record_aggregates_the_seeds_and_stale_follows_the_code(project):
    run = project / "runs"
    for s, (a, h) in enumerate([(0.5, True), (0.7, True), (0.9, False)]):
        job(run, "99-demo", s, a, h)
    assert results.stale("99-demo") == [f"no recorded results ({results.path('99-demo')})"]
    assert results.record(run) == [results.path("99-demo")]
    d = results.load("99-demo")
    assert d["claims"]["C1"]["holds"] == [True, True, False]
    assert d["metrics"]["acc"]["mean"] == pytest.approx(0.7)
    assert d["metrics"]["acc"]["values"] == [0.5, 0.7, 0.9]
    assert results.stale("99-demo") == []
    # prose and the results cell may change; code may not
    notebook(project, "99-demo", "x = 1\n", md="# another title")
    assert results.stale("99-demo") == []
    notebook(project, "99-demo", "x = 2\n")
    assert results.stale("99-demo") == ["the notebook's code cells changed since the record"]


def test_a_record_goes_stale_only_when_a_zoo_entry_its_runs_used_moves(project, monkeypatch):
    from workbench.models import recipes
    run = project / "runs"
    for s in range(3):
        job(run, "99-demo", s, 0.5, True, zoo=["lm-tiny"] if s else ["lm-tiny", "lora-pool"])
    results.record(run)
    d = results.load("99-demo")
    assert d["key"]["zoo_scope"] == "used" and sorted(d["key"]["zoo"]) == ["lm-tiny", "lora-pool"]
    assert results.stale("99-demo") == []
    # another recipe moves: this record does not care; its own recipe moves: stale
    monkeypatch.setitem(recipes.RECIPES, "lm-base",
                        recipes.replace(recipes.RECIPES["lm-base"], seed=1))
    assert results.stale("99-demo") == []
    monkeypatch.setitem(recipes.RECIPES, "lm-tiny",
                        recipes.replace(recipes.RECIPES["lm-tiny"], seed=1))
    assert results.stale("99-demo") == ["zoo keys moved: lm-tiny"]


def test_a_run_notes_the_zoo_entries_it_looks_up():
    from workbench import cache
    from workbench.models import zoo
    zoo.recipe("lm-micro")
    assert "lm-micro" in cache.used()


def test_a_failed_or_missing_seed_records_nothing(project):
    run = project / "runs"
    job(run, "99-demo", 0, 0.5, True)
    job(run, "99-demo", 1, 0.5, True, status="failed")
    job(run, "99-demo", 2, 0.5, True)
    assert results.record(run) == [] and results.load("99-demo") is None


def test_say_fills_numbers_from_the_record(project, capsys):
    run = project / "runs"
    for s, (a, h) in enumerate([(0.5, True), (0.7, True), (0.9, False)]):
        job(run, "99-demo", s, a, h)
    results.record(run)
    text = results.render("99-demo", "C1 holds on {claims[C1]} seeds; acc {metrics[acc]:.2f}, "
                                  "{metrics[nope]:.2f} over seeds {seeds}.")
    assert text == "C1 holds on 2/3 seeds; acc 0.70 ± 0.20, ? over seeds 0, 1, 2."    # ddof 1
    assert results.render("99-demo", "{metrics[nope].mean:.1f} {metrics[acc].mean:.1f}") == "? 0.7"
    assert format(results.Stat(5.0, 0.0, [5, 5, 5]), ".0f") == "5"          # a constant: no "± 0"
    results.say("99-demo", "C1 {claims[C1]}")
    assert capsys.readouterr().out == "C1 2/3\n"              # outside Jupyter: printed
    table = results.table("99-demo")
    assert "| C1 | acc is high | yes | holds | holds | does not hold | 2/3 |" in table


def test_findings_page_is_current():
    page = Path(__file__).parents[1] / "docs" / "findings.md"
    assert page.read_text() == results.findings(), \
        "docs/findings.md is stale: python -m workbench.results findings > docs/findings.md"


def test_compare_reports_moved_metrics_and_verdicts_not_timings(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    job(a, "99-demo", 0, 0.5, True)
    job(b, "99-demo", 0, 0.5, True)
    (b / "99-demo/smoke/seed-0/metrics.json").write_text(
        (b / "99-demo/smoke/seed-0/metrics.json").read_text().replace('"train_s": 0.0',
                                                                      '"train_s": 9.0'))
    c = compare.compare(a, b)
    assert (c["differences"], c["compared"]) == ([], 1)   # a timing moved: nothing to report
    assert all(compare.is_timing(k) for k in ("c3_cost.step_ms.dora", "cost.step_ms / LoRA.full",
                                               "esig_cost_ratio", "build_seconds", "train_s",
                                               "per_candidate.lm-gpt2.answer alone (s)",
                                               "c5_latency_overhead", "step_s_ste", "timing_exponent"))
    assert not any(compare.is_timing(k) for k in ("acc", "loss_s0", "mean_spikes", "steps"))
    job(b, "99-demo", 1, 0.5, True)
    c = compare.compare(a, b)
    assert (c["differences"], c["compared"]) == ([], 1)
    assert c["unpaired"] == ["99-demo/smoke/seed-1: only in after"]
    c = tmp_path / "c"
    job(c, "99-demo", 0, 0.5000001, False)
    lines = compare.compare(a, c)["differences"]
    assert "99-demo/smoke/seed-0: claim C1: holds True -> False" in lines
    assert any(line.startswith("99-demo/smoke/seed-0: metric acc: 0.5 -> 0.5000001")
               for line in lines)
    assert any("metric curve.1" in line for line in lines)
    assert compare.compare(a, c, tol=1e-3)["differences"] == [
        "99-demo/smoke/seed-0: claim C1: holds True -> False"]
    assert compare.main([str(a), str(a)]) == 0 and compare.main([str(a), str(c)]) == 1
    from workbench import cli                          # a subcommand like the others
    assert cli.main(["compare", str(a), str(a)]) == 0
    assert cli.main(["compare", str(a), str(c), "--tol", "1e-3"]) == 1
    assert cli.main(["compare", str(a), str(tmp_path / "nowhere")]) == 2
    more = json.loads((a / "99-demo/smoke/seed-0/metrics.json").read_text())
    more["metrics"]["new"] = 1.0                       # recorded for the prose: added, not moved
    assert compare.diff_metrics(json.loads((a / "99-demo/smoke/seed-0/metrics.json").read_text()),
                                more) == []
    assert compare.added_metrics({"metrics": {}}, more) == ["acc", "curve.0", "curve.1", "new"]


def test_report_only_reports_and_record_writes_the_records(project, capsys):
    """The records are tracked files: `workbench report` writes only inside its folder, and
    `workbench record` is the one command that writes notebooks/results/."""
    from workbench import cli
    run = project / "runs"
    for s in (0, 1, 2):
        job(run, "99-demo", s, 0.5 + s / 10, True)
    assert cli.main(["report", str(run), "--no-html"]) == 0
    assert "recorded" not in capsys.readouterr().out
    assert results.load("99-demo") is None and not results.results_dir().exists()
    assert (run / "aggregate.csv").exists()
    with pytest.raises(SystemExit):                       # the option is gone with the behaviour
        cli.main(["report", str(run), "--no-record"])
    assert cli.main(["record", str(run)]) == 0
    assert f"recorded: {results.path('99-demo')}" in capsys.readouterr().out
    assert results.load("99-demo")["claims"]["C1"]["holds"] == [True, True, True]
    assert cli.main(["record", str(run), "99-demo"]) == 0          # one notebook of the folder
    capsys.readouterr()


def test_record_says_why_nothing_was_recorded(project, capsys):
    from workbench import cli
    run = project / "runs"
    job(run, "99-demo", 0, 0.5, True)                     # one seed of three
    assert cli.main(["record", str(run)]) == 1
    err = capsys.readouterr().err
    assert "not recorded: 99-demo" in err and "nothing recorded" in err
    assert results.load("99-demo") is None
    assert cli.main(["record", str(project / "nowhere")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert cli.main(["record", str(run), "98-nothing"]) == 2


def test_what_we_saw_and_aggregate_csv_give_one_spread(project):
    """The record (What we saw) and aggregate.csv take mean and std from one place: the sample
    std (ddof 1), 0 for one seed."""
    from workbench import report, stats
    run = project / "runs"
    for s, a in enumerate([0.5, 0.7, 1.2]):
        job(run, "99-demo", s, a, True)
    results.record(run)
    report.build(run, html=False)
    agg = {r["metric"]: r for r in report.aggregate_rows(report.collect(run))}
    rec = results.load("99-demo")["metrics"]["acc"]
    assert rec["std"] == agg["acc"]["std"] == pytest.approx(0.3605551275)
    assert rec["mean"] == agg["acc"]["mean"] == pytest.approx(0.8)
    assert stats.mean_std([2.0]) == (2.0, 0.0)
    assert stats.mean_std([1.0, 3.0]) == (2.0, pytest.approx(2 ** 0.5))


def test_a_record_is_carried_over_only_when_no_number_moves(project, capsys):
    """`workbench record AFTER --unchanged-from BEFORE`: a refactor of a notebook's code keeps its
    record when runs of the recorded commit and of today's code agree to the last digit."""
    import subprocess
    from workbench import cli

    def git(*a):
        subprocess.run(["git", *a], cwd=project, check=True, capture_output=True)

    def runs(root: Path, accs, commit=None, dirty=False):
        for s, acc in enumerate(accs):
            job(root, "99-demo", s, acc, True)
            d = root / "99-demo/smoke" / f"seed-{s}"
            (d / "env.json").write_text(json.dumps({"git": {"commit": commit, "dirty": dirty}}))
            (d / "99-demo.ipynb").write_text((project / "notebooks/99-demo.ipynb").read_text())

    git("init", "-q"); git("add", "notebooks"); git("-c", "user.name=t", "-c", "user.email=t@t",
                                                    "commit", "-qm", "recorded")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project, capture_output=True,
                          text=True).stdout.strip()
    runs(project / "rec", [0.5, 0.7, 0.9], head)
    results.record(project / "rec")
    runs(project / "before", [0.5], head)
    notebook(project, "99-demo", "x = 1  # a refactor\n")                  # today's code
    assert results.stale("99-demo") == ["the notebook's code cells changed since the record"]
    runs(project / "moved", [0.5000001])
    runs(project / "after", [0.5])
    assert "moved" in results.rekey("99-demo", project / "before", project / "moved")[0]
    assert "uncommitted" in results.rekey("99-demo", project / "after", project / "after")[0]
    notebook(project, "99-demo", "x = 2\n")                                 # a real change
    assert "did not run today's" in results.rekey("99-demo", project / "before",
                                                  project / "after")[0]
    notebook(project, "99-demo", "x = 1  # a refactor\n")
    assert results.stale("99-demo") != []                                  # nothing written
    assert cli.main(["record", str(project / "after"), "--unchanged-from",
                     str(project / "before")]) == 0
    assert "carried over" in capsys.readouterr().out
    assert results.stale("99-demo") == []
    assert results.load("99-demo")["metrics"]["acc"]["values"] == [0.5, 0.7, 0.9]


def test_compare_leaves_out_what_a_run_reads_off_the_clock(tmp_path):
    """Wall-clock measures a name does not give away are named by the run (``run.clock``, a
    claim's ``clock=``); either run's list counts, so an older run without one compares too."""
    from workbench.runtime import Run
    runs = {}
    for name, tps in (("a", 100.0), ("b", 250.0)):
        run = Run("99-demo", out_dir=tmp_path / name, params={})
        run.record(acc=0.5)
        run.clock(ratio=tps / 200)
        run.claim("C1", "fast enough", holds=True, clock=("repeats",),
                  evidence={"repeats": [tps, tps], "flops": 10})
        runs[name] = run.summary()
    assert runs["a"]["clock"] == ["ratio"] and runs["a"]["claims"][0]["clock"] == ["repeats"]
    assert compare.diff_metrics(runs["a"], runs["b"]) == []
    older = {**runs["a"], "clock": [], "claims": [{**runs["a"]["claims"][0], "clock": []}]}
    assert compare.diff_metrics(older, runs["b"]) == []
    runs["b"]["metrics"]["acc"] = 0.6
    runs["b"]["claims"][0]["evidence"]["flops"] = 11
    assert compare.diff_metrics(runs["a"], runs["b"]) == [
        "metric acc: 0.5 -> 0.6", "claim C1 evidence flops: 10 -> 11"]
    with pytest.raises(KeyError, match="does not hold"):
        Run("99-demo", out_dir=tmp_path / "c", params={}).claim(
            "C1", "x", holds=True, evidence={"a": 1}, clock=("b",))


def test_a_mid_run_is_recorded_beside_the_smoke_record(project, capsys):
    """``notebooks/results/mid/<slug>.json``: the same key and aggregation, its own staleness;
    What we saw shows both scales and prose reads the mid record as ``{mid....}``."""
    run = project / "runs"
    for s, (a, h) in enumerate([(0.5, True), (0.7, True), (0.9, False)]):
        job(run, "99-demo", s, a, h)
        job(run, "99-demo", s, a + 0.05, True, params="mid")
    written = results.record(run)
    assert written == [results.path("99-demo"), results.path("99-demo", "mid")]
    assert results.path("99-demo", "mid") == project / "notebooks/results/mid/99-demo.json"
    mid = results.load("99-demo", "mid")
    assert mid["scale"] == "mid" and mid["claims"]["C1"]["holds"] == [True, True, True]
    assert mid["metrics"]["acc"]["mean"] == pytest.approx(0.75)
    assert results.stale("99-demo", "mid") == []
    shown = results.scales_table("99-demo")
    assert "| C1 | acc is high | yes | 2/3 | 3/3 |" in shown and "mid scale" in shown
    assert results.render("99-demo", "{claims[C1]} then {mid.claims[C1]}, "
                          "{mid.metrics[acc]:.2f}") == "2/3 then 3/3, 0.75 ± 0.20"
    results.path("99-demo", "mid").unlink()
    assert results.render("99-demo", "at mid {mid.claims[C1]}") == "at mid ?"
    assert "No recorded runs of 99-demo at mid" in results.scales_table("99-demo")
    with pytest.raises(ValueError, match="records are kept at"):
        results.path("99-demo", "full")


def test_an_edit_to_other_scales_rows_keeps_a_record(project):
    """A record at one scale survives edits a run at that scale cannot see (comments, the other
    scales' rows of SIZES), and follows the row it names (``"mid": "smoke"``)."""
    before = 'SIZES = {"smoke": {"n": 1}, "full": {"n": 9}}\nx = 1\n'
    notebook(project, "99-demo", before)
    text = (project / "notebooks/99-demo.ipynb").read_text()
    run = project / "runs"
    for s in range(3):
        job(run, "99-demo", s, 0.5, True)
        job(run, "99-demo", s, 0.5, True, params="mid")
    results.record(run)
    notebook(project, "99-demo", 'SIZES = {"smoke": {"n": 1},  # why\n  "mid": "smoke", '
                                 '"full": {"n": 10}}\nx = 1\n')
    assert results.rekey_rows("99-demo", text, "smoke")
    assert results.stale("99-demo") == []
    # the mid record was made when mid had no row: what mid runs now is the smoke row
    assert results.rekey_rows("99-demo", text, "mid") is False
    mid_text = (project / "notebooks/99-demo.ipynb").read_text()
    results.record(run)                                       # record mid again, at this text
    notebook(project, "99-demo", 'SIZES = {"smoke": {"n": 2}, "mid": "smoke", "full": {"n": 10}}\n'
                                 'x = 1\n')
    assert not results.rekey_rows("99-demo", mid_text, "mid")       # its smoke row moved
    notebook(project, "99-demo", 'SIZES = {"smoke": {"n": 1}, "mid": "smoke", "full": {"n": 3}}\n'
                                 'x = 1\n')
    assert results.rekey_rows("99-demo", mid_text, "mid")
    notebook(project, "99-demo", 'SIZES = {"smoke": {"n": 1}, "mid": "smoke", "full": {"n": 3}}\n'
                                 'x = 2\n')
    assert not results.rekey_rows("99-demo", mid_text, "mid")       # code moved
    # a row written as another plus changes follows the row it names too
    notebook(project, "99-demo", 'SIZES = {"smoke": {"n": 1}, "mid": {"like": "smoke", "n": 2}}\n'
                                 'x = 1\n')
    like_text = (project / "notebooks/99-demo.ipynb").read_text()
    results.record(run)
    notebook(project, "99-demo", 'SIZES = {"smoke": {"n": 9}, "mid": {"like": "smoke", "n": 2}}\n'
                                 'x = 1\n')
    assert not results.rekey_rows("99-demo", like_text, "mid")


def test_the_judging_seeds_are_recorded_beside_the_record(project, capsys):
    """``workbench record DIR --seeds 3,4,5``: a changed criterion's judging seeds, in
    ``judging/``, rendered into docs/decisions.md's section; other seed sets are refused."""
    from workbench import cli
    run = project / "runs"
    for s in (3, 4, 5):
        job(run, "99-demo", s, 0.6, s != 4)
    assert cli.main(["record", str(run), "--seeds", "3,4,5"]) == 0
    p = results.path("99-demo", "smoke", results.JUDGING)
    assert p == project / "notebooks/results/judging/99-demo.json" and p.is_file()
    assert results.load("99-demo") is None                 # the seeds 0-2 record is untouched
    assert results.load("99-demo", "smoke", (3, 4, 5))["claims"]["C1"]["holds"] == [True, False, True]
    section = results.judging()
    assert "### 99-demo at smoke, seeds 3, 4, 5" in section and "| 2/3 |" in section
    assert cli.main(["record", str(run), "--seeds", "3,4"]) == 2
    assert "records cover seeds" in capsys.readouterr().err


def test_the_judging_section_of_decisions_is_current():
    text = (Path(__file__).resolve().parents[1] / "docs/decisions.md").read_text()
    assert results.judging() in text, "python -m workbench.results judging"
