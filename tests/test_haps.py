"""Paper 11 (HAPS): generated LoRA shapes per architecture, the per-example LoRA equals peft's,
the router's distribution, and the objectives against their formulas on hand-made values."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, \
    Qwen2Config, Qwen2ForCausalLM

from workbench.methods import haps as H

SMALL = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def _models():
    torch.manual_seed(0)
    return {"llama": LlamaForCausalLM(LlamaConfig(**SMALL)).eval(),
            "qwen2": Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval(),
            "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_inner=24, n_layer=2,
                                               n_head=2, n_positions=32)).eval()}


@pytest.fixture(scope="module")
def models():
    return _models()


def _haps(models, rank=3, shared=True):
    shapes = {n: [(i, o) for _, _, i, o in H.target_modules(m)] for n, m in models.items()}
    torch.manual_seed(1)
    h = H.HAPS(list(models), shapes, 20, 8, rank, shared)
    with torch.no_grad():                  # B starts at zero: give it values so the update acts
        for g in h.gens.values():
            for head in g.heads:
                head.bias.normal_(0, 0.2)
    return h


def test_generated_lora_shapes_per_architecture(models):
    h = _haps(models)
    x = torch.rand(5, 20)
    for n, m in models.items():
        mods = H.target_modules(m)
        assert len(mods) == 2 * 2                       # two projections per block, two blocks
        for (_, mod, i, o), (A, B) in zip(mods, h.lora(x, n)):
            assert A.shape == (5, 3, i) and B.shape == (5, o, 3)
            y = mod(torch.rand(1, 4, i))
            assert y.shape[-1] == o                      # in/out read right (Conv1D is (in, out))


def test_b_starts_at_zero_so_the_candidate_starts_as_itself(models):
    shapes = {n: [(i, o) for _, _, i, o in H.target_modules(m)] for n, m in models.items()}
    h = H.HAPS(list(models), shapes, 20, 8, 2)
    for n in models:
        assert all(float(B.detach().abs().max()) == 0.0 for _, B in h.lora(torch.rand(3, 20), n))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_hooked_lora_equals_peft_with_the_same_factors(models, arch):
    m = models[arch]
    h = _haps(models)
    mods = H.target_modules(m)
    ids = torch.randint(0, 40, (1, 7))
    facs = h.lora(torch.rand(1, 20), arch)
    with torch.no_grad():
        own = m(input_ids=ids).logits
        with H.lora_hooks([mod for _, mod, _, _ in mods], facs, 2.0):
            ours = m(input_ids=ids).logits
        ref = H.peft_with(m, [nm for nm, _, _, _ in mods], [(A[0], B[0]) for A, B in facs],
                          2.0)(input_ids=ids).logits
    assert torch.allclose(ours, ref, atol=1e-5)
    assert float((ours - own).abs().max()) > 1e-3
    # the hooks are gone after the block
    assert torch.equal(m(input_ids=ids).logits, own)


def test_per_example_factors_act_per_example(models):
    m, h = models["llama"], _haps(models)
    mods = [mod for _, mod, _, _ in H.target_modules(m)]
    ids = torch.randint(0, 40, (1, 6)).repeat(2, 1)
    facs = h.lora(torch.rand(2, 20), "llama")
    with torch.no_grad(), H.lora_hooks(mods, facs, 2.0):
        both = m(input_ids=ids).logits
    for b in range(2):
        with torch.no_grad(), H.lora_hooks(mods, [(A[b:b + 1], B[b:b + 1]) for A, B in facs], 2.0):
            assert torch.allclose(both[b], m(input_ids=ids[b:b + 1]).logits[0], atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_router_outputs_a_valid_distribution(models, shared):
    h = _haps(models, shared=shared)
    p = h.route(torch.rand(6, 20)).softmax(1)
    assert p.shape == (6, 3) and (p >= 0).all() and torch.allclose(p.sum(1), torch.ones(6))
    assert len(h.trunks) == (1 if shared else 1 + 3)


def test_reward_augmented_loss_equals_its_formula():
    logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    lm = torch.tensor([[1.0, 3.0], [2.0, 4.0]])
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p1 = [0.5, 0.5]
    e2 = torch.tensor(2.0).exp().item()
    p2 = [e2 / (e2 + 1), 1 / (e2 + 1)]
    lam, eta = 0.7, 0.3
    row1 = p1[0] * 1 + p1[1] * 3 - lam * p1[0] * 1 + eta * 2.0
    row2 = p2[0] * 2 + p2[1] * 4 - lam * p2[1] * 1 + eta * 3.0
    got = H.reward_augmented_loss(logits, lm, r, lam, eta)
    assert got.item() == pytest.approx((row1 + row2) / 2, rel=1e-6)
    # the reward carries no gradient; the router is pushed towards low loss minus reward
    logits.requires_grad_(True)
    rr = r.clone().requires_grad_(True)
    H.reward_augmented_loss(logits, lm, rr, lam, eta).backward()
    assert rr.grad is None or float(rr.grad.abs().sum()) == 0.0
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]     # candidate 0: lower loss and rewarded


def test_supervised_loss_equals_its_formula():
    logits = torch.tensor([[1.0, 0.0]])
    lm = torch.tensor([[1.0, 2.0]])
    p = torch.tensor([1.0, 0.0]).exp() / torch.tensor([1.0, 0.0]).exp().sum()
    want = -p[1].log() + (p * lm[0]).sum() + 0.5 * 1.5
    got = H.supervised_loss(logits, lm, torch.tensor([1]), 0.5)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_answer_loss_and_teacher_forced_reward():
    labels = torch.tensor([[-100, -100, 3, 1]])
    logits = torch.full((1, 4, 5), -10.0)
    logits[0, 1, 3] = 10.0                               # predicts label at position 2
    logits[0, 2, 1] = 10.0                               # and at position 3
    loss, hit = H.answer_loss(logits, labels)
    assert hit.item() == 1.0 and loss.item() < 1e-6
    logits[0, 2, 1], logits[0, 2, 2] = -10.0, 10.0
    _, hit = H.answer_loss(logits, labels)
    assert hit.item() == 0.0


def test_static_labels_break_ties_by_loss():
    correct = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    loss = torch.tensor([[2.0, 1.0], [0.5, 3.0], [0.1, 5.0]])
    assert H.static_labels(correct, loss).tolist() == [1, 0, 1]


def test_prompt_features_are_deterministic_and_normalized():
    a = H.prompt_features(["12+34=", "a b c ->"], 64)
    b = H.prompt_features(["12+34=", "a b c ->"], 64)
    assert torch.equal(a, b) and torch.allclose(a.norm(dim=1), torch.ones(2))
    assert not torch.allclose(a[0], a[1])


# -- the reference's structure (zihangtian/HAPS, HotpotQA/joint_rl) ------------------------------

def _char_tokenizer(chars: str):
    """A character-level tokenizer with <pad>, <bos>, <eos> and <unk>, as the zoo's LMs have."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>"] + sorted(set(chars)))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def test_shaped_reward_is_minus_one_where_the_score_is_zero():
    # rl_batch.py L418: reward = -1 if f1 == 0 else f1
    r = H.shaped_reward(torch.tensor([0.0, 1.0, 0.5, 0.0]))
    assert r.tolist() == [-1.0, 1.0, 0.5, -1.0]


