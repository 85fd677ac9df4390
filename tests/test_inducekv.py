"""InduceKV: KV-injection equivalence (C1), byte accounting, the budget, calibrated retrieval,
PyCIL metrics, and the baselines' byte counts, on tiny random Llama models."""
import numpy as np
import pytest
import torch

from workbench.data import tasks
from workbench.methods import inducekv as K
from workbench.methods import inducekv_baselines as KB
from tiny_models import CharTok, tiny_llama


Tok = CharTok


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(n_layers=3)


def _ids(tok, e):
    return [tok.bos_token_id] + tok([e.prompt + e.completion()])["input_ids"][0]


@pytest.mark.parametrize("family", ["sort", "sub", "kv"])
def test_cached_entry_equals_running_the_prefix_text(tiny, family):
    """C1: logits (and every layer's hidden states) of a query after the entry's payload equal
    those of the concatenated text, to float tolerance, for several prefixes."""
    model, tok = tiny
    exs = tasks.generate(family, 4, seed=3, difficulty=tasks.get(family).difficulties[1])
    for pre, q in zip(exs[:3], exs[1:]):
        e = K.make_entry(model, tok, pre)
        qi = _ids(tok, q)
        with torch.no_grad():
            full = model(input_ids=torch.tensor([e.ids + qi]), output_hidden_states=True)
            cached = K.forward_with_entries(model, [e], torch.tensor([qi]),
                                            output_hidden_states=True)
        # the two paths sum attention in another order (other matmul shapes): float32 rounding
        # then differs by about 1e-6 of the largest activation (1.1-1.3e-6 measured under torch's
        # AVX-512, AVX2 and portable kernels and MKL's reproducible path), so an element near zero
        # may differ by more than any fixed atol; 1e-5 of the largest is rounding on every CPU,
        # and wrong positions (the test below) move logits by more than 1e-3
        pairs = [*zip(full.hidden_states, cached.hidden_states), (full.logits, cached.logits)]
        for hf, hc in pairs:
            scale = float(hf.abs().max())
            torch.testing.assert_close(hc[0], hf[0, e.length:], rtol=1e-5, atol=1e-5 * scale)


def test_wrong_positions_break_the_equivalence(tiny):
    """The test above can fail: a continuation at positions 0.. (not after the prefix) differs."""
    model, tok = tiny
    pre, q = tasks.generate("sort", 2, seed=1, difficulty=5)
    e = K.make_entry(model, tok, pre)
    qi = torch.tensor([_ids(tok, q)])
    cache, P = K.build_cache(model, [e])
    with torch.no_grad():
        full = model(input_ids=torch.tensor([e.ids + qi[0].tolist()])).logits[0, e.length:]
        wrong = model(input_ids=qi, position_ids=torch.arange(qi.shape[1])[None], cache=cache)
    assert (full - wrong.logits[0]).abs().max() > 1e-3


def test_shifted_keys_equal_keys_computed_at_shifted_positions(tiny):
    model, tok = tiny
    a, b = tasks.generate("reverse", 2, seed=2, difficulty=4)
    ea, eb = K.make_entry(model, tok, a), K.make_entry(model, tok, b)
    pos = torch.arange(ea.length, ea.length + eb.length)[None]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([eb.ids]), position_ids=pos, use_cache=True)
    for layer in range(len(eb.keys)):
        assert torch.allclose(out.cache.layers[layer].keys[0],
                              K.shift_keys(model, eb.keys[layer], ea.length), atol=1e-5)
        # values of deeper layers move only by rounding: RoPE attention is shift-invariant
        assert torch.allclose(out.cache.layers[layer].values[0], eb.values[layer], atol=1e-4)
    cache, P = K.build_cache(model, [ea, eb], batch=3)
    assert P == ea.length + eb.length and cache.get_seq_length() == P
    assert cache.layers[0].keys.shape[0] == 3


