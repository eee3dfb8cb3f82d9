"""The study's steps: each a subprocess of a real entry point (rope_llama/cli/), skipped once its marker
exists, run in lanes of dependent steps, up to `jobs` lanes at once (Steps); `run` lays out the lanes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rope_llama.core.checkpoint import atomic_write_text, checkpoint_context_len, resolve_checkpoint
from rope_llama.core.checks import resolve_lengths
from rope_llama.interchange.destination import claim_results_directory
from rope_llama.study.config import RANDOMIZED, StudyConfig, check_config, seed_list
from rope_llama.study.summary import summarise

# The entry points a step runs, as `python -m <module>`: from the checkout and from an installed package alike.
TRAIN, EVALUATE, RETRIEVE = (
    "rope_llama.cli.train",
    "rope_llama.cli.eval_extrapolation",
    "rope_llama.cli.passkey",
)
SMOKE_TRAIN = ["model=tiny", "data.max_len=32", "data.batch_size=8", "trainer.max_steps=20",
               "trainer.val_check_interval=10", "trainer.limit_val_batches=2", "optim.warmup_steps=5",
               "sample.max_new_tokens=0"]  # fmt: skip
SMOKE_EXTEND = ["data.max_len=128", "data.batch_size=2", "trainer.max_steps=10",
                "trainer.val_check_interval=5", "optim.warmup_steps=2"]  # fmt: skip
SMOKE_POSE = ["trainer.max_steps=10", "optim.warmup_steps=2"]  # fmt: skip
SMOKE_LENGTHS = [32, 64, 128, 256, 512]
# PoSE fine-tunes: (target length / L, RoPE scaling: the base's, or PI / YaRN matched to the target); runs
# pose<factor>_<none|pi|yarn>
POSE_FINETUNES = tuple((factor, scaling) for factor in (4, 16) for scaling in ("none", "linear", "yarn"))
SCALING_NAMES = {"none": "none", "linear": "pi", "yarn": "yarn"}
SMOKE_RETRIEVAL_LENGTHS = [512, 1024]  # the prompts' fixed parts need a few hundred tokens with a tiny BPE
TRAINED = "study_trained"  # marker file in a run directory: its training finished
DONE = "study_done"  # marker file in an evaluation's out directory: every output of the step is written
# an evaluation's out is the study's own: one without its marker (killed before the marker) is done again
REDO = ["overwrite=true"]


class Steps:
    """Runs the study's steps as subprocesses, up to `jobs` at once (one lane of dependent steps per
    worker thread). With jobs > 1 each step's output goes to out/logs/<step>.log and its torch threads
    are the machine's cores / jobs; a failure lets the running steps finish, starts no new one, and is
    raised by `run_lanes`."""

    def __init__(self, out: Path, jobs: int) -> None:
        self.out, self.jobs = out, jobs
        self.stopped = threading.Event()  # a step failed: the others start nothing new
        self.lock = threading.Lock()
        self.started = time.monotonic()

    def say(self, line: str) -> None:
        with self.lock:  # one whole line per print, whichever worker prints
            minutes = (time.monotonic() - self.started) / 60
            print(f"[study {minutes:5.1f} min] {line}", flush=True)

    def step(self, name: str, done: Path, command: list[str], same_command: bool = False) -> None:
        """Run one entry point (`command`: the interpreter's arguments, e.g. -m <module> <overrides>) unless its
        marker `done` exists (with `same_command`: and records this command; an evaluation run again with
        other options keeps its finished units); a failure stops the study with one sentence.
        The study writes `done` (atomically) only after the command succeeded, so a step killed while
        writing its outputs runs again."""
        recorded = " ".join(command) + "\n"
        if done.exists() and (not same_command or done.read_text() == recorded):
            self.say(f"{name}: done ({done} exists), skipped")
            return
        if self.stopped.is_set():
            raise Cancelled(name)
        begun = time.monotonic()
        if self.jobs == 1:
            self.say(f"{name}: {' '.join(command)}")
            returncode = subprocess.run([sys.executable, *command]).returncode
            where = ""
        else:
            log = self.out / "logs" / (name.replace(" ", "_") + ".log")
            log.parent.mkdir(parents=True, exist_ok=True)
            threads = str(max(1, (os.cpu_count() or 1) // self.jobs))
            self.say(f"{name}: started, output in {log}: {' '.join(command)}")
            with open(log, "w") as f:
                env = {**os.environ, "OMP_NUM_THREADS": threads}  # jobs processes share the cores
                returncode = subprocess.run([sys.executable, *command], stdout=f, stderr=subprocess.STDOUT, env=env).returncode  # fmt: skip
            last = log.read_text(errors="replace").replace("\r", "\n").strip().rsplit("\n", 1)[-1]
            where = (
                f" ({last.removeprefix('error: ')!r}; its output: {log})" if last else f" (its output: {log})"
            )
        if returncode != 0:
            raise RuntimeError(
                f"step {name!r} failed{where}; fix it and re-run with resume=true to continue."
            )
        atomic_write_text(done, recorded)
        self.say(f"{name}: finished in {(time.monotonic() - begun) / 60:.1f} min")

    def guarded(self, lane: Callable[[], None]) -> None:
        try:
            lane()
        except BaseException:  # any failure (a step's, or the study's own): no new step starts
            self.stopped.set()
            raise

    def run_lanes(self, lanes: list[Callable[[], None]]) -> None:
        """Run each lane (a function calling `step` in order) on a pool of `jobs` workers, in list
        order; a lane that needs another's output waits for it, so it must come after that lane.
        Re-raises the first failure in lane order once every running step has ended."""
        with ThreadPoolExecutor(self.jobs) as pool:
            futures = [pool.submit(self.guarded, lane) for lane in lanes]
        if failures := [e for f in futures if (e := f.exception()) and not isinstance(e, Cancelled)]:
            raise failures[0]


class Cancelled(Exception):
    """A step not started because another step failed."""


def run(cfg: StudyConfig, train_extra: list[str]) -> None:
    """The whole study into cfg.out: every step not done yet, then the summary. Each step runs in this
    process's directory (relative paths in `train_extra` mean what they mean here)."""
    check_config(cfg)
    out = claim_results_directory(cfg.out, "resume", cfg.resume)  # a non-empty out: only with resume=true
    # the bases' context: an imported or reused base_ckpt's own, else the length the study trains at
    base_len = 32 if cfg.smoke else checkpoint_context_len(cfg.base_ckpt) if cfg.base_ckpt else 256
    lengths = SMOKE_LENGTHS if cfg.smoke else resolve_lengths(list(cfg.lengths), base_len)
    retrieval_lengths = (
        SMOKE_RETRIEVAL_LENGTHS
        if cfg.smoke
        else resolve_lengths(list(cfg.retrieval_lengths or lengths), base_len)
    )
    focus = [] if cfg.smoke else resolve_lengths(list(cfg.focus_lengths), base_len)
    # smoke trains at max_len 32, too short for recall windows: the recipe is a full-size choice
    recipe = [cfg.recipe] if cfg.recipe and not cfg.smoke else []
    train_args = (SMOKE_TRAIN if cfg.smoke else []) + train_extra
    extend_args = SMOKE_EXTEND if cfg.smoke else []
    step_options = [
        f"threads={cfg.threads}",
        *(f"extend_options.{k}={v}" for k, v in cfg.extend_options.items()),
    ]
    as_list = lambda xs: "[" + ",".join(map(str, xs)) + "]"  # noqa: E731

    def experiment(*names: str) -> list[str]:
        """One experiment= override, the recipe first: Hydra merges a list in order, while a second
        experiment= would replace the recipe (a fine-tune would lose e.g. its model.mix_previous_tokens)."""
        names = (*recipe, *names)
        return [f"experiment=[{','.join(names)}]"] if names else []

    steps = Steps(out, cfg.jobs)

    def train(name: str, *args: str) -> Path:
        run_dir = out / "runs" / name
        # last.ckpt alone does not mean done (it is also written every 100 steps and on SIGTERM):
        # the study marks a finished training itself, and an interrupted one resumes exactly.
        resume = ["ckpt_path=last"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
        steps.step(f"train {name}", run_dir / TRAINED,
                   ["-m", TRAIN, f"hydra.run.dir={run_dir}", *train_args, *args, *resume])  # fmt: skip
        return run_dir

    def focusing(methods: list[str], at: list[int], depths: list[float] | None = None) -> list[str]:
        """The focus options of a step over several methods (a fine-tune's one method has nothing to choose);
        `depths`: a retrieval step's depths at the focus lengths."""
        kept = [t for t in focus if t in at]
        if not kept or len(methods) == 1:
            return []
        at_depths = [] if depths is None else [f"focus_depths={as_list(depths)}"]
        return [f"focus_lengths={as_list(kept)}", f"focus_count={cfg.focus_count}", *at_depths]

    def evaluate(name: str, ckpt: Path, methods: list[str]) -> None:
        for corpus in cfg.corpora:
            data = [] if corpus == "own" else [f"data={corpus}"]
            steps.step(f"eval {name} on {corpus}", out / "eval" / corpus / name / DONE,
                       ["-m", EVALUATE, f"ckpt={ckpt}", f"out={out / 'eval' / corpus / name}",
                        f"methods={as_list(methods)}", f"lengths={as_list(lengths)}", f"max_windows={cfg.max_windows}",
                        *focusing(methods, lengths), *step_options, *data, *REDO], same_command=True)  # fmt: skip

    def retrieve(name: str, ckpt: Path, methods: list[str]) -> None:
        if cfg.retrieval:
            depths = [0.0, 0.5, 1.0] if cfg.smoke else list(cfg.retrieval_depths)
            focus_depths = None if cfg.retrieval_focus_depths is None else list(cfg.retrieval_focus_depths)
            options = ["task_options.multikey.keys=2", "task_options.vartrack.chains=1"] if cfg.smoke else []
            steps.step(f"retrieval {name}", out / "retrieval" / name / DONE,
                       ["-m", RETRIEVE, f"ckpt={ckpt}", f"out={out / 'retrieval' / name}", f"methods={as_list(methods)}",
                        f"tasks={as_list(cfg.retrieval_tasks)}", f"depths={as_list(depths)}", f"trials={cfg.retrieval_trials}",
                        f"lengths={as_list(retrieval_lengths)}", f"chat={str(cfg.chat).lower()}",
                        *focusing(methods, retrieval_lengths, focus_depths), *options, *step_options, *REDO],
                       same_command=True)  # fmt: skip

    seeds = seed_list(cfg.seeds)
    bases = {
        f"base_s{k}": Path(cfg.base_ckpt) if cfg.base_ckpt else out / "runs" / f"base_s{k}" for k in seeds
    }
    # set when a base's training ends: its fine-tunes start
    trained = {name: threading.Event() for name in bases}
    finetuned = seeds[: cfg.finetune_seeds]
    suffix = lambda k: "" if k == seeds[0] else f"_s{k}"  # noqa: E731
    finetunes = {  # name -> (base it starts from, experiment, overrides)
        f"{method}{suffix(k)}": (f"base_s{k}", "extend_context", (*rope, *extend_args))
        for k in finetuned
        for method, rope in (("pi", ()), ("yarn", ("rope=yarn",)))
    }
    for k in finetuned if cfg.pose else ():
        for factor, scaling in POSE_FINETUNES:
            # the factor follows from target_len and the base's length (model/context.py)
            pose_args = (f"rope={scaling}", f"positions.target_len={factor * base_len}")
            name = f"pose{factor}_{SCALING_NAMES[scaling]}{suffix(k)}"
            finetunes[name] = (f"base_s{k}", "pose", (*pose_args, *(SMOKE_POSE if cfg.smoke else [])))

    def base_lane(seed: int) -> None:
        name = f"base_s{seed}"
        try:
            if not cfg.base_ckpt:
                seeded = [f"seed={1337 + seed}", f"data.seed={1337 + seed}", f"++data.recall.seed={seed}"]
                train(name, *experiment(), f"data.max_len={base_len}", "rope=none", *seeded)
        finally:  # also on failure, so the fine-tunes' lanes stop waiting (and then start nothing)
            trained[name].set()
        evaluate(name, bases[name], list(cfg.methods))
        retrieve(name, bases[name], list(cfg.retrieval_methods))

    def extend_lane(name: str) -> None:
        base, recipe_name, overrides = finetunes[name]
        trained[base].wait()
        if steps.stopped.is_set():
            raise Cancelled(f"train {name}")
        init = resolve_checkpoint(bases[base])  # init_from takes a .ckpt file
        run_dir = train(name, *experiment(recipe_name), f"init_from={init}", *overrides)
        evaluate(name, run_dir, ["ckpt"])
        retrieve(name, run_dir, ["ckpt"])

    def randomized_lane() -> None:
        # target_len: the longest evaluated length, as the paper's L_max covers the test lengths
        args = (*experiment("randomized_positions"), f"data.max_len={base_len}", "rope=none")
        run_dir = train(RANDOMIZED, *args, f"positions.target_len={max(lengths)}")
        evaluate(RANDOMIZED, run_dir, ["none"])
        retrieve(RANDOMIZED, run_dir, ["none"])

    def large_base_lane() -> None:
        large_args = (*experiment(), f"data.max_len={base_len}", "rope=none", f"rope.base={cfg.large_base}")
        large = Path(cfg.large_base_ckpt) if cfg.large_base_ckpt else train("large_base", *large_args)
        evaluate("large_base", large, ["none"])

    # after the bases, the longest lanes first (a base trained from scratch takes twice a fine-tune's lane), so
    # that they do not end the study alone on one core; the fine-tunes fill the other workers
    large = cfg.large_base is not None or cfg.large_base_ckpt is not None
    extra = [*([large_base_lane] if large else []), *([randomized_lane] if cfg.randomized else [])]
    steps.run_lanes([*(lambda k=k: base_lane(k) for k in seeds), *extra,
                     *(lambda name=name: extend_lane(name) for name in finetunes)])  # fmt: skip
    models = [
        *bases,
        *finetunes,
        *(["large_base"] if large else []),
        *([RANDOMIZED] if cfg.randomized else []),
    ]
    summarise(cfg, out, models, base_len, train_extra, seeds)
