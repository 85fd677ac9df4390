"""InduceKV (paper 01, ``docs/papers/01-inducekv.md``): the harness of notebook 01-inducekv.

The method (memory entries, the cache they are written into, the bilevel selection, the stream
under a byte budget) lives in :mod:`workbench.methods.inducekv`; the baselines' building blocks
(LoRA bytes and states, the MoE router, the L2P prompt pool) in
:mod:`workbench.methods.inducekv_baselines`. Here is what the notebook runs with them:

- the task stream and its data (held-out test problems, candidate prefixes and probes, LoRA
  training pairs), from space-separated family specs;
- the C1 equivalence checks (entry vs prefix text, two entries end to end, ``generate``);
- InduceKV on every scenario, and the selection and calibration contrasts (C4);
- the continual-VQA stream (:func:`multimodal_backbone`: images through the frozen mini-CLIP and
  the caption-trained ClipCap projector into the LM's input embeddings, :mod:`workbench.methods.
  inducekv_mm`; :func:`vqa_data`: digit, colour, shape and texture questions) and the check that
  the prefix reaches the LM (:func:`prefix_check`);
- the baselines at the same budget (sequential LoRA, replay, MoE of LoRAs routed by centroids and
  by a trained gate (:func:`gated_moe`), an L2P prompt pool),
  their trained states cached by a key of everything that changes them (:func:`cached_states`,
  :func:`workbench.cache.build`), and their accuracy matrices;
- the diagnostics of C5 (a compute-matched LoRA, bounded pools, smaller budgets, more entries
  retrieved) and the footprint traces of C2;
- the explorer over the byte budget: :func:`pair_scores` scores every (example, entry) pair a
  stream can ask for once, and :func:`replay_stream` reruns :func:`K.run_stream`'s memory (evict,
  select, calibrate, retrieve) at any budget and selection rule from those lookups, in a fraction
  of a second; :func:`stream_figure` draws it.
"""
from __future__ import annotations

import hashlib
import json
import random
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from peft import PeftModel

from workbench import cache, plots
from workbench.data import images, packing, tasks
from workbench.evaluate import MIDDLE, heldout_examples
from workbench.methods import inducekv as K
from workbench.methods import inducekv_baselines as KB
from workbench.methods import inducekv_mm as MM
from workbench.models import adapters, clip, finetune, zoo

__all__ = ["Settings", "parse_stream", "scenarios", "frozen_backbone", "task_data", "data_summary",
           "equivalence_table", "two_entries_diff", "generate_matches", "run_inducekv",
           "cache_path", "cached_states", "sequential_lora", "moe_experts", "lora_pool",
           "lora_matrix", "lora_baselines", "l2p_baseline", "results_table", "c3_summary",
           "selection_runs", "selection_table", "calibration_summary", "compute_matched_lora",
           "diagnostics", "footprint", "slug", "PairScores", "pair_scores", "replay_stream",
           "stream_figure", "gated_moe", "VQA_TASKS", "vqa_stream",
           "MultimodalBackbone", "vqa_data", "projector_state", "multimodal_backbone",
           "prefix_check", "task_rules"]


# -- the stream and its data ---------------------------------------------------------------------
def parse_stream(spec: str) -> list[tuple[str, str, int]]:
    """'sub sort@4' -> [(name, family, difficulty)]; a bare family runs at its middle level.
    (Spaces, not commas: a comma list on the command line is a grid of jobs.)"""
    out = []
    for item in spec.split():
        fam, _, d = item.partition("@")
        tasks.get(fam)
        out.append((item, fam, int(d) if d else MIDDLE[fam]))
    return out


def scenarios(stream: str, domain_stream: str = "") -> dict[str, list[tuple[str, str, int]]]:
    """The task-incremental stream, and the domain-incremental one when it is given."""
    out = {"task-incremental": parse_stream(stream)}
    if domain_stream:
        out["domain-incremental"] = parse_stream(domain_stream)
    return out


def frozen_backbone(model: str, scale: str, device="cpu"):
    """The zoo backbone ``model`` at ``scale`` on ``device``, every parameter frozen:
    ``(lm, tok)``."""
    lm, tok = zoo.load(model, scale, device=str(device))
    for p in lm.parameters():
        p.requires_grad_(False)
    return lm, tok


def task_rules(scens: dict, seed: int) -> dict[str, object]:
    """The rule of every task of an in-context family (:data:`tasks.ICL_FAMILIES`: a tag
    letter, a substitution, ...), drawn once per task and seed and distinct between tasks of
    one family: such a task is its family under one fixed rule, which a prompt alone does not
    show and an entry of the task does."""
    rng, rules = random.Random(zlib.crc32(f"rules:{seed}".encode())), {}
    for items in scens.values():
        for name, fam, _ in items:
            draw = tasks.get(fam).rule
            if draw is None or name in rules:
                continue
            taken = [r for n, r in rules.items() if n.partition("@")[0] == fam]
            rule = draw(rng)
            while rule in taken:
                rule = draw(rng)
            rules[name] = rule
    return rules


