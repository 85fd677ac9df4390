"""The shipped zoo: the smoke builds the checkout carries in ``data/zoo``, so nothing is trained.

Training is deterministic on one machine but not across machines (data/zoo.md: the same recipe
gave ``lm-base`` kv 0.25 on one CPU and 0.45 on another), and notebooks choose their families from
the cards, so two machines that built their own zoo ran two different experiments. The checkout
therefore ships the smoke weights of every recipe, of the LoRA pool on ``lm-base`` and of the
mini-CLIP, each in the folder its key names, laid out as the cache's ``zoo`` folder;
:func:`workbench.cache.build` copies a shipped entry into the cache instead of training it. A
recipe change moves its key, finds nothing shipped and builds as before; ``workbench zoo build
NAME --force`` rebuilds locally.

:func:`entries` lists what must be shipped at today's keys, :func:`check` what is wrong with
``data/zoo`` (missing, stale or mislabelled), :func:`ship` copies finished local builds there
(``workbench zoo ship``, after a recipe change and a rebuild).

The smoke runs' own entries. What the notebooks derive from the zoo on first use (19's adapted
models, 16's fine-tunes, 11's routers, 06's GRPO and readers, 01's streams, 04's sweep...) kept a
fresh clone's ``make run`` 28 minutes in its notebooks (10 with them shipped). They ship too, in
``data/smoke`` laid out as the cache (:func:`workbench.cache.smoke_root`): :func:`ship_smoke` copies
the entries that runs used (each run's ``metrics.json`` lists them, :func:`workbench.cache.entries`)
and writes ``MANIFEST.json`` (entry, ready file, the notebooks that use it, bytes);
:func:`check_smoke` says what is wrong with it. Their keys are computed inside the experiments, so
a code change that moves one leaves the shipped copy unused (the notebook builds as before, and
the run's ``metrics.json`` says ``built``): ship again from a fresh ``make run``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .. import cache
from . import adapters, clip, zoo

__all__ = ["SCALE", "FILES", "entries", "check", "not_copied", "ship", "size_bytes",
           "smoke_entries", "ship_smoke", "check_smoke", "MANIFEST"]

SCALE = "smoke"
# what a shipped folder keeps (lock files, peft's README and temporary folders stay behind)
FILES = ("card.json", "done.json", "config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json", "adapter_config.json",
         "adapter_model.safetensors")


def entries() -> dict[str, tuple[Path, str]]:
    """``{name: (folder relative to the zoo, the key its card must carry)}`` at today's keys."""
    out = {}
    for name, r in zoo.RECIPES.items():
        out[name] = (zoo.model_dir(name, SCALE).relative_to(zoo.zoo_dir()), r.key(SCALE))
    for name, kw in adapters.SHIPPED_POOLS.items():
        pool = adapters.pool_dir(adapters.POOL_BASE, SCALE, **kw)
        out[name] = (pool.relative_to(zoo.zoo_dir()), pool.name.rsplit("-", 1)[1])
    c = clip.model_dir(SCALE)
    out[clip.NAME] = (c.relative_to(zoo.zoo_dir()), c.name.rsplit("-", 1)[1])
    return out


def check(root: Path | None = None) -> list[str]:
    """What is wrong with the shipped zoo at ``root`` (``data/zoo``): [] when every entry is
    shipped at today's key, its card agrees, and nothing else is there."""
    root = Path(root or cache.shipped_root())
    problems, wanted = [], entries()
    for name, (rel, key) in wanted.items():
        card = root / rel / "card.json"
        if not card.exists():
            problems.append(f"{name}: nothing shipped at {rel} (build it, then `workbench zoo ship`)")
            continue
        c = json.loads(card.read_text())
        if name in adapters.SHIPPED_POOLS:
            if c.get("base_key") != zoo.recipe(adapters.POOL_BASE).key(SCALE):
                problems.append(f"{name}: its card's base_key is not lm-base's key")
        elif c.get("key") != key:
            problems.append(f"{name}: its card says key {c.get('key')}, the recipe's is {key}")
    kept = {str(rel) for rel, _ in wanted.values()}
    for d in _folders(root):
        if str(d.relative_to(root)) not in kept:
            problems.append(f"{d.relative_to(root)}: shipped but no recipe has this key (remove it)")
    return problems


def not_copied() -> list[dict]:
    """The cards of what ``data/zoo`` ships at today's keys and the cache does not hold yet, as
    ``workbench zoo list`` shows them beside the built ones: each with its ``path`` in
    ``data/zoo`` and ``"shipped": True``. The backbones first, then the pool, then the mini-CLIP
    (the order of the built ones); :func:`workbench.cache.build` copies each on first use."""
    out = []
    for rel, _ in sorted(entries().values(), key=lambda e: (len(e[0].parts), str(e[0]))):
        card = cache.shipped_root() / rel / "card.json"
        if card.exists() and not (zoo.zoo_dir() / rel / "card.json").exists():
            out.append({**json.loads(card.read_text()), "path": str(card.parent), "shipped": True})
    return out


