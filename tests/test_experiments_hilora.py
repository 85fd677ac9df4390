"""Paper 07's harness (workbench.experiments.hilora): selection accuracy against the number of
fitting inputs, the baselines' gates, and the unseen-domain table, on hand-made inputs."""
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch

from workbench.experiments import hilora as X

POOL = ["a", "b", "c"]


def _clusters(n, d=6, seed=0, spread=0.05):
    """``n`` points per family around far-apart centres (one per family of POOL + "h")."""
    g = np.random.default_rng(seed)
    centres = {f: 3.0 * np.eye(d)[i] for i, f in enumerate(POOL + ["h"])}
    return {f: torch.tensor(c + spread * g.standard_normal((n, d)), dtype=torch.float32)
            for f, c in centres.items()}


def test_selection_curve_finds_the_true_lora_on_separable_features():
    fit = _clusters(16, seed=0)
    held = _clusters(5, seed=1)
    eval_x = torch.cat([held[f] for f in POOL + ["h"]])
    eval_fam = np.repeat(POOL + ["h"], 5)
    c2 = X.selection_curve({f: fit[f] for f in POOL}, eval_x, eval_fam, POOL, [4, 16],
                           temperature=1.0, threshold=0.9, k_max=2)
    assert list(c2.n_fit) == [4, 16]
    assert (c2.top1_accuracy == 1.0).all() and (c2.selected_contains_true == 1.0).all()
    assert (c2.mean_selected >= 1).all() and (c2.mean_selected <= 2).all()
    # the held-out family "h" is not in domain: scoring it as if it were would need a true LoRA
    swapped = X.selection_curve({"a": fit["b"], "b": fit["a"], "c": fit["c"]}, eval_x, eval_fam,
                                POOL, [16], temperature=1.0, threshold=0.9, k_max=2)
    assert abs(float(swapped.top1_accuracy[0]) - 1 / 3) < 1e-9       # only "c" stays right


def _bed(rank=4):
    return SimpleNamespace(pool_families=POOL, families=POOL + ["h"], n_pool=3, n_all=4, rank=rank)


def test_method_gates_route_every_prompt_as_each_baseline_says():
    post = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    mask = np.array([[True, True, False], [False, False, True]])
    kroc = np.array([[3, 1, 0], [0, 0, 4]])
    fam = np.array(["a", "h"])
    gates = X.method_gates(_bed(), post, mask, kroc, fam, router_choice=np.array([1, 2]), single="b",
                           top_k=2)
    for name, (w, k) in gates.items():
        assert w.shape == k.shape == (2, 4), name
        if name != "oracle":                                 # held-out LoRAs serve the oracle only
            assert not w[:, 3].any(), name
    w, k = gates["oracle"]
    assert w[0].tolist() == [1, 0, 0, 0] and w[1].tolist() == [0, 0, 0, 1] and (k[w > 0] == 4).all()
    assert np.allclose(gates["uniform"][0][:, :3], 1 / 3)
    assert gates["single best"][0][:, 1].tolist() == [1, 1]
    assert gates["trained router"][0].argmax(1).tolist() == [1, 2]
    w, _ = gates["top-k"]
    assert w[0].tolist() == [0.5, 0.5, 0, 0] and w[1].tolist() == [0, 0.5, 0.5, 0]
    w, k = gates["HiLoRA"]
    assert w[:, :3].tolist() == mask.astype(float).tolist() and k[:, :3].tolist() == kroc.tolist()
    assert not gates["base"][0].any()


def test_unseen_table_averages_member_families_and_domains():
    fams = ["sort", "dedupe", "pattern_skip", "kv", "count", "rotate", "swap"]
    per_family = pd.DataFrame({"HiLoRA": np.arange(7) / 10, "oracle": np.ones(7)}, index=fams)
    unseen = X.unseen_table(per_family, fams[:5], ["rotate", "swap"])
    assert unseen.loc["held-out rotate", "HiLoRA"] == 0.5
    assert np.isclose(unseen.loc["mix sort+count+kv", "HiLoRA"], (0 + 0.4 + 0.3) / 3)
    assert np.isclose(unseen.loc["mix all pool", "HiLoRA"], 0.2)
    assert np.isclose(unseen.loc["mean over unseen domains", "HiLoRA"],
                      unseen.drop("mean over unseen domains").HiLoRA.mean())
    assert (unseen.oracle == 1).all()


