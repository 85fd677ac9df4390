"""A user's own model against what a notebook's kernel needs of its shapes and files: refused
(exit 2, naming the parameter and what to do) by ``workbench run --dry-run`` and again in the
kernel, or, for an optional step, a warning and a skip with a note (``models.checkpoint.fit``).
Tiny random Llama, Qwen3, Gemma2 and Granite checkpoints, saved with the zoo's tokenizer, seconds
each."""
import json
import re

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM,
                          LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from workbench import cli, runtime
from workbench import quant as Q
from workbench.experiments import gsq as gsq_lab
from workbench.experiments import hestia as hestia_lab
from workbench.experiments import lqzo as lqzo_lab
from workbench.methods import gsq as gsq_method
from workbench.models import checkpoint, zoo
from workbench.notebooks import resolve

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
         "gemma2": (Gemma2Config, Gemma2ForCausalLM),
         "granite": (GraniteConfig, GraniteForCausalLM)}


@pytest.fixture(scope="module")
def tok():
    return zoo.tokenizer("lm-micro")


@pytest.fixture()
def make(tmp_path, tok):
    """``make(arch, hidden=, heads=, kv=, head_dim=, ffn=)``: a seeded random one-layer
    checkpoint of ``arch`` saved with the zoo's tokenizer; its directory."""
    def build(arch, hidden=128, heads=4, kv=4, head_dim=32, ffn=256):
        config, model = ARCHS[arch]
        torch.manual_seed(0)
        extra = {} if arch == "llama" else {"head_dim": head_dim}
        m = model(config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv, **extra))
        d = tmp_path / f"my-{arch}-{hidden}-{kv}-{ffn}"
        m.save_pretrained(d)
        tok.save_pretrained(d)
        return d
    return build


def dry_run(capsys, slug, model, *more):
    """``workbench run SLUG -p model DIR ... --dry-run``: ``(exit code, stdout, stderr)``."""
    rc = cli.main(["run", slug, "-p", "model", str(model), *more, "--dry-run"])
    out = capsys.readouterr()
    return rc, out.out, " ".join(out.err.split())


# -- 14: group sizes, the vector frontier's codebook blocks, the GGUF file C4 reads ----------------

def test_14_accepts_a_llama_whose_shapes_fit(make, capsys):
    rc, out, err = dry_run(capsys, "14", make("llama"))
    assert rc == 0, err
    assert "1 job(s)" in out and "warning" not in err


def test_14_refuses_a_default_group_size_that_does_not_divide_and_names_those_that_do(make,
                                                                                     capsys):
    d = make("llama", ffn=192)                   # down_proj has 192 in-features: 128 does not fit
    rc, _, err = dry_run(capsys, "14", d)
    assert rc == 2
    assert re.search(r"14-gsq: model = '.*my-llama-128-4-192': group_size 128 \(the smoke "
                     r"default\) does not divide the in-features: model\.layers\.0\.mlp\."
                     r"down_proj has 192 in-features; pass -p group_size 32 or 64", err), err
    rc, _, err = dry_run(capsys, "14", d, "-p", "group_size", "64")
    assert rc == 0, err
    rc, _, err = dry_run(capsys, "14", d, "-p", "group_size", "64,128")   # each grid point
    assert rc == 2 and "group_size = 128 does not divide" in err


def test_14_refuses_layers_too_small_for_the_3_bit_frontier_whatever_the_group_size(make,
                                                                                    capsys):
    d = make("llama", kv=2)                      # k_proj and v_proj: 2 x 32 = 64 out-features
    for more in ((), ("-p", "group_size", "64"), ("-p", "group_size", "32")):
        rc, _, err = dry_run(capsys, "14", d, *more)
        assert rc == 2
        assert "GPTVQ's 3-bit frontier" in err and "at least 128 rows" in err, err
        assert "k_proj has 64 out-features (and 1 more layer)" in err
        assert "no group_size changes that" in err


def test_the_frontier_rule_is_the_quantizers_own():
    """``vq_least_rows`` says a layer fits exactly when ``quant.rows_for_budget`` finds a block."""
    for bits in (2, 3):
        for g in (32, 64, 128):
            least = checkpoint.vq_least_rows(bits, g)
            for rows in (16, 32, 48, 64, 96, 128, 192, 256):
                try:
                    Q.rows_for_budget(bits, gsq_lab.VQ_DIM, rows, g, Q.bits_per_weight(bits, g))
                    fits = True
                except ValueError:
                    fits = False
                assert fits == (rows >= least), (bits, g, rows)
    assert [checkpoint.vq_least_rows(b, 128) for b in (2, 3)] == [32, 128]


