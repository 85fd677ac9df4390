"""The experiments of notebook 10: Hestia, operator-faithful differentiable QAT for extremely
low-bit LLMs (the method itself is :mod:`workbench.methods.hestia`).

The harness loads a zoo backbone (``lm-qbed`` by default: the quantization-sensitive bed) and
builds the QAT data (a fixed stream of corpus windows and packed task lines, the same for every
method) and the held-out evaluation sets; scores the two reference rows (full precision, ternary
rounding without training) per held-out block and per task item; computes the offline Hessian
traces (Hutch++, one per tensor by default, as every path of the public code) and their temperature
scales; runs the QAT comparison (STE, Hestia with one global schedule, the matched global
control, Hestia with Hessian schedules); compares two runs on the same items with a paired
bootstrap; checks each quantizer's forward against its backward; times a training step of each
mode; writes the final model as a GGUF file and reads it back (or says why it skips that, for
a model the export cannot write); gathers the evidence of the claims; and, for the explorer,
draws the relaxed quantizer along one tensor's schedule.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import matplotlib as mpl
import numpy as np
import pandas as pd
import torch

from workbench import costs, evaluate
from workbench.diagnostics import paired_bootstrap
from workbench import quant as Q
from workbench.data import corpus, packing, tasks
from workbench.data.tasks import difficulties
from workbench.methods import hestia as M
from workbench.models import zoo
from workbench.plots import subplots

__all__ = ["LIMITS", "KEY", "COLOR", "limits", "qat_config", "train_stream", "block_nll",
           "task_items", "Bed", "load_bed", "reference_rows", "sensitivities",
           "trace_table", "qat_methods", "qat_run", "qat_metrics", "row_table", "compare", "consistency",
           "stepper", "step_costs", "ratio_by_tokens", "c5_verdict", "export_gguf", "gguf_metrics", "gguf_summary",
           "c2_evidence", "schedule_figure",
           "DEAD_SLOPE", "forward_curve", "dead_share", "relaxation_figure"]

# the knobs' and sizes' allowed values, checked by run.sizes before anything runs
LIMITS = {"steps": (10, None), "batch": (1, None), "lr": (1e-12, None), "t0": (1e-12, None),
          "compress_ratio": (0, 0.999), "alpha": (0, None), "kappa": (1e-12, None),
          "granularity": list(M.GRANULARITIES), "decay_style": list(M.DECAY_STYLES),
          "trace_estimator": ["hutchpp", "hutchinson"]}
# the four QAT runs: label -> the metric-name stem
KEY = {"STE (absmean)": "ste", "Hestia, global T": "hestia_global",
       "Hestia, global T x mean scale": "hestia_global_matched", "Hestia, Hessian T": "hestia_hessian"}
COLOR = dict(zip(KEY, ["#1f5a96", "#d1495b", "#e09f3e", "#2e933c"]))


def limits() -> dict:
    """:data:`LIMITS` with the zoo's backbones and the task registry's families as choices."""
    return {**LIMITS, "task_family": tasks.names()}      # model: checked by models.checkpoint


def qat_config(S: dict, t0: float | None, compress_ratio: float,
               decay_style: str = "cosine") -> M.QATConfig:
    """The QAT settings every method shares; ``t0`` None takes the public code's MSE-optimal
    initial temperature; ``decay_style`` is :class:`M.Schedule`'s; the relaxed-vs-hard gap is
    logged at least 20 times."""
    T0 = M.optimal_init_temp() if t0 is None else float(t0)
    return M.QATConfig(steps=S["steps"], batch=S["batch"], lr=S["lr"],
                       log_every=min(S["log_every"], S["steps"]), t0=T0,
                       compress_ratio=compress_ratio, decay_style=decay_style,
                       gap_every=max(1, min(S["gap_every"], S["steps"] // 20)))


def train_stream(tok, ctx: int, n_blocks: int, seed: int, task_fraction: float = 0.5,
                 families=("add", "pattern")) -> torch.Tensor:
    """(n_blocks, ctx) training blocks: random windows of the corpus' train documents and, for a
    ``task_fraction`` of them, packed task lines (``<bos> prompt answer <eos>``) of ``families``,
    so QAT sees the same kind of text the backbone was trained on. Shuffled with ``seed``."""
    n_task = int(round(n_blocks * task_fraction))
    text = corpus.calibration_blocks(tok, ctx, n_blocks - n_task, seed=seed)
    if n_task == 0:
        return text
    per_family = n_task * ctx // 6 // len(families) + 1    # a task line is >= 8 tokens
    lines = corpus.task_lines(families, per_family, seed=seed + 7, easiest=1)
    try:
        task_blocks = packing.stream(packing.encode(tok, lines), n_task, ctx)
    except ValueError as e:
        raise ValueError(f"{e}; lower task_fraction") from None
    blocks = torch.cat([text, task_blocks])
    g = torch.Generator().manual_seed(seed)
    return blocks[torch.randperm(len(blocks), generator=g)]


def block_nll(model, blocks: torch.Tensor, batch: int = 16) -> np.ndarray:
    """Mean next-token negative log-likelihood of each ``(ctx)`` block: the per-item scores of a
    paired comparison; ``exp`` of their mean is ``evaluate.perplexity`` (blocks of one length)."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            x = blocks[i: i + batch].to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:],
                                                    reduction="none")
            out.append(nll.mean(1).cpu().double())
    return torch.cat(out).numpy()


