"""A user's own model: a local Hugging Face checkpoint directory in place of a zoo recipe name.

Every LM notebook's ``model`` parameter (and 03's and 15's ``clip_model``) takes a zoo recipe
name or the path of a directory written by ``save_pretrained`` (``config.json``, the weights, the
tokenizer or processor files). This module tells the two apart (:func:`is_checkpoint`), refuses
a directory a notebook cannot use before a kernel starts (:func:`validate`, called by the runner
and again by ``workbench.start``), and names it for the caches (:func:`content_hash`: what is
built from a checkpoint, a LoRA pool or a fine-tune, is keyed by the hash of its ``config.json``
and weight files, computed once per path and modification time).

What :func:`validate` refuses, each time naming the parameter and what to do: a path that does not
exist; a directory without ``config.json``; one without a tokenizer (an LM) or image processor
(a CLIP); an architecture without the modules the notebook's method needs
(:data:`REQUIREMENTS`, for instance the separate q/k/v/o projections a LoRA method adapts); a
model whose float32 weights (estimated from the config, on the meta device: nothing is loaded)
do not fit the device's memory. With the run's scale and knobs, :func:`fit` then refuses shapes
and files a notebook's kernel would fail on (:data:`SHAPES`: a group size that does not divide
every block linear's in-features, layers too small for 14's vector frontier, a GGUF file a claim
reads that the export cannot write) and warns of an optional step the notebook will skip. A
tokenizer without a pad token is accepted with a warning: the loader sets pad = eos
(:func:`pad_warning`); one without a bos token, bos = eos (:func:`bos_warning`).

Importing this module imports neither torch nor transformers; :func:`validate` and :func:`fit`
import them only for a checkpoint's architecture, size and shapes.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .. import cache

__all__ = ["CheckpointError", "REQUIREMENTS", "NOTEBOOK_NEEDS", "RENAMED", "SHAPES",
           "FIT_KNOBS", "is_checkpoint", "label", "content_hash", "card", "pad_warning",
           "bos_warning", "validate", "validate_params", "fit", "fitting_group_sizes",
           "vq_least_rows",
           "absolute", "estimate", "device_bytes"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
BYTES_PER_PARAMETER = 4          # the notebooks load float32
HEADROOM = 0.9                   # share of the device's memory a notebook may fill

# what a method needs of an architecture: module-name parts every decoder layer must hold, as
# nn.Linear (GPT-2's fused Conv1D c_attn is not four projections), and the layout, if any
REQUIREMENTS = {
    "lm": {"text": "a causal LM", "linears": ()},
    "qkvo": {"text": "separate q_proj, k_proj, v_proj and o_proj nn.Linear projections in "
                     "every attention layer (Llama, Qwen2, Mistral, Gemma; not GPT-2's fused "
                     "c_attn nor Phi-3's qkv_proj)",
             "linears": ("q_proj", "k_proj", "v_proj", "o_proj")},
    "decoder": {"text": "Llama-style decoder layers at model.layers, each with self_attn "
                        "q_proj/k_proj/v_proj/o_proj, mlp gate_proj/up_proj/down_proj and a "
                        "post_attention_layernorm (Llama, Qwen2, Mistral; not GPT-2 or Phi-3)",
                "linears": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"), "layers": True},
    # GSQ's sub-blocks are x + attn(input_layernorm(x)) and h + mlp(post_attention_layernorm(h)):
    # a layer with more (Gemma2's pre- and post-feedforward norms) would be fitted wrongly
    "llama_layer": {"text": "Llama-style decoder layers at model.layers, each x + "
                            "self_attn(input_layernorm(x)), then h + "
                            "mlp(post_attention_layernorm(h)), and nothing more (Llama, Qwen2, "
                            "Qwen3, Mistral; not Gemma2's extra norms, GPT-2 or Phi-3)",
                    "linears": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"), "layers": True,
                    "children": ("self_attn", "mlp", "input_layernorm",
                                 "post_attention_layernorm")},
    "lora": {"text": "projections peft's LoRA can wrap (q/k/v/o, gate/up/down, or GPT-2's "
                     "c_attn/c_proj/c_fc)", "linears": (),
             "any_of": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj", "c_attn", "c_proj", "c_fc")},
    "haps": {"text": "an architecture whose projections HAPS adapts (methods.haps.ARCH_TARGETS: "
                     "Llama, Qwen2, GPT-2)", "linears": (),
             "model_types": ("llama", "qwen2", "gpt2")},
    "clip": {"text": "a CLIPModel", "linears": ()},
}

# each notebook's model parameters: name -> (kind: lm | clip, requirement, working copies of the
# weights it holds at once, for the memory estimate)
NOTEBOOK_NEEDS = {
    "01-inducekv": {"model": ("lm", "lora", 3)},
    "02-lqzo": {"model": ("lm", "decoder", 3)},
    "03-hdca": {"clip_model": ("clip", "clip", 2)},
    "04-hybrid-lora": {"model": ("lm", "qkvo", 4)},
    "05-lora-bottleneck-rank": {"model": ("lm", "decoder", 3)},
    "06-hint-tuning": {"instruct_model": ("lm", "lm", 1), "reasoning_model": ("lm", "lora", 3)},
    "07-hilora": {"model": ("lm", "lora", 3)},
    "10-hestia": {"model": ("lm", "decoder", 3)},
    "11-haps": {"candidate_models": ("lm", "haps", 2)},
    "13-frechet-merging": {"model": ("lm", "lora", 3)},
    "14-gsq": {"model": ("lm", "llama_layer", 3)},
    "15-fewshot-clip-optimizers": {"clip_model": ("clip", "clip", 2)},
    "16-fura": {"model": ("lm", "qkvo", 8)},
    "18-loss-signature-curation": {"model": ("lm", "qkvo", 3), "teacher_model": ("lm", "lm", 1)},
    "19-nbdiff": {"model": ("lm", "lm", 4)},
}

# what a notebook's kernel needs of a checkpoint's shapes and files beyond its modules, checked
# by :func:`fit` on the model built from the config (meta device) before a kernel starts:
# "group_size": (step, largest) of the group sizes the notebook allows; each must divide every
# block linear's in-features (the SIZES row gives the default); "vq_bits": the widths of 14's
# GPTVQ frontier, whose 2-D fp16 codebooks must fit the scalar grid's bits per weight;
# "gguf": (mode, what the file is for): "claim" refuses a model the GGUF export cannot write,
# "optional" warns that the notebook will skip the step
SHAPES = {
    "02-lqzo": {"group_size": (1, None)},
    "10-hestia": {"gguf": ("optional", "its llama.cpp file of the ternary model")},
    "14-gsq": {"group_size": (32, 2048), "vq_bits": (2, 3),
               "gguf": ("claim", "C4 compares two llama.cpp GGUF files of the model")},
}
FIT_KNOBS = ("group_size",)          # the parameters :func:`fit` reads besides the models
VQ_DIM, CODEBOOK_BITS = 2, 16        # 14's GPTVQ: 2-D vectors, fp16 codebook entries


# parameters renamed to one model parameter convention: old name -> new name
RENAMED = {
    "02-lqzo": {"model_name": "model"}, "04-hybrid-lora": {"base": "model"},
    "06-hint-tuning": {"instruct": "instruct_model", "reasoning": "reasoning_model"},
    "07-hilora": {"base": "model"}, "10-hestia": {"model_name": "model"},
    "11-haps": {"candidates": "candidate_models"}, "13-frechet-merging": {"base": "model"},
    "14-gsq": {"model_name": "model"}, "16-fura": {"base": "model"},
    "18-loss-signature-curation": {"student": "model", "model_teacher": "teacher_model"},
    "19-nbdiff": {"base": "model"},
}


class CheckpointError(ValueError):
    """A model parameter that names no usable model; the message says which and what to do."""


def is_checkpoint(value) -> bool:
    """True when ``value`` is meant as a directory (a path separator, ``~``, ``.``, or an
    existing directory) rather than a zoo recipe name such as ``lm-base``."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    text = os.fspath(value)
    return os.sep in text or "/" in text or text.startswith(("~", ".")) or Path(text).is_dir()


