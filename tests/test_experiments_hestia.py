"""The Hestia harness (notebook 10): the QAT stream, the four runs' settings, the step timer
that leaves the model as it found it, and the consistency check of both quantizers."""
import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workbench.experiments import hestia as X
from workbench.methods import hestia as M


class CharTok:
    """A stand-in tokenizer: one id per character (all >= 32), specials 0, 1 (bos), 2 (eos)."""
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __call__(self, texts, add_special_tokens=False):
        if isinstance(texts, str):
            return {"input_ids": [ord(ch) % 5000 + 32 for ch in texts]}
        return {"input_ids": [[ord(ch) % 5000 + 32 for ch in t] for t in texts]}


def _tiny_lm():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=50,
                      max_position_embeddings=16, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_train_stream_mixes_text_and_task_blocks_reproducibly():
    tok = CharTok()
    a = X.train_stream(tok, 32, 20, seed=3, task_fraction=0.5)
    b = X.train_stream(tok, 32, 20, seed=3, task_fraction=0.5)
    assert a.shape == (20, 32) and torch.equal(a, b)             # same seed, same stream
    with_bos = int((a == tok.bos_token_id).any(1).sum())          # packed task lines start with bos
    assert with_bos == 10                                         # exactly the task fraction
    only_text = X.train_stream(tok, 32, 6, seed=3, task_fraction=0.0)
    assert not (only_text == tok.bos_token_id).any()
    assert not torch.equal(X.train_stream(tok, 32, 20, seed=4, task_fraction=0.5), a)


def test_the_matched_control_runs_at_the_geometric_mean_scale():
    scales = {"a": 0.6, "b": 0.9, "c": 0.75}
    methods, mean_scale = X.qat_methods(scales)
    assert list(methods) == list(X.KEY)
    assert math.isclose(mean_scale, (0.6 * 0.9 * 0.75) ** (1 / 3))
    mode, matched = methods["Hestia, global T x mean scale"]
    assert mode == "hestia" and set(matched.values()) == {mean_scale} and set(matched) == set(scales)
    assert methods["Hestia, Hessian T"] == ("hestia", scales) and methods["STE (absmean)"][1] is None


def test_qat_config_logs_the_gap_at_least_twenty_times():
    S = {"steps": 120, "batch": 8, "lr": 5e-4, "log_every": 500, "gap_every": 25}
    cfg = X.qat_config(S, None, 0.2)
    assert cfg.log_every == 120 and cfg.gap_every == 6 and cfg.t0 == M.optimal_init_temp()
    assert X.qat_config(S, 0.5, 0.2).t0 == 0.5


def test_stepper_leaves_the_model_as_it_found_it():
    model = _tiny_lm()
    layers = M.ternarize(model, "hestia")
    for m in layers.values():
        m.temp, m.pressure = 0.2, 0.5
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 50, (2, 8))
    step = X.stepper(model, x, "hestia", temp=0.3)
    step()
    step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all((m.temp, m.pressure, m.mode) == (0.2, 0.5, "hestia") for m in layers.values())


def test_step_costs_pairs_the_rounds_and_counts_the_quantizer():
    model = _tiny_lm()
    M.ternarize(model, "hestia")
    x = torch.randint(0, 50, (2, 8))
    t, counts = X.step_costs(model, x, rounds=3, temp=0.3)
    assert list(t.columns) == ["STE", "Hestia", "ratio"] and len(t) == 3
    assert ((t.ratio - t.Hestia / t.STE).abs() < 1e-12).all()
    # the same matrix products in both modes; the relaxed quantizer's elementwise work is
    # invisible to the FLOP counter and shows in the bytes moved
    assert counts["flops"]["Hestia"] == counts["flops"]["STE"] > 0
    assert counts["bytes"]["Hestia"] > counts["bytes"]["STE"] > 0


def test_ratio_by_tokens_gives_one_row_per_batch_and_an_empty_table_for_none():
    model = _tiny_lm()
    M.ternarize(model, "hestia")
    data = torch.randint(0, 50, (4, 8))
    t = X.ratio_by_tokens(model, data, [1, 4], rounds=2, temp=0.3)
    assert t.sequences.tolist() == [1, 4] and t.tokens.tolist() == [8, 32]
    assert (t.q1 <= t["median"]).all() and (t["median"] <= t.q3).all()
    assert (t.byte_ratio > 1).all()
    assert len(X.ratio_by_tokens(model, data[:0], [], rounds=2, temp=0.3)) == 0


