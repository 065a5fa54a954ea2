"""
Look up when needed: the knobs. TrainConfig holds the flags both scripts share (the docstring under
each field is its --help), the --algo presets of the baselines,
the shipped demos as the flags they stand for, the parser that turns a command line into a Config,
and the checks of flag combinations that cannot work.
"""
import argparse
import ast
import inspect
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass, fields, is_dataclass

import torch

import crosscheck
import entropy_control
from dataset import parse_eval_data
from ranks import die, is_dist, print0

# --------------------------------------------------------------------------------------------------
# 1. The knobs both scripts share, written once; each script's Config adds its paper's own.
#    The defaults run the reasoning demo (python da3po.py, or Config() in code);
#    the papers' scale is in docs/gpu.md.
@dataclass
class TrainConfig:
    # run
    algo: str = ""
    """preset (the script's PRESETS); explicit flags override the preset"""
    demo: str = "reasoning"
    """the shipped demo whose flags apply: reasoning (the defaults shown) | arith (the sums demo:
    its flags are listed below)"""
    model: str = "demo"
    """local Hugging Face folder, hub id, or 'demo' (the reasoning demo's tiny shipped model)"""
    train_data: str = "reasoning"
    """'reasoning' or 'arith' (the demos' sums) or a .jsonl/.json/.parquet file of
    problem/answer rows"""
    eval_data: str = "reasoning"
    """as --train_data (the demos': 200 held-out sums); several sets comma-separated, each with its
    own k as set@k (aime24.jsonl@32,math500.jsonl@8; no @k: --eval_samples)"""
    out_dir: str = ""
    """config.json, metrics.jsonl, samples.jsonl, checkpoints"""
    seed: int = 0
    """init seed (same on every rank); sampling uses seed + rank"""
    steps: int = 20
    """RL steps (one rollout batch each)"""
    device: str = ""
    """'' = cuda if available, else cpu"""
    dtype: str = "float32"
    """compute dtype: float32 | bfloat16 (trained weights and optimizer state stay float32)"""
    grad_checkpointing: bool = False
    """recompute activations in backward (less memory, ~30% more compute)"""
    attn_implementation: str = ""
    """the trainer's attention, by transformers' name ('' = the model's own); docs/gpu.md"""
    cpu_offload: bool = False
    """FSDP2 (under torchrun): sharded parameters and optimizer state on the CPU"""
    # LoRA (peft, requirements/lora.txt): train low-rank adapters, the base frozen (docs/gpu.md)
    lora_rank: int = 0
    """r: rank of the adapters; 0 = off (every weight trained)"""
    lora_alpha: float = 32.0
    """alpha: the adapters' output is scaled by alpha / r"""
    lora_target_modules: str = ""
    """linear layers to adapt, comma-separated (q_proj,v_proj); '' = all in the blocks"""
    lora_dropout: float = 0.0
    """0 only: dropout would make every trainer forward a random draw (docs/gpu.md)"""
    lora_sync: str = "auto"
    """what vLLM receives after each update: adapter | merged | auto (the adapter if it can)"""
    # rollout
    prompts_per_step: int = 16
    """groups trained on per step, across all ranks (train batch size in DAPO)"""
    group_size: int = 8
    """G (K in DARO): completions per prompt"""
    dynamic_sampling: bool = True
    """DAPO: keep only groups with 0 < #correct < G, refill from fresh prompts"""
    oversample: float = 1.5
    """prompts generated per dynamic-sampling batch, as a multiple of prompts_per_step"""
    max_gen_batches: int = 4
    """cap on generation batches per step; at the cap, warn and train on what was kept"""
    max_staleness: int = 0
    """S: partial rollouts (partial.py): unfinished groups carry over to later steps, dropped once
    their oldest token is more than S steps older than the weights training them; 0 = off"""
    partial_chunk: int = 0
    """with --max_staleness: tokens a sequence grows by between two checks for a full step;
    0 = a quarter of --max_new_tokens"""
    max_new_tokens: int = 72
    """L_max: hard limit on completion length"""
    max_prompt_length: int = 1024
    """prompts longer than this (tokens, template included) are dropped at load"""
    temperature: float = 1.0
    """rollout sampling temperature"""
    top_p: float = 1.0
    """rollout nucleus sampling"""
    rollout_batch_size: int = 512
    """sequences per forward of our sampler (memory knob)"""
    rollout: str = "hf"
    """rollout engine: hf (our sampler on the HF model) | vllm | auto (vLLM if usable)"""
    vllm_gpu_memory: float = 0.0
    """vLLM's share of GPU memory; 0 = the most the trainer leaves (bench/memory.py)"""
    max_model_len: int = 0
    """longest sequence vLLM keeps KV cache for; 0 = longest prompt + max_new_tokens"""
    vllm_cpu_kv_gb: float = 0.5
    """vLLM on CPU: KV cache size in GiB"""
    rollout_is: str = "none"
    """correct the engine/trainer mismatch: none | token | sequence (docs/gpu.md)"""
    rollout_is_cap: float = 2.0
    """C: the weight pi_old / pi_rollout is truncated at C"""
    rollout_is_mask: bool = False
    """reject tokens (sequences) whose weight is outside [1/C, C] instead"""
    prompt_template: str = "auto"
    """chat | plain | dapo | none | auto (none for the demo, else chat if any)"""
    answer_format: str = "auto"
    """where the verifier looks: boxed | answer_line | auto"""
    verifier_crosscheck: bool = False
    """Math-Verify also judges the eval completions; log where it disagrees with ours
    (crosscheck/*, crosscheck.jsonl)"""
    crosscheck_train: int = 0
    """with --verifier_crosscheck: completions per training step it also judges; 0 = none"""
    prompt_key: str = ""
    """data field holding the problem ('' = try problem, question, prompt; dots for nested)"""
    answer_key: str = ""
    """data field holding the answer ('' = try answer, final_answer, reward_model.ground_truth)"""
    # reward (DAPO)
    overlong_buffer: int = 16
    """L_cache: penalty ramps from 0 at L_max - L_cache tokens to -1 at L_max; 0 = off"""
    overlong_penalty: float = 1.0
    """penalty factor of the overlong shaping"""
    # advantages and loss
    std_norm: bool = True
    """GRPO z-score advantage; off = Dr. GRPO (mean-centred only)"""
    loss_agg: str = "token-mean"
    """token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm"""
    seq_ratio: bool = False
    """GSPO: length-normalised sequence-level importance ratio"""
    clip_low: float = 0.2
    """epsilon_low: ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.28
    """epsilon_high: ratio clipped above at 1 + clip_high (clip-higher)"""
    clip_ratio_c: float = 0.0
    """dual clip for negative advantages (verl uses 3.0); 0 = off"""
    kl_coef: float = 0.0
    """beta: k3 KL penalty to the initial model; 0 = none, as in DAPO"""
    # entropy controls (entropy_control.py, docs/entropy.md: each default's source); off by default
    entropy_coef: float = 0.0
    """entropy bonus: each token's loss minus entropy_coef * its entropy; 0 = off (as verl)"""
    entropy_control: str = "none"
    """none | clip_cov | kl_cov: Clip-Cov or KL-Cov (arXiv:2505.22617) on the tokens of largest
    Cov(log pi, A) over the whole update (every micro-batch and rank)"""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov's r: share of the update's tokens whose gradient is cut (2e-4: the paper, verl)"""
    clip_cov_lb: float = 1.0
    """Clip-Cov's lower bound on a candidate's Cov_t (the paper's and verl's 1)"""
    clip_cov_ub: float = 5.0
    """Clip-Cov's upper bound on a candidate's Cov_t (the paper's and verl's 5)"""
    kl_cov_ratio: float = 2e-3
    """KL-Cov's k: the share of the update's tokens penalised (the paper's 7B recipe 2e-3; verl's
    default is 2e-4)"""
    kl_cov_coef: float = 1.0
    """KL-Cov's beta (the paper's recipes 1; verl's config 0.1). KL-Cov drops PPO's clip on every
    token, as the paper and verl do"""
    kl_cov_penalty: str = "abs"
    """KL-Cov's penalty: abs, |log r| (the authors' code and verl) | k3, r - 1 - log r (an estimate
    of the paper's KL(pi_old || pi), smooth at r = 1)"""
    # optimisation
    lr: float = 1e-4
    """AdamW learning rate (the papers: 1e-6)"""
    weight_decay: float = 0.1
    """AdamW weight decay (DAPO recipe)"""
    warmup_steps: int = 0
    """linear learning-rate warm-up over this many RL steps (not optimizer updates), as verl"""
    grad_clip: float = 1.0
    """max global gradient norm"""
    updates_per_step: int = 2
    """optimizer updates (mini-batches) per RL step; the step's groups are split evenly"""
    micro_batch_size: int = 64
    """sequences per forward/backward on one rank (memory knob; not the math)"""
    micro_batch_tokens: int = 0
    """> 0: micro-batches packed by length up to this many tokens, ranks balanced"""
    logprob_path: str = "auto"
    """how log pi is computed: plain (one padded forward, common.token_logprobs) | shortcuts (the
    same numbers from a group's prompt once, packed rows and the output layer in chunks, each
    checked at start-up: shortcuts.py) | auto (plain for the shipped demos, else shortcuts)"""
    logprob_chunk: int = 1024
    """shortcuts: positions x rows whose logits exist at once (recomputed in backward); 0 = all"""
    pack: bool = True
    """shortcuts: pack a micro-batch's rows without padding, as transformers does, where that runs
    fewer positions; --no-pack: rows padded"""
    # evaluation, logging, checkpoints
    eval_every: int = 10
    """evaluate every N steps (also at step 0 and at the end); 0 = only at start and end"""
    eval_samples: int = 4
    """k: completions per eval problem (avg@k, pass@k, maj@k) of the sets without @k"""
    eval_size: int = 0
    """eval problems to use, spread evenly over each set (its mix of levels kept); 0 = all"""
    eval_temperature: float = 1.0
    """eval sampling temperature"""
    eval_top_p: float = 1.0
    """eval nucleus sampling (DAPO reports top_p 0.7)"""
    eval_batch_size: int = 128
    """eval problems per generate call"""
    sample_every: int = 10
    """write a few completions to samples.jsonl every N steps"""
    save_every: int = 0
    """checkpoint every N steps (and at the end, and on a stop request); 0 = only at the end"""
    keep_last: int = 2
    """checkpoints kept on disk (older ones are deleted)"""
    resume: bool = False
    """continue from the latest checkpoint in out_dir"""
    max_bad_updates: int = 3
    """stop the run after this many non-finite losses/gradients in a row (each is skipped)"""
    eval_only: bool = False
    """evaluate --model on --eval_data and exit"""
    report_to: str = "none"
    """also log to: none | tensorboard | wandb (requirements/tracking.txt)"""
    wandb_project: str = ""
    """wandb project of --report_to wandb"""


# --------------------------------------------------------------------------------------------------
# 2. The --algo presets: the baselines both papers compare against, each its paper's recipe for
#    every knob that defines the algorithm; the flags give the scale (model, lr, batch sizes,
#    lengths, the overlong buffer).
# DAPO's 4 techniques (overlong shaping: the default buffer)
_DAPO = {"dynamic_sampling": True, "std_norm": True, "loss_agg": "token-mean", "seq_ratio": False,
         "clip_low": 0.2, "clip_high": 0.28}
# the baselines below turn DAPO's dynamic sampling, clip-higher and overlong shaping off
_OFF = {"dynamic_sampling": False, "clip_high": 0.2, "overlong_buffer": 0}

BASELINES = {
    "dapo": _DAPO,
    # GRPO, with no KL term as in DAPO, Dr. GRPO and GSPO, so GRPO vs DAPO changes nothing else;
    # verl's GRPO examples add a k3 KL loss to the initial model (--kl_coef 0.001 runs that),
    # DeepSeekMath's beta was 0.04
    "grpo": {**_DAPO, **_OFF, "loss_agg": "seq-mean-token-mean"},
    # Dr. GRPO: mean-centred advantages, token sums over the constant L_max
    "dr_grpo": {**_DAPO, **_OFF, "std_norm": False, "loss_agg": "seq-mean-token-sum-norm"},
    # GSPO: the sequence ratio, its tiny clip range, the rollout batch split into 4 mini-batches
    "gspo": {**_DAPO, **_OFF, "seq_ratio": True, "loss_agg": "seq-mean-token-mean",
             "clip_low": 3e-4, "clip_high": 4e-4, "updates_per_step": 4},
}


def presets(own: dict[str, dict], off: dict) -> dict[str, dict]:
    """A script's --algo presets: its own, then the baselines, each with the script's algorithm
    switched off by `off`."""
    return {**own, **{name: {**off, **recipe} for name, recipe in BASELINES.items()}}


# --------------------------------------------------------------------------------------------------
# 3. Flags from a script's Config (the docstring under each field is its --help), and the checks
#    of their combinations.
# --demo is a shipped demo, as the flags it stands for. The default, `reasoning`
# (demo/reasoning/README.md), is the dataclass defaults, on the command line and in Config() alike;
# `arith` is the sums demo. A demo applies before the --algo preset (GRPO's preset turns its
# overlong shaping off), and explicit flags override both.
# A --model of the user's own is no demo's. No demo applies to it unless --demo is given (a note
# says which of the demo's values it runs on), and the knobs the defaults size for a demo
# (DEMO_SIZED) must be set, by flags or the --algo preset, or the run stops naming them.
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
ARITH_MODEL = os.path.join(DEMO_DIR, "arith", "model")
DEMOS = {"reasoning": {},
         "arith": {"model": ARITH_MODEL, "train_data": "arith", "eval_data": "arith",
                   "max_new_tokens": 12, "overlong_buffer": 4, "prompts_per_step": 32, "steps": 60}}
DEMO_MODELS = ("demo", ARITH_MODEL, os.path.join(DEMO_DIR, "reasoning", "model"))
# The knobs whose defaults are a demo's (the data, the token budget, the run's length and batch,
# the tiny model's learning rate): a real run sets each (docs/gpu.md's recipes do);
# an --eval_only run the first two.
DEMO_SIZED = ("train_data", "eval_data", "max_new_tokens", "overlong_buffer", "steps",
              "prompts_per_step", "lr")
EVAL_ONLY_SIZED = ("eval_data", "max_new_tokens")
# --help's last paragraph: the demos and what a model of the user's own needs.
_ARITH_FLAGS = {**DEMOS["arith"], "model": os.path.relpath(ARITH_MODEL, os.path.dirname(DEMO_DIR))}
EPILOG = ("The defaults above run the reasoning demo; --demo arith (the sums demo) sets "
          + ", ".join(f"--{k} {v}" for k, v in _ARITH_FLAGS.items())
          + ". A --model of your own runs on no demo's values: it needs "
          + ", ".join("--" + k for k in DEMO_SIZED) + " (docs/gpu.md's recipes set them).")


def is_demo_model(name: str) -> bool:
    """--model names a shipped demo's model ('demo', or one of the demo folders)."""
    return any(name == m or os.path.realpath(name) == os.path.realpath(m) for m in DEMO_MODELS)


def _demo_sized(given: dict, demo: str, cfg, argv_model: str) -> dict:
    """The demo-sized knobs a --model of the user's own would get from no flag: with --demo, the
    demo's (said in one note); without, none (the run stops, naming the flags to set)."""
    needed = EVAL_ONLY_SIZED if given.get("eval_only") else DEMO_SIZED
    missing = [k for k in needed if k not in given]
    if not missing:
        return {}
    if not demo:
        die(f"--model {argv_model} is not a demo's model: set "
            f"{', '.join('--' + k for k in missing)} (their defaults are sized for the CPU demos; "
            f"docs/gpu.md has the papers' recipes), or --demo {'|'.join(DEMOS)} for a demo's "
            f"values")
    values = {k: DEMOS[demo].get(k, getattr(cfg, k)) for k in missing}
    if os.environ.get("RANK", "0") == "0":
        print(f"note: --model {argv_model} runs on --demo {demo}'s "
              + ", ".join(f"{k} {v}" for k, v in values.items()), flush=True)
    return values


def field_help(cls) -> dict[str, str]:
    """Each Config field's --help text: the docstring under the field (as cleanrl's Args), read from
    the source of the class and its bases. Returns {field name: text}."""
    helps = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for statement, after in zip(body, body[1:]):
            if not isinstance(statement, ast.AnnAssign):
                continue
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                helps[statement.target.id] = " ".join(str(after.value.value).split())
    return helps


def parse_config(cls, argv: list[str] | None = None, presets: dict[str, dict] | None = None):
    """Precedence: dataclass defaults < --demo (reasoning unless given; none for a --model of the
    user's own) < preset of --algo < explicit flags (`--lr 1e-5`, `--lr=1e-5`, `--x`/`--no-x`). An
    unknown or abbreviated flag exits 2 naming it; overriding a preset prints a note; a model of the
    user's own missing a DEMO_SIZED knob exits 2 naming them all (with --demo: a note naming the
    demo's values it gets)."""
    helps = field_help(cls)
    parser = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]), epilog=EPILOG,
                                     description=(cls.__doc__ or "").strip(), allow_abbrev=False)
    for f in fields(cls):
        help_text = f"{helps.get(f.name, '')} (default: {f.default!r})".replace("%", "%%")
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)  # only flags given
        kind = type(f.default)
        if kind is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(f"--{f.name}", type=kind, metavar=kind.__name__.upper(), **kw)
    given = vars(parser.parse_args(argv))
    cfg = cls()
    own_model = "model" in given and not is_demo_model(given["model"])  # a model of the user's own
    demo = given.setdefault("demo", "" if own_model else cfg.demo)  # "": no demo applies
    if demo not in DEMOS and not (own_model and demo == ""):
        parser.error(f"argument --demo: invalid choice {demo!r} (choose from {', '.join(DEMOS)})")
    if presets is not None:
        algo = given.get("algo", cfg.algo)
        if algo not in presets:
            parser.error(f"argument --algo: invalid choice {algo!r} (choose from "
                         f"{', '.join(presets)})")
        # a recipe knob changed by hand is allowed, but never silently
        for k, v in presets[algo].items():
            if k in given and given[k] != v and os.environ.get("RANK", "0") == "0":
                print(f"note: --{k} {given[k]} overrides the {algo} preset's {k} = {v}", flush=True)
        given = {**presets[algo], **given}
    if own_model:
        given = {**_demo_sized(given, demo, cfg, given["model"]), **given}
    given = {**DEMOS.get(demo, {}), **given}
    for k, v in given.items():
        setattr(cfg, k, v)
    return cfg


