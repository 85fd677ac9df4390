"""``workbench list | new | run | plan | report | record | compare | book | zoo``: the command
line. Starts fast (no torch on import)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import compare
from . import notebooks as nbs
from .env import project_root
from .runtime import SCALES


def _last_results(root: Path) -> dict[str, str]:
    """slug -> its newest readable metrics.json under ``root``: claims held, scale, seed, when.
    One walk of the folder for all notebooks; hidden folders (jobs being assembled) skipped."""
    newest: dict[str, tuple[float, Path]] = {}
    for path in root.rglob("metrics.json") if root.is_dir() else []:
        rel = path.relative_to(root).parts
        if any(part.startswith(".") for part in rel):
            continue
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        for part in path.parent.parts[-4:]:
            if nbs.NAME_RE.match(part + ".ipynb"):
                if part not in newest or mtime > newest[part][0]:
                    newest[part] = (mtime, path)
                break
    out = {}
    for slug, (mtime, path) in newest.items():
        try:
            m = json.loads(path.read_text())
            claims = m.get("claims", [])
            held = sum(bool(c.get("holds")) for c in claims)
        except (OSError, ValueError, AttributeError):
            out[slug] = "unreadable metrics.json"
            continue
        when = time.strftime("%m-%d %H:%M", time.localtime(mtime))
        out[slug] = f"{held}/{len(claims)} hold, {m.get('scale')} s{m.get('seed')}, {when}"
    return out


def _recorded(slug: str, scale: str) -> str:
    """``4/6``: the claims of the record at ``scale`` that held on every recorded seed, of all
    its claims (``-`` without a record)."""
    from . import results
    d = results.load(slug, scale)
    if d is None:
        return "-"
    claims = d.get("claims", {}).values()
    return f"{sum(1 for c in claims if c['holds'] and all(c['holds']))}/{len(claims)}"


def _claim_ids(claims: list[str]) -> str:
    """``C1 C2 C3 C5`` -> ``C1-C3 C5``: claim ids in little room."""
    nums = [int(c[1:]) for c in claims if c[1:].isdigit()]
    if len(nums) != len(claims) or not nums:
        return " ".join(claims) or "-"
    runs, start = [], nums[0]
    for a, b in zip(nums, nums[1:] + [None]):
        if b != a + 1:
            runs.append(f"C{start}" if start == a else f"C{start}-C{a}")
            start = b
    return " ".join(runs)


def _fit(rows: list[tuple], width: int, flex: int) -> list[str]:
    """Rows as aligned columns within ``width`` characters; column ``flex`` is shortened."""
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    room = width - (sum(widths) - widths[flex]) - 2 * (len(widths) - 1)
    widths[flex] = max(8, min(widths[flex], room))
    lines = []
    for r in rows:
        cells = list(r)
        if len(cells[flex]) > widths[flex]:
            cells[flex] = cells[flex][: widths[flex] - 3] + "..."
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()[:width])
    return lines


def cmd_list(args) -> int:
    broken: list[tuple[Path, str]] = []
    infos = nbs.discover(broken=broken)
    for path, reason in broken:
        print(f"warning: skipped {path.name}: {reason}", file=sys.stderr)
    if not infos:
        print(f"no notebooks found in {nbs.notebooks_dir()}")
        return 1
    runs = Path(args.runs) if args.runs else project_root() / "runs"
    if args.runs and not runs.is_dir():
        print(f"error: --runs {runs} is not a folder", file=sys.stderr)
        return 2
    last = _last_results(runs)
    rows = [("no", "slug", "title", "claims", "smoke", "mid",
             f"last result (in {args.runs or 'runs/'})")]
    for i in infos:
        rows.append((i.number, i.slug, i.title, _claim_ids(i.claims), _recorded(i.slug, "smoke"),
                     _recorded(i.slug, "mid"), last.get(i.slug, "never run")))
    lines = _fit(rows, args.width, flex=2)
    print(lines[0])
    print("-" * min(args.width, max(len(ln) for ln in lines)))
    print("\n".join(lines[1:]))
    return 0


def _dashboard_link(client) -> str | None:
    """The Dask dashboard's address, only when something serves it (bokeh installed)."""
    import importlib.util
    if importlib.util.find_spec("bokeh") is None:
        return None
    return getattr(client, "dashboard_link", None)


