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


def test_shared_surface_but_different_rules():
    assert set(T.same_surface("reverse")) >= {"sort", "rotate", "swap", "dedupe"}
    assert "addmod" in T.same_surface("add") and "pattern_skip" in T.same_surface("pattern")
    # same prompt, different answers: a router must read the rule from data, not the prompt
    add, addmod = T.generate("add", 200, 5, 2), T.generate("addmod", 200, 5, 2)
    assert [e.prompt for e in add] == [e.prompt for e in addmod]
    assert sum(a.target != b.target for a, b in zip(add, addmod)) > 100
    p, q = T.generate("pattern", 50, 0, 3), T.generate("pattern_skip", 50, 0, 3)
    assert [e.prompt for e in p] == [e.prompt for e in q]
    assert all(a.target != b.target for a, b in zip(p, q))


def test_counting_and_recall():
    for ex in T.generate("count", 30, 0, 8):
        assert int(ex.target) == ex.prompt.split(" -> ")[0].split(" in ")[1].split().count(
            ex.metadata["char"])
    for ex in T.generate("kv", 30, 0, 4):
        ctx, q = ex.prompt.split(" ; ")
        assert dict(kv.split("=") for kv in ctx.split())[q.rstrip("?")] == ex.target


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
