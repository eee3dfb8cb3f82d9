"""The study's options (StudyConfig, checked by `check_config` before the first step) and its runs' names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rope_llama import CONFIGS
from rope_llama.core.checkpoint import checkpoint_context_len, resolve_checkpoint
from rope_llama.core.checks import check_lengths, check_number, is_integer
from rope_llama.core.threads import check_threads
from rope_llama.inference.evaluation import check_method
from rope_llama.inference.retrieval import HELDOUT, TASKS

RANDOMIZED = "randomized"  # the randomized-positions base's run
# RoPE scalings, the attention extensions (model/extend.py) alone and composed with a scaling; the remaps
# at their defaults, derived from each base's trained length
ZERO_SHOT = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3", "self_extend", "logn", "yarn+logn",
             "llama3+self_extend", "string", "dca", "rerope", "leaky_rerope")  # fmt: skip
RETRIEVAL_METHODS = ("none", "ntk", "dynamic_ntk", "yarn", "llama3", "self_extend", "string", "dca", "rerope",
                     "leaky_rerope")  # fmt: skip


@dataclass
class StudyConfig:
    out: str = "runs/study"
    resume: bool = False  # continue the study in a non-empty out (finished steps are skipped)
    smoke: bool = False  # tiny model, few steps, short lengths: checks the pipeline in minutes
    # base models: a count n (seeds 0..n-1) or the seeds themselves, e.g. [7,10,11]; seed k trains with
    # seed=1337+k data.seed=1337+k ++data.recall.seed=k (its run: base_s<k>).
    # Any: OmegaConf 2.3 has no int | list[int] field
    seeds: Any = 3
    # the bases of the first N seeds are fine-tuned (PI and YaRN at 1024; with `pose`, six PoSE fine-tunes). One
    # keeps the study near 90 minutes on 2 cores; each more adds two full-length fine-tunes (~11-13 min each, side by
    # side) and six PoSE ones (~7-8 min each) with their evaluations. The first seed's fine-tunes are named pi, yarn,
    # pose<F>_<scaling> (as in every earlier study, so those resume), seed k's with the suffix _s<k>.
    finetune_seeds: int = 1
    # experiment= of every trained model: recall_base (models that retrieve, docs/data.md); null: the default job
    recipe: str | None = "recall_base"
    corpora: list[str] = field(default_factory=lambda: ["own", "kjv"])  # own | a data config group
    # reuse one trained base model (run dir or .ckpt) as the only seed; `recipe` must be what it was trained with
    # (the fine-tunes start from it with that experiment: recipe=null for a default-job model)
    base_ckpt: str | None = None
    large_base_ckpt: str | None = None  # reuse a trained large-base model instead of step 4
    large_base: float | None = 500000.0  # rope.base of the large-base model; null: no large-base model
    pose: bool = True  # PoSE fine-tunes of the fine-tuned seeds' bases (POSE_FINETUNES)
    randomized: bool = True  # a base trained from scratch on randomized position ids (seed 0)
    # evaluation lengths: tokens, or multiples of the bases' context ("2x"; an imported base_ckpt's own context)
    lengths: list[Any] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])
    max_windows: int = 4
    # the bases' zero-shot perplexity methods and retrieval methods (scripts/eval_extrapolation.py's names)
    methods: list[str] = field(default_factory=lambda: list(ZERO_SHOT))
    retrieval_methods: list[str] = field(default_factory=lambda: list(RETRIEVAL_METHODS))
    # lengths (e.g. [4x]) where the bases run only `none` and the focus_count best methods of the length below
    focus_lengths: list[Any] = field(default_factory=list)
    focus_count: int = 4
    # extension fields for every evaluation and retrieval step, as eval.yaml's extend_options, e.g.
    # {window: 2048, group: matched} for Self-Extend on an 8k model (its defaults, 64 and 32, suit L = 256)
    extend_options: dict[str, Any] = field(default_factory=dict)
    retrieval: bool = True
    # retrieval suite tasks (scripts/passkey.py): heldout = the held-out wording families, pooled as the headline
    retrieval_tasks: list[str] = field(default_factory=lambda: ["passkey", HELDOUT])
    retrieval_lengths: list[Any] | None = None  # null = lengths
    retrieval_trials: int = 4  # prompts per (task, length, depth) cell and model
    retrieval_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    # depths of the retrieval at focus_lengths (null = retrieval_depths): fewer prompts where each costs most
    retrieval_focus_depths: list[float] | None = None
    chat: bool = False  # retrieval prompts in the tokenizer's chat template (an instruct model's)
    threads: Any = (
        "auto"  # torch threads of the evaluations: auto (cores / jobs when jobs > 1, else the free cores) | N
    )
    # steps run at once: on the 2-core CPU three one-thread trainings side by side do 1.3x the steps of one
    # two-thread training (docs/performance.md); a lane's steps (train, then its evaluations) stay in order
    jobs: int = 3


def seed_list(seeds: Any) -> list[int]:
    """The base models' seeds from `seeds`: a count n means 0..n-1; a list names them (distinct, >= 0)."""
    if is_integer(seeds) and seeds >= 1:
        return list(range(seeds))
    distinct = isinstance(seeds, list) and len(set(map(str, seeds))) == len(seeds) > 0
    if distinct and all(is_integer(k) and k >= 0 for k in seeds):
        return seeds
    raise ValueError(f"seeds must be a count >= 1 or a list of distinct seeds >= 0, got {seeds!r}.")