def task_items(family: str, n: int, seed: int, easiest: int | None) -> list:
    """The ``n`` examples ``evaluate.task_accuracy`` scores (spread over the family's
    ``easiest`` difficulties, all when None)."""
    ds = difficulties(family, easiest)
    return [e for d in ds for e in tasks.generate(family, -(-n // len(ds)), seed, d)][:n]


@dataclass
class Bed:
    """The backbone, its QAT data and its evaluation sets."""
    base: torch.nn.Module      # the full-precision backbone (never trained here)
    tok: object                # its tokenizer
    card: dict                 # its zoo card
    ctx: int                   # tokens per block
    data: torch.Tensor         # the QAT stream, (blocks, ctx), the same for every method
    held_eval: torch.Tensor    # held-out blocks scored during QAT
    held_final: torch.Tensor   # held-out blocks scored at the end
    task_family: str           # zoo task family of the zero-shot accuracy
    task_examples: int         # examples of that family scored
    load_s: float              # seconds zoo.load took

    def score(self, model) -> float:
        """Held-out perplexity on the small set scored during QAT."""
        return evaluate.perplexity(model, self.held_eval)

    def final_ppl(self, model) -> float:
        """Held-out perplexity on the final set."""
        return evaluate.perplexity(model, self.held_final)

    def accuracy(self, model) -> float:
        """Exact-match accuracy on the task family (fixed examples, greedy answers)."""
        return evaluate.task_accuracy(model, self.tok, self.task_family, self.task_examples,
                                      seed=777, easiest=self.card["recipe"].get("easiest"))

    def final_row(self, model) -> dict:
        """The final scores, with the per-item ones a paired comparison needs: ``nll`` per
        held-out block (``ppl`` is ``exp`` of their mean) and ``correct`` per task example."""
        nll = block_nll(model, self.held_final)
        exs = task_items(self.task_family, self.task_examples, 777,
                         self.card["recipe"].get("easiest"))
        correct = evaluate.item_scores(model, self.tok, exs)
        return {"ppl": float(np.exp(nll.mean())), "acc": float(correct.mean()), "nll": nll,
                "correct": correct}


def load_bed(model_name: str, scale: str, S: dict, cfg: M.QATConfig, *, seed: int, device,
             task_family: str) -> Bed:
    """Load the zoo backbone (built on first use), the QAT stream of ``cfg.steps * cfg.batch``
    blocks (or the scale's ``train_blocks``) and the held-out sets (a seeded subset), in blocks of
    the scale's ``ctx`` tokens (0 or None: the backbone's context)."""
    t_load = time.time()
    base, tok = zoo.load(model_name, scale, device=str(device))
    load_s = time.time() - t_load
    ctx = min(S.get("ctx") or base.config.max_position_embeddings,
              base.config.max_position_embeddings)
    n_blocks = S["train_blocks"] or cfg.steps * cfg.batch
    data = train_stream(tok, ctx, n_blocks, seed=seed, task_fraction=S["task_fraction"])
    held = corpus.heldout_blocks(tok, ctx)
    order = torch.randperm(len(held), generator=torch.Generator().manual_seed(1000 + seed))
    held_eval = held[order[: S["eval_blocks"]]]
    held_final = held[order[: S["final_blocks"]]] if S["final_blocks"] else held
    return Bed(base, tok, base.zoo_card, ctx, data, held_eval, held_final, task_family,
               S["task_examples"], load_s)


def reference_rows(bed: Bed) -> tuple[dict, dict]:
    """The two reference rows (full precision; absmean ternary rounding, no training; each
    :meth:`Bed.final_row`) and the ternary layers' sizes: ``(rows, {"n_ternary_weights",
    "n_tensors"})``."""
    ptq = copy.deepcopy(bed.base)
    layers_ptq = M.ternarize(ptq, "hard")
    n_ternary = sum(m.weight.numel() for m in layers_ptq.values())
    rows = {"full precision": bed.final_row(bed.base), "ternary PTQ (no QAT)": bed.final_row(ptq)}
    return rows, {"n_ternary_weights": n_ternary, "n_tensors": len(layers_ptq)}


def sensitivities(bed: Bed, S: dict, seed: int, device, kappa: float, alpha: float,
                  estimator: str = "hutchpp", granularity: str = "tensor") -> dict:
    """Hessian traces of the ternary tensors on the full-precision model (once, before QAT;
    ``M.hessian_traces`` with the scale's ``trace_sketch`` and ``trace_query`` for Hutch++ or
    ``trace_probes`` for Hutchinson, shared per ``granularity`` group) and the temperature scales
    they give: ``names``, ``traces``, ``temp_scales``, ``sensitivity``, ``groups`` and
    ``seconds``."""
    t_tr = time.time()
    fp_model = copy.deepcopy(bed.base)
    M.ternarize(fp_model, "fp")
    tnames = list(M.ternary_layers(fp_model))
    calib = corpus.calibration_blocks(bed.tok, bed.ctx, S["trace_blocks"], seed=10_000 + seed)
    traces_w = M.hessian_traces(fp_model, [n + ".weight" for n in tnames], calib.to(device),
                                estimator=estimator, granularity=granularity,
                                num_sketch=S["trace_sketch"], num_query=S["trace_query"],
                                n_samples=S["trace_probes"], seed=seed)
    traces = {n: traces_w[n + ".weight"] for n in tnames}
    del fp_model
    temp_scales, sensitivity = M.temperature_scales(traces, kappa=kappa, alpha=alpha)
    return {"names": tnames, "traces": traces, "temp_scales": temp_scales,
            "sensitivity": sensitivity, "groups": len(M.trace_groups(tnames, granularity)),
            "seconds": time.time() - t_tr}


def trace_table(sens: dict) -> pd.DataFrame:
    """The traces as a (tensor kind x block) table."""
    tnames = sens["names"]
    return pd.DataFrame({"block": [int(n.split(".")[2]) for n in tnames],
                         "tensor": [n.split(".")[-1] for n in tnames],
                         "trace": [sens["traces"][n] for n in tnames],
                         "temp scale": [sens["temp_scales"][n] for n in tnames]}
                        ).pivot(index="tensor", columns="block", values="trace")


def qat_methods(temp_scales: dict) -> tuple[dict, float]:
    """label -> (mode, per-tensor scales or None) of the four runs, and the matched control's
    scale: the geometric mean of the per-tensor scales, so that a C4 win cannot come from the
    Hessian runs being cooler on average."""
    mean_scale = math.exp(np.mean([math.log(v) for v in temp_scales.values()]))
    methods = {"STE (absmean)": ("ste", None), "Hestia, global T": ("hestia", None),
               "Hestia, global T x mean scale": ("hestia", {n: mean_scale for n in temp_scales}),
               "Hestia, Hessian T": ("hestia", temp_scales)}
    return methods, mean_scale


def qat_run(bed: Bed, cfg: M.QATConfig, mode: str, scales: dict | None,
            progress=lambda it, **kw: it) -> tuple:
    """One QAT run from the pretrained backbone: ``(model, history, row)``, the row holding the
    hard model's final scores (:meth:`Bed.final_row`), the never-flipped and changed fractions,
    and the run's seconds."""
    t_run = time.time()
    model = copy.deepcopy(bed.base)
    M.ternarize(model, mode)
    hist = M.qat(model, bed.data, cfg, mode, scales, evaluate=bed.score, progress=progress)
    with M.mode_as(model, "hard"):
        row = bed.final_row(model)
    fl = hist["flips"]
    row.update(never_flipped=fl.never_flipped(), changed=fl.changed_overall(),
               seconds=time.time() - t_run)
    return model, hist, row


def qat_metrics(rows: dict, hists: dict) -> dict:
    """The metrics of the four runs: final perplexity and accuracy, never-flipped and changed
    fractions, and the hard model's perplexity curve."""
    out = {}
    for label, k in KEY.items():
        out.update({f"ppl_{k}": rows[label]["ppl"], f"acc_{k}": rows[label]["acc"],
                    f"never_flipped_{k}": rows[label]["never_flipped"],
                    f"changed_{k}": rows[label]["changed"], f"ppl_curve_{k}": hists[label]["hard"]})
    return out


def row_table(rows: dict) -> pd.DataFrame:
    """The rows as a table, without the per-item scores."""
    return pd.DataFrame({k: {c: v for c, v in r.items() if c not in ("nll", "correct")}
                         for k, r in rows.items()}).T


def compare(rows: dict, a: str, b: str, seed: int = 0) -> dict:
    """Run ``a`` against run ``b`` on the same items, ``diagnostics.paired_bootstrap``: ``nll``,
    the held-out NLL per block of ``b`` minus ``a`` (> 0: ``a`` has the lower perplexity), and
    ``acc``, the exact match per example of ``a`` minus ``b``; each ``{diff, low, high, ...}``."""
    return {"nll": paired_bootstrap(rows[b]["nll"], rows[a]["nll"], seed=seed),
            "acc": paired_bootstrap(rows[a]["correct"], rows[b]["correct"], seed=seed)}


def consistency(models: dict, cfg: M.QATConfig, seed: int) -> dict:
    """Forward-backward consistency of every ternary tensor of the final Hessian-schedule model
    (Hestia) and of the STE model, at ``T0 / 4``: max and median relative error of autograd's
    directional derivative against a float64 central difference."""
    out = {}
    for label, mode in (("Hestia, Hessian T", "hestia"), ("STE (absmean)", "ste")):
        checks = [M.directional_check(l.weight, mode, cfg.t0 / 4, seed=seed + i)
                  for i, l in enumerate(M.ternary_layers(models[label]).values())]
        out[label] = {"max relative error": max(c["rel_error"] for c in checks),
                      "median relative error": float(np.median([c["rel_error"] for c in checks])),
                      "tensors": len(checks)}
    return out


def stepper(model, x: torch.Tensor, mode: str, temp: float = 0.3):
    """One forward + backward + AdamW step in ``mode`` on batch ``x``, as a callable (C5), on a
    copy of ``model`` (its current weights, every ternary layer at temperature ``temp`` and full
    pressure, a throw-away optimizer): calling it never touches ``model``."""
    m = copy.deepcopy(model).train()
    for layer in M.ternary_layers(m).values():
        layer.mode, layer.temp, layer.pressure = mode, temp, 1.0
    opt = torch.optim.AdamW(m.parameters(), lr=1e-6, weight_decay=0.0)

    def step():
        loss = m(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()
    return step


def step_costs(model, x: torch.Tensor, rounds: int, temp: float,
               clock=None) -> tuple[pd.DataFrame, dict]:
    """C5, side by side: the seconds of a :func:`stepper` step of STE and of Hestia over
    ``rounds`` interleaved rounds (:func:`workbench.costs.interleaved`, ABBA after a warm-up),
    with each round's ratio Hestia / STE; and the floating-point operations and bytes moved of
    one step of each (:func:`workbench.costs.flops`, :func:`workbench.costs.bytes_moved`).
    ``clock``: as :func:`workbench.costs.interleaved` (``time.process_time`` on a CPU, so another
    job's load does not enter the seconds)."""
    steps = {"STE": stepper(model, x, "ste", temp), "Hestia": stepper(model, x, "hestia", temp)}
    t = costs.interleaved(steps, rounds, clock=clock)
    t["ratio"] = t["Hestia"] / t["STE"]
    counts = {"flops": {k: costs.flops(f) for k, f in steps.items()},
              "bytes": {k: costs.bytes_moved(f) for k, f in steps.items()}}
    return t, counts


def ratio_by_tokens(model, data: torch.Tensor, batches, rounds: int, temp: float,
                    clock=None) -> pd.DataFrame:
    """C5's overhead against the tokens per step: for each number of sequences in ``batches``,
    :func:`step_costs` on the first that many blocks of ``data``: the per-round ratio Hestia / STE
    (median and quartiles) and the byte ratio of one step, one row per batch. The quantizer's work
    grows with the weights, the matmuls' with weights times tokens, so the ratio should fall as the
    tokens per step grow."""
    out = []
    for b in batches:
        t, counts = step_costs(model, data[:b], rounds, temp, clock)
        sp = costs.spread(t["ratio"])
        out.append({"sequences": int(b), "tokens": int(b * data.shape[1]), "median": sp["median"],
                    "q1": sp["q1"], "q3": sp["q3"], "step_s_ste": float(t["STE"].median()),
                    "byte_ratio": counts["bytes"]["Hestia"] / counts["bytes"]["STE"]})
    return pd.DataFrame(out)


def c5_verdict(spread: dict, by_tokens: pd.DataFrame, batch_tokens: int, bar: float = 1.10) -> dict:
    """C5's verdict, "the training-time overhead is small". The relaxed quantizer's extra work
    grows with the weights and the matmuls' with weights times tokens, so the overhead is
    amortised over the tokens of a step, and the paper's steps (1-3B models, large batches) hold
    far more tokens than any we can time. With two or more timed batches (``by_tokens``, from
    :func:`ratio_by_tokens`): judged at the most tokens per step timed, where the upper quartile
    of the per-round ratios must be at most ``bar`` *and* the median ratio must fall from the
    fewest tokens to the most (the amortisation the argument rests on). With none (``spread`` of
    the QAT batch alone, ``batch_tokens`` tokens): that batch's upper quartile at most ``bar``."""
    if len(by_tokens) >= 2:
        rows = by_tokens.sort_values("tokens")
        top, low = rows.iloc[-1], rows.iloc[0]
        falls = bool(top["median"] < low["median"])
        return {"holds": bool(top["q3"] <= bar and falls), "tokens": int(top["tokens"]),
                "q3": float(top["q3"]), "median": float(top["median"]), "falls": falls,
                "bar": bar}
    return {"holds": bool(spread["q3"] <= bar), "tokens": int(batch_tokens),
            "q3": float(spread["q3"]), "median": float(spread["median"]), "falls": None, "bar": bar}


def export_gguf(model, bed: Bed, path, *, name: str, metadata: dict, ppl_memory: float,
                n_ternary: int, device) -> dict:
    """Write ``model``'s ternary tensors as TQ2_0 (Q4_0 where a row is shorter than 256) and read
    the file back: are the stored weights exactly ``fp16(gamma) * q``, which type each tensor
    got, the bits per ternary weight, and the held-out perplexity through transformers (and
    llama.cpp when installed) beside the in-memory hard model's ``ppl_memory``.

    An optional step: for a model the export cannot write (``Q.gguf.unsupported``: an
    architecture or tokenizer llama.cpp's names are not known for) nothing is written and the
    result holds ``skipped`` (why) and the in-memory perplexity alone; no claim reads the file."""
    why = Q.gguf.unsupported(model.config, bed.tok)
    if why is not None:
        return {"skipped": why, "ppl": {"in memory (hard ternary)": ppl_memory}}
    codes = {n + ".weight": Q.ternary_quantized(l.weight)
             for n, l in M.ternary_layers(model).items()}
    gguf_path = Q.gguf.export_model_gguf(model, path, "TQ2_0", tokenizer=bed.tok, codes=codes,
                                         name=name, metadata=metadata)
    stored = {n: Q.gguf.stored_weight(q, "TQ2_0") for n, q in codes.items()}  # fp16(gamma) * q
    data = Q.gguf.read_gguf(gguf_path)
    back = dict(Q.gguf.import_model_gguf(copy.deepcopy(bed.base).cpu(), gguf_path)
                .named_parameters())
    kinds = pd.Series({k: v["qtype"] for k, v in data.items()
                       if k.startswith("blk.") and v["values"].ndim == 2})
    tf_model, _ = Q.gguf.load_transformers(gguf_path)
    file_ppl = {"in memory (hard ternary)": ppl_memory,
                "transformers": evaluate.perplexity(tf_model.to(device), bed.held_final)}
    if Q.gguf.have_llama_cpp():
        file_ppl["llama.cpp"] = Q.gguf.llama_cpp_perplexity(gguf_path,
                                                            bed.held_final.cpu().numpy())
    return {"path": gguf_path, "exact": all(torch.equal(back[n], w) for n, w in stored.items()),
            "types": kinds.value_counts().to_dict(),
            "bits": 8 * sum(data[k]["raw"].nbytes for k in kinds.index) / n_ternary,
            "ppl": file_ppl}


_READER_KEY = {"transformers": "transformers", "llama.cpp": "llama_cpp"}


def gguf_metrics(gg: dict) -> dict:
    """What the notebook records of :func:`export_gguf`'s result: the file's size, exactness,
    bits per ternary weight, tensor types, readers and each reader's perplexity (``gguf_ppl_*``);
    ``gguf_skipped`` (why) alone when the step was skipped."""
    if "skipped" in gg:
        return {"gguf_skipped": gg["skipped"]}
    return {"gguf_file_bytes": gg["path"].stat().st_size, "gguf_ternary_exact": gg["exact"],
            "gguf_ternary_bits_per_weight": gg["bits"], "gguf_ternary_types": gg["types"],
            "gguf_readers": list(gg["ppl"])[1:],
            **{"gguf_ppl_" + _READER_KEY.get(k, "memory"): v for k, v in gg["ppl"].items()}}


def gguf_summary(gg: dict) -> str:
    """One line on :func:`export_gguf`'s file (or on why there is none)."""
    if "skipped" in gg:
        return (f"skipped the GGUF file: {gg['skipped']}; the verdicts do not read it "
                "(gguf_skipped in the metrics)")
    readers = list(gg["ppl"])[1:]
    return (f"{gg['path'].name}: {gg['path'].stat().st_size:,} bytes; ternary tensors "
            f"{gg['types']}, {gg['bits']:.2f} bits per ternary weight; stored weights exactly "
            f"fp16(gamma) * q: {gg['exact']}; read by {', '.join(readers)}"
            + ("" if "llama.cpp" in gg["ppl"] else " (llama-cpp-python is not installed)"))


def c2_evidence(hists: dict, models: dict, cfg: M.QATConfig) -> dict:
    """Per Hestia run: the final temperature and gaps, the final relaxed and hard perplexities,
    and the mean relaxed-vs-hard gap at the start of the anneal and at the last step with T > 0."""
    c2 = {}
    for label in ("Hestia, global T", "Hestia, Hessian T"):
        h = hists[label]
        anneal = [i for i, s in enumerate(h["gap_step"]) if s > cfg.compress_ratio * cfg.steps]
        hot = [i for i in anneal if h["gap_temp_mean"][i] > 0]
        c2[label] = {"final_temp_max": max(m.temp for m in M.ternary_layers(models[label]).values()),
                     "final_gap_max_rel": h["gap_max"][-1], "final_gap_max_abs":
                     M.relaxed_gap(M.ternary_layers(models[label]))["max_abs"],
                     "final_ppl_relaxed": h["relaxed"][-1], "final_ppl_hard": h["hard"][-1],
                     "mean_gap_anneal_start": h["gap_mean"][anneal[0]],
                     "mean_gap_last_positive_T": h["gap_mean"][hot[-1]],
                     "last_positive_T_step": h["gap_step"][hot[-1]]}
    return c2


def schedule_figure(schedules: dict, traces: dict, cfg: M.QATConfig):
    """Every tensor's temperature over QAT, coloured by its log Hessian trace (floored at 1e-3
    of the largest), beside the global schedule and the end of the compress phase."""
    fig, ax = subplots(1, 1, figsize=(6.8, 3.8))
    logt = {n: math.log10(max(traces[n], 1e-3 * max(abs(v) for v in traces.values())))
            for n in traces}
    norm = mpl.colors.Normalize(min(logt.values()), max(logt.values()))
    cmap = mpl.colormaps["viridis"]
    xs = np.arange(cfg.steps)
    for n in traces:
        ax.plot(xs, [schedules[n].temperature(t) for t in xs], color=cmap(norm(logt[n])), lw=1)
    glob = M.Schedule(cfg.steps, cfg.t0, cfg.compress_ratio, decay_style=cfg.decay_style)
    ax.plot(xs, [glob.temperature(t) for t in xs], "k--", lw=1.4, label="global schedule")
    ax.axvline(cfg.compress_ratio * cfg.steps, color="grey", lw=0.8, ls=":",
               label="end of compress")
    fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax,
                 label="log10 Hessian trace (floored)")
    ax.set_xlabel("QAT step")
    ax.set_ylabel("temperature T (codebook units$^2$)")
    ax.set_title(f"{len(traces)} per-tensor schedules")
    ax.legend()
    return fig


# -- the explorer: the relaxed quantizer along one tensor's schedule ----------------------------

DEAD_SLOPE = 0.1     # a weight whose forward moves less than this per unit of W/gamma is "dead"


def forward_curve(x: torch.Tensor, temp: float, pressure: float):
    """What Hestia's forward computes from ``x = W / gamma`` at ``temp`` and ``pressure``,
    ``lerp(x, E_T(x), pressure)`` with ``E_T(x) = sum_c c softmax_c(-(x - c)^2 / T)``, and its
    slope in ``x`` (gamma held fixed): ``1 - p + p (2/T) Var_p(c)``; ``temp <= 0`` is the hard
    quantizer, whose forward is flat between the rounding boundaries."""
    if temp <= 0:
        e, slope_e = torch.clamp(torch.round(x), -1, 1), torch.zeros_like(x)
    else:
        c = torch.tensor(M.CODEBOOK, dtype=x.dtype, device=x.device)
        prob = torch.softmax(-(x.unsqueeze(-1) - c) ** 2 / temp, dim=-1)
        e = prob @ c
        slope_e = (2 / temp) * (prob @ (c * c) - e * e)
    return torch.lerp(x, e, pressure), (1 - pressure) + pressure * slope_e


def dead_share(x: torch.Tensor, schedule: M.Schedule, steps) -> np.ndarray:
    """At each of ``steps``: the share of the weights ``x = W / gamma`` whose forward slope
    (:func:`forward_curve`, at the schedule's temperature and pressure) is below
    :data:`DEAD_SLOPE`: moving them a little changes nothing the network computes."""
    return np.array([float((forward_curve(x, schedule.temperature(t), schedule.pressure(t))[1]
                            < DEAD_SLOPE).float().mean()) for t in steps])


def relaxation_figure(w: torch.Tensor, schedule: M.Schedule, glob: M.Schedule, step: int,
                      name: str):
    """Left: the forward of one tensor at ``step`` of its schedule against ``x = W / gamma``
    (and its slope), the hard quantizer dashed, the tensor's weights as a histogram. Right: the
    share of its weights in the dead zone over QAT, its schedule against the global one (read
    on 4096 evenly spaced quantiles of the weights, so a move stays cheap)."""
    x = (w / M.absmean_scale(w)).flatten().float().cpu()          # a figure: on the host
    grid = torch.linspace(-2.5, 2.5, 501)
    temp, pres = schedule.temperature(step), schedule.pressure(step)
    f, slope = forward_curve(grid, temp, pres)
    fig, (a1, a2) = subplots(1, 2, figsize=(12, 3.8))
    a1.hist(x.numpy(), bins=120, range=(-2.5, 2.5), density=True, color="0.85", label="weights")
    a1.plot(grid, forward_curve(grid, 0.0, 1.0)[0], "k--", lw=1, label="hard Q (STE forward)")
    a1.plot(grid, f, color=COLOR["Hestia, Hessian T"], label="Hestia forward")
    a1.plot(grid, slope.clamp(max=3), ":", color=COLOR["Hestia, Hessian T"],
            label="its slope (cut at 3)")
    a1.set(xlabel="x = W / gamma", ylim=(-1.6, 3.1),
           title=f"{name.removeprefix('model.layers.')}, step {step}: T = {temp:.3g}, "
           f"pressure {pres:.2f} (scale {schedule.scale:.2f})")
    a1.legend(fontsize=7, loc="upper left")
    xs = np.arange(schedule.steps)
    qs = x.sort().values[torch.linspace(0, len(x) - 1, min(len(x), 4096)).long()]  # quantiles
    for s, lab, ls in ((schedule, "this tensor's schedule", "-"), (glob, "global schedule", "--")):
        color = "k" if s is glob else COLOR["Hestia, Hessian T"]
        a2.plot(xs, dead_share(qs, s, xs), ls, color=color, label=lab)
    a2.axvline(step, color="0.4", lw=1)
    a2.set(xlabel="QAT step", ylabel=f"share of weights with slope < {DEAD_SLOPE}",
           ylim=(-0.02, 1.02), title="dead zone over QAT (STE's forward: all of them, always)")
    a2.legend(fontsize=7)
    return fig
