"""LoraHub (workbench.methods.lorahub): element-wise composition, its loss, the gradient-free search."""

import numpy as np
import pytest
import torch

from tiny_models import tiny_llama_two_loras
from workbench.methods import hilora as hl
from workbench.methods import lorahub as lh


@pytest.fixture(scope="module")
def tiny():
    base, peft = tiny_llama_two_loras()
    return base, peft, [hl.lora_factors(peft, n) for n in ("t0", "t1")]


def test_compose_sums_a_and_b_separately_so_cross_terms_appear(tiny):
    _, _, factors = tiny
    got = lh.compose(factors, [0.5, -1.0])
    name = next(iter(factors[0]))
    (b0, a0), (b1, a1) = factors[0][name], factors[1][name]
    assert torch.allclose(got[name][0], 0.5 * b0 - b1) and torch.allclose(got[name][1], 0.5 * a0 - a1)
    delta = got[name][0] @ got[name][1]
    assert not torch.allclose(delta, 0.25 * b0 @ a0 + b1 @ a1, atol=1e-4)   # w_j w_l B_j A_l terms


def test_one_hot_weights_reproduce_that_lora_and_zero_weights_the_base(tiny):
    base, peft, factors = tiny
    x = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        plain = base(x).logits
        hub = lh.ComposedLora(base, factors)
        for j, name in enumerate(("t0", "t1")):
            hub.set_weights(np.eye(2)[j])
            peft.set_adapter(name)
            assert torch.allclose(base(x).logits, peft(x).logits, atol=1e-5)
        hub.set_weights([0.0, 0.0])
        assert torch.allclose(base(x).logits, plain, atol=1e-6)
        hub.remove()
        assert torch.allclose(base(x).logits, plain)


class _CharTok:
    """A character tokenizer on the tiny model's 40 ids (0 pad, 1 bos, 2 eos)."""
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[3 + ord(c) % 37 for c in t] for t in texts]}


def test_loss_is_the_completion_cross_entropy_plus_the_l1_penalty(tiny):
    from types import SimpleNamespace
    base, _, factors = tiny
    exs = [SimpleNamespace(prompt="abc->", completion=lambda steps=False: "cba"),
           SimpleNamespace(prompt="xy->", completion=lambda steps=False: "yx")]
    hub = lh.ComposedLora(base, factors)
    tok = _CharTok()
    hub.set_weights([0.0, 0.0])
    with torch.no_grad():
        manual = []
        for p, c in (("abc->", "cba"), ("xy->", "yx")):
            seq = [1] + tok([p])["input_ids"][0] + tok([c])["input_ids"][0] + [2]
            lp = base(torch.tensor([seq])).logits[0, :-1].log_softmax(-1)
            tgt = torch.tensor(seq[1:])
            nll = -lp[torch.arange(len(tgt)), tgt]
            manual.append(nll[len(p):])                      # completion tokens and <eos>
        want = float(torch.cat(manual).mean())
    assert abs(lh.lorahub_loss(base, tok, hub, exs, [0.0, 0.0]) - want) < 1e-5
    w = np.array([0.4, -1.0])
    with_w = lh.lorahub_loss(base, tok, hub, exs, w)
    hub.set_weights(w)
    with torch.no_grad():
        hub_ce = lh.lorahub_loss(base, tok, hub, exs, w, alpha=0.0)
    assert abs(with_w - hub_ce - lh.L1_ALPHA * 0.7) < 1e-6
    hub.remove()


def test_search_finds_a_quadratic_minimum_within_bounds_and_budget():
    target = np.array([0.8, -0.3, 0.0, 1.2])
    calls = []

    def loss(w):
        calls.append(np.array(w))
        return float(((np.asarray(w) - target) ** 2).sum())

    w, trace = lh.search(loss, 4, seed=0, budget=200)
    assert len(trace) == len(calls) == 200 and np.allclose(calls[0], 0)   # starts at w = 0
    assert all(b <= a for a, b in zip(trace, trace[1:]))                     # best so far
    assert trace[-1] < 0.01 * trace[0] and np.allclose(w, target, atol=0.1)
    assert all((np.abs(c) <= lh.BOUND).all() for c in calls)
    w2, trace2 = lh.search(loss, 4, seed=0, budget=200)
    assert np.array_equal(w, w2) and trace == trace2                         # seeded
    far, _ = lh.search(lambda v: float(((np.asarray(v) - 5.0) ** 2).sum()), 2, seed=1, budget=120)
    assert np.allclose(far, lh.BOUND, atol=0.05)                             # the bound holds
    assert len(lh.search(loss, 4, seed=0)[1]) == lh.BUDGET