def config_dict(cfg, world_size: int = 1) -> dict:
    """The config used, plus what reproducing a run needs: world size, versions, git commit."""
    import transformers
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, timeout=5,
                             capture_output=True, text=True)
        commit = git.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {**asdict(cfg),
            "_world_size": world_size,
            "_torch": torch.__version__,
            "_transformers": transformers.__version__,
            "_git_commit": commit}


# The flags check_config holds to a list of choices or to a lower bound.
CHOICES = {"loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
           "dtype": ("float32", "bfloat16", "float16"),
           "prompt_template": ("auto", "chat", "plain", "dapo", "none"),
           "answer_format": ("boxed", "answer_line", "auto"),
           "logprob_path": ("auto", "plain", "shortcuts"),
           "rollout": ("hf", "vllm", "auto"),
           "rollout_is": ("none", "token", "sequence"),
           "report_to": ("none", "tensorboard", "wandb"),
           "entropy_control": ("none", "clip_cov", "kl_cov"),
           "kl_cov_penalty": ("abs", "k3")}
AT_LEAST = {**dict.fromkeys(("steps", "eval_every", "save_every", "sample_every", "eval_size",
                             "overlong_buffer", "micro_batch_tokens", "logprob_chunk",
                             "crosscheck_train", "entropy_coef", "kl_cov_coef", "max_staleness",
                             "partial_chunk"), 0),
            **dict.fromkeys(("prompts_per_step", "updates_per_step", "micro_batch_size",
                             "max_new_tokens", "max_prompt_length", "eval_samples",
                             "max_gen_batches", "rollout_batch_size", "eval_batch_size",
                             "keep_last", "max_bad_updates", "oversample"), 1),
            "group_size": 2}  # (advantages are relative to the group)


