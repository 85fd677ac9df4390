"""The experiments of notebook 14: GSQ, Gumbel-Softmax scalar quantization (the method itself is
:mod:`workbench.methods.gsq`).

The harness loads the zoo's quantization bed with its calibration Hessians and held-out blocks;
measures how sensitive the backbone is to its block weights; quantizes every block linear with
RTN, GPTQ and GSQ as published (IST-DASLab/GSQ, started from the reference's own GPTQ: searched
group scales, damping 0.1) at each bit width, and the two
ablations of ours that re-solve the scales of GPTQ's and of GSQ's assignment in closed form; at 2
and 3 bits, the frontier GSQ is measured against (GPTVQ, van Baalen et al. 2024, at the scalar
grid's bits per weight, codebooks included) and AWQ (Lin et al. 2024) beside RTN and GPTQ;
scores the zero-shot task; writes gguf-py's Q4_0 assignment and GSQ's as GGUF files and reads
them back three ways; and times GSQ against layer size. For the explorer: RTN's and GPTQ's
perplexity over bits and group sizes (GSQ only where the notebook ran it) and one weight row on
its grid.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from workbench import evaluate
from workbench import quant as Q
from workbench.data import corpus
from workbench.methods import gsq as M
from workbench.models import zoo
from workbench.plots import subplots

__all__ = ["LIMITS", "METHODS", "ABLATIONS", "STARTS", "NAMES", "LLAMA_CPP_PPL_RTOL", "limits",
           "swapped", "layer_errors", "gap_closed", "loglog_slope", "Bed", "load_bed",
           "weight_noise", "baseline", "gsq_start", "quantize_all", "FRONTIER", "VQ_DIM",
           "frontier", "frontier_gap", "frontier_metrics", "solved_scales", "ppl_metrics",
           "ppl_table", "flips", "layer_error_means", "diagnostics_figure", "task_scores",
           "q4_0_round_trip", "readers_agree", "timing_sweep", "timing_figure", "group_sizes",
           "group_table", "grid_rows", "explore_figure"]

LIMITS = {"group_size": [32 * k for k in range(1, 65)], "gsq_steps": (0, None),
          "n_calib": (1, None)}
METHODS = ("rtn", "gptq", "gsq")
ABLATIONS = ("gptq+scales", "gsq+scales")
# GSQ's start: the reference's GPTQ (searched, signed group scales, damping 0.1,
# methods.gsq.gptq_start) or the GPTQ baseline's codes (absmax scales, damping 0.01)
STARTS = ("official", "absmax")
FRONTIER = ("awq", "vq")          # the other scalar baseline and the vector frontier (2, 3 bits)
VQ_DIM = 2                        # GPTVQ's 2-D vectors (the paper's main setting)
NAMES = {"rtn": "RTN", "awq": "AWQ", "gptq": "GPTQ",
         "gsq-start": "GPTQ as GSQ starts it (searched scales, damping 0.1)",
         "gsq": "GSQ (as published)",
         "gptq+scales": "GPTQ + solved scales (ablation, ours)",
         "gsq+scales": "GSQ + solved scales (ablation, ours)",
         "vq": "GPTVQ 2-D (vector frontier)"}
LLAMA_CPP_PPL_RTOL = 0.01        # llama.cpp's Q8_0 activations against the float model


def limits() -> dict:
    """:data:`LIMITS` (``model``, a zoo name or a checkpoint, is checked before the kernel starts
    by :func:`workbench.models.checkpoint.validate_params`)."""
    return dict(LIMITS)


class swapped:
    """Context manager: temporarily put ``weights`` (name -> tensor) into ``model``'s linears."""

    def __init__(self, model, weights: dict):
        self.model, self.weights, self.saved = model, weights, {}

    def __enter__(self):
        mods = dict(self.model.named_modules())
        with torch.no_grad():
            for n, w in self.weights.items():
                p = mods[n].weight
                self.saved[n] = p.detach().clone()
                p.copy_(w.to(p.dtype))
        return self.model

    def __exit__(self, *exc):
        mods = dict(self.model.named_modules())
        with torch.no_grad():
            for n, w in self.saved.items():
                mods[n].weight.copy_(w)
        return False


