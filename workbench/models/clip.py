"""The zoo's mini-CLIP: a ``transformers`` ``CLIPModel`` pretrained contrastively on
image-caption pairs of :mod:`workbench.data.images` (digits and the procedural shapes family).

``load(scale)`` returns ``(CLIPModel, tokenizer)``, built on first use and cached under
``cache.folder("zoo", "clip")`` keyed by a hash of the recipe and its sizes, built once through
:func:`workbench.cache.build` (file lock, temporary directory renamed into place).
Training: symmetric InfoNCE (Radford et al. 2021, eq. in Fig. 3) with the learned
temperature ``logit_scale`` (clamped at ln 100 as in CLIP); each batch holds one image of every
training class, so no two pairs of a batch share a caption class (no false negatives).
The shapes family's held-out classes (``images.SHAPES_HELDOUT``) are never trained on.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig,
                          PreTrainedTokenizerFast)

from .. import cache
from ..device import zoo_scale
from ..data import images
from ..env import torch_threads

__all__ = ["NAME", "CLIP_VERSION", "ClipSize", "SIZES", "load", "load_model", "pixels", "build",
           "ensure", "model_dir",
           "list_built", "tokenizer", "tokenize", "image_features", "text_features",
           "class_features", "pooled", "zero_shot_logits", "zero_shot_accuracy", "info_nce",
           "make_model", "evaluate"]

NAME = "clip-mini"
CLIP_VERSION = 1
BUILD_THREADS = 1     # torch threads while building at smoke (see ensure)


@dataclass(frozen=True)
class ClipSize:
    """Sizes of one mini-CLIP build (vision ViT on SIZE x SIZE images, word-level text encoder)."""
    dim: int = 64             # hidden size of both towers
    vision_layers: int = 3
    text_layers: int = 2
    heads: int = 4
    mlp: int = 128
    patch: int = 4            # 16 x 16 images -> 16 patches + class token
    proj: int = 64            # joint embedding
    steps: int = 1500         # AdamW steps, one image of every training class a step
    lr: float = 2e-3          # warm-up 5%, cosine to 0
    weight_decay: float = 0.05
    n_per_class: int = 48     # rendered training images per seen shape class
    seed: int = 0


SIZES = {"smoke": ClipSize(), "full": ClipSize(dim=128, vision_layers=4, text_layers=3, mlp=256,
                                             proj=128, steps=6000, n_per_class=200)}


def _key(scale: str, s: ClipSize) -> str:
    scale = zoo_scale(scale)
    return cache.key(NAME, CLIP_VERSION, scale, asdict(s), images.SHAPES_SEEN, images.TEMPLATES,
                     images.SIZE)


def model_dir(scale: str = "smoke", sizes: ClipSize | None = None) -> Path:
    scale = zoo_scale(scale)            # mid runs on the smoke mini-CLIP
    s = sizes or SIZES[scale]
    return cache.folder("zoo", "clip") / f"{NAME}-{scale}-{_key(scale, s)}"


# -- text -------------------------------------------------------------------------------------

def tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over :func:`images.vocabulary` with
    ``<bos> ... <eos>`` around every caption (CLIP pools the text at the first ``<eos>``)."""
    specials = ["<pad>", "<bos>", "<unk>", "<eos>"]
    vocab = {w: i for i, w in enumerate(specials + images.vocabulary())}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 1), ("<eos>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def tokenize(tok, texts, device="cpu") -> dict:
    """``input_ids`` and ``attention_mask`` of ``texts``, padded to the longest."""
    b = tok(list(texts), padding=True, return_tensors="pt")
    return {"input_ids": b["input_ids"].to(device), "attention_mask": b["attention_mask"].to(device)}


# -- model ------------------------------------------------------------------------------------

def make_model(s: ClipSize, vocab_size: int):
    """A fresh ``CLIPModel`` of sizes ``s`` (``CLIPVisionConfig`` / ``CLIPTextConfig``)."""
    torch.manual_seed(s.seed)
    text = CLIPTextConfig(vocab_size=vocab_size, hidden_size=s.dim, intermediate_size=s.mlp,
                          num_hidden_layers=s.text_layers, num_attention_heads=s.heads,
                          max_position_embeddings=16, projection_dim=s.proj,
                          pad_token_id=0, bos_token_id=1, eos_token_id=3)
    vision = CLIPVisionConfig(hidden_size=s.dim, intermediate_size=s.mlp,
                              num_hidden_layers=s.vision_layers, num_attention_heads=s.heads,
                              num_channels=3, image_size=images.SIZE, patch_size=s.patch,
                              projection_dim=s.proj)
    cfg = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                     projection_dim=s.proj)
    return CLIPModel(cfg)


def info_nce(logits_per_image):
    """Symmetric InfoNCE of a square logit matrix whose diagonal holds the matching pairs:
    ``(CE(L, arange) + CE(L^T, arange)) / 2`` (image->text and text->image)."""
    t = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    return 0.5 * (F.cross_entropy(logits_per_image, t) + F.cross_entropy(logits_per_image.T, t))