def check_config(cfg: StudyConfig) -> None:
    seeds = seed_list(cfg.seeds)
    if cfg.base_ckpt and len(seeds) != 1:
        raise ValueError(f"base_ckpt reuses one base model, so it needs seeds=1, got seeds={cfg.seeds}.")
    if not cfg.corpora:
        raise ValueError("corpora is empty; give at least one, e.g. corpora=[own].")
    if unknown := [t for t in cfg.retrieval_tasks if t not in (*TASKS, HELDOUT)]:
        raise ValueError(f"retrieval_tasks {unknown} are unknown; allowed tasks are {[*TASKS, HELDOUT]}.")
    check_number("finetune_seeds", cfg.finetune_seeds, minimum=0, maximum=len(seeds), integer=True,
                 allowed=f"an integer from 0 to the number of seeds ({len(seeds)})")  # fmt: skip
    check_number("jobs", cfg.jobs, minimum=1, integer=True, means="steps run at once")
    # What the steps will pass on, checked before the first one starts (a step would find it only hours in).
    recipes = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
    if cfg.recipe is not None and cfg.recipe not in recipes:
        raise ValueError(
            f"recipe={cfg.recipe!r} is not an experiment; choose one of {', '.join(recipes)} or null."
        )
    groups = sorted(p.stem for p in (CONFIGS / "data").glob("*.yaml"))
    if unknown := [c for c in cfg.corpora if c != "own" and c not in groups]:
        raise ValueError(
            f"corpora {unknown} are unknown; a corpus is `own` or a data group ({', '.join(groups)})."
        )
    for name in ("base_ckpt", "large_base_ckpt"):
        if getattr(cfg, name) is not None:  # one sentence when it does not exist or is not plain data
            checkpoint_context_len(getattr(cfg, name))
    if cfg.base_ckpt and "own" in cfg.corpora:
        saved = resolve_checkpoint(cfg.base_ckpt).parent.parent / ".hydra" / "config.yaml"
        if not saved.is_file():
            raise ValueError(
                f"corpora has `own`, the base's training data, but {cfg.base_ckpt} has no training config "
                f"({saved}; an imported model); name data groups instead, e.g. corpora=[shakespeare,kjv]."
            )
    for name in ("lengths", "retrieval_lengths"):  # null retrieval_lengths: lengths
        if getattr(cfg, name) is not None:
            check_lengths(name, list(getattr(cfg, name)), relative=True)
    if cfg.focus_lengths:  # empty: no length is focused
        check_lengths("focus_lengths", list(cfg.focus_lengths), relative=True)
    for name in ("methods", "retrieval_methods"):
        if not getattr(cfg, name):
            raise ValueError(f"{name} is empty; give at least one method, e.g. {name}=[none,yarn].")
        for method in getattr(cfg, name):
            check_method(str(method))
    for name, minimum in (("max_windows", 1), ("retrieval_trials", 1), ("focus_count", 1)):
        check_number(name, getattr(cfg, name), minimum=minimum, integer=True)
    for name in ("retrieval_depths", "retrieval_focus_depths"):
        depths = getattr(cfg, name)
        if depths is not None and (not depths or any(not 0 <= d <= 1 for d in depths)):
            raise ValueError(f"{name} must be depths in [0, 1], got {list(depths)}.")
    if cfg.retrieval_focus_depths is not None and not cfg.focus_lengths:
        raise ValueError(
            f"retrieval_focus_depths={list(cfg.retrieval_focus_depths)} applies at focus lengths, but "
            "focus_lengths is empty; give focus_lengths (e.g. [4x]) or leave retrieval_focus_depths null."
        )
    check_threads(cfg.threads)


def model_and_seed(run_name: str, first_seed: int) -> tuple[str, int]:
    """The model a study run belongs to and its seed: base_s<k>, pi_s<k>, pose4_yarn_s<k> -> (base | pi |
    pose4_yarn, k); an unsuffixed fine-tune (pi, yarn, pose4_pi, ...) -> the first seed's; large_base and
    randomized (trained with the default seeds) -> seed 0."""
    if "_s" in run_name and run_name.rsplit("_s", 1)[1].isdigit():
        model, seed = run_name.rsplit("_s", 1)
        return model, int(seed)
    return run_name, 0 if run_name in ("large_base", RANDOMIZED) else first_seed
