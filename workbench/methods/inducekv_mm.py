"""The multimodal backbone of InduceKV's continual-VQA stream (paper 01): an image through the
frozen mini-CLIP image encoder, projected into prefix embeddings of the frozen LM.

The projector follows ClipCap (Mokady et al. 2021, "ClipCap: CLIP Prefix for Image Captioning",
the MLP mapping network): the CLIP image embedding goes through an MLP (tanh) to ``k`` vectors of
the LM's hidden size, which the LM reads as a prefix of input embeddings; the LM and CLIP stay
frozen and only the projector is trained, on image captions (LLaVA's stage 1, "feature
alignment", trains its projector the same way). After that the projector is frozen too: the
continual stream adapts the multimodal backbone ``CLIP -> projector -> LM`` as a whole, and
every method (InduceKV and the baselines) sees the same one.

How the prefix enters the LM. As in LLaVA, a prompt carries image placeholders whose input
embeddings are replaced by the projected features. Here each image ``n`` of a stream owns ``k``
placeholder ids ``V + n k + j`` (``V`` the text vocabulary): the LM's input embedding becomes
:class:`PrefixEmbedding`, which looks text ids up in the original table and placeholder ids in
``projector(features[n])[j]``. So the exact ``inputs_embeds`` of ``<bos> [image prefix]
question`` reach the decoder while every tool that works on token ids (packing, the KV entries,
LoRA training, the L2P prompt pool, the caches) works unchanged. :class:`ImageTokenizer` wraps
the text tokenizer so that the marker ``<image:n>`` in a prompt becomes those ids.
"""
from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["Projector", "PrefixEmbedding", "ImageTokenizer", "marker", "install",
           "prefix_embeds"]

_MARK = re.compile(r"<image:(\d+)>")


def marker(n: int) -> str:
    """The prompt text standing for image ``n`` of the stream."""
    return f"<image:{n}>"


class Projector(nn.Module):
    """ClipCap's MLP mapping network: CLIP image embedding (``d_in``) -> ``k`` prefix
    embeddings of size ``d_lm`` (``Linear, tanh, Linear``; the output scaled to the LM's
    embedding scale at initialisation)."""

    def __init__(self, d_in: int, d_lm: int, k: int, hidden: int = 256, seed: int = 0,
                 scale: float = 1.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.k, self.d_lm, self.scale = k, d_lm, scale
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, k * d_lm))
        with torch.no_grad():
            for layer in (self.net[0], self.net[2]):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g)
                                   / layer.weight.shape[1] ** 0.5)
                layer.bias.zero_()

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """(N, d_in) -> (N, k, d_lm)."""
        return self.scale * self.net(f).view(len(f), self.k, self.d_lm)


class PrefixEmbedding(nn.Module):
    """The LM's input embedding with image placeholders: ids < ``vocab`` read ``text``; id
    ``vocab + n k + j`` reads ``projector(features[n])[j]`` (computed for the images present)."""

    def __init__(self, text: nn.Embedding, projector: Projector, features: torch.Tensor):
        super().__init__()
        self.text, self.projector = text, projector
        self.vocab = text.num_embeddings
        self.register_buffer("features", features.detach().float().clone(), persistent=True)

    @property
    def weight(self):                       # what code reading the embedding table expects
        return self.text.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.text(ids.clamp(max=self.vocab - 1))
        img = ids >= self.vocab
        if img.any():
            rel = ids[img] - self.vocab
            n, j = rel // self.projector.k, rel % self.projector.k
            uniq, inv = n.unique(return_inverse=True)
            pre = self.projector(self.features[uniq])                 # (U, k, d)
            out = out.masked_scatter(img[..., None], pre[inv, j].to(out.dtype))
        return out


class ImageTokenizer:
    """The text tokenizer, with ``<image:n>`` in a text tokenized to image ``n``'s ``k``
    placeholder ids (``vocab + n k + j``); everything else is the wrapped tokenizer's."""

    def __init__(self, tok, k: int):
        self._tok, self.k, self.vocab = tok, k, len(tok)

    def __getattr__(self, name):
        if name == "_tok":                  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def _one(self, text: str) -> list[int]:
        ids, at = [], 0
        for m in _MARK.finditer(text):
            if text[at: m.start()].strip():
                ids += self._tok(text[at: m.start()], add_special_tokens=False)["input_ids"]
            n = int(m.group(1))
            ids += [self.vocab + n * self.k + j for j in range(self.k)]
            at = m.end()
        if text[at:]:
            ids += self._tok(text[at:], add_special_tokens=False)["input_ids"]
        return ids

    def __call__(self, texts, add_special_tokens: bool = False, **kw):
        one = isinstance(texts, str)
        ids = [self._one(t) for t in ([texts] if one else texts)]
        if add_special_tokens:
            ids = [[self._tok.bos_token_id] + i for i in ids]
        return {"input_ids": ids[0] if one else ids}


def install(lm, projector: Projector, features: torch.Tensor) -> nn.Module:
    """Put a :class:`PrefixEmbedding` of ``features`` (one row per image of the stream) into
    ``lm`` (in place; its text embedding and every weight unchanged). Returns ``lm``."""
    text = lm.get_input_embeddings()
    if isinstance(text, PrefixEmbedding):
        text = text.text
    lm.set_input_embeddings(PrefixEmbedding(text, projector, features))
    return lm


def prefix_embeds(lm, ids: torch.Tensor, images: list[int | None]) -> torch.Tensor:
    """The reference ``inputs_embeds`` built by hand: row ``i`` is the text embedding of
    ``ids[i]`` with image ``images[i]``'s projected prefix inserted right after ``<bos>``
    (what :class:`PrefixEmbedding` must equal; ``ids`` without placeholders)."""
    emb = lm.get_input_embeddings()
    text, proj, feats = emb.text, emb.projector, emb.features
    rows = []
    for r, n in zip(ids, images):
        e = text(r)
        if n is not None:
            e = torch.cat([e[:1], proj(feats[n: n + 1])[0], e[1:]])
        rows.append(e)
    return torch.stack(rows)