def test_two_entries_equal_per_example_attention_over_their_text(tiny):
    """Entries end to end = the concatenated prefixes where each attends only to itself and the
    query to all (a 4-D mask), at continuous positions."""
    model, tok = tiny
    a, b, q = tasks.generate("sort", 3, seed=5, difficulty=4)
    ea, eb = K.make_entry(model, tok, a), K.make_entry(model, tok, b)
    qi = _ids(tok, q)
    n = ea.length + eb.length + len(qi)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    allowed[ea.length: ea.length + eb.length, : ea.length] = False   # b does not see a
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ea.ids + eb.ids + qi]), attention_mask=mask,
                     position_ids=torch.arange(n)[None]).logits[0, -len(qi):]
        cached = K.forward_with_entries(model, [ea, eb], torch.tensor([qi])).logits[0]
    assert torch.allclose(full, cached, atol=1e-4, rtol=1e-4)


def test_entry_byte_accounting(tiny):
    model, tok = tiny
    (ex,) = tasks.generate("count", 1, seed=0, difficulty=4)
    e = K.make_entry(model, tok, ex)
    cfg = model.config
    L, hd = e.length, cfg.hidden_size // cfg.num_attention_heads
    payload = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * L * hd * 4
    assert e.nbytes == payload + cfg.hidden_size * 4 + K.TOKEN_BYTES * L
    assert e.ids[0] == tok.bos_token_id and e.ids[-1] == tok.eos_token_id
    assert e.n_prompt == 1 + len(ex.prompt)


def test_budget_raises_and_traces():
    b = K.Budget(100)
    b.check(40, "a")
    b.check(100, "b")
    with pytest.raises(K.BudgetExceeded):
        b.check(101, "c")
    assert b.peak == 101 and [w for w, _ in b.trace] == ["a", "b", "c"]


