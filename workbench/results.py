"""Recorded results: what a notebook's "What we saw" shows, read from runs, never typed.

``workbench run NN --seeds 0,1,2 --out DIR`` then ``workbench record DIR`` (:func:`record`)
writes ``notebooks/results/<slug>.json``: every claim's verdict per seed and every scalar metric's
mean, std (:func:`workbench.stats.mean_std`, as ``aggregate.csv`` has it) and values, over the
seeds of the notebook's default smoke run; a default ``--scale mid`` run is recorded the same way
in ``notebooks/results/mid/<slug>.json`` (:data:`SCALES`). The file carries a key: a hash of the notebook's code
cells and the keys of the zoo entries its runs used (each run lists them in ``metrics.json``,
from ``cache.used``; a record from before runs listed them carries every entry's key). When either
moves, the file is stale (:func:`stale`), and the test suite says which notebook to run again: a
recipe change stales only its users.

In a notebook, :func:`show` renders the verdict table from the file, and :func:`say` renders
prose whose numbers come from it::

    results.say("12-nfi", "C1 holds on {claims[C1]} seeds; the gap is {metrics[gap]:.2f}.")

Torch-free (the report imports it); the zoo's keys are read lazily.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .env import project_root
from .stats import mean_std

__all__ = ["SEEDS", "JUDGING", "SCALES", "RESULTS_TAG", "EXPLORE_TAG", "results_dir", "path",
           "folder", "notebook_key", "zoo_keys", "current_key", "record", "rekey", "load",
           "stale", "Recorded", "table", "show", "render", "say", "findings", "main"]

SEEDS = (0, 1, 2)           # the seeds a recorded result covers
JUDGING = (3, 4, 5)         # the seeds that judge a changed criterion, recorded beside SEEDS
SCALES = ("smoke", "mid")   # the scales with records (full needs a GPU: its runs stay run folders)
RESULTS_TAG = "results"     # a code cell tagged so shows recorded results: not part of the key
EXPLORE_TAG = "explore"     # an explorer after run.finish() (workbench.explore): records nothing


def results_dir() -> Path:
    """``notebooks/results``: one JSON file per notebook, committed with it."""
    return project_root() / "notebooks" / "results"


def path(slug: str, scale: str = "smoke", seeds=SEEDS) -> Path:
    """The record of ``slug`` at ``scale``: ``<slug>.json`` at smoke, ``<scale>/<slug>.json``
    beside it for the others; the record of the judging seeds (:data:`JUDGING`, the seeds a
    changed criterion was judged on) in a ``judging/`` folder beside each."""
    return folder(scale, seeds) / f"{slug}.json"


def folder(scale: str = "smoke", seeds=SEEDS) -> Path:
    """Where the records at ``scale`` over ``seeds`` lie (:func:`path`); a scale or seed set
    that has no records is a ValueError."""
    if scale not in SCALES:
        raise ValueError(f"records are kept at {SCALES}, not {scale!r}")
    seeds = tuple(seeds)
    if seeds not in (SEEDS, JUDGING):
        raise ValueError(f"records cover seeds {SEEDS} or the judging seeds {JUDGING}, not {seeds}")
    root = results_dir() if scale == "smoke" else results_dir() / scale
    return root / "judging" if seeds == JUDGING else root


def notebook_key(nb_path: Path) -> str:
    """A hash of the notebook's code cells (sources only; the cells tagged ``results``, which
    only read this file, and ``explore``, which come after the verdicts and record nothing
    (``tests/test_house.py`` checks both), and all markdown are left out, so editing prose or an
    explorer keeps the record). An executed copy from a run folder has the key of its source:
    the parameters cell papermill injects is left out too."""
    return text_key(Path(nb_path).read_text())


def text_key(text: str) -> str:
    """:func:`notebook_key` of a notebook's JSON text (one from ``git show``, say)."""
    nb = json.loads(text)
    skip = {RESULTS_TAG, EXPLORE_TAG, "injected-parameters"}
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
            and not skip & set(c.get("metadata", {}).get("tags", []))]
    return hashlib.sha256(json.dumps(code).encode()).hexdigest()[:16]


