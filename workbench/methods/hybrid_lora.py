"""Hybrid-LoRA: full fine-tuning where a low-rank update falls short, LoRA elsewhere, for RLVR.

Paper 04 (NeurIPS 2026, ``docs/papers/04-hybrid-lora.md``). RL with verifiable rewards (RLVR) trains
the policy with GRPO: for each problem q, G completions o_1..o_G are sampled and scored by the
task's verifier, r_i in {0, 1}, and every token of o_i gets the group-normalized advantage

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)                                  (1)

(:func:`group_advantages`). With the importance ratio rho_{i,t} = pi(o_{i,t} | ...) / pi_old(...)
the GRPO loss is the clipped surrogate, averaged over the tokens of each completion and then over
completions, optionally with a KL penalty to the reference policy (k3 estimator),

    L = -1/G sum_i 1/|o_i| sum_t [ min(rho A_i, clip(rho, 1-e, 1+e) A_i) - beta KL_t ]     (2)

GSPO replaces the token ratio by the sequence ratio s_i = exp(1/|o_i| sum_t log rho_{i,t})
(:func:`grpo_loss` with ``level="sequence"``). Training itself runs in TRL's ``GRPOTrainer``
(``workbench.experiments.hybrid_lora.train_grpo``); :func:`grpo_loss` is eq. (2) written out,
used for the probe gradient and checked against TRL's loss on the same batch in the tests.

**The Hybrid-LoRA Score.** On one probe batch of rollouts, take each candidate module's policy
gradient G_m = dL/dW_m (eq. 2 at rho = 1, i.e. the REINFORCE direction with advantages (1)) and
measure the share of its energy a rank-r update cannot hold (Eckart-Young):

    score_m = 1 - sum_{i<=r} sigma_i(G_m)^2 / sum_i sigma_i(G_m)^2                         (3)

(:func:`hybrid_score`). The top-scored modules within a budget of 10% of the candidates are
fully fine-tuned, the rest get LoRA (:func:`select_modules`, :func:`make_policy`): in ``peft``
the full modules are ``modules_to_save`` (a trained copy; disabling the adapter restores the
original, so TRL's KL reference stays the base model), the others LoRA layers.
"""
from __future__ import annotations

import math

import torch

from ..data import tasks
from ..models import finetune

__all__ = ["METHODS", "group_advantages", "grpo_loss", "rollouts", "completion_logps",
           "candidate_modules", "probe_gradients", "hybrid_score", "module_budget",
           "select_modules", "random_modules", "make_policy", "trainable"]

METHODS = ("full", "lora", "rslora", "dora", "pissa", "hybrid", "random")


# -- eq. (1) and (2) ----------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, group: int, scale: bool = True) -> torch.Tensor:
    """Eq. (1): each reward minus its group's mean, over the group's std (unbiased, as TRL) +
    1e-4; ``rewards`` is (n_problems * group,) with each problem's completions adjacent."""
    r = rewards.float().view(-1, group)
    a = r - r.mean(1, keepdim=True)
    if scale:
        a = a / (r.std(1, keepdim=True) + 1e-4)
    return a.reshape(-1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              epsilon: float = 0.2, epsilon_high: float | None = None, level: str = "token",
              beta: float = 0.0, ref_logp: torch.Tensor | None = None,
              kl_correction: bool = True) -> torch.Tensor:
    """Eq. (2): the clipped surrogate on (B, T) per-token log-probs of the completions, masked,
    mean over each completion's tokens then over completions (TRL's ``loss_type="grpo"``).
    ``level="sequence"`` is GSPO's ratio, the geometric mean of the token ratios.
    ``kl_correction`` multiplies the KL term by the (unclipped) ratio, TRL's default
    (``use_bias_correction_kl``: the unbiased reverse-KL gradient of DeepSeek-V3.2); without it
    the KL term is the original GRPO one."""
    eh = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logp - old_logp
    if level == "sequence":                     # GSPO: one ratio per completion, length-normalized
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', not {level!r}")
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + eh) * a)
    if beta:
        d = ref_logp - logp                     # k3 estimator of KL(pi || pi_ref), >= 0
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * (kl * ratio if kl_correction else kl)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


# -- rollouts from generate ---------------------------------------------------------------------

def rollouts(model, tok, examples: list, group: int, max_new_tokens: int, temperature: float = 1.0,
             seed: int = 0) -> dict:
    """``group`` sampled completions per example (``model.generate``, ``<bos>`` + prompt, left
    padded), their verifier rewards and the tensors eq. (2) needs; the completion mask runs
    through the first ``<eos>``."""
    device = next(model.parameters()).device
    tok.padding_side = "left"
    prompts = [tok.bos_token + e.prompt for e in examples for _ in range(group)]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    torch.manual_seed(seed)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    comp = gen[:, enc["input_ids"].shape[1]:]
    is_eos = comp == tok.eos_token_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), comp.shape[1])
    mask = (torch.arange(comp.shape[1], device=device)[None] <= first[:, None]).long()
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    rewards = torch.tensor([tasks.score(e, t) for e, t in
                            zip([e for e in examples for _ in range(group)], texts)],
                           device=device)
    return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
            "completion_ids": comp, "completion_mask": mask, "rewards": rewards, "texts": texts}


def completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """(B, T) log-probabilities of the completion tokens under ``model`` (as TRL computes them:
    one forward on prompt + completion, the logits that predict each completion token)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    att = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=att).logits[:, prompt_ids.shape[1] - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


# -- the Hybrid-LoRA Score ----------------------------------------------------------------------

def candidate_modules(model, targets=finetune.TARGETS) -> list[str]:
    """Names of the linear projections that can be adapted (attention and MLP), in model order."""
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in targets]


def probe_gradients(model, tok, examples: list, group: int, max_new_tokens: int,
                    temperature: float = 1.0, seed: int = 0) -> tuple[dict, dict]:
    """The policy gradient dL/dW of eq. (2) (at rho = 1) of every candidate module on one probe
    batch of rollouts of ``examples``; returns ``({name: grad}, batch statistics)``. ``model``
    is left unchanged (its gradients are cleared)."""
    names = candidate_modules(model)
    mods = dict(model.named_modules())
    batch = rollouts(model, tok, examples, group, max_new_tokens, temperature, seed)
    adv = group_advantages(batch["rewards"], group)
    model.zero_grad(set_to_none=True)
    req = {n: p.requires_grad for n, p in model.named_parameters()}
    for n in names:
        mods[n].weight.requires_grad_(True)
    logp = completion_logps(model, batch["prompt_ids"], batch["prompt_mask"],
                            batch["completion_ids"], batch["completion_mask"])
    grpo_loss(logp, logp.detach(), adv, batch["completion_mask"].float()).backward()
    grads = {n: mods[n].weight.grad.detach().clone() for n in names}
    model.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        p.requires_grad_(req[n])
    r = batch["rewards"].view(-1, group)
    stats = {"reward": float(r.mean()), "groups_with_signal": float((r.std(1) > 0).float().mean()),
             "n_rollouts": int(r.numel())}
    return grads, stats


def hybrid_score(grad: torch.Tensor, rank: int) -> float:
    """Eq. (3): the share of ``grad``'s energy (squared Frobenius norm) outside its top-``rank``
    singular subspace, i.e. what the best rank-r update misses (0: low rank suffices)."""
    s2 = torch.linalg.svdvals(grad.double()) ** 2
    total = float(s2.sum())
    return 0.0 if total == 0 else float(s2[rank:].sum()) / total


def module_budget(n_candidates: int, budget: float = 0.1) -> int:
    """How many modules a budget of ``budget`` (a share of the candidates) allows: the floor,
    at least one, so the budget is never exceeded beyond that one."""
    return max(1, math.floor(budget * n_candidates + 1e-9))


def select_modules(scores: dict, budget: float = 0.1) -> list[str]:
    """The top-scored modules within the budget (ties keep model order)."""
    k = module_budget(len(scores), budget)
    return sorted(scores, key=lambda n: -scores[n])[:k]


def random_modules(names: list[str], k: int, seed: int) -> list[str]:
    """The control: ``k`` candidates drawn uniformly at random (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [names[i] for i in sorted(torch.randperm(len(names), generator=g)[:k].tolist())]


# -- the methods --------------------------------------------------------------------------------

def make_policy(model, method: str, rank: int, scale: float, full_modules=(), seed: int = 0):
    """``model`` ready for ``method``: ``full`` trains every weight; ``lora``, ``rslora``
    (alpha / sqrt(r)), ``dora`` and ``pissa`` (A, B from the top-r SVD of W, W the residual)
    are ``peft`` LoRA on every candidate; ``hybrid`` and ``random`` fully fine-tune
    ``full_modules`` (``modules_to_save``) and put LoRA on the other candidates."""
    if method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    kw = {"lora": {}, "rslora": {"use_rslora": True}, "dora": {"use_dora": True},
          "pissa": {"init_lora_weights": "pissa"}}
    if method in kw:
        return finetune.lora_model(model, rank, scale, seed, **kw[method])
    if method in ("hybrid", "random"):
        rest = [n for n in candidate_modules(model) if n not in set(full_modules)]
        return finetune.lora_model(model, rank, scale, seed, targets=rest,
                                   modules_to_save=list(full_modules))
    raise ValueError(f"unknown method {method!r}; methods are {METHODS}")


def trainable(model) -> int:
    """How many parameters ``model`` trains."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