def _fake_entries(n, nbytes_each, task="t", d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = nbytes_each[i] if isinstance(nbytes_each, list) else nbytes_each
        kv = (torch.zeros(1, L, 1),)
        out.append(K.Entry(task, torch.randn(d, generator=g), kv, kv, [1] * L, 1))
    return out


@pytest.mark.parametrize("mode", ["bilevel", "likelihood", "random"])
def test_selection_never_exceeds_its_room(mode):
    rs = np.random.default_rng(0)
    for trial in range(20):
        sizes = rs.integers(1, 30, 12).tolist()
        cands = _fake_entries(12, sizes, seed=trial)
        room = int(rs.integers(0, 2000))
        scores = {"likelihood": rs.normal(size=12), "retention": rs.normal(size=12),
                  "coverage_sim": rs.uniform(size=(20, 12))}
        chosen = K.select(cands, room, scores, mode=mode, rng=rs)
        assert len(set(chosen)) == len(chosen)
        assert sum(cands[i].nbytes for i in chosen) <= room
        # greedy fills: nothing left out would still fit
        left = [i for i in range(12) if i not in chosen]
        used = sum(cands[i].nbytes for i in chosen)
        assert all(used + cands[i].nbytes > room for i in left)


def test_memory_add_and_evict_respect_the_budget():
    es = _fake_entries(6, 10, task="a") + _fake_entries(3, 10, task="b", seed=1)
    for i, e in enumerate(es):
        e.utility = float(i)
    m = K.Memory(K.Budget(5 * es[0].nbytes))
    for e in es[:5]:
        m.add(e)
    with pytest.raises(K.BudgetExceeded):
        m.add(es[5])
    m.evict_to(3 * es[0].nbytes)
    assert m.nbytes <= 3 * es[0].nbytes
    assert [e.utility for e in m.entries] == [2.0, 3.0, 4.0]     # lowest utility went first
    assert m.budget.peak <= m.budget.limit


def test_retrieval_returns_the_nearest_key_after_calibration():
    """A shared nuisance dimension of large spread makes raw cosine retrieve by the nuisance;
    the fitted calibration retrieves by the task dimension, and retrieve() returns the
    calibrated argmax."""
    g = torch.Generator().manual_seed(0)
    n = 40
    task = torch.arange(n) % 2
    keys = torch.zeros(n, 7)
    keys[:, 0] = 10.0                                     # common offset
    keys[:, 1:4] = torch.randn(n, 3, generator=g) * 5.0   # nuisance
    keys[:, 4] = (2 * task - 1).float() * 0.5 + 0.05 * torch.randn(n, generator=g)
    keys[:, 5:] = 0.05 * torch.randn(n, 2, generator=g)
    names = ["x" if t else "y" for t in task.tolist()]
    es = [K.Entry(nm, k, (), (), [1], 1) for nm, k in zip(names, keys)]
    cal = K.fit_calibration(keys, names, steps=100)

    def loo_hit(calib):
        s = K.similarity(keys, keys, calib).fill_diagonal_(-9)
        return float((task[s.argmax(1)] == task).float().mean())
    assert loo_hit(cal) == 1.0 and loo_hit(None) < 0.7
    q = keys[:5] + 0.01
    got = K.retrieve(es, q, k=1, calib=cal)
    want = K.similarity(q, keys, cal).argmax(1)
    assert [g_[0] is es[j] for g_, j in zip(got, want.tolist())] == [True] * 5
    assert cal.nbytes == 2 * 7 * 4


def test_pycil_metrics_on_a_hand_matrix():
    acc = np.array([[0.9, np.nan, np.nan],
                    [0.6, 0.8, np.nan],
                    [0.3, 0.7, 1.0]])
    assert np.allclose(K.stage_accuracy(acc), [0.9, 0.7, 2.0 / 3])
    assert K.average_accuracy(acc) == pytest.approx((0.9 + 0.7 + 2.0 / 3) / 3)
    assert K.last_accuracy(acc) == pytest.approx(2.0 / 3)
    assert K.forgetting(acc) == pytest.approx(((0.9 - 0.3) + (0.8 - 0.7)) / 2)
    assert K.forgetting(acc[:1, :1]) == 0.0


def test_state_hash_sees_a_one_bit_change(tiny):
    model, _ = tiny
    h = K.state_hash(model)
    p = next(model.parameters())
    with torch.no_grad():
        old = p.view(-1)[0].clone()
        p.view(-1)[0] = torch.nextafter(old, old + 1)
        assert K.state_hash(model) != h
        p.view(-1)[0] = old
    assert K.state_hash(model) == h


def test_answer_scores_exact_matches_greedy_generation(tiny):
    """Teacher-forced exact match is 1 iff greedy decoding writes the completion then <eos>."""
    model, tok = tiny
    exs = tasks.generate("sort", 6, seed=0, difficulty=3)
    logp, exact = K.answer_scores(model, tok, exs)
    for e, x in zip(exs, exact):
        ids = torch.tensor([[tok.bos_token_id] + tok([e.prompt])["input_ids"][0]])
        target = tok([e.completion()])["input_ids"][0] + [tok.eos_token_id]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=len(target), do_sample=False,
                                 pad_token_id=0, eos_token_id=2)
        assert float(out[0, ids.shape[1]:].tolist() == target) == x
    assert (logp < 0).all()


def test_run_stream_keeps_the_budget_at_every_point(tiny):
    model, tok = tiny
    stream = ["sort", "sub"]
    prepared, tests = [], {}
    for f in stream:
        exs = tasks.generate(f, 14, seed=1, difficulty=tasks.get(f).difficulties[0])
        prepared.append(K.prepare(model, tok, f, exs[:6], exs[6:9]))
        tests[f] = exs[9:]
    budget = 3 * prepared[0].cands[0].nbytes
    h = K.state_hash(model)
    for mode in ("bilevel", "random", "likelihood"):
        out = K.run_stream(model, tok, prepared, tests, budget, mode=mode, calib_steps=5,
                           also_raw=True)
        assert out["peak_bytes"] <= budget and len(out["trace"]) > 3
        assert out["memory"].nbytes <= budget
        assert np.isnan(out["acc"][0, 1]) and not np.isnan(out["acc"][1]).any()
        assert set(out["entries_per_task"]) == set(stream)
    assert K.state_hash(model) == h