def _dir(value) -> Path:
    return Path(os.fspath(value)).expanduser().resolve()


def label(value) -> str:
    """A short name for folder names and tables: a zoo name as it is, a checkpoint by the name of
    its directory."""
    return _dir(value).name if is_checkpoint(value) else str(value)


# -- content hash -------------------------------------------------------------------------------

_HASHES: dict = {}


def _hashed_files(d: Path) -> list[Path]:
    return [d / "config.json"] + sorted(p for p in d.iterdir()
                                        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def content_hash(value, length: int = 12) -> str:
    """The sha1 of the checkpoint's ``config.json`` and weight files (names and bytes), first
    ``length`` hex digits: what keys everything built from it. Memoised by path, sizes and
    modification times, in this process and in ``cache.folder("checkpoints")/hashes.json``, so a
    large checkpoint is read once."""
    d = _dir(value)
    files = _hashed_files(d)
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    memo_key = cache.key(str(d), stamp, length=20)
    if memo_key in _HASHES:
        return _HASHES[memo_key][:length]
    memo = cache.folder("checkpoints") / "hashes.json"
    try:
        stored = json.loads(memo.read_text())
    except (FileNotFoundError, ValueError):
        stored = {}
    if memo_key not in stored:
        h = hashlib.sha1()
        for p in files:
            h.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        stored[memo_key] = h.hexdigest()
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        tmp.replace(memo)
    _HASHES[memo_key] = stored[memo_key]
    return _HASHES[memo_key][:length]


def card(value, model=None) -> dict:
    """The card of a checkpoint: its ``card.json`` when it has one (a zoo build, or a zoo model
    exported with ``zoo.export``), else what the workbench can say without measuring: every task
    family as trained (unknown), no steps in task text. ``key`` is always the content hash (the
    zoo card's own key, when there was one, is kept as ``zoo_key``); ``parameters`` is counted
    from ``model`` when given."""
    d = _dir(value)
    f = d / "card.json"
    from ..data.tasks import ALL_FAMILIES
    base = {"name": d.name, "trained_tasks": list(ALL_FAMILIES), "recipe": {"with_steps": False,
            "easiest": None}, "tokens_seen": None, "heldout_ppl": None, "unigram_ppl": None}
    found = json.loads(f.read_text()) if f.exists() else {}
    out = {**base, **found, "path": str(d), "key": content_hash(d), "zoo_key": found.get("key")}
    if model is not None:
        out["parameters"] = sum(p.numel() for p in model.parameters())
    return out


# -- validation ---------------------------------------------------------------------------------

def _special(d: Path, name: str):
    """The tokenizer's ``name`` special token as its config files write it (None when unset)."""
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        p = d / fname
        if p.exists():
            try:
                v = json.loads(p.read_text()).get(name)
            except ValueError:
                continue
            if isinstance(v, dict):
                v = v.get("content")
            if v:
                return v
    return None


def pad_warning(value, param: str = "model") -> str | None:
    """The warning for a tokenizer without a pad token (the loader sets pad = eos), or None."""
    d = _dir(value)
    if _special(d, "pad_token") is not None:
        return None
    return (f"{param}: the tokenizer in {d} has no pad token; using its eos token "
            f"{_special(d, 'eos_token')!r} as pad (set tok.pad_token and save it to choose "
            f"another)")


def bos_warning(value, param: str = "model") -> str | None:
    """The warning for a tokenizer without a bos token (Qwen2's, for one), or None. Every
    notebook starts a prompt with ``<bos>``; the loader then uses the eos token, the document
    separator such a model saw between pretraining documents."""
    d = _dir(value)
    if _special(d, "bos_token") is not None:
        return None
    return (f"{param}: the tokenizer in {d} has no bos token; prompts start with its eos token "
            f"{_special(d, 'eos_token')!r} instead (set tok.bos_token and save it to choose "
            f"another)")


_META: dict = {}


def _meta_model(d: Path, kind: str):
    """The model built from ``d``'s config on the meta device (no weights read), memoised by
    path and the config's modification time (:func:`validate` and :func:`fit` share it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, CLIPModel
    key = (str(d), kind, (d / "config.json").stat().st_mtime_ns)
    if key not in _META:
        cfg = AutoConfig.from_pretrained(d, local_files_only=True)
        with torch.device("meta"):
            _META[key] = CLIPModel(cfg) if kind == "clip" else \
                AutoModelForCausalLM.from_config(cfg)
    return _META[key]


def _missing(model, need: str) -> list[str]:
    """What ``model`` lacks of requirement ``need`` (empty when it has it)."""
    import torch.nn as nn
    req = REQUIREMENTS[need]
    if "model_types" in req and model.config.model_type not in req["model_types"]:
        return [f"model_type {model.config.model_type!r} in {req['model_types']}"]
    if "any_of" in req:
        names = {n.split(".")[-1] for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
        return [] if names & set(req["any_of"]) else [" or ".join(req["any_of"])]
    linears = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [x for x in req["linears"] if x not in linears]
    if req.get("layers") and not hasattr(getattr(model, "model", None), "layers"):
        missing.append("model.layers")
    return missing


def _extra(model, need: str) -> list[str]:
    """The modules of ``model``'s decoder layers beyond those requirement ``need`` allows (its
    ``children``), in the order of the first layer; empty when it allows any."""
    allowed = REQUIREMENTS[need].get("children")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if allowed is None or layers is None:
        return []
    return list(dict.fromkeys(n for layer in layers for n, _ in layer.named_children()
                              if n not in allowed))


def device_bytes(device: str | None = None) -> tuple[str, int | None]:
    """``(what, bytes)``: the memory a notebook may use on ``device`` (a CUDA device's total
    memory, else the machine's physical memory); None when unknown."""
    dev = str(device or "cpu")
    if dev.startswith("cuda") or dev == "auto":
        try:
            import torch
            if torch.cuda.is_available():
                i = int(dev.split(":")[1]) if ":" in dev else 0
                return f"GPU {i}", int(torch.cuda.get_device_properties(i).total_memory)
        except Exception:                       # no torch build with CUDA: judge the CPU
            pass
    try:
        return "CPU memory", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "CPU memory", None


def estimate(value, kind: str = "lm") -> dict:
    """Parameters and float32 bytes of a checkpoint, from its config alone (meta device)."""
    model = _meta_model(_dir(value), kind)
    n = sum(p.numel() for p in model.parameters())
    return {"parameters": n, "bytes": n * BYTES_PER_PARAMETER, "model": model}


def validate(value, param: str = "model", kind: str = "lm", need: str = "lm",
             copies: int = 1, device: str | None = None, where: str = "") -> list[str]:
    """Refuse a model parameter a notebook cannot use (:class:`CheckpointError`, naming
    ``param`` and what to do); return the warnings (a missing pad token). A zoo name passes (the
    zoo checks its own names); a checkpoint is checked in the order a user would fix it."""
    at = f"{where}: " if where else ""
    if value is None:
        return []
    if not is_checkpoint(value):
        from .recipes import RECIPES
        known = sorted(RECIPES) if kind == "lm" else ["clip-mini"]
        if str(value) not in known:
            raise CheckpointError(f"{at}{param} = {value!r} is neither a zoo model "
                                  f"({', '.join(known)}) nor a directory; give a zoo name or a "
                                  "checkpoint path (./my-model, /abs/path)")
        return []
    d = _dir(value)
    if not d.exists():
        raise CheckpointError(f"{at}{param} = {value!r}: no such directory; give a zoo name or "
                              "the directory model.save_pretrained(...) wrote")
    if not d.is_dir():
        raise CheckpointError(f"{at}{param} = {value!r} is a file; give the directory that "
                              "holds config.json and the weights")
    if not (d / "config.json").exists():
        raise CheckpointError(f"{at}{param} = {value!r}: no config.json in {d}; save the model "
                              "there with model.save_pretrained(path)")
    if not any(p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in d.iterdir()):
        raise CheckpointError(f"{at}{param} = {value!r}: no weight files (*.safetensors, *.bin) "
                              f"in {d}; save the model there with model.save_pretrained(path)")
    warnings = []
    if kind == "clip":
        if not any((d / f).exists() for f in PROCESSOR_FILES) or \
                not any((d / f).exists() for f in TOKENIZER_FILES):
            raise CheckpointError(f"{at}{param} = {value!r}: no CLIP processor (image processor "
                                  f"and tokenizer files) in {d}; save one there with "
                                  "CLIPProcessor.save_pretrained(path)")
    else:
        if not any((d / f).exists() for f in TOKENIZER_FILES):
            raise CheckpointError(f"{at}{param} = {value!r}: no tokenizer in {d} (none of "
                                  f"{', '.join(TOKENIZER_FILES)}); save one there with "
                                  "tokenizer.save_pretrained(path)")
        for token, warning in (("pad", pad_warning), ("bos", bos_warning)):
            w = warning(d, param)
            if w and _special(d, "eos_token") is None:
                raise CheckpointError(f"{at}{param} = {value!r}: the tokenizer has neither a "
                                      f"{token} nor an eos token; set tok.{token}_token and "
                                      "save it")
            warnings += [w] if w else []
    try:
        est = estimate(d, kind)
    except Exception as e:                  # an architecture this transformers does not know
        raise CheckpointError(f"{at}{param} = {value!r}: transformers cannot build a model from "
                              f"{d / 'config.json'} ({type(e).__name__}: {e})") from None
    missing = _missing(est["model"], need)
    if missing:
        arch = ", ".join(est["model"].config.architectures or [type(est["model"]).__name__])
        raise CheckpointError(f"{at}{param} = {value!r}: this method needs "
                              f"{REQUIREMENTS[need]['text']}; {arch} has no "
                              f"{', '.join(missing)}; choose a model with them")
    extra = _extra(est["model"], need)
    if extra:
        arch = ", ".join(est["model"].config.architectures or [type(est["model"]).__name__])
        raise CheckpointError(f"{at}{param} = {value!r}: this method needs "
                              f"{REQUIREMENTS[need]['text']}; the decoder layers of {arch} also "
                              f"hold {', '.join(extra)}, which it would leave out; choose a "
                              "model without them")
    what, avail = device_bytes(device)
    want = est["bytes"] * max(1, copies)
    if avail is not None and want > HEADROOM * avail:
        raise CheckpointError(
            f"{at}{param} = {value!r}: {est['parameters'] / 1e9:.2f}B parameters, about "
            f"{want / 2**30:.1f} GiB in float32 for {copies} working copies, more than "
            f"{HEADROOM:.0%} of the {avail / 2**30:.1f} GiB of {what}; choose a smaller model or "
            "a device with more memory")
    return warnings


def _split(value) -> list:
    """11's comma-separated list, or the one value."""
    if isinstance(value, str) and "," in value:
        return [v.strip() for v in value.split(",") if v.strip()]
    return [value]


def absolute(slug: str, name: str, value):
    """``value`` with every checkpoint path in it made absolute (a kernel runs in its run folder,
    not where the user typed the path); other values as they are."""
    if name not in NOTEBOOK_NEEDS.get(slug, {}) or not isinstance(value, str):
        return value
    return ",".join(str(_dir(v)) if is_checkpoint(v) else v for v in _split(value))


def validate_params(slug: str, params: dict, device: str | None = None,
                    scale: str | None = None) -> list[str]:
    """:func:`validate` every model parameter of notebook ``slug`` in ``params`` (a
    comma-separated list for 11's ``candidate_models``) and, given the run's ``scale``, :func:`fit`
    them to its knobs; the warnings."""
    warnings = []
    for name, (kind, need, copies) in NOTEBOOK_NEEDS.get(slug, {}).items():
        for v in _split(params.get(name)):
            warnings += validate(v, name, kind, need, copies, device, where=slug)
    if scale is not None:
        warnings += fit(slug, params, scale)
    return warnings


# -- shapes and files a kernel needs (SHAPES) ---------------------------------------------------

def _block_linears(model) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of the ``nn.Linear`` layers inside the transformer blocks, the ones
    the quantizers replace (``quant.block_linears``)."""
    import torch.nn as nn
    return {n: tuple(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (".layers." in n or n.startswith("layers."))}


def fitting_group_sizes(cols, step: int = 1, largest: int | None = None) -> list[int]:
    """The group sizes, multiples of ``step`` up to ``largest``, that divide every in-features
    count in ``cols``."""
    top = min(cols) if largest is None else min(min(cols), largest)
    return [g for g in range(step, top + 1, step) if all(c % g == 0 for c in cols)]


def vq_least_rows(bits: int, group_size: int) -> int:
    """The fewest rows a codebook block of 14's GPTVQ needs (:data:`VQ_DIM`-D vectors, fp16
    entries, ``group_size`` columns) to stay within the scalar grid's bits per weight,
    ``bits + 16 / group_size``: a layer with fewer out-features has no block that fits
    (``quant.rows_for_budget`` raises)."""
    from ..quant.grid import bits_per_weight
    from ..quant.vq import vq_bits_per_weight
    budget = bits_per_weight(bits, group_size)
    r = 1
    while vq_bits_per_weight(bits, VQ_DIM, r * group_size, CODEBOOK_BITS) > budget + 1e-12:
        r += 1
    return r


def _either(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def _first(bad: list, what: str) -> str:
    """``name has n <what>``, of the first offending layer, and how many more there are."""
    (name, n), more = bad[0], len(bad) - 1
    return f"{name} has {n} {what}" + (f" (and {more} more layer{'s' * (more > 1)})"
                                         if more else "")


def _default_size(slug: str, scale: str, name: str):
    """Size ``name`` of notebook ``slug``'s SIZES row at ``scale`` (the notebook's default)."""
    from ..notebooks import notebooks_dir, sizes_table
    return sizes_table(notebooks_dir() / f"{slug}.ipynb")[scale][name]


def _gguf_problem(d: Path, config) -> str | None:
    """Why the GGUF export cannot write this checkpoint (its architecture, its tokenizer)."""
    from ..quant import gguf
    why = gguf.unsupported(config)
    if why is not None:
        return why
    f = d / "tokenizer.json"
    if not f.exists():
        return f"GGUF export writes a byte-level BPE tokenizer.json, and {d} has none"
    return gguf.unsupported(config, json.loads(f.read_text()))


def _fit_one(slug: str, param: str, value, needs: dict, params: dict, scale: str) -> list[str]:
    """:func:`fit` of one checkpoint: what the user cannot change first (the model's own shapes
    and files), then the knobs."""
    from ..quant.grid import bits_per_weight
    at = f"{slug}: {param} = {value!r}: "
    d = _dir(value)
    model = _meta_model(d, "lm")
    linears = _block_linears(model)
    warnings = []
    g = None
    if "group_size" in needs and linears:
        given = params.get("group_size")
        g = int(given or _default_size(slug, scale, "group_size"))
    for bits in needs.get("vq_bits", ()) if g else ():
        least = vq_least_rows(bits, g)
        short = [(n, o) for n, (o, _) in linears.items() if o < least]
        if short:
            raise CheckpointError(
                f"{at}GPTVQ's {bits}-bit frontier ({VQ_DIM}-D codebooks of "
                f"{2 ** (bits * VQ_DIM)} fp16 entries at the scalar grid's "
                f"{bits_per_weight(bits, g):g} bits per weight) needs codebook blocks of at least "
                f"{least} rows, and {_first(short, 'out-features')}; no group_size changes that: "
                f"choose a model whose block linears all have at least {least} out-features")
    if "gguf" in needs:
        mode, what = needs["gguf"]
        why = _gguf_problem(d, model.config)
        if why and mode == "claim":
            raise CheckpointError(f"{at}{what}, and {why}; choose a Llama, Mistral, Qwen2 or "
                                  "Qwen3 model with a byte-level BPE tokenizer")
        if why:
            warnings.append(f"{param}: {why}; the notebook skips {what} (gguf_skipped in its "
                            "metrics)")
    if g:
        step, largest = needs["group_size"]
        what = f"group_size = {g}" if params.get("group_size") else \
            f"group_size {g} (the {scale} default)"
        cols = sorted({c for _, c in linears.values()})
        bad = [(n, c) for n, (_, c) in linears.items() if c % g]
        if bad:
            fits = fitting_group_sizes(cols, step, largest)
            todo = (f"pass -p group_size {_either(fits)}, which divide every block linear's "
                    "in-features" if fits else
                    f"no multiple of {step} divides every block linear's in-features "
                    f"({', '.join(map(str, cols))}); choose a model whose in-features are "
                    f"multiples of {step}")
            raise CheckpointError(f"{at}{what} does not divide the in-features: "
                                  f"{_first(bad, 'in-features')}; {todo}")
    return warnings


def fit(slug: str, params: dict, scale: str) -> list[str]:
    """Refuse (:class:`CheckpointError`, naming the parameter and what to do) a checkpoint whose
    shapes or files notebook ``slug``'s kernel would fail on at ``scale`` with the knobs in
    ``params`` (:data:`SHAPES`; a knob left out or None takes its SIZES default); return the
    warnings (an optional step the notebook will skip). A zoo model fits its notebooks."""
    needs = SHAPES.get(slug)
    if not needs:
        return []
    warnings = []
    for name, (kind, _, _) in NOTEBOOK_NEEDS.get(slug, {}).items():
        for v in _split(params.get(name)):
            if kind == "lm" and v is not None and is_checkpoint(v):
                warnings += _fit_one(slug, name, v, needs, params, scale)
    return warnings
