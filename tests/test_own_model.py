"""A user's own model: every LM notebook's ``model`` takes a zoo name or a local
checkpoint directory; a directory a notebook cannot use is refused before a kernel starts.

Fast: the refusals (through the runner, ``batch.validate_params``, and in the kernel,
``runtime.check_limits``), the content hash, loading a re-saved zoo model. Slow: four
architectures through notebooks 14, 16, 07 and 19 at smoke, and a re-saved zoo model giving its
zoo name's numbers (14)."""
import json
import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from workbench import batch, cli, evaluate, runtime
from workbench.experiments import hint_tuning
from workbench.models import adapters, checkpoint, clip, finetune, zoo
from workbench.notebooks import resolve


def _save(model, tok, d):
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def tiny(kind: str, d, tok):
    """A seeded random tiny model of ``kind`` (llama, gpt2, mistral) saved with ``tok`` in ``d``."""
    torch.manual_seed(0)
    v = len(tok)
    if kind == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=v, n_embd=32, n_layer=1, n_head=2,
                                       n_positions=64))
    elif kind == "mistral":
        m = MistralForCausalLM(MistralConfig(vocab_size=v, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, sliding_window=None))
    else:
        m = LlamaForCausalLM(LlamaConfig(vocab_size=v, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2))
    return _save(m, tok, d)


@pytest.fixture(scope="module")
def micro_tok():
    return zoo.load("lm-micro")[1]


@pytest.fixture()
def llama_dir(tmp_path, micro_tok):
    return tiny("llama", tmp_path / "my-llama", micro_tok)


def runner(slug, **params):
    """The runner's check of ``-p`` values (what ``workbench run`` does before any job)."""
    return batch.validate_params(resolve(slug), {k: [str(v)] for k, v in params.items()})


# -- refusals ---------------------------------------------------------------------------------

def test_a_zoo_name_and_a_good_checkpoint_pass(llama_dir):
    assert runner("14-gsq", model="lm-base") == {"model": ["lm-base"]}
    # 32 wide: too small for 14's vector frontier (tests/test_own_model_fit.py), fine for 10
    assert runner("10-hestia", model=llama_dir) == {"model": [str(llama_dir)]}
    assert checkpoint.validate_params("16-fura", {"model": str(llama_dir)}) == []


def test_a_relative_checkpoint_path_reaches_the_kernel_absolute(llama_dir, monkeypatch):
    monkeypatch.chdir(llama_dir.parent)
    assert runner("10-hestia", model="./my-llama") == {"model": [str(llama_dir.resolve())]}


def test_a_path_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(batch.ParameterError, match=r"14-gsq: model = .*no such directory"):
        runner("14-gsq", model=tmp_path / "nowhere")


def test_an_unknown_zoo_name_is_refused_with_the_known_ones():
    with pytest.raises(batch.ParameterError, match="neither a zoo model .*lm-base.* nor a dir"):
        runner("16-fura", model="lm-bsae")


def test_a_directory_without_config_json_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(batch.ParameterError, match="model = .*no config.json.*save_pretrained"):
        runner("19-nbdiff", model=tmp_path / "empty")


def test_a_directory_without_a_tokenizer_is_refused(llama_dir):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (llama_dir / f).unlink()
    with pytest.raises(batch.ParameterError, match="no tokenizer .*tokenizer.save_pretrained"):
        runner("07-hilora", model=llama_dir)


def test_an_architecture_without_the_method_modules_is_refused_naming_them(tmp_path, micro_tok):
    gpt2 = tiny("gpt2", tmp_path / "my-gpt2", micro_tok)
    with pytest.raises(batch.ParameterError,
                       match=r"16-fura: model = .*q_proj.*GPT2LMHeadModel has no q_proj, "
                             r"k_proj, v_proj, o_proj"):
        runner("16-fura", model=gpt2)
    with pytest.raises(batch.ParameterError, match="Llama-style decoder layers.*model.layers"):
        runner("14-gsq", model=gpt2)
    assert runner("19-nbdiff", model=gpt2)            # 19 needs a causal LM only
    assert runner("07-hilora", model=gpt2)            # peft's LoRA wraps GPT-2's Conv1D


