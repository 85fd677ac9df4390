"""``workbench list | new | run | report | zoo``: the command line. Starts fast (no torch on import)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import notebooks as nbs
from .env import project_root
from .runtime import SCALES


def _last_result(slug: str) -> str:
    """The newest metrics.json of this notebook under runs/: claims held, scale, seed, when."""
    runs = project_root() / "runs"
    best = None
    for path in runs.rglob("metrics.json") if runs.is_dir() else []:
        if path.parent.name == slug or f"/{slug}/" in path.as_posix():
            if best is None or path.stat().st_mtime > best.stat().st_mtime:
                best = path
    if best is None:
        return "never run"
    m = json.loads(best.read_text())
    claims = m.get("claims", [])
    held = sum(c["holds"] for c in claims)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(best.stat().st_mtime))
    return f"{held}/{len(claims)} hold ({m.get('scale')}, seed {m.get('seed')}, {when})"


def cmd_list(args) -> int:
    infos = nbs.discover()
    if not infos:
        print(f"no notebooks found in {nbs.notebooks_dir()}")
        return 1
    rows = [("no", "slug", "title", "claims", "last result")]
    for i in infos:
        title = i.title if len(i.title) <= 60 else i.title[:57] + "..."
        rows.append((i.number, i.slug, title, " ".join(i.claims) or "-", _last_result(i.slug)))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for n, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    return 0


def cmd_run(args) -> int:
    from . import batch, report
    if not args.all and not args.notebooks:
        print("name one or more notebooks (see `workbench list`) or pass --all", file=sys.stderr)
        return 2
    executor = "dask" if args.scheduler else args.executor
    try:
        infos = nbs.discover() if args.all else [nbs.resolve(n) for n in args.notebooks]
        seeds = [int(s) for s in batch.split_values(args.seeds)]
        raw: dict[str, list[str]] = {}
        for name, value in args.param or []:
            if name in raw:
                raise batch.ParameterError(f"-p {name} given twice; use a comma list for a grid")
            raw[name] = batch.split_values(value)
        out = Path(args.out or project_root() / "runs" / time.strftime("%Y%m%d-%H%M%S"))
        jobs = batch.plan(infos, out, scale=args.scale, raw_params=raw, seeds=seeds)
    except (LookupError, batch.ParameterError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_jobs = args.jobs or os.cpu_count() or 1
    client = None
    if executor == "dask":      # connect before anything runs: a bad address is bad input
        from . import cluster
        try:
            client = cluster.connect(args.scheduler, n_workers=min(n_jobs, len(jobs)), timeout=5,
                                     retries=args.retries)
        except cluster.SchedulerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        where = args.scheduler or f"a local cluster of {min(n_jobs, len(jobs))} worker(s)"
        how = f"on {where}" + (f", dashboard {client.dashboard_link}"
                               if getattr(client, "dashboard_link", None) else "")
    else:
        how = f"{min(n_jobs, len(jobs))} at a time"
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(jobs)} job(s) over {len(infos)} notebook(s), {how}, "
          f"timeout {args.timeout:g} s each -> {out}")
    try:
        # on an existing cluster, without --jobs: as many jobs at a time as it has threads
        window = args.jobs if args.scheduler else n_jobs
        if client is not None:
            results = cluster.run_dask(jobs, client=client, n_workers=window,
                                       timeout=args.timeout, resume=args.resume,
                                       strict=args.strict, retries=args.retries)
        else:
            results = batch.run_batch(jobs, n_jobs=n_jobs, timeout=args.timeout,
                                      resume=args.resume, strict=args.strict)
    finally:
        if client is not None:
            cluster.close(client)
    print(batch.summary_table(results))
    index = report.build(out, html=args.html)
    print(f"report: {index}")
    if any(r.status == "interrupted" for r in results):
        print(f"interrupted: finished jobs are kept; `--resume --out {out}` runs the rest",
              file=sys.stderr)
        return 130
    return 0 if all(r.passed for r in results) else 1


def cmd_report(args) -> int:
    from . import report
    try:
        index = report.build(Path(args.dir), html=not args.no_html)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {index}\nresults: {index.parent / 'results.csv'}")
    return 0


def cmd_new(args) -> int:
    from .template import new_notebook
    try:
        path = new_notebook(args.name, title=args.title, force=args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}: fill every TODO(template), then `workbench run {path.stem}`")
    return 0


def _format_cards(cards: list[dict]) -> str:
    """The LM and pool cards as the zoo's table, the mini-CLIP cards as their own."""
    from .models import clip, zoo
    clips = [c for c in cards if c.get("kind") == "clip"]
    text = zoo.format_cards([c for c in cards if c.get("kind") != "clip"])
    return text + ("\n\nmini-CLIP: zero-shot top-1 accuracy\n" + clip.format_cards(clips)
                   if clips else "")