def check_config(cfg, world_size: int, check_algorithm=None):
    """Flag combinations that cannot work stop here, naming the flag (exit 2), before anything is
    loaded; the script's own last (check_algorithm(cfg)). --logprob_path auto is resolved here,
    once: a resumed run takes the path the fresh run took, and config.json records it."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            die(f"--{name} {getattr(cfg, name)!r}: choose one of {', '.join(allowed)}")
    for name, low in AT_LEAST.items():
        if getattr(cfg, name) < low:
            die(f"--{name} must be >= {low}, got {getattr(cfg, name)}")
    if cfg.cpu_offload and not is_dist():
        die("--cpu_offload needs FSDP2, which runs under torchrun: launch with torchrun "
            "--standalone --nproc_per_node=1 (one GPU) or more")
    if cfg.dtype == "float16" and not cfg.eval_only:
        die("--dtype float16 trains without loss scaling (small gradients underflow): use "
            "bfloat16, or float16 only with --eval_only")
    if cfg.prompts_per_step % world_size:
        die(f"--prompts_per_step {cfg.prompts_per_step} does not divide over {world_size} ranks")
    if cfg.updates_per_step > cfg.prompts_per_step // world_size:
        die(f"--updates_per_step {cfg.updates_per_step} is more than the "
            f"{cfg.prompts_per_step // world_size} prompts per rank (--prompts_per_step "
            f"{cfg.prompts_per_step} over {world_size} ranks): an update needs a group")
    if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        die(f"--out_dir {cfg.out_dir!r} is an existing file, not a folder")
    if cfg.overlong_buffer >= cfg.max_new_tokens:
        die(f"--overlong_buffer {cfg.overlong_buffer} must be below --max_new_tokens "
            f"{cfg.max_new_tokens}")
    if cfg.rollout_is_cap <= 1:
        die(f"--rollout_is_cap must be > 1 (weights in [1/cap, cap]), got {cfg.rollout_is_cap}")
    if not (cfg.temperature > 0 and 0 < cfg.top_p <= 1):
        die(f"--temperature must be > 0 and --top_p in (0, 1], got {cfg.temperature}, {cfg.top_p}")
    if cfg.verifier_crosscheck or cfg.crosscheck_train:  # crosscheck.py: the pair, Math-Verify
        crosscheck.check_flags(cfg)
    if cfg.max_staleness and cfg.rollout_is == "none":  # tokens of older weights: partial.py
        die(f"--max_staleness {cfg.max_staleness} needs --rollout_is token or sequence")
    if cfg.entropy_control != "none":  # the controls' pairs and upper bounds
        entropy_control.check_flags(cfg)
    parse_eval_data(cfg.eval_data, cfg.eval_samples)  # a bad set@k stops here
    check_lora_config(cfg)
    if cfg.logprob_path == "auto":  # the rule: the shipped demos run the plain path a reader copies
        cfg.logprob_path = "plain" if is_demo_model(cfg.model) else "shortcuts"
    if check_algorithm is not None:
        check_algorithm(cfg)


def check_lora_config(cfg):
    """The --lora_* flags: a rank >= 1 turns LoRA on (check_lora_flags); the others only tune it, so
    setting them without a rank is a mistake, not a silent full fine-tune."""
    if cfg.lora_rank > 0:
        return check_lora_flags(cfg)
    tuned = [f"--{f.name}" for f in fields(cfg)
             if f.name.startswith("lora_") and f.name != "lora_rank"
             and getattr(cfg, f.name) != f.default]
    if cfg.lora_rank < 0 or tuned:
        die(f"--lora_rank {cfg.lora_rank}: LoRA needs a rank >= 1" +
            (f" ({', '.join(tuned)} set: they only apply to LoRA)" if tuned else ""))


def check_lora_flags(cfg):
    """LoRA's own flags, with --lora_rank >= 1; a rate chosen for full fine-tuning gets a note."""
    if cfg.lora_alpha <= 0:
        die(f"--lora_alpha must be > 0, got {cfg.lora_alpha}")
    # Dropout in the trainer's forwards would make pi_old, pi and the rollout three random draws:
    # the ratio of identical weights would not be 1, and a start-up check would compare two draws.
    if cfg.lora_dropout != 0:
        die(f"--lora_dropout {cfg.lora_dropout}: only 0 is supported, since dropout makes the "
            f"trainer's log-probs a random draw and the ratio pi / pi_old of identical weights "
            f"not 1 (docs/gpu.md)")
    if cfg.lora_sync not in ("auto", "adapter", "merged"):
        die(f"--lora_sync {cfg.lora_sync!r}: choose one of auto, adapter, merged")
    # the rates chosen for full fine-tuning: the default (the demos') and the papers' (docs/gpu.md)
    full_rates = (next(f.default for f in fields(cfg) if f.name == "lr"), 1e-6)
    if cfg.lr in full_rates:
        print0(f"note: --lora_rank {cfg.lora_rank} trains at --lr {cfg.lr:g}, a rate chosen for "
               f"full fine-tuning; LoRA's best rates were higher: 1e-3 on both demos, 3.3x full "
               f"fine-tuning's best (experiments/results/lora_study.md), about 10x in LoRA Without "
               f"Regret (docs/gpu.md)")
