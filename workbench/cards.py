"""How ``workbench zoo list`` and ``zoo build`` print the zoo's cards: one Markdown table.

Torch-free, so the command line formats cards without importing a model.
"""
from __future__ import annotations

__all__ = ["card_rows", "format_cards", "format_clip_cards"]


def card_rows(cards: list[dict]) -> list[dict]:
    """One summary row per model card (what ``workbench zoo list`` prints): size, tokens, build
    time, perplexity vs unigram, and per family the middle-difficulty score (or the mean over
    the evaluated difficulties for v1 cards)."""
    rows = []
    for c in cards:
        if "adapters" in c or "error" in c or c.get("kind") == "clip":
            continue
        by = c.get("task_accuracy_middle") or c.get("task_accuracy", {})
        # an in-context family the card also scores alone (lm-base's kv_dense_sp, with its
        # pairs in the prompt) reads as a trained family
        trained = c.get("trained_tasks", []) + [f for f in c.get("trained_in_context", [])
                                                if f in by]
        rows.append({
            "name": c["name"], "scale": c["scale"], "arch": c.get("arch", "?"),
            "params": c["parameters"], "tokens": c["tokens_seen"],
            "build_s": c.get("build_seconds"), "ppl": round(c["heldout_ppl"], 1),
            "unigram": round(c["unigram_ppl"], 1),
            "middle": "middle" if "task_accuracy_middle" in c else "easiest",
            "solved": sorted(f for f, a in by.items() if a >= 0.8),
            "trained": {f: by.get(f) for f in trained if f in by},
            "heldout_best": max((a for f, a in by.items() if f not in trained), default=None),
            "in_context": _in_context_cell(c),
            "init_from": (c.get("init_from") or {}).get("name"),
            "direct": _direct_cell(c.get("direct")),
            "long_trace": [(f, t["difficulty"], t["median_tokens_written"], t["exact_match"])
                           for f, t in c.get("long_trace", {}).items()]})
    return rows


def _in_context_cell(c: dict) -> str:
    """The families whose exact match gains at least +0.3 from the card's demonstrations:
    ``family 0-shot->k-shot``; '' for cards without the in-context column."""
    ic = c.get("in_context")
    if not ic:
        return ""
    k = str(ic["shots"])
    return ", ".join(f"{f} {v['0']:.2f}->{v[k]:.2f}" for f, v in ic["accuracy"].items()
                     if v["gain"] >= 0.3) or "none"


def _direct_cell(d: dict | None):
    """``(ratio, ours, theirs, against, families)`` of a card's forced-direct comparison."""
    if not d:
        return None
    return (d["ratio"], d["forced_direct_mean"], d["other_direct_mean"], d["against"],
            d["solved_by_both"])


def format_cards(cards: list[dict]) -> str:
    """The cards as a Markdown table (for ``workbench zoo list`` and the README)."""
    head = ("| model | arch | params | tokens | build s | ppl (unigram) | trained families: "
            "exact match at the middle difficulty | best held-out family | in context: "
            "0 -> 4 demonstrations (gain >= +0.3) |")
    lines = [head, "|" + "---|" * 9]
    for r in card_rows(cards):
        fam = ", ".join(f"{f} {a:.2f}" for f, a in r["trained"].items())
        if r["middle"] != "middle":
            fam += " (easiest level)"
        hb = "" if r["heldout_best"] is None else f"{r['heldout_best']:.2f}"
        lines.append(f"| {r['name']} ({r['scale']}) | {r['arch']} | {r['params'] / 1e6:.2f}M | "
                     f"{r['tokens'] / 1e6:.2f}M | {r['build_s']} | {r['ppl']} ({r['unigram']}) "
                     f"| {fam} | {hb} | {r['in_context']} |")
    tuned = [r for r in card_rows(cards) if r["init_from"] or r["direct"] or r["long_trace"]]
    if tuned:
        lines += ["", "| model | fine-tuned from | forced direct / other's direct (families "
                  "both solve) | long trace: median tokens written, exact match |",
                  "|---|---|---|---|"]
        for r in tuned:
            d = r["direct"]
            dc = "" if d is None else (f"{d[0]:.2f} ({d[1]:.2f} / {d[2]:.2f} {d[3]}; "
                                       f"{', '.join(d[4])})")
            lt = "; ".join(f"{f} at {k}: {m:.0f} tokens, {a:.2f}" for f, k, m, a in
                           r["long_trace"])
            lines.append(f"| {r['name']} ({r['scale']}) | {r['init_from'] or ''} | {dc} | {lt} |")
    pools = [c for c in cards if "adapters" in c]
    for p in pools:
        lines.append("")
        init = ", each adapter from its own LoRA init" if p.get("init") == "per_adapter" else ""
        lines.append(f"LoRA pool on {p['base']} ({p['scale']}, rank {p['rank']}, scale "
                     f"{p['lora_scale']}{init}): adapter: own-family exact match (base), gain")
        lines.append("| adapter | own | base | gain | train s |")
        lines.append("|---|---|---|---|---|")
        for n, a in p["adapters"].items():
            b = sum(p["base_accuracy"][f] for f in a["families"]) / len(a["families"])
            lines.append(f"| {n} | {a['own_accuracy']:.2f} | {b:.2f} | "
                         f"{a['gain_over_base']:+.2f} | {a['train_seconds']} |")
        if p.get("merges"):
            lines.append("")
            lines.append("cat merges (peft add_weighted_adapter, combination_type='cat', weights "
                         "1, 1) of each pair of adapters gaining >= +0.3: share of each one's "
                         "gain kept, (merged - base) / (own - base)")
            lines.append("| pair | first kept | second kept |")
            lines.append("|---|---|---|")
            for pair, m in p["merges"].items():
                k1, k2 = (("?" if k is None else f"{k:.2f}") for k in m["kept"].values())
                lines.append(f"| {pair} | {k1} | {k2} |")
    return "\n".join(lines)


def format_clip_cards(cards: list[dict]) -> str:
    """The mini-CLIP cards as a Markdown table (zero-shot accuracy vs chance)."""
    lines = ["| model | params | build s | shapes seen | shapes held-out | held-out among all "
             "| digits |", "|" + "---|" * 7]
    for c in cards:
        z = c["zero_shot"]
        cell = lambda k: f"{z[k]['acc']:.2f} (chance {z[k]['chance']:.3f})"   # noqa: E731
        lines.append(f"| {c['name']} ({c['scale']}) | {c['parameters'] / 1e6:.2f}M | "
                     f"{c['build_seconds']} | {cell('shapes_seen')} | {cell('shapes_heldout')} | "
                     f"{cell('shapes_heldout_among_all')} | {cell('digits_test')} |")
    return "\n".join(lines)
