"""Hybrid-LoRA (paper 04, workbench.methods.hybrid_lora): GRPO's loss and the module score."""
import copy

import pytest

torch = pytest.importorskip("torch")

from workbench.methods import hybrid_lora as H  # noqa: E402


def test_group_advantages_are_eq1():
    r = torch.tensor([1., 0., 0., 1., 1., 1., 1., 1., 0., 0., 0., 1.])
    a = H.group_advantages(r, 4)
    for g in range(3):
        x = r[4 * g: 4 * g + 4]
        ref = (x - x.mean()) / (x.std(unbiased=True) + 1e-4)
        assert torch.allclose(a[4 * g: 4 * g + 4], ref, atol=1e-6)
    assert torch.all(a[4:8] == 0)                                   # no signal in a uniform group
    assert torch.allclose(a.view(3, 4).sum(1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(H.group_advantages(r, 4, scale=False).view(3, 4),
                          r.view(3, 4) - r.view(3, 4).mean(1, keepdim=True))


def _hand_batch(seed=0, B=6, T=4):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + (torch.rand(B, T, generator=g) - 0.5)               # ratios from e^-0.5 to e^0.5
    ref = logp + (torch.rand(B, T, generator=g) - 0.5) * 0.3
    adv = torch.tensor([1.5, -1.0, 0.5, -0.2, 2.0, -2.0])[:B]
    mask = torch.ones(B, T)
    mask[0, 2:] = 0
    mask[3, 1:] = 0
    return logp, old, ref, adv, mask


def test_clipped_surrogate_equals_the_reference_formula():
    logp, old, ref, adv, mask = _hand_batch()
    eps, beta = 0.2, 0.05
    got = H.grpo_loss(logp, old, adv, mask, eps, beta=beta, ref_logp=ref, kl_correction=False)
    total = 0.0
    for i in range(logp.shape[0]):                                   # eq. (2), loop by loop
        s, n = 0.0, 0
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            rho = float(torch.exp(logp[i, t] - old[i, t]))
            clipped = min(max(rho, 1 - eps), 1 + eps)
            kl = float(torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1)
            s += -min(rho * float(adv[i]), clipped * float(adv[i])) + beta * kl
            n += 1
        total += s / n
    assert got.item() == pytest.approx(total / logp.shape[0], rel=1e-5)
    ratio = torch.exp(logp - old)
    assert ((ratio > 1.2) | (ratio < 0.8)).any()                     # the clip is exercised


def test_gspo_uses_one_length_normalized_ratio_per_sequence():
    logp, old, _, adv, mask = _hand_batch(1)
    got = H.grpo_loss(logp, old, adv, mask, 0.2, level="sequence")
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))        # geometric mean of the ratios
    ref = -torch.min(s * adv, s.clamp(0.8, 1.2) * adv).mean()
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    with pytest.raises(ValueError):
        H.grpo_loss(logp, old, adv, mask, level="tokens")


