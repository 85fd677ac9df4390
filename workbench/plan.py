"""``workbench plan``: each job's estimated FLOPs, peak memory and H100 time, without running it.

Estimates, not measurements. A notebook's cost is read from its ``SIZES`` row (with ``-p`` knobs
applied the way ``run.sizes`` applies them) and the configs of the zoo models it uses, through a
small cost model per notebook (:data:`MODELS`) built from the usual counts:

* a transformer of N non-embedding-plus-head parameters, L layers, width d: ``2 N`` FLOPs a token
  forward plus ``4 L T d`` for attention over T tokens; training ``3x`` that (forward + backward,
  Kaplan et al. 2020, "6 N tokens");
* an MLP or RNN: ``2 x`` its parameters a sample forward, ``6 x`` trained;
* time: FLOPs at an assumed utilisation :data:`UTILISATION` of the H100's dense bf16 peak
  :data:`PEAK_FLOPS`, plus a fixed cost per sequential step (kernel launches dominate the small
  models here: :data:`STEP_S` per training step, :data:`CALL_S` per forward or decoding step),
  plus host work that does not run on the GPU (environment steps at :data:`ENV_STEP_S`);
* peak memory: 16 bytes per trained parameter (fp32 weights, gradients, two AdamW moments),
  4 per frozen one, plus bf16 activations of ``34 b T d L`` bytes (Korthikanti et al. 2022,
  flash attention: no T^2 term).

A zoo model the run needs and the cache lacks is built first: its build is listed as its own line
(``zoo:<name>``), costed by the same counts. Importing this module imports neither torch nor
transformers (the CLI starts fast).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PEAK_FLOPS = 989e12        # H100 SXM, dense bf16 tensor cores
UTILISATION = 0.2          # assumed share of the peak a ~1-30M-parameter model reaches
STEP_S = 3e-3              # fixed cost of one training step (fwd + bwd + optimizer launches)
CALL_S = 1e-3              # fixed cost of one forward call or one decoding step
ENV_STEP_S = 2e-5          # host time of one environment step (MinAtar / classic control)
TASK_TOKENS = 40           # tokens of a rendered task example (prompt + answer)
STEPS_TOKENS = 96          # the same with its chain-of-thought steps
BUDGET_S = 600             # the target: a full run within 10 minutes on one H100


@dataclass
class Cost:
    """One phase of a job: FLOPs, sequential steps, host seconds, peak bytes."""
    what: str
    flops: float = 0.0
    steps: float = 0.0          # training steps (STEP_S each)
    calls: float = 0.0          # forward calls / decoding steps (CALL_S each)
    host_s: float = 0.0
    peak_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.flops / (UTILISATION * PEAK_FLOPS) + self.steps * STEP_S
                + self.calls * CALL_S + self.host_s)


@dataclass
class Estimate:
    slug: str
    scale: str
    phases: list[Cost] = field(default_factory=list)

    @property
    def own(self) -> list[Cost]:
        """The notebook's own phases (without the zoo builds it would start first)."""
        return [p for p in self.phases if not p.what.startswith("zoo:")]

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.own)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.own)

    @property
    def build_seconds(self) -> float:
        return sum(p.seconds for p in self.phases if p.what.startswith("zoo:"))

    @property
    def peak_bytes(self) -> float:
        return max([p.peak_bytes for p in self.phases] or [0.0])

    def cpu_seconds(self, rate: float) -> float:
        """The notebook's own FLOPs at ``rate`` FLOP/s (:func:`cpu_rate`: one thread, as a run
        uses): a lower bound, since fixed per-step costs come on top on a small model."""
        return self.flops / rate

    def row(self) -> dict:
        return {"notebook": self.slug, "scale": self.scale, "flops": self.flops,
                "peak_gib": self.peak_bytes / 2**30, "h100_s": self.seconds,
                "build_s": self.build_seconds,
                "phases": [{"what": p.what, "flops": p.flops, "s": p.seconds} for p in self.phases]}


