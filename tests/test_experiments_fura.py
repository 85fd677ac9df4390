"""The harness of notebook 16 (workbench.experiments.fura) on a tiny module: the methods it
prepares, the update it reads back, the 4-bit core bound and retention at equal target accuracy."""
import copy
from types import SimpleNamespace

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pd = pytest.importorskip("pandas")
from torch import nn  # noqa: E402

from workbench.experiments import fura as xp  # noqa: E402
from workbench.methods import fura  # noqa: E402


class Tiny(nn.Module):
    """Two projections named as in the zoo's Llama (``q_proj`` square, ``up_proj`` tall)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.up_proj = nn.Linear(16, 48, bias=False)

    def forward(self, i):
        return self.up_proj(self.q_proj(self.emb(i)))


def _tiny():
    torch.manual_seed(0)
    return Tiny()


@pytest.mark.parametrize("method,blocks", [("svd", 1), ("fura", 4)])
def test_prepare_reconstructs_and_trains_only_the_cores(method, blocks):
    m0 = _tiny()
    W0 = xp.pretrained_weights(m0)
    assert list(W0) == ["q_proj", "up_proj"]
    m = xp.prepare(_tiny(), method)
    assert xp.only_cores_trainable(m)
    assert {mod.n for mod in m.modules() if isinstance(mod, fura.FuraLinear)} == {blocks}
    recon = xp.reconstruction(m, W0, rank=2)
    assert recon.rel_error.max() < 1e-5
    assert (recon.trainable == recon.closed_form).all()
    # untrained, the update read back is zero (the reference is the method's own init)
    d = xp.update(m0, m, method, list(W0))
    assert max(float(v.abs().max()) for v in d.values()) == 0.0
    # a trained core moves the update, and it stays in span(U_j) of the blocks
    with torch.no_grad():
        m.up_proj.R.add_(0.1 * torch.randn_like(m.up_proj.R))
    d = xp.update(m0, m, method, list(W0))
    U = fura.block_svd(W0["up_proj"], m.up_proj.n)[0]
    assert float(d["up_proj"].norm()) > 0.01
    assert fura.outside_span(d["up_proj"], U) < 1e-6


def test_full_finetune_update_leaves_the_column_space():
    m0, m = _tiny(), xp.prepare(_tiny(), "full")
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {"q_proj.weight", "up_proj.weight"}
    W0 = xp.pretrained_weights(m0)
    with torch.no_grad():
        m.up_proj.weight.add_(0.1 * torch.randn_like(m.up_proj.weight))
    d = xp.update(m0, m, "full", list(W0))
    U1 = fura.block_svd(W0["up_proj"], 1)[0]
    assert fura.outside_span(d["up_proj"], U1) > 0.1


def test_qfura_core_lies_within_half_a_grid_step():
    m0 = _tiny()
    W0 = xp.pretrained_weights(m0)
    q = xp.prepare(_tiny(), "qfura", bits=4, group_size=16)
    assert xp.core_within_bound(q, W0)
    err = xp.qfura_init_error(m0, W0, 4, 16)
    assert set(err) == set(W0) and all(0 < e < 0.5 for e in err.values())
    assert set(xp.qlora_init_error(W0, 4, 16)) == set(W0)


def test_retention_at_the_first_checkpoint_reaching_tau():
    traj = pd.DataFrame({"method": ["svd"] * 3 + ["full"] * 3, "step": [1, 2, 3] * 2,
                         "target": [0.2, 0.5, 0.6, 0.4, 0.9, 1.0],
                         "retention": [0.8, 0.7, 0.6, 0.5, 0.3, 0.1]})
    tau = xp.equal_target_level(traj, "full", "svd")
    assert tau == 0.6
    assert xp.retention_at(traj, "svd", tau) == 0.6
    assert xp.retention_at(traj, "full", tau) == 0.3        # first checkpoint at or above 0.6
    assert xp.retention_at(traj, "full", 1.5) is None


def test_prepare_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        xp.prepare(_tiny(), "bogus")


def test_block_trade_counts_and_spans():
    torch.manual_seed(1)
    w0 = torch.randn(48, 16, dtype=torch.float64)
    assert xp.block_counts(16) == [1, 2, 4, 8, 16]
    inside = torch.randn(48, 16, dtype=torch.float64)
    U1 = fura.block_svd(w0, 1)[0]
    inside = xp.project_blocks(inside, U1)                  # in span(U) of the whole W
    trade = xp.block_trade(w0, {"inside": inside, "random": torch.randn(48, 16, dtype=torch.float64)}, 2)
    assert list(trade.index) == [1, 2, 4, 8, 16]
    assert trade.loc[4, "FuRA trainable"] == 4 * 4 * (4 + 1)            # n k (b + 1), k = b
    assert (trade["LoRA trainable"] == 2 * (16 + 48)).all()
    assert trade.loc[1, "outside, inside"] < 1e-12                    # n = 1: the SVD's span
    assert trade["outside, random"].is_monotonic_increasing           # smaller blocks, less room
    U4 = fura.block_svd(w0, 4)[0]
    p = xp.project_blocks(inside, U4)
    assert torch.allclose(xp.project_blocks(p, U4), p)                # a projection
    assert fura.outside_span(p, U4) < 1e-12


def test_inside_spectra_per_block_count():
    torch.manual_seed(2)
    w0 = torch.randn(48, 16, dtype=torch.float64)
    delta = xp.project_blocks(torch.randn(48, 16, dtype=torch.float64), fura.block_svd(w0, 1)[0])
    sp = xp.inside_spectra(w0, delta.float())                        # cast to w0's dtype
    assert set(sp) == {"dW", 1, 2, 4, 8, 16} and len(sp[4]) == 16
    assert abs(sp[1] - sp["dW"]).max() < 1e-5                       # n = 1: all of it inside span(U)
    assert all(sp[n].sum() <= sp["dW"].sum() + 1e-6 for n in (2, 4, 8, 16))   # a projection shrinks it


class TinyAttn(nn.Module):
    """A q_proj and an o_proj of width 16 with 2 heads in ``config`` (o_proj cut by head)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=2)
        self.emb = nn.Embedding(10, 16)
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.o_proj = nn.Linear(16, 16, bias=False)

    def forward(self, i):
        return self.o_proj(self.q_proj(self.emb(i)))