def zoo_keys(names=None) -> dict:
    """Today's smoke keys of the zoo entries ``names`` (as a run notes them: recipes, ``lora-pool``,
    the mini-CLIP; ``cache.used``). ``None``: the key of every entry, as records written before
    runs noted what they used were keyed (the pool then by its version alone)."""
    from .models import adapters, clip, recipes      # lazy: they import torch
    if names is None:
        keys = {name: r.key("smoke") for name, r in sorted(recipes.RECIPES.items())}
        keys["lora-pool"] = adapters.POOL_VERSION
        keys[clip.NAME] = clip.model_dir("smoke").name
        return keys
    now = {"lora-pool": adapters.recipe_key("smoke"), clip.NAME: clip.model_dir("smoke").name}
    return {n: now[n] if n in now else recipes.recipe(n).key("smoke") if n in recipes.RECIPES
            else None for n in sorted(names)}


def current_key(slug: str, zoo_used=None) -> dict:
    """The record key of ``slug`` today: its code cells, and the keys of the zoo entries its runs
    used (``zoo_used``: their names; every entry when unknown)."""
    return {"notebook": notebook_key(project_root() / "notebooks" / f"{slug}.ipynb"),
            "zoo": zoo_keys(zoo_used)}


def _scalar(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def record(run_dir: Path, slugs=None, seeds=SEEDS) -> list[Path]:
    """Write the record (:func:`path`) of every notebook and scale in ``run_dir`` whose default
    run at that scale (folder ``smoke`` or ``mid``) finished ``ok`` on every seed of ``seeds``;
    returns the files written. A notebook and scale with a missing or failed seed is left as it
    was."""
    run_dir = Path(run_dir)
    written = []
    for nb_dir in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        slug = nb_dir.name
        if slugs is not None and slug not in slugs:
            continue
        if not (project_root() / "notebooks" / f"{slug}.ipynb").exists():
            continue
        for scale in SCALES:
            runs = []
            for s in seeds:
                m = nb_dir / scale / f"seed-{s}" / "metrics.json"
                job = nb_dir / scale / f"seed-{s}" / "job.json"
                if not m.exists() or (job.exists() and json.loads(job.read_text()).get("status")
                                      not in ("ok", None)):
                    break
                runs.append(json.loads(m.read_text()))
            else:
                written.append(_write(slug, runs, list(seeds), scale))
    return written


def _write(slug: str, runs: list[dict], seeds: list[int], scale: str = "smoke") -> Path:
    claims: dict[str, dict] = {}
    for r in runs:
        for c in r.get("claims", []):
            d = claims.setdefault(c["id"], {"text": c["text"], "robust": c.get("robust", False),
                                            "holds": [], "evidence": []})
            d["holds"].append(c.get("holds"))
            d["evidence"].append(c.get("evidence", {}))
    metrics = {}
    names = sorted({k for r in runs for k, v in r.get("metrics", {}).items() if _scalar(v)})
    for k in names:
        vals = [r["metrics"].get(k) for r in runs]
        ok = [v for v in vals if _scalar(v)]
        mean, std = mean_std(ok)
        metrics[k] = {"mean": mean, "std": std, "values": vals}
    # the zoo entries the runs used (runs from before runtime noted them have no "zoo": then
    # every entry's key, as before)
    used = sorted({n for r in runs for n in r["zoo"]}) if all("zoo" in r for r in runs) else None
    key = current_key(slug, used)
    if used is not None:
        key["zoo_scope"] = "used"
    out = {"notebook": slug, "scale": scale, "seeds": seeds, "key": key,
           "recorded": time.strftime("%Y-%m-%d"),
           "duration_s": [r.get("duration_s") for r in runs],
           "claims": claims, "metrics": metrics}
    p = path(slug, scale, seeds)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return p


def load(slug: str, scale: str = "smoke", seeds=SEEDS) -> dict | None:
    p = path(slug, scale, seeds)
    return json.loads(p.read_text()) if p.exists() else None


def stale(slug: str, scale: str = "smoke", seeds=SEEDS) -> list[str]:
    """Why the record of ``slug`` at ``scale`` no longer describes the notebook ([] when
    current)."""
    d = load(slug, scale, seeds)
    if d is None:
        return [f"no recorded results ({path(slug, scale, seeds)})"]
    scoped = d["key"].get("zoo_scope") == "used"
    now = current_key(slug, list(d["key"]["zoo"]) if scoped else None)
    why = []
    if d["key"]["notebook"] != now["notebook"]:
        why.append("the notebook's code cells changed since the record")
    moved = sorted(k for k in set(now["zoo"]) | set(d["key"]["zoo"])
                   if now["zoo"].get(k) != d["key"]["zoo"].get(k))
    if moved:
        why.append(f"zoo keys moved: {', '.join(moved)}")
    return why


def _scale_code(nb: dict, scale: str) -> list[str]:
    """The keyed code cells as a run at ``scale`` reads them: parsed (comments and layout
    dropped), with every row of ``SIZES`` but ``scale``'s (and the row it names, if it names
    one) removed."""
    import ast
    out = []
    for c in nb["cells"]:
        if c["cell_type"] != "code" or {RESULTS_TAG, EXPLORE_TAG} & set(
                c.get("metadata", {}).get("tags", [])):
            continue
        tree = ast.parse("".join(c["source"]))
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", "") == "SIZES" \
                    and isinstance(stmt.value, ast.Dict):
                rows = {getattr(k, "value", None): v for k, v in zip(stmt.value.keys, stmt.value.values)}
                read, row = {scale}, rows.get(scale)
                if isinstance(row, ast.Constant):                   # "mid": "smoke"
                    read.add(row.value)
                elif isinstance(row, ast.Dict):                     # "mid": {"like": "smoke", ...}
                    read |= {v.value for k, v in zip(row.keys, row.values)
                             if getattr(k, "value", None) == "like" and isinstance(v, ast.Constant)}
                keep = [(k, v) for k, v in zip(stmt.value.keys, stmt.value.values)
                        if not isinstance(k, ast.Constant) or k.value in read]
                stmt.value.keys, stmt.value.values = [k for k, _ in keep], [v for _, v in keep]
        out.append(ast.dump(tree))
    return out


def rekey_rows(slug: str, before: str, scale: str = "smoke") -> bool:
    """Carry a current record over an edit that a run at its scale cannot see: when the record
    of ``slug`` at ``scale`` was current for the notebook text ``before`` (its JSON) and the
    notebook now differs from it only in comments, layout and the other scales' rows of
    ``SIZES``, write today's notebook key into the record and return True; otherwise change
    nothing and return False (record it again)."""
    d = load(slug, scale)
    nb_path = project_root() / "notebooks" / f"{slug}.ipynb"
    if d is None or d["key"]["notebook"] != text_key(before):
        return False
    if _scale_code(json.loads(before), scale) != _scale_code(json.loads(nb_path.read_text()), scale):
        return False
    d["key"]["notebook"] = notebook_key(nb_path)
    path(slug, scale).write_text(json.dumps(d, indent=1) + "\n")
    return True


def rekey(slug: str, before: Path, after: Path, scale: str = "smoke") -> list[str]:
    """Carry ``slug``'s record over a change of its code that moves no number. ``before`` is a
    run folder of the code the record was made from (its runs' ``env.json`` names a clean commit
    at which the record was current), ``after`` one of today's notebook, with the same seeds of
    the default run at ``scale``. When every metric and every verdict of every paired seed is equal
    (:func:`workbench.compare.compare` at tolerance 0; timings left out), today's notebook key is
    written into the record. Returns why not (``[]`` when re-keyed); nothing is written then."""
    import subprocess
    from . import compare
    d = load(slug, scale)
    if d is None:
        return [f"no record of {slug} at {scale} to carry over"]
    why = [w for w in stale(slug, scale) if "code cells" not in w]
    if why:
        return why                                     # a zoo entry moved: record it again
    nb_path = project_root() / "notebooks" / f"{slug}.ipynb"
    jobs = {}
    for name, root in (("before", Path(before)), ("after", Path(after))):
        seeds = sorted(root.glob(f"{slug}/{scale}/seed-*/metrics.json"))
        if not seeds:
            return [f"{root} holds no default {scale} run of {slug}"]
        jobs[name] = {p.parent.name: p.parent for p in seeds}
    paired = sorted(set(jobs["before"]) & set(jobs["after"]))
    if not paired:
        return ["the two folders share no seed"]
    for seed in paired:
        b, a = jobs["before"][seed], jobs["after"][seed]
        git = json.loads((b / "env.json").read_text()).get("git") or {}
        if not git.get("commit") or git.get("dirty") is not False:
            return [f"{b} ran on uncommitted code: its notebook cannot be named"]
        old = subprocess.run(["git", "show", f"{git['commit']}:notebooks/{slug}.ipynb"],
                             cwd=project_root(), capture_output=True, text=True)
        if old.returncode != 0:
            return [f"{slug} is not in commit {git['commit'][:10]}"]
        if text_key(old.stdout) != d["key"]["notebook"]:
            return [f"the record was not made from commit {git['commit'][:10]}'s notebook"]
        if notebook_key(a / f"{slug}.ipynb") != notebook_key(nb_path):
            return [f"{a} did not run today's notebook"]
    moved = compare.compare(before, after, tol=0.0, only=[slug])
    moved = [line for line in moved["differences"] if line.split("/")[1] == scale
             and line.split("/")[2].split(":")[0] in paired]
    if moved:
        return [f"{len(moved)} number(s) or verdict(s) moved, e.g. {moved[0]}"]
    d["key"]["notebook"] = notebook_key(nb_path)
    path(slug, scale).write_text(json.dumps(d, indent=1) + "\n")
    return []


# -- reading a record in a notebook ---------------------------------------------------------------

@dataclass
class Stat:
    """A metric over the recorded seeds; formats as ``mean ± std`` (``{m:.2f}``)."""
    mean: float
    std: float
    values: list = field(default_factory=list)

    def __format__(self, spec: str) -> str:
        spec = spec or ".3g"
        if self.std == 0 and len(set(self.values)) <= 1:
            return f"{self.mean:{spec}}"            # the same on every seed: no "± 0"
        return f"{self.mean:{spec}} ± {self.std:{spec}}"


@dataclass
class Verdict:
    """A claim over the recorded seeds; formats as ``held/n`` (``{c}``)."""
    text: str
    robust: bool
    holds: list

    @property
    def held(self) -> int:
        return sum(1 for h in self.holds if h)

    @property
    def n(self) -> int:
        return len(self.holds)

    def __format__(self, spec: str) -> str:
        return f"{self.held}/{self.n}"


@dataclass
class Recorded:
    """A notebook's record at one scale, for templates: ``claims[C1]``, ``metrics[name]``,
    ``seeds``, ``n``."""
    slug: str
    claims: dict
    metrics: dict
    seeds: list
    stale: list
    scale: str = "smoke"

    @classmethod
    def of(cls, slug: str, scale: str = "smoke", seeds=SEEDS) -> "Recorded | None":
        d = load(slug, scale, seeds)
        if d is None:
            return None
        return cls(slug, {k: Verdict(v["text"], v["robust"], v["holds"]) for k, v in d["claims"].items()},
                   {k: Stat(v["mean"], v["std"], v["values"]) for k, v in d["metrics"].items()},
                   d["seeds"], stale(slug, scale, seeds), scale)

    @property
    def n(self) -> int:
        return len(self.seeds)


def _display_markdown(text: str) -> None:
    """Markdown in a notebook (rendered by JupyterLab, kept in the executed notebook), plain text
    elsewhere. Returns nothing, so a cell ending in show/say shows no repr beside it."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Markdown(text))
    else:
        print(text)


def _none_yet(slug: str, scale: str) -> str:
    knob = "" if scale == "smoke" else f" --scale {scale}"
    return f"*No recorded runs of {slug} at {scale} yet: `workbench run {slug}{knob} " \
           f"--seeds 0,1,2` then `workbench record` on its folder.*"


def table(slug: str, scale: str = "smoke", seeds=SEEDS) -> str:
    """The verdict table of the record at ``scale`` as Markdown (claim, robust, per seed,
    held)."""
    r = Recorded.of(slug, scale, seeds)
    if r is None:
        return _none_yet(slug, scale)
    head = "| claim | | robust | " + " | ".join(f"seed {s}" for s in r.seeds) + " | held |"
    lines = [head, "|" + "---|" * (4 + r.n)]
    for cid, v in r.claims.items():
        marks = " | ".join("holds" if h else ("—" if h is None else "does not hold")
                           for h in v.holds)
        lines.append(f"| {cid} | {v.text} | {'yes' if v.robust else 'no'} | {marks} | "
                     f"{v.held}/{v.n} |")
    rel = path(slug, scale, seeds).relative_to(results_dir()).as_posix()
    note = f"Recorded over seeds {', '.join(map(str, r.seeds))} at {scale} scale " \
           f"(`notebooks/results/{rel}`)."
    if r.stale:
        note += " **Stale:** " + "; ".join(r.stale) + "."
    return note + "\n\n" + "\n".join(lines)


def scales_table(slug: str) -> str:
    """Smoke and mid side by side as Markdown: each claim, whether it is robust, and the seeds
    on which it held at each scale (``—`` where a scale has no record yet), then each record's
    per-seed table (:func:`table`)."""
    recs = {s: Recorded.of(slug, s) for s in SCALES}
    have = [s for s in SCALES if recs[s] is not None]
    if not have:
        return table(slug)
    ids = list(dict.fromkeys(c for s in have for c in recs[s].claims))
    head = "| claim | | robust | " + " | ".join(f"{s}" for s in SCALES) + " |"
    lines = [head, "|" + "---|" * (3 + len(SCALES))]
    for cid in ids:
        v = next(recs[s].claims[cid] for s in have if cid in recs[s].claims)
        cells = [f"{recs[s].claims[cid]}" if recs[s] is not None and cid in recs[s].claims
                 else "—" for s in SCALES]
        lines.append(f"| {cid} | {v.text} | {'yes' if v.robust else 'no'} | " + " | ".join(cells) + " |")
    parts = ["Claims held per recorded seed at each scale (seeds 0-2).", "", "\n".join(lines)]
    for s in SCALES:
        parts += ["", f"**{s}**", "", table(slug, s)]
    return "\n".join(parts)


def show(slug: str) -> None:
    """Display the records' verdicts, smoke and mid side by side, then each per seed
    (:func:`scales_table`; Markdown in Jupyter, text elsewhere)."""
    _display_markdown(scales_table(slug))


def say(slug: str, template: str) -> None:
    """Display ``template`` (Markdown) with its ``{claims[C1]}``, ``{metrics[name]:.2f}``,
    ``{n}`` and ``{seeds}`` fields filled from the smoke record, and ``{mid.claims[C1]}``,
    ``{mid.metrics[name]}`` from the mid record; a metric or record that is missing shows as
    ``?`` rather than failing, so prose never breaks a run."""
    _display_markdown(render(slug, template))


def render(slug: str, template: str) -> str:
    """``template`` with its fields filled from the record (what :func:`say` displays)."""
    r = Recorded.of(slug)
    if r is None:
        return table(slug)
    fields = _fields(r)
    mid = Recorded.of(slug, "mid")
    fields["mid"] = _Unknown() if mid is None else type("Mid", (), _fields(mid))()
    return template.format_map(fields)


class _Missing(dict):
    def __missing__(self, k):
        return _Unknown()


def _fields(r: Recorded) -> dict:
    return {"claims": _Missing(r.claims), "metrics": _Missing(r.metrics), "n": r.n,
            "seeds": ", ".join(map(str, r.seeds))}


class _Unknown:
    """A field the record lacks: shown as ``?`` (``{metrics[x]}``, ``{metrics[x].mean}`` and
    ``{mid.claims[C1]}`` without a mid record alike), so prose never breaks a run."""
    def __getattr__(self, name):
        return self

    def __getitem__(self, key):
        return self

    def __format__(self, spec: str) -> str:
        return "?"


def findings() -> str:
    """docs/findings.md: every notebook's recorded verdict table, in notebook order
    (``python -m workbench.results findings > docs/findings.md``; a test keeps it current)."""
    nbs = sorted(p.stem for p in (project_root() / "notebooks").glob("[0-9][0-9]-*.ipynb"))
    out = ["# Findings: what each notebook measured, claim by claim", "",
           "Rendered from the recorded runs in `notebooks/results/` (seeds 0-2 at smoke scale, and",
           "at mid scale in `notebooks/results/mid/`) by `python -m workbench.results findings`;",
           "never edited by hand. A claim that is not robust may fail at smoke scale;",
           "[decisions.md](decisions.md) says why for each one the specs expected to hold. The",
           "readings are in each notebook's \"What we saw\".", ""]
    for slug in nbs:
        out += [f"## {slug}", "", scales_table(slug), ""]
    return "\n".join(out).rstrip() + "\n"


JUDGING_BEGIN, JUDGING_END = "<!-- begin judging -->", "<!-- end judging -->"


def judging() -> str:
    """The judging seeds' verdicts (:data:`JUDGING`) of every notebook with such a record, at
    each scale: the section of docs/decisions.md between its markers, rendered by
    ``python -m workbench.results judging`` (a test keeps it current). A criterion changed for a
    reason written in docs/decisions.md is judged on these seeds, unseen when it was written."""
    out = []
    nbs = sorted(p.stem for p in (project_root() / "notebooks").glob("[0-9][0-9]-*.ipynb"))
    for slug in nbs:
        for scale in SCALES:
            if load(slug, scale, JUDGING) is not None:
                out += [f"### {slug} at {scale}, seeds {', '.join(map(str, JUDGING))}", "",
                        table(slug, scale, JUDGING), ""]
    body = "\n".join(out).rstrip() or "*No criterion has been judged on these seeds yet.*"
    return f"{JUDGING_BEGIN}\n{body}\n{JUDGING_END}"


def main(argv=None) -> int:
    """``python -m workbench.results findings`` | ``judging`` | ``stale`` |
    ``rekey-rows SLUG GIT_REV`` (``workbench record`` writes records)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["findings"]:
        sys.stdout.write(findings())
        return 0
    if args[:1] == ["judging"]:          # rewrite docs/decisions.md's judging section
        import re
        page = project_root() / "docs" / "decisions.md"
        text = page.read_text()
        pattern = re.compile(re.escape(JUDGING_BEGIN) + ".*?" + re.escape(JUDGING_END), re.S)
        text = pattern.sub(lambda _: judging(), text) if pattern.search(text) else \
            text.rstrip("\n") + "\n\n## Judging seeds\n\n" + judging() + "\n"
        page.write_text(text)
        print(f"wrote the judging section of {page}")
        return 0
    if args[:1] == ["stale"]:             # every smoke record, and every mid record there is
        bad = 0
        for nb in sorted((project_root() / "notebooks").glob("[0-9][0-9]-*.ipynb")):
            for scale in SCALES:
                if scale != "smoke" and load(nb.stem, scale) is None:
                    continue
                why = stale(nb.stem, scale)
                if why:
                    bad += 1
                    print(f"{nb.stem} ({scale}): {'; '.join(why)}")
        return 1 if bad else 0
    if args[:1] == ["rekey-rows"] and len(args) == 3:      # rekey-rows SLUG GIT_REV
        import subprocess
        before = subprocess.run(["git", "show", f"{args[2]}:notebooks/{args[1]}.ipynb"],
                                cwd=project_root(), capture_output=True, text=True, check=True)
        failed = 0
        for scale in SCALES:
            if load(args[1], scale) is None:
                continue
            done = rekey_rows(args[1], before.stdout, scale)
            failed += not done
            print(f"{args[1]} ({scale}): " + (
                "re-keyed (only other scales' rows or comments changed)" if done else
                "not re-keyed: record it again"))
        return 1 if failed else 0
    print("usage: python -m workbench.results findings | judging | stale | rekey-rows SLUG GIT_REV",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
