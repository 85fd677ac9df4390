"""Paper 07: ROC decomposition, the routed forward, Gaussian likelihoods and adaptive selection."""
import copy

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal

from tiny_models import tiny_llama_two_loras
from workbench.methods import hilora as hl


def test_rocs_sum_to_the_lora_delta():
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(7, 3, generator=g), torch.randn(3, 5, generator=g)
    parts = hl.rocs(b, a)
    assert parts.shape == (3, 7, 5)
    assert torch.allclose(parts.sum(0), b @ a, atol=1e-6)
    assert all(torch.linalg.matrix_rank(p).item() == 1 for p in parts)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_two_loras()


def test_all_rocs_on_reproduce_each_lora_and_fewer_do_not(tiny):
    base, peft = tiny
    factors = [hl.lora_factors(peft, n) for n in ("t0", "t1")]
    x = torch.randint(0, 40, (3, 6))
    hooks = hl.RocHooks(base, factors)
    try:
        for j, name in enumerate(("t0", "t1")):
            peft.set_adapter(name)
            with torch.no_grad():
                want = peft(input_ids=x).logits
                w, k = hl.whole_gates(np.full(3, j), 2, 4)
                hooks.set_gates(w, k)
                got = base(input_ids=x).logits
                assert torch.allclose(got, want, atol=1e-5)
                hooks.set_gates(w, k // 2)            # half the ROCs: a different function
                assert (base(input_ids=x).logits - want).abs().max() > 1e-3
                # token level: exactly k = 2 ROCs of LoRA j active at every token and module
                assert all(bool((a.sum(-1) == 2).all()) for a in hooks.active.values())
        with torch.no_grad():
            hooks.off()
            plain = base(input_ids=x).logits
        assert hooks.active                            # the last routed pass was recorded
    finally:
        hooks.remove()
    with torch.no_grad():
        assert torch.equal(base(input_ids=x).logits, plain)


def test_gaussian_loglik_matches_scipy():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(60, 4)) + 3 * j for j in range(2)]
    gs = hl.fit_gaussians(xs)
    q = rng.normal(size=(10, 4))
    ll = hl.log_likelihoods(q, gs)
    for j, (mu, cov) in enumerate(gs):
        assert np.allclose(ll[:, j], multivariate_normal(mu, cov).logpdf(q))
    assert np.isfinite(hl.log_likelihoods(q, hl.fit_gaussians([xs[0][:2]]))).all()   # n = 2 < d
    # factored once (fit time), the same likelihoods from a triangular solve per input
    assert np.allclose(hl.log_likelihoods(q, hl.factor_gaussians(gs)), ll)


def test_selection_picks_the_generating_component():
    rng = np.random.default_rng(1)
    d, n = 8, 200
    means = rng.normal(scale=3, size=(3, d))
    train = [rng.normal(size=(n, d)) + m for m in means]
    labels = rng.integers(0, 3, 300)
    test = rng.normal(size=(300, d)) + means[labels]
    post = hl.posterior(hl.log_likelihoods(test, hl.fit_gaussians(train)))
    assert (post.argmax(1) == labels).mean() > 0.95
    mask = hl.select(post, threshold=0.9, k_max=2)
    assert mask[np.arange(300), labels].mean() > 0.95
    assert (mask.sum(1) >= 1).all() and (mask.sum(1) <= 2).all()
    k = hl.allocate(post, mask, budget=6, rank=4)
    assert ((k > 0) == mask).all() and (k <= 4).all()
    assert (k.sum(1) == np.minimum(6, 4 * mask.sum(1))).all()


def test_arrow_prototype_is_the_top_right_singular_vector():
    g = torch.Generator().manual_seed(2)
    b, a = torch.randn(9, 3, generator=g), torch.randn(3, 6, generator=g)
    v = hl._top_right_vector(b, a)
    ref = torch.linalg.svd(b @ a).Vh[0]
    assert torch.allclose(v.abs(), ref.abs(), atol=1e-5)


def _char_tokenizer(chars: str):
    """A character-level tokenizer with <pad>, <bos>, <eos> and <unk>, as the zoo's LMs have."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(chars)))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def test_routed_generation_gives_each_row_its_own_lora():
    """generate_routed (through workbench.evaluate.generate, gates set per generate batch) writes
    for every prompt what peft writes with that prompt's LoRA alone; min_new_tokens is honoured
    and the model's generation defaults are left as they were."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from workbench import evaluate
    tok = _char_tokenizer("abcdefgh")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    base = LlamaForCausalLM(cfg).eval()
    lcfg = dict(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"],
                init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(**lcfg), adapter_name="t0")
    peft.add_adapter("t1", LoraConfig(**lcfg))
    peft.eval()
    prompts = ["abca", "hgfe", "dcba", "beef", "face"]
    choice = np.array([0, 1, 1, 0, 1])
    want = []
    for p, j in zip(prompts, choice):
        peft.set_adapter(f"t{j}")
        want += evaluate.generate(peft, tok, [p], max_new_tokens=6)
    peft.set_adapter("t0")
    assert want != evaluate.generate(peft, tok, prompts, max_new_tokens=6)   # the LoRAs differ
    hooks = hl.RocHooks(base, [hl.lora_factors(peft, n) for n in ("t0", "t1")])
    try:
        w, k = hl.whole_gates(choice, 2, 4)
        assert hl.generate_routed(base, tok, prompts, hooks, w, k, max_new_tokens=6, batch=2) == want
        # an <eos> that always wins (and no other special token): empty completions, unless
        # min_new_tokens forbids it
        bias = torch.zeros(len(tok))
        bias[[tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]] = -100.0
        bias[tok.eos_token_id] = 100.0
        h = base.lm_head.register_forward_hook(lambda m, i, out: out + bias)
        try:
            assert set(hl.generate_routed(base, tok, prompts, hooks, w, k, max_new_tokens=6)) == {""}
            fixed = hl.generate_routed(base, tok, prompts, hooks, w, k, max_new_tokens=6, batch=2,
                                       min_new_tokens=3)
        finally:
            h.remove()
        assert all(c != "" for c in fixed)
        assert base.generation_config.min_new_tokens is None              # restored
    finally:
        hooks.remove()
