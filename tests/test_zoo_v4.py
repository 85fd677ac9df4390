"""The zoo's fine-tunes of a base recipe, the reasoning mix of steps and direct answers,
the forced-direct column and the long-trace family."""
import statistics
from dataclasses import replace

import pytest

from workbench import cards, evaluate
from workbench.data import tasks
from workbench.models import recipes, training, zoo


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    return tmp_path


def test_longadd_is_add_on_long_numbers_with_long_traces():
    from workbench.data import corpus
    for d in tasks.get("longadd").difficulties:
        for e in tasks.generate("longadd", 20, seed=1, difficulty=d):
            a, b = e.metadata["a"], e.metadata["b"]
            assert len(str(a)) == len(str(b)) == d and e.target == str(a + b)
            assert len(e.steps) == d and tasks.score(e, e.completion(True)) == 1.0
    assert tasks.get("longadd").surface != tasks.get("add").surface   # prompts never alike
    # a zoo-sized BPE (512 tokens, the task sample lines every recipe uses) writes a 12-digit
    # sum's steps in about 150 tokens
    tok = corpus.train_tokenizer(512, extra_text=corpus.task_lines(
        tasks.ALL_FAMILIES, 100, seed=2, with_steps=True) + [" ".join(tasks.LETTERS)] * 200)
    n = [len(tok(e.completion(True), add_special_tokens=False)["input_ids"])
         for e in tasks.generate("longadd", 40, seed=3, difficulty=evaluate.LONG_LEVEL["longadd"])]
    assert statistics.median(n) >= 140


def test_reasoning_mix_renders_easy_items_bare_and_a_share_forced_direct():
    r = replace(recipes.RECIPES["lm-reasoning"], smoke=replace(
        recipes.RECIPES["lm-reasoning"].smoke, n_task_examples=600))
    exs = training.task_examples(r, r.smoke)
    comps = training.completions(r, exs)
    levels = dict(zip(r.train_tasks, r.direct_levels))
    forced = steps = 0
    for e, c in zip(exs, comps):
        assert tasks.score(e, c) == 1.0                         # every rendering is right
        easy = e.difficulty in tasks.get(e.family).difficulties[:levels[e.family]]
        if easy:
            assert c == " " + e.target                          # easy: answered at once
        elif c.startswith(" =>"):
            forced += 1
        elif e.steps:
            steps += 1
            assert c == e.completion(True)
    share = forced / (forced + steps)
    assert abs(share - r.forced_direct_share) < 0.1               # the recipe's share (0.4)
    # without steps everything is a bare answer; the old recipes render as before
    assert training.completions(replace(r, with_steps=False), exs[:50]) == \
        [e.completion(False) for e in exs[:50]]
    base = recipes.RECIPES["lm-base"]
    bex = training.task_examples(base, replace(base.smoke, n_task_examples=50))
    assert training.completions(base, bex) == [e.completion(True) for e in bex]


def test_trace_only_families_keep_every_trace_and_the_others_their_share():
    r = replace(recipes.RECIPES["lm-reasoning"], forced_direct_share=0.5, trace_only=("longadd",))
    r = replace(r, smoke=replace(r.smoke, n_task_examples=600))
    exs = training.task_examples(r, r.smoke)
    forced = [e.family for e, c in zip(exs, training.completions(r, exs)) if c.startswith(" =>")]
    assert "longadd" in {e.family for e in exs} and "longadd" not in forced
    assert {"count", "add", "chain"} <= set(forced)
    assert all(c == e.completion(True) for e, c in zip(exs, training.completions(r, exs))
               if e.family == "longadd")
    # an empty trace_only is no field at all for the key (the shipped keys stay)
    base = recipes.RECIPES["lm-instruct"]
    assert replace(base, trace_only=()).key("smoke") == base.key("smoke")
    assert replace(base, trace_only=("longadd",)).key("smoke") != base.key("smoke")


def test_fine_tune_key_moves_with_its_base_and_old_keys_stay(monkeypatch):
    # ZOO_VERSION 3 (distinct surfaces) moved every key; lm-tiny's is pinned in test_zoo.py
    r = recipes.RECIPES["lm-reasoning"]
    k = r.key("smoke")
    assert replace(r, compare_direct=None).key("smoke") == k     # card-only field
    assert replace(r, forced_direct_share=0.1).key("smoke") != k
    assert replace(r, init_from=None).key("smoke") != k
    moved = dict(recipes.RECIPES, **{"lm-base": replace(recipes.RECIPES["lm-base"], seed=7)})
    monkeypatch.setattr(recipes, "RECIPES", moved)
    assert r.key("smoke") != k                                   # the base's key enters ours
    assert recipes.RECIPES["lm-instruct"].init_from == r.init_from == "lm-base"


def test_fine_tune_of_a_built_model_and_its_card(cache):
    base = zoo.recipe("lm-micro")
    ft = replace(base, name="micro-ft", init_from="lm-micro", with_steps=True,
                 train_tasks=("pattern", "kv", "count"), direct_levels=(0, 0, 1),
                 forced_direct_share=0.3, extra_eval=("longadd",), compare_direct="lm-micro",
                 smoke=replace(base.smoke, steps=2, lr=1e-9, ctx=48))
    base_model, base_tok = zoo.load("lm-micro")
    model, tok = zoo.load("micro-ft", recipe=ft)
    card = model.zoo_card
    assert card["init_from"] == {"name": "lm-micro", "key": base.key("smoke")}
    assert tok.get_vocab() == base_tok.get_vocab()               # the base's tokenizer
    a, b = base_model.state_dict(), model.state_dict()
    assert all((a[k] - b[k]).abs().max() < 1e-4 for k in a)      # lr 1e-9: still the base
    assert model.config.max_position_embeddings == 48
    lt = card["long_trace"]["longadd"]
    assert lt["difficulty"] == evaluate.LONG_LEVEL["longadd"] and 0 <= lt["exact_match"] <= 1
    assert lt["median_reference_trace_tokens"] > 0
    assert "longadd" in card["task_accuracy_by_difficulty"]
    d = card["direct"]
    assert d["against"] == "lm-micro" and set(d["forced_direct"]) == {"pattern", "kv"}
    assert set(d["solved_by_both"]) <= {"pattern", "kv"}
    table = cards.format_cards([card])
    assert "fine-tuned from" in table and "lm-micro" in table and "longadd at 12" in table
    with pytest.raises(ValueError, match="architecture"):
        zoo.load("micro-bad", recipe=replace(ft, name="micro-bad",
                                             smoke=replace(ft.smoke, d_model=64)))


def test_forced_direct_appends_the_answer_mark():
    class Tok:
        pass
    seen = []

    def fake_generate(model, tok, prompts, max_new_tokens=16, batch=64):
        seen.extend(prompts)
        return [" 5\nmore"] * len(prompts)
    exs = tasks.generate("add", 3, seed=0, difficulty=1)
    import workbench.evaluate as E
    orig = E.generate
    E.generate = fake_generate
    try:
        tok = lambda s, add_special_tokens=False: {"input_ids": list(s)}   # noqa: E731
        out = E.forced_direct(None, tok, exs)
    finally:
        E.generate = orig
    assert all(p == e.prompt + " =>" for p, e in zip(seen, exs))
    assert out == [" => 5"] * 3
    assert [tasks.score(e, c) for e, c in zip(exs, out)] == [float(e.target == "5") for e in exs]