def test_14_accepts_a_qwen3_whose_gguf_file_c4_writes(make, capsys):
    rc, out, err = dry_run(capsys, "14", make("qwen3"))
    assert rc == 0, err
    assert "1 job(s)" in out and "warning" not in err


def test_14_refuses_a_granite_whose_gguf_file_c4_cannot_write(make, capsys):
    # Granite's layers are Llama's (GSQ fits them); the GGUF export does not know Granite
    rc, _, err = dry_run(capsys, "14", make("granite"))
    assert rc == 2
    assert "C4 compares two llama.cpp GGUF files of the model" in err
    assert "not 'granite'" in err and "choose a Llama, Mistral, Qwen2 or Qwen3 model" in err


def test_14_refuses_gemma2_layers_whose_extra_norms_gsq_would_leave_out(make, capsys):
    d = make("gemma2")
    rc, _, err = dry_run(capsys, "14", d)
    assert rc == 2
    assert "needs Llama-style decoder layers" in err
    assert "Gemma2ForCausalLM also hold pre_feedforward_layernorm, post_feedforward_layernorm" \
        in err, err
    assert checkpoint.validate_params("02-lqzo", {"model": str(d)}) == []   # 02 reads no layout


def test_14s_kernel_refuses_as_the_runner_does(make):
    d = str(make("llama", ffn=192))
    with pytest.raises(checkpoint.CheckpointError, match=r"14-gsq: model = .*group_size 128 "
                                                         r"\(the smoke default\) does not"):
        runtime.check_limits({"model": d, "device": "cpu", "scale": "smoke",
                              "group_size": None}, "14-gsq")
    runtime.check_limits({"model": d, "device": "cpu", "scale": "smoke", "group_size": 64},
                         "14-gsq")


def test_the_checks_read_the_notebooks_and_harness_they_guard():
    """SHAPES says what notebook 14 and its harness do: multiples of 32 up to 2048, 2-D vectors,
    the frontier at 2 and 3 bits, 128 as the default group size at both scales."""
    step, largest = checkpoint.SHAPES["14-gsq"]["group_size"]
    assert gsq_lab.LIMITS["group_size"] == list(range(step, largest + 1, step))
    assert checkpoint.VQ_DIM == gsq_lab.VQ_DIM
    src = "".join("".join(c["source"]) for c in
                  json.loads(resolve("14").path.read_text())["cells"] if c["cell_type"] == "code")
    bits = re.search(r"FRONTIER_BITS = (\(.*?\))", src).group(1)
    assert eval(bits) == checkpoint.SHAPES["14-gsq"]["vq_bits"]
    assert checkpoint.fitting_group_sizes([128, 384], 32, 2048) == [32, 64, 128]
    assert checkpoint.fitting_group_sizes([64, 192], 32, 2048) == [32, 64]
    assert checkpoint.fitting_group_sizes([48, 96], 32, 2048) == []
    assert checkpoint.fitting_group_sizes([64, 96], 1, None) == [1, 2, 4, 8, 16, 32]


# -- 02: its group size; its setup line without a zoo card ---------------------------------------

def test_02_refuses_the_full_group_size_on_a_narrow_model_and_passes_smoke(make, capsys):
    d = make("qwen3", hidden=64, heads=2, kv=1)
    rc, _, err = dry_run(capsys, "02", d, "--scale", "full")
    assert rc == 2
    assert "group_size 128 (the full default) does not divide the in-features" in err
    assert "pass -p group_size 1, 2, 4, 8, 16, 32 or 64" in err, err
    rc, _, err = dry_run(capsys, "02", d)                 # smoke's groups of 32 divide 64
    assert rc == 0, err


def test_02s_setup_line_reads_no_zoo_card_field_a_checkpoint_lacks(make):
    d = make("qwen3")
    card = checkpoint.card(d)
    assert "task_accuracy" not in card
    assert lqzo_lab.card_note(card, "sub").startswith("no card accuracy")
    assert lqzo_lab.card_note({"task_accuracy": {"sub": 0.125}}, "sub") == "card accuracy 0.12"
    cell = next("".join(c["source"]) for c in json.loads(resolve("02").path.read_text())["cells"]
                if "card = lm.zoo_card" in "".join(c["source"]))
    assert "task_accuracy" not in cell and "lab.card_note(card, family)" in cell


# -- 10: the GGUF file is optional -------------------------------------------------------------

