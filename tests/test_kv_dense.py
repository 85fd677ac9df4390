"""kv_dense, the optional dense look-up format of kv (docs/zoo-lessons.md): the value token right
after its key, several questions on one set of pairs labelled as one document; off by default
(no listed family), named by lm-base's recipe only."""
from dataclasses import replace

import pytest

from workbench.data import packing, tasks as T
from workbench.models import recipes, training


def test_off_by_default_but_in_lm_bases_mix():
    for f in ("kv_dense", "kv_dense_sp"):
        assert f not in T.names() and f not in T.ICL_FAMILIES and f not in T.FAMILIES
        assert T.get(f) is T.OPTIONAL[f]
    # lm-base trains kv in its dense form and its card scores it alone; no other
    # recipe names either format
    assert [r.name for r in recipes.RECIPES.values() if "kv_dense_sp" in r.train_tasks] == \
        ["lm-base"]
    assert all("kv_dense" not in r.train_tasks for r in recipes.RECIPES.values())
    base = recipes.RECIPES["lm-base"]
    assert "kv" not in base.train_tasks and base.extra_eval == ("kv_dense_sp",)
    for ex in T.generate("kv", 10, 0, 4) + T.generate("tag", 10, 0, 3):
        assert ex.lead == " " and ex.completion() == " " + ex.target     # surfaces unchanged


@pytest.mark.parametrize("name,ask", [("kv_dense", "; "), ("kv_dense_sp", " ; ")])
def test_example_and_context(name, ask):
    for ex in T.generate(name, 30, 0, 4):
        pairs, q = ex.prompt.split(" ; ")
        table = {p[0]: p[1:] for p in pairs.split()[1:]}
        assert len(table) == 4 and table[q] == ex.target and ex.completion() == ex.target
        assert T.score(ex, ex.completion()) == 1.0 and T.score(ex, "x") == 0.0
    for ctx in T.contexts(name, 20, 4, seed=0, difficulty=3):
        first, *rest = ctx
        assert first.prompt.startswith("kv ") and len(rest) == 4
        assert all(e.prompt.startswith(ask) and e.metadata["rule"] == first.metadata["rule"]
                   and e.target == first.metadata["rule"][e.prompt[len(ask):]] for e in rest)
    one = T.contexts(name, 5, 0, seed=1, difficulty=4)   # no demonstrations: an ordinary
    assert all(len(c) == 1 and c[0].prompt.startswith("kv ") for c in one)   # example


@pytest.mark.parametrize("name", ["kv_dense", "kv_dense_sp"])
def test_value_token_follows_its_key_and_every_answer_is_labelled(name):
    r = replace(recipes.RECIPES["lm-base"], train_tasks=("reverse", name),
                task_weights=None, context_share=0.5, max_shots=6)
    s = replace(r.smoke, n_task_examples=300)
    tok = training.tokenizer(r, s)
    docs = [d for d in training.task_documents(r, s) if d[0].family == name]
    assert sum(len(d) for d in docs) >= 300 and max(len(d) for d in docs) == 7
    comps = training.completions(r, [e for d in docs for e in d])
    for d, (ids, labels) in zip(docs, training.encode_documents(tok, docs, s.ctx, True, comps)):
        prompt, comp = T.render_context(d, True)
        assert ids[1:-1] == tok(prompt + comp, add_special_tokens=False)["input_ids"]
        pieces = [tok.decode([i]) for i in ids]
        table = d[0].metadata["rule"]
        answers = [i for i, y in enumerate(labels) if y != packing.IGNORE][:-1]   # not <eos>
        assert [pieces[i] for i in answers] == [e.target for e in d]
        for i in answers:                       # the asked key is the token right before
            assert table[pieces[i - 1].strip()] == pieces[i]
        keys = [i for i, p in enumerate(pieces[:answers[0]]) if p[:1] == " " and p.strip() in table]
        assert all(pieces[i + 1] == table[pieces[i].strip()] for i in keys)   # and in the pairs
        if name == "kv_dense_sp":            # every question is asked with the same " ;" token
            assert len({pieces[i - 2] for i in answers}) == 1


def test_the_card_reads_kv_dense_sp_as_a_trained_family():
    from workbench import cards, evaluate
    assert evaluate.MIDDLE["kv_dense_sp"] == 4
    card = {"name": "m", "scale": "smoke", "parameters": 1, "tokens_seen": 1, "heldout_ppl": 9.0,
            "unigram_ppl": 190.0, "trained_tasks": ["reverse"],
            "trained_in_context": ["kv_dense_sp", "tag"],
            "task_accuracy_middle": {"reverse": 1.0, "sub": 0.1, "kv_dense_sp": 0.95}}
    row = cards.card_rows([card])[0]
    assert row["trained"] == {"reverse": 1.0, "kv_dense_sp": 0.95}    # tag: not scored alone
    assert row["heldout_best"] == 0.1
    assert "kv_dense_sp 0.95" in cards.format_cards([card])
