"""The report of a batch directory: ``results.csv``, ``aggregate.csv`` and ``index.html``.

It reads what the jobs left behind (``job.json`` from the batch runner, ``metrics.json`` from the
notebook, see DESIGN.md) and never re-runs anything. Works on any directory holding run
directories, so ``workbench report runs/interactive`` works too. No torch here.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path


def collect(root: Path) -> list[dict]:
    """One record per run directory under ``root``: job status plus the notebook's metrics."""
    root = Path(root)
    dirs = {p.parent for p in root.rglob("job.json")} | {p.parent for p in root.rglob("metrics.json")}
    records = []
    for d in sorted(dirs):
        job = json.loads((d / "job.json").read_text()) if (d / "job.json").exists() else {}
        met = json.loads((d / "metrics.json").read_text()) if (d / "metrics.json").exists() else {}
        spec = job.get("job", {})
        records.append({
            "dir": d, "rel": d.relative_to(root).as_posix(),
            "notebook": spec.get("slug") or met.get("notebook", d.name),
            "params": spec.get("params", {k: v for k, v in met.get("params", {}).items()
                                          if k not in ("scale", "seed", "device", "out_dir")}),
            "scale": spec.get("scale") or met.get("scale"),
            "seed": spec.get("seed", met.get("seed")),
            "status": job.get("status", "ok" if met else "unknown"),
            "duration_s": job.get("duration_s", met.get("duration_s")),
            "run_s": met.get("duration_s"),     # start() to finish(): kernel start excluded
            "error": job.get("error", ""),
            "metrics": met.get("metrics", {}),
            "claims": met.get("claims", []),
            "figures": met.get("figures", []),
        })
    return records


def _params_key(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "-"


def results_frame(records: list[dict]):
    """One row per job: notebook, parameters, seed, status, duration, metrics, claim verdicts."""
    import pandas as pd
    rows = []
    for r in records:
        row = {"notebook": r["notebook"], "scale": r["scale"], "params": _params_key(r["params"]),
               "seed": r["seed"], "status": r["status"], "duration_s": r["duration_s"],
               "run_s": r["run_s"],
               "error": r["error"]}
        for k, v in r["metrics"].items():
            if isinstance(v, (int, float, bool)) or v is None:
                row[f"metric:{k}"] = v
        for c in r["claims"]:
            row[f"claim:{c['id']}"] = "holds" if c["holds"] else "does not hold"
        rows.append(row)
    return pd.DataFrame(rows)


def aggregate_frame(results):
    """Per notebook x parameters, over seeds: n, seeds, mean and std of every numeric metric,
    and for every claim how many seeds it held in."""
    import pandas as pd
    if results.empty:
        return pd.DataFrame()
    rows = []
    ok = results[results["status"].isin(["ok", "cached"])]
    for (nb, scale, params), g in ok.groupby(["notebook", "scale", "params"], dropna=False):
        row = {"notebook": nb, "scale": scale, "params": params, "n": len(g),
               "seeds": ",".join(str(s) for s in sorted(g["seed"].dropna().astype(int)))}
        for col in g.columns:
            if col.startswith("metric:"):
                vals = pd.to_numeric(g[col], errors="coerce").dropna()
                if len(vals):
                    row[f"{col[7:]} mean"] = vals.mean()
                    row[f"{col[7:]} std"] = vals.std(ddof=1) if len(vals) > 1 else 0.0
            elif col.startswith("claim:"):
                vals = g[col].dropna()
                row[col] = f"{(vals == 'holds').sum()}/{len(vals)}"
        rows.append(row)
    return pd.DataFrame(rows)


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.4g}"
    return html.escape(str(v))


def _render_notebook(nb_path: Path) -> Path | None:
    """The executed notebook as HTML beside it (skipped when already up to date)."""
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