def layer_errors(model, hessians: dict, weights: dict) -> dict[str, float]:
    """Relative reconstruction error ``tr(dW H dW^T) / tr(W H W^T)`` of each layer."""
    layers = Q.block_linears(model)
    out = {}
    for n, wq in weights.items():
        w = layers[n].weight.detach().float()
        out[n] = Q.output_error(w, wq, hessians[n]) / Q.output_error(w, torch.zeros_like(w),
                                                                     hessians[n])
    return out


def gap_closed(ppl_fp: float, ppl_rtn: float, ppl_x: float) -> float:
    """Fraction of the RTN-to-full-precision perplexity gap that method ``x`` closes."""
    gap = ppl_rtn - ppl_fp
    return float("nan") if gap <= 0 else (ppl_rtn - ppl_x) / gap


def loglog_slope(x, y) -> float:
    """Least-squares slope of log y against log x (the scaling exponent)."""
    lx = torch.tensor([math.log(v) for v in x])
    ly = torch.tensor([math.log(v) for v in y])
    lx, ly = lx - lx.mean(), ly - ly.mean()
    return float((lx * ly).sum() / (lx * lx).sum())


@dataclass
class Bed:
    """The backbone, its block linears, their calibration Hessians and the held-out blocks."""
    model: torch.nn.Module     # the full-precision backbone (weights swapped in and out)
    tok: object                # its tokenizer
    card: dict                 # its zoo card
    calib: torch.Tensor        # calibration blocks (train split)
    held: torch.Tensor         # held-out blocks
    layers: dict               # name -> block linear
    H: dict                    # name -> calibration Hessian 2/N X X^T
    ppl_fp: float              # held-out perplexity in full precision
    load_s: float              # seconds zoo.load took
    t_start: float             # when the quantization work began (time.time())

    def elapsed(self) -> float:
        """Seconds since the quantization work began."""
        return time.time() - self.t_start

    def ppl(self, weights: dict | None = None) -> float:
        """Held-out perplexity, with ``weights`` (name -> tensor) swapped in when given."""
        if weights is None:
            return evaluate.perplexity(self.model, self.held)
        with swapped(self.model, weights):
            return evaluate.perplexity(self.model, self.held)


def load_bed(model: str, scale: str, S: dict, seed: int, device) -> Bed:
    """Load the backbone (a zoo name, built on first use, or a checkpoint directory), draw the
    calibration windows (seeded) and the held-out blocks, and collect every block linear's
    Hessian."""
    t0 = time.time()
    lm, tok = zoo.load(model, scale, device=str(device))
    load_s = time.time() - t0
    t_start = time.time()
    calib = corpus.calibration_blocks(tok, S["ctx"], S["n_calib"], seed=seed)
    held = corpus.heldout_blocks(tok, S["ctx"], S["heldout_blocks"] or None)
    layers = Q.block_linears(lm)
    H = Q.collect_hessians(lm, layers, calib)
    ppl_fp = evaluate.perplexity(lm, held)
    return Bed(lm, tok, lm.zoo_card, calib, held, layers, H, ppl_fp, load_s, t_start)


def weight_noise(bed: Bed, levels, seed: int, device) -> tuple[dict, float]:
    """Held-out perplexity with every block weight perturbed as ``w (1 + sigma eps)``,
    ``eps ~ N(0, 1)`` (one seeded draw per level, in order), and with the block linears zeroed."""
    gen_noise = torch.Generator(device=device).manual_seed(seed)
    sensitivity = {}
    for sigma in levels:
        noisy = {n: l.weight.detach() * (1 + sigma * torch.randn(l.weight.shape, generator=gen_noise,
                                                                  device=device))
                 for n, l in bed.layers.items()}
        sensitivity[sigma] = bed.ppl(noisy)
    zeroed = bed.ppl({n: torch.zeros_like(l.weight) for n, l in bed.layers.items()})
    return sensitivity, zeroed


