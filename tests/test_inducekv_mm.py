"""InduceKV's continual-VQA stream and trained-gate MoE (paper 01): the image prefix
reaches the LM's input embeddings, an entry of an image prompt is still its prefix in context,
the gate's weights sum to 1 over the live experts and move with training, and the hooked LoRA
mixture with a one-hot gate is the peft model of that expert. Tiny random models only."""
import copy

import numpy as np
import torch

from workbench.data import packing, tasks
from workbench.methods import inducekv as K
from workbench.methods import inducekv_baselines as KB
from workbench.methods import inducekv_mm as MM
from tiny_models import CharTok, tiny_llama

K_IMG = 3


def _mm(n_images=4, seed=0):
    """A tiny Llama with a prefix of ``n_images`` random CLIP-like features, and its tokenizer."""
    model, tok = tiny_llama(n_layers=2)
    g = torch.Generator().manual_seed(seed)
    feats = torch.nn.functional.normalize(torch.randn(n_images, 8, generator=g), dim=-1)
    proj = MM.Projector(8, model.config.hidden_size, K_IMG, hidden=16, seed=1)
    MM.install(model, proj, feats)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, MM.ImageTokenizer(CharTok(), K_IMG)


def _ex(n, q="what ->", a="ab"):
    return tasks.Example("vqa-t", f"{MM.marker(n)} {q}", a, 0)


def test_image_tokenizer_places_the_images_placeholders():
    tok = MM.ImageTokenizer(CharTok(), K_IMG)
    ids = tok(f"{MM.marker(2)} ab")["input_ids"]
    V = len(CharTok())
    assert ids[:K_IMG] == [V + 2 * K_IMG + j for j in range(K_IMG)]
    assert ids[K_IMG:] == CharTok()(" ab")["input_ids"]


def test_the_prefix_reaches_the_lms_input_embeddings():
    """Placeholder ids give exactly the logits of ``inputs_embeds`` = text embeddings with
    ``projector(features[n])`` after <bos>; another image changes them."""
    model, tok = _mm()
    (ids, _), = packing.encode(tok, [_ex(1).prompt])
    text = torch.tensor([ids[:1] + ids[1 + K_IMG:]])
    with torch.no_grad():
        got = model(input_ids=torch.tensor([ids])).logits
        ref = model(inputs_embeds=MM.prefix_embeds(model, text, [1])).logits
        emb = model.get_input_embeddings()(torch.tensor([ids]))[0, 1: 1 + K_IMG]
        proj = model.get_input_embeddings().projector(model.get_input_embeddings().features[1:2])
        (ids2, _), = packing.encode(tok, [_ex(2).prompt])
        other = model(input_ids=torch.tensor([ids2])).logits
    assert torch.allclose(emb, proj[0])
    assert torch.allclose(got, ref, atol=1e-6)
    assert (got - other).abs().max() > 1e-3


def test_an_image_entry_is_its_prefix_in_context():
    """C1 on the multimodal backbone: an entry of ``<bos> image question answer <eos>`` in the
    cache equals running that prefix (image embeddings included) before the query."""
    model, tok = _mm()
    e = K.make_entry(model, tok, _ex(0), "vqa-t")
    (qi, _), = packing.encode(tok, [_ex(3).prompt], [" ab"])
    with torch.no_grad():
        full = model(input_ids=torch.tensor([e.ids + qi])).logits[0, e.length:]
        cached = K.forward_with_entries(model, [e], torch.tensor([qi])).logits[0]
    assert e.length == 1 + K_IMG + len(" what -> ab") + 1
    assert torch.allclose(full, cached, atol=1e-5)