def _claims_matrix(recs: list[dict]) -> str:
    """Claims as rows, runs as columns, verdicts in the cells."""
    ids, texts = [], {}
    for r in recs:
        for c in r["claims"]:
            if c["id"] not in texts:
                ids.append(c["id"])
                texts[c["id"]] = (c["text"], c.get("robust", False))
    if not ids:
        return "<p>No claims recorded.</p>"
    head = "".join(f"<th>{_fmt(_params_key(r['params']))}<br>seed {r['seed']}</th>" for r in recs)
    body = []
    for cid in ids:
        cells = []
        for r in recs:
            c = next((c for c in r["claims"] if c["id"] == cid), None)
            if c is None:
                cells.append("<td class=na>-</td>")
            else:
                cells.append(f"<td class={'ok' if c['holds'] else 'bad'}>"
                             f"{'holds' if c['holds'] else 'does not hold'}</td>")
        text, robust = texts[cid]
        body.append(f"<tr><th>{cid}{' (robust)' if robust else ''}</th>"
                    f"<td class=text>{_fmt(text)}</td>{''.join(cells)}</tr>")
    return (f"<table><tr><th>claim</th><th>text</th>{head}</tr>{''.join(body)}</table>")


def _table(df) -> str:
    if df is None or df.empty:
        return "<p>(empty)</p>"
    head = "".join(f"<th>{_fmt(c)}</th>" for c in df.columns)
    rows = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>"
                   for row in df.itertuples(index=False))
    return f"<table><tr>{head}</tr>{rows}</table>"


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
td.ok{background:#e3f4e1}td.bad{background:#fbe1e1}td.na{color:#999}td.text{max-width:480px}
img{max-width:560px;margin:4px;border:1px solid #eee}h2{border-bottom:2px solid #1f5a96}
.fail{color:#b00}"""


def build(root: Path) -> Path:
    """Write ``results.csv``, ``aggregate.csv`` and ``index.html`` into ``root``; return the
    path of ``index.html``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; give the --out directory of a run")
    records = collect(root)
    results = results_frame(records)
    agg = aggregate_frame(results)
    results.to_csv(root / "results.csv", index=False)
    agg.to_csv(root / "aggregate.csv", index=False)

    parts = [f"<html><head><meta charset=utf-8><title>Workbench report: {html.escape(str(root))}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>Workbench report</h1><p>{len(records)} run(s) in <code>{html.escape(str(root))}"
             "</code>; tables: <a href=results.csv>results.csv</a>, "
             "<a href=aggregate.csv>aggregate.csv</a>.</p>"]
    if not results.empty:
        cols = [c for c in ("notebook", "params", "seed", "status", "duration_s", "run_s", "error")
                if c in results]
        parts += ["<h2>Jobs</h2>", _table(results[cols])]
    for nb in sorted({r["notebook"] for r in records}):
        recs = [r for r in records if r["notebook"] == nb]
        recs.sort(key=lambda r: (_params_key(r["params"]), r["seed"] if r["seed"] is not None
                                 else -1))
        parts.append(f"<h2 id='{html.escape(nb)}'>{html.escape(nb)}</h2>")
        failed = [r for r in recs if r["status"] not in ("ok", "cached")]
        for r in failed:
            parts.append(f"<p class=fail>{_fmt(r['rel'])}: {r['status']} {_fmt(r['error'])} "
                         f"(<a href='{r['rel']}/log.txt'>log</a>)</p>")
        parts += ["<h3>Verdicts</h3>", _claims_matrix([r for r in recs if r["claims"]])]
        if not agg.empty:
            sub = agg[agg["notebook"] == nb].dropna(axis=1, how="all")
            if len(sub):
                parts += ["<h3>Aggregate over seeds (mean, std, n)</h3>", _table(sub)]
        for r in recs:
            links = []
            executed = r["dir"] / f"{nb}.ipynb"
            if executed.exists():
                page = _render_notebook(executed)
                if page:
                    links.append(f"<a href='{page.relative_to(root).as_posix()}'>executed "
                                 "notebook</a>")
            if (r["dir"] / "log.txt").exists():
                links.append(f"<a href='{r['rel']}/log.txt'>log</a>")
            figs = []
            for name in r["figures"]:
                rel = f"{r['rel']}/figures/{name}"
                figs.append(f"<a href='{rel}'><img src='{rel}' alt='{html.escape(name)}'></a>"
                            if name.endswith(".png") else f"<a href='{rel}'>{html.escape(name)}</a>")
            first = r is recs[0]
            parts.append(f"<details{' open' if first else ''}><summary>{_fmt(r['rel'])} "
                         f"({r['status']}, {_fmt(r['duration_s'])} s) {' · '.join(links)}"
                         f"</summary>{''.join(figs)}</details>")
    parts.append("</body></html>")
    index = root / "index.html"
    index.write_text("\n".join(parts))
    return index
