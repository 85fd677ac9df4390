"""The zoo: concurrent loads build once, the card is complete, a second load reads the cache."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from workbench.models import zoo
from workbench import cards
from workbench import evaluate

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, sys
    from workbench.models import zoo
    path, built = zoo.ensure("lm-micro", "smoke")
    model, tok = zoo.load("lm-micro", "smoke")
    print(json.dumps({"built": built, "path": str(path), "n": model.num_parameters()}))
""")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    return tmp_path


def test_two_processes_build_once_then_cache(cache):
    # a checkout without data/zoo (WORKBENCH_HOME), so lm-micro is trained, not copied
    env = {**os.environ, "WORKBENCH_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "WORKBENCH_HOME": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["built"] for o in outs) == [False, True]      # exactly one built it
    assert outs[0]["path"] == outs[1]["path"]
    path = zoo.model_dir("lm-micro", "smoke")
    assert str(path) == outs[0]["path"]
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]   # no half-written dir

    card = json.loads((path / "card.json").read_text())
    for key in ("parameters", "tokens_seen", "heldout_ppl", "unigram_ppl", "task_accuracy",
                "name", "scale", "key", "build_seconds"):
        assert key in card
    assert card["parameters"] == outs[0]["n"] > 0
    assert 0 < card["tokens_seen"] <= 8 * 4 * 32
    assert set(card["task_accuracy"]) == set(zoo.ALL_FAMILIES)
    assert all(0 <= a <= 1 for a in card["task_accuracy"].values())
    assert card["heldout_ppl"] > 1 and card["unigram_ppl"] > 1

    # a third request in this process reads the cache
    p2, built = zoo.ensure("lm-micro", "smoke")
    assert p2 == path and not built
    model, tok = zoo.load("lm-micro")
    assert tok.pad_token and tok.eos_token and tok.bos_token
    assert model.zoo_card["key"] == card["key"]
    built_cards = zoo.list_built()
    assert [c["name"] for c in built_cards] == ["lm-micro"]
    assert zoo.clear("lm-micro") == [path] and not path.exists() and zoo.list_built() == []


def test_recipes_and_keys():
    assert {"lm-tiny", "lm-instruct", "lm-reasoning", "lm-micro"} <= set(zoo.RECIPES)
    r = zoo.RECIPES["lm-tiny"]
    assert r.key("smoke") != r.key("full")
    assert r.key("smoke") == zoo.RECIPES["lm-tiny"].key("smoke")
    assert r.key("smoke") != zoo.RECIPES["lm-instruct"].key("smoke")
    with pytest.raises(KeyError, match="recipes are"):
        zoo.load("no-such-model")
    with pytest.raises(ValueError):
        r.size("huge")
    # the training mix is part of the key, and lm-tiny leans on a few families so one is solved
    from dataclasses import replace
    assert replace(r, task_weights=None).key("smoke") != r.key("smoke")
    assert r.task_weights is not None and len(r.task_weights) == len(r.train_tasks)
    assert max(r.task_weights) >= 2 * min(r.task_weights)


def test_recipes_cache_and_cards_import_without_torch():
    # the zoo itself imports torch at its top (visible dependencies); what the CLI needs to
    # name recipes, find the cache and print cards does not
    code = "import sys, workbench.models.recipes, workbench.cache, workbench.cards, " \
           "workbench.data.tasks; " \
           "print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"]


def test_v2_card_lists_every_difficulty_on_unseen_prompts(cache):
    from workbench.data import tasks
    card = zoo.build("lm-micro")
    by = card["task_accuracy_by_difficulty"]
    assert set(by) == set(zoo.ALL_FAMILIES)
    for f in zoo.ALL_FAMILIES:
        assert [int(d) for d in by[f]] == list(tasks.get(f).difficulties)
        assert set(card["tokens_written"][f]) == set(by[f])
        assert card["task_accuracy_middle"][f] == by[f][str(evaluate.MIDDLE[f])]
    # evaluation prompts avoid the training prompts wherever the problem space allows
    exs, share = evaluate.heldout_examples("kv", 4, 10, exclude={"never"})
    assert share == 1.0 and len(exs) == 10
    seen = {f"{a}+{b}=" for a in range(10) for b in range(10)}      # all 1-digit sums
    exs, share = evaluate.heldout_examples("add", 1, 10, exclude=seen)
    assert share == 0.0 and len(exs) == 10                          # falls back, and says so
    exs, share = evaluate.heldout_examples("add", 3, 10, exclude=seen)
    assert share == 1.0