def task_data(tok, scens: dict, sizes: dict, seed: int, with_steps: bool) -> dict[str, dict]:
    """Per task of every scenario: ``test`` (the pool card's held-out problems), ``pool`` and
    ``probes`` (candidate prefixes and likelihood probes, never a test prompt, one seeded
    permutation shared by the stream), ``train`` and ``pairs`` (LoRA training examples at every
    difficulty of the family, as the pool trained, or at the one level named). A task of an
    in-context family holds its rule (:func:`task_rules`) in every split, and its test problems
    are drawn under it (distinct prompts, none a candidate's)."""
    rs = np.random.default_rng(seed)
    rules = task_rules(scens, seed)
    data = {}
    for items in scens.values():
        for name, fam, d in items:
            rule = rules.get(name)
            if rule is None:
                test = heldout_examples(fam, d, sizes["n_test"], seed=999)[0]
            else:
                drawn = tasks.generate(fam, 4 * sizes["n_test"], 999, d, rule)
                test = list({e.prompt: e for e in drawn}.values())[: sizes["n_test"]]
            banned = {e.prompt for e in test}
            cand = [e for e in tasks.generate(fam, 6 * (sizes["n_pool"] + sizes["n_probe"]),
                                              seed + 100, d, rule) if e.prompt not in banned]
            cand = list({e.prompt: e for e in cand}.values())
            pick = rs.permutation(len(cand))
            levels = [d] if "@" in name else tasks.get(fam).difficulties
            train = [e for lv in levels for e in tasks.generate(
                fam, -(-sizes["lora_train"] // len(levels)), seed + 200, lv, rule)
                if e.prompt not in banned]
            n_pool = sizes["n_pool"]
            data[name] = {"family": fam, "difficulty": d, "rule": rule, "test": test,
                          "pool": [cand[i] for i in pick[:n_pool]],
                          "probes": [cand[i] for i in pick[n_pool: n_pool + sizes["n_probe"]]],
                          "train": train,
                          "pairs": packing.encode(tok, [e.prompt for e in train],
                                                  [e.completion(with_steps) for e in train])}
    return data


def data_summary(scens: dict, data: dict) -> pd.DataFrame:
    """One row per task: scenario, family, difficulty, rule (in-context families) and the sizes
    of its splits."""
    return pd.DataFrame([{"scenario": s, "task": n, "family": f, "difficulty": d,
                          "rule": data[n].get("rule"),
                          "test": len(data[n]["test"]), "candidates": len(data[n]["pool"]),
                          "probes": len(data[n]["probes"]), "lora_examples": len(data[n]["pairs"])}
                         for s, items in scens.items() for n, f, d in items])


def slug(text: str) -> str:
    """A metric-name part: spaces and punctuation to underscores ("LoRA, compute-matched" ->
    "LoRA_compute_matched")."""
    out = "".join(c if c.isalnum() else "_" for c in text)
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_")


# -- the continual-VQA stream -------------------------------------------------------------------
# task -> (image family, question, the answer of a class name)
VQA_TASKS = {"digit": ("digits", "digit ->", lambda c: c),
             "colour": ("shapes", "colour ->", lambda c: c.split()[1]),
             "shape": ("shapes", "shape ->", lambda c: c.split()[2]),
             "texture": ("shapes", "texture ->", lambda c: c.split()[0])}


def vqa_stream(spec: str) -> list[tuple[str, str, int]]:
    """'digit colour shape' -> [(name, "vqa-<name>", 0)], every name a :data:`VQA_TASKS` key."""
    return [(n, f"vqa-{n}", 0) for n in spec.split() if VQA_TASKS[n]]


def _vqa_images(fam: str, split: str, n: int, seed: int):
    """``n`` images of ``fam`` with their class names: digits from CLIP's ``split``; shapes
    freshly drawn (seen classes; the test split from another seed than the training one)."""
    if fam == "digits":
        x, y, _ = images.digits(split)
        names = [images.DIGIT_NAMES[i] for i in y]
    else:
        cls = images.classes("shapes", "seen")
        x, y, _ = images.shapes(cls, -(-n // len(cls)), seed + (500 if split == "test" else 600))
        names = [cls[i] for i in y]
    pick = np.random.default_rng([seed, len(names), 3]).permutation(len(names))[:n]
    return x[pick], [names[i] for i in pick]


def vqa_data(tok, items, sizes: dict, seed: int) -> tuple[dict, np.ndarray]:
    """Per task, as :func:`task_data`: ``test`` (held-out images), ``pool``, ``probes`` and
    ``train`` (training images) of ``<image:n> question -> answer`` examples; and the images
    (N, 3, 16, 16), row ``n`` being image ``n`` of the stream."""
    data, xs, at = {}, [], 0
    for name, fam, _ in items:
        img_fam, question, answer = VQA_TASKS[name]
        n_tr = sizes["n_pool"] + sizes["n_probe"] + sizes["vqa_train"]
        split = {}
        for part, n in (("test", sizes["n_test"]), ("train", n_tr)):
            x, cls = _vqa_images(img_fam, part, n, seed)
            split[part] = [tasks.Example(fam, f"{MM.marker(at + i)} {question}", answer(c), 0)
                           for i, c in enumerate(cls)]
            xs.append(x)
            at += len(x)
        tr, n_pool = split["train"], sizes["n_pool"]
        train = tr[n_pool + sizes["n_probe"]:]
        data[name] = {"family": fam, "difficulty": 0, "test": split["test"],
                      "pool": tr[:n_pool], "probes": tr[n_pool: n_pool + sizes["n_probe"]],
                      "train": train,
                      "pairs": packing.encode(tok, [e.prompt for e in train],
                                              [e.completion() for e in train])}
    return data, np.concatenate(xs)


@dataclass
class MultimodalBackbone:
    """The frozen CLIP image features of a stream's images and the trained projector's state:
    :meth:`setup` installs the prefix into a loaded LM (frozen); ``key`` names it in caches."""
    features: torch.Tensor
    projector: dict
    k: int
    key: str

    def setup(self, lm):
        p = MM.Projector(self.features.shape[1], lm.config.hidden_size, self.k)
        p.load_state_dict(self.projector)
        for q in p.parameters():
            q.requires_grad_(False)
        return MM.install(lm, p.eval(), self.features)


def projector_state(model: str, scale: str, sizes: dict, seed: int = 0, device="cpu") -> dict:
    """The ClipCap projector trained on captions (CLIP's training digits and seen shapes, every
    caption template) with the LM and CLIP frozen; cached by its settings. Part of the frozen
    multimodal backbone, so one build (seed 0) serves every seed of the notebook; trained on
    ``device`` (not in the key), kept on the host."""
    spec = {"base": model, "scale": scale, "seed": seed, "k": sizes["vqa_k"],
            "steps": sizes["proj_steps"], "lr": sizes["proj_lr"], "batch": sizes["lora_batch"]}

    def build():
        lm, tok = frozen_backbone(model, scale, device)
        cm, _ = clip.load(scale, str(device))
        x, _, caps = images.digits("train")
        xs, _, caps2 = images.shapes(images.classes("shapes", "seen"), 8, 0)
        with torch.no_grad():
            f = clip.image_features(cm, np.concatenate([x, xs]))
        emb = float(lm.get_input_embeddings().weight.std())
        proj = MM.Projector(f.shape[1], lm.config.hidden_size, sizes["vqa_k"], seed=seed,
                            scale=emb)
        MM.install(lm, proj, f)
        mtok = MM.ImageTokenizer(tok, sizes["vqa_k"])
        pairs = packing.encode(mtok, [MM.marker(i) for i in range(len(f))],
                               [" " + c for c in caps + caps2])
        losses = finetune.train_steps(lm, pairs, sizes["proj_steps"], sizes["lora_batch"],
                                      sizes["proj_lr"], seed, tok.pad_token_id)
        return {"state": {k: v.detach().cpu().clone() for k, v in proj.state_dict().items()},
                "losses": losses}
    return cached_states("projector", spec, build)


def multimodal_backbone(model: str, scale: str, items, sizes: dict, seed: int, device="cpu"):
    """The continual-VQA stream's frozen multimodal backbone and data: ``(lm, tok, mm, data,
    caption_losses)``: the zoo LM with the stream's image prefix installed, the
    :class:`MM.ImageTokenizer`, the :class:`MultimodalBackbone`, :func:`vqa_data`'s tasks; the
    LM on ``device``."""
    lm, tok = frozen_backbone(model, scale, device)
    mtok = MM.ImageTokenizer(tok, sizes["vqa_k"])
    data, x = vqa_data(mtok, items, sizes, seed)
    cm, _ = clip.load(scale, str(device))
    with torch.no_grad():
        feats = clip.image_features(cm, x)
    proj = projector_state(model, scale, sizes, device=device)
    key = cache.key(lm.zoo_card["key"], str(clip.model_dir(scale).name), sizes["vqa_k"],
                    sizes["proj_steps"], sizes["proj_lr"], feats.sum().item(), len(feats))
    mm = MultimodalBackbone(feats, proj["state"], sizes["vqa_k"], key)
    return mm.setup(lm), mtok, mm, data, proj["losses"]


@torch.no_grad()
def prefix_check(lm, tok, data: dict, names: list[str]) -> dict:
    """The image prefix reaches the LM: the largest difference between the logits of a test
    prompt through the placeholder ids and through hand-built ``inputs_embeds`` (text
    embeddings with ``projector(CLIP(image))`` after ``<bos>``), and how far the logits move
    when another image of the stream is put in its place."""
    diff, moved = 0.0, []
    for n in names:
        a, b = data[n]["test"][:2]
        (ids, _), (ids_b, _) = packing.encode(tok, [a.prompt, b.prompt])
        k, V = tok.k, tok.vocab
        img_a, img_b = (ids[1] - V) // k, (ids_b[1] - V) // k
        text = _ids(lm, ids[:1] + ids[1 + k:])
        ref = lm(inputs_embeds=MM.prefix_embeds(lm, text, [img_a])).logits
        got = lm(input_ids=_ids(lm, ids)).logits
        swap = lm(input_ids=_ids(lm, ids[:1] + ids_b[1: 1 + k] + ids[1 + k:])).logits
        diff = max(diff, float((ref - got).abs().max()))
        moved.append(float((swap - got)[0, -1].abs().max()) if img_a != img_b else 0.0)
    return {"max_logit_diff_vs_inputs_embeds": diff, "min_logit_move_other_image": min(moved)}


# -- C1: an entry is its prefix in context -------------------------------------------------------
def _ids(lm, ids: list[int]) -> torch.Tensor:
    """One row of token ids on ``lm``'s device."""
    return torch.tensor([ids], device=lm.device)


def _query_ids(tok, text: str) -> list[int]:
    return [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def equivalence_table(lm, tok, data: dict, names: list[str], with_steps: bool) -> pd.DataFrame:
    """For every (prefix task, query task) pair: the largest logit and hidden-state differences
    between the backbone on the concatenated text and the query on top of the prefix's entry,
    the logit scale, and the difference when the query wrongly sits at positions 0.. (the
    rotary mistake: keys were stored rotated at their own positions)."""
    rows = []
    for a in names:
        for b in names:
            pre, q = data[a]["pool"][0], data[b]["test"][0]
            e = K.make_entry(lm, tok, pre, a, with_steps)
            qi = _query_ids(tok, q.prompt + q.completion(with_steps))
            full = lm(input_ids=_ids(lm, e.ids + qi), output_hidden_states=True)
            cached = K.forward_with_entries(lm, [e], _ids(lm, qi), output_hidden_states=True)
            cache_, _ = K.build_cache(lm, [e])
            wrong = lm(input_ids=_ids(lm, qi), cache=cache_,
                       position_ids=torch.arange(len(qi), device=lm.device)[None]).logits[0]
            dl = float((full.logits[0, e.length:] - cached.logits[0]).abs().max())
            dh = max(float((hf[0, e.length:] - hc[0]).abs().max())
                     for hf, hc in zip(full.hidden_states, cached.hidden_states))
            rows.append({"prefix": a, "query": b, "prefix_tokens": e.length, "max_logit_diff": dl,
                         "max_hidden_diff_any_layer": dh,
                         "logit_scale": float(full.logits[0, e.length:].abs().max()),
                         "wrong_positions_diff": float((full.logits[0, e.length:] - wrong)
                                                       .abs().max())})
    return pd.DataFrame(rows)


@torch.no_grad()
def two_entries_diff(lm, tok, data: dict, names: list[str], with_steps: bool) -> float:
    """Two entries end to end against the concatenated prefixes under a 4-D mask in which each
    prefix sees only itself (and the query sees both): the largest logit difference."""
    ea, eb = (K.make_entry(lm, tok, data[n]["pool"][1], n, with_steps) for n in names[:2])
    qi = _query_ids(tok, data[names[-1]]["test"][1].prompt)
    n_all = ea.length + eb.length + len(qi)
    allowed = torch.tril(torch.ones(n_all, n_all, dtype=torch.bool, device=lm.device))
    allowed[ea.length: ea.length + eb.length, : ea.length] = False
    mask = torch.zeros(1, 1, n_all, n_all, device=lm.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min)
    ref = lm(input_ids=_ids(lm, ea.ids + eb.ids + qi), attention_mask=mask,
             position_ids=torch.arange(n_all, device=lm.device)[None]).logits[0, -len(qi):]
    two = K.forward_with_entries(lm, [ea, eb], _ids(lm, qi)).logits[0]
    return float((ref - two).abs().max())


def generate_matches(lm, tok, data: dict, names: list[str], with_steps: bool,
                     per_task: int = 2, max_new_tokens: int = 12) -> list[bool]:
    """Greedy ``generate`` with the entry's cache injected against ``generate`` on the full
    text, for ``per_task`` test prompts of every task: whether the tokens are identical."""
    same = []
    for n in names:
        e = K.make_entry(lm, tok, data[n]["pool"][2], n, with_steps)
        for q in data[n]["test"][:per_task]:
            ids = _ids(lm, e.ids + _query_ids(tok, q.prompt))
            kw = dict(max_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            g_full = lm.generate(ids, **kw)
            g_cache = lm.generate(ids, cache=K.build_cache(lm, [e])[0], **kw)
            same.append(bool(torch.equal(g_full, g_cache)))
    return same


# -- InduceKV on the stream ----------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """What every run on one stream shares: the deployed-byte ``budget``, the notebook's sizes
    (``sizes``, its ``S``), the ``seed``, and whether answers are written with their steps
    (``with_steps``, :func:`workbench.models.zoo.with_steps`), and whether InduceKV's entries
    are demonstrations of one document (``document``, :func:`K.prefix_ids`)."""
    budget: int
    sizes: dict
    seed: int
    with_steps: bool
    document: bool = False


def run_inducekv(lm, tok, scens: dict, data: dict, cfg: Settings):
    """Per scenario: every task's candidates prepared (:func:`K.prepare`), then the stream under
    ``budget`` with bilevel selection, also evaluated with raw cosine retrieval. Returns
    ``(prepared, query_keys, outputs)``, each keyed by scenario (the query keys are filled by the
    run and reused by every later run on the same tests)."""
    budget, sizes, seed, with_steps = cfg.budget, cfg.sizes, cfg.seed, cfg.with_steps
    prep, qk, ikv = {}, {}, {}
    for scen, items in scens.items():
        prep[scen] = [K.prepare(lm, tok, n, data[n]["pool"], data[n]["probes"], with_steps,
                                cfg.document) for n, _, _ in items]
        qk[scen] = {}
        ikv[scen] = K.run_stream(lm, tok, prep[scen], {n: data[n]["test"] for n, _, _ in items},
                                 budget, "bilevel", sizes["top_k"], with_steps=with_steps,
                                 seed=seed, calib_steps=sizes["calib_steps"], also_raw=True,
                                 query_cache=qk[scen])
    return prep, qk, ikv


# -- cached baseline runs ------------------------------------------------------------------------
def cache_path(kind: str, spec: dict) -> Path:
    """``<zoo>/inducekv/<kind>-<key>``: the key is the sha1 of ``spec``'s JSON (10 hex digits;
    the folders the notebook has always used, so no cached state is trained again)."""
    key = hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return zoo.zoo_dir() / "inducekv" / f"{kind}-{key}"


def cached_states(kind: str, spec: dict, build) -> list[dict]:
    """What ``build()`` returns (per-stage state dicts), computed once and cached by ``spec``
    (:func:`workbench.cache.build`: a file lock, a folder renamed into place)."""
    path = cache_path(kind, spec)

    def write(tmp):
        torch.save(build(), tmp / "states.pt")
        return spec

    cache.build(path, write)
    return torch.load(path / "states.pt", weights_only=False)


def sequential_lora(pool, base: str, stream: list[str], train_pairs: dict, steps: int,
                    batch: int, lr: float, seed: int, replay_per_task: int = 0,
                    first: str | None = None, rank: int = 8, lora_scale: float = 2.0,
                    mm=None, device="cpu"):
    """``(peft_model, tok, states, info)``: one LoRA after each stage of ``stream`` (cached),
    on ``device``.

    ``first``: the pool adapter that is stage 1 (what training a LoRA on the first task gives,
    already cached); None trains a fresh LoRA (``rank``, ``lora_scale``) ``steps`` on it, as
    every later stage is trained. With ``replay_per_task`` that many examples of each finished
    task join a replay buffer that fills half of every later batch. ``mm``: the continual-VQA
    stream's :class:`MultimodalBackbone` (its image prefix installed in the loaded model, its
    key in the cache's)."""
    model, tok = zoo.load(base, pool.scale, device=str(device))
    if mm is not None:
        mm.setup(model)
    if first is not None:
        model = PeftModel.from_pretrained(model, pool.path(first), is_trainable=True)
    else:
        model = KB.fresh_lora(model, seed, rank, lora_scale)
    spec = {"pool": str(pool.dir.name), "base": base, "stream": stream, "steps": steps,
            "batch": batch, "lr": lr, "seed": seed, "replay": replay_per_task, "first": first,
            "rank": rank, "lora_scale": lora_scale,
            "data": {t: [len(train_pairs[t]), sum(len(i) for i, _ in train_pairs[t])]
                     for t in stream}}
    if mm is not None:
        spec["mm"] = mm.key

    def build():
        states, buf, buffers = [], [], []
        for t, task in enumerate(stream):
            if t > 0 or first is None:
                KB.train_steps(model, train_pairs[task], steps, batch, lr, seed + 1000 * t,
                               buf or None, tok.pad_token_id)
            states.append(KB.lora_state(model))
            if replay_per_task:
                rs = np.random.default_rng(seed + t)
                pick = rs.choice(len(train_pairs[task]), replay_per_task, replace=False)
                buf = buf + [train_pairs[task][i] for i in pick]
            buffers.append(sum(len(ids) for ids, _ in buf) * K.TOKEN_BYTES)
        return {"states": states, "buffer_bytes": buffers}

    kind = ("replay" if replay_per_task else "seqlora") + ("" if first else "-fresh")
    got = cached_states(kind, spec, build)
    n_train = sum(1 for t in range(len(stream)) if t > 0 or first is None)
    info = {"buffer_bytes": got["buffer_bytes"], "adapter_bytes": KB.lora_bytes(model),
            "passes": 3 * steps * batch * n_train}
    KB.set_lora_state(model, got["states"][-1])
    model.eval()
    return model, tok, got["states"], info


def moe_experts(pool, base: str, stream: list[str], train_pairs: dict, experts_from_pool,
                steps: int, batch: int, lr: float, seed: int, mm=None, device="cpu"):
    """``(peft_model, states, passes)``: one expert LoRA per task. ``experts_from_pool`` names
    the pool adapter of each task (cached, no training); None trains a fresh one per task."""
    if experts_from_pool is not None:
        model, _ = zoo.load(base, pool.scale, device=str(device))
        model = PeftModel.from_pretrained(model, pool.path(experts_from_pool[0]))
        return model.eval(), [KB.pool_state(pool, f) for f in experts_from_pool], 0
    states, passes, model = [], 0, None
    for t, name in enumerate(stream):
        model, _, st, info = sequential_lora(pool, base, [name], train_pairs, steps, batch, lr,
                                             seed + t, mm=mm, device=device)
        states.append(st[0])
        passes += info["passes"]
    return model, states, passes


# -- the baselines at the same budget ------------------------------------------------------------
def lora_pool(model: str, scale: str, scens: dict):
    """The zoo's cached LoRA pool: every family on the pool's base; on another backbone, the
    stream's families only."""
    fams = None if model == adapters.POOL_BASE else sorted(
        {f for items in scens.values() for _, f, _ in items})
    return adapters.adapters(model, fams, model_scale=scale)


def lora_matrix(pm, states: list[dict], stream_names: list[str], tests: dict, tok, budget: int,
                extra_bytes, kind: str, with_steps: bool, route=None) -> dict:
    """``acc[t, j]`` of the LoRA ``states`` after each stage on the tests of every seen task,
    with the deployed bytes ``extra_bytes(t)`` checked against ``budget`` at every stage.
    ``route(t, j)`` gives each query's state index (MoE); otherwise stage t's state answers.
    ``last_items``: per-item exact match of every task's tests after the last stage."""
    T = len(stream_names)
    A, bud, last = np.full((T, T), np.nan), K.Budget(budget), []
    for t in range(T):
        bud.check(extra_bytes(t), f"{kind} stage {t}")
        for j, n in enumerate(stream_names[: t + 1]):
            which = route(t, j) if route else np.full(len(tests[n]), t)
            sc = np.zeros(len(which))
            for r in np.unique(which):
                KB.set_lora_state(pm, states[r])
                idx = np.where(which == r)[0]
                sc[idx] = K.answer_scores(pm, tok, [tests[n][i] for i in idx],
                                          with_steps=with_steps)[1]
            A[t, j] = sc.mean()
            if t == T - 1:
                last.append(sc)
    return {"acc": A, "trace": bud.trace, "last_items": np.concatenate(last)}


def lora_baselines(pool, model: str, scale: str, items, data: dict, cfg: Settings, *,
                   prepared: list, qk: dict, tok, mm=None, device="cpu") -> dict:
    """Sequential LoRA, replay and MoE of LoRAs on one scenario, on ``device``: ``{method: {acc,
    trace, passes}}``. The pool's adapters seed stage 1 and the experts when every task is its own pool
    family, and a pool adapter's training counts as the compute of the stage it stands for. The
    MoE keeps the experts that fit beside their centroids (the oldest goes first) and routes each
    query to the nearest centroid of the frozen retrieval keys; the gated MoE mixes the same
    experts with a trained gate (:func:`gated_moe`)."""
    budget, sizes, seed, with_steps = cfg.budget, cfg.sizes, cfg.seed, cfg.with_steps
    names_s = [n for n, _, _ in items]
    fams = [f for _, f, _ in items]
    pairs = {n: data[n]["pairs"] for n in names_s}
    tests = {n: data[n]["test"] for n in names_s}
    seeded = len(set(fams)) == len(fams) and all(f in pool.names for f in fams)
    pool_size = adapters.POOL_SIZES[zoo.zoo_scale(scale)]         # mid runs on the smoke pool
    pool_passes = 3 * pool_size.steps * pool_size.batch
    out = {}
    for kind, replay in (("sequential LoRA", 0), ("replay", sizes["replay_per_task"])):
        pm, _, states, info = sequential_lora(pool, model, names_s, pairs, sizes["lora_steps"],
                                              sizes["lora_batch"], sizes["lora_lr"], seed, replay,
                                              first=fams[0] if seeded else None, mm=mm,
                                              device=device)
        out[kind] = lora_matrix(pm, states, names_s, tests, tok, budget,
                                lambda t: info["adapter_bytes"] + info["buffer_bytes"][t], kind,
                                with_steps)
        out[kind]["passes"] = info["passes"] + (pool_passes if seeded else 0)
    moe, experts, moe_passes = moe_experts(pool, model, names_s, pairs, fams if seeded else None,
                                           sizes["lora_steps"], sizes["lora_batch"],
                                           sizes["lora_lr"], seed, mm, device)
    per_expert = KB.lora_bytes(moe)
    d = prepared[0].pool_keys.shape[1]
    cap = max(1, budget // (per_expert + 4 * d))

    def live(t):
        return list(range(max(0, t + 1 - cap), t + 1))

    def moe_route(t, j):
        names_live = [names_s[i] for i in live(t)]
        _, cents = KB.centroids({n: prepared[names_s.index(n)].pool_keys for n in names_live})
        return np.array(live(t))[KB.route(qk[names_s[j]], cents)]

    out["MoE of LoRAs"] = lora_matrix(moe, experts, names_s, tests, tok, budget,
                                      lambda t: len(live(t)) * (per_expert + 4 * d), "MoE",
                                      with_steps, moe_route)
    out["MoE of LoRAs"]["passes"] = moe_passes + (pool_passes * len(fams) if seeded else 0)
    out["MoE of LoRAs"]["experts_kept"] = len(live(len(names_s) - 1))
    out["gated MoE of LoRAs"] = gated_moe(model, scale, names_s, data, experts, cfg, qk=qk,
                                          tok=tok, per_expert=per_expert, mm=mm, device=device)
    out["gated MoE of LoRAs"]["passes"] += out["MoE of LoRAs"]["passes"]
    return out


def gated_moe(model: str, scale: str, names_s: list[str], data: dict, experts: list[dict],
              cfg: Settings, *, qk: dict, tok, per_expert: int, mm=None, device="cpu") -> dict:
    """The MoE's experts mixed by a trained linear gate on the frozen retrieval key
    (:class:`KB.Gate`, :class:`KB.LoraMixture`): at task t the experts that fit beside the gate
    are live (the oldest goes first) and the gate is trained on task t's training data alone;
    ``acc[t, j]`` under the gate after task t. Also ``gate_weights[t][j]`` (mean weights on task
    j's tests) and ``gate_losses``."""
    budget, sizes, seed, with_steps = cfg.budget, cfg.sizes, cfg.seed, cfg.with_steps
    lm, _ = frozen_backbone(model, scale, device)
    if mm is not None:
        mm.setup(lm)
    d, T, n = lm.config.hidden_size, len(names_s), sizes["gate_steps"] * sizes["gate_batch"]
    qtrain = {m: K.query_keys(lm, tok, data[m]["train"][:n]) for m in names_s}
    pairs = {m: data[m]["pairs"][:n] for m in names_s}
    gate = KB.Gate(d, T, seed).to(lm.device)
    row = per_expert + gate.nbytes(1)
    cap = max(1, budget // row)
    A, W, bud, losses, last = np.full((T, T), np.nan), [], K.Budget(budget), [], []
    with KB.LoraMixture(lm, experts) as mix:
        for t, m in enumerate(names_s):
            live = list(range(max(0, t + 1 - cap), t + 1))
            bud.check(len(live) * row, f"gated MoE stage {t}")
            losses.append(KB.train_gate(lm, mix, gate, pairs[m], qtrain[m], live,
                                        sizes["gate_steps"], sizes["gate_batch"],
                                        sizes["gate_lr"], seed + t, tok.pad_token_id))
            W.append([])
            for j, mj in enumerate(names_s[: t + 1]):
                with torch.no_grad():
                    w = gate(qk[mj], live)
                ex = KB.gated_scores(lm, mix, w, tok, data[mj]["test"], with_steps)[1]
                A[t, j] = ex.mean()
                W[t].append(w.mean(0).cpu().numpy())
                if t == T - 1:
                    last.append(ex)
    return {"acc": A, "trace": bud.trace, "gate_weights": W, "gate_losses": losses,
            "last_items": np.concatenate(last),
            "passes": 3 * sizes["gate_steps"] * sizes["gate_batch"] * T}


def l2p_baseline(lm, tok, names_s: list[str], data: dict, qk: dict, cfg: Settings,
                 mm=None) -> dict:
    """The L2P prompt pool on one scenario: trained task by task on the frozen query feature
    (states cached per stage), then ``acc[t, j]`` with its bytes checked at every stage."""
    budget, sizes, seed, with_steps = cfg.budget, cfg.sizes, cfg.seed, cfg.with_steps
    torch.manual_seed(seed)
    emb_scale = float(lm.get_input_embeddings().weight.std())
    pp = KB.PromptPool(sizes["l2p_prompts"], sizes["l2p_length"], lm.config.hidden_size,
                       sizes["l2p_top"], emb_scale, seed).to(lm.device)
    spec = {"base": lm.zoo_card["key"], "stream": names_s, "batch": sizes["lora_batch"],
            "sizes": {k: sizes[k] for k in sizes if k.startswith("l2p")},
            "seed": seed, "data": {n: len(data[n]["pairs"]) for n in names_s}}
    if mm is not None:
        spec["mm"] = mm.key
    sub = {n: data[n]["pairs"][: sizes["l2p_steps"] * 8] for n in names_s}

    def build():
        states = []
        for t, n in enumerate(names_s):
            q = K.query_keys(lm, tok, data[n]["train"][: len(sub[n])])
            KB.train_l2p(lm, pp, sub[n], q, sizes["l2p_steps"], sizes["lora_batch"],
                         sizes["l2p_lr"], seed + t, tok.pad_token_id)
            states.append({k: v.detach().clone() for k, v in pp.state_dict().items()})
        return states
    states = cached_states("l2p", spec, build)
    T = len(names_s)
    A, bud, last = np.full((T, T), np.nan), K.Budget(budget), []
    for t in range(T):
        pp.load_state_dict(states[t])
        bud.check(pp.nbytes, f"L2P stage {t}")
        for j, n in enumerate(names_s[: t + 1]):
            ex = KB.l2p_scores(lm, pp, tok, data[n]["test"], qk[n], with_steps)[1]
            A[t, j] = ex.mean()
            if t == T - 1:
                last.append(ex)
    return {"acc": A, "trace": bud.trace, "last_items": np.concatenate(last),
            "passes": 3 * sizes["l2p_steps"] * sizes["lora_batch"] * T}


# -- the comparison (C3) -------------------------------------------------------------------------
def results_table(results: dict, budget: int) -> pd.DataFrame:
    """One row per (scenario, method): PyCIL's average accuracy, last accuracy, forgetting, the
    peak deployed bytes and the example-forward passes spent adapting."""
    return pd.DataFrame([{"scenario": scen, "method": meth,
                          "average_accuracy": K.average_accuracy(r["acc"]),
                          "last_accuracy": K.last_accuracy(r["acc"]),
                          "forgetting": K.forgetting(r["acc"]),
                          "peak_bytes": max(b for _, b in r["trace"]), "budget": budget,
                          "passes": r["passes"]}
                         for scen in results for meth, r in results[scen].items()])


def c3_summary(table: pd.DataFrame, scens) -> dict[str, dict]:
    """Per scenario: InduceKV's average accuracy and forgetting against the best baseline's, and
    whether it beats every baseline on each."""
    out = {}
    for scen in scens:
        t_ = table[table.scenario == scen].set_index("method")
        others = t_.drop(index="InduceKV")
        out[scen] = {"inducekv_aa": t_.loc["InduceKV", "average_accuracy"],
                     "best_baseline_aa": others.average_accuracy.max(),
                     "best_baseline": others.average_accuracy.idxmax(),
                     "inducekv_forgetting": t_.loc["InduceKV", "forgetting"],
                     "lowest_baseline_forgetting": others.forgetting.min(),
                     "higher_aa_than_all": bool((t_.loc["InduceKV", "average_accuracy"]
                                                 > others.average_accuracy).all()),
                     "lower_forgetting_than_all": bool((t_.loc["InduceKV", "forgetting"]
                                                        < others.forgetting).all())}
    return out


# -- selection and calibration (C4) --------------------------------------------------------------
def selection_runs(lm, tok, prepared: list, tests: dict, bilevel: dict, cfg: Settings, *,
                   qk: dict) -> dict[str, dict]:
    """The same candidates and budget under the three selection rules: bilevel (the run already
    made), likelihood only, random."""
    budget, sizes, seed, with_steps = cfg.budget, cfg.sizes, cfg.seed, cfg.with_steps
    runs = {"bilevel": bilevel}
    for mode in ("likelihood", "random"):
        runs[mode] = K.run_stream(lm, tok, prepared, tests, budget, mode, sizes["top_k"],
                                  with_steps=with_steps, seed=seed,
                                  calib_steps=sizes["calib_steps"], query_cache=qk)
    return runs


def selection_table(runs: dict[str, dict]) -> pd.DataFrame:
    """Average accuracy, forgetting, final top-1 hit rate and peak bytes per selection rule."""
    return pd.DataFrame([{"selection": m, "average_accuracy": K.average_accuracy(o["acc"]),
                          "forgetting": K.forgetting(o["acc"]),
                          "final_hit_rate": np.nanmean(o["hit"][-1]),
                          "peak_bytes": o["peak_bytes"]} for m, o in runs.items()])


def calibration_summary(out: dict) -> dict[str, float]:
    """The bilevel memory retrieved with the fitted calibration against raw cosine: mean top-1
    hit rate and average accuracy."""
    return {"calibrated_hit": float(np.nanmean(out["hit"])),
            "raw_cosine_hit": float(np.nanmean(out["hit_raw"])),
            "calibrated_aa": K.average_accuracy(out["acc"]),
            "raw_cosine_aa": K.average_accuracy(out["acc_raw"])}


# -- diagnostics (C5) and the footprint (C2) -----------------------------------------------------
def compute_matched_lora(pool, model: str, names: list[str], data: dict, passes: int,
                         cfg: Settings, *, tok, device="cpu"):
    """A fresh sequential LoRA given InduceKV's ``passes`` (a step of a batch costs three
    example-forwards): ``(steps per task, its accuracy matrix and trace, its passes)``."""
    budget, sizes, seed, with_steps = cfg.budget, cfg.sizes, cfg.seed, cfg.with_steps
    steps = max(1, round(passes / len(names) / (3 * sizes["lora_batch"])))
    pm, _, st, info = sequential_lora(pool, model, names, {n: data[n]["pairs"] for n in names},
                                      steps, sizes["lora_batch"], sizes["lora_lr"], seed,
                                      device=device)
    cm = lora_matrix(pm, st, names, {n: data[n]["test"] for n in names}, tok, budget,
                     lambda t: info["adapter_bytes"], "compute-matched LoRA", with_steps)
    return steps, cm, info["passes"]


def diagnostics(lm, tok, prepared: list, tests: dict, cfg: Settings, *, ikv: dict, cm: dict,
                cm_steps: int, qk: dict):
    """InduceKV against the compute-matched LoRA, with bounded candidate pools, at fractions of
    the budget and with more entries retrieved. Returns the table and the accuracy-vs-budget
    curve ``[(budget, average accuracy, trace)]`` (the full budget first)."""
    budget, sizes, seed, with_steps = cfg.budget, cfg.sizes, cfg.seed, cfg.with_steps
    rows = [{"variant": "InduceKV", "knob": "full", "average_accuracy":
             K.average_accuracy(ikv["acc"]), "peak_bytes": ikv["peak_bytes"]},
            {"variant": "LoRA, compute-matched (fresh)", "knob": f"{cm_steps} steps/task",
             "average_accuracy": K.average_accuracy(cm["acc"]),
             "peak_bytes": max(b for _, b in cm["trace"])}]
    kw = dict(with_steps=with_steps, seed=seed, calib_steps=sizes["calib_steps"], query_cache=qk)
    for nb in sizes["pool_bounds"]:
        bounded = [K.Prepared(P.task, P.cands[:nb], P.likelihood[:nb], P.pool_keys, P.passes)
                   for P in prepared]
        o = K.run_stream(lm, tok, bounded, tests, budget, "bilevel", sizes["top_k"], **kw)
        rows.append({"variant": "InduceKV, bounded pool", "knob": f"{nb} candidates",
                     "average_accuracy": K.average_accuracy(o["acc"]),
                     "peak_bytes": o["peak_bytes"]})
    curve = [(budget, K.average_accuracy(ikv["acc"]), ikv["trace"])]
    for fr in sizes["budget_fractions"]:
        b = int(budget * fr)
        o = K.run_stream(lm, tok, prepared, tests, b, "bilevel", sizes["top_k"], **kw)
        curve.append((b, K.average_accuracy(o["acc"]), o["trace"]))
        rows.append({"variant": "InduceKV, budget", "knob": f"{fr:g} x budget",
                     "average_accuracy": K.average_accuracy(o["acc"]),
                     "peak_bytes": o["peak_bytes"], "budget": b})
    for kk in sizes["k_sweep"]:
        o = K.run_stream(lm, tok, prepared, tests, budget, "bilevel", kk, **kw)
        rows.append({"variant": "InduceKV, top-k", "knob": f"k={kk}",
                     "average_accuracy": K.average_accuracy(o["acc"]),
                     "peak_bytes": o["peak_bytes"]})
    return pd.DataFrame(rows), curve


def footprint(results: dict, selection: dict, curve: list, budget: int):
    """Every deployed state's trace (each method of each scenario, each selection rule, each
    budget of the curve), its limit (the budget it ran under) and peak, and whether it stayed
    within: ``(traces, limits, peaks, within)``."""
    traces = {f"{scen}/{m}": r["trace"] for scen in results for m, r in results[scen].items()}
    traces.update({f"selection/{m}": o["trace"] for m, o in selection.items()})
    traces.update({f"budget curve/{b}": tr for b, _, tr in curve})
    limits = {k: (int(k.split("/")[-1]) if k.startswith("budget curve") else budget)
              for k in traces}
    peaks = {k: max(b for _, b in tr) for k, tr in traces.items()}
    within = {k: peaks[k] <= limits[k] for k in traces}
    return traces, limits, peaks, within


# -- the explorer: the byte budget over the stream ------------------------------------------------
@dataclass
class PairScores:
    """Every answer score a stream with one retrieved entry per query can ask for, computed once:
    the candidates of every task (in stream order), and per (example, entry) pair the answer's
    log-likelihood and exact match, the last column without an entry (``NONE``)."""
    cands: list                  # every candidate entry, task by task
    anchor_lp: np.ndarray        # (candidates, candidates + 1): candidate a's own example | entry c
    test_lp: dict                # task -> (tests, candidates + 1)
    test_exact: dict             # task -> (tests, candidates + 1)

    NONE = -1


def _pair_tables(model, tok, cands: list, tests: dict, with_steps: bool) -> dict:
    """The arrays of :class:`PairScores`: one :func:`K.answer_scores` call per entry and
    example set, the last column without an entry."""
    def table(examples):
        cols = [K.answer_scores(model, tok, examples, [c], with_steps) for c in cands]
        cols.append(K.answer_scores(model, tok, examples, None, with_steps))
        return np.stack([lp for lp, _ in cols], 1), np.stack([ex for _, ex in cols], 1)

    out = {"anchor_lp": table([c.example for c in cands])[0]}
    for task, exs in tests.items():
        out[f"lp/{task}"], out[f"exact/{task}"] = table(exs)
    return out


def pair_scores(model, tok, prepared: list, tests: dict, with_steps: bool,
                backbone: str | None = None) -> PairScores:
    """:class:`PairScores` of ``prepared`` (:func:`K.prepare`'s, one per task) and each task's
    ``tests`` (the backbone is frozen, so they never change). With ``backbone`` (its
    :func:`K.state_hash`) they are cached by it and every candidate's and test's tokens."""
    cands = [c for P in prepared for c in P.cands]
    tests = {P.task: tests[P.task] for P in prepared}
    if backbone is None:
        arrays = _pair_tables(model, tok, cands, tests, with_steps)
    else:
        spec = {"v": 1, "backbone": backbone, "with_steps": with_steps,
                "cands": [c.ids for c in cands],
                "tests": {t: [[e.prompt, e.completion(with_steps)] for e in exs]
                          for t, exs in tests.items()}}
        path = cache_path("pairs", spec)

        def write(tmp):
            np.savez(tmp / "pairs.npz", **_pair_tables(model, tok, cands, tests, with_steps))
            return {"candidates": len(cands), "tasks": list(tests)}

        cache.build(path, write)
        with np.load(path / "pairs.npz") as f:
            arrays = dict(f)
    return PairScores(cands, arrays["anchor_lp"], {t: arrays[f"lp/{t}"] for t in tests},
                      {t: arrays[f"exact/{t}"] for t in tests})


def _unit(x) -> np.ndarray:
    """``x`` scaled to [0, 1] (zeros when flat), as :func:`K.select` scales its terms."""
    x = np.asarray(x, dtype=float)
    span = x.max() - x.min() if len(x) else 0.0
    return (x - x.min()) / span if span > 1e-12 else np.zeros_like(x)


def _retention(ps: PairScores, col: dict, cands: list, mem) -> np.ndarray:
    """:func:`K.retention` with one retrieved entry, from the lookups: minus the expected
    answer-NLL increase on the stored entries (as queries) if a candidate joined the memory."""
    anchors = mem.entries
    if not anchors:
        return np.zeros(len(cands))
    rows = [col[id(a)] for a in anchors]
    akeys = torch.stack([a.key for a in anchors])
    sim = K.similarity(akeys, akeys, mem.calib).fill_diagonal_(-2)
    now = [rows[int(sim[i].argmax())] if len(anchors) > 1 else ps.NONE for i in range(len(rows))]
    lp_now = ps.anchor_lp[rows, now]
    p = torch.softmax(torch.cat([K.similarity(akeys, torch.stack([c.key for c in cands]),
                                              mem.calib), sim.clamp(min=-1)], 1) / 0.1,
                      dim=1)[:, :len(cands)].cpu().numpy()
    lp_c = ps.anchor_lp[np.ix_(rows, [col[id(c)] for c in cands])]
    return -(p * np.maximum(0.0, lp_now[:, None] - lp_c)).mean(0)


def _stage(ps: PairScores, col: dict, P, cands: list, mem, budget: int, t: int, mode: str,
           weights, rng, calib_steps: int) -> None:
    """One task of :func:`K.run_stream`: evict the old tasks to ``budget * t / (t + 1)``, select
    the new task's entries (scores as the stream computes them), refit the calibration."""
    mem.evict_to(int(budget * t / (t + 1)), where=f"task {t}: evict")
    keys = torch.stack([e.key for e in mem.entries] + [c.key for c in cands])
    labels = [e.task for e in mem.entries] + [P.task] * len(cands)
    inner = K.fit_calibration(keys, labels, steps=calib_steps)
    scores = {"likelihood": P.likelihood, "retention": np.zeros(len(cands))}
    if mode == "bilevel":
        scores["retention"] = _retention(ps, col, cands, K.Memory(K.Budget(budget),
                                                                  list(mem.entries), inner))
        sim = K.similarity(P.pool_keys, torch.stack([c.key for c in cands]), inner)
        scores["coverage_sim"] = ((sim + 1) / 2).cpu().numpy()
    reserve = 2 * cands[0].key.numel() * 4 if mem.calib is None else 0
    chosen = K.select(cands, budget - mem.nbytes - reserve, scores, weights, mode, rng)
    util = _unit(scores["likelihood"]) + _unit(scores["retention"])
    for i in chosen:
        cands[i].utility = float(util[i])
        mem.add(cands[i], where=f"task {t}: add")
    if mem.entries:
        mem.refit(calib_steps, where=f"task {t}: calibrate")


def replay_stream(ps: PairScores, prepared: list, qk: dict, budget: int, mode: str = "bilevel",
                  weights=(1.0, 1.0, 1.0), seed: int = 0, calib_steps: int = 60) -> dict:
    """:func:`K.run_stream` with one retrieved entry per query (``k = 1``, calibrated), its
    answer scores read from ``ps`` instead of the backbone: the same memory, accuracy ``acc`` and
    hit rate ``hit``, plus ``gain[t, j]`` (task j's mean answer log-likelihood gain from its
    retrieved entry after task t, nats) and ``bytes``/``entries`` per task after each task.
    ``qk``: the tests' query keys by task (the stream's ``query_cache``)."""
    copies = [[replace(c, utility=0.0) for c in P.cands] for P in prepared]
    col = {id(c): i for i, c in enumerate(c for cs in copies for c in cs)}
    rng, T, mem = np.random.default_rng(seed), len(prepared), K.Memory(K.Budget(budget))
    acc, hit, gain = (np.full((T, T), np.nan) for _ in range(3))
    made = []
    for t, (P, cands) in enumerate(zip(prepared, copies)):
        _stage(ps, col, P, cands, mem, budget, t, mode, weights, rng, calib_steps)
        made += [{"after": t, "task": Q.task,
                  "entries": sum(e.task == Q.task for e in mem.entries),
                  "bytes": sum(e.nbytes for e in mem.entries if e.task == Q.task)}
                 for Q in prepared]
        for j, Q in enumerate(prepared[: t + 1]):
            got = K.retrieve(mem.entries, qk[Q.task], 1, mem.calib)
            cols = [col[id(g[-1])] if g else ps.NONE for g in got]
            rows = np.arange(len(cols))
            acc[t, j] = ps.test_exact[Q.task][rows, cols].mean()
            gain[t, j] = (ps.test_lp[Q.task][rows, cols] - ps.test_lp[Q.task][:, ps.NONE]).mean()
            hit[t, j] = np.mean([bool(g) and g[-1].task == Q.task for g in got])
    return {"acc": acc, "hit": hit, "gain": gain, "memory": mem, "trace": mem.budget.trace,
            "made": pd.DataFrame(made)}


def stream_figure(out: dict, tasks_: list, budget: int, mode: str):
    """The explorer's picture of one replay: the memory's bytes per task after each task (the
    budget and the eviction target marked, entry counts on the bars), each task's answer
    log-likelihood gain from its retrieved entry, and the stage accuracy and hit rate."""
    fig, (ax, bx, cx) = plots.subplots(1, 3, figsize=(15, 3.8))
    made, T = out["made"], len(tasks_)
    bottom = np.zeros(T)
    for i, task in enumerate(tasks_):
        rows = made[made.task == task].sort_values("after")
        kib = rows["bytes"].to_numpy() / 1024
        bars = ax.bar(range(T), kib, bottom=bottom, color=plots.PALETTE[i % 7], label=task)
        ax.bar_label(bars, [str(n) if n else "" for n in rows["entries"]], label_type="center",
                     fontsize=7, color="white")
        bottom += kib
    ax.axhline(budget / 1024, color="k", lw=1, label="budget")
    ax.plot(range(T - 1), [budget * (t + 1) / (t + 2) / 1024 for t in range(T - 1)], "k_",
            ms=40, mew=1.5, label="evicted down to, before the next task")
    ax.set(xticks=range(T), xticklabels=[f"after {t}" for t in tasks_], ylabel="KiB in memory",
           ylim=(0, 1.4 * budget / 1024),
           title=f"memory at {budget // 1024} KiB, {mode} (entry counts on the bars)")
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    for j, task in enumerate(tasks_):
        bx.plot(range(j, T), out["gain"][j:, j], "o-", color=plots.PALETTE[j % 7], label=task)
    bx.axhline(0, color="k", lw=0.8)
    bx.set(xticks=range(T), xticklabels=[f"after {t}" for t in tasks_],
           ylabel="answer log-likelihood gain (nats)", title="what the retrieved entry adds")
    bx.legend(fontsize=7)
    stage = [np.nanmean(out["acc"][t, : t + 1]) for t in range(T)]
    cx.plot(range(T), stage, "o-", color=plots.PALETTE[0], label="exact match (seen tasks)")
    cx.plot(range(T), [np.nanmean(out["hit"][t, : t + 1]) for t in range(T)], "s--",
            color=plots.PALETTE[1], label="top-1 hit rate")
    cx.set(xticks=range(T), xticklabels=[f"after {t}" for t in tasks_], ylim=(-0.05, 1.05),
           ylabel="share of the seen tasks' queries",
           title=f"average accuracy {np.mean(stage):.3f}")
    cx.legend(fontsize=7)
    return fig
