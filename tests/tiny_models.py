"""Tiny models shared by several test files (imported by name: pytest puts tests/ on the path)."""
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


class CharTok:
    """A character tokenizer with the interface ``packing.encode`` and the harnesses use (one
    text or a list of texts)."""
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __init__(self):
        chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789+-*=>;?. "))
        self.vocab = {c: i + 3 for i, c in enumerate(chars)}

    def __len__(self):
        return len(self.vocab) + 3

    def __call__(self, texts, add_special_tokens=False):
        if isinstance(texts, str):
            return {"input_ids": [self.vocab[c] for c in texts]}
        return {"input_ids": [[self.vocab[c] for c in t] for t in texts]}


def tiny_llama(n_layers: int):
    """``(model, CharTok)``: a random 32-wide Llama, seeded, weights scaled up 4x so that
    positions matter more than in the default init."""
    torch.manual_seed(0)
    tok = CharTok()
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tok),
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model, tok


class TwoLayerNet(nn.Module):
    """16 -> 32 -> 4 with tanh, its linears under ``layers.0`` (what ``lqzo.quantize`` walks)."""
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.Tanh(),
                                                   nn.Linear(32, 4))])

    def forward(self, x):
        return self.layers[0](x)


def tiny_llama_two_loras():
    """``(base, peft model)``: a seeded 16-wide Llama and a copy carrying two random LoRAs,
    "t0" and "t1", on q/v/down projections (the LoRA-pool methods' tests)."""
    import copy
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2)
    base = LlamaForCausalLM(cfg).eval()
    lcfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(**lcfg), adapter_name="t0")
    peft.add_adapter("t1", LoraConfig(**lcfg))
    return base, peft.eval()