def _folders(root: Path) -> list[Path]:
    """The shipped entry folders under ``root`` (those holding a card)."""
    return sorted(p.parent for p in root.glob("**/card.json"))


def ship(root: Path | None = None) -> list[str]:
    """Copy every finished local build at today's keys into ``root`` (``data/zoo``), keeping
    only :data:`FILES`, and remove shipped folders no recipe names any more; return what changed.
    Raises when an entry is not built locally (build it first)."""
    root = Path(root or cache.shipped_root())
    wanted, done = entries(), []
    for name, (rel, _) in wanted.items():      # all built, or nothing shipped is touched
        src = zoo.zoo_dir() / rel
        if not (src / "card.json").exists():
            raise FileNotFoundError(f"{name} is not built at {src}: `workbench zoo build {name}`")
    for name, (rel, _) in wanted.items():
        src, dst = zoo.zoo_dir() / rel, root / rel
        shutil.rmtree(dst, ignore_errors=True)
        for f in sorted(src.rglob("*")):
            if f.is_file() and f.name in FILES:
                (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dst / f.relative_to(src))
        done.append(f"shipped {name} -> {dst}")
    kept = {str(rel) for rel, _ in wanted.values()}
    for d in _folders(root):
        if str(d.relative_to(root)) not in kept:
            shutil.rmtree(d)
            done.append(f"removed {d}")
    return done


def size_bytes(root: Path | None = None) -> int:
    """The shipped zoo's size on disk (the issue asks for about 60 MB at most)."""
    root = Path(root or cache.shipped_root())
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


MANIFEST = "MANIFEST.json"
_SMOKE_SKIP = ("README.md",)          # peft's boilerplate beside an adapter


def smoke_entries(*run_dirs: Path) -> dict[str, dict]:
    """``{entry: {"ready", "notebooks"}}``: the cache entries the smoke runs under ``run_dirs``
    used (their ``metrics.json``), less the zoo's own (shipped in ``data/zoo``)."""
    zoo_own = {("zoo" / rel).as_posix() for rel, _ in entries().values()}
    out: dict[str, dict] = {}
    for run_dir in run_dirs:
        for m in sorted(Path(run_dir).rglob("metrics.json")):
            met = json.loads(m.read_text())
            if met.get("scale") != SCALE:
                continue
            for e in met.get("cache", []):
                if e["entry"] in zoo_own:
                    continue
                d = out.setdefault(e["entry"], {"ready": e["ready"], "notebooks": []})
                if met.get("notebook") and met["notebook"] not in d["notebooks"]:
                    d["notebooks"].append(met["notebook"])
    if not out:
        raise FileNotFoundError(f"no smoke run under {', '.join(map(str, run_dirs))} lists its "
                                "cache entries (run the notebooks first: `workbench run --all`)")
    return dict(sorted(out.items()))


def ship_smoke(*run_dirs: Path, root: Path | None = None) -> list[str]:
    """Ship every entry the smoke runs under ``run_dirs`` used, from the cache into ``root``
    (``data/smoke``, made anew: what no run used is gone), with the manifest; return what
    changed. Raises, and touches nothing, when an entry is not in the cache (a run on another
    cache root)."""
    root = Path(root or cache.smoke_root())
    wanted = smoke_entries(*run_dirs)
    for rel, d in wanted.items():
        if not cache.is_built(cache.root() / rel, d["ready"]):
            raise FileNotFoundError(f"{rel} is not in the cache {cache.root()}: ship from the "
                                    "cache the runs used (WORKBENCH_CACHE)")
    old = (json.loads((root / MANIFEST).read_text())["entries"]
           if (root / MANIFEST).exists() else {})
    tmp = root.parent / f".{root.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    done = []
    for rel, d in wanted.items():
        src = cache.root() / rel
        for f in sorted(src.rglob("*")):
            if f.is_file() and f.name not in _SMOKE_SKIP:
                (tmp / rel / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, tmp / rel / f.relative_to(src))
        d["bytes"] = size_bytes(tmp / rel)
        if rel not in old:
            done.append(f"shipped {rel} ({d['bytes'] / 1e6:.1f} MB; {', '.join(d['notebooks'])})")
    done += [f"removed {rel}" for rel in old if rel not in wanted]
    (tmp / MANIFEST).write_text(json.dumps({"entries": wanted}, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    os.rename(tmp, root)
    return done


def check_smoke(root: Path | None = None) -> list[str]:
    """What is wrong with the shipped smoke entries at ``root`` (``data/smoke``): [] when every
    manifest entry is there and finished, and every file belongs to one."""
    root = Path(root or cache.smoke_root())
    if not (root / MANIFEST).exists():
        return [f"{root / MANIFEST} is missing (`workbench zoo ship --smoke RUN`)"]
    wanted = json.loads((root / MANIFEST).read_text())["entries"]
    problems = [f"{rel}: in the manifest but not finished (no {d['ready']})"
                for rel, d in wanted.items() if not cache.is_built(root / rel, d["ready"])]
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = f.relative_to(root).as_posix()
        if not any(rel.startswith(w + "/") for w in wanted):
            problems.append(f"{rel}: in no manifest entry (ship again, or remove it)")
    return problems