def solved_scales(bed: Bed, info: dict, group_size: int) -> dict:
    """The ablations (ours, not the paper's): an assignment's levels (GPTQ's or GSQ's) with the
    scales re-solved in closed form for the layer-wise objective (eq. 4,
    :func:`workbench.methods.gsq.optimal_scales`)."""
    wq = {}
    for n, i in info.items():
        lv = i["q"].level_index.float()
        s = M.optimal_scales(bed.layers[n].weight.detach()[None].float(), bed.H[n][None],
                             lv[None], group_size)[0]
        ok = torch.isfinite(s) & (s * i["q"].scale > 0)          # keep the sign, never zero
        wq[n] = Q.expand_groups(torch.where(ok, s, i["q"].scale), group_size, lv.shape[1]) * lv
    return wq


def baseline(bed: Bed, method: str, bits: int, group_size: int) -> tuple[dict, dict]:
    """RTN or GPTQ (layer-wise, on the full-precision model's Hessians) of every block linear:
    ``(name -> dequantized weight, name -> {"q", "seconds"})``."""
    weights, info = {}, {}
    for n, lin in bed.layers.items():
        t = time.time()
        w = lin.weight.detach()
        q = Q.rtn(w, bits, group_size) if method == "rtn" else Q.gptq(w, bed.H[n], bits,
                                                                        group_size)
        weights[n], info[n] = q.dequantize(), {"q": q, "seconds": time.time() - t}
    return weights, info


def gsq_start(bed: Bed, bits: int, group_size: int) -> tuple[dict, dict]:
    """GSQ's start as the reference computes it (:func:`workbench.methods.gsq.gptq_start`) for
    every block linear, on the full-precision model's Hessians: ``(name -> dequantized weight,
    name -> {"q", "seconds"})``."""
    weights, info = {}, {}
    for n, lin in bed.layers.items():
        t = time.time()
        q = M.gptq_start(lin.weight.detach(), bed.H[n], bits, group_size)
        weights[n], info[n] = q.dequantize(), {"q": q, "seconds": time.time() - t}
    return weights, info


def quantize_all(bed: Bed, bits_list, group_size: int, cfg: M.GSQConfig, seed: int,
                 start: str = "official") -> dict:
    """(method, bits) -> perplexity, weights, per-layer info, seconds (wall and this process'
    CPU: one thread, so CPU seconds are what a quiet machine's wall clock would show) and
    per-layer errors, for RTN, GPTQ and GSQ as published at each bit width, then the two
    solved-scales ablations; prints a line per quantization. GSQ starts from ``start``
    (:data:`STARTS`): ``"official"``, the reference's GPTQ (its own row, ``"gsq-start"``), or
    ``"absmax"``, the GPTQ baseline's codes and scales."""
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, not {start!r}")
    results = {}
    for bits in bits_list:
        for method in METHODS:
            if method == "gsq" and start == "official":
                t, cpu = time.time(), time.process_time()
                weights, info = gsq_start(bed, bits, group_size)
                secs, cpu = time.time() - t, time.process_time() - cpu
                ppl = bed.ppl(weights)
                results[("gsq-start", bits)] = {"ppl": ppl, "weights": weights, "info": info,
                                                "s": secs, "cpu": cpu,
                                                "err": layer_errors(bed.model, bed.H, weights)}
                print(f"{bits} bit start ppl {ppl:8.3f}   {secs:5.1f} s ({cpu:5.1f} s CPU)")
            t, cpu = time.time(), time.process_time()
            if method == "gsq":
                src = "gsq-start" if start == "official" else "gptq"
                init = {n: i["q"] for n, i in results[(src, bits)]["info"].items()}
                weights, info = M.quantize_model(bed.model, bed.calib, init, cfg, seed=seed)
            else:
                weights, info = baseline(bed, method, bits, group_size)
            secs, cpu = time.time() - t, time.process_time() - cpu
            ppl = bed.ppl(weights)
            results[(method, bits)] = {"ppl": ppl, "weights": weights, "info": info, "s": secs,
                                       "cpu": cpu, "err": layer_errors(bed.model, bed.H, weights)}
            print(f"{bits} bit {method:5s} ppl {ppl:8.3f}   {secs:5.1f} s ({cpu:5.1f} s CPU)")
        for ab in ABLATIONS:
            wq = solved_scales(bed, results[(ab.split("+")[0], bits)]["info"], group_size)
            results[(ab, bits)] = {"ppl": bed.ppl(wq)}
    return results