def test_reinforce_loss_on_a_hand_made_batch():
    # rl_batch.py L421: loss = -reward * sum(log p); here averaged over the batch
    logp = torch.tensor([-2.0, -1.0], requires_grad=True)
    loss = H.reinforce_loss(logp, H.shaped_reward(torch.tensor([1.0, 0.0])))
    assert loss.item() == pytest.approx(-(1 * -2.0 + -1 * -1.0) / 2)
    loss.backward()
    assert logp.grad.tolist() == [-0.5, 0.5]      # raise the right answer, lower the wrong one


def test_top_p_keeps_the_tokens_under_the_cumulative_mass():
    # agent.py L380-386: sorted cumulative <= top_p kept (the top token always), renormalized
    p = torch.tensor([0.15, 0.5, 0.05, 0.3])
    out = H.top_p_logprobs(p.log(), 1.0, 0.9).exp()
    assert torch.allclose(out, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=1e-6)
    kept = H.top_p_logprobs(p.log(), 1.0, 0.9, keep=torch.tensor(0)).exp()
    assert torch.allclose(kept, torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95, atol=1e-6)
    assert torch.allclose(H.top_p_logprobs(p.log(), 1.0, 0.1).exp(), torch.tensor([0, 1.0, 0, 0]))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pooled_state_is_the_masked_mean_of_the_last_hidden_state(models, arch):
    # lora_generator.py L109-119: hidden_states[-1] * mask, summed over tokens, / token count
    tok, m = _char_tokenizer("abcdefgh"), models[arch]
    prompts = ["abc", "hgfedcba", "d"]
    pooled = H.pooled_state(m, tok, prompts)
    for i, p in enumerate(prompts):
        ids = tok(tok.bos_token + p, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            alone = m(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].mean(0)
        assert torch.allclose(pooled[i], alone, atol=1e-5)       # padding changes nothing


def test_official_targets_are_the_last_blocks_attention_output(models):
    # agent.py L331-356: self_attn.o_proj of layers[total - n:], --layers 1 (rl_batch.py L529)
    assert [n for n, *_ in H.official_targets(models["llama"])] == ["model.layers.1.self_attn.o_proj"]
    assert [n for n, *_ in H.official_targets(models["gpt2"], 2)] == \
        ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]