@pytest.mark.parametrize("level,beta", [("token", 0.0), ("token", 0.1), ("sequence", 0.0), ("sequence", 0.1)])
def test_loss_equals_trl_grpo_loss_on_the_same_batch(tmp_path, level, beta):
    """Eq. (2) as written here and TRL's ``GRPOTrainer._compute_loss`` give the same number (and
    gradient) on the same model and batch."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from workbench.models import zoo
    model, tok = zoo.load("lm-micro")
    model.train()
    cfg = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                     max_completion_length=3, loss_type="grpo", importance_sampling_level=level,
                     beta=beta, epsilon=0.2, report_to=[], use_cpu=True, temperature=1.0,
                     save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["a b c ->"] * 4}))
    trainer.current_gradient_accumulation_steps = 1      # set by the training loop; one micro-batch
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    batch = {"prompt_ids": torch.randint(5, V, (4, 5), generator=g), "prompt_mask": torch.ones(4, 5, dtype=torch.long),
             "completion_ids": torch.randint(5, V, (4, 3), generator=g),
             "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])}
    with torch.no_grad():
        lp = H.completion_logps(model, **batch)
    old = lp + 0.4 * (torch.rand(lp.shape, generator=g) - 0.5)
    ref = lp + 0.2 * (torch.rand(lp.shape, generator=g) - 0.5)
    adv = H.group_advantages(torch.tensor([1., 0., 0., 1.]), 4)
    mask = batch["completion_mask"]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    with torch.no_grad():               # TRL's fused LM-head path gives the same log-probs to ~1e-3
        trl_lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids,
                                                            torch.cat([batch["prompt_mask"], mask], 1), 3)[0]
    assert torch.allclose(trl_lp * mask, lp * mask, atol=2e-3)
    # the same per-token log-probs into both losses: what remains is eq. (2) against TRL's
    logp = H.completion_logps(model, **batch)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    ours = H.grpo_loss(logp, old, adv, mask.float(), 0.2, level=level, beta=beta, ref_logp=ref)
    theirs = trainer._compute_loss(trainer.model, {**batch, "advantages": adv, "old_per_token_logps": old,
                                                   "ref_per_token_logps": ref})
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-8)
    w = next(p for p in model.parameters() if p.requires_grad)
    g1 = torch.autograd.grad(ours, w, retain_graph=True)[0]
    g2 = torch.autograd.grad(theirs, w)[0]
    assert g1.abs().max() > 0 and torch.allclose(g1, g2, atol=1e-7)


def test_score_is_the_energy_a_rank_r_update_misses():
    g = torch.Generator().manual_seed(0)
    low = torch.randn(12, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 10, generator=g, dtype=torch.float64)
    assert H.hybrid_score(low, 3) == pytest.approx(0.0, abs=1e-12)   # rank 3: nothing outside
    assert H.hybrid_score(torch.eye(8), 2) == pytest.approx(6 / 8)
    m = torch.randn(12, 10, generator=g, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    best = u[:, :4] @ torch.diag(s[:4]) @ vh[:4]                     # Eckart-Young: the best rank 4
    resid = float((m - best).norm() ** 2 / m.norm() ** 2)
    assert H.hybrid_score(m, 4) == pytest.approx(resid, rel=1e-10)
    q, _ = torch.linalg.qr(torch.randn(12, 4, generator=g, dtype=torch.float64))
    assert float((m - q @ q.T @ m).norm() ** 2 / m.norm() ** 2) >= resid   # any other rank 4 misses more
    assert H.hybrid_score(torch.zeros(3, 3), 1) == 0.0


@pytest.mark.parametrize("n", [10, 28, 56, 99, 100])
def test_the_ten_percent_budget_is_respected(n):
    scores = {f"m{i}": float((7 * i) % n) for i in range(n)}
    chosen = H.select_modules(scores, 0.1)
    assert len(chosen) == H.module_budget(n, 0.1) <= 0.1 * n
    assert len(chosen) == int(0.1 * n)
    worst_chosen = min(scores[c] for c in chosen)
    assert all(scores[o] <= worst_chosen for o in scores if o not in chosen)   # the top ones
    rnd = H.random_modules(list(scores), len(chosen), seed=3)
    assert len(set(rnd)) == len(chosen) and rnd == H.random_modules(list(scores), len(chosen), seed=3)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=40, max_position_embeddings=16)
    return LlamaForCausalLM(cfg)


def test_hybrid_split_trains_selected_modules_fully_and_freezes_other_full_weights():
    pytest.importorskip("peft")
    base = _tiny_llama()
    names = H.candidate_modules(base)
    assert len(names) == 14
    full = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    pm = H.make_policy(copy.deepcopy(base), "hybrid", rank=2, scale=2.0, full_modules=full)
    train = {n for n, p in pm.named_parameters() if p.requires_grad}
    for n in names:
        tail = n.removeprefix("model.")
        own = [t for t in train if f".{tail}." in t]
        if n in full:                   # a trained full copy of the weight, no LoRA factors
            assert own and all("modules_to_save" in t for t in own) and not any("lora_" in t for t in own)
        else:                           # LoRA factors only; the full weight stays frozen
            assert own and all("lora_" in t for t in own)
    assert not any("embed" in t or "norm" in t for t in train)
    frozen = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
    x = torch.randint(0, 40, (2, 6))
    pm(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in pm.named_parameters() if n in frozen)
    with pm.disable_adapter():          # the reference: the base model exactly
        assert torch.allclose(pm(input_ids=x).logits, base(input_ids=x).logits, atol=1e-6)
    lora = H.make_policy(copy.deepcopy(base), "lora", rank=2, scale=2.0)
    assert all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    assert H.trainable(lora) == sum(2 * (m.in_features + m.out_features)
                                    for n, m in base.named_modules() if n in names)


def test_rollout_mask_runs_through_the_first_eos():
    from workbench.data import tasks
    from workbench.models import zoo
    model, tok = zoo.load("lm-micro")
    exs = tasks.generate("kv", 3, 0, 2)
    b = H.rollouts(model, tok, exs, group=4, max_new_tokens=4, seed=0)
    assert b["completion_ids"].shape[0] == 12 and b["rewards"].shape == (12,)
    for ids, m in zip(b["completion_ids"], b["completion_mask"]):
        eos = (ids == tok.eos_token_id).nonzero()
        n = int(eos[0]) + 1 if len(eos) else len(ids)
        assert m[:n].all() and not m[n:].any()
    grads, stats = H.probe_gradients(model, tok, exs, 4, 4, seed=0)
    assert set(grads) == set(H.candidate_modules(model))
    assert all(p.grad is None for p in model.parameters())
