"""Tests of paper 19 (NBDIFF): masks as a function of block size, one pass = two passes."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workbench.methods import nbdiff as nd


def tiny(vocab=40):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("n", [1, 5, 16])
def test_block_size_one_is_causal(n):
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert torch.equal(nd.block_mask(nd.block_ids(n, 1)), causal)
    assert torch.equal(nd.block_mask(nd.block_ids(n, 1, start=3)), causal)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_larger_blocks_add_only_intra_block_links(size):
    n = 17
    ids = nd.block_ids(n, size, start=2)
    m, causal = nd.block_mask(ids), torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert (m | causal).equal(m)                          # every causal link kept
    extra = m & ~causal
    i, j = extra.nonzero().T
    assert len(i) > 0 and torch.all(ids[i] == ids[j])    # added links stay inside a block
    blk = ids[ids >= 0]
    assert torch.bincount(blk).max() == size


def test_parallel_mask_parts():
    ids = nd.block_ids(8, 4)
    m = nd.parallel_mask(ids, context_causal=True)
    assert not m[8:, :8].any()                           # clean copy never sees noise
    assert torch.equal(m[8:, 8:], torch.tril(torch.ones(8, 8, dtype=torch.bool)))
    assert torch.equal(m[:4, :4], torch.ones(4, 4, dtype=torch.bool)) and not m[:4, 8:].any()
    assert m[4:8, 8:12].all() and not m[4:8, 12:].any()  # offset block-causal
    assert torch.equal(nd.parallel_mask(ids, False)[8:, 8:], nd.block_mask(ids))


def test_4d_mask_reaches_llama():
    model, x = tiny(), torch.randint(3, 40, (2, 12))
    with torch.no_grad():
        ref = model(input_ids=x).logits
        causal = model(input_ids=x, attention_mask=nd.additive(nd.block_mask(nd.block_ids(12, 1)))
                       .expand(2, -1, -1, -1)).logits
        blk = model(input_ids=x, attention_mask=nd.additive(nd.block_mask(nd.block_ids(12, 4)))
                    .expand(2, -1, -1, -1)).logits
    assert torch.allclose(ref, causal, atol=1e-5)
    # the first block is bidirectional: the model on its 4 tokens with a full mask
    full = torch.ones(1, 1, 4, 4)
    with torch.no_grad():
        first = model(input_ids=x[:, :4], attention_mask=nd.additive(full.bool()[0, 0]).expand(2, -1, -1, -1)).logits
        y = x.clone()
        y[:, 8:] = (y[:, 8:] + 1) % 40
        blk_y = model(input_ids=y, attention_mask=nd.additive(nd.block_mask(nd.block_ids(12, 4)))
                      .expand(2, -1, -1, -1)).logits
    assert torch.allclose(blk[:, :4], first, atol=1e-5)
    assert (ref[:, 0] - blk[:, 0]).abs().max() > 1e-3          # position 0 now sees its block
    assert torch.allclose(blk[:, :8], blk_y[:, :8], atol=1e-5)  # later blocks stay invisible
    assert (blk[:, 8] - blk_y[:, 8]).abs().max() > 1e-3


@pytest.mark.parametrize("context_causal", [True, False])
def test_one_pass_equals_two_pass(context_causal):
    model, g = tiny(), torch.Generator().manual_seed(1)
    B, n = 3, 14
    x0 = torch.randint(3, 39, (B, n), generator=g)
    ids = torch.stack([nd.block_ids(n, 4, start=s) for s in (1, 3, 5)])
    noisable = ids >= 0
    xt, masked, p = nd.noise(x0, ids, noisable, 39, g)
    pos = torch.arange(n).expand(B, n)
    with torch.no_grad():
        a, ca = nd.one_pass(model, x0, xt, ids, pos, context_causal)
        b, cb = nd.two_pass(model, x0, xt, ids, pos, context_causal)
    assert masked.any()
    la, lb = nd.diffusion_loss(a, x0, masked, p, noisable), nd.diffusion_loss(b, x0, masked, p, noisable)
    assert abs(float(la - lb)) < 1e-4 and float(la) > 0
    assert torch.allclose(a[:, 1:], b[:, 1:], atol=1e-4)
    assert torch.allclose(nd.ar_loss(ca, x0, noisable), nd.ar_loss(cb, x0, noisable), atol=1e-5)


def test_block_size_one_prediction_is_the_ar_model():
    model, x0 = tiny(), torch.randint(3, 39, (2, 10))
    ids = nd.block_ids(10, 1)
    xt = torch.full_like(x0, 39)
    with torch.no_grad():
        pred, _ = nd.one_pass(model, x0, xt, ids, torch.arange(10).expand(2, 10))
        ar = model(input_ids=x0).logits
    assert torch.allclose(pred[:, 1:], ar[:, :-1], atol=1e-5)


def test_curriculum_monotone_and_complete():
    sizes = [nd.curriculum(s, 100) for s in range(120)]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 8
    assert set(sizes) == {1, 2, 4, 8}
    fr = [nd.anneal_fraction(s, 100) for s in range(100)]
    assert fr == sorted(fr) and fr[0] == 0 and fr[-1] == 1


def test_noise_rate_follows_t():
    g = torch.Generator().manual_seed(0)
    x0 = torch.zeros(2000, 8, dtype=torch.long)
    ids = nd.block_ids(8, 8)
    xt, masked, p = nd.noise(x0, ids, torch.ones_like(x0, dtype=torch.bool), 5, g)
    assert torch.all(p[:, :1] == p)                     # one t per block
    assert abs(float(masked.float().mean()) - 0.5) < 0.02 and torch.all(xt[masked] == 5)


# -- the reference decoder (YuchuanTian/NBDiff generation_utils.py, diffusion_generate) ---------

def test_threshold_commit_top_token_plus_every_one_above_threshold():
    conf = torch.tensor([[0.50, 0.95, 0.30, 0.91], [0.20, 0.40, 0.99, 0.10], [0.3, 0.6, 0.2, 0.5]])
    still = torch.tensor([[True, True, True, True], [True, True, False, True],
                          [True, False, True, True]])
    got = nd.threshold_commit(conf, still, 0.9)
    want = torch.tensor([[False, True, False, True],     # both above 0.9 (the top among them)
                         [False, True, False, False],    # 0.99 is committed already: top = 0.40
                         [False, False, False, True]])   # none above: the top masked one only
    assert torch.equal(got, want)
    assert torch.equal(nd.threshold_commit(conf, still, 0.0), still)   # threshold 0: all at once


def _prompts():
    return [[1, 5, 7, 9, 3], [1, 4, 8], [1, 6, 6, 2, 11, 12]]     # ragged: left-padded


@pytest.mark.parametrize("size", [1, 3, 4])
def test_decode_with_cache_equals_without(size):
    m = tiny()
    a, pa = nd.decode_threshold(m, _prompts(), 10, size, mask_id=39, threshold=0.05, use_cache=True)
    b, pb = nd.decode_threshold(m, _prompts(), 10, size, mask_id=39, threshold=0.05, use_cache=False)
    assert torch.equal(a, b) and pa == pb
    assert not (a == 39).any()


def test_block_first_token_is_the_causal_prediction():
    m = tiny()
    prompts, size, L = _prompts(), 4, 6
    out, _ = nd.decode_threshold(m, prompts, 12, size, mask_id=39, threshold=0.5)
    for b, p in enumerate(prompts):
        seq = torch.tensor([p + out[b].tolist()])
        with torch.no_grad():
            logits = m(input_ids=seq).logits[0]                  # plain causal forward
        for s in range(0, 12, size):                             # each block's first token
            top = logits[len(p) + s - 1].argmax()                # over the whole vocabulary
            assert top == 39 or out[b, s] == top                 # a mask first token is denoised


def test_block_size_one_decoding_is_greedy_ar():
    m = tiny()
    seq = [1, 5, 7]
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(m(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    mask_id = next(t for t in range(39, 0, -1) if t not in seq)    # one greedy never picks
    out, passes = nd.decode_threshold(m, [[1, 5, 7]], 6, 1, mask_id=mask_id)
    assert out[0].tolist() == seq[3:] and passes == 6


class _Fixed(torch.nn.Module):
    """A stand-in LM: every output is one fixed distribution ``probs`` over the vocabulary."""

    def __init__(self, probs):
        super().__init__()
        self.logits = torch.tensor(probs).log()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kw):
        from types import SimpleNamespace
        return SimpleNamespace(logits=self.logits.expand(*input_ids.shape, -1).clone())


def test_threshold_decoder_confidence_is_the_whole_vocabulary_softmax():
    """The reference's confidence is the top probability of the softmax over the whole vocabulary,
    the mask token included, never renormalised without it: YuchuanTian/NBDiff
    ``generation_utils.py``, ``sample_tokens`` L58-90 (L66 ``probs = torch.softmax(logits)``, L75
    ``confidence, x0 = probs.max(dim=-1)``) as ``diffusion_generate`` calls it, L278-284 (masked
    positions only, L280; the most confident one, L281, plus every one above the threshold,
    L282-283). Here token 4 has 0.85 and the mask token (5) 0.10: 0.85 < 0.9, so each pass
    commits one token (renormalised without the mask, 0.85 / 0.90 > 0.9 would commit the block at
    once)."""
    m = _Fixed([0.02, 0.01, 0.01, 0.01, 0.85, 0.10])
    out, passes = nd.decode_threshold(m, [[1, 2]], 4, 4, mask_id=5, threshold=0.9)
    assert out.tolist() == [[4, 4, 4, 4]] and passes == 1 + 3       # prefill, one pass a token
    conf, tok = nd._greedy(m.logits)
    assert tok == 4 and conf == pytest.approx(0.85)
    out, passes = nd.decode_threshold(m, [[1, 2]], 4, 4, mask_id=5, threshold=0.8)
    assert out.tolist() == [[4, 4, 4, 4]] and passes == 1 + 1       # above 0.8: all at once


def test_threshold_decoder_mask_token_stays_masked_and_never_stalls():
    """Where the greedy token is the mask token itself the reference writes it back (L284), so
    the position stays masked; a row with nothing else to commit would repeat the same pass for
    ever there, so it commits the top other token at its most confident position."""
    m = _Fixed([0.05, 0.05, 0.05, 0.05, 0.30, 0.50])
    out, passes = nd.decode_threshold(m, [[1, 2]], 4, 2, mask_id=5)
    assert out.tolist() == [[4, 4, 4, 4]]
    assert passes == 1 + 2 + 1 + 2      # prefill, block 1 (its first token masked), store, block 2


def test_nelbo_rows_pool_to_the_bound_on_the_same_noise():
    model, g = tiny(), torch.Generator().manual_seed(2)
    x0, start = torch.randint(3, 39, (5, 12), generator=g), torch.tensor([1, 3, 1, 2, 4])
    tot, cnt = nd.nelbo_rows(model, x0, start, 4, 39, True, draws=2, seed=7, batch=2)
    assert tot.shape == cnt.shape == (5,) and (tot >= 0).all()
    assert torch.equal(cnt, 2.0 * (12 - start).double())           # noisable: after the prompt
    assert nd.nelbo(model, x0, start, 4, 39, True, draws=2, seed=7, batch=2) == \
        pytest.approx(float(tot.sum() / cnt.sum()))
    # by hand: diffusion_loss times its noisable count, summed over the same draws and batches
    g, ref = torch.Generator().manual_seed(7), 0.0
    for _ in range(2):
        for i in range(0, 5, 2):
            xb, sb = x0[i:i + 2], start[i:i + 2]
            ids = torch.stack([nd.block_ids(12, 4, int(s)) for s in sb])
            xt, masked, p = nd.noise(xb, ids, ids >= 0, 39, g)
            with torch.no_grad():
                lg, _ = nd.one_pass(model, xb, xt, ids, torch.arange(12).expand(len(xb), 12))
            ref += float(nd.diffusion_loss(lg, xb, masked, p, ids >= 0)) * int((ids >= 0).sum())
    assert float(tot.sum()) == pytest.approx(ref, rel=1e-5)