def frontier(bed: Bed, bits_list, group_size: int, kmeans_iters: int,
             act_mean: dict | None = None) -> dict:
    """(method, bits) -> perplexity, weights, seconds, CPU seconds, per-layer errors and bits per
    weight, for AWQ (per-linear alpha search before RTN, ``Q.awq``) and GPTVQ (``Q.gptvq``:
    2-D vectors, fp16 codebooks, each codebook over the fewest rows that keep the scalar grid's
    bits per weight, ``bits + 16 / group_size``, with the codebook counted); prints a line each."""
    act_mean = act_mean or Q.mean_abs_inputs(bed.model, bed.layers, bed.calib)
    out = {}
    for bits in bits_list:
        budget = Q.bits_per_weight(bits, group_size)
        for method in FRONTIER:
            t, cpu = time.time(), time.process_time()
            weights, extra = {}, {}
            for n, lin in bed.layers.items():
                w = lin.weight.detach()
                if method == "awq":
                    weights[n], info = Q.awq(w, bed.H[n], act_mean[n], bits, group_size)
                    extra[n] = {"alpha": info["alpha"], "bpw": budget}
                else:
                    rows = Q.rows_for_budget(bits, VQ_DIM, w.shape[0], group_size, budget)
                    vq = Q.gptvq(w, bed.H[n], bits, VQ_DIM, rows, group_size,
                                 kmeans_iters=kmeans_iters)
                    weights[n], extra[n] = vq.dequantize(), {"bpw": vq.bits_per_weight,
                                                              "rows": rows}
            secs, cpu = time.time() - t, time.process_time() - cpu
            ppl = bed.ppl(weights)
            sizes = {n: lin.weight.numel() for n, lin in bed.layers.items()}
            bpw = sum(extra[n]["bpw"] * sizes[n] for n in sizes) / sum(sizes.values())
            out[(method, bits)] = {"ppl": ppl, "weights": weights, "info": extra, "s": secs,
                                   "cpu": cpu, "bpw": bpw,
                                   "err": layer_errors(bed.model, bed.H, weights)}
            print(f"{bits} bit {method:5s} ppl {ppl:8.3f}   {bpw:.3f} bpw   {secs:5.1f} s "
                  f"({cpu:5.1f} s CPU)")
    return out


def frontier_gap(ppl_gptq: float, ppl_gsq: float, ppl_vq: float) -> float:
    """Fraction of the GPTQ-to-frontier gap GSQ closes, ``(gptq - gsq) / (gptq - vq)``; NaN
    when the vector quantizer is not ahead of GPTQ (no gap to close)."""
    gap = ppl_gptq - ppl_vq
    return float("nan") if gap <= 0 else (ppl_gptq - ppl_gsq) / gap


def frontier_metrics(results: dict, bits_list) -> dict:
    """``ppl_{awq,vq}_{bits}bit``, their seconds and CPU seconds, ``bpw_{awq,vq}_{bits}bit``,
    ``awq_alpha_mean_{bits}bit``, ``layer_err_{awq,vq}_{bits}bit`` and
    ``frontier_gap_closed_gsq_{bits}bit`` (needs GPTQ's and GSQ's rows in ``results``)."""
    out = {}
    for b in bits_list:
        for m in FRONTIER:
            r = results[(m, b)]
            out.update({f"ppl_{m}_{b}bit": r["ppl"], f"seconds_{m}_{b}bit": r["s"],
                        f"cpu_seconds_{m}_{b}bit": r["cpu"], f"bpw_{m}_{b}bit": r["bpw"],
                        f"layer_err_{m}_{b}bit": float(np.mean(list(r["err"].values())))})
        out[f"awq_alpha_mean_{b}bit"] = float(np.mean(
            [i["alpha"] for i in results[("awq", b)]["info"].values()]))
        out[f"frontier_gap_closed_gsq_{b}bit"] = frontier_gap(
            *(results[(m, b)]["ppl"] for m in ("gptq", "gsq", "vq")))
    return out


