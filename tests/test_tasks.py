"""Every task family: seeded, well-formed, and its verifier accepts the right answer only."""
import pytest

from workbench.data import tasks as T


@pytest.mark.parametrize("name", T.names())
def test_generator_verifier_pair(name):
    fam = T.get(name)
    for d in fam.difficulties:
        exs = fam.generate(25, seed=3, difficulty=d)
        assert len(exs) == 25
        for ex in exs:
            assert ex.family == name and ex.difficulty == d and ex.prompt and ex.target
            assert "\n" not in ex.text(with_steps=True)
            # the reference completion scores 1, with and without steps
            assert T.score(ex, ex.completion()) == 1.0
            assert fam.score(ex, ex.completion(with_steps=True)) == 1.0
            assert T.score(ex, ex.completion() + "\nmore text") == 1.0
            # a wrong answer scores 0, also behind correct-looking steps
            assert T.score(ex, ex.target + "x") == 0.0
            assert T.score(ex, " 1 => " + ex.target + " 0") == 0.0
            assert T.score(ex, "") == 0.0
            if fam.has_steps:
                assert ex.steps, f"{name} promises steps"


@pytest.mark.parametrize("name", T.names())
def test_seeded_and_varied(name):
    a = T.generate(name, 20, seed=1)
    b = T.generate(name, 20, seed=1)
    c = T.generate(name, 20, seed=2)
    assert [e.text(True) for e in a] == [e.text(True) for e in b]
    assert [e.text(True) for e in a] != [e.text(True) for e in c]
    assert len({e.prompt for e in a}) > 5


def test_arithmetic_is_right():
    for ex in T.generate("add", 50, 0, 3):
        assert int(ex.target) == ex.metadata["a"] + ex.metadata["b"]
        assert ex.steps[-1].endswith(f"c{int(ex.target) // 10 ** 3}")
    for ex in T.generate("sub", 50, 0, 3):
        assert int(ex.target) == ex.metadata["a"] - ex.metadata["b"] >= 0
    for ex in T.generate("mul", 50, 0, 2):
        assert int(ex.target) == ex.metadata["a"] * ex.metadata["b"]
    for ex in T.generate("chain", 50, 0, 4):
        assert len(ex.steps) == 4
        assert int(ex.target) == eval(ex.steps[-1].split("=")[0])   # last step reproduces it
        assert ex.steps[-1].endswith("=" + ex.target)


def test_string_rules():
    ex = T.Example("reverse", "a b c ->", "c b a", 3)
    assert T.score(ex, " c b a") == 1.0 and T.score(ex, "cba") == 0.0
    for ex in T.generate("sort", 20, 0, 5):
        assert ex.target.split() == sorted(ex.metadata["input"])
    for ex in T.generate("rotate", 20, 0, 4):
        s = ex.metadata["input"]
        assert "".join(ex.target.split()) == s[1:] + s[0]
    for ex in T.generate("dedupe", 20, 0, 6):
        assert "".join(ex.target.split()) == "".join(dict.fromkeys(ex.metadata["input"]))


def test_every_family_has_its_own_surface_and_paired_rules_keep_their_inputs():
    # no two families share a prompt surface, so trained skills never
    # contradict each other; each string/recall family starts with its operator word
    assert all(T.same_surface(f) == [] for f in T.names())
    assert len({T.get(f).surface for f in T.names()}) == len(T.names())
    for f in ("reverse", "sort", "rotate", "swap", "dedupe"):
        assert all(e.prompt.startswith(f + " ") for e in T.generate(f, 10, 0))
    # addmod and pattern_skip still draw the inputs of add and pattern (Family.stream)
    add, addmod = T.generate("add", 200, 5, 2), T.generate("addmod", 200, 5, 2)
    assert [e.prompt.replace("+", "(+)") for e in add] == [e.prompt for e in addmod]
    assert sum(a.target != b.target for a, b in zip(add, addmod)) > 100
    p, q = T.generate("pattern", 50, 0, 3), T.generate("pattern_skip", 50, 0, 3)
    assert [e.prompt.replace("next", "skip", 1) for e in p] == [e.prompt for e in q]
    assert all(a.target != b.target for a, b in zip(p, q))


