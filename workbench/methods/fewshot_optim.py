"""Few-shot CLIP adaptation: it is the optimizer's preconditioning, not full fine-tuning (paper 15).

The classifier of every method is CLIP's zero-shot head: ``logit_scale * cos(f(x), w_c)`` with
``w_c`` the text embedding of class ``c``'s prompt. Full fine-tuning trains the image tower and
the head with SGD, Adam or AdamW (or Shampoo / SOAP from ``pytorch_optimizer``); the PEFT
baselines are a linear probe (head only), CoOp-style prompt tuning (learned context words),
``peft`` LoRA on the image tower's attention and a CLIP-Adapter residual on image features.

The paper's diagnostics are here: the per-coordinate ratio of the few-shot to the full-data
second moment of per-example gradients (C2), Adam's first-step update norm against SGD's and
the budget-matched Adam whose learning rate makes the two equal (C3), distance from the
pretrained weights (C5); the top Hessian eigenvalue is :func:`workbench.diagnostics.top_hessian_eigenvalue`.
The notebook's data, its runs of every method on every support set and its tables are the
harness in :mod:`workbench.experiments.fewshot_optim`.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from pytorch_optimizer import SOAP, Shampoo
from torch import nn
from torch.func import functional_call, grad, vmap

from ..models import clip

__all__ = ["FewShotClassifier", "make_optimizer", "train", "correct", "accuracy",
           "per_example_sq_grads",
           "full_grad", "second_moment_ratio", "first_step_update", "budget_matched_lr",
           "distance_from_init", "OPTIMIZERS", "PEFT"]


class FewShotClassifier(nn.Module):
    """CLIP's image tower with a cosine head initialised from the class prompts' text features.

    ``mode`` picks what trains: ``full`` (image tower, projection, head), ``linear`` (head),
    ``coop`` (``n_ctx`` context vectors replacing "a photo of a"; the head is recomputed from the
    text tower every forward), ``lora`` (``peft`` LoRA on the image tower's q/v projections,
    head frozen), ``adapter`` (CLIP-Adapter: f + alpha * MLP(f) on image features, head frozen).
    """

    def __init__(self, model, tok, names, mode: str = "full", lora_rank: int = 4,
                 adapter_alpha: float = 0.2, n_ctx: int = 4):
        super().__init__()
        self.mode, self.names = mode, list(names)
        self.model = copy.deepcopy(model)
        # eager attention: C5's Hessian-vector products need double backprop, which torch's
        # fused CPU attention kernel does not implement
        self.model.set_attn_implementation("eager")
        self.tok = tok
        with torch.no_grad():
            w = clip.class_features(self.model, tok, self.names)
        self.head = nn.Parameter(w.clone())
        self.scale = float(self.model.logit_scale.detach().exp())
        for p in self.model.parameters():
            p.requires_grad_(False)
        if mode == "full":
            for p in list(self.model.vision_model.parameters()) + \
                    list(self.model.visual_projection.parameters()):
                p.requires_grad_(True)
        elif mode == "linear":
            pass
        elif mode == "coop":
            self.head.requires_grad_(False)
            ids = clip.tokenize(tok, [f"a photo of a {n}" for n in self.names],
                                _device(self.model))
            self.register_buffer("ids", ids["input_ids"])
            self.register_buffer("mask", ids["attention_mask"])
            emb = self.model.text_model.embeddings.token_embedding
            self.n_ctx = n_ctx
            self.ctx = nn.Parameter(emb(self.ids[0, 1:1 + n_ctx]).detach().clone())
            emb.register_forward_hook(self._ctx_hook)
        elif mode == "lora":
            self.head.requires_grad_(False)
            cfg = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj"])
            self.model.vision_model = inject_adapter_in_model(cfg, self.model.vision_model)
        elif mode == "adapter":
            self.head.requires_grad_(False)
            d = self.head.shape[1]
            self.adapter = nn.Sequential(nn.Linear(d, d // 4), nn.ReLU(), nn.Linear(d // 4, d))
            nn.init.zeros_(self.adapter[2].weight)
            nn.init.zeros_(self.adapter[2].bias)
            self.alpha = adapter_alpha
        else:
            raise ValueError(mode)
        if mode != "coop":
            self.head.requires_grad_(mode in ("full", "linear"))
        self.to(self.head.device)       # what was built here (adapter, CoOp's ids) joins CLIP

    def _ctx_hook(self, module, inputs, out):
        # CoOp (Zhou et al. 2022, eq. 2): the prompt's context tokens are free vectors
        if getattr(self, "_in_coop", False):
            out = out.clone()
            out[:, 1:1 + self.n_ctx] = self.ctx
        return out

    def weights(self):
        if self.mode != "coop":
            return F.normalize(self.head, dim=-1)
        self._in_coop = True
        try:
            f = clip.pooled(self.model.get_text_features(input_ids=self.ids,
                                                          attention_mask=self.mask))
        finally:
            self._in_coop = False
        return F.normalize(f, dim=-1)

    @property
    def frozen_tower(self) -> bool:
        """Whether the image tower is frozen (linear, CoOp, CLIP-Adapter): its features of a
        fixed input never change, so training computes them once."""
        return self.mode in ("linear", "coop", "adapter")

    def features(self, x):
        """The image tower's pooled features of ``x`` (before the head)."""
        x = torch.as_tensor(x, dtype=torch.float32, device=self.head.device)
        return clip.pooled(self.model.get_image_features(pixel_values=clip.pixels(self.model, x)))

    def classify(self, f):
        """Cosine logits of image features ``f`` against the class weights."""
        if self.mode == "adapter":
            f = F.normalize(f, dim=-1)
            f = f + self.alpha * self.adapter(f)       # CLIP-Adapter's residual blend
        return self.scale * F.normalize(f, dim=-1) @ self.weights().T

    def forward(self, x):
        return self.classify(self.features(x))

    def trainable(self):
        return [p for p in self.parameters() if p.requires_grad]


