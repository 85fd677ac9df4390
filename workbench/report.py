"""The report of a batch directory: ``results.csv``, ``aggregate.csv`` and ``index.html``.

It reads what the jobs left behind (``job.json`` from the batch runner, ``metrics.json`` from the
notebook, see docs/design.md) and never re-runs anything. Works on any directory holding run
directories, so ``workbench report runs/interactive`` works too; hidden directories (a job's
staging directory) are skipped.

``aggregate.csv`` is long: one row per notebook x parameters x metric (mean, std, n, seeds), so
``pd.read_csv(...).pivot_table(index=["notebook", "params"], columns="metric", values="mean")``
gives the wide view. A claim appears as the metric ``claim:C1`` whose mean is the share of seeds
in which it held. The HTML is rendered by Jinja2 with autoescaping (``report_html.py``), so every
string that comes from a notebook is escaped. No torch and no pandas here: the CLI imports it.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .stats import mean_std

AGGREGATE_COLUMNS = ["notebook", "params", "metric", "mean", "std", "n", "seeds"]
PLAN_NAME = "plan.json"        # written by `workbench run` (batch.write_plan)


class EmptyRunDir(ValueError):
    """The folder holds no job and no plan: nothing to report."""


def collect(root: Path) -> list[dict]:
    """One record per run directory under ``root``: job status plus the notebook's metrics."""
    root = Path(root)
    found = {p.parent for p in root.rglob("job.json")} | {p.parent for p in root.rglob("metrics.json")}
    records = []
    for d in sorted(found):
        rel = d.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue            # a job being assembled, or the leftovers of an interrupted one
        job = read_json(d / "job.json")
        met = read_json(d / "metrics.json")
        spec = job.get("job", {})
        status, error = job.get("status", "ok" if met else "unknown"), job.get("error", "")
        if status in ("ok", "cached") and (d / "metrics.json").exists() and not met:
            status, error = "failed", "metrics.json is not readable JSON (cut short?)"
        elif status in ("ok", "cached") and not (d / "metrics.json").exists():
            status, error = "failed", "metrics.json is missing"
        records.append({
            "dir": d, "rel": rel.as_posix(),
            "notebook": spec.get("slug") or met.get("notebook", d.name),
            "params": spec.get("params", {k: v for k, v in met.get("params", {}).items()
                                          if k not in ("scale", "seed", "device", "out_dir")}),
            "scale": spec.get("scale") or met.get("scale"),
            "seed": spec.get("seed", met.get("seed")),
            "status": status,
            "duration_s": job.get("duration_s", met.get("duration_s")),
            "run_s": met.get("duration_s"),     # start() to finish(): kernel start excluded
            "attempts": job.get("attempts", 1),
            "note": job.get("note", ""),
            "error": error,
            "error_cell": job.get("error_cell", ""),
            "metrics": met.get("metrics", {}),
            "claims": met.get("claims", []),
            "figures": met.get("figures", []),
        })
    return records


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; {} when it is absent, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):       # absent, or unreadable: the record says what it can
        return {}
    return data if isinstance(data, dict) else {}


def planned_but_missing(root: Path, records: list[dict]) -> list[dict]:
    """Records for the jobs ``plan.json`` lists that left no result (the batch was stopped, or
    the runner killed, before they finished), so that every planned job is in the report."""
    plan = read_json(Path(root) / PLAN_NAME)
    have = {r["rel"] for r in records}
    out = []
    for j in plan.get("jobs", []):
        if not isinstance(j, dict) or j.get("dir") in have:
            continue
        out.append({
            "dir": Path(root) / j.get("dir", ""), "rel": j.get("dir", ""),
            "notebook": j.get("slug"), "params": j.get("params") or {}, "scale": j.get("scale"),
            "seed": j.get("seed"), "status": "interrupted", "duration_s": None, "run_s": None,
            "attempts": 0, "note": "", "error": "no result: the batch stopped before this job "
            "finished (`workbench run --resume --out` runs it)", "error_cell": "",
            "metrics": {}, "claims": [], "figures": []})
    return out