def cmd_zoo(args) -> int:
    try:
        from .models import zoo
    except ImportError as e:
        print(f"error: the zoo needs its dependencies ({e}); reinstall the workbench", file=sys.stderr)
        return 2
    if args.action == "list":
        from .models import adapters, clip
        print("recipes: " + ", ".join(sorted(zoo.RECIPES) + [clip.NAME]))
        cards = zoo.list_built() + adapters.list_built() + clip.list_built()
        if args.json:
            for card in cards:
                print(json.dumps(card))
        elif cards:
            print(_format_cards(cards))
        else:
            print("nothing built yet: `workbench zoo build --all`")
        return 0
    if args.action == "clear":
        if len(args.name) > 1:
            print("error: zoo clear takes one recipe name (or none: everything)", file=sys.stderr)
            return 2
        for path in zoo.clear(args.name[0] if args.name else None):
            print(f"removed {path}")
        return 0
    from .models import adapters, clip
    buildable = sorted(zoo.RECIPES) + [adapters.POOL_NAME, clip.NAME]
    unknown = [n for n in args.name if n not in buildable]
    if unknown:
        print(f"error: unknown recipe {unknown[0]!r}; recipes: {', '.join(buildable)}",
              file=sys.stderr)
        return 2
    if args.all or len(args.name) > 1 or args.name in ([adapters.POOL_NAME], [clip.NAME]):
        cards = adapters.build_all(args.scale, force=args.force, jobs=args.jobs,
                                   names=None if args.all else args.name)
        print(_format_cards(cards))
        failed = [c for c in cards if "error" in c]
        for c in failed:
            print(f"error: {c['name']}: {c['error']}", file=sys.stderr)
        return 1 if failed else 0
    if not args.name:
        print(f"error: name a recipe to build (or --all): {', '.join(buildable)}", file=sys.stderr)
        return 2
    card = zoo.build(args.name[0], args.scale, force=args.force)
    print(json.dumps(card, indent=2))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="every notebook with its claims and last result")

    n = sub.add_parser("new", help="a new notebook NN-slug.ipynb from the template")
    n.add_argument("name", help="NN-slug, e.g. 08-htfm")
    n.add_argument("--title", help="the paper's title (default: from the slug)")
    n.add_argument("--force", action="store_true", help="overwrite an existing notebook")

    r = sub.add_parser("run", help="execute notebooks through papermill, in parallel")
    r.add_argument("notebooks", nargs="*", metavar="SLUG", help="e.g. 12-nfi (or its number)")
    r.add_argument("--all", action="store_true", help="every notebook")
    r.add_argument("--scale", choices=SCALES, default="smoke")
    r.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="set a notebook parameter; a comma list (-p bits 4,3,2) makes a grid")
    r.add_argument("--seeds", default="0", help="comma list of seeds, e.g. 0,1,2")
    r.add_argument("--jobs", type=int, default=None,
                   help="parallel jobs (default: cores; with --scheduler, the cluster's threads)")
    r.add_argument("--timeout", type=float, default=900, help="seconds per job")
    r.add_argument("--out", default=None, help="run directory (default runs/<timestamp>)")
    r.add_argument("--resume", action="store_true",
                   help="skip jobs complete in --out for the same notebook content and parameters")
    r.add_argument("--strict", action="store_true",
                   help="a robust claim that does not hold fails its job")
    r.add_argument("--executor", choices=("process", "dask"), default="process",
                   help="local papermill processes (default) or tasks on a Dask cluster")
    r.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="Dask scheduler to run on, e.g. tcp://host:8786 (implies --executor dask;"
                        " default: a local cluster of --jobs workers)")
    r.add_argument("--retries", type=int, default=1,
                   help="Dask: times a job is re-run on another worker when its worker dies "
                        "(local cluster; an existing one uses its allowed-failures setting)")
    r.add_argument("--html", action="store_true",
                   help="also render each executed notebook as HTML (about 1 s each)")

    rep = sub.add_parser("report", help="results.csv, aggregate.csv and index.html of a run dir")
    rep.add_argument("dir")
    rep.add_argument("--no-html", action="store_true",
                     help="do not render executed notebooks as HTML (faster)")

    z = sub.add_parser("zoo", help="build, list or clear the shared pretrained backbones")
    z.add_argument("action", choices=("build", "list", "clear"))
    z.add_argument("name", nargs="*",
                   help="build: recipes (and lora-pool/lm-base), several at a time like --all; "
                        "clear: one recipe, or none for everything")
    z.add_argument("--scale", choices=SCALES, default="smoke")
    z.add_argument("--force", action="store_true", help="rebuild even when cached")
    z.add_argument("--all", action="store_true",
                   help="build: every recipe and the LoRA pool")
    z.add_argument("--json", action="store_true", help="list: one JSON card per line")
    z.add_argument("--jobs", type=int, default=2,
                   help="build of several: builds at a time, one CPU thread each (default 2)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handler = {"list": cmd_list, "new": cmd_new, "run": cmd_run, "report": cmd_report, "zoo": cmd_zoo}
    try:
        return handler[args.command](args)
    except BrokenPipeError:         # `workbench list | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