def test_lora_and_prompt_pool_bytes(tiny):
    from peft import LoraConfig, get_peft_model
    import copy
    model, _ = tiny
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, lora_alpha=4,
                                                         target_modules=["q_proj", "v_proj"]))
    d, layers = model.config.hidden_size, model.config.num_hidden_layers
    assert KB.lora_bytes(pm) == layers * 2 * (2 * d + d * 2) * 4
    pool = KB.PromptPool(5, 3, d, 2, 0.02)
    assert pool.nbytes == (5 * 3 * d + 5 * d) * 4
    q = torch.randn(4, d)
    assert pool.select(q).shape == (4, 2)


def test_moe_router_picks_the_nearest_centroid():
    keys = {"a": torch.tensor([[1.0, 0.0], [1.2, 0.1]]), "b": torch.tensor([[0.0, 1.0]])}
    names, c = KB.centroids(keys)
    assert names == ["a", "b"]
    assert KB.route(torch.tensor([[2.0, 0.1], [0.1, 3.0]]), c).tolist() == [0, 1]


def test_lora_training_leaves_the_backbone_weights_unchanged(tiny):
    """The PEFT baselines train only LoRA factors: the base weights inside the PeftModel hash
    the same before and after (what C2 checks for every method)."""
    import copy
    model, tok = tiny
    base = copy.deepcopy(model)
    pm = KB.fresh_lora(base, seed=0, rank=2)
    exs = tasks.generate("sort", 16, seed=0, difficulty=3)
    from workbench.data import packing
    pairs = packing.encode(tok, [e.prompt for e in exs], [e.completion() for e in exs])
    before = {k: v.clone() for k, v in KB.lora_state(pm).items()}
    KB.train_steps(pm, pairs, steps=3, batch=4, lr=1e-2, seed=0)
    after = KB.lora_state(pm)
    assert any(not torch.equal(before[k], after[k]) for k in before)      # LoRA moved
    base_w = {n: p for n, p in pm.get_base_model().named_parameters() if "lora_" not in n}
    orig = dict(model.named_parameters())
    for n, p in base_w.items():
        key = n.replace(".base_layer", "")
        assert torch.equal(p, orig[key]), n


class DocTok(CharTok):
    """CharTok with the context separator, so examples can be laid out as one document."""
    def __init__(self):
        super().__init__()
        self.vocab[tasks.CONTEXT_SEP] = len(self.vocab) + 3


def test_document_entry_and_its_query_read_as_one_training_document():
    """A document entry is ``<bos> prompt completion SEP`` and a query scored after it continues
    that document: its answer log-likelihood and exact match equal those of the whole text
    ``<bos> demo SEP query answer <eos>`` run at once (how the zoo's documents are laid out)."""
    model, _ = tiny_llama(n_layers=2)
    tok = DocTok()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    pre, *qs = tasks.generate("sort", 4, seed=5, difficulty=4)
    e = K.make_entry(model, tok, pre, document=True)
    plain = K.make_entry(model, tok, pre)
    sep = tok.vocab[tasks.CONTEXT_SEP]
    assert e.document and e.ids == plain.ids[:-1] + [sep] and e.n_prompt == plain.n_prompt
    assert e.nbytes == plain.nbytes                      # one token for one token
    lp, ex = K.answer_scores(model, tok, qs, [e])
    for q, l, x in zip(qs, lp, ex):
        p, c = tok(q.prompt)["input_ids"], tok(q.completion())["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([e.ids + p + c])
        labels = torch.tensor([[-100] * (e.length + len(p)) + c])
        with torch.no_grad():
            ref_lp, ref_ex = K.score_logits(model(input_ids=ids).logits, labels)
        assert abs(ref_lp[0] - l) < 1e-4 and ref_ex[0] == x
    # after an <eos> entry the query starts a document of its own (<bos>): another text
    lp_plain, _ = K.answer_scores(model, tok, qs, [plain])
    assert not np.allclose(lp_plain, lp)