def run_info(root: Path, records: list[dict]) -> dict:
    """When the batch started, its command, the git commit(s) and the notebooks' titles: from
    ``plan.json`` when there is one, else from the jobs' ``env.json`` and file times."""
    import time
    root = Path(root)
    plan = read_json(root / PLAN_NAME)
    commits: dict[str, bool] = {}
    git = plan.get("git") or {}
    if git.get("commit"):
        commits[git["commit"]] = bool(git.get("dirty"))
    for r in records:
        g = read_json(Path(r["dir"]) / "env.json").get("git") or {}
        if g.get("commit"):
            commits[g["commit"]] = commits.get(g["commit"], False) or bool(g.get("dirty"))
    started = plan.get("started")
    if not started:
        times = [p.stat().st_mtime for r in records for p in [Path(r["dir"]) / "job.json",
                 Path(r["dir"]) / "metrics.json"] if p.exists()]
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(min(times))) if times else ""
    titles = dict(plan.get("titles") or {})
    missing = {r["notebook"] for r in records} - set(titles)
    if missing:
        try:
            from .notebooks import discover
            titles.update({i.slug: i.title for i in discover() if i.slug in missing})
        except Exception:       # no notebooks folder here: the slugs will do
            pass
    return {"started": started, "command": plan.get("command", ""),
            "commits": [{"commit": c[:10], "dirty": d} for c, d in commits.items()],
            "titles": titles}


def params_key(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "-"


def _number(v) -> float | None:
    """A metric value as a float, or None when it is not a finite-or-inf number (text, lists)."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
        return float(v)
    return None


def results_rows(records: list[dict]) -> list[dict]:
    """One row per job: notebook, parameters, seed, status, duration, scalar metrics
    (``metric:NAME``) and claim verdicts (``claim:ID``)."""
    rows = []
    for r in records:
        row = {"notebook": r["notebook"], "scale": r["scale"], "params": params_key(r["params"]),
               "seed": r["seed"], "status": r["status"], "duration_s": r["duration_s"],
               "run_s": r["run_s"], "attempts": r["attempts"], "note": r["note"],
               "error": r["error"], "error_cell": r["error_cell"]}
        for k, v in r["metrics"].items():
            if isinstance(v, (int, float, bool)) or v is None:
                row[f"metric:{k}"] = v
        for c in r["claims"]:
            row[f"claim:{c['id']}"] = "holds" if c["holds"] else "does not hold"
        rows.append(row)
    return rows


def aggregate_rows(records: list[dict]) -> list[dict]:
    """Long format over the seeds of each notebook x scale x parameters (passed jobs only):
    one row per numeric metric and per claim, with mean, std (:func:`stats.mean_std`: ddof 1,
    0 for one seed), n, seeds.
    ``params`` includes the scale (``scale=smoke, lr=0.01``) so a smoke and a full run of the
    same grid point stay apart."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["status"] in ("ok", "cached"):
            key = (r["notebook"], params_key({"scale": r["scale"], **r["params"]}))
            groups.setdefault(key, []).append(r)
    rows = []
    for (nb, params), recs in sorted(groups.items()):
        recs = sorted(recs, key=lambda r: (r["seed"] is None, r["seed"]))
        series: dict[str, list[tuple]] = {}
        for r in recs:
            for k, v in r["metrics"].items():
                if (x := _number(v)) is not None:
                    series.setdefault(k, []).append((r["seed"], x))
        for r in recs:
            for c in r["claims"]:
                series.setdefault(f"claim:{c['id']}", []).append((r["seed"], float(c["holds"])))
        for metric, pairs in series.items():
            vals = [x for _, x in pairs]
            mean, std = mean_std(vals)
            rows.append({"notebook": nb, "params": params, "metric": metric, "mean": mean,
                         "std": std, "n": len(vals),
                         "seeds": ",".join(str(s) for s, _ in pairs)})
    return rows


def _write_csv(path: Path, rows: list[dict], first: list[str]) -> None:
    cols = list(first)
    for row in rows:
        cols += [k for k in row if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)


def fmt(v) -> str:
    """Numbers to 4 significant digits, None and NaN to blank; the template escapes the rest."""
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def render_notebook(nb_path: Path) -> Path | None:
    """The executed notebook as HTML beside it (skipped when already up to date). About a
    second per notebook (nbconvert), which is why ``workbench run`` leaves it to ``--html`` or
    ``workbench report``."""
    target = nb_path.with_suffix(".html")
    if target.exists() and target.stat().st_mtime >= nb_path.stat().st_mtime:
        return target
    try:
        import nbformat
        from nbconvert import HTMLExporter
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(nb_path, as_version=4))
        target.write_text(body)
        return target
    except Exception:           # a rendering problem must not cost the rest of the report
        return None