# -- model shapes -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """What the cost model needs of a transformer LM: layers, width, MLP width, vocabulary."""
    name: str
    n_layers: int
    d_model: int
    d_ff: int
    vocab: int
    ctx: int

    @property
    def params(self) -> float:
        """Parameters that cost FLOPs: the blocks (q, k, v, o; gate, up, down) and the head."""
        return self.n_layers * (4 * self.d_model ** 2 + 3 * self.d_model * self.d_ff) \
            + self.vocab * self.d_model

    def forward(self, tokens: float, T: float) -> float:
        return 2 * self.params * tokens + 4 * self.n_layers * T * self.d_model * tokens

    def train(self, tokens: float, T: float) -> float:
        return 3 * self.forward(tokens, T)

    def train_bytes(self, batch: float, T: float, trained: float | None = None) -> float:
        trained = self.params if trained is None else trained
        return (16 * trained + 4 * (self.params - trained)
                + 34 * batch * T * self.d_model * self.n_layers)

    def infer_bytes(self, batch: float, T: float) -> float:
        return 4 * self.params + 4 * batch * T * self.d_model * self.n_layers   # weights + KV


def zoo_shape(name: str, scale: str) -> Shape:
    """The shape of zoo recipe ``name`` at ``scale`` (a recipe the zoo knows), or of a local
    checkpoint folder ``name`` (:func:`checkpoint_shape`; its own size at every scale)."""
    if (Path(str(name)) / "config.json").is_file():
        return checkpoint_shape(Path(str(name)))
    from .models.recipes import recipe      # no torch: recipes imports data.tasks and cache only
    s = recipe(name).size(scale)
    return Shape(name, s.n_layers, s.d_model, s.d_ff, s.vocab, s.ctx)


# config.json names of a Shape's fields: Llama/Qwen/Mistral/Gemma first, then GPT-2's
_CONFIG = {"n_layers": ("num_hidden_layers", "n_layer"), "d_model": ("hidden_size", "n_embd"),
           "d_ff": ("intermediate_size", "n_inner"), "vocab": ("vocab_size",),
           "ctx": ("max_position_embeddings", "n_positions")}


def checkpoint_shape(folder: Path) -> Shape:
    """A local checkpoint's shape from its ``config.json`` (read as JSON: no transformers), for
    the cost model: layers, width, MLP width (GPT-2's default 4 x width when unset), vocabulary
    and context."""
    import json
    cfg = json.loads((folder / "config.json").read_text())
    got = {f: next((cfg[k] for k in keys if cfg.get(k)), None) for f, keys in _CONFIG.items()}
    if got["d_ff"] is None and got["d_model"]:
        got["d_ff"] = 4 * got["d_model"]
    missing = [f for f, v in got.items() if not v]
    if missing:
        raise ValueError(f"{folder}/config.json gives no {', '.join(missing)} "
                         f"(looked for {', '.join(k for f in missing for k in _CONFIG[f])}): "
                         "no cost estimate for it")
    return Shape(folder.name, got["n_layers"], got["d_model"], got["d_ff"], got["vocab"],
                 got["ctx"])


CPU_RATE_FROM = "lm-base"     # the shipped build whose measured time calibrates the CPU rate


def cpu_rate() -> tuple[float, str]:
    """(FLOP/s, where from) of one CPU thread, measured rather than assumed: the FLOPs of the
    shipped ``lm-base`` build (:func:`zoo_build`, a training run that matmuls dominate) over the
    build seconds its card reports (one thread of the machine that built the shipped zoo)."""
    import json
    from . import cache
    from .models.recipes import recipe
    folder = cache.shipped_root() / f"{CPU_RATE_FROM}-smoke-{recipe(CPU_RATE_FROM).key('smoke')}"
    card = json.loads((folder / "card.json").read_text())
    rate = zoo_build(CPU_RATE_FROM, "smoke").flops / card["build_seconds"]
    return rate, (f"{rate / 1e9:.0f} GFLOP/s, one thread, from the shipped {CPU_RATE_FROM} "
                  f"build ({card['build_seconds']:.0f} s)")


def zoo_build(name: str, scale: str) -> Cost:
    """Training a zoo recipe from its Size: steps x batch x ctx tokens, plus its card."""
    from .models.recipes import recipe
    r = recipe(name)
    s, m = r.size(scale), zoo_shape(name, scale)
    tokens = s.steps * s.batch * s.ctx
    return Cost(f"zoo:{name}", m.train(tokens, s.ctx), steps=s.steps,
                calls=s.eval_examples * 20 * 16, peak_bytes=m.train_bytes(s.batch, s.ctx))


# -- the cost model of each notebook --------------------------------------------------------------

