"""Hint Tuning (paper 06): state labelling, minimal-prefix hints, token counting, the probe
(the harness: tests/test_experiments_hint_tuning.py)."""

import pytest

from workbench.data import tasks
from workbench.experiments import hint_tuning as X
from workbench.methods import hint_tuning as ht
from workbench.models import finetune


def test_label_state_least_guidance():
    # the instruct model agrees unaided: No-Hint, whatever happens with hints
    assert ht.label_state(True, [False, False], False) == (ht.NO_HINT, 0)
    # the first prefix that makes it agree is the minimal one, not a longer one that also does
    assert ht.label_state(False, [False, True, True], True) == (ht.SPARSE_HINT, 2)
    assert ht.label_state(False, [True, False], True) == (ht.SPARSE_HINT, 1)
    # nothing shorter than the full reasoning: Full-Hint, whether or not the full hint agrees
    assert ht.label_state(False, [False, False], True) == (ht.FULL_HINT, None)
    assert ht.label_state(False, [], False) == (ht.FULL_HINT, None)


def test_split_and_render_round_trip_the_registry_format():
    for fam in ("add", "count", "chain"):
        for e in tasks.generate(fam, 20, seed=3):
            comp = e.completion(with_steps=True)
            steps, ans = ht.split_reasoning(comp)
            assert steps == e.steps and ans == e.target
            assert ht.render(steps, ans) == comp
            assert tasks.score(e, ht.render([], ans)) == 1.0
    assert ht.split_reasoning(" 42") == ([], "42")


def test_sparse_hints_are_proper_prefixes_shortest_first():
    for e in tasks.generate("chain", 30, seed=1, difficulty=5):
        hints = ht.sparse_hints(e.steps)
        assert [len(h) for h in hints] == list(range(1, len(e.steps)))
        full = ht.hint_prompt(e.prompt, e.steps)
        for h in hints:
            assert h == e.steps[:len(h)]
            # the rendered probe input with a sparse hint is a prefix of the full-hint input
            assert ht.hint_prompt(e.prompt, h).endswith(" =>")
            assert full.startswith(ht.hint_prompt(e.prompt, h)[:-3])
    assert ht.sparse_hints(["only"]) == [] and ht.hint_prompt("1+2=", []) == "1+2="


def test_training_target_per_state():
    e = tasks.generate("add", 1, seed=0, difficulty=3)[0]
    direct = ht.training_target(ht.NO_HINT, e.steps, 0, e.target)
    sparse = ht.training_target(ht.SPARSE_HINT, e.steps, 1, e.target)
    full = ht.training_target(ht.FULL_HINT, e.steps, None, e.target)
    assert direct == e.completion(False) and full == e.completion(True)
    assert sparse == " " + e.steps[0] + " => " + e.target
    assert all(tasks.score(e, t) == 1.0 for t in (direct, sparse, full))
    assert len(direct) < len(sparse) < len(full)


class _CharTok:
    """A stand-in tokenizer: one token per character (so counts differ from words or bytes)."""
    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_count_tokens_uses_the_tokenizer():
    assert ht.count_tokens(_CharTok(), ["ab", " 1+2=3 c0", ""]) == [2, 9, 0]


def test_count_tokens_with_a_real_bpe():
    from workbench.data import corpus
    tok = corpus.train_tokenizer(300, extra_text=["1+2=3 c0 ; 4+5=9 c0 => 93"] * 50)
    text = " 1+2=3 c0 ; 4+5=9 c0 => 93"
    (n,) = ht.count_tokens(tok, [text])
    assert n == len(tok(text, add_special_tokens=False)["input_ids"])
    assert n < len(text)                   # BPE merges: fewer tokens than characters


def test_probe_labels_every_problem_and_agreement_needs_r_answer(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    exs = tasks.generate("add", 4, seed=0, difficulty=2)
    p, c = X.reader_data(("add",), 4)
    model, tok, _ = finetune.cached_lora("lm-micro", "smoke", p, c,
                                         finetune.LoraSettings(rank=2, steps=2))
    r_comps = [e.completion(True) for e in exs]
    res = ht.probe(model, tok, exs, r_comps, max_new_tokens=4)
    assert len(res) == 4
    for p, e in zip(res, exs):
        assert p.steps == e.steps and p.r_answer == e.target
        assert len(p.sparse) == len(e.steps) - 1
        assert p.state == ht.label_state(p.direct, p.sparse, p.full)[0]