def ppl_metrics(results: dict, bits_list) -> dict:
    """``ppl_{method}_{bits}bit``, ``seconds_{method}_{bits}bit`` and
    ``cpu_seconds_{method}_{bits}bit`` of RTN, GPTQ and GSQ (and of GSQ's start, ``gsq_start``,
    where it ran), and ``ppl_gptq_scales_{bits}bit``, ``ppl_gsq_scales_{bits}bit`` of the
    ablations."""
    out = {}
    for bits in bits_list:
        if ("gsq-start", bits) in results:
            r = results[("gsq-start", bits)]
            out.update({f"ppl_gsq_start_{bits}bit": r["ppl"],
                        f"seconds_gsq_start_{bits}bit": r["s"],
                        f"cpu_seconds_gsq_start_{bits}bit": r["cpu"]})
        for m in METHODS:
            out.update({f"ppl_{m}_{bits}bit": results[(m, bits)]["ppl"],
                        f"seconds_{m}_{bits}bit": results[(m, bits)]["s"],
                        f"cpu_seconds_{m}_{bits}bit": results[(m, bits)]["cpu"]})
        for ab in ABLATIONS:
            out[f"ppl_{ab.split('+')[0]}_scales_{bits}bit"] = results[(ab, bits)]["ppl"]
    return out


def ppl_table(results: dict, bits_list, group_size: int, ppl_fp: float) -> pd.DataFrame:
    """Perplexity per method (rows) and bit width (columns, with bits per weight); NaN where a
    method did not run at that width (AWQ and GPTVQ run at 2 and 3 bits)."""
    table = pd.DataFrame({f"{b} bit ({Q.bits_per_weight(b, group_size):.3g} bpw)":
                          {NAMES[m]: results[(m, b)]["ppl"] if (m, b) in results else np.nan
                           for m in NAMES} for b in bits_list})
    table.loc["full precision"] = ppl_fp
    return table


def flips(results: dict, bits: int) -> np.ndarray:
    """GSQ's assignment flips per step, summed over the sub-blocks, at ``bits`` (a single 0
    when GSQ ran no step)."""
    hists = {id(i["hist"]): i["hist"] for i in results[("gsq", bits)]["info"].values()}
    f = np.sum([h["flips"] for h in hists.values()], axis=0)
    return f if np.size(f) else np.zeros(1, dtype=int)


def layer_error_means(results: dict, bits_list) -> dict:
    """``layer_err_{method}_{bits}bit``: the mean relative reconstruction error over layers."""
    return {f"layer_err_{m}_{b}bit": float(np.mean(list(results[(m, b)]["err"].values())))
            for m in METHODS for b in bits_list}


def diagnostics_figure(results: dict, layer_names: list, bits_list):
    """GSQ's flips per step (all bit widths), and the per-layer error of RTN, GPTQ and GSQ at 2
    and 3 bits."""
    fig, axes = subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    for bits in bits_list:
        f = flips(results, bits)
        ax.plot(np.arange(1, len(f) + 1), np.maximum(f, 0.5), label=f"{bits} bit")
    ax.set_yscale("log")
    ax.set_xlabel("GSQ step (each sub-block)")
    ax.set_ylabel("assignment flips (all layers, log)")
    ax.set_title("GSQ: level changes per step")
    ax.legend()
    x = np.arange(len(layer_names))
    for ax, bits in zip(axes[1:], (2, 3)):
        for m, off in (("rtn", -0.27), ("gptq", 0.0), ("gsq", 0.27)):
            ax.bar(x + off, [results[(m, bits)]["err"][n] for n in layer_names], width=0.27,
                   label=NAMES[m])
        ax.set_yscale("log")
        ax.set_xticks(x[::7])
        ax.set_xticklabels([f"block {n.split('.')[2]}" for n in layer_names[::7]])
        ax.set_xlabel("layer (q, k, v, o, gate, up, down per block)")
        ax.set_ylabel("relative reconstruction error (log)")
        ax.set_title(f"per-layer error, {bits} bit")
        ax.legend()
    return fig