def test_ref_generator_update_is_alpha_A_B_as_the_reference_patches_it():
    # lora_generator.py L126-127: A (b, D, r), B (b, r, D); agent.py L141: ΔW = α A @ B
    torch.manual_seed(0)
    gen, lin, alpha = H.RefGenerator(6, 5, 4, 3, d_hidden=16), torch.nn.Linear(5, 4), 0.01
    assert all(m.bias.abs().sum() == 0 for m in gen.modules() if isinstance(m, torch.nn.Linear))
    h, x = torch.randn(2, 6), torch.randn(2, 7, 5)
    A_ref, B_ref = gen(h)
    assert A_ref.shape == (2, 4, 3) and B_ref.shape == (2, 3, 5)
    with torch.no_grad(), H.lora_hooks([lin], [gen.factors(h)], alpha):
        hooked = lin(x)
    for b in range(2):       # the reference's merged forward: F.linear(x, W + α A B, bias)
        ref = torch.nn.functional.linear(x[b], lin.weight + alpha * A_ref[b] @ B_ref[b], lin.bias)
        assert torch.allclose(hooked[b], ref, atol=1e-6)


def test_ref_haps_top_starts_as_the_frozen_state_and_is_shared(models):
    torch.manual_seed(0)
    dims = {n: H.official_targets(m)[0][2:] for n, m in models.items()}
    ref = H.RefHAPS(list(models), dims, 12, rank=2)
    h = torch.randn(3, 12)
    assert torch.equal(ref.route(h), ref.router(h))                  # W starts at zero
    assert len(ref.lora(h, "gpt2")) == 1 and ref.lora(h, "gpt2")[0][0].shape == (3, 2, 16)
    with torch.no_grad():
        ref.tops["shared"].bias.fill_(1.0)
    assert torch.equal(ref.top(h, "router"), ref.top(h, "qwen2"))    # one top for every part
    sep = H.RefHAPS(list(models), dims, 12, rank=2, shared=False)
    assert set(sep.tops) == {"router", "llama", "qwen2", "gpt2"}


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_answer_logprob_is_the_sum_of_the_sampled_tokens_log_probs(models, arch):
    # agent.py L393-431: Σ log p(sampled token), p after top-p; recomputed per prompt, unpadded
    tok, m = _char_tokenizer("abcdefgh" * 5), models[arch]
    prompts = ["abc", "hgfedcba"]
    enc, new, nm = H.sample_answers(m, tok, prompts, 5, 1.0, 0.9, torch.Generator().manual_seed(0))
    lp = H.answer_logprob(m, enc, new, nm, 1.0, 0.9)
    for i, p in enumerate(prompts):
        ids = tok(tok.bos_token + p, return_tensors="pt", add_special_tokens=False)["input_ids"]
        want = 0.0
        for t in new[i][nm[i]].tolist():
            with torch.no_grad():
                want += float(H.top_p_logprobs(m(input_ids=ids).logits[0, -1], 1.0, 0.9)[t])
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
        assert lp[i].item() == pytest.approx(want, abs=1e-4)


def test_rl_step_trains_generators_and_top_but_not_the_router_head(models):
    # utils.route runs under no_grad: in rl_batch.rl_train the routing choice gets no gradient;
    # the generators' loss reaches the router only through its shared part (here the top)
    from workbench.data import tasks
    ex = tasks.generate("reverse", 6, 0)
    tok = _char_tokenizer("".join(e.prompt + e.completion() for e in ex))
    small = {n: models[n] for n in ("gpt2", "qwen2")}
    dims = {n: H.official_targets(m)[0][2:] for n, m in small.items()}
    torch.manual_seed(0)
    ref = H.RefHAPS(list(small), dims, 12, rank=2)
    h, s = torch.randn(6, 12), H.RefSettings(rank=2, batch=6)
    loss, score, choice = H.rl_step_loss(ref, small, {n: tok for n in small}, ex, None, h,
                                         torch.arange(6), s, torch.Generator().manual_seed(0),
                                         {n: 4 for n in small})
    assert score == 0.0 and loss.item() < 0     # every reward -1: loss = mean log p, pushed down
    loss.backward()
    assert ref.router.weight.grad is None
    assert ref.tops["shared"].weight.grad.abs().sum() > 0
    used = ref.gens[ref.names[int(choice[0])]]
    assert used.out_A.weight.grad.abs().sum() > 0
