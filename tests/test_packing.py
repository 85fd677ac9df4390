"""Task text as token rows: the one encoder and its three layouts (data/packing.py)."""
import pytest
import torch

from workbench.data import packing


class CharTok:
    """A stand-in tokenizer: one id per character, specials 0 (pad), 1 (bos), 2 (eos)."""
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(ch) for ch in t] for t in texts]}


TOK = CharTok()
A, B = ord("a"), ord("b")


def test_encode_labels_only_the_answer_and_eos():
    (ids, labels), = packing.encode(TOK, ["ab"], ["b"])
    assert ids == [1, A, B, B, 2]
    assert labels == [-100, -100, -100, B, 2]
    (ids, labels), = packing.encode(TOK, ["ab"])           # no completion: text only
    assert ids == [1, A, B, 2] and labels == [-100, -100, -100, 2]
    with pytest.raises(ValueError, match="2 prompts but 1"):
        packing.encode(TOK, ["a", "b"], ["c"])


def test_pad_right_pads_to_the_longest():
    out = packing.pad(packing.encode(TOK, ["a", "abab"], ["b", "a"]), TOK.pad_token_id)
    assert out["input_ids"].tolist() == [[1, A, B, 2, 0, 0, 0], [1, A, B, A, B, A, 2]]
    assert out["labels"].tolist() == [[-100, -100, B, 2, -100, -100, -100],
                                      [-100] * 5 + [A, 2]]


def test_pack_keeps_whole_examples_and_the_last_row():
    pairs = packing.encode(TOK, ["a", "ab", "abab", "a"], ["b"] * 4)   # lengths 4, 5, 7, 4
    ids, labels = packing.pack(pairs, ctx=9, pad_id=0)
    assert ids.shape == (3, 9)                    # [4+5], [7], [4]: the partial last row stays
    assert ids[0].tolist() == [1, A, B, 2, 1, A, B, B, 2]
    assert ids[2].tolist() == [1, A, B, 2] + [0] * 5
    assert labels[2].tolist() == [-100, -100, B, 2] + [-100] * 5
    assert (ids == 1).sum() == 4                  # every example, none split or dropped
    long = packing.encode(TOK, ["a" * 20], ["b"])
    ids, _ = packing.pack(long + pairs[:1], ctx=9, pad_id=0)   # too long for a row: skipped
    assert ids.shape == (1, 9)
    with pytest.raises(ValueError, match="no example fits"):
        packing.pack(long, ctx=9, pad_id=0)


def test_stream_cuts_back_to_back_examples_into_rows():
    pairs = packing.encode(TOK, ["ab", "a"])       # [1 a b 2] [1 a 2]
    rows = packing.stream(pairs, n_rows=2, ctx=3)
    assert rows.tolist() == [[1, A, B], [2, 1, A]]
    with pytest.raises(ValueError, match="7 tokens of task text, 8 needed"):
        packing.stream(pairs, n_rows=2, ctx=4)


def test_positions_restart_at_bos_and_make_packed_rows_independent():
    ids = torch.tensor([[1, A, B, 2, 1, A, 2, 0], [1, B, B, B, 2, 0, 0, 0]])
    pos = packing.positions(ids, TOK.bos_token_id)
    assert pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]]
    # transformers reads the restarts as packed sequences: the second example's logits are
    # those it has alone (block-diagonal attention), and without the positions they are not
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2)).eval()
    x = torch.randint(3, 128, (1, 10))
    x[0, 0] = x[0, 4] = 1
    alone = m(input_ids=x[:, 4:], use_cache=False).logits
    packed = m(input_ids=x, position_ids=packing.positions(x, 1), use_cache=False).logits
    plain = m(input_ids=x, use_cache=False).logits
    assert torch.allclose(packed[:, 4:], alone, atol=1e-5)
    assert not torch.allclose(plain[:, 4:], alone, atol=1e-3)