def task_scores(bed: Bed, results: dict, n: int) -> tuple[str, dict]:
    """The trained task family the full-precision model does best, and the exact-match accuracy
    on it of fp and of RTN, GPTQ and GSQ at 2 and 3 bits."""
    card = bed.card
    easiest = card["recipe"].get("easiest")
    known = card.get("task_accuracy") or {       # a checkpoint without a zoo card: measure
        f: evaluate.task_accuracy(bed.model, bed.tok, f, n, seed=777, easiest=easiest)
        for f in card["trained_tasks"]}
    family = max(card["trained_tasks"], key=lambda f: known[f])
    acc = {"fp": evaluate.task_accuracy(bed.model, bed.tok, family, n, seed=777, easiest=easiest)}
    for bits in (2, 3):
        for m in METHODS:
            with swapped(bed.model, results[(m, bits)]["weights"]):
                acc[f"{m}_{bits}bit"] = evaluate.task_accuracy(bed.model, bed.tok, family, n,
                                                               seed=777, easiest=easiest)
    return family, acc


def _q4_0_file(bed: Bed, label: str, codes: dict, path, name: str, metadata: dict, device,
               reader: str) -> dict:
    """Write one Q4_0 assignment as a GGUF file and read it back three ways."""
    stored = {n: Q.gguf.stored_weight(q, "Q4_0") for n, q in codes.items()}  # levels x fp16 scales
    ppl_memory = bed.ppl({n[: -len(".weight")]: w.to(device) for n, w in stored.items()})
    path = Q.gguf.export_model_gguf(bed.model, path, "Q4_0", tokenizer=bed.tok, codes=codes,
                                    name=name, metadata=metadata)
    back = dict(Q.gguf.import_model_gguf(copy.deepcopy(bed.model).cpu(), path).named_parameters())
    tf_model, _ = Q.gguf.load_transformers(path)
    return {"file": path.name, "bytes": path.stat().st_size,
            "types": dict(pd.Series(Q.gguf.tensor_types(path)).value_counts()),
            "exact": all(torch.equal(back[n], w) for n, w in stored.items()),
            "ppl_memory": ppl_memory,
            "ppl_transformers": evaluate.perplexity(tf_model.to(device), bed.held),
            "ppl_llama_cpp": (Q.gguf.llama_cpp_perplexity(path, bed.held.cpu().numpy())
                              if reader == "llama.cpp" else None)}


def q4_0_round_trip(bed: Bed, cfg: M.GSQConfig, seed: int, out_dir, name: str,
                    device) -> dict:
    """gguf-py's own Q4_0 quantization of every block weight, GSQ as published started from it
    (groups of 32, 4 bits: shifts {-2..2} around the file's codes), both written as GGUF files and read back: ``reader`` (llama.cpp when installed,
    else transformers), ``files`` (label -> what each reader found), ``ppl_start``,
    ``ppl_gsq`` (the deciding reader's perplexities), ``seconds`` and ``cpu_seconds`` (GSQ's)."""
    start = {n: Q.gguf.q4_0_quantized(lin.weight.detach().cpu().numpy()).to(lin.weight.device)
             for n, lin in bed.layers.items()}
    t, cpu = time.time(), time.process_time()
    _, info_q4 = M.quantize_model(bed.model, bed.calib, start, cfg, seed=seed)
    secs, cpu = time.time() - t, time.process_time() - cpu
    assignments = {"gguf-py Q4_0": {n + ".weight": q for n, q in start.items()},
                   "GSQ Q4_0": {n + ".weight": i["q"] for n, i in info_q4.items()}}
    reader = "llama.cpp" if Q.gguf.have_llama_cpp() else "transformers"
    files = {label: _q4_0_file(bed, label, codes,
                               out_dir / f"{name}-{label.split()[0]}-q4_0.gguf",
                               f"{name} {label}",
                               {"workbench.notebook": "14-gsq", "workbench.seed": seed}, device,
                               reader)
             for label, codes in assignments.items()}
    ppl_key = "ppl_llama_cpp" if reader == "llama.cpp" else "ppl_transformers"
    ppl_start, ppl_gsq = (files[k][ppl_key] for k in assignments)
    return {"reader": reader, "files": files, "ppl_start": ppl_start, "ppl_gsq": ppl_gsq,
            "seconds": secs, "cpu_seconds": cpu}