def without(d, token: str):
    """``d``'s tokenizer config without its ``token`` (``pad_token``, ``bos_token``)."""
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop(token, None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_a_tokenizer_without_a_pad_token_warns_and_the_loader_uses_eos(llama_dir):
    without(llama_dir, "pad_token")
    (w,) = checkpoint.validate(llama_dir, "model")
    assert "no pad token" in w and "eos" in w
    with pytest.warns(UserWarning, match="no pad token"):
        _, tok = zoo.load(str(llama_dir))
    assert tok.pad_token == tok.eos_token is not None


def test_a_tokenizer_without_a_bos_token_warns_and_prompts_start_with_eos(llama_dir):
    without(llama_dir, "bos_token")                 # as Qwen2's tokenizers ship
    (w,) = checkpoint.validate(llama_dir, "model")
    assert "no bos token" in w and "eos" in w
    with pytest.warns(UserWarning, match="no bos token"):
        model, tok = zoo.load(str(llama_dir))
    assert tok.bos_token == tok.eos_token is not None
    assert len(evaluate.generate(model, tok, ["add 1 2 ="], max_new_tokens=2)) == 1
    without(llama_dir, "eos_token")                 # nothing to start a prompt with: refused
    with pytest.raises(checkpoint.CheckpointError, match="neither a bos nor an eos"):
        checkpoint.validate(llama_dir, "model")


def test_a_chat_template_frames_the_instruct_models_questions(llama_dir):
    cfg = json.loads((llama_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (llama_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = zoo.tokenizer(str(llama_dir))
    # the template's own <bos> is dropped: generate and the trainers put one before every prompt
    assert evaluate.chat_prompt(tok, "add 1 2 =") == "<|user|>add 1 2 =<|assistant|>"
    assert evaluate.chat_prompt(zoo.tokenizer("lm-micro"), "add 1 2 =") == "add 1 2 ="
    prompts, _ = hint_tuning.reader_data(["add"], 2, render=lambda t: evaluate.chat_prompt(tok, t))
    assert prompts and all(p.startswith("<|user|>") and p.endswith("<|assistant|>") for p in prompts)


def test_a_model_too_large_for_the_device_is_refused_from_its_config(llama_dir, monkeypatch):
    n = checkpoint.estimate(llama_dir)["parameters"]
    assert n == sum(p.numel() for p in zoo.load(str(llama_dir))[0].parameters())
    monkeypatch.setattr(checkpoint, "device_bytes", lambda device=None: ("GPU 0", 4 * n))
    with pytest.raises(batch.ParameterError, match=r"16-fura: model = .*working copies, more "
                                                   r"than 90% .* GPU 0; choose a smaller"):
        runner("16-fura", model=llama_dir)


def test_the_kernel_checks_again(tmp_path, llama_dir):
    with pytest.raises(checkpoint.CheckpointError, match="14-gsq: model = .*no such directory"):
        runtime.check_limits({"model": str(tmp_path / "nowhere"), "device": "cpu"}, "14-gsq")
    runtime.check_limits({"model": str(llama_dir), "device": "cpu"}, "14-gsq")


def test_an_old_parameter_name_is_refused_naming_the_new_one():
    for slug, old, new in [("14-gsq", "model_name", "model"), ("16-fura", "base", "model"),
                           ("06-hint-tuning", "reasoning", "reasoning_model"),
                           ("18-loss-signature-curation", "model_teacher", "teacher_model"),
                           ("11-haps", "candidates", "candidate_models")]:
        with pytest.raises(batch.ParameterError, match=f"'{old}' is now '{new}'"):
            runner(slug, **{old: "lm-base"})


def test_every_lm_notebook_names_its_model_parameters_as_the_convention_says():
    for slug, needs in checkpoint.NOTEBOOK_NEEDS.items():
        spec = batch.parameters(resolve(slug).path)
        assert set(needs) <= set(spec), slug
    lm = {s for s, n in checkpoint.NOTEBOOK_NEEDS.items() if "model" in n}
    assert lm == {"01-inducekv", "02-lqzo", "04-hybrid-lora", "05-lora-bottleneck-rank",
                  "07-hilora", "10-hestia", "13-frechet-merging", "14-gsq", "16-fura",
                  "18-loss-signature-curation", "19-nbdiff"}


def tiny_clip(d):
    """A seeded random CLIP on 32-px images (the workbench renders 16 px) with a processor."""
    from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor,
                              CLIPTextConfig, CLIPVisionConfig)
    tok = clip.tokenizer()
    torch.manual_seed(0)
    text = CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16,
                          projection_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=3)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8,
                              projection_dim=16)
    CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         projection_dim=16)).save_pretrained(d)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tok).save_pretrained(d)
    return d