def test_prepare_by_head_cuts_only_o_proj_and_update_reads_it_back():
    torch.manual_seed(0)
    m0 = TinyAttn()
    W0 = xp.pretrained_weights(m0)
    for by_head, o_blocks in ((True, 2), (False, 4)):
        m = xp.prepare(copy.deepcopy(m0), "fura", by_head=by_head)
        assert (m.q_proj.n, m.o_proj.n) == (4, o_blocks)
        assert xp.reconstruction(m, W0, rank=2).rel_error.max() < 1e-5
        d = xp.update(m0, m, "fura", list(W0), by_head=by_head)     # the same blocks: no rounding
        assert max(float(v.abs().max()) for v in d.values()) == 0.0
    q = xp.prepare(copy.deepcopy(m0), "qfura", by_head=True, group_size=16)
    assert q.o_proj.n == 2
    assert set(xp.qfura_init_error(m0, W0, 4, 16, by_head=True)) == set(W0)


def _data(val=True):
    ex = lambda p: SimpleNamespace(prompt=p)                        # noqa: E731
    return xp.TaskData("rotate", [], [[1, 2]], [ex("t1"), ex("t2")], {"add": [ex("r1")]},
                       [ex("v1")] if val else [])


def test_lr_sweep_selects_on_validation_never_on_the_test(monkeypatch, tmp_path):
    """Each method at the rate with the best ``val_target``; the test target disagrees on
    purpose, and every fine-tune's settings carry the rate and ``by_head``."""
    seen = []
    val = {("lora", 1e-3): 0.2, ("lora", 1e-2): 0.6, ("fura", 1e-3): 0.5, ("fura", 1e-2): 0.1}

    def fake(base, zscale, method, pairs, settings, evaluator, every, device):
        seen.append(settings)
        v = val[method, settings["lr"]]
        return None, {"trajectory": [{"step": 4, "val_target": v, "target": 1 - v}],
                      "train_seconds": 0.0}

    monkeypatch.setattr(xp, "cached_finetune", fake)
    monkeypatch.setattr(xp.cache, "folder", lambda *parts: tmp_path)
    monkeypatch.setattr(xp.zoo, "key", lambda base, scale: "k")
    S = {"steps": 4, "batch": 2, "rank": 2, "lora_scale": 2.0, "bits": 4, "group_size": 16,
         "every": 2, "by_head": True}
    kw = dict(seed=0, evaluator=None, pad_id=0, device="cpu")
    sw = xp.lr_sweep("lm", "smoke", _data(), S, **kw, grid=[1e-2, 1e-3], methods=["lora", "fura"])
    assert xp.best_lrs(sw) == {"lora": 1e-2, "fura": 1e-3}
    assert {s["lr"] for s in seen} == {1e-3, 1e-2} and all(s["by_head"] for s in seen)
    assert all(s["eval"]["val"] == ["v1"] for s in seen)
    n = len(seen)
    xp.lr_sweep("lm", "smoke", _data(), S, **kw, grid=[1e-2, 1e-3], methods=["lora", "fura"])
    assert len(seen) == n                                            # every run from the cache
    with pytest.raises(ValueError, match="validation"):
        xp.lr_sweep("lm", "smoke", _data(val=False), S, **kw, grid=[1e-3], methods=["lora"])