def readers_agree(files: dict) -> bool:
    """Every file holds exactly its codes, transformers' perplexity is the in-memory model's
    (to 1e-5), and llama.cpp's (when read) is within :data:`LLAMA_CPP_PPL_RTOL` of it."""
    return all(r["exact"] and abs(r["ppl_transformers"] / r["ppl_memory"] - 1) <= 1e-5
               and (r["ppl_llama_cpp"] is None
                    or abs(r["ppl_llama_cpp"] / r["ppl_memory"] - 1) <= LLAMA_CPP_PPL_RTOL)
               for r in files.values())


def _linear(x, weights: dict):
    """A one-linear sub-block ``x W^T`` (the timing sweep's)."""
    return x @ weights["w"].T


def timing_sweep(dims, steps: int, seed: int, tokens: int = 512) -> tuple[list, list]:
    """Seconds of GSQ's loop (3 bits, groups of 32, started from RTN, the reference's settings)
    on a one-linear sub-block ``x W^T`` of each width in ``dims``, ``tokens`` Gaussian input rows
    per step, after a 2-step warm-up: ``(weights per layer, seconds)``."""
    gen = torch.Generator().manual_seed(seed)
    sizes, secs = [], []
    for dim in dims:
        x = torch.randn(4 * tokens, dim, generator=gen)
        W = torch.randn(dim, dim, generator=gen) / dim ** 0.5
        q0 = Q.rtn(W, 3, 32)
        warm = M.GSQConfig(steps=2, batch=tokens)
        M.train_subblock(_linear, {"w": M.GumbelQuantizer(q0, warm, gen)}, x, x @ W.T, warm, gen)
        cfg = M.GSQConfig(steps=steps, batch=tokens)
        gq = M.GumbelQuantizer(q0, cfg, gen)
        t = time.perf_counter()
        M.train_subblock(_linear, {"w": gq}, x, x @ W.T, cfg, gen)
        sizes.append(dim * dim)
        secs.append(time.perf_counter() - t)
    return sizes, secs


def timing_figure(sizes: list, secs: list, steps: int, slope: float):
    """Seconds per layer against weights per layer on log axes, with a linear reference."""
    fig, ax = subplots(1, 1, figsize=(5.2, 3.6))
    ax.loglog(sizes, secs, "o-", label=f"GSQ, {steps} steps (exponent {slope:.2f})")
    ax.loglog(sizes, [secs[0] * s / sizes[0] for s in sizes], "k--", lw=1,
              label="linear in weights")
    ax.set_xlabel("weights per layer")
    ax.set_ylabel("seconds per layer")
    ax.set_title("GSQ cost vs layer size")
    ax.legend()
    return fig


# -- the explorer: bits and group size against perplexity and the weight grid ----------------

def group_sizes(layers: dict) -> list[int]:
    """The allowed group sizes (multiples of 32) that divide every layer's in-features."""
    cols = [lin.weight.shape[1] for lin in layers.values()]
    return [g for g in LIMITS["group_size"] if all(c % g == 0 for c in cols)]


def group_table(bed: Bed, results: dict, bits_list, sizes, group_size: int) -> pd.DataFrame:
    """Held-out perplexity of RTN and GPTQ at every bit width and group size in ``sizes`` (read
    from ``results`` at the notebook's ``group_size``, quantized afresh elsewhere), and GSQ's at
    ``group_size`` only: rows ``method, bits, group size, bits per weight, ppl``."""
    rows = []
    for gs in sizes:
        for b in bits_list:
            for m in ("rtn", "gptq", "gsq"):
                if m == "gsq" and gs != group_size:
                    continue
                ppl = (results[(m, b)]["ppl"] if gs == group_size
                       else bed.ppl(baseline(bed, m, b, gs)[0]))
                rows.append({"method": NAMES[m], "bits": b, "group size": gs,
                             "bits per weight": Q.bits_per_weight(b, gs), "ppl": ppl})
    return pd.DataFrame(rows)