def image_features(model, x, normalize: bool = True, batch: int = 1024):
    """Projected image embeddings of ``x`` ((N, 3, 16, 16) in [0, 1], array or tensor), L2-
    normalised by default; gradients flow (wrap in ``torch.no_grad()`` to evaluate)."""
    x = torch.as_tensor(x, dtype=torch.float32, device=next(model.parameters()).device)
    f = torch.cat([pooled(model.get_image_features(pixel_values=pixels(model, x[i: i + batch])))
                   for i in range(0, len(x), batch)])
    return torch.nn.functional.normalize(f, dim=-1) if normalize else f


def text_features(model, tok, texts, normalize: bool = True):
    """Projected text embeddings of ``texts``, L2-normalised by default."""
    b = tokenize(tok, texts, next(model.parameters()).device)
    f = pooled(model.get_text_features(**b))
    return torch.nn.functional.normalize(f, dim=-1) if normalize else f


def pooled(out):
    # transformers 5 returns a model output from get_*_features; 4.x returned the tensor
    return out if hasattr(out, "shape") else out.pooler_output


def class_features(model, tok, names, templates=(0,)):
    """One normalised text embedding per class name: the mean over ``templates`` of
    :func:`images.caption`, renormalised (CLIP's prompt ensemble; template 0 alone by default)."""
    fs = torch.stack([text_features(model, tok, [images.caption(n, t) for n in names])
                      for t in templates]).mean(0)
    return torch.nn.functional.normalize(fs, dim=-1)


def zero_shot_logits(model, tok, x, names, templates=(0,)):
    """``logit_scale * cos(image, class prompt)``: (N, len(names)) zero-shot logits."""
    w = class_features(model, tok, names, templates)
    return model.logit_scale.exp() * image_features(model, x) @ w.T


def zero_shot_accuracy(model, tok, x, y, names, templates=(0,)) -> float:
    """Top-1 zero-shot accuracy of ``model`` on ``(x, y)`` among the classes ``names``."""
    with torch.no_grad():
        pred = zero_shot_logits(model, tok, x, names, templates).argmax(-1).cpu()
    return float((pred == torch.as_tensor(y)).float().mean())


# -- building ---------------------------------------------------------------------------------

def _train(s: ClipSize, log=None):
    """Train a mini-CLIP of sizes ``s``; returns ``(model, tok, losses)``."""
    tok = tokenizer()
    model = make_model(s, len(tok))
    xs, ys, _ = images.shapes(images.SHAPES_SEEN, s.n_per_class, seed=s.seed)
    xd, yd, _ = images.digits("train")
    names = list(images.SHAPES_SEEN) + list(images.DIGIT_NAMES)
    x = torch.as_tensor(np.concatenate([xs, xd]))
    y = np.concatenate([ys, yd + len(images.SHAPES_SEEN)])
    members = [np.flatnonzero(y == k) for k in range(len(names))]
    # the tokenised captions of every (class, template) pair
    caps = tokenize(tok, [images.caption(n, t) for n in names
                          for t in range(len(images.TEMPLATES))])
    n_t = len(images.TEMPLATES)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    warm = max(1, s.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, s.steps)
                                                                          / s.steps)))
    rng = np.random.default_rng([s.seed, 3])
    losses = []
    model.train()
    for step in range(s.steps):
        idx = np.array([m[rng.integers(len(m))] for m in members])   # one image per class
        tpl = rng.integers(0, n_t, len(names))
        rows = np.arange(len(names)) * n_t + tpl
        out = model(pixel_values=x[idx], input_ids=caps["input_ids"][rows],
                    attention_mask=caps["attention_mask"][rows])
        loss = info_nce(out.logits_per_image)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(float(loss.detach()))
        if log and (step + 1) % 200 == 0:
            log(f"step {step + 1}/{s.steps} loss {np.mean(losses[-200:]):.3f}")
    return model.eval(), tok, losses


def evaluate(model, tok, n_per_class: int = 10, seed: int = 99) -> dict:
    """Zero-shot accuracies (template 0) on fresh images: shapes seen classes (among seen),
    held-out classes (among held-out, and among all 144), digits test split; with chance."""
    xs, ys, _ = images.shapes(images.SHAPES_SEEN, n_per_class, seed)
    xh, yh, _ = images.shapes(images.SHAPES_HELDOUT, n_per_class, seed)
    xd, yd, _ = images.digits("test")
    allc = list(images.SHAPES_CLASSES)
    yh_all = [allc.index(images.SHAPES_HELDOUT[k]) for k in yh]
    ns, nh = len(images.SHAPES_SEEN), len(images.SHAPES_HELDOUT)
    return {
        "shapes_seen": {"acc": zero_shot_accuracy(model, tok, xs, ys, images.SHAPES_SEEN),
                        "chance": 1 / ns, "classes": ns},
        "shapes_heldout": {"acc": zero_shot_accuracy(model, tok, xh, yh, images.SHAPES_HELDOUT),
                           "chance": 1 / nh, "classes": nh},
        "shapes_heldout_among_all": {"acc": zero_shot_accuracy(model, tok, xh, yh_all, allc),
                                     "chance": 1 / len(allc), "classes": len(allc)},
        "digits_test": {"acc": zero_shot_accuracy(model, tok, xd, yd, images.DIGIT_NAMES),
                        "chance": 0.1, "classes": 10},
        "n_per_class": n_per_class, "eval_seed": seed}