def test_selection_variants_score_each_prompt_once_per_number_of_loras(monkeypatch):
    from workbench.data import tasks
    examples = tasks.generate("sort", 4, 0)
    post = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.98, 0.01, 0.01], [0.5, 0.45, 0.05]])
    mask = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=bool)
    asked = []

    def fake_generate(lm, tok, prompts, hooks, w, k, max_new_tokens):
        asked.append((list(prompts), w.copy(), k.copy()))
        # right only under one LoRA: the variant's score tells the columns apart
        return [e.target if (wi > 0).sum() == 1 else "x" for e, wi in
                zip([e for p in prompts for e in examples if e.prompt == p][:len(prompts)], w)]

    monkeypatch.setattr(X.hl, "generate_routed", fake_generate)
    bed = SimpleNamespace(**vars(_bed(rank=4)), hooks=SimpleNamespace(handles=[object()]),
                          lm=None, tok=None)
    v = X.selection_variants(bed, examples, post, mask, np.array([0.5, 0.25, 0.75, 0.0]),
                             budget=4, k_max=2, max_new_tokens=8)
    assert list(v.columns) == [1, 2]
    assert v.loc[2, 1] == 0.75 and v.loc[[0, 1, 3], 2].tolist() == [0.5, 0.25, 0.0]   # reused
    assert v.loc[[0, 1, 3], 1].tolist() == [1.0, 1.0, 1.0] and v.loc[2, 2] == 0.0    # generated
    one, two = asked
    assert one[0] == [examples[i].prompt for i in (0, 1, 3)]
    assert one[1][:, :3].argmax(1).tolist() == [0, 2, 0] and (one[2].sum(1) == 4).all()
    assert two[1][0, :3].tolist() == [1.0, 1.0, 0.0] and two[2][0, :3].tolist() == [3, 1, 0]


def test_at_threshold_counts_as_select_does_and_the_curve_reads_the_variants():
    from workbench.methods import hilora as hl
    pool, held = ["sort", "dedupe", "pattern_skip", "kv", "count"], ["rotate"]
    g = np.random.default_rng(0)
    post = g.dirichlet(np.ones(5) * 0.3, size=60)
    fam = np.array((pool + held) * 10)
    v = pd.DataFrame({1: np.ones(60), 2: np.zeros(60)})            # one LoRA right, two wrong
    for t in (0.5, 0.8, 0.95, 1.0):
        acc, n = X.at_threshold(v, post, fam, t, 2)
        assert (n == hl.select(post, t, 2).sum(1)).all()
        assert np.isclose(acc.mean(), (n == 1).mean())            # families are equal-sized
    curve = X.threshold_curve(v, post, fam, [0.5, 0.9, 1.0], k_max=2, pool_families=pool, heldout=held)
    assert list(curve.threshold) == [0.5, 0.9, 1.0]
    assert curve["share with 2+ LoRAs"].is_monotonic_increasing
    assert curve["pool families"].is_monotonic_decreasing and curve["unseen domains"].iloc[-1] < 1
    _, n = X.at_threshold(v, post, fam, 0.9, 2)
    assert np.isclose(curve["share with 2+ LoRAs"][1], (n > 1).mean())


FAMS = ["sort", "dedupe", "pattern_skip", "kv", "count", "rotate", "swap"]


def test_unseen_items_average_to_the_unseen_table_and_carry_per_domain_methods():
    g = np.random.default_rng(0)
    fam = np.repeat(FAMS, [3, 4, 5, 2, 3, 4, 6])                    # unequal families
    scores = {"HiLoRA": g.integers(0, 2, len(fam)).astype(float),
              "base": g.integers(0, 2, len(fam)).astype(float)}
    domains = X.unseen_domains(FAMS[:5], FAMS[5:])
    W = X.unseen_weights(fam, domains)
    hub = np.where(np.array([np.isin(fam, fs) for fs in domains.values()]),
                   g.integers(0, 2, (len(domains), len(fam))), np.nan)
    per_family = pd.DataFrame(scores).groupby(fam).mean()
    hub_acc = X.domain_accuracy(hub, fam, domains)
    unseen = X.unseen_table(per_family, FAMS[:5], FAMS[5:], {"LoraHub": hub_acc})
    items = X.unseen_items(scores, {"LoraHub": hub}, W)
    for m in ("HiLoRA", "base", "LoraHub"):
        assert len(items[m]) == len(fam)
        assert np.isclose(items[m].mean(), unseen.loc["mean over unseen domains", m]), m
    ci = X.c3_intervals(items, ["base", "LoraHub"])
    assert list(ci.index) == ["base", "LoraHub"]
    assert np.isclose(ci.loc["base", "diff"], items["HiLoRA"].mean() - items["base"].mean())
    assert (ci["low"] <= ci["diff"]).all() and (ci["diff"] <= ci["high"]).all()
    better = dict(items, HiLoRA=items["base"] + W.sum(0))          # one point more on every domain
    assert (X.c3_intervals(better, ["base"])["low"] > 0).all()