def test_c5_is_judged_at_the_most_tokens_timed_and_needs_the_ratio_to_fall():
    import pandas as pd
    spread = {"median": 1.3, "q3": 1.4}
    rows = pd.DataFrame({"tokens": [2048, 128, 512], "median": [1.05, 1.5, 1.2],
                         "q3": [1.08, 1.6, 1.3]})
    v = X.c5_verdict(spread, rows, 512)
    assert v["holds"] and v["tokens"] == 2048 and v["falls"] and v["q3"] == 1.08
    # the most tokens under the bar, but the ratio does not fall: the amortisation is not shown
    flat = rows.assign(median=[1.05, 1.0, 1.2])
    assert not X.c5_verdict(spread, flat, 512)["holds"]
    assert not X.c5_verdict(spread, rows.assign(q3=[1.11, 1.6, 1.3]), 512)["holds"]
    # one batch timed (smoke): that batch's upper quartile alone
    one = X.c5_verdict(spread, rows[:0], 512)
    assert not one["holds"] and one["tokens"] == 512 and one["falls"] is None
    assert X.c5_verdict({"median": 1.0, "q3": 1.1}, rows[:0], 512)["holds"]


def test_qat_config_takes_the_decay_style_and_the_limits_name_it():
    S = {"steps": 40, "batch": 2, "lr": 1e-3, "log_every": 10, "gap_every": 5}
    assert X.qat_config(S, 0.5, 0.2).decay_style == "cosine"
    assert X.qat_config(S, 0.5, 0.2, "hessian").decay_style == "hessian"
    assert X.LIMITS["decay_style"] == ["cosine", "hessian"]
    assert "block" in X.LIMITS["granularity"] and "tensor" in X.LIMITS["granularity"]


def test_consistency_separates_hestia_from_the_ste():
    models = {"Hestia, Hessian T": _tiny_lm(), "STE (absmean)": _tiny_lm()}
    M.ternarize(models["Hestia, Hessian T"], "hestia")
    M.ternarize(models["STE (absmean)"], "ste")
    out = X.consistency(models, M.QATConfig(t0=0.35), seed=0)
    assert out["Hestia, Hessian T"]["tensors"] == 14
    assert out["Hestia, Hessian T"]["max relative error"] < 1e-4
    assert out["STE (absmean)"]["median relative error"] > 1e-2


def test_limits_name_the_zoo_and_the_task_families():
    lim = X.limits()
    assert "model_name" not in lim and "add" in lim["task_family"]   # model: models.checkpoint
    assert lim["compress_ratio"] == (0, 0.999)


def test_block_nll_gives_evaluates_perplexity():
    from workbench import evaluate
    model = _tiny_lm()
    blocks = torch.randint(0, 50, (5, 12), generator=torch.Generator().manual_seed(0))
    nll = X.block_nll(model, blocks, batch=2)
    assert nll.shape == (5,)
    assert math.isclose(math.exp(nll.mean()), evaluate.perplexity(model, blocks), rel_tol=1e-6)


def test_compare_signs_a_win_of_the_first_run_positive():
    import numpy as np
    rows = {"a": {"nll": np.full(50, 2.0), "correct": np.ones(50)},
            "b": {"nll": np.full(50, 2.5), "correct": np.r_[np.ones(25), np.zeros(25)]}}
    out = X.compare(rows, "a", "b")
    assert math.isclose(out["nll"]["diff"], 0.5) and out["nll"]["low"] > 0   # a: lower NLL
    assert math.isclose(out["acc"]["diff"], 0.5) and out["acc"]["low"] > 0   # a: more correct
    assert X.row_table({"a": {"ppl": 1.0, "nll": rows["a"]["nll"]}}).columns.tolist() == ["ppl"]


def test_forward_curve_is_the_relaxed_quantizer_and_its_slope():
    x = torch.linspace(-2, 2, 41, dtype=torch.float64, requires_grad=True)
    e, slope = X.forward_curve(x, 0.5, 1.0)
    ref = M.soft_ternary_closed_form(x, 0.5)
    assert torch.allclose(e, ref, atol=1e-12)
    (grad,) = torch.autograd.grad(ref.sum(), x)
    assert torch.allclose(slope, grad, atol=1e-10)                 # (2/T) Var is the derivative
    half, s_half = X.forward_curve(x.detach(), 0.5, 0.25)           # compress: a lerp from x
    assert torch.allclose(half, 0.75 * x.detach() + 0.25 * e.detach())
    assert torch.allclose(s_half, 0.75 + 0.25 * slope.detach())
    hard, s_hard = X.forward_curve(torch.tensor([-1.7, -0.2, 0.7]), 0.0, 1.0)
    assert hard.tolist() == [-1.0, 0.0, 1.0] and s_hard.tolist() == [0.0, 0.0, 0.0]


def test_dead_share_runs_from_none_to_all_along_the_schedule():
    x = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    s = M.Schedule(steps=20, t0=0.35, compress_ratio=0.2)
    share = X.dead_share(x, s, range(20))
    assert share[0] == 0.0 and share[-1] == 1.0                     # fp-ish start, hard end
    assert share[5] < share[15]                                     # annealing kills the slope
    fig = X.relaxation_figure(x.reshape(40, 50), s, s, 10, "t")
    assert len(fig.axes) == 2