def grid_rows(bed: Bed, results: dict, layer: str, bits: int, gs: int, group_size: int,
              row: int = 0, cols: int = 64) -> dict:
    """One output row of ``layer`` (its first ``cols`` inputs), on the host for the figure:
    ``"fp"`` -> the weights, and per method -> ``(dequantized weights, per-group scale)``: RTN and
    GPTQ quantized afresh at ``bits`` and ``gs`` (one layer, cheap), GSQ read from ``results``
    when ``gs == group_size``."""
    w = bed.layers[layer].weight.detach()
    qs = {"rtn": Q.rtn(w, bits, gs), "gptq": Q.gptq(w, bed.H[layer], bits, gs)}
    if gs == group_size:
        qs["gsq"] = results[("gsq", bits)]["info"][layer]["q"]
    out = {"fp": w[row, :cols].float().cpu()}
    for m, q in qs.items():
        out[m] = (q.dequantize()[row, :cols].cpu(),
                  q.scale[row, :max(1, cols // q.group_size)].cpu())
    return out


def _ppl_panel(ax, table: pd.DataFrame, bits: int, gs: int, ppl_fp: float) -> None:
    """Perplexity against bits per weight: one line per method and group size, ``gs`` bold."""
    for (m, g), t in table.groupby(["method", "group size"], sort=False):
        on, color = g == gs, {"RTN": "C0", "GPTQ": "C1"}.get(m, "C2")
        ax.plot(t["bits per weight"], t["ppl"], "^-" if "GSQ" in m else "o-", color=color,
                lw=2 if on else 0.8, alpha=1 if on else 0.3, ms=6 if on else 3,
                label=f"{m}, group {g}" if on or "GSQ" in m else None)
    pick = table[(table["bits"] == bits) & (table["group size"] == gs)]
    ax.plot(pick["bits per weight"], pick["ppl"], "o", ms=13, mfc="none", mec="k")
    ax.axhline(ppl_fp, color="k", ls="--", lw=1, label="full precision")
    ax.set(xlabel="bits per weight (levels + fp16 scales)", ylabel="held-out perplexity",
           title=f"perplexity: {bits} bit, group {gs} circled")
    ax.legend(fontsize=7)


def explore_figure(table: pd.DataFrame, rows: dict, bits: int, gs: int, ppl_fp: float,
                   layer: str):
    """Left: perplexity against bits per weight over group sizes (:func:`group_table`). Right:
    one weight row (:func:`grid_rows`) with GPTQ's grid levels per group (grey) and where RTN,
    GPTQ and GSQ put each weight."""
    fig, (a1, a2) = subplots(1, 2, figsize=(12, 3.8))
    _ppl_panel(a1, table, bits, gs, ppl_fp)
    fp = rows["fp"].numpy()
    x = np.arange(len(fp))
    lv = Q.levels(bits).float()
    for k, s in enumerate(rows["gptq"][1]):
        for v in (s * lv).tolist():
            a2.hlines(v, k * gs - 0.5, min((k + 1) * gs, len(fp)) - 0.5, color="0.85", lw=0.8)
    a2.plot(x, fp, "k.", ms=5, label="full precision")
    for (m, mk), off in zip((("rtn", "o"), ("gptq", "s"), ("gsq", "^")), (-0.25, 0.0, 0.25)):
        if m in rows:
            a2.plot(x + off, rows[m][0].numpy(), mk, ms=3.5, mfc="none", label=NAMES[m])
    ran = table.loc[table["method"] == NAMES["gsq"], "group size"]
    gsq = "" if "gsq" in rows else f"; GSQ ran at group {int(ran.iloc[0])} only"
    a2.set(xlabel="input index (row 0)", ylabel="weight",
           title=f"{layer.removeprefix('model.layers.')}: {bits}-bit grid, group {gs}{gsq}")
    a2.legend(fontsize=7, ncol=2)
    return fig
