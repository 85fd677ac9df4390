"""The harness of notebook 19 (workbench.experiments.nbdiff): the mask table, the problem draw,
the 4D mask through a tiny Llama, and the one-pass vs two-pass comparison."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from workbench.experiments import nbdiff as xp  # noqa: E402


def tiny(vocab=40):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_mask_table_size_one_is_causal_and_larger_sizes_add_intra_block_links():
    t = xp.mask_table(n=12, sizes=(1, 2, 4), starts=(0, 3))
    assert list(t.index) == [(1, 0), (1, 3), (2, 0), (2, 3), (4, 0), (4, 3)]
    assert t.loc[[(1, 0), (1, 3)], "equals_causal"].all()
    assert (t.loc[[(1, 0), (1, 3)], "extra_links"] == 0).all()
    big = t.drop(index=[(1, 0), (1, 3)])
    assert big.keeps_causal.all() and big.extra_inside_blocks.all()
    assert not big.equals_causal.any()
    # 12 positions in blocks of 2 from 0: 6 blocks, one extra link each (the later sees the earlier)
    assert t.loc[(2, 0), "extra_links"] == 6
    assert t.loc[(4, 0), "extra_links"] == 3 * 6         # blocks of 4: 4*3/2 = 6 links, 3 blocks


def test_mask_reaches_model():
    m = tiny()
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    d = xp.mask_reaches_model(m, x, 16)
    assert d["max_diff_causal_4d"] < 1e-5
    assert d["max_diff_block4_4d"] > 1e-3


def test_problems_are_seeded_and_split():
    a_train, a_val, a_test = xp.problems(["reverse", "add"], 8, 4, seed=3, n_val=8)
    b_train, b_val, b_test = xp.problems(["reverse", "add"], 8, 4, seed=3, n_val=8)
    c_train, _, _ = xp.problems(["reverse", "add"], 8, 4, seed=4)
    p = lambda ex: [e.prompt for e in ex]                                   # noqa: E731
    assert p(a_train) == p(b_train) and p(a_val) == p(b_val) and p(a_test) == p(b_test)
    assert p(a_train) != p(c_train)
    assert not set(p(a_train)) & set(p(a_test))                             # the task's own split
    assert len(a_val) == 16 and not set(p(a_val)) & (set(p(a_train)) | set(p(a_test)))
    # the training (and test) problems do not depend on the validation split's size
    d_train, d_val, d_test = xp.problems(["reverse", "add"], 8, 4, seed=3)
    assert p(d_train) == p(a_train) and p(d_test) == p(a_test) and d_val == []


def test_lr_sweep_selects_each_path_on_validation_and_caches(monkeypatch, tmp_path):
    from types import SimpleNamespace
    calls, best = [], {"nbdiff": 1e-3, "anneal": 3e-3, "direct": 3e-4}
    val = [SimpleNamespace(prompt="v")]

    def adapted(base, zs, path, x0, start, S, seed, train, device):
        calls.append((path, S["lr"]))
        return (path, S["lr"]), [1.0] * 30, False

    def accuracy(m, tok, prompts, val, gen_len, size, per_pass, mask_id, cc):
        assert cc == (m[0] == "nbdiff") and per_pass == 1 and len(val) == 1
        return (1.0 if m[1] == best[m[0]] else 0.5), 1

    monkeypatch.setattr(xp, "adapted", adapted)
    monkeypatch.setattr(xp, "accuracy", accuracy)
    monkeypatch.setattr(xp, "prompt_ids", lambda tok, ex: [[1]] * len(ex))
    monkeypatch.setattr(xp.cache, "folder", lambda group: tmp_path)
    S = {"n_corpus": 1, "steps": 2, "batch": 1, "lr": None, "ar_weight": 0.5, "final_block": 4,
         "ctx": 8, "gen_len": 4}
    grid = [3e-3, 3e-4, 1e-3]
    kw = dict(seed=0, train=[], val=val, tok=None, mask_id=9, device="cpu", grid=grid)
    sw = xp.lr_sweep("lm-base", "smoke", None, None, S, **kw)
    assert {p: sw.at_best(p)["lr"] for p in best} == best
    assert len(calls) == 9 and list(sw.table.lr[:3]) == sorted(grid)
    xp.lr_sweep("lm-base", "smoke", None, None, S, **kw)
    assert len(calls) == 9                                                  # all from the cache


def test_c3_intervals_orient_every_row_so_that_nbdiff_wins_above_zero():
    rng = np.random.default_rng(0)
    items = rng.integers(0, 2, 300).astype(float)
    rows = rng.normal(3.0, 0.1, 200)
    scores = {"nbdiff": {"items": np.ones(300), "rows": rows - 0.5},        # right and lower
              "anneal": {"items": items, "rows": rows},
              "direct": {"items": np.ones(300), "rows": rows + 0.0}}
    t = xp.c3_intervals(scores)
    assert list(t.index) == ["accuracy: nbdiff - anneal", "nelbo: anneal - nbdiff",
                             "accuracy: nbdiff - direct", "nelbo: direct - nbdiff"]
    assert t.loc["accuracy: nbdiff - anneal", "low"] > 0
    assert t.loc["nelbo: anneal - nbdiff", "low"] > 0 and t.loc["nelbo: direct - nbdiff", "low"] > 0
    assert t.loc["accuracy: nbdiff - direct", "diff"] == 0                  # a tie is no win
    assert (t.n_items == [300, 200, 300, 200]).all()


@pytest.mark.parametrize("n_rows", [4])
def test_one_vs_two_pass_agree_on_a_tiny_model(n_rows):
    models = {"nbdiff": tiny(41), "direct": tiny(41)}
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, 40, (n_rows, 16), generator=g)
    start = torch.tensor([3, 5, 1, 4])
    t = xp.one_vs_two_pass(models, x0, start, ctx=16, size=4, mask_id=40, seed=0)
    assert list(t.index) == ["context-causal", "block-causal"]
    assert (t.two_pass > 0).all()
    assert (t.abs_diff < 1e-4 * t.two_pass.abs().clip(lower=1)).all()
    # the same seed draws the same noise: the comparison is reproducible
    assert xp.one_vs_two_pass(models, x0, start, ctx=16, size=4, mask_id=40, seed=0).equals(t)


class LetterTok:
    """Letters as tokens, with the interface decode_sample uses (0 pad, 1 bos, 2 eos)."""
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    names = ["<pad>", "<bos>", "<eos>"] + [chr(97 + i) for i in range(26)] + ["\u0120"] * 11

    def __call__(self, text, add_special_tokens=False):
        from types import SimpleNamespace
        return SimpleNamespace(input_ids=[3 + ord(c) - 97 for c in text if c.isalpha()])

    def convert_ids_to_tokens(self, ids):
        return [self.names[i] if i < len(self.names) else "<mask>" for i in ids]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(t for t in self.convert_ids_to_tokens(ids) if not t.startswith("<"))


@pytest.mark.parametrize("size,per_pass", [(1, 1), (4, 1), (4, 4), (3, 3)])
def test_decode_sample_says_which_pass_wrote_each_token(size, per_pass):
    from workbench.data import tasks
    from workbench.methods import nbdiff as nd
    model, tok, gen_len = tiny(41), LetterTok(), 8
    ex = tasks.generate("reverse", 1, 0)[0]
    s = xp.decode_sample(model, tok, ex, gen_len=gen_len, size=size, per_pass=per_pass, mask_id=40)
    out, passes = nd.decode(model, xp.prompt_ids(tok, [ex]), gen_len, size, per_pass, 40, True, 0)
    assert s["output"] == tok.convert_ids_to_tokens(out[0].tolist())      # the recorder is inert
    assert s["passes"] == passes and max(s["written_in_pass"]) == passes
    assert s["prompt"][0] == "<bos>" and s["target"] == ex.target
    blocks = [s["written_in_pass"][b:b + size] for b in range(0, gen_len, size)]
    if per_pass == size:                                  # a whole block in one pass
        assert blocks == [[k + 1] * len(b) for k, b in enumerate(blocks)]
    else:                                                 # one token a pass, block after block
        assert sorted(s["written_in_pass"]) == list(range(1, gen_len + 1))
        assert all(max(a) < min(b) for a, b in zip(blocks, blocks[1:]))


def test_sample_figure_draws_the_block_mask_over_prompt_and_output():
    import matplotlib.pyplot as plt
    sample = {"prompt": ["<bos>", "a", "\u0120->"], "output": ["b", "a", "<eos>", "<pad>"],
              "written_in_pass": [1, 1, 2, 2], "completion": "ba", "target": "b a",
              "correct": False, "passes": 2}
    fig = xp.sample_figure(sample, 2, accuracy=0.25)
    ax, strip = fig.axes
    mask = ax.images[0].get_array()
    assert mask.shape == (7, 7) and mask[3, 4] and not mask[4, 5]    # inside a block / the next
    assert [t.get_text() for t in ax.get_xticklabels()][:3] == ["bos", "a", "_->"]
    assert "2 forward passes" in ax.get_title() and "0.25" in ax.get_title()
    assert "wrong" in strip.get_title()
    plt.close(fig)


def _tok(pad, eos):
    from types import SimpleNamespace
    return SimpleNamespace(pad_token_id=pad, eos_token_id=eos)


def test_block_size_one_reference_decoder_equals_cached_generate():
    from workbench.methods import nbdiff as nd
    m, prompts = tiny(), [[1, 5, 7, 9, 3], [1, 4, 8]]
    free = lambda out: [t for t in range(2, 40) if t not in out.flatten().tolist()]  # noqa: E731
    ar = xp.ar_generate(m, _tok(0, 38), prompts, 8)
    mask_id, eos = free(ar)[:2]                       # ids greedy decoding never picks here
    ar = xp.ar_generate(m, _tok(0, eos), prompts, 8)
    out, passes = nd.decode_threshold(m, prompts, 8, 1, mask_id, pad_id=0)
    assert ar.shape == (2, 8) and torch.equal(out, ar.cpu()) and passes == 8


def test_speed_compare_rows():
    m = tiny()
    t = xp.speed_compare(m, m, _tok(0, 38), [[1, 5, 7], [1, 4]], gen_len=8, size=4, mask_id=39, repeats=3)
    assert list(t.columns) == ["ar_tokens_per_s", "diffusion_tokens_per_s", "ratio"] and len(t) == 3
    assert (t > 0).all().all()
    assert ((t.ratio - t.diffusion_tokens_per_s / t.ar_tokens_per_s).abs() < 1e-9).all()


def test_speed_counts_per_token():
    m = tiny()
    c = xp.speed_counts(m, m, _tok(0, 38), [[1, 5, 7], [1, 4]], gen_len=8, size=4, mask_id=39)
    assert list(c.index) == ["AR generate", "diffusion"]
    assert (c.flops_per_token > 0).all() and (c.bytes_per_token > 0).all()
    # block 4 of the same model: the diffusion decoder re-reads whole blocks, AR one token a step
    assert c.flops_per_token["diffusion"] > c.flops_per_token["AR generate"]