def test_projector_training_moves_only_the_projector():
    """Caption training through the frozen LM changes the projector and nothing else."""
    from workbench.models import finetune
    model, tok = _mm()
    proj = model.get_input_embeddings().projector
    for p in proj.parameters():
        p.requires_grad_(True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pairs = packing.encode(tok, [MM.marker(i) for i in range(4)], [" ab", " cd", " ab", " cd"])
    finetune.train_steps(model, pairs, 3, 4, 1e-2, 0, tok.pad_token_id)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all("projector" in k for k in changed)


def _experts(model, n=3):
    """``n`` random LoRA states on ``model`` (non-zero B) and the peft model they belong to."""
    pm = KB.fresh_lora(copy.deepcopy(model), seed=0, rank=2)
    states = []
    for i in range(n):
        torch.manual_seed(10 + i)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn_like(p) * 0.3)
        states.append(KB.lora_state(pm))
    return pm, states


def test_mixture_with_a_one_hot_gate_is_that_expert():
    model, _ = tiny_llama(n_layers=2)
    pm, states = _experts(model)
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 11, 12]])
    with KB.LoraMixture(model, states) as mix, torch.no_grad():
        mix.weights = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
        got = model(input_ids=ids).logits
        KB.set_lora_state(pm, states[1])
        ref = pm(input_ids=ids).logits
    with torch.no_grad():
        plain = model(input_ids=ids).logits            # hooks removed: the base model again
    assert torch.allclose(got, ref, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3
    with KB.LoraMixture(model, states) as mix, torch.no_grad():
        mix.weights = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
        mix_half = model(input_ids=ids).logits
    assert not torch.allclose(mix_half[0], got[0], atol=1e-4)


def test_gate_weights_sum_to_one_over_live_experts_and_move_with_training():
    model, tok = _mm()
    _, states = _experts(model)
    gate = KB.Gate(model.config.hidden_size, 3, seed=0)
    exs = [_ex(i % 4, a="ab" if i % 2 else "cd") for i in range(8)]
    pairs = packing.encode(tok, [e.prompt for e in exs], [e.completion() for e in exs])
    q = K.query_keys(model, tok, exs)
    w0 = gate(q, [0, 1]).detach()
    assert torch.allclose(w0.sum(1), torch.ones(len(q)))
    assert (w0[:, 2] == 0).all()
    with KB.LoraMixture(model, states) as mix:
        losses = KB.train_gate(model, mix, gate, pairs, q, [0, 1], steps=15, batch=8, lr=0.2,
                               seed=0, pad_id=tok.pad_token_id)
        w1 = gate(q, [0, 1]).detach()
        _, exact = KB.gated_scores(model, mix, w1, tok, exs)
    assert torch.allclose(w1.sum(1), torch.ones(len(q)))
    assert (w1 - w0).abs().max() > 1e-2
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert exact.shape == (8,)
    assert gate.nbytes(2) == 2 * (model.config.hidden_size + 1) * 4


def test_vqa_data_pairs_every_example_with_its_own_image():
    """The stream's examples: one image per example (its marker indexes the images), answers
    read from the image's class, test images apart from training ones."""
    from workbench.data import images
    from workbench.experiments import inducekv as lab
    items = lab.vqa_stream("digit colour")
    assert [n for n, _, _ in items] == ["digit", "colour"]
    tok = MM.ImageTokenizer(CharTok(), K_IMG)
    sizes = {"n_pool": 4, "n_probe": 2, "n_test": 5, "vqa_train": 6}
    data, x = lab.vqa_data(tok, items, sizes, seed=0)
    exs = [e for n, _, _ in items for part in ("test", "pool", "probes", "train")
           for e in data[n][part]]
    marks = [int(e.prompt.split(">")[0].split(":")[1]) for e in exs]
    assert sorted(marks) == list(range(len(x))) and x.shape[1:] == (3, 16, 16)
    assert all(e.target in images.COLOURS for e in data["colour"]["test"])
    assert all(e.target in images.DIGIT_NAMES for e in data["digit"]["train"])
    assert len(data["digit"]["pool"]) == 4 and len(data["colour"]["pairs"]) == 6
    assert data["digit"]["pairs"][0][0][1] >= len(CharTok())       # the image after <bos>