def _lm(p: dict, S: dict, *keys, default="lm-base") -> Shape:
    name = next((p[k] for k in keys if p.get(k)), default)
    scale = p.get("zoo_scale") or p.get("pool_scale") or p["scale"]
    return zoo_shape(name, scale)


def _gen(m: Shape, prompts: float, new: float, prompt_len: float = 24, batch: float = 64) -> Cost:
    """Greedy decoding with a KV cache: ``prompts`` rows, ``new`` tokens each."""
    return Cost("generate", m.forward(prompts * (prompt_len + new), prompt_len + new),
                calls=-(-prompts // batch) * new, peak_bytes=m.infer_bytes(batch, prompt_len + new))


def _fit(m: Shape, steps: float, batch: float, T: float, what: str = "fine-tune",
         lora: bool = True) -> Cost:
    trained = 0.01 * m.params if lora else None
    return Cost(what, m.train(steps * batch * T, T), steps=steps,
                peak_bytes=m.train_bytes(batch, T, trained))


def _mlp(params: float, samples: float, steps: float, what: str = "small net") -> Cost:
    return Cost(what, 6 * params * samples, steps=steps, peak_bytes=16 * params + 4 * samples)


def c01(p, S):
    m, n = _lm(p, S, "model"), len(S["stream"].split()) + len(S["domain_stream"].split())
    T = STEPS_TOKENS
    return [_fit(m, 3 * n * S["lora_steps"], S["lora_batch"], T, "LoRA stages (3 methods)"),
            _fit(m, n * S["l2p_steps"], 32, T, "L2P prompt pool"),
            Cost("candidate scores", m.forward(n * S["n_pool"] * S["n_probe"] * T * 8, T),
                 calls=n * S["n_pool"] * 8),
            _gen(m, 8 * n * S["n_test"], 32)]


def c02(p, S):
    m = _lm(p, S, "model_name", "model", default="lm-qbed")
    T = TASK_TOKENS
    zo = 4 * S["zo_steps"] * (2 + S["n_probe"] / 8)       # four ZO methods, two-point + probes
    return [Cost("ZO steps", m.forward(zo * S["batch"] * T, T), calls=zo,
                 peak_bytes=m.infer_bytes(S["batch"], T)),
            _fit(m, S["zo_steps"], S["batch"], T, "fp fine-tune", lora=False),
            _gen(m, 6 * max(S["n_heldout"], 512), 8),
            _mlp(2e5, S["vit_train_steps"] * 64 + 4 * S["vit_zo_steps"] * 64 * 3,
                 S["vit_train_steps"] + 4 * S["vit_zo_steps"], "digits ViT")]


def _clip_params(scale: str) -> float:
    d, layers = (128, 7) if scale == "full" else (64, 5)
    return layers * 12 * d * d


def c03(p, S):
    P = _clip_params(S["clip_scale"])
    n_cls = (10 if "digits" in S["families"] else 0) + \
        (S["shapes_classes"] if "shapes" in S["families"] else 0)
    samples = n_cls * S["n_train"] * S["steps"] * 8          # ~8 methods and ablations
    return [_mlp(P, samples * 65, S["steps"] * 8 * 15, "adapters in the image encoder")]


def c04(p, S):
    m = _lm(p, S, "model", "base", default="lm-tiny")
    runs = len(S["lrs"]) * 7                                   # seven methods on one grid
    rows = S["prompts"] * S["group"]
    gen = Cost("rollouts", m.forward(runs * S["steps"] * rows * 24, 24),
               calls=runs * S["steps"] * S["max_new_tokens"], peak_bytes=m.infer_bytes(rows, 24))
    evals = runs * (S["n_val"] + S["n_eval"]) * max(1, S["steps"] // S["every"])
    return [gen, _fit(m, runs * S["steps"] * S["num_iterations"], rows, 24, "GRPO updates",
                      lora=False),
            _gen(m, evals, S["max_new_tokens"])]


def c05(p, S):
    m = _lm(p, S, "model", default="lm-tiny")
    syn = len(S["ns"]) * len(S["ks"]) * S["pg_steps"] * S["d"] ** 2 * 4096
    return [Cost("synthetic problems (float64, host)", 0, host_s=syn / 5e9),
            _fit(m, S["lm_steps"] * 8, S["n_examples"], TASK_TOKENS, "learned updates"),
            _fit(m, len(S["lora_ranks"]) * S["lora_seeds"] * S["lora_steps"], S["lora_train"],
                 TASK_TOKENS, "LoRA rank sweep")]


def c06(p, S):
    m = _lm(p, S, "reasoning_model", "reasoning", "model", default="lm-reasoning")
    levels = 15
    n = levels * (S["n_train"] + S["n_test"])
    return [_gen(m, n * (2 + len(S["budgets"])), S["max_new_tokens"]),
            _fit(m, 2 * S["lora_steps"], S["lora_batch"], STEPS_TOKENS, "hint tuning (2 models)")]


def c07(p, S):
    m = _lm(p, S, "model", "base")
    fams = len(S["pool"]) + len(S["heldout"])
    return [Cost("features", m.forward(fams * S["n_fit"] * 24, 24), calls=fams * S["n_fit"] / 64),
            _gen(m, 12 * fams * S["n_eval"], 16),
            _gen(m, 2 * S["tp_repeats"] * S["tp_prompts"], S["tp_tokens"]),
            Cost("LoraHub search", m.forward(2 * 100 * S["hub_shots"] * 32, 32), calls=200)]


def c08(p, S):
    h = S["hidden"]
    P = 3 * h * h
    runs = 4                                                   # four models
    out = [_mlp(P, runs * S["steps"] * S["batch"], runs * S["steps"], "velocity fields"),
           Cost("sampling", 2 * P * runs * S["n_eval"] * 100, calls=runs * 5 * 100)]
    if S["c5_steps"]:
        P5 = 3 * S["c5_hidden"] ** 2
        out.append(_mlp(P5, 2 * S["c5_steps"] * S["batch"], 2 * S["c5_steps"], "C5 digits/fields"))
    return out


def c09(p, S):
    agent = p.get("agent") or "ppo"
    cfg = S[agent]
    runs = 2 * S["n_inner_seeds"]                                # standard and HR torsos
    env = runs * S["total_timesteps"] + runs * S["relu_timesteps"]
    P = 4 * S["width"] ** 2 + 64 * 100 * S["width"] // 10
    batch = cfg.get("num_envs", 4) * cfg.get("num_steps", 1)
    updates = env / batch * (4 if agent == "ppo" else 1)
    other = [c for c in (S.get("pqn"), S.get("sac")) if c]      # PQN and SAC, 3 torsos
    o_env = sum(3 * c["n_inner_seeds"] * c["total_timesteps"] for c in other)
    o_upd = sum(3 * c["n_inner_seeds"] * c["total_timesteps"] * (1.5 if "batch_size" in c else
                2 * 4 / (c["num_envs"] * c["num_steps"])) for c in other)
    return [Cost("environment steps (host)", 0, host_s=(env + o_env) * ENV_STEP_S),
            _mlp(P, env * 4, updates, f"{agent} updates"),
            _mlp(P, o_env * 4, o_upd, "PQN and SAC updates")]


def c10(p, S):
    m = _lm(p, S, "model_name", "model", default="lm-qbed")
    T = S["ctx"] or m.ctx
    methods = 4
    hvp = S["trace_probes"] + 2 * S["trace_sketch"] + S["trace_query"]
    return [_fit(m, methods * S["steps"], S["batch"], T, "QAT (4 methods)", lora=False),
            Cost("Hessian traces", 2 * m.train(hvp * S["trace_blocks"] * T, T),
                 steps=2 * hvp, peak_bytes=2 * m.train_bytes(S["trace_blocks"], T)),
            _gen(m, methods * S["task_examples"], 8)]


def c11(p, S):
    names = S["candidate_models"]
    names = names if isinstance(names, list) else names.split(",")
    scale = p.get("zoo_scale") or p["scale"]
    ms = [zoo_shape(n, scale) for n in names]
    fams = len(S["families"])
    out = [_fit(m, S["steps"], S["batch"], TASK_TOKENS, f"HAPS on {m.name}") for m in ms]
    out += [_gen(m, 4 * fams * S["n_test"], 16) for m in ms]
    out.append(_mlp(S["d_h"] * S["feat_dim"] * 4, S["router_steps"] * S["batch"],
                    S["router_steps"], "routers"))
    return out


def c12(p, S):
    P = 2 * S["hidden"] * S["hidden"] + S["mod_p"] * S["hidden"] * 3
    Pd = 64 * S["digits_hidden"] + 2 * S["digits_hidden"] ** 2
    variants = 3                                         # float32, float64, zero-sum (VARIANTS)
    n_mod = S["mod_p"] ** 2 * S["train_frac"]
    return [_mlp(P, variants * S["steps"] * n_mod, variants * S["steps"], "modular addition"),
            _mlp(Pd, variants * S["digits_steps"] * S["digits_n"], variants * S["digits_steps"],
                 "digits")]


def c13(p, S):
    m = _lm(p, S, "model", "base")
    fams = len(S["families"])
    merges = 6
    return [Cost("losses of merges", m.forward(merges * S["n_reparam"] * S["n_loss"] * 32, 32),
                 calls=merges * S["n_reparam"]),
            _gen(m, merges * fams * S["n_eval"], 16),
            _mlp(S["mlp_hidden"] ** 2 * 2, 4 * S["mlp_steps"] * 1000, 4 * S["mlp_steps"], "MLPs")]


def c14(p, S):
    m = _lm(p, S, "model_name", "model", default="lm-qbed")
    T = S["ctx"]
    sub_blocks = m.n_layers * 7
    gsq = sub_blocks * S["gsq_steps"]
    layer = Shape(m.name, 1, m.d_model, m.d_ff, 0, T)
    return [Cost("GSQ (Lion steps per sub-block)", layer.train(gsq * S["gsq_batch"] * T, T),
                 steps=gsq, peak_bytes=m.train_bytes(S["gsq_batch"], T)),
            Cost("calibration and GPTQ/AWQ/VQ", 10 * m.forward(S["n_calib"] * T, T),
                 calls=10 * S["n_calib"] / 8),
            Cost("perplexity and tasks", 12 * m.forward(512 * T + S["task_examples"] * 40, T),
                 calls=12 * 64)]


def c15(p, S):
    P = _clip_params(p.get("clip_scale") or p["scale"])
    runs = len(S["shots"]) * len(S["lrs"]) * 6                  # six optimizers
    return [_mlp(P, runs * S["steps"] * 29 * 8 * 65, runs * S["steps"], "few-shot runs"),
            _mlp(P, 29 * S["n_full"] * 65 * 3, 29 * S["n_full"] / 32, "full-data pool")]


def c16(p, S):
    m = _lm(p, S, "model", "base")
    runs = 6 * len(S["lr_grid"])                                 # six methods on the grid
    evals = runs * S["steps"] / S["every"]
    return [_fit(m, runs * S["steps"], S["batch"], STEPS_TOKENS, "fine-tunes x lr grid"),
            _gen(m, evals * (S["n_val"] + 6 * S["n_retain"]) + runs * S["n_eval"], 12)]


def c17(p, S):
    h = S["hidden"]
    P = 4 * h * h
    runs = 4 + 3 * S["inner_seeds"]
    return [_mlp(P, runs * S["steps"] * S["batch"] * 8, runs * S["steps"], "RNN classifiers"),
            _mlp(P, runs * S["nt_steps"] * S["nt_batch"] * 8, runs * S["nt_steps"], "next-token")]


def c18(p, S):
    student = _lm(p, S, "model", "student")
    teacher = _lm(p, S, "teacher_model", "model_teacher", default="lm-reasoning")
    n = len(S["families"]) * 6 * S["n_per_level"]
    return [_gen(teacher, 2 * n, 96),
            Cost("loss signatures", student.train(S["n_dirs"] * len(S["scales"]) * n * 96, 96),
                 steps=S["n_dirs"] * len(S["scales"]) * n / 32),
            _fit(student, S["adapt_steps"] * S["n_dirs"], 16, 96, "direction adapters"),
            _fit(student, S["sft_steps"] * 4 * S["n_candidates"], S["sft_batch"], 96,
                 "downstream SFT"),
            _gen(student, 4 * S["n_candidates"] * len(S["families"]) * S["n_test"] * 6, 64)]


def c19(p, S):
    m = _lm(p, S, "model", "base")
    paths = 4
    return [_fit(m, paths * S["steps"], S["batch"], S["ctx"], "AR -> diffusion paths",
                 lora=False),
            Cost("NELBO bound", m.forward(paths * S["n_heldout_rows"] * S["nelbo_draws"]
                                          * S["ctx"] * S["ctx"], S["ctx"]),
                 calls=paths * S["n_heldout_rows"] * S["nelbo_draws"] / 8),
            _gen(m, paths * len(S["families"]) * S["n_test"], S["gen_len"])]


MODELS = {"01": c01, "02": c02, "03": c03, "04": c04, "05": c05, "06": c06, "07": c07, "08": c08,
          "09": c09, "10": c10, "11": c11, "12": c12, "13": c13, "14": c14, "15": c15, "16": c16,
          "17": c17, "18": c18, "19": c19}
# which parameters name the zoo models a notebook loads (today's names and the renamed ones)
ZOO_PARAMS = ("model", "base", "model_name", "student", "teacher_model", "model_teacher",
              "reasoning_model", "instruct_model", "reasoning", "instruct")


# -- reading a notebook ---------------------------------------------------------------------------

def _coerce(value: str, like):
    if isinstance(like, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(like, int):
        return int(value)
    if isinstance(like, float):
        return float(value)
    if isinstance(like, list):
        return [type(like[0])(v) if like else v for v in value.split(",")]
    return value


def estimate(slug: str, path: Path, scale: str = "full", params: dict | None = None) -> Estimate:
    """The cost of one job of notebook ``slug`` at ``scale`` with ``params`` (strings as ``-p``
    gives them), and of the zoo builds it would start."""
    from .notebooks import parameters, sizes_table
    spec = parameters(path)
    defaults = {}
    for name, info in spec.items():
        try:
            defaults[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError):
            defaults[name] = None
    p = {**defaults, **(params or {}), "scale": scale}
    table = sizes_table(path)
    if scale not in table:
        raise LookupError(f"{slug}: SIZES has no {scale} row (rows: {', '.join(table)})")
    S = dict(table[scale])
    for name, value in (params or {}).items():
        if name in S and value is not None:
            S[name] = _coerce(str(value), S[name])
    est = Estimate(slug, scale, MODELS[slug[:2]](p, S))
    est.phases[:0] = missing_builds(p, S)
    return est


def missing_builds(p: dict, S: dict) -> list[Cost]:
    """The zoo builds a job would start: its zoo models at their scale, when not in the cache."""
    from . import cache
    from .models import recipes
    from .device import zoo_scale
    scale = zoo_scale(p.get("zoo_scale") or p.get("pool_scale") or p["scale"])
    names = {v for k, v in p.items() if k in ZOO_PARAMS and v in recipes.RECIPES}
    for key in ("candidates", "encoder"):
        v = S.get(key)
        names |= set(v if isinstance(v, list) else [v] if v else [])
    out, seen = [], set()
    for name in sorted(n for n in names if n in recipes.RECIPES):
        r = recipes.RECIPES[name]
        chain = [name] + ([r.init_from] if r.init_from else [])
        for n in (n for n in chain if n not in seen):
            seen.add(n)
            built = cache.folder("zoo") / f"{n}-{scale}-{recipes.RECIPES[n].key(scale)}"
            if not (built / "card.json").exists():
                out.append(zoo_build(n, scale))
    return out


def table(rows: list[dict]) -> str:
    """A markdown table of estimates (:meth:`Estimate.row` dicts)."""
    lines = ["| notebook | FLOPs | peak memory | H100 time (est.) | largest phase | zoo builds "
             "first (est.) |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        own = [ph for ph in r["phases"] if not ph["what"].startswith("zoo:")]
        big = max(own, key=lambda ph: ph["s"]) if own else {"what": "-"}
        builds = ", ".join(f"{ph['what'][4:]} {duration(ph['s'])}" for ph in r["phases"]
                           if ph["what"].startswith("zoo:")) or "-"
        lines.append(f"| {r['notebook']} | {r['flops']:.1e} | {r['peak_gib']:.2f} GiB | "
                     f"{duration(r['h100_s'])} | {big['what']} | {builds} |")
    return "\n".join(lines)


def duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def assumptions() -> str:
    return (f"H100 bf16 dense peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s at an assumed "
            f"{UTILISATION:.0%} utilisation, {STEP_S * 1e3:g} ms per training step and "
            f"{CALL_S * 1e3:g} ms per forward or decoding step of fixed cost, "
            f"{ENV_STEP_S * 1e6:g} us of host time per environment step; estimates, not "
            "measurements")