def test_a_local_clip_loads_and_sees_the_workbench_images(tmp_path):
    d = tiny_clip(tmp_path / "my-clip")
    assert runner("15-fewshot-clip-optimizers", clip_model=d)
    model, tok = clip.load_model(str(d))
    x = torch.rand(3, 3, 16, 16)
    assert clip.pixels(model, x).shape == (3, 3, 32, 32)         # resized, then normalised
    assert clip.image_features(model, x).shape == (3, 16)
    assert model.zoo_card["key"] == checkpoint.content_hash(d)
    mini, _ = clip.load_model(None)
    assert clip.pixels(mini, x) is x                             # the mini-CLIP: unchanged
    (d / "processor_config.json").unlink()
    with pytest.raises(batch.ParameterError, match="03-hdca: clip_model = .*no CLIP processor"):
        runner("03-hdca", clip_model=d)


def test_a_mistral_goes_through_gguf_as_the_llama_it_is(tmp_path, micro_tok):
    from workbench import evaluate
    from workbench.quant import gguf
    m, tok = zoo.load(str(tiny("mistral", tmp_path / "mistral", micro_tok)))
    gguf.export_model_gguf(m, tmp_path / "mistral.gguf", qtype="F32", tokenizer=tok)
    back, _ = gguf.load_transformers(tmp_path / "mistral.gguf")
    x = torch.randint(3, len(tok), (2, 16))
    assert evaluate.perplexity(back, x) == pytest.approx(evaluate.perplexity(m, x), rel=1e-6)


# -- hashing, keys, loading -------------------------------------------------------------------

def test_the_content_hash_keys_derived_caches_and_follows_the_weights(llama_dir, tmp_path):
    h = checkpoint.content_hash(llama_dir)
    assert zoo.key(str(llama_dir)) == h == zoo.key(str(llama_dir), "full")
    copy = shutil.copytree(llama_dir, tmp_path / "copy")
    assert checkpoint.content_hash(copy) == h                 # content, not the path
    assert adapters.pool_dir(str(llama_dir)).name.startswith("my-llama-smoke-")
    m = zoo.load(str(copy))[0]
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)
    m.save_pretrained(copy)
    assert checkpoint.content_hash(copy) != h
    assert zoo.key("lm-base") == zoo.recipe("lm-base").key("smoke")


def test_a_re_saved_zoo_model_loads_as_the_zoo_one(tmp_path):
    d = zoo.export("lm-base", tmp_path / "lm-base-copy")
    a, ta = zoo.load("lm-base")
    b, tb = zoo.load(str(d))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))
    text = "reverse: abc =>"
    assert ta(text)["input_ids"] == tb(text)["input_ids"] and tb.padding_side == "left"
    assert zoo.with_steps(str(d)) == zoo.recipe("lm-base").with_steps
    assert b.zoo_card["key"] == checkpoint.content_hash(d)
    assert b.zoo_card["zoo_key"] == a.zoo_card["key"]


def test_ensure_finds_a_checkpoint_built(llama_dir):
    assert zoo.ensure(str(llama_dir)) == (llama_dir.resolve(), False)


def test_a_re_saved_qwen2_keeps_the_tokenizer_it_was_trained_with(tmp_path):
    from workbench.quant import gguf
    d = zoo.export("lm-qwen2", tmp_path / "qwen2")
    a, b = zoo.load("lm-qwen2")[1], zoo.load(str(d))[1]
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert gguf.tokenizer_pre(b) == "refact"          # what 14's GGUF files need


def test_a_checkpoint_without_a_card_gets_a_minimal_one(llama_dir):
    m, _ = zoo.load(str(llama_dir))
    card = m.zoo_card
    assert card["name"] == "my-llama" and card["parameters"] > 0 and card["tokens_seen"] is None
    assert set(card["trained_tasks"]) == set(zoo.ALL_FAMILIES) and not zoo.with_steps(
        str(llama_dir))