def test_lorahub_shots_are_labelled_examples_of_the_domain_and_never_evaluation_prompts():
    from workbench.data import tasks
    domains = {"held-out rotate": ["rotate"], "mix": ["sort", "count", "kv"]}
    block = {e.prompt for e in tasks.generate("sort", 20, 3000, X.evaluate.MIDDLE["sort"])[:3]}
    shots = X.lorahub_shots(domains, 5, block, seed=0)
    assert [e.family for e in shots["held-out rotate"]] == ["rotate"] * 5
    assert [e.family for e in shots["mix"]] == ["sort", "count", "kv", "sort", "count"]
    assert not {e.prompt for s in shots.values() for e in s} & block


def test_throughput_alternates_the_paths_and_pairs_each_repeat(monkeypatch):
    order = []
    clock = iter(np.arange(0, 100, 1.0))
    monkeypatch.setattr(X.costs.time, "perf_counter", lambda: next(clock))
    fake = {"single peft LoRA": lambda: order.append("s"), "HiLoRA": lambda: order.append("h")}
    monkeypatch.setattr(X, "_paths", lambda *a, **k: fake)
    t = X.throughput(None, ["p"] * 2, None, 4, 4, 1.0, 0.9, 2, 8)
    assert order == ["s", "h"] + ["s", "h", "h", "s", "s", "h", "h", "s"]    # warm-up, then ABBA
    assert len(t) == 4 and np.allclose(t["single peft LoRA"], 8.0)           # 8 tokens in 1 s
    assert np.allclose(t["ratio"], t["HiLoRA"] / t["single peft LoRA"])


def test_cpu_interleaved_alternates_and_reads_process_time(monkeypatch):
    order = []
    clock = iter(np.arange(0, 100, 2.0))
    monkeypatch.setattr(X.time, "process_time", lambda: next(clock))
    fake = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    t = X._cpu_interleaved(fake, 2)
    assert order == ["a", "b", "a", "b", "b", "a"]                           # warm-up, then ABBA
    assert list(t.columns) == ["a", "b"] and np.allclose(t.to_numpy(), 2.0)


def test_wide_bed_carries_the_pools_lora_shapes_and_routes_through_the_same_hooks():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_hilora import _char_tokenizer
    from tiny_models import tiny_llama_two_loras
    from workbench.methods import hilora as hl
    base, peft = tiny_llama_two_loras()
    tok = _char_tokenizer("abcdefgh")
    base.config.vocab_size = len(tok)
    for k in ("bos", "eos", "pad"):
        setattr(base.config, f"{k}_token_id", getattr(tok, f"{k}_token_id"))
    bed = SimpleNamespace(lm=base, peft_model=peft, tok=tok, rank=4, n_all=3, pool_families=["t0", "t1"])
    wb = X.wide_bed(bed, hidden=32, intermediate=48, layers=1, heads=4, seed=0)
    assert wb.lm.config.hidden_size == 32 and wb.config["targets"] == ["down_proj", "q_proj", "v_proj"]
    assert wb.hooks.n == 3 and wb.hooks.rank == 4 and len(wb.hooks.handles) == 3    # one layer
    w = np.array([[1.0, 0, 0], [0.5, 0.5, 0]])
    k = np.array([[4, 0, 0], [2, 2, 0]])
    out = X.wide_cost(wb, ["abc", "hgfe"], w, k, new_tokens=3, repeats=2, temperature=1.0,
                      threshold=0.9, k_max=2, budget=4, n_gauss=2)
    assert len(out["seconds"]) == 2 and (out["seconds"]["ratio"] > 0).all()
    f = out["flops_per_token"]
    assert f["HiLoRA"] > f["single peft LoRA"] > 0                  # the routing forward costs FLOPs
    assert out["flop_ratio"] == f["single peft LoRA"] / f["HiLoRA"]
    # the same hooks route the wide model: a LoRA's gates open, its update moves the logits
    ids = torch.tensor([[tok.bos_token_id, 3, 4, 5]])
    wb.hooks.set_gates(np.array([[0.0, 1.0, 0.0]]), np.array([[0, 4, 0]]))
    with torch.no_grad():
        hooked = wb.lm(input_ids=ids).logits
    wb.hooks.off()
    assert not torch.allclose(hooked, wb.lm(input_ids=ids).logits)