def test_v1_recipes_keep_their_keys():
    # lm-tiny's cache key (and so its built weights) must not move with fields added after it;
    # only ZOO_VERSION (a change of every family's task text) moves it
    assert zoo.RECIPES["lm-tiny"].key("smoke") == "aa3c722abe"
    assert zoo.RECIPES["lm-tiny"].loop == "v1"
    for n in ("lm-base", "lm-instruct", "lm-reasoning", "lm-gpt2", "lm-qwen2", "lm-qbed"):
        assert zoo.RECIPES[n].loop in ("v2", "v3") and zoo.RECIPES[n].eval_by_difficulty


def test_v3_recipes_train_families_of_distinct_surfaces():
    # two trained families with one prompt surface (reverse and sort) would contradict each other
    from workbench.data import tasks
    for r in zoo.RECIPES.values():
        if r.loop == "v3":
            surfaces = [tasks.get(f).surface for f in r.train_tasks]
            assert len(set(surfaces)) == len(surfaces), r.name


def test_quant_sensitivity_restores_the_model(cache):
    import torch
    model, tok = zoo.load("lm-micro")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = evaluate.quant_sensitivity(model, tok, bits=2, group_size=32, ctx=32, n=2)
    assert out["ppl_rtn"] != out["ppl_fp"]          # 2-bit RTN moves the model
    assert set(out["acc_fp"]) == {"pattern", "kv"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lora_pool_is_cached_loadable_and_changes_logits(cache):
    import torch
    from peft import PeftModel
    from workbench.models import adapters
    pool = adapters.adapters("lm-micro", ["pattern", "kv+count"], rank=2, scale=2.0)
    assert pool.names == ["pattern", "kv+count"]
    card = pool.card
    assert set(card["base_accuracy"]) == {"pattern", "kv", "count"}
    a = card["adapters"]["kv+count"]
    assert a["families"] == ["kv", "count"] and set(a["accuracy"]) == set(card["base_accuracy"])
    assert (pool.dir / "pattern" / "adapter_config.json").exists()
    # a second call reads the cache (same directory, nothing rebuilt)
    mtime = (pool.dir / "card.json").stat().st_mtime
    again = adapters.adapters("lm-micro", ["pattern", "kv+count"], rank=2, scale=2.0)
    assert again.dir == pool.dir and (again.dir / "card.json").stat().st_mtime == mtime
    assert adapters.adapters("lm-micro", ["pattern"], rank=4).dir != pool.dir   # rank is in the key
    # loadable with PeftModel, and the adapter changes the logits
    base, tok = zoo.load("lm-micro")
    x = tok(tok.bos_token + "a b c a b c a ->", return_tensors="pt",
            add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = base(input_ids=x).logits
    model = PeftModel.from_pretrained(base, pool.path("pattern"))
    with torch.no_grad():
        out = model(input_ids=x).logits
    assert not torch.allclose(ref, out)
    multi, _ = pool.load()
    assert set(multi.peft_config) == {"pattern", "kv+count"}
    with pytest.raises(KeyError, match="family"):
        adapters.adapters("lm-micro", ["nope"])
    assert [c["base"] for c in adapters.list_built()] == ["lm-micro", "lm-micro"]


def test_cards_table_and_cli_all(cache):
    from workbench import cli
    card = zoo.build("lm-micro")
    table = cards.format_cards([card])
    assert "lm-micro (smoke)" in table and table.count("\n") == 2
    ap = cli.parser()
    assert ap.parse_args(["zoo", "build", "--all"]).all
    assert ap.parse_args(["zoo", "list", "--json"]).json


def test_cli_builds_several_names_together_and_refuses_unknown_ones(monkeypatch, capsys):
    from workbench import cli
    from workbench.models import adapters
    seen = {}

    def fake_build_all(scale, force=False, jobs=1, names=None):
        seen.update(scale=scale, jobs=jobs, names=names)
        return [{"name": n, "scale": scale, "error": "not built in this test"} for n in names]

    monkeypatch.setattr(adapters, "build_all", fake_build_all)
    rc = cli.main(["zoo", "build", "lm-micro", adapters.POOL_NAME, "--jobs", "1"])
    assert seen == {"scale": "smoke", "jobs": 1, "names": ["lm-micro", adapters.POOL_NAME]}
    assert rc == 1 and "not built in this test" in capsys.readouterr().err
    assert cli.main(["zoo", "build", "lm-micro", "lm-nope"]) == 2
    assert "unknown recipe 'lm-nope'" in capsys.readouterr().err
    assert cli.main(["zoo", "clear", "lm-micro", "lm-tiny"]) == 2


def test_build_order_names_every_buildable_recipe_and_puts_the_pool_after_its_base():
    from workbench.models import adapters
    order = adapters.BUILD_ORDER
    assert sorted(order) == sorted([*zoo.RECIPES, *adapters.SHIPPED_POOLS, adapters.CLIP_NAME])
    assert all(order.index(adapters.POOL_BASE) < order.index(p) for p in adapters.SHIPPED_POOLS)


def test_build_all_in_parallel_keeps_order_and_reports_a_failed_build(cache):
    from workbench.models import adapters
    cards = adapters.build_all("smoke", jobs=2, names=["lm-nope", "lm-micro"])
    assert [c["name"] for c in cards] == ["lm-nope", "lm-micro"]
    assert "unknown zoo model 'lm-nope'" in cards[0]["error"]
    assert "error" not in cards[1] and (zoo.model_dir("lm-micro") / "card.json").exists()


def test_context_documents_tokenize_like_the_rendered_context_and_label_every_answer():
    # several examples of one family in one row, one <bos>, no attention reset; the
    # training ids are the tokens of the text the card's in-context evaluation prompts with
    from dataclasses import replace
    from workbench.data import packing, tasks
    from workbench.models import training
    r = replace(zoo.RECIPES["lm-base"], train_tasks=("sort", "lettermap"), task_weights=None,
                context_share=0.5, max_shots=3)
    s = replace(r.smoke, n_task_examples=200, ctx=128)
    tok = training.tokenizer(r, s)
    docs = training.task_documents(r, s)
    assert sum(len(d) for d in docs) >= 400 and all(len({e.family for e in d}) == 1 for d in docs)
    multi = [d for d in docs if len(d) > 1]
    assert {d[0].family for d in multi} == {"sort", "lettermap"}
    assert all(len({str(e.metadata["rule"]) for e in d}) == 1 for d in docs
               if d[0].family == "lettermap")                     # one rule per context
    sort_docs = [d for d in docs if d[0].family == "sort"]
    assert 0.3 < sum(len(d) for d in sort_docs if len(d) > 1) / \
        sum(len(d) for d in sort_docs) < 0.7                        # context_share of sort
    pairs = training.encode_documents(tok, multi[:20], s.ctx, r.with_steps)
    for d, (ids, labels) in zip(multi[:20], pairs):
        prompt, comp = tasks.render_context(d, r.with_steps)
        assert ids == [tok.bos_token_id] + tok(prompt + comp, add_special_tokens=False)[
            "input_ids"] + [tok.eos_token_id]
        answers = [t for t, y in zip(ids, labels) if y != packing.IGNORE]
        assert tok.decode(answers[:-1]) == "".join(e.completion() for e in d)
    x, _ = training.task_rows(r, s, tok, docs)
    assert x.shape[1] == 128 and int((x == tok.bos_token_id).sum()) == len(docs)


def test_in_context_card_column_on_unseen_queries(cache):
    from dataclasses import replace
    from workbench.data import tasks
    from workbench.models.training import train_and_save
    r = replace(zoo.RECIPES["lm-micro"], train_tasks=("pattern", "tag"), context_share=0.5,
                max_shots=2, icl_shots=2, smoke=replace(zoo.RECIPES["lm-micro"].smoke, ctx=64))
    assert r.key("smoke") != zoo.RECIPES["lm-micro"].key("smoke")
    card = train_and_save(r, "smoke", cache / "m")
    assert card["trained_tasks"] == ["pattern"] and card["trained_in_context"] == ["tag"]
    ic = card["in_context"]
    assert ic["shots"] == 2 and set(ic["accuracy"]) == set(zoo.ALL_FAMILIES + tasks.ICL_FAMILIES)
    for v in ic["accuracy"].values():
        assert v["gain"] == pytest.approx(v["2"] - v["0"], abs=1e-3)
    # the 0-shot column is plain exact match on the same queries
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    model = AutoModelForCausalLM.from_pretrained(cache / "m").eval()
    tok = PreTrainedTokenizerFast.from_pretrained(cache / "m")
    ctxs = evaluate.in_context_examples("pattern", 3, 4, 2)
    assert evaluate.in_context_accuracy(model, tok, ctxs, shots=0) == \
        evaluate.exact_match(model, tok, [c[-1] for c in ctxs])
    assert "in context" in cards.format_cards([card])


def test_pool_card_reports_cat_merges_of_gaining_pairs(cache, monkeypatch):
    from workbench.models import adapters
    monkeypatch.setattr(adapters, "MERGE_GAIN", -1.0)        # every micro adapter "gains"
    pool = adapters.adapters("lm-micro", ["pattern", "kv", "kv+count"], rank=2)
    m = pool.card["merges"]
    assert list(m) == ["pattern+kv"]                          # single-family adapters only
    a = pool.card["adapters"]
    for n in ("pattern", "kv"):
        own, base = a[n]["accuracy"][n], pool.card["base_accuracy"][n]
        if own != base:
            assert m["pattern+kv"]["kept"][n] == pytest.approx(
                (m["pattern+kv"]["accuracy"][n] - base) / (own - base), abs=1e-3)
    assert "cat merges" in cards.format_cards([pool.card])