def _claims_matrix(recs: list[dict]) -> dict:
    """Claims as rows, runs as columns, verdicts in the cells."""
    ids, texts = [], {}
    for r in recs:
        for c in r["claims"]:
            if c["id"] not in texts:
                ids.append(c["id"])
                texts[c["id"]] = (c.get("text", ""), c.get("robust", False))
    cols = [(f"{params_key(r['params'])} · " if r["params"] else "") + f"seed {r['seed']}"
            for r in recs]
    rows = []
    for cid in ids:
        cells = []
        for r in recs:
            c = next((c for c in r["claims"] if c["id"] == cid), None)
            cells.append(None if c is None else bool(c["holds"]))
        rows.append({"id": cid, "text": texts[cid][0], "robust": texts[cid][1], "cells": cells})
    return {"columns": cols, "rows": rows}


def _aggregate_table(rows: list[dict]) -> dict:
    """One notebook's aggregate rows pivoted: metrics down, parameter sets across."""
    params = list(dict.fromkeys(r["params"] for r in rows))
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    cell = {(r["metric"], r["params"]): r for r in rows}
    body = []
    for m in metrics:
        cells = []
        for p in params:
            r = cell.get((m, p))
            cells.append(None if r is None else {"mean": fmt(r["mean"]), "std": fmt(r["std"]),
                                                 "n": r["n"], "seeds": r["seeds"]})
        body.append({"metric": m, "cells": cells})
    return {"params": params, "rows": body}


def build(root: Path, html: bool = True, require: bool = False) -> Path:
    """Write ``results.csv``, ``aggregate.csv`` and ``index.html`` into ``root``; return the
    path of ``index.html``. ``html``: also render each executed notebook as HTML beside it
    (nbconvert, ~1 s each); without it the report links the ``.ipynb`` (or an HTML page that is
    already there). Every job of the run's ``plan.json`` is listed, those without a result as
    interrupted. ``require``: :class:`EmptyRunDir` when there is nothing to report."""
    from .report_html import render
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; give the --out directory of a run")
    records = collect(root)
    records += planned_but_missing(root, records)
    if require and not records:
        raise EmptyRunDir(f"{root} holds no results (no job.json or metrics.json below it, "
                          "no plan.json); give the --out folder of a run")
    info = run_info(root, records)
    results = results_rows(records)
    agg = aggregate_rows(records)
    _write_csv(root / "results.csv", results, ["notebook", "scale", "params", "seed", "status"])
    _write_csv(root / "aggregate.csv", agg, AGGREGATE_COLUMNS)

    notebooks = []
    for nb in sorted({r["notebook"] for r in records}, key=str):
        recs = [r for r in records if r["notebook"] == nb]
        recs.sort(key=lambda r: (params_key(r["params"]), r["seed"] if r["seed"] is not None
                                 else -1))
        runs = []
        for r in recs:
            executed = r["dir"] / f"{nb}.ipynb"
            page = None
            if executed.exists():
                page = render_notebook(executed) if html else (
                    executed.with_suffix(".html") if executed.with_suffix(".html").exists()
                    else None)
            figures = [{"href": f"{r['rel']}/figures/{name}", "name": name,
                        "image": name.lower().endswith((".png", ".svg", ".jpg"))}
                       for name in r["figures"]]
            runs.append({
                "rel": r["rel"], "status": r["status"], "duration": fmt(r["duration_s"]),
                "notebook": (page.relative_to(root).as_posix() if page else
                             f"{r['rel']}/{nb}.ipynb" if executed.exists() else None),
                "log": f"{r['rel']}/log.txt" if (r["dir"] / "log.txt").exists() else None,
                "figures": figures})
        notebooks.append({
            "name": nb, "title": "" if info["titles"].get(nb) == nb else
            info["titles"].get(nb, ""),
            "failed": [r for r in recs if r["status"] not in ("ok", "cached")],
            "claims": _claims_matrix([r for r in recs if r["claims"]]),
            "aggregate": _aggregate_table([a for a in agg if a["notebook"] == nb]),
            "runs": runs})
    jobs = [{**row, "duration_s": fmt(row["duration_s"]), "run_s": fmt(row["run_s"])}
            for row in results]
    index = root / "index.html"
    index.write_text(render(root=str(root), n_runs=len(records), jobs=jobs,
                            notebooks=notebooks, info=info))
    return index