def test_10_warns_that_it_will_skip_the_gguf_file_and_runs(make, capsys):
    rc, out, err = dry_run(capsys, "10", make("gemma2"))
    assert rc == 0 and "1 job(s)" in out
    assert "warning: 10-hestia: model: GGUF export knows the architectures" in err
    assert "not 'gemma2'; the notebook skips its llama.cpp file" in err
    for arch in ("llama", "qwen3"):
        rc, _, err = dry_run(capsys, "10", make(arch))
        assert rc == 0 and "GGUF" not in err, (arch, err)
    with pytest.warns(UserWarning, match="skips its llama.cpp file"):
        runtime.check_limits({"model": str(make("gemma2")), "device": "cpu",
                              "scale": "smoke"}, "10-hestia")


def test_10s_export_skips_with_a_note_and_records_the_flag_alone(make, tok):
    model, _ = zoo.load(str(make("gemma2")))
    bed = type("Bed", (), {"tok": tok})()
    gg = hestia_lab.export_gguf(model, bed, "unused.gguf", name="x", metadata={},
                                ppl_memory=3.5, n_ternary=1, device="cpu")
    assert gg == {"skipped": Q.gguf.unsupported(model.config),
                  "ppl": {"in memory (hard ternary)": 3.5}}
    assert hestia_lab.gguf_metrics(gg) == {"gguf_skipped": gg["skipped"]}
    assert hestia_lab.gguf_summary(gg).startswith("skipped the GGUF file: GGUF export knows")


def test_10s_metrics_of_a_written_file_are_what_the_cell_recorded(tmp_path):
    """The recorded names, values and order of a written file, as the cell wrote them inline."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 1234)
    gg = {"path": f, "exact": True, "bits": 4.5, "types": {"Q4_0": 28},
          "ppl": {"in memory (hard ternary)": 9.0, "transformers": 9.000001, "llama.cpp": 9.01}}
    file_ppl, readers = gg["ppl"], list(gg["ppl"])[1:]
    before = dict(gguf_file_bytes=gg["path"].stat().st_size, gguf_ternary_exact=gg["exact"],
                  gguf_ternary_bits_per_weight=gg["bits"], gguf_ternary_types=gg["types"],
                  gguf_readers=readers,
                  **{"gguf_ppl_" + {"transformers": "transformers", "llama.cpp": "llama_cpp"}.get(
                      k, "memory"): v for k, v in file_ppl.items()})
    after = hestia_lab.gguf_metrics(gg)
    assert list(after.items()) == list(before.items())
    assert hestia_lab.gguf_summary(gg) == (
        "m.gguf: 1,234 bytes; ternary tensors {'Q4_0': 28}, 4.50 bits per ternary weight; "
        "stored weights exactly fp16(gamma) * q: True; read by transformers, llama.cpp")


def test_what_the_gguf_export_can_write_is_known_before_it_writes(tok):
    assert Q.gguf.unsupported(LlamaConfig(), tok) is None
    assert Q.gguf.unsupported(Qwen3Config(), tok) is None
    assert Q.gguf.unsupported(Gemma2Config()) == ("GGUF export knows the architectures "
                                                  "['gpt2', 'llama', 'mistral', 'qwen2', "
                                                  "'qwen3'], not 'gemma2'")
    spec = json.loads(tok.backend_tokenizer.to_str())
    assert Q.gguf.unsupported(LlamaConfig(), spec) is None
    assert "not Unigram" in Q.gguf.unsupported(LlamaConfig(), {**spec, "model": {"type":
                                                                                  "Unigram"}})
    meta = {**spec, "pre_tokenizer": {"type": "Metaspace"}}
    assert Q.gguf.unsupported(LlamaConfig(), meta).endswith("not Metaspace")


# -- a device the CPU tests cannot show: GSQ's batch order is drawn where its generator is -------

def test_gsq_draws_its_batch_order_on_the_generators_device(monkeypatch):
    seen, randperm = [], torch.randperm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("device"))
        return randperm(*args, **kwargs)

    monkeypatch.setattr(torch, "randperm", spy)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 32, generator=gen)
    q = Q.rtn(w, 3, 32)
    cfg = gsq_method.GSQConfig(steps=3, batch=4)
    x = torch.randn(16, 32, generator=gen)
    gsq_method.train_subblock(lambda x, ws: x @ ws["w"].T,
                              {"w": gsq_method.GumbelQuantizer(q, cfg, gen)}, x, x @ w.T, cfg, gen)
    assert seen and all(d == gen.device for d in seen)