def ensure(scale: str = "smoke", sizes: ClipSize | None = None, force: bool = False) -> Path:
    """Build the mini-CLIP at ``scale`` once (file lock, atomic rename); return its directory.
    ``force`` trains it again and replaces the finished build (``workbench zoo build --force``)."""
    scale = zoo_scale(scale)
    s = sizes or SIZES[scale]
    path = model_dir(scale, s)
    path.parent.mkdir(parents=True, exist_ok=True)
    if sizes is None:
        cache.note_use(NAME)

    def build_into(tmp: Path) -> dict:
        # one thread, whoever calls: the weights depend on the thread count (conv and addmm
        # reduction order: a 2-thread build differed from a 1-thread one by up to 0.36 in a
        # weight), and in a two-job `zoo build` a 2-thread build ran 3.4x slower (275 s, 82 s)
        with torch_threads(BUILD_THREADS):
            return _build_into(tmp)

    def _build_into(tmp: Path) -> dict:
        t0 = time.time()
        model, tok, losses = _train(s)
        train_s = time.time() - t0
        card = {"name": NAME, "scale": scale, "kind": "clip", "arch": "CLIPModel (ViT + text)",
                "parameters": sum(p.numel() for p in model.parameters()),
                "sizes": asdict(s), "key": _key(scale, s),
                "train_seconds": round(train_s, 1),
                "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
                "logit_scale": round(float(model.logit_scale.detach().exp()), 2),
                "zero_shot": evaluate(model, tok),
                "load_at_build": os.getloadavg()[0], "torch_threads": _threads()}
        card["build_seconds"] = round(time.time() - t0, 1)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "card.json").write_text(json.dumps(card, indent=2))
        return {"built": True}

    cache.build(path, build_into, force=force)
    return path


def _threads() -> int:
    return torch.get_num_threads()


def load(scale: str = "smoke", device: str = "cpu", sizes: ClipSize | None = None):
    """``(CLIPModel, tokenizer)`` of the mini-CLIP at ``scale``, in eval mode on ``device``,
    built on first use; its card is ``model.zoo_card``."""
    path = ensure(scale, sizes)
    model = CLIPModel.from_pretrained(path, dtype="float32").to(device).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    model.zoo_card = json.loads((path / "card.json").read_text())
    return model, tok


def load_model(clip_model: str | None = None, scale: str = "smoke", device: str = "cpu"):
    """``(CLIPModel, tokenizer)`` of a notebook's ``clip_model``: None (or ``clip-mini``) the
    zoo's mini-CLIP at ``scale``; a directory a local ``CLIPModel`` with its ``CLIPProcessor``
    (local files only; refused by :func:`checkpoint.validate` when it cannot be used). A local
    model keeps its processor's mean and std (``model.pixel_norm``) so that :func:`pixels`
    feeds it the [0, 1] images of :mod:`workbench.data.images` as it was trained to see them;
    its card is :func:`checkpoint.card` (key: the content hash; no zero-shot numbers)."""
    if clip_model is None or clip_model == NAME:
        return load(scale, device)
    from transformers import CLIPProcessor
    from . import checkpoint
    d = Path(clip_model).expanduser().resolve()
    checkpoint.validate(d, "clip_model", kind="clip", need="clip")
    model = CLIPModel.from_pretrained(d, dtype="float32", local_files_only=True).to(device).eval()
    proc = CLIPProcessor.from_pretrained(d, local_files_only=True)
    ip = proc.image_processor
    model.pixel_norm = (list(ip.image_mean), list(ip.image_std))
    model.zoo_card = {**checkpoint.card(d, model), "kind": "clip", "zero_shot": {}}
    return model, proc.tokenizer


def pixels(model, x):
    """``x`` ((N, 3, H, W) in [0, 1]) as ``model``'s vision tower takes it: resized
    (bilinear) to its ``image_size`` and normalised by ``model.pixel_norm`` when it has one (a
    local CLIP); the mini-CLIP's images pass unchanged."""
    size = getattr(model.config, "vision_config", model.config).image_size   # or a vision tower
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    norm = getattr(model, "pixel_norm", None)
    if norm is not None:
        mean, std = (torch.tensor(v, dtype=x.dtype, device=x.device)[:, None, None] for v in norm)
        x = (x - mean) / std
    return x


def build(scale: str = "smoke", force: bool = False) -> dict:
    """Build (when not cached) and return the card (what ``workbench zoo build clip-mini`` does)."""
    return json.loads((ensure(scale, force=force) / "card.json").read_text())


def list_built() -> list[dict]:
    """The cards of every finished mini-CLIP in the cache, each with its ``path``."""
    root = cache.folder("zoo", "clip")
    out = []
    for card in sorted(root.glob("*/card.json")) if root.exists() else []:
        if not card.parent.name.startswith("."):
            out.append({**json.loads(card.read_text()), "path": str(card.parent)})
    return out
