"""The study (rope_llama/study/, run by scripts/study.py): the steps it runs and resumes, its options, and its tables."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rope_llama.inference.retrieval import pooled_heldout
from rope_llama.inference.stats import wilson_interval
from rope_llama.study import config, lanes, tables
from rope_llama.study.config import ZERO_SHOT
from tests.helpers import ROOT, compose_train, small_corpus


def test_study_resumes_an_interrupted_training_and_skips_a_finished_one(tmp_path, monkeypatch):
    commands = []

    def fake_run(command, **_):  # records train.py's command line, then "fails" to stop the study
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=1)

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    base = tmp_path / "runs" / "base_s0"
    (base / "checkpoints").mkdir(parents=True)
    (base / "checkpoints" / "last.ckpt").touch()  # written every 100 steps: not a finished training
    with pytest.raises(RuntimeError, match="step 'train base_s0' failed"):
        lanes.run(config.StudyConfig(out=str(tmp_path), resume=True, jobs=1), [])
    assert commands[-1][2] == "rope_llama.cli.train" and commands[-1][-1] == "ckpt_path=last"
    assert "seed=1337" in commands[-1] and "experiment=[recall_base]" in commands[-1]  # seed 0, recipe
    (base / lanes.TRAINED).touch()  # the study's marker: base is skipped, the next step runs
    with pytest.raises(RuntimeError, match="step 'eval base_s0 on own' failed"):
        lanes.run(config.StudyConfig(out=str(tmp_path), resume=True, jobs=1), [])


def test_a_step_whose_outputs_were_cut_off_runs_again(tmp_path, monkeypatch):
    """windows.csv alone (a kill or a full disk mid-write) is not done: only the study's marker, written after
    the step succeeded, is; the marker is written last and atomically."""
    commands = []

    def fake_run(command, **_):
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=0 if len(commands) == 1 else 1)

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    (tmp_path / "runs" / "base_s0").mkdir(parents=True)
    (tmp_path / "runs" / "base_s0" / lanes.TRAINED).touch()
    eval_dir = tmp_path / "eval" / "own" / "base_s0"
    eval_dir.mkdir(parents=True)
    (eval_dir / "windows.csv").write_text("method,length,lo")  # truncated
    monkeypatch.setattr(lanes, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    with pytest.raises(RuntimeError, match="step 'eval base_s0 on kjv' failed"):
        lanes.run(config.StudyConfig(out=str(tmp_path), resume=True, seeds=1, jobs=1), [])
    assert (
        commands[0][2] == "rope_llama.cli.eval_extrapolation" and f"out={eval_dir}" in commands[0]
    )  # ran again, into its own out whatever that holds (the eval refuses a non-empty out otherwise)
    assert "overwrite=true" in commands[0]
    assert (eval_dir / lanes.DONE).read_text() == " ".join(commands[0][1:]) + "\n"
    assert not (tmp_path / "eval" / "kjv" / "base_s0" / lanes.DONE).exists()  # the failed step: no marker


def test_a_non_empty_out_needs_resume_and_a_run_directory_is_never_one(tmp_path, monkeypatch):
    """A study into an out that holds files (an earlier study's, or anything) starts no step unless
    resume=true, and one inside a run directory none at all; the refusals create nothing."""
    commands = []
    monkeypatch.setattr(lanes.subprocess, "run", lambda command, **_: commands.append(command))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(
        ValueError, match="is not empty; pass resume=true to continue in it, or give another out"
    ):
        lanes.run(config.StudyConfig(out=str(tmp_path), jobs=1), [])
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="is inside the run directory"):
        lanes.run(config.StudyConfig(out=str(tmp_path / "run" / "study"), resume=True, jobs=1), [])
    assert commands == [] and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run"]
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]


def finished(out: Path, name: str, corpora: tuple[str, ...] = ("own", "kjv")) -> None:
    """Mark a study run as trained, evaluated on `corpora` and retrieved. The evaluation markers record no
    command, so the study runs those steps again (cheaply, under a fake run) and keeps the training."""
    for done in [out / "runs" / name / lanes.TRAINED, out / "retrieval" / name / lanes.DONE,
                 *(out / "eval" / corpus / name / lanes.DONE for corpus in corpora)]:  # fmt: skip
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()


def test_study_fine_tunes_keep_the_recipe(tmp_path, monkeypatch):
    """With recipe=recall_base the PI/YaRN fine-tunes start from a base with previous-token mixing, so
    their composed config must keep the recipe's model (and data) settings and add extend_context's."""
    commands = []

    def fake_run(command, **_):
        commands.append(command)
        failed = command[2] == "rope_llama.cli.train"  # stop the study at the first training
        return subprocess.CompletedProcess(command, returncode=int(failed))

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    for name in (
        "base_s0",
        "large_base",
        config.RANDOMIZED,
    ):  # trained and evaluated: the PI fine-tune runs next
        finished(tmp_path, name)
    monkeypatch.setattr(lanes, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    with pytest.raises(RuntimeError, match="step 'train pi' failed"):
        lanes.run(
            config.StudyConfig(out=str(tmp_path), resume=True, seeds=1, recipe="recall_base", jobs=1), []
        )
    overrides = [c for c in commands[-1][3:] if not c.startswith(("hydra.", "init_from="))]
    assert overrides == ["experiment=[recall_base,extend_context]"]
    cfg = compose_train(overrides, tmp_path / "pi")
    assert cfg.model.mix_previous_tokens == 3 and cfg.data.recall.fraction > 0  # the recipe's
    assert cfg.data.max_len == 1024 and cfg.rope.factor is None  # extend_context's: follows the lengths
    assert cfg.optim.name == "muon" and cfg.optim.muon_lr == 2e-3  # the recipe's optimizer at fine-tune rates


def test_study_seed_list_names_the_bases_and_fine_tunes_the_first(tmp_path, monkeypatch):
    """seeds=[7,3]: base_s7 and base_s3 train with seeds 1344 and 1340 (recall seeds 7 and 3), and the
    PI fine-tune starts from the first seed's base, not from a base_s0 that does not exist."""
    commands = []

    def fake_run(command, **_):
        commands.append(command)
        return subprocess.CompletedProcess(
            command, returncode=1 if command[2] == "rope_llama.cli.train" else 0
        )

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    monkeypatch.setattr(lanes, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    with pytest.raises(RuntimeError, match="step 'train base_s7' failed"):
        lanes.run(
            config.StudyConfig(out=str(tmp_path), resume=True, seeds=[7, 3], corpora=["own"], jobs=1), []
        )
    assert commands[-1][-3:] == ["seed=1344", "data.seed=1344", "++data.recall.seed=7"]
    for seed in (7, 3):  # both bases trained: the study goes on to the fine-tune
        (tmp_path / "runs" / f"base_s{seed}").mkdir(parents=True)
        (tmp_path / "runs" / f"base_s{seed}" / lanes.TRAINED).touch()
    for name in ("large_base", config.RANDOMIZED):  # the lanes that run before the fine-tunes: done
        finished(tmp_path, name, corpora=("own",))
    commands.clear()
    with pytest.raises(RuntimeError, match="step 'train pi' failed"):
        lanes.run(
            config.StudyConfig(out=str(tmp_path), resume=True, seeds=[7, 3], corpora=["own"], jobs=1), []
        )
    evaluations = [(f"rope_llama.cli.{entry}", base) for base in ("base_s7", "base_s3")
                   for entry in ("eval_extrapolation", "passkey")]  # fmt: skip
    of_bases = [(c[2], Path(c[3].removeprefix("ckpt=")).name) for c in commands[:-1] if "base_s" in c[3]]
    assert of_bases == evaluations and commands[-1][2] == "rope_llama.cli.train"
    assert f"init_from={tmp_path / 'runs' / 'base_s7' / 'last.ckpt'}" in commands[-1]


def test_study_runs_jobs_steps_at_once_and_fine_tunes_only_after_the_first_base(tmp_path, monkeypatch):
    """jobs=3: never more than three subprocesses at once (and three do overlap), each with the cores / 3
    threads and its output in out/logs/; every step runs once; the PI and YaRN fine-tunes, whose lanes
    have workers while base_s0 still trains, start only after that training has ended."""
    lock, running, events, envs = threading.Lock(), [0], [], []

    def fake_run(command, stdout, stderr, env):
        name = next(c for c in command[3:] if c.startswith(("hydra.run.dir=", "out=")))
        Path(name.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)  # as train.py does
        with lock:
            running[0] += 1
            events.append(("start", command[2], name, running[0]))
            envs.append((env["OMP_NUM_THREADS"], Path(stdout.name).parent))
        time.sleep(0.5 if name.endswith("runs/base_s0") else 0.05)  # the first base trains longest
        with lock:
            running[0] -= 1
            events.append(("end", command[2], name, running[0]))
        return subprocess.CompletedProcess(command, returncode=0)

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    monkeypatch.setattr(lanes, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    monkeypatch.setattr(lanes, "summarise", lambda *args: None)  # the fakes write no tables
    lanes.run(config.StudyConfig(out=str(tmp_path), resume=True, seeds=2, corpora=["own"], jobs=3), [])
    starts = [e for e in events if e[0] == "start"]
    assert max(e[3] for e in starts) == 3  # three at once, never four
    # trainings (2 bases, pi, yarn, 6 PoSE, large base, randomized), evaluations, retrievals (no large base)
    assert len(starts) == len({(e[1], e[2]) for e in starts}) == 12 + 12 + 11
    assert set(envs) == {(str(max(1, (os.cpu_count() or 1) // 3)), tmp_path / "logs")}
    order = [(e[0], e[2].rsplit("/", 1)[-1]) for e in events if e[1] == "rope_llama.cli.train"]
    base_end = order.index(("end", "base_s0"))
    for finetune in (
        "pi",
        "yarn",
        "pose4_none",
        "pose4_pi",
        "pose4_yarn",
        "pose16_none",
        "pose16_pi",
        "pose16_yarn",
    ):
        assert base_end < order.index(("start", finetune))


@pytest.mark.parametrize("large_base, trained", [(None, False), (250000.0, True)])
def test_large_base_null_runs_no_large_base_lane(tmp_path, monkeypatch, large_base, trained):
    """large_base=null: the study trains and evaluates only the bases (and what else is asked); a number
    trains the large-base model with that rope.base."""
    commands = recorded_steps(monkeypatch)
    study = config.StudyConfig(out=str(tmp_path), seeds=1, finetune_seeds=0, pose=False, randomized=False,
                               corpora=["own"], jobs=1, large_base=large_base)  # fmt: skip
    lanes.run(study, [])
    runs = [c for c in commands if c[2] == lanes.TRAIN]
    assert [c[3].rsplit("/", 1)[-1] for c in runs] == ["base_s0", *(["large_base"] if trained else [])]
    assert trained == any(f"rope.base={large_base}" in c for c in runs)


def test_study_finetune_seeds_fine_tunes_each_base_after_its_own_training(tmp_path, monkeypatch):
    """seeds=[7,3] finetune_seeds=2: PI and YaRN fine-tunes of both bases, the first seed's named pi / yarn
    and seed 3's pi_s3 / yarn_s3, each from its own base and started only after that base's training
    ended (base_s3 trains longest here, so a fine-tune that waited for base_s7 alone would start early)."""
    lock, events, commands = threading.Lock(), [], {}

    def fake_run(command, stdout, stderr, env):
        name = next(c for c in command[3:] if c.startswith(("hydra.run.dir=", "out=")))
        Path(name.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)
        with lock:
            events.append(("start", command[2], name.rsplit("/", 1)[-1]))
            commands[command[2], name.rsplit("/", 1)[-1]] = command
        time.sleep(0.5 if name.endswith("runs/base_s3") else 0.05)
        with lock:
            events.append(("end", command[2], name.rsplit("/", 1)[-1]))
        return subprocess.CompletedProcess(command, returncode=0)

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    monkeypatch.setattr(lanes, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    summarised = []
    monkeypatch.setattr(lanes, "summarise", lambda cfg, out, models, *rest: summarised.append(models))
    cfg = config.StudyConfig(
        out=str(tmp_path), resume=True, seeds=[7, 3], corpora=["own"], jobs=4, finetune_seeds=2
    )
    lanes.run(cfg, [])
    order = [(e[0], e[2]) for e in events if e[1] == "rope_llama.cli.train"]
    pose = [f"pose{f}_{r}" for f in (4, 16) for r in ("none", "pi", "yarn")]
    finetunes = [(name, "base_s7") for name in ("pi", "yarn", *pose)]
    finetunes += [(name, "base_s3") for name in ("pi_s3", "yarn_s3", *(f"{p}_s3" for p in pose))]
    for name, base in finetunes:
        command = commands["rope_llama.cli.train", name]
        assert f"init_from={tmp_path / 'runs' / base / 'last.ckpt'}" in command
        assert ("rope=yarn" in command) == ("yarn" in name)
        assert order.index(("end", base)) < order.index(("start", name))
        if name.startswith("pose"):  # PoSE towards factor x L; its RoPE factor follows (model/context.py)
            factor = int(name[4 : name.index("_")])
            assert (
                "experiment=[recall_base,pose]" in command
                and f"positions.target_len={factor * 256}" in command
            )
            assert not any(c.startswith("rope.factor=") for c in command)
    assert order.index(("start", "pi")) < order.index(("end", "base_s3"))  # not held back by the other base
    assert "experiment=[recall_base,randomized_positions]" in commands["rope_llama.cli.train", "randomized"]
    assert summarised == [["base_s7", "base_s3", "pi", "yarn", "pi_s3", "yarn_s3", *pose, *(f"{p}_s3" for p in pose),
                           "large_base", "randomized"]]  # fmt: skip


def test_study_names_map_to_model_and_seed():
    assert config.model_and_seed("base_s3", 7) == ("base", 3)
    assert config.model_and_seed("yarn_s3", 7) == ("yarn", 3)
    assert config.model_and_seed("pi", 7) == ("pi", 7)  # the first seed's fine-tune
    assert config.model_and_seed("large_base", 7) == ("large_base", 0)
    assert config.model_and_seed("pose16_yarn", 7) == ("pose16_yarn", 7)
    assert config.model_and_seed("pose4_pi_s3", 7) == ("pose4_pi", 3)
    assert config.model_and_seed("randomized", 7) == ("randomized", 0)


@pytest.mark.parametrize("finetune_seeds", [-1, 3, 1.5, True])
def test_study_rejects_bad_finetune_seeds_in_one_sentence(finetune_seeds):
    with pytest.raises(
        ValueError, match=r"^finetune_seeds must be an integer from 0 to the number of seeds \(2\)"
    ):
        config.check_config(config.StudyConfig(seeds=2, finetune_seeds=finetune_seeds))


def test_study_failure_with_jobs_starts_nothing_new_and_names_the_step_and_its_log(tmp_path, monkeypatch):
    commands = []

    def fake_run(command, stdout, stderr, env):
        commands.append(command)
        fails = "base_s0" in command[3]
        stdout.write("Epoch 0: 10%\rEpoch 0: 20%\nerror: out of memory\n" if fails else "")
        return subprocess.CompletedProcess(command, returncode=1 if fails else 0)

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    log = tmp_path / "logs" / "train_base_s0.log"
    message = rf"^step 'train base_s0' failed \('out of memory'; its output: {log}\); fix it and re-run"
    with pytest.raises(RuntimeError, match=message):
        lanes.run(config.StudyConfig(out=str(tmp_path), resume=True, seeds=2, jobs=2), [])
    assert [c[2] for c in commands] in (
        ["rope_llama.cli.train"],
        ["rope_llama.cli.train"] * 2,
    )  # base_s1's may have started already
    assert all("base_s" in c[3] for c in commands)  # no fine-tune, large base or evaluation began


@pytest.mark.parametrize("seeds", [0, -1, True, [], [1, 1], [2, -3], "3"])
def test_study_rejects_bad_seeds_in_one_sentence(seeds):
    with pytest.raises(ValueError, match=r"^seeds must be a count >= 1 or a list of distinct seeds"):
        config.check_config(config.StudyConfig(seeds=seeds))


@pytest.mark.parametrize("jobs", [0, -2, 1.5])
def test_study_rejects_bad_jobs_in_one_sentence(jobs):
    with pytest.raises(ValueError, match=r"^jobs must be an integer >= 1 \(steps run at once\), got"):
        config.check_config(config.StudyConfig(jobs=jobs))


@pytest.mark.slow
def test_study_smoke_runs_every_step_and_resumes(tmp_path):
    """~4 minutes on 2 shared cores: twenty tiny trainings (two seeds, both fine-tuned at full length and
    with PoSE; the large-base and randomized-positions bases), evaluations on two corpora and retrieval runs,
    each a subprocess."""
    corpus = small_corpus(tmp_path / "corpus", n_files=8, chars=12000)
    data = [
        "data=text_files",
        f"data.source.paths=[{corpus}]",
        "data.vocab_size=320",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    command = [
        sys.executable,
        str(ROOT / "scripts" / "study.py"),
        f"out={tmp_path / 'study'}",
        "smoke=true",
        "seeds=2",
        "finetune_seeds=2",
        "threads=1",
        "--",
        *data,
    ]
    subprocess.run(command, check=True, cwd=ROOT)
    study_dir = tmp_path / "study"
    summary = (study_dir / "summary.md").read_text()
    models = (
        "base/yarn",
        "pi/ckpt",
        "yarn/ckpt",
        "large_base/none",
        "pose4_yarn/ckpt",
        "pose16_yarn/ckpt",
        "randomized/none",
    )
    assert all(f"| {m} | " in summary for m in models)
    assert (
        "trained extensions (seed 0), T = 512" in summary
        and "### What each training buys (seed 0)" in summary
    )
    assert "| pose16_yarn | 10 | " in summary  # its cost row: the smoke's 10 steps
    assert "### own: perplexity" in summary and "### kjv: perplexity" in summary
    assert "| base/yarn | 2 | " in summary  # two seeds behind every base cell
    assert "| yarn/ckpt | 2 | " in summary  # and behind each fine-tune (yarn, yarn_s1)
    assert (study_dir / "runs" / "yarn_s1" / lanes.TRAINED).is_file()
    assert "Significant orderings (95%)" in summary and "### heldout: greedy accuracy" in summary
    assert summary.index("### heldout: greedy") < summary.index("### passkey: greedy")  # the headline first
    for name in (
        "summary.png",
        "retrieval_passkey.png",
        "retrieval_passkey_depths.png",
        "retrieval_heldout.png",
        "paired_ppl.csv",
        "retrieval.csv",
        "paired_retrieval.csv",
    ):
        assert (study_dir / name).is_file()
    with open(study_dir / "paired_ppl.csv") as f:
        paired = list(csv.DictReader(f))
    n_methods = len(ZERO_SHOT)
    base = [r for r in paired if r["model"] == "base"]
    assert len(base) == 2 * 5 * n_methods * (n_methods - 1) // 2  # corpora x lengths from L on x pairs
    # the best zero-shot method, pi, yarn, six PoSE fine-tunes, the large base and the randomized one
    assert len(paired) - len(base) == 2 * 4 * 11 * 10 // 2
    again = subprocess.run(
        [*command[:3], "resume=true", *command[3:]], check=True, cwd=ROOT, capture_output=True, text=True
    )
    # resumable: every step's output exists (20 trainings, 20 models x 2 corpora evaluated, 19 retrievals)
    assert again.stdout.count("skipped") == 20 + 40 + 19


def test_study_tables_average_seeds_and_mark_only_significant_orderings():
    """Constructed per-window losses: `good` is 0.1 nats better than `none` on every window of every
    seed, `same` equals `none` up to symmetric noise. The seed table shows each seed's perplexity
    mean and range; the paired table marks good < none and good < same, and nothing else."""
    rng = np.random.default_rng(0)
    windows = []
    for seed in range(3):
        for document in range(2):
            for window in range(4):
                base = 4.0 + 0.2 * seed + rng.normal(0, 0.3)  # seeds and windows differ a lot
                noise = 0.01 if (seed + document + window) % 2 else -0.01
                for method, loss in (("none", base), ("good", base - 0.1), ("same", base + noise)):
                    row = {"model": "base", "method": method, "length": 512, "seed": seed}
                    windows.append({**row, "document": document, "window": window, "loss": loss})
    table = tables.seed_table(windows, "own")
    per_seed = [
        np.exp(np.mean([w["loss"] for w in windows if w["method"] == "none" and w["seed"] == s]))
        for s in range(3)
    ]
    assert (
        f"| base/none | 3 | {np.mean(per_seed):,.2f} [{min(per_seed):,.2f}, {max(per_seed):,.2f}] |" in table
    )
    assert "| base/good | 3 | **" in table  # the best mean is bold
    rows, text = tables.paired_ppl(windows, "own", "base", max_len=256)
    significant = {(r["a"], r["b"]): r["better"] for r in rows if r["significant"]}
    assert significant == {("none", "good"): "good", ("good", "same"): "good"}
    good_vs_none = next(r for r in rows if {r["a"], r["b"]} == {"none", "good"})
    assert good_vs_none["diff"] == pytest.approx(0.1) and good_vs_none["clusters"] == 6  # documents x seeds
    assert "Significant orderings (95%): good < none, good < same" in text


def test_study_retrieval_tables_pool_seeds_with_wilson_intervals():
    """Greedy: yarn always right, none in trial 0 only. Ranking: both rank the key first except in one
    of none's prompts, so the ranking has no significant ordering."""
    trials = []
    for seed in range(2):
        for depth in (0.0, 0.5, 1.0):
            for trial in range(5):
                for method, correct in (("yarn", 1), ("none", int(trial == 0))):
                    ranked = int((method, seed, depth, trial) != ("none", 1, 0.0, 4))
                    trials.append({"task": "passkey", "model": "base", "seed": seed, "method": method, "length": 512,
                                   "depth": depth, "trial": trial, "greedy_correct": correct, "rank_correct": ranked})  # fmt: skip
    accuracy, paired, text = tables.retrieval_tables(trials)
    none = next(r for r in accuracy if r["method"] == "base/none")
    assert none["trials"] == 30 and none["greedy_acc"] == pytest.approx(6 / 30) and none["seeds"] == 2
    assert (none["greedy_low"], none["greedy_high"]) == pytest.approx(wilson_interval(6, 30))
    assert none["ranking_acc"] == pytest.approx(29 / 30)
    assert (none["ranking_seed_min"], none["ranking_seed_max"]) == pytest.approx((14 / 15, 1.0))
    assert [(r["metric"], r["better"], r["significant"]) for r in paired] == [
        ("greedy", "yarn", True),
        ("ranking", "", False),  # no better method named without significance
    ]
    assert "(greedy), base models, T = 512: significant orderings (95%): yarn < none" in text
    assert "(ranking), base models, T = 512: significant orderings (95%): none" in text
    assert "| base/yarn | 100% [" in text and "### passkey: ranking accuracy" in text
    assert "margin" not in text and "margin_mean" not in none  # trials.csv files without the margin column
    assert "greedy misses" not in text and "miss_overrun" not in none  # nor answers: no miss kinds guessed
    assert "| base/none | 20% / 20% |" in text  # the per-seed table: trial 0 of 5 per depth on each seed


def test_study_pools_the_heldout_families_as_the_first_table_with_distinct_paired_units():
    """Two families of 2 seeds x 2 depths x 3 trials: the pooled `heldout` row counts both (24 trials), its paired
    test sees 24 units (the families' trial indices do not collide), and its table comes first."""
    trials = []
    for task in ("heldout_prose", "heldout_dialogue", "passkey"):
        for seed in range(2):
            for depth in (0.0, 1.0):
                for trial in range(3):
                    for method, correct in (("yarn", 1), ("none", int(task == "heldout_prose"))):
                        trials.append({"task": task, "model": "base", "seed": seed, "method": method, "length": 512,
                                       "depth": depth, "trial": trial, "greedy_correct": correct, "rank_correct": 1})  # fmt: skip
    accuracy, paired, text = tables.retrieval_tables(trials + pooled_heldout(trials))
    pooled = next(r for r in accuracy if r["task"] == "heldout" and r["method"] == "base/none")
    assert pooled["trials"] == 24 and pooled["greedy_acc"] == pytest.approx(0.5)
    greedy = next(r for r in paired if r["task"] == "heldout" and r["metric"] == "greedy")
    assert greedy["units"] == 24 and greedy["better"] == "yarn"
    titles = [
        line for line in text.splitlines() if line.startswith("### ") and "greedy accuracy, pooled" in line
    ]
    assert [t.split(":")[0] for t in titles] == [
        "### heldout",
        "### passkey",
        "### heldout_prose",
        "### heldout_dialogue",
    ]


def test_study_retrieval_tables_show_a_base_that_never_copies_seed_by_seed():
    """Seed 2 writes every key, seed 10 none: pooled that is 50%; the per-seed table, in seed order, shows both."""
    trials = [{"task": "passkey", "model": "base", "seed": seed, "method": "none", "length": 256, "depth": 0.5,
               "trial": trial, "greedy_correct": int(seed == 2), "rank_correct": 1}
              for seed in (10, 2) for trial in range(4)]  # fmt: skip
    trials.append(trials[0] | {"model": "yarn", "method": "ckpt", "seed": 0})  # a fine-tune: not a base seed
    _, _, text = tables.retrieval_tables(trials)
    assert "| base/none | 50% [" in text
    assert "### passkey: greedy accuracy per seed (base models: 2 / 10)" in text
    assert "| base/none | 100% / 0% |" in text


def test_study_retrieval_tables_class_the_greedy_misses():
    """Four prompts per method: yarn writes two keys and overruns two; none answers prose first twice, a distractor's
    key once, another number once. Answers come as trials.csv gives them, all-digit ones parsed as numbers."""
    answers = {"yarn": [" 10388.", 10388, 103888, " 103888."], "none": [" the road", "\n", 24676, 12]}
    trials = [{"task": "passkey", "model": "base", "seed": 0, "method": method, "length": 512, "depth": 0.5,
               "trial": i, "greedy_correct": int(str(answer).strip(" .") == "10388"), "rank_correct": 1,
               "key": 10388, "answer": answer, "distractors": 24676}  # one distractor: read_csv makes it an int
              for method, given in answers.items() for i, answer in enumerate(given)]  # fmt: skip
    accuracy, _, text = tables.retrieval_tables(trials)
    yarn = next(r for r in accuracy if r["method"] == "base/yarn")
    assert (yarn["greedy_acc"], yarn["miss_overrun"], yarn["miss_prose_first"]) == (0.5, 0.5, 0.0)
    assert "### passkey: greedy misses by kind (prose first / overrun / another needle / incomplete /" in text
    assert "| base/none | 50% / 0% / 25% / 0% / 25% |" in text


def test_study_retrieval_tables_compare_first_token_margins():
    """yarn's margin is none's plus 0.5 on every prompt (+ noise shared by both), on seed-specific
    levels: the mean, the seeds' range and the significant ordering follow from that construction."""
    rng = np.random.default_rng(0)
    trials = []
    for seed, level in ((0, -1.0), (1, 1.0)):
        for depth in (0.0, 0.5, 1.0):
            for trial in range(5):
                shared = float(rng.normal())
                for method, shift in (("none", 0.0), ("yarn", 0.5)):
                    trials.append({"task": "passkey", "model": "base", "seed": seed, "method": method, "length": 512,
                                   "depth": depth, "trial": trial, "greedy_correct": 1, "rank_correct": 1,
                                   "first_margin": level + shared + shift})  # fmt: skip
    accuracy, paired, text = tables.retrieval_tables(trials)
    none, yarn = (next(r for r in accuracy if r["method"] == f"base/{m}") for m in ("none", "yarn"))
    margins = {
        s: [t["first_margin"] for t in trials if t["method"] == "none" and t["seed"] == s] for s in (0, 1)
    }
    assert none["margin_mean"] == pytest.approx(np.mean(margins[0] + margins[1]))
    assert (none["margin_seed_min"], none["margin_seed_max"]) == pytest.approx(
        (min(map(np.mean, margins.values())), max(map(np.mean, margins.values())))
    )
    assert yarn["margin_mean"] == pytest.approx(none["margin_mean"] + 0.5)
    margin_row = next(r for r in paired if r["metric"] == "margin")
    assert margin_row["better"] == "yarn" and margin_row["significant"]
    assert margin_row["diff"] == pytest.approx(-0.5 if margin_row["a"] == "none" else 0.5)
    tied = [r["significant"] for r in paired if r["metric"] != "margin"]
    assert tied == [False, False]  # greedy and ranking: every prompt right with both methods
    assert "### passkey: first-token margin (nats)" in text
    assert f"| base/yarn | {yarn['margin_mean']:+.2f} [" in text
    assert "(margin), base models, T = 512: significant orderings (95%): yarn < none" in text


def recorded_steps(monkeypatch) -> list[list[str]]:
    """The study's step commands, recorded instead of run (each succeeds); no summary is written."""
    commands = []

    def fake_run(command, **_):
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=0)

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    monkeypatch.setattr(lanes, "summarise", lambda *args: None)
    return commands


def imported_base(tmp_path: Path, context_len: int = 8192) -> Path:
    """A checkpoint with no training config beside it (as import_gguf.py writes) claiming `context_len`."""
    from rope_llama.core.checkpoint import weights_checkpoint
    from rope_llama.model.config import ModelConfig
    from rope_llama.model.llama import Llama

    model = Llama(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64,
                              lengths=context_len))  # fmt: skip
    path = tmp_path / "import" / "model.ckpt"
    path.parent.mkdir()
    import torch

    torch.save(weights_checkpoint(model, None), path)
    return path


def test_an_imported_base_is_evaluated_at_multiples_of_its_own_context(tmp_path, monkeypatch):
    """base_ckpt of an import: no training; lengths and focus lengths as multiples of its context; the methods,
    extension options, depths, chat and focus options reach the steps; `own` (no training config) is refused."""
    commands = recorded_steps(monkeypatch)
    base = imported_base(tmp_path)
    options = dict(out=str(tmp_path / "out"), base_ckpt=str(base), seeds=1, finetune_seeds=0, pose=False,
                   randomized=False, large_base=None, jobs=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"corpora has `own`.*name data groups instead"):
        lanes.run(config.StudyConfig(**options), [])
    study = config.StudyConfig(**options, corpora=["kjv"], lengths=["1x", "2x", "4x"], focus_lengths=["4x"],
                               methods=["none", "yarn", "dca"], retrieval_methods=["none", "yarn"],
                               extend_options={"window": 2048, "group": "matched"}, chat=True,
                               retrieval_depths=[0.5], retrieval_focus_depths=[0.25, 0.75],
                               retrieval_tasks=["passkey", "multivalue"])  # fmt: skip
    lanes.run(study, [])
    assert [c[2] for c in commands] == [lanes.EVALUATE, lanes.RETRIEVE]  # nothing trained
    evaluation, retrieval = commands
    for command in commands:
        assert "lengths=[8192,16384,32768]" in command and "focus_lengths=[32768]" in command
        assert "extend_options.window=2048" in command and "extend_options.group=matched" in command
    assert "methods=[none,yarn,dca]" in evaluation and "data=kjv" in evaluation
    assert {"methods=[none,yarn]", "depths=[0.5]", "focus_depths=[0.25,0.75]", "chat=true",
            "tasks=[passkey,multivalue]"} <= set(retrieval)  # fmt: skip
    assert not any(arg.startswith("focus_depths") for arg in evaluation)


def test_an_evaluation_step_runs_again_when_its_command_changes(tmp_path, monkeypatch):
    """A finished evaluation asked again with other options (more windows) runs again (its units make that
    cheap); asked the same, it is skipped. A training's marker alone still means done."""
    commands = recorded_steps(monkeypatch)
    options = dict(out=str(tmp_path / "out"), base_ckpt=str(imported_base(tmp_path)), seeds=1, finetune_seeds=0,
                   pose=False, randomized=False, large_base=None, jobs=1, corpora=["kjv"], retrieval=False)  # fmt: skip
    lanes.run(config.StudyConfig(**options, max_windows=1), [])
    lanes.run(config.StudyConfig(**options, max_windows=1, resume=True), [])
    assert len(commands) == 1
    lanes.run(config.StudyConfig(**options, max_windows=2, resume=True), [])
    assert len(commands) == 2 and "max_windows=2" in commands[-1]