def test_paired_target_scores_the_same_test_items(monkeypatch):
    scores = {"a": np.array([1.0, 1, 1, 1, 0, 1, 1, 1]), "b": np.array([0.0, 0, 1, 0, 0, 0, 1, 0])}
    seen = []

    def item_scores(model, tok, ex, ws):
        seen.append([e.prompt for e in ex])
        return scores[model]

    monkeypatch.setattr(xp.evaluate, "item_scores", item_scores)
    test = [SimpleNamespace(prompt=f"x{i}") for i in range(8)]
    data = xp.TaskData(**{**_data().__dict__, "test": test})
    out = xp.paired_target(xp.target_scores({"a": "a", "b": "b"}, None, data, False), "a", ["b"])
    assert out["b"]["diff"] == pytest.approx(0.625)
    assert out["b"]["low"] > 0 and out["b"]["high"] <= 1
    assert seen == [[e.prompt for e in test]] * 2                 # the test set, not target_eval
    xp.target_scores({"a": "a"}, None, _data(), False)
    assert seen[-1] == ["t1", "t2"]                               # no test set: the checkpoints'


def test_task_data_draws_a_test_set_outside_the_cache_key(monkeypatch):
    monkeypatch.setattr(xp.packing, "encode", lambda tok, prompts, completions: [])
    sizes = dict(n_train=32, n_eval=8, n_retain=4, retain_families=["add"], seed=0, with_steps=False)
    a = xp.task_data(None, "rotate", **sizes, n_val=8)
    b = xp.task_data(None, "rotate", **sizes, n_val=8, n_test=200)
    assert a.eval_names() == b.eval_names() and a.test == []          # cache keys unchanged
    p = lambda ex: {e.prompt for e in ex}                              # noqa: E731
    assert len(b.test) == 200 and not p(b.test) & (p(b.train) | p(b.val_eval))


def test_task_data_eval_names_carry_the_validation_split_only_when_drawn():
    assert "val" not in _data(val=False).eval_names()                 # old cache keys unchanged
    assert _data().eval_names()["val"] == ["v1"]


class _Logits(nn.Module):
    """Next-token logits: uniform over ``vocab``, or (``oracle``) peaked on a fixed next token."""

    def __init__(self, vocab: int, oracle: dict | None = None):
        super().__init__()
        self.vocab, self.oracle = vocab, oracle or {}
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab) + self.w
        for (row, pos), tok in self.oracle.items():
            logits[row, pos, tok] = 50.0
        return SimpleNamespace(logits=logits)


def test_retention_nll_reads_the_completion_tokens_of_each_retain_prompt(monkeypatch):
    # two retain prompts of different lengths: labels on the completion and <eos> only, the
    # shorter row right-padded (pad id 0), which must not count
    pairs = [([1, 5, 6, 7, 2], [-100, -100, 6, 7, 2]), ([1, 8, 9, 2], [-100, -100, -100, 2])]
    monkeypatch.setattr(xp.packing, "encode", lambda tok, prompts, completions: pairs)
    ex = [SimpleNamespace(prompt=p, completion=lambda ws: " c") for p in ("a", "b")]
    data = xp.TaskData(**{**_data().__dict__, "retain_eval": {"add": ex[:1], "count": ex[1:]}})
    tok = SimpleNamespace(pad_token_id=0)
    uniform = xp.retention_nll(_Logits(10), tok, data, False)
    assert uniform == pytest.approx([np.log(10)] * 2)              # every labelled token: log V
    # an oracle on prompt 1's three labelled tokens (predicted at positions 1, 2, 3) and on
    # prompt 2's <eos> (position 2): loss 0 there
    oracle = _Logits(10, {(0, 1): 6, (0, 2): 7, (0, 3): 2, (1, 2): 2})
    assert xp.retention_nll(oracle, tok, data, False) == pytest.approx([0.0, 0.0], abs=1e-6)
    # half right on prompt 1: the per-token mean, not the sum
    half = _Logits(10, {(0, 1): 6})
    assert xp.retention_nll(half, tok, data, False)[0] == pytest.approx(2 / 3 * np.log(10), abs=1e-4)
    # batches of one (no padding) give the same per-prompt losses
    assert xp.retention_nll(half, tok, data, False, batch=1) == pytest.approx(
        xp.retention_nll(half, tok, data, False), abs=1e-6)