# a job's default limit: about ten times smoke's 90 s, twice mid's 15 minutes (a reader's
# laptop is rarely idle), and a day at full, whose longest notebooks run for hours on one GPU
RUN_TIMEOUT = {"smoke": 900, "mid": 1800, "full": 86400}


def cmd_run(args) -> int:
    from . import batch, report
    if not args.all and not args.notebooks:
        print("error: name one or more notebooks (see `workbench list`) or pass --all",
              file=sys.stderr)
        return 2
    if args.resume and not args.out:
        print("error: --resume needs --out, the folder of the run to complete", file=sys.stderr)
        return 2
    if args.timeout is None:
        args.timeout = RUN_TIMEOUT[args.scale]
    executor = "dask" if args.scheduler else args.executor
    import shlex
    command = "workbench " + shlex.join(getattr(args, "argv", None) or ["run"])
    notes: list[str] = []
    try:
        broken: list[tuple[Path, str]] = []
        if args.all:
            infos = nbs.discover(broken=broken)
            for path, reason in broken:
                print(f"warning: skipped {path.name}: {reason}", file=sys.stderr)
        else:
            infos = [nbs.resolve(n) for n in args.notebooks]
        seeds = batch.parse_seeds(args.seeds)
        raw: dict[str, list[str]] = {}
        for name, value in args.param or []:
            if name in raw:
                raise batch.ParameterError(f"-p {name} given twice; use a comma list for a grid")
            raw[name] = batch.split_values(value, f"-p {name}")
        out = Path(args.out) if args.out else None
        if out is not None and out.exists() and not out.is_dir():
            raise batch.RunDirError(f"--out {out} is a file, not a folder; give a folder for "
                                    "the results")
        base = out or project_root() / "runs" / "<new>"
        jobs = batch.plan(infos, base, scale=args.scale, raw_params=raw, seeds=seeds,
                          notes=notes)
    except (LookupError, batch.ParameterError, batch.RunDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    n_jobs = args.jobs or os.cpu_count() or 1
    if args.dry_run:
        try:        # what the real run would refuse when it takes --out
            batch.check_run_dir(out or project_root() / "runs")
        except batch.RunDirError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        where = out or project_root() / "runs" / "<YYYYmmdd-HHMMSS>"
        print(f"{len(jobs)} job(s) over {len({j.slug for j in jobs})} notebook(s) would run, "
              f"{min(n_jobs, len(jobs))} at a time, timeout {args.timeout:g} s each -> {where}")
        for j in jobs:
            print(f"  {batch.job_label(j):<50} {Path(j.out).relative_to(Path(base).resolve())}")
        _print_estimates(jobs)
        return 0
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
        link = _dashboard_link(client)
        how = f"on {where}" + (f", dashboard {link}" if link else "")
    else:
        how = f"{min(n_jobs, len(jobs))} at a time"
    try:        # --out is taken (created, locked) only once every job is known to be valid
        if out is None:
            out, lock = batch.new_run_dir(project_root() / "runs", command)
        else:
            lock = batch.claim_run_dir(out, command)
    except batch.RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        if client is not None:
            cluster.close(client)
        return 2
    if args.out is None:        # planned against a placeholder: lay the jobs out in the new dir
        jobs = batch.plan(infos, out, scale=args.scale, raw_params=raw, seeds=seeds)
    batch.remove_stale_staging(out)     # what a killed runner left; the folder is ours now
    batch.write_plan(out, jobs, infos, command)
    print(f"{len(jobs)} job(s) over {len({j.slug for j in jobs})} notebook(s), {how}, "
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
    lock.close()
    if any(r.status == "interrupted" for r in results):
        print(f"interrupted: finished jobs are kept; `--resume --out {out}` runs the rest",
              file=sys.stderr)
        return 130
    return 0 if all(r.passed for r in results) else 1


def cmd_plan(args) -> int:
    """Each job's estimated FLOPs, peak memory and H100 time (workbench/plan.py), nothing run."""
    from . import plan
    if not args.all and not args.notebooks:
        print("error: name one or more notebooks (see `workbench list`) or pass --all",
              file=sys.stderr)
        return 2
    try:
        infos = nbs.discover() if args.all else [nbs.resolve(n) for n in args.notebooks]
        params = dict(args.param or [])
        ests = [plan.estimate(i.slug, i.path, args.scale, params) for i in infos]
    except (LookupError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = plan.cpu_rate() if args.scale != "full" else None
    rows = [dict(e.row(), **({"cpu_s": e.cpu_seconds(rate[0])} if rate else {})) for e in ests]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        over = "  (over the 10-minute budget)" if r["h100_s"] > plan.BUDGET_S else ""
        print(f"{r['notebook']} at {r['scale']}: {r['flops']:.2e} FLOPs, peak "
              f"{r['peak_gib']:.2f} GiB, about {plan.duration(r['h100_s'])} on one H100{over}"
              + (f", at least {plan.duration(r['cpu_s'])} on one CPU thread" if rate else "")
              + (f"; zoo builds first: {plan.duration(r['build_s'])}" if r["build_s"] else ""))
        for ph in r["phases"]:
            print(f"  {ph['what']:<40} {ph['flops']:9.2e} FLOPs  {plan.duration(ph['s']):>9}")
    print(f"assumed: {plan.assumptions()}"
          + (f"; the CPU at {rate[1]} (the notebook's own FLOPs; Python overhead and small "
             f"kernels make a real run slower)" if rate else ""))
    return 0


def _print_estimates(jobs) -> None:
    """What each distinct job of a dry run would cost (``workbench plan``'s model: FLOPs, peak
    memory, one H100, and this CPU at the measured one-thread rate); a job the cost model cannot
    read says why, and the dry run goes on."""
    from . import plan
    rate = None
    seen = set()
    for j in jobs:
        what = (j.slug, j.scale, tuple(sorted((k, str(v)) for k, v in j.params.items())))
        if what in seen:
            continue
        seen.add(what)
        try:
            est = plan.estimate(j.slug, Path(j.path), j.scale, dict(j.params))
            rate = rate or plan.cpu_rate()
        except (LookupError, ValueError, OSError, TypeError) as e:
            print(f"  estimate of {j.slug} ({j.scale}): none ({e})")
            continue
        params = ", ".join(f"{k}={v}" for k, v in j.params.items())
        print(f"  estimate of {j.slug} ({j.scale}{', ' + params if params else ''}), per seed: "
              f"{est.flops:.2e} FLOPs, peak {est.peak_bytes / 2**30:.2f} GiB; about "
              f"{plan.duration(est.seconds)} on one H100, at least "
              f"{plan.duration(est.cpu_seconds(rate[0]))} on one CPU thread"
              + (f"; zoo builds first: {plan.duration(est.build_seconds)} on an H100"
                 if est.build_seconds else ""))
    if rate:
        print(f"  (estimates, not measurements: the CPU at {rate[1]}; `workbench plan` says more)")


def cmd_report(args) -> int:
    from . import report
    try:
        index = report.build(Path(args.dir), html=not args.no_html, require=True)
    except (FileNotFoundError, report.EmptyRunDir) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {index}\nresults: {index.parent / 'results.csv'}")
    return 0


def cmd_record(args) -> int:
    """``notebooks/results/<slug>.json`` (and ``mid/<slug>.json``) from a run folder: tracked
    files, written only here."""
    run = Path(args.dir)
    if not run.is_dir():
        print(f"error: {run} is not a folder; give the --out folder of `workbench run SLUG "
              "--seeds 0,1,2 --out DIR`", file=sys.stderr)
        return 2
    try:
        slugs = [nbs.resolve(n).slug for n in args.notebooks] if args.notebooks else None
    except (LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from . import results        # imports the zoo's recipes (torch) for the records' keys
    if args.unchanged_from:
        return _rekey(results, Path(args.unchanged_from), run, slugs)
    try:
        seeds = tuple(int(s) for s in args.seeds.split(","))
        results.folder("smoke", seeds)                  # refuses a seed set with no records
    except ValueError as e:
        print(f"error: --seeds {args.seeds}: {e}", file=sys.stderr)
        return 2
    written = results.record(run, slugs=slugs, seeds=seeds)
    for path in written:
        print(f"recorded: {path} (What we saw reads it; commit it with the notebook)")
    seeds = ", ".join(map(str, seeds))
    ran = {d.name for d in run.iterdir() if d.is_dir() and (slugs is None or d.name in slugs)
           and (nbs.notebooks_dir() / f"{d.name}.ipynb").exists()}
    for slug in sorted(ran - {p.stem for p in written}):
        print(f"not recorded: {slug}: neither its default smoke run ({slug}/smoke/) nor its "
              f"default mid run ({slug}/mid/) is ok on every seed of {seeds}", file=sys.stderr)
    if not written:
        print(f"error: nothing recorded from {run}: a record needs a notebook's default smoke or "
              f"mid run ok on seeds {seeds} (`workbench run SLUG [--scale mid] --seeds 0,1,2 "
              f"--out {run}`)", file=sys.stderr)
        return 1
    return 0


def _rekey(results, before: Path, after: Path, slugs) -> int:
    """``record AFTER --unchanged-from BEFORE``: move each record's key to today's code where
    the two folders' runs agree to the last digit (results.rekey)."""
    if not before.is_dir():
        print(f"error: {before} is not a folder; give a run folder of the recorded code",
              file=sys.stderr)
        return 2
    slugs = slugs or sorted(d.name for d in after.iterdir() if d.is_dir()
                            and (nbs.notebooks_dir() / f"{d.name}.ipynb").exists())
    bad = 0
    for slug in slugs:
        scales = [s for s in results.SCALES if (after / slug / s).is_dir()] or ["smoke"]
        for scale in scales:
            why = results.rekey(slug, before, after, scale)
            bad += bool(why)
            at = f" ({scale})" if scale != "smoke" else ""
            print(f"{slug}{at}: " + (f"not carried over: {'; '.join(why)} (record it again)"
                                     if why else "carried over: no number or verdict moved"))
    return 1 if bad else 0


def cmd_compare(args) -> int:
    return compare.run(args)


def cmd_book(args) -> int:
    from . import book
    t0 = time.perf_counter()
    try:
        index = book.build(Path(args.dir), Path(args.out) if args.out else None, jobs=args.jobs,
                           quiet=not args.verbose)
    except (FileNotFoundError, ModuleNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"book: {index} ({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_new(args) -> int:
    from .template import new_paper
    try:
        paths = new_paper(args.name, title=args.title, module=args.module, dry_run=args.dry_run)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = project_root()
    print("would write (nothing written):" if args.dry_run else "wrote:")
    for path in paths:
        print(f"  {path.relative_to(root)}" + ("  (an entry added)" if path.name in
                                              ("plan.py", "README.md") else ""))
    if not args.dry_run:
        slug = paths[0].stem
        tests = " ".join(str(p.relative_to(root)) for p in paths if p.parent.name == "tests")
        print(f"next: rewrite every TODO(template) (grep -rn 'TODO(template)' notebooks workbench "
              f"tests docs), then `pytest {tests}` and `workbench run {slug}`")
    return 0


def _format_cards(built: list[dict]) -> str:
    """The LM and pool cards as the zoo's table, the mini-CLIP cards as their own."""
    from .cards import format_cards, format_clip_cards
    clips = [c for c in built if c.get("kind") == "clip"]
    text = format_cards([c for c in built if c.get("kind") != "clip"])
    return text + ("\n\nmini-CLIP: zero-shot top-1 accuracy\n" + format_clip_cards(clips)
                   if clips else "")


def cmd_zoo(args) -> int:
    try:
        from .models import zoo
    except ImportError as e:
        print(f"error: the zoo needs its dependencies ({e}); reinstall the workbench", file=sys.stderr)
        return 2
    if args.action == "list":
        from . import cache
        from .models import adapters, clip, shipped
        print("recipes: " + ", ".join(sorted(zoo.RECIPES) + [clip.NAME]))
        cards = zoo.list_built() + adapters.list_built() + clip.list_built()
        waiting = shipped.not_copied()      # a fresh clone's zoo: shipped, copied on first use
        if args.json:
            for card in cards + waiting:
                print(json.dumps(card))
            return 0
        if cards:
            print(f"in the cache ({zoo.zoo_dir()}):\n" + _format_cards(cards))
        if waiting:
            print(("\n" if cards else "") + f"shipped in {cache.shipped_root()}, copied into "
                  "the cache on first use (or all at once by `make zoo`), nothing trained:\n"
                  + _format_cards(waiting))
        if not cards and not waiting:
            print("nothing built or shipped: `workbench zoo build --all` trains every recipe")
        return 0
    if args.action == "ship":
        from . import cache
        from .models import shipped
        try:
            lines = shipped.ship_smoke(*args.smoke) if args.smoke else shipped.ship()
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        zoo_mb, smoke_mb = (shipped.size_bytes(r) / 1e6 for r in (cache.shipped_root(),
                                                                   cache.smoke_root()))
        print(f"data/zoo: {zoo_mb:.1f} MB, data/smoke: {smoke_mb:.1f} MB; commit it with the change")
        return 0
    if args.action == "clear":
        if len(args.name) > 1:
            print("error: zoo clear takes one recipe name (or none: everything)", file=sys.stderr)
            return 2
        for path in zoo.clear(args.name[0] if args.name else None):
            print(f"removed {path}")
        return 0
    from .models import adapters, clip
    buildable = sorted(zoo.RECIPES) + [*adapters.SHIPPED_POOLS, clip.NAME]
    unknown = [n for n in args.name if n not in buildable]
    if unknown:
        print(f"error: unknown recipe {unknown[0]!r}; recipes: {', '.join(buildable)}",
              file=sys.stderr)
        return 2
    if args.all or len(args.name) > 1 or (args.name and args.name[0] in [*adapters.SHIPPED_POOLS, clip.NAME]):
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


def _int_at_least(low: int):
    """An argparse type: a whole number >= ``low``, refused with a one-line reason otherwise."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {n}")
        return n
    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return x


RUN_EPILOG = """\
values: -p NAME VALUE sets a parameter of the notebook's parameters cell (see `workbench run
  SLUG --dry-run` and the cell itself). Commas make a grid: -p bits 4,3,2 runs three jobs. One
  value that holds commas is written in brackets or quotes: -p candidates '[lm-base,lm-gpt2]'
  is one job with both models (a str parameter gets "lm-base,lm-gpt2"), and -p x '[1,2],[3]'
  is a grid of two lists. Values outside a parameter's declared limit ([1..], (0..1], {a|b})
  are refused before any job starts.

examples:
  workbench run 12-nfi                              one job: smoke scale, seed 0
  workbench run 12-nfi --seeds 0,1,2 --jobs 2       three seeds, two at a time
  workbench run 12-nfi -p lr 0.01,0.003 --seeds 0,1 a grid: 2 values x 2 seeds = 4 jobs
  workbench run 11-haps -p candidates '[lm-base,lm-gpt2]'   one list value, not a grid
  workbench run --all --scale full --out runs/full  every notebook at full scale
  workbench run --all --out runs/full --resume      run only what is not complete there
  workbench run 12-nfi -p steps 50,100 --dry-run    show the jobs and folders, run nothing

one run owns its --out folder (a second run on it is refused); without --out each run gets a
new runs/<YYYYmmdd-HHMMSS>. While jobs run, the progress line shows each job's cell and the
path of its live log. Exit status: 0 all jobs passed, 1 some failed, 2 bad input (nothing ran),
130 interrupted.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("list", help="every notebook with its claims and last result")
    ls.add_argument("--runs", metavar="DIR", default=None,
                    help="read the last results from this run folder (default: runs/)")
    ls.add_argument("--width", type=_positive_int, default=100,
                    help="columns to fit in (default 100)")

    n = sub.add_parser("new", help="a new paper NN-slug: notebook, method, harness, tests, page",
                       description="Write a new paper, runnable and tested as written: "
                       "notebooks/NN-slug.ipynb, workbench/methods/NAME.py, "
                       "workbench/experiments/NAME.py, tests/test_NAME.py, "
                       "tests/test_experiments_NAME.py and docs/papers/NN-slug.md, plus its "
                       "cost model in workbench/plan.py and its row in docs/papers/README.md. "
                       "They hold a placeholder (gradient descent on a quadratic) to replace "
                       "wherever TODO(template) stands. Refused, with nothing written, when "
                       "the slug is malformed, NN is taken or any of the files exists.",
                       epilog="example: workbench new 20-demo-paper --dry-run")
    n.add_argument("name", help="NN-slug: two digits, a dash, lowercase letters, digits and "
                   "dashes (e.g. 20-demo-paper)")
    n.add_argument("--title", help="the paper's title (default: from the slug)")
    n.add_argument("--module", metavar="NAME", help="the method's and harness's module name "
                   "(default: the slug without its number, '-' as '_': demo_paper)")
    n.add_argument("--dry-run", action="store_true", help="list the files it would write and "
                   "write nothing")

    r = sub.add_parser("run", help="execute notebooks through papermill, in parallel",
                       description="Run notebooks as papermill jobs: one job per notebook x "
                       "parameter set x seed, each in its own folder of --out, then write the "
                       "report (index.html, results.csv, aggregate.csv) into it. Nothing outside "
                       "--out is written: `workbench record DIR` turns a three-seed run into "
                       "the notebooks' recorded results.",
                       epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("notebooks", nargs="*", metavar="SLUG", help="e.g. 12-nfi (or its number)")
    r.add_argument("--all", action="store_true", help="every notebook")
    r.add_argument("--scale", choices=SCALES, default="smoke",
                   help="the sizes each notebook runs at: smoke (CPU, about a minute a "
                        "notebook; the default), mid (at most 15 minutes a seed on 2 CPU "
                        "cores, sized to show each paper's effect) or full (the papers' "
                        "sizes, mostly GPU)")
    r.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="set a notebook parameter; a comma list (-p bits 4,3,2) makes a grid, "
                        "a value in brackets or quotes ('[a,b]', '\"a,b\"') is one value")
    r.add_argument("--seeds", default="0", help="comma list of seeds, e.g. 0,1,2 (default 0)")
    r.add_argument("--jobs", type=_positive_int, default=None,
                   help="parallel jobs (default: cores; with --scheduler, the cluster's threads)")
    r.add_argument("--timeout", type=_seconds, default=None,
                   help="seconds per job before it is stopped (default: "
                        + ", ".join(f"{v:g} at {k}" for k, v in RUN_TIMEOUT.items()) + ")")
    r.add_argument("--out", default=None,
                   help="run folder, owned by this run while it runs (default: a new "
                        "runs/<YYYYmmdd-HHMMSS>)")
    r.add_argument("--dry-run", action="store_true",
                   help="check every value and list the jobs and their folders; run nothing")
    r.add_argument("--resume", action="store_true",
                   help="skip jobs complete in --out for the same notebook content and parameters")
    r.add_argument("--strict", action="store_true",
                   help="a robust claim that does not hold fails its job")
    r.add_argument("--executor", choices=("process", "dask"), default="process",
                   help="local papermill processes (default) or tasks on a Dask cluster")
    r.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="Dask scheduler to run on, e.g. tcp://host:8786 (implies --executor dask;"
                        " default: a local cluster of --jobs workers)")
    r.add_argument("--retries", type=_non_negative_int, default=1,
                   help="Dask: times a job is re-run on another worker when its worker dies "
                        "(local cluster; an existing one uses its allowed-failures setting)")
    r.add_argument("--html", action="store_true",
                   help="also render each executed notebook as HTML (about 1 s each)")

    pl = sub.add_parser("plan", help="each job's estimated FLOPs, memory and H100 time; runs "
                        "nothing", description="Estimate each notebook's cost at a scale from "
                        "its SIZES row and its zoo models' configs (workbench/plan.py): FLOPs, "
                        "peak memory and time on one H100, with the zoo builds it would start. "
                        "Estimates at a stated utilisation, not measurements.")
    pl.add_argument("notebooks", nargs="*", metavar="SLUG", help="e.g. 14-gsq (or its number)")
    pl.add_argument("--all", action="store_true", help="every notebook")
    pl.add_argument("--scale", choices=SCALES, default="full", help="default full")
    pl.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                    help="a notebook parameter or size, as workbench run takes it")
    pl.add_argument("--json", action="store_true", help="one JSON list of the estimates")

    rep = sub.add_parser("report", help="results.csv, aggregate.csv and index.html of a run dir",
                         description="Write results.csv, aggregate.csv and index.html into DIR "
                         "from what its jobs left; nothing outside DIR is written.")
    rep.add_argument("dir")
    rep.add_argument("--no-html", action="store_true",
                     help="do not render executed notebooks as HTML (faster)")

    rec = sub.add_parser("record", help="notebooks/results/<slug>.json from a three-seed run "
                         "(what a notebook's What we saw shows)",
                         description="Write notebooks/results/<slug>.json (tracked: commit it with "
                         "the notebook) for each notebook whose default smoke run in DIR is ok on "
                         "seeds 0, 1 and 2: every claim's verdict per seed, every scalar metric's "
                         "mean, std and values. The one command that writes these files.")
    rec.add_argument("dir", help="a run folder, as `workbench run SLUG --seeds 0,1,2 --out DIR` "
                     "writes it")
    rec.add_argument("notebooks", nargs="*", metavar="SLUG",
                     help="record only these notebooks (default: every one the folder holds)")
    rec.add_argument("--seeds", default=",".join(map(str, (0, 1, 2))),
                     help="the seeds to record: 0,1,2 (the record What we saw shows; default) or "
                     "3,4,5 (the judging seeds of a changed criterion, recorded in judging/ "
                     "beside it)")
    rec.add_argument("--unchanged-from", metavar="BEFORE",
                     help="record nothing new: carry each record over to today's code where "
                     "DIR's seeds equal BEFORE's (a run of the recorded commit) in every metric "
                     "and verdict")

    cmp_ = sub.add_parser("compare", help="which metrics and verdicts moved between two run "
                          "folders", description=compare.__doc__.split("\n\n")[0],
                          epilog="Timings are left out; exit status 1 when anything differs.")
    compare.add_arguments(cmp_)

    bk = sub.add_parser("book", help="a static site of a run's executed notebooks (docs/book.md)",
                        description="Build the book: one chapter per executed notebook of the "
                        "run (never re-run), verdicts over seeds from notebooks/results/, the "
                        "claims matrix, the shared parts and docs/; search, maths, offline.")
    bk.add_argument("dir", help="a run folder, as `workbench run --all --out DIR` writes it")
    bk.add_argument("--out", default=None, help="where to build (default DIR/book; the site is "
                    "OUT/html/index.html, a rebuild redoes only what changed)")
    bk.add_argument("--jobs", type=_positive_int, default=2, help="Sphinx processes (default 2)")
    bk.add_argument("--verbose", action="store_true", help="Sphinx's progress and warnings")

    z = sub.add_parser("zoo", help="build, list, clear or ship the shared pretrained backbones")
    z.add_argument("action", choices=("build", "list", "clear", "ship"),
                   help="ship: copy the local smoke builds at today's keys into data/zoo (what "
                        "the checkout carries, so nothing is trained elsewhere)")
    z.add_argument("name", nargs="*",
                   help="build: recipes (and lora-pool/lm-base), several at a time like --all; "
                        "clear: one recipe, or none for everything")
    z.add_argument("--scale", choices=SCALES, default="smoke")
    z.add_argument("--force", action="store_true", help="rebuild even when cached")
    z.add_argument("--all", action="store_true",
                   help="build: every recipe and the LoRA pool")
    z.add_argument("--json", action="store_true", help="list: one JSON card per line")
    z.add_argument("--smoke", nargs="+", metavar="RUN", default=None,
                   help="ship: instead of the zoo, the cache entries the smoke runs under these "
                        "run folders derived from it (fine-tunes, sweeps...) into data/smoke, "
                        "so a fresh clone's notebooks train nothing")
    z.add_argument("--jobs", type=int, default=2,
                   help="build of several: builds at a time, one CPU thread each (default 2)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    handler = {"list": cmd_list, "new": cmd_new, "run": cmd_run, "plan": cmd_plan,
               "report": cmd_report, "record": cmd_record, "compare": cmd_compare,
               "book": cmd_book, "zoo": cmd_zoo}
    try:
        return handler[args.command](args)
    except BrokenPipeError:         # `workbench list | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