def test_cached_fine_tunes_key_on_the_checkpoint(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(finetune.cache, "folder", lambda *parts: tmp_path)
    s = finetune.LoraSettings(rank=2, steps=2, batch=2)
    _, _, info = finetune.cached_lora(str(llama_dir), "smoke", ["a =>", "b =>"], [" a", " b"], s)
    assert info["base_key"] == checkpoint.content_hash(llama_dir)
    assert "my-llama" in info["path"] and not info["cached"]


# -- four architectures through the notebooks (slow) --------------------------------------------

@pytest.fixture(scope="module")
def own_models(tmp_path_factory):
    """Llama, Qwen2 and GPT-2 zoo models re-saved outside the cache, and a random Mistral (an
    architecture the zoo never builds) with lm-base's tokenizer and widths. Four key-value heads,
    as many as query heads: with two, k_proj and v_proj have 64 output rows, and 14's GPTVQ
    frontier finds no codebook block of 64 rows within its 3.125 bits per weight (a real model's
    projections have hundreds of rows)."""
    root = tmp_path_factory.mktemp("own")
    out = {n: zoo.export(f"lm-{n}" if n != "llama" else "lm-base", root / n)
           for n in ("llama", "qwen2", "gpt2")}
    base, tok = zoo.load("lm-base")
    c = base.config
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings,
        sliding_window=None, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id))
    out["mistral"] = _save(mistral, tok, root / "mistral")
    return out


# what each notebook refuses (the runner's exit status 2, before a kernel starts)
REFUSED = {("14-gsq", "gpt2"), ("16-fura", "gpt2")}


def run_notebook(slug, model, out, strict=True, monkeypatch=None):
    if not strict:
        monkeypatch.setenv("WORKBENCH_STRICT", "0")    # a random model's claims may not hold
    return cli.main(["run", slug, "-p", "model", str(model), "--out", str(out), "--jobs", "1",
                     "--timeout", "3600"])   # a new model builds its fine-tunes and pool


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.architectures
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral"])
@pytest.mark.parametrize("slug", ["14-gsq", "16-fura", "07-hilora", "19-nbdiff"])
def test_four_architectures_through_the_notebooks(slug, arch, own_models, tmp_path, capsys,
                                                  monkeypatch):
    rc = run_notebook(slug, own_models[arch], tmp_path / "run", strict=False,
                      monkeypatch=monkeypatch)
    text = capsys.readouterr()
    if (slug, arch) in REFUSED:
        assert rc == 2 and "needs" in text.err and "has no" in text.err
        return
    assert rc == 0, text.out[-3000:] + text.err[-3000:]
    m = json.loads(next((tmp_path / "run").rglob("metrics.json")).read_text())
    assert m["params"]["model"] == str(own_models[arch]) and m["claims"]


@pytest.mark.slow
@pytest.mark.notebook
def test_a_re_saved_zoo_model_gives_the_zoo_names_numbers(tmp_path, capsys):
    d = zoo.export("lm-qbed", tmp_path / "lm-qbed")
    metrics = {}
    for name in ("lm-qbed", d):
        out = tmp_path / f"run-{zoo.label(str(name))}-{len(metrics)}"
        assert run_notebook("14-gsq", name, out) == 0, capsys.readouterr().out[-3000:]
        metrics[len(metrics)] = json.loads(next(out.rglob("metrics.json")).read_text())
    a, b = metrics[0], metrics[1]
    keys = [k for k, v in a["metrics"].items() if isinstance(v, (int, float))
            and not any(t in k for t in ("second", "timing")) and not k.endswith("_s")]
    assert len(keys) > 20
    assert {k: a["metrics"][k] for k in keys} == {k: b["metrics"][k] for k in keys}
    assert [c["holds"] for c in a["claims"]] == [c["holds"] for c in b["claims"]]


@pytest.mark.slow
@pytest.mark.notebook
def test_a_qwen3_runs_through_notebook_05(tmp_path, capsys, monkeypatch):
    """Beyond the four architectures: a random Qwen3 with lm-base's tokenizer and widths, its
    own head_dim (q/k norms, a head_dim other than hidden / heads) and grouped-query attention,
    through 05 at smoke end to end (it builds nothing: about a minute on 2 cores)."""
    base, tok = zoo.load("lm-base")
    c = base.config
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id))
    d = _save(qwen3, tok, tmp_path / "my-qwen3")
    rc = run_notebook("05-lora-bottleneck-rank", d, tmp_path / "run", strict=False,
                      monkeypatch=monkeypatch)
    text = capsys.readouterr()
    assert rc == 0, text.out[-3000:] + text.err[-3000:]
    m = json.loads(next((tmp_path / "run").rglob("metrics.json")).read_text())
    assert m["params"]["model"] == str(d) and m["claims"]
