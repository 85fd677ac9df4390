"""Every LM notebook's model parameters against every decoder architecture of the installed
transformers: for each (notebook, parameter, architecture) either the runner's check
(``checkpoint.validate_params`` with ``fit``, what ``--dry-run`` runs) refuses the checkpoint with
a message naming the parameter, or the harness entry points the notebook calls on that model (the
loader, a forward, the method's core call at tiny sizes) run on it. The expected refusals are
listed (:data:`REFUSED`), so an architecture that starts or stops passing a check shows here.

The architectures are small random checkpoints (hidden 64 or 96, two layers) saved with the zoo's
tokenizer: Llama (untied, RMSNorm, grouped-query attention), a Llama with hidden 96 and Llama-3
rotary scaling, Mistral, Qwen2 (q/k/v biases, tied), Qwen3 (q/k norms, head_dim of its own),
GPT-2 (LayerNorm, Conv1D, learned positions), Gemma (GeGLU, scaled embeddings), Gemma2 (extra
norms, soft-capping), Phi-3 (fused qkv_proj and gate_up_proj, partial rotary) and GPT-NeoX
(LayerNorm, partial rotary, parallel residual). 14 reads its own wider copies (hidden 128, as many
key-value heads as query heads): its vector frontier refuses narrower layers
(``tests/test_own_model_fit.py``). The checkpoint variants (float32, float16 and bfloat16 weights,
one file or shards, a base or a chat-template tokenizer) only change the loading path, so they go
through the loader alone."""
import copy
import json

import numpy as np
import pytest
import torch
import transformers as T

from workbench import evaluate
from workbench.data import corpus, packing, tasks
from workbench.models import checkpoint, finetune, zoo

CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _config(arch: str, v: int, wide: bool):
    """The config of a two-layer random ``arch`` model with a ``v``-token vocabulary."""
    h, heads, kv, ffn = (128, 4, 4, 256) if wide else (64, 4, 2, 128)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common = dict(vocab_size=v, hidden_size=h, intermediate_size=ffn, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=128, **ids)
    if arch == "llama":
        return T.LlamaConfig(**common)
    if arch == "llama-96":                  # hidden 3 x 32, Llama-3's rotary scaling
        return T.LlamaConfig(**{**common, "hidden_size": 96, "num_attention_heads": 3,
                                "num_key_value_heads": 1, "intermediate_size": 160},
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    if arch == "mistral":
        return T.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return T.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return T.Qwen3Config(**common, head_dim=32 if wide else 24, tie_word_embeddings=True)
    if arch == "gemma":
        return T.GemmaConfig(**common, head_dim=h // heads)
    if arch == "gemma2":
        return T.Gemma2Config(**common, head_dim=h // heads)
    if arch == "phi3":
        return T.Phi3Config(**common, partial_rotary_factor=0.5)
    if arch == "gpt2":
        return T.GPT2Config(vocab_size=v, n_embd=h, n_layer=2, n_head=heads, n_positions=128,
                            **ids)
    if arch == "gpt_neox":
        return T.GPTNeoXConfig(vocab_size=v, hidden_size=h, intermediate_size=ffn,
                               num_hidden_layers=2, num_attention_heads=heads,
                               max_position_embeddings=128, rotary_pct=0.25,
                               use_parallel_residual=True, tie_word_embeddings=False, **ids)
    raise KeyError(arch)


ARCHS = ["llama", "llama-96", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "phi3",
         "gpt_neox"]


@pytest.fixture(scope="module")
def tok():
    return zoo.tokenizer("lm-micro")


def save(d, arch, tok, *, wide=False, dtype=torch.float32, shard=False, chat=False):
    """A seeded random ``arch`` checkpoint in ``d``: weights in ``dtype``, in shards or one file,
    with the zoo's tokenizer (a chat template added when ``chat``)."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(_config(arch, len(tok), wide))
    with torch.no_grad():                   # off the init of ones, so a dropped norm shows
        for n, p in model.named_parameters():
            if "norm" in n or "ln" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(d, max_shard_size="40KB" if shard else "5GB")
    tok.save_pretrained(d)
    if chat:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = CHAT
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tok):
    """``ckpt(arch, wide=False)``: the directory of that checkpoint, saved once per module."""
    root, made = tmp_path_factory.mktemp("archs"), {}

    def get(arch, wide=False):
        key = (arch, wide)
        if key not in made:
            made[key] = save(root / f"my-{arch}{'-wide' * wide}", arch, tok, wide=wide)
        return made[key]
    return get


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Whatever a harness caches (fine-tunes, pools) goes to this test's folder."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))


# -- the loading path: dtypes, shards, tokenizers ---------------------------------------------------

VARIANTS = [(a, dt, sh, ch) for a in ("llama", "gpt2") for dt in ("float32", "float16", "bfloat16")
            for sh in (False, True) for ch in ((False, True) if a == "llama" else (False,))]


@pytest.mark.parametrize("arch,dtype,shard,chat", VARIANTS,
                         ids=[f"{a}-{d}-{'sharded' if s else 'one-file'}-{'chat' if c else 'base'}"
                              for a, d, s, c in VARIANTS])
def test_a_checkpoint_loads_in_float32_whatever_it_was_saved_as(arch, dtype, shard, chat, tok,
                                                                tmp_path):
    dt = getattr(torch, dtype)
    d = save(tmp_path / "ckpt", arch, tok, dtype=dt, shard=shard, chat=chat)
    names = {p.name for p in d.iterdir()}
    assert shard == any("-of-" in n for n in names), names
    assert checkpoint.validate_params("19-nbdiff", {"model": str(d)}, scale="smoke") == []
    est = checkpoint.estimate(d)
    model, tk = zoo.load(str(d))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert est["parameters"] == sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    ref = T.AutoModelForCausalLM.from_config(_config(arch, len(tok), False))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n or "ln" in n:
                p.add_(0.1 * torch.randn_like(p))
    tol = {"float32": 0.0, "float16": 1e-3, "bfloat16": 1e-2}[dtype]
    got = dict(model.named_parameters())
    for n, p in ref.named_parameters():          # the saved weights, upcast exactly
        assert torch.allclose(got[n], p.to(dt).float(), atol=0, rtol=0), n
        assert torch.allclose(got[n], p, atol=tol * max(1.0, float(p.detach().abs().max())), rtol=0), n
    x = torch.randint(3, len(tk), (2, 12))
    assert np.isfinite(evaluate.perplexity(model, x))
    assert tk("add 1 2 =")["input_ids"] == tok("add 1 2 =")["input_ids"]
    assert (tk.chat_template is not None) == chat
    prompt = evaluate.chat_prompt(tk, "add 1 2 =")
    assert prompt == ("<|user|>add 1 2 =<|assistant|>" if chat else "add 1 2 =")
    assert len(evaluate.generate(model, tk, [prompt], max_new_tokens=2)) == 1
    assert model.zoo_card["key"] == checkpoint.content_hash(d)


# -- the harness path: each notebook's entry points on each architecture ----------------------------

def _examples(family="add", n=4, seed=0):
    return tasks.generate(family, n, seed=seed, difficulty=tasks.get(family).difficulties[0])


def _pairs(tok, n=4):
    exs = _examples(n=n)
    return packing.encode(tok, [e.prompt for e in exs], [e.completion(False) for e in exs])


def _lora(model, tok, steps=1):
    """A LoRA on every projection peft wraps, trained ``steps`` steps (the pool's loop)."""
    peft_model = finetune.lora_model(model, rank=2, scale=2.0, seed=0)
    losses = finetune.train_steps(peft_model, _pairs(tok), steps, 2, 1e-3, 0, tok.pad_token_id)
    assert all(np.isfinite(losses))
    return peft_model.eval()


def core_01(path):
    from workbench.experiments import inducekv as lab
    lm, tok = lab.frozen_backbone(path, "smoke", "cpu")
    data = {"sort": {"pool": tasks.generate("sort", 3, seed=1, difficulty=2),
                     "test": tasks.generate("sort", 1, seed=2, difficulty=2)}}
    c1 = lab.equivalence_table(lm, tok, data, ["sort"], False)   # an entry = its prefix text
    assert (c1.max_logit_diff < 1e-4).all(), c1
    assert (c1.wrong_positions_diff > 100 * c1.max_logit_diff.max()).all(), c1
    assert lab.generate_matches(lm, tok, data, ["sort"], False, per_task=1,
                                max_new_tokens=2) == [True]


def core_02(path):
    from workbench.experiments import lqzo as lab
    from workbench.methods import lqzo as method
    lm, tok = zoo.load(path, "smoke", device="cpu")
    data = lab.task_data(tok, "add", tasks.get("add").difficulties[0], 0, "cpu", n_pool=8,
                         n_held=4)
    qmodel, scales = method.quantize(lm, 3, 32)
    probe = lab.subset(data["train"], torch.arange(2))
    assert np.isfinite(float(lab.lm_loss(qmodel, probe)))
    base = lab.heldout_scores({"fp": lm, "quant": qmodel}, data, tok)
    assert set(base) == {"fp", "quant"}


def core_04(path):
    from workbench.experiments import hybrid_lora as lab
    model, tok = zoo.load(path, "smoke", device="cpu")
    bed = lab.problems("add", tasks.get("add").difficulties[0], 1, 1, 0, n_val=1)
    start = lab.base_rewards(model, tok, bed["held"], 2, 2, 0, sampled=1)
    assert 0 <= start["greedy"] <= 1
    sc = lab.score_modules(model, tok, bed["probe_a"], bed["probe_b"], group=2, max_new_tokens=2,
                           rank=2, budget=0.25, seed=0)
    assert sc["chosen"] and set(sc["chosen"]) <= set(sc["names"])


def core_05(path):
    from workbench.experiments import lora_bottleneck_rank as lab
    from workbench.methods import lora_bottleneck_rank as method
    lm, tok = lab.frozen_lm(path, "smoke", "cpu")
    last, names = lab.attention_names(lm)
    batch = lab.task_examples_batch(tok, "add", 4, 0, lm.device)
    feats = method.block_features(lm, batch)
    xf = feats["x"][method.feeding_positions(batch["labels"])]
    assert xf.shape[1] == lm.config.hidden_size
    base_loss = float(method.lm_loss(lm, batch))
    g = torch.Generator().manual_seed(0)
    assert lab.invisibility(lm, names, xf, batch, base_loss, g) is not None
    assert set(lab.constant_key_change(lm, names["k_proj"], batch, g)) == {"no_rope", "rope"}
    bases = method.attention_bases(feats, batch["labels"])
    dh, kv = bases["ranks"]["head_dim"], len(bases["value_heads"])
    assert kv * dh == lm.get_submodule(names["v_proj"]).weight.shape[0]
    S = {"lm_lam": 1e-3, "lm_steps": 2, "lm_lr": 0.1}
    learned, nope = lab.learn_updates(lm, batch, names, S, dh)
    d = learned["value (per-head trace norm)"][0]
    assert len(lab.per_head_ranks(d, dh, kv)) == kv
    assert 0 <= method.value_outside_energy(d, bases["value_heads"]) <= 1 + 1e-9


def core_06_instruct(path):
    from workbench.experiments import hint_tuning as lab
    model, tok = zoo.load(path, "smoke", device="cpu")
    problems = lab.draw_problems(["add"], "test", 2, np.random.default_rng(0))
    ev = lab.measure(model, tok, problems, 4)
    assert len(ev) == len(problems)
    prompts, _ = lab.reader_data(["add"], 1, render=lambda t: evaluate.chat_prompt(tok, t))
    assert prompts


def core_06_reasoning(path):
    from workbench.experiments import hint_tuning as lab
    model, tok = zoo.load(path, "smoke", device="cpu")
    problems = lab.draw_problems(["add"], "test", 2, np.random.default_rng(0))
    out = lab.truncated_generate(model, tok, [e.prompt for e in problems], 4)
    assert len(out) == len(problems)
    _lora(model, tok)                      # the hint-tuned LoRA


def core_07(path):
    from workbench.methods import hilora as hl
    lm, tok = zoo.load(path, "smoke", device="cpu")
    peft_model = _lora(copy.deepcopy(lm), tok)
    factors = hl.lora_factors(peft_model, "default")
    assert factors
    hooks = hl.RocHooks(lm, [factors, factors])
    hooks.remove()


def core_10(path):
    from workbench.experiments import hestia as lab
    from workbench.methods import hestia as M
    S = {"ctx": 16, "train_blocks": 4, "task_fraction": 0.5, "eval_blocks": 2,
         "final_blocks": 2, "task_examples": 2}
    cfg = M.QATConfig(steps=1, batch=2)
    bed = lab.load_bed(path, "smoke", S, cfg, seed=0, device="cpu", task_family="add")
    model = copy.deepcopy(bed.base)
    layers = M.ternarize(model, "hestia")
    assert layers
    with M.mode_as(model, "hard"):
        assert np.isfinite(bed.score(model))


def core_11(path):
    from workbench.experiments import haps as lab
    from workbench.methods import haps as H
    model, tok = zoo.load(path, "smoke", device="cpu")
    losses, hits = lab.teacher_forced(model, tok, _examples(), False)
    assert len(losses) == 4
    mods = H.target_modules(model)
    assert mods


def core_13(path):
    from workbench.methods import frechet as method
    lm, tok = zoo.load(path, "smoke", device="cpu")
    peft_model = _lora(lm, tok)
    factors = method.get_factors(peft_model, "default")
    assert factors and all(b.dtype == torch.float64 for b, _ in factors.values())


def core_14(path):
    from workbench.experiments import gsq as lab
    from workbench.quant import gguf
    S = {"ctx": 16, "n_calib": 4, "heldout_blocks": 2}
    bed = lab.load_bed(path, "smoke", S, 0, "cpu")
    assert np.isfinite(bed.ppl_fp)
    weights, info = lab.baseline(bed, "rtn", 3, 32)
    assert np.isfinite(bed.ppl(weights))
    weights, info = lab.baseline(bed, "gptq", 3, 32)     # GSQ's start (gsq_start adds a scale
    assert set(weights) == set(bed.layers)                # search, seconds a layer on 2 cores)
    assert np.isfinite(bed.ppl(weights))
    assert gguf.unsupported(bed.model.config, bed.tok) is None     # C4's files (test_gguf*.py)


def core_16(path):
    from workbench.experiments import fura as lab
    model0, tok = zoo.load(path, "smoke", device="cpu")
    probe = lab.probe_batch(tok, ["add"], "cpu", n=2)
    W0 = lab.pretrained_weights(model0)
    init = lab.prepare(copy.deepcopy(model0), "fura", rank=2)
    assert lab.only_cores_trainable(init)
    assert lab.logit_change(model0, init, probe) < 1e-3
    lab.reconstruction(init, W0, 2)


def core_18_student(path):
    from workbench.experiments import loss_signature as lab
    model, tok = zoo.load(path, "smoke", device="cpu")
    problems = lab.draw_problems(["add"], 4, "train", np.random.default_rng(0))
    traces = lab.solver_traces(problems, 0.0, 0, "solver") * 8
    adapted = lab.adapt(model, tok, traces, np.random.default_rng(0), rank=2, steps=1, seed=0)
    sigs, counts = lab.pool_signatures(adapted, tok, traces[:4], [1.0], n_dirs=2, dir_rank=2,
                                       scales=[0.01, 0.1], seed=0, device="cpu")
    assert np.isfinite(np.asarray(sigs[1.0])).all()


def core_18_teacher(path):
    from workbench.experiments import loss_signature as lab
    model, tok = zoo.load(path, "smoke", device="cpu")
    problems = lab.draw_problems(["add"], 1, "train", np.random.default_rng(0))
    traces = lab.model_traces(model, tok, problems, "teacher")
    assert len(traces) == len(problems)


def core_19(path):
    from workbench.experiments import nbdiff as lab
    from workbench.methods import nbdiff as method
    ar, tok = zoo.load(path, "smoke", device="cpu")
    x = method.task_rows(tok, tasks.generate("reverse", 2, 0), 16)[0]
    c1 = lab.mask_reaches_model(ar, x, 16)
    assert c1["max_diff_causal_4d"] < 1e-4 < c1["max_diff_block4_4d"], c1
    tok = copy.deepcopy(tok)
    m = copy.deepcopy(ar)
    mask_id = method.add_mask_token(m, tok)
    x0, start = method.task_rows(tok, _examples(), 16)
    losses = method.adapt(m, x0, start, "nbdiff", steps=1, final=4, mask_id=mask_id, batch=2)
    assert np.isfinite(losses).all()
    m.eval()                               # as the notebook loads its adapted models
    c2 = lab.one_vs_two_pass({"nbdiff": m, "direct": m}, x0, start, ctx=16, size=4,
                             mask_id=mask_id, seed=0)
    assert (c2.abs_diff < 1e-3).all(), c2


CORES = {("01-inducekv", "model"): core_01, ("02-lqzo", "model"): core_02,
         ("04-hybrid-lora", "model"): core_04, ("05-lora-bottleneck-rank", "model"): core_05,
         ("06-hint-tuning", "instruct_model"): core_06_instruct,
         ("06-hint-tuning", "reasoning_model"): core_06_reasoning,
         ("07-hilora", "model"): core_07, ("10-hestia", "model"): core_10,
         ("11-haps", "candidate_models"): core_11, ("13-frechet-merging", "model"): core_13,
         ("14-gsq", "model"): core_14, ("16-fura", "model"): core_16,
         ("18-loss-signature-curation", "model"): core_18_student,
         ("18-loss-signature-curation", "teacher_model"): core_18_teacher,
         ("19-nbdiff", "model"): core_19}

# (notebook, parameter) -> {architecture: what its refusal says}: GPT-2 has fused Conv1D
# projections, Phi-3 fused qkv_proj and gate_up_proj, GPT-NeoX query_key_value and dense_* (no
# projection the LoRA pool's targets name); 11 routes over Llama, Qwen2 and GPT-2 only; 14 also
# needs 128 out-features per block linear (llama-96 has 32-row k/v), nothing beyond Llama's
# layer (Gemma2's extra norms) and an architecture its GGUF export maps (not Gemma)
_UNFUSED = {"gpt2": "has no q_proj", "phi3": "has no q_proj", "gpt_neox": "has no q_proj"}
_NO_LORA = {"gpt_neox": "has no q_proj or k_proj"}
REFUSED = {
    ("01-inducekv", "model"): _NO_LORA,
    ("02-lqzo", "model"): _UNFUSED,
    ("04-hybrid-lora", "model"): _UNFUSED,
    ("05-lora-bottleneck-rank", "model"): _UNFUSED,
    ("06-hint-tuning", "reasoning_model"): _NO_LORA,
    ("07-hilora", "model"): _NO_LORA,
    ("10-hestia", "model"): _UNFUSED,
    ("11-haps", "candidate_models"): {a: f"no model_type '{a}'" for a in
                                      ("mistral", "qwen3", "gemma", "gemma2", "phi3",
                                       "gpt_neox")},
    ("13-frechet-merging", "model"): _NO_LORA,
    ("14-gsq", "model"): {**_UNFUSED, "llama-96": "GPTVQ's 3-bit frontier",
                          "gemma": "not 'gemma'", "gemma2": "also hold pre_feedforward"},
    ("16-fura", "model"): _UNFUSED,
    ("18-loss-signature-curation", "model"): _UNFUSED,
}


def test_every_model_parameter_of_every_lm_notebook_is_in_the_matrix():
    lm = {(s, p) for s, needs in checkpoint.NOTEBOOK_NEEDS.items()
          for p, (kind, _, _) in needs.items() if kind == "lm"}
    assert set(CORES) == lm


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slug,param", list(CORES), ids=[f"{s[:2]}-{p}" for s, p in CORES])
def test_a_notebook_refuses_an_architecture_or_its_harness_runs_on_it(slug, param, arch, ckpt):
    path = str(ckpt(arch, wide=slug == "14-gsq"))
    try:
        checkpoint.validate_params(slug, {param: path}, scale="smoke")
    except checkpoint.CheckpointError as e:
        assert f"{slug}: {param} = " in str(e), e
        assert arch in REFUSED.get((slug, param), {}), f"unexpected refusal: {e}"
        assert REFUSED[(slug, param)][arch] in str(e), e
        return
    assert arch not in REFUSED.get((slug, param), {}), "accepted, but listed as refused"
    CORES[(slug, param)](path)