def _device(module) -> torch.device:
    """Where ``module``'s parameters live (the run's device once CLIP was loaded there)."""
    return next(module.parameters()).device


OPTIMIZERS = ("sgd", "adam", "adamw", "adam_budget", "adam_numerator", "shampoo", "soap")
PEFT = ("linear", "coop", "lora", "adapter")


def make_optimizer(name: str, params, lr: float, weight_decay: float = 0.0):
    """``torch.optim`` SGD (momentum 0.9) / Adam / AdamW, or ``pytorch_optimizer``'s Shampoo and
    SOAP (Gupta et al. 2018; Vyas et al. 2024)."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name in ("adam", "adam_budget", "adam_numerator"):
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay or 0.05)
    if name == "shampoo":
        return Shampoo(params, lr=lr, momentum=0.9)
    if name == "soap":
        return SOAP(params, lr=lr, weight_decay=0.0, precondition_frequency=1)
    raise ValueError(name)


def train(clf: FewShotClassifier, x, y, optimizer: str, lr: float, steps: int,
          numerator_grad=None):
    """Full-batch training of ``clf``'s trainable parameters on the support set ``(x, y)``.
    ``numerator_grad`` (``adam_numerator``): Adam's first step uses this full-data gradient as
    its bias-corrected first moment, m_1 / (1 - beta1) = g_full (numerator-side alignment; the
    denominator stays the support set's, sqrt(v_1 / (1 - beta2)) = |g_support|), so the first
    update is lr * g_full / (|g_support| + eps): what Adam would do had its first gradient been
    the full-data one.

    A frozen image tower's features are computed once (the same numbers, fewer forwards). A
    diverged run ends early: a non-finite loss or gradient, or a preconditioner that cannot be
    computed from blown-up statistics (Shampoo's SVD fails to converge). Returns the losses of
    the steps taken; a diverged run's last entry is NaN."""
    params = clf.trainable()
    opt = make_optimizer(optimizer, params, lr)
    y = torch.as_tensor(y, device=_device(clf))
    losses = []
    clf.train()
    frozen = getattr(clf, "frozen_tower", False)
    if frozen:
        with torch.no_grad():
            f = clf.features(x)
    for step in range(steps):
        loss = F.cross_entropy(clf.classify(f) if frozen else clf(x), y)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None):
            losses.append(math.nan)
            break
        if step == 0 and numerator_grad is not None:
            # seed Adam's state so that after its update m_1 = b1 m_0 + (1 - b1) g = (1 - b1) g_full:
            # torch divides m_1 by the bias correction 1 - b1, so the corrected moment is g_full
            # (seeding m_1 = g_full itself made the first step 1 / (1 - b1) = 10 times too large)
            b1 = opt.param_groups[0]["betas"][0]
            for p, g in zip(params, numerator_grad):
                st = opt.state[p]
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = (1 - b1) * (g - p.grad) / b1
                st["exp_avg_sq"] = torch.zeros_like(p)
        try:
            opt.step()
        except torch.linalg.LinAlgError:
            losses.append(math.nan)
            break
    return losses


def correct(clf, x, y, batch: int = 1024) -> torch.Tensor:
    """Per item of ``(x, y)``: whether ``clf`` classifies it right (a bool tensor; the paired
    comparisons of two methods on the same test images read it)."""
    clf.eval()
    with torch.no_grad():
        pred = torch.cat([clf(x[i: i + batch]).argmax(-1) for i in range(0, len(x), batch)])
    return pred == torch.as_tensor(y, device=pred.device)


def accuracy(clf, x, y, batch: int = 1024) -> float:
    """The share of ``(x, y)`` that ``clf`` classifies right."""
    return float(correct(clf, x, y, batch).float().mean())


def full_grad(clf, x, y):
    """The gradient of the mean cross-entropy on ``(x, y)`` w.r.t. the trainable parameters."""
    params = clf.trainable()
    return torch.autograd.grad(F.cross_entropy(clf(x), torch.as_tensor(y, device=_device(clf))),
                               params)


def per_example_sq_grads(clf, x, y, chunk: int = 256) -> torch.Tensor:
    """Mean over examples of the squared per-example gradient, flattened over the trainable
    parameters: the second-moment estimate E_i[g_i ⊙ g_i] that Adam's denominator tracks.
    The per-example gradients come ``chunk`` at a time from ``torch.func`` (vmap of grad)."""
    names = [n for n, p in clf.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in clf.named_parameters() if p.requires_grad}

    def loss_one(pr, xi, yi):
        return F.cross_entropy(functional_call(clf, pr, (xi[None],)), yi[None])

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
    dev = _device(clf)
    x = torch.as_tensor(x, dtype=torch.float32, device=dev)
    y = torch.as_tensor(y, device=dev)
    acc = torch.zeros(sum(params[n].numel() for n in names), device=dev)
    for i in range(0, len(x), chunk):
        g = per_example(params, x[i: i + chunk], y[i: i + chunk])
        g = {n: v.to(dev) for n, v in g.items()}       # where they are already (for the audit)
        acc += torch.cat([(g[n] ** 2).sum(0).reshape(-1) for n in names])
    return acc / len(x)


def second_moment_ratio(v_few: torch.Tensor, v_full: torch.Tensor, eps: float = 1e-20):
    """Per-coordinate ratio v_few / v_full over coordinates with v_full > eps, and summary:
    median and the fraction of coordinates below 1 (C2: few-shot underestimates)."""
    keep = v_full > eps
    r = (v_few[keep] / v_full[keep]).cpu()          # for histograms and numpy
    return r, {"median": float(r.median()), "frac_below_1": float((r < 1).float().mean()),
               "geo_mean": float(r.clamp_min(1e-30).log().mean().exp())}


def first_step_update(clf, x, y, optimizer: str, lr: float) -> float:
    """The norm of the first update ``||theta_1 - theta_0||`` of ``optimizer`` at ``lr`` on the
    support set (the model is restored afterwards)."""
    params = clf.trainable()
    before = [p.detach().clone() for p in params]
    train(clf, x, y, optimizer, lr, steps=1)
    norm = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(params, before)))
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
    return norm


def budget_matched_lr(adam_lr: float, adam_norm: float, sgd_norm: float) -> float:
    """C3: the Adam learning rate whose first-step update norm equals SGD's (Adam's first step
    is linear in lr, ``lr * m / (sqrt(v) + eps)``)."""
    return adam_lr * sgd_norm / adam_norm


def distance_from_init(clf, init_state: dict) -> float:
    """``||theta - theta_0||`` over the trainable parameters (C5)."""
    tot = 0.0
    for n, p in clf.named_parameters():
        if p.requires_grad and n in init_state:
            tot += float(((p.detach() - init_state[n]) ** 2).sum())
    return math.sqrt(tot)