def test_in_context_families_share_a_rule_per_context_and_show_the_query_symbols():
    assert set(T.ICL_FAMILIES) == {"lettermap", "digitmap", "pick", "tag"}
    for f in T.ICL_FAMILIES:
        ctxs = T.contexts(f, 30, 4, seed=1, difficulty=3)
        assert ctxs == T.contexts(f, 30, 4, seed=1, difficulty=3)          # seeded
        rules = set()
        for c in ctxs:
            assert len(c) == 5 and {e.family for e in c} == {f}
            rule = c[0].metadata["rule"]
            assert all(e.metadata["rule"] == rule for e in c)        # one rule per context
            rules.add(str(rule))
            if f in ("lettermap", "digitmap"):                      # every query symbol shown
                shown = {ch for e in c[:-1] for ch in e.metadata["input"]}
                assert set(c[-1].metadata["input"]) <= shown
        assert len(rules) > 1                                       # drawn per context
        prompt, comp = T.render_context(ctxs[0])
        assert prompt.count(T.CONTEXT_SEP) == 4 and prompt.endswith(ctxs[0][-1].prompt)
        assert comp == ctxs[0][-1].completion()
    # alone, a rule family's prompt does not determine its answer: the same prompt, two rules
    by_prompt = {}
    for e in T.generate("lettermap", 3000, 0, 2):
        by_prompt.setdefault(e.prompt, set()).add(e.target)
    assert max(len(v) for v in by_prompt.values()) > 1
    # ordinary families: independent examples of the family, the same for the same seed
    c = T.contexts("sort", 3, 2, seed=0, difficulty=5)
    assert [[e.prompt for e in x] for x in c] == \
        [[e.prompt for e in x] for x in T.contexts("sort", 3, 2, seed=0, difficulty=5)]


def test_kv_keys_tokenize_alike_in_the_context_and_the_question():
    # without a leading space the first key ("m=7 b=9 ; m?") would be "m", the question's " m"
    from workbench.models import recipes, training
    r = recipes.RECIPES["lm-base"]
    tok = training.tokenizer(r, r.smoke)            # the recipe's own BPE
    for ex in T.generate("kv", 20, 0, 4):
        ids = tok(ex.prompt, add_special_tokens=False)["input_ids"]
        pieces = [tok.decode([i]) for i in ids]
        keys = [pieces[i - 1] for i, p in enumerate(pieces) if p == "="]
        assert len(keys) == 4 and all(k.startswith(" ") for k in keys)
        assert pieces[-2] in keys and pieces[-1] == "?"


def test_counting_and_recall():
    for ex in T.generate("count", 30, 0, 8):
        assert int(ex.target) == ex.prompt.split(" -> ")[0].split(" in ")[1].split().count(
            ex.metadata["char"])
    for ex in T.generate("kv", 30, 0, 4):
        ctx, q = ex.prompt.split(" ; ")
        assert dict(kv.split("=") for kv in ctx.split()[1:])[q.rstrip("?")] == ex.target


def test_unknown_family():
    with pytest.raises(KeyError, match="families are"):
        T.get("nope")


def test_draw_problems_takes_n_per_level_from_one_side_only():
    import numpy as np
    fams = ["add", "reverse"]
    train = T.draw_problems(fams, 3, "train", np.random.default_rng(0))
    test = T.draw_problems(fams, 3, "test", np.random.default_rng(0))
    levels = sum(len(T.get(f).difficulties) for f in fams)
    assert len(train) == len(test) == 3 * levels
    assert not {e.prompt for e in train} & {e.prompt for e in test}      # disjoint sides
    again = T.draw_problems(fams, 3, "train", np.random.default_rng(0))
    assert [e.prompt for e in again] == [e.prompt for e in train]


def test_a_fixed_rule_holds_in_every_example_and_keeps_the_other_draws():
    per_example = T.generate("tag", 40, seed=3, difficulty=3)
    fixed = T.generate("tag", 40, seed=3, difficulty=3, rule="q")
    assert len({e.metadata["rule"] for e in per_example}) > 1
    assert all(e.metadata["rule"] == "q" and e.target.endswith("q") for e in fixed)
    assert [e.prompt for e in fixed] == [e.prompt for e in
                                         T.generate("tag", 40, seed=3, difficulty=3, rule="q")]
    assert [e.prompt for e in per_example] == [e.prompt for e in
                                               T.generate("tag", 40, seed=3, difficulty=3)]
    with pytest.raises(ValueError, match="not an in-context family"):
        T.generate("sort", 2, rule="q")
