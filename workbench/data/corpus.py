"""The text corpus and the tokenizer shared by the zoo's language models.

Text: the Python language reference prose shipped in the standard library
(``pydoc_data.topics``: 79 documents, about 0.46 MB of human-written English), split into train
and held-out *documents* by a fixed hash of the document name, plus rendered task examples from
:mod:`workbench.data.tasks`. See ``data/corpus.md``.

Tokenizer: a byte-level BPE trained with the ``tokenizers`` package (digits split one per token,
so arithmetic is learnable), wrapped as a ``transformers.PreTrainedTokenizerFast`` with
``<pad>``, ``<bos>`` and ``<eos>``. Nothing is downloaded; nothing is trained at import.
"""
from __future__ import annotations

import random
import zlib
from pydoc_data.topics import topics

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from . import tasks as T

__all__ = ["SPECIAL", "HELDOUT_FRACTION", "documents", "is_heldout", "split", "train_text",
           "heldout_text", "task_lines", "train_tokenizer", "encode_documents", "blocks",
           "heldout_blocks", "calibration_blocks"]

SPECIAL = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>",
           "unk_token": "<unk>"}
HELDOUT_FRACTION = 0.12


def documents() -> dict[str, str]:
    """All reference documents, name -> text, in a stable order."""
    return {k: topics[k] for k in sorted(topics)}


def is_heldout(name: str) -> bool:
    """A document is held out when the crc32 of its name falls in the held-out fraction."""
    return (zlib.crc32(name.encode()) % 1000) < HELDOUT_FRACTION * 1000


def split() -> tuple[dict[str, str], dict[str, str]]:
    """(train, heldout) documents, split by document so no text leaks across."""
    docs = documents()
    train = {k: v for k, v in docs.items() if not is_heldout(k)}
    held = {k: v for k, v in docs.items() if is_heldout(k)}
    return train, held


def train_text() -> list[str]:
    return list(split()[0].values())


def heldout_text() -> list[str]:
    return list(split()[1].values())


def task_lines(families, n_per_family: int, seed: int, with_steps: bool = False,
               easiest: int | None = None) -> list[str]:
    """Rendered task examples (prompt + reference completion), shuffled with ``seed``.

    ``easiest=k`` spreads each family's examples over its ``k`` easiest difficulties only.
    """
    lines = []
    for fam in families:
        ds = T.get(fam).difficulties if easiest is None else T.get(fam).difficulties[:easiest]
        for d in ds:
            lines += [ex.text(with_steps=with_steps)
                      for ex in T.generate(fam, -(-n_per_family // len(ds)), seed, d)]
    random.Random(seed).shuffle(lines)
    return lines


def train_tokenizer(vocab_size: int = 1024, extra_text: list[str] | None = None):
    """Train a byte-level BPE on the train documents (+ ``extra_text``) and wrap it.

    Returns a ``PreTrainedTokenizerFast`` with pad/bos/eos/unk set; deterministic for a fixed
    input.
    """

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL.values()), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_text() + list(extra_text or []), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.padding_side = "left"           # left padding for batched generation
    return fast


def encode_documents(tokenizer, texts: list[str]) -> list[int]:
    """One token stream: each document followed by ``<eos>``."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids


def blocks(tokenizer, texts: list[str], ctx: int, max_blocks: int | None = None):
    """Non-overlapping ``ctx``-token blocks of the document stream, as a LongTensor (B, ctx)."""
    ids = encode_documents(tokenizer, texts)
    n = len(ids) // ctx
    if max_blocks is not None:
        n = min(n, max_blocks)
    return torch.tensor(ids[: n * ctx], dtype=torch.long).view(n, ctx)


def heldout_blocks(tokenizer, ctx: int, max_blocks: int | None = None):
    """Held-out reference text as (B, ctx) token blocks: the perplexity benchmark."""
    return blocks(tokenizer, heldout_text(), ctx, max_blocks)


def calibration_blocks(tokenizer, ctx: int, n: int, seed: int = 0):
    """``n`` random ``ctx``-token windows of the *train* documents (quantization calibration)."""
    ids = torch.tensor(encode_documents(tokenizer, train_text()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - ctx, (n,), generator=g)
    return torch.stack([ids[s: s + ctx] for s in starts.tolist()])
