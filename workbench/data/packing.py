"""Task text as token rows: ``<bos> prompt completion <eos>``, labelled on the answer.

One encoder and three layouts, shared by the zoo's pre-training, the fine-tuning notebooks and
QAT: right-padded rows (one example each), packed rows (whole examples, no example split across
rows) and a stream (examples back to back, cut into rows).
"""
from __future__ import annotations

import torch

__all__ = ["encode", "pad", "pack", "positions", "stream", "task_batch"]

IGNORE = -100   # the label that cross-entropy skips (transformers' convention)


def encode(tok, prompts: list[str], completions: list[str] | None = None) -> list[tuple[list, list]]:
    """``(ids, labels)`` per example: ``<bos> prompt completion <eos>``, with labels on the
    completion and ``<eos>`` only (prompts of generated tasks are random and carry no signal).
    Without completions the whole text is the prompt (labels are then only ``<eos>``)."""
    completions = completions if completions is not None else [""] * len(prompts)
    if len(completions) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    ps = tok(list(prompts), add_special_tokens=False)["input_ids"]
    cs = tok(list(completions), add_special_tokens=False)["input_ids"]
    return [([tok.bos_token_id] + p + c + [tok.eos_token_id],
             [IGNORE] * (1 + len(p)) + c + [tok.eos_token_id]) for p, c in zip(ps, cs)]


def pad(pairs: list[tuple[list, list]], pad_id: int) -> dict[str, torch.Tensor]:
    """One example per row, right-padded to the longest: ``{"input_ids", "labels"}``.

    Under a causal mask right padding never reaches a labelled position, so no attention mask is
    needed (and transformers skips building one)."""
    T = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), T), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    for i, (seq, lab) in enumerate(pairs):
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, :len(lab)] = torch.tensor(lab)
    return {"input_ids": ids, "labels": labels}


def pack(pairs: list[tuple[list, list]], ctx: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole examples packed greedily into ``ctx``-token rows, each row padded at its end.

    Examples longer than ``ctx`` are skipped; the last, partly filled row is kept.
    Returns ``(ids, labels)`` of shape (rows, ctx)."""
    rows, labels, cur, lab = [], [], [], []

    def flush():
        rows.append(cur + [pad_id] * (ctx - len(cur)))
        labels.append(lab + [IGNORE] * (ctx - len(lab)))

    for seq, sl in pairs:
        if len(seq) > ctx:
            continue
        if len(cur) + len(seq) > ctx:
            flush()
            cur, lab = [], []
        cur, lab = cur + seq, lab + sl
    if cur:
        flush()
    if not rows:
        raise ValueError(f"no example fits in ctx={ctx} tokens")
    return torch.tensor(rows, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def positions(ids: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Position ids that restart at 0 at every ``<bos>`` of packed ``(rows, ctx)`` ``ids``.

    Passed as ``position_ids`` (with no attention mask), ``transformers`` reads the restarts as
    packed sequences and masks attention block-diagonally: each example sees only itself, at the
    positions it has when generated alone. Without this, a packed ``kv`` or ``count`` example
    can attend to the letters of the examples before it in the row."""
    T = ids.shape[-1]
    idx = torch.arange(T).expand_as(ids)
    starts = torch.where(ids == bos_id, idx, torch.zeros_like(idx))
    return idx - starts.cummax(-1).values


def stream(pairs: list[tuple[list, list]], n_rows: int, ctx: int) -> torch.Tensor:
    """The examples' tokens back to back, cut into ``n_rows`` rows of ``ctx`` (language-model
    text without padding; an example may cross a row boundary)."""
    ids = [t for seq, _ in pairs for t in seq][: n_rows * ctx]
    if len(ids) < n_rows * ctx:
        raise ValueError(f"{len(ids)} tokens of task text, {n_rows * ctx} needed; pass more examples")
    return torch.tensor(ids, dtype=torch.long).view(n_rows, ctx)


def task_batch(tok, examples, device=None) -> dict[str, torch.Tensor]:
    """Task-registry examples as right-padded ``<bos> prompt completion <eos>`` rows labelled on
    the answer (:func:`encode`, :func:`pad`): the task loss is the answer's negative
    log-likelihood."""
    out = pad(encode(tok, [e.prompt for e in examples], [e.completion() for e in examples]),
              tok.pad_token_id)
    return {k: v.to(device) for k, v in out.items()} if device is not None else out
