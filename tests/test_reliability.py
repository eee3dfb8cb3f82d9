"""Reliability of a training process: kills, SIGTERM, non-finite loss, refused resumes that write nothing,
a run directory that belongs to one run, one-sentence errors, RoPE properties. Checkpoint files and safe
loading: test_checkpoint_files.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rope_llama.cli import train as train_py
from rope_llama.core.checkpoint import (
    CheckpointError,
    model_state_from_checkpoint,
    safe_load,
)
from rope_llama.model.rope import SCALINGS, RopeConfig, RotaryEmbedding
from tests.helpers import (
    ROOT,
    compose_train,
    crafted_checkpoint,
    last_weights,
    refusal,
    small_corpus,
    tiny_overrides,
    train_cli,
    tree,
)

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def train_args(tmp_path: Path, corpus: str, run_dir: Path, *extra: str) -> list[str]:
    return tiny_overrides(tmp_path, corpus) + ["sample.max_new_tokens=0", f"hydra.run.dir={run_dir}", *extra]


def start_training(args: list[str], **popen) -> subprocess.Popen:
    """train.py in the background, so the test can signal it."""
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=ENV, **popen)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, "training ended before the file appeared"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- kills and signals


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, corpus):
    # saves are frequent; the cache is cut into shards that windows cross
    steps = ["trainer.max_steps=200", "callbacks.checkpoint.every_n_train_steps=5", "data.shard_tokens=2048"]
    full = tmp_path / "full"
    assert train_cli(*train_args(tmp_path, corpus, full, *steps)).returncode == 0

    killed = tmp_path / "killed"
    proc = start_training(
        train_args(tmp_path, corpus, killed, *steps), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for(killed / "checkpoints" / "last.ckpt", proc)
    time.sleep(random.Random(0).uniform(0.0, 1.5))  # somewhere in a later step or checkpoint save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step_at_kill = safe_load(killed / "checkpoints" / "last.ckpt")["global_step"]
    had_metrics = (killed / "metrics.csv").exists()
    assert step_at_kill < 200, "the run finished before the kill: nothing was tested"

    resumed = train_cli(*train_args(tmp_path, corpus, killed, *steps, "ckpt_path=last"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = last_weights(full), last_weights(killed)
    assert safe_load(killed / "checkpoints" / "last.ckpt")["global_step"] == 200
    assert all(torch.equal(a[k], b[k]) for k in a)
    if had_metrics:  # the killed run's log is kept beside the resumed run's
        assert list(killed.glob("metrics.*.csv")), "the killed run's metrics were overwritten"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, corpus):
    run_dir = tmp_path / "term"
    steps = ["trainer.max_steps=100000", "callbacks.checkpoint.every_n_train_steps=5"]
    proc = start_training(
        train_args(tmp_path, corpus, run_dir, *steps),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(run_dir / "checkpoints" / "last.ckpt", proc)  # training is under way
    time.sleep(0.7)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "Stopped by SIGTERM" in out and "Traceback" not in err
    assert f"hydra.run.dir={run_dir}" in out and "trainer.max_steps=100000" in out  # its own overrides
    step = safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    assert 5 <= step < 100000

    resumed = train_cli(
        *train_args(tmp_path, corpus, run_dir, f"trainer.max_steps={step + 4}", "ckpt_path=last")
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == step + 4


WRITER = """
import sys, torch
from rope_llama.core.checkpoint import atomic_torch_save
path, i = sys.argv[1], 0
while True:
    i += 1
    atomic_torch_save({"version": i, "payload": torch.full((4_000_000,), float(i))}, path)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "last.ckpt"
    rng = random.Random(0)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, env=ENV)
        wait_for(path, proc, timeout=60)
        time.sleep(rng.uniform(0.05, 0.6))  # a 16 MB write is usually in flight
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = safe_load(path)  # always a complete file: the old one or the new one, never half
        assert torch.equal(ckpt["payload"], torch.full((4_000_000,), float(ckpt["version"])))


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus):
    import lightning as L

    class PoisonAt(L.Callback):  # a NaN weight at step 15, after the step-10 checkpoint
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 15:
                with torch.no_grad():
                    module.model.norm.weight.fill_(float("nan"))

    run_dir = tmp_path / "nan"
    cfg = compose_train(tiny_overrides(tmp_path, corpus) + ["trainer.max_steps=30"], run_dir)
    _, datamodule, module, trainer, _ = train_py.setup_run(cfg)
    trainer.callbacks.append(PoisonAt())
    with pytest.raises(train_py.NonFiniteLossError, match="Loss became nan at step 15"):
        trainer.fit(module, datamodule=datamodule)
    ckpt = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 10
    assert all(torch.isfinite(t).all() for t in model_state_from_checkpoint(ckpt).values())


# ----------------------------------------------------------------------------- refused checkpoints write nothing


@pytest.mark.parametrize("option", ["init_from", "ckpt_path"])
def test_training_refuses_a_crafted_checkpoint(option, tmp_path, corpus):
    path, marker = crafted_checkpoint(tmp_path)
    cfg = compose_train(tiny_overrides(tmp_path, corpus) + [f"{option}={path}"], tmp_path / "run")
    with pytest.raises(CheckpointError, match="Refusing to load"):
        train_py.train(cfg)
    assert not marker.exists()


def test_refused_resume_leaves_no_run_directory(tmp_path, corpus, monkeypatch, capsys):
    path, marker = crafted_checkpoint(tmp_path)
    run_dir = tmp_path / "run"
    code, err = cli(
        tiny_overrides(tmp_path, corpus) + [f"ckpt_path={path}", f"hydra.run.dir={run_dir}"],
        monkeypatch,
        capsys,
    )
    assert code == 2 and err.strip().splitlines()[-1] == f"error: {refusal(path)}"
    assert not run_dir.exists() and not marker.exists()


@pytest.mark.parametrize("resume", ["missing", "crafted"])
def test_refused_run_keeps_a_run_directory_that_existed_before(resume, tmp_path, corpus, monkeypatch, capsys):
    path, _ = crafted_checkpoint(tmp_path)
    run_dir = tmp_path / "run"  # e.g. left by an earlier failed run: Hydra's files only
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "notes.yaml").write_text("mine\n")
    (run_dir / "train.log").write_text("an earlier log\n")
    ckpt_path = "last" if resume == "missing" else path
    code, _ = cli(
        tiny_overrides(tmp_path, corpus) + [f"ckpt_path={ckpt_path}", f"hydra.run.dir={run_dir}"],
        monkeypatch,
        capsys,
    )
    assert code == 2
    assert (run_dir / ".hydra" / "notes.yaml").read_text() == "mine\n"
    assert (run_dir / "train.log").read_text() == "an earlier log\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "train.log"]  # nothing written either
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["notes.yaml"]


# ----------------------------------------------------------------------------- a run directory belongs to one run


def trained_run(tmp_path, corpus, monkeypatch, capsys, name: str) -> Path:
    run_dir = tmp_path / name
    code, err = cli(tiny_overrides(tmp_path, corpus) + [f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert code == 0, err
    return run_dir


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_refused_run_rewrites_nothing_of_an_existing_run(tmp_path, corpus, monkeypatch, capsys):
    """Hydra's .hydra/ config is written by train.py after the checks: a refusal leaves the run's intact."""
    run_dir = trained_run(tmp_path, corpus, monkeypatch, capsys, "a")
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (
        run_dir / ".hydra" / "overrides.yaml"
    ).is_file()
    before = snapshot(run_dir)
    for bad in (["optim.lr=-1"], ["seed=5"], ["trainer.accumulate_grad_batches=0"]):
        code, _ = cli(
            tiny_overrides(tmp_path, corpus) + bad + [f"hydra.run.dir={run_dir}"], monkeypatch, capsys
        )
        assert code == 2
        assert snapshot(run_dir) == before


def test_another_runs_checkpoint_is_not_resumed_into_a_run_with_checkpoints(
    tmp_path, corpus, monkeypatch, capsys
):
    a = trained_run(tmp_path, corpus, monkeypatch, capsys, "a")
    b = trained_run(tmp_path, corpus, monkeypatch, capsys, "b")
    before = snapshot(a)
    args = tiny_overrides(tmp_path, corpus) + [
        f"ckpt_path={b / 'checkpoints' / 'last.ckpt'}",
        f"hydra.run.dir={a}",
    ]
    code, err = cli(args, monkeypatch, capsys)
    assert (
        code == 2 and "is another run's checkpoint, and resuming it into" in err and "overwrite=true" in err
    )
    assert snapshot(a) == before
    code, err = cli(args + ["trainer.max_steps=30", "overwrite=true"], monkeypatch, capsys)
    assert code == 0, err  # asked for


def test_a_second_process_is_refused_while_a_run_holds_its_directory(tmp_path, corpus, monkeypatch, capsys):
    from rope_llama.training.run_dir import RunLock

    run_dir = tmp_path / "busy"
    lock = RunLock(run_dir).acquire()  # as the first process holds it, for its lifetime
    try:
        code, err = cli(tiny_overrides(tmp_path, corpus) + [f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
        assert code == 2 and err.strip() == (
            f"error: {run_dir} is in use by another training process (it holds {lock.path}); wait for it to "
            "finish or choose another run_name."
        )
        assert not run_dir.exists()
    finally:
        lock.release()
    assert not lock.path.exists()
    trained_run(tmp_path, corpus, monkeypatch, capsys, "busy")  # free again


def test_a_link_to_a_running_runs_directory_takes_that_runs_lock(tmp_path, corpus, monkeypatch, capsys):
    """run_name=alias, a symbolic link to runs/busy: the directory is resolved before its lock is taken, so
    the run that holds runs/busy refuses it (the link's own lock name, .alias.lock, once let it train there)."""
    from rope_llama.training.run_dir import RunLock

    busy = tmp_path / "runs" / "busy"
    (busy / "checkpoints").mkdir(parents=True)
    (busy / "checkpoints" / "last.ckpt").write_bytes(b"the running run's")
    (tmp_path / "runs" / "alias").symlink_to("busy")
    monkeypatch.chdir(tmp_path)  # runs/ is relative to the working directory
    before = tree(tmp_path / "runs")
    lock = RunLock(busy).acquire()
    try:
        code, err = cli(tiny_overrides(tmp_path, corpus) + ["run_name=alias"], monkeypatch, capsys)
    finally:
        lock.release()
    assert code == 2 and err.strip() == (
        f"error: {busy} is in use by another training process (it holds {lock.path}); wait for it to "
        "finish or choose another run_name."
    )
    assert tree(tmp_path / "runs") == before  # the lock released, nothing else added


@pytest.mark.parametrize("inside", ["checkpoints/new", "eval", None])
def test_a_run_inside_another_run_or_into_the_runs_folder_is_refused(
    inside, tmp_path, corpus, monkeypatch, capsys
):
    """hydra.run.dir inside another run's directory (its checkpoints/ or beside them), or the folder of runs
    itself (None), is refused in one sentence before anything is created or written."""
    other = tmp_path / "runs" / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.ckpt").write_bytes(b"the other run's")
    run_dir = tmp_path / "runs" if inside is None else other / inside
    before = tree(tmp_path / "runs")
    code, err = cli(tiny_overrides(tmp_path, corpus) + [f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    if inside is None:
        message = (
            f"error: The run directory {run_dir} holds other runs' directories (a folder of runs, such as "
        )
    else:
        message = (
            f"error: The run directory {run_dir} is inside the run directory {other} (it holds checkpoints/"
        )
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert tree(tmp_path / "runs") == before and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["", "/abs/path", "a/b", "..", "-x"])
def test_run_name_must_be_a_plain_name(name, tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # runs/ is relative to the working directory
    code, err = cli(tiny_overrides(tmp_path, corpus) + [f"run_name={name}"], monkeypatch, capsys)
    assert code == 2 and f"error: run_name={name!r} is not a plain name;" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ----------------------------------------------------------------------------- one-sentence errors


def cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """train.main() exactly as the command line runs it (Hydra parsing included), in this process."""
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    try:
        train_py.main()
    except SystemExit as exit_:
        return exit_.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


BAD_INPUT = {
    "unknown group option": (["model=huge"], "Could not find 'model/huge'"),
    "inconsistent shape": (
        ["model.n_heads=4", "model.n_kv_heads=3"],
        "n_heads (4) must be divisible by n_kv_heads (3)",
    ),
    "odd head dim": (["model.d_model=36", "model.n_heads=4"], "head dim d_model/n_heads = 9 must be even"),
    "unknown rope scaling": (
        ["rope.scaling=warp"],
        "rope.scaling must be one of none, linear, ntk, dynamic_ntk, yarn, llama3",
    ),
    "factor < 1": (["rope=linear", "rope.factor=0.5"], "rope.factor must be a finite number in [1, 1048576]"),
    "max_len beyond the data": (["data.max_len=50000"], "max_len"),
    "missing data files": (["data.source.paths=[/nonexistent/*.txt]"], "/nonexistent/*.txt"),
    "missing resume checkpoint": (["ckpt_path=last"], "ckpt_path=last but"),
    "unbounded max_steps": (  # max_epochs bounds Lightning's loop but gives the LR schedule no length
        ["trainer.max_steps=-1", "+trainer.max_epochs=1"],
        "trainer.max_steps must be an integer >= 1, got -1.",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_sentence_and_writes_nothing(case, tmp_path, corpus, monkeypatch, capsys):
    args, sentence = BAD_INPUT[case]
    run_dir = tmp_path / "run"
    code, err = cli(
        tiny_overrides(tmp_path, corpus) + args + [f"hydra.run.dir={run_dir}"], monkeypatch, capsys
    )
    assert code != 0 and sentence in err, err
    assert "Traceback" not in err
    if case != "unknown group option":  # Hydra lists the available options after its sentence
        last = err.strip().splitlines()[-1]  # progress bars of data preparation may come before it
        assert last.startswith("error: ") and sentence in last
    assert not run_dir.exists()


def test_non_utf8_text_is_one_sentence(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "latin1"
    folder.mkdir()
    (folder / "a.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 500)
    overrides = tiny_overrides(tmp_path, str(folder / "*.txt"))
    code, err = cli(overrides + [f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 2 and "UTF-8" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- RoPE properties


@st.composite
def rope_cases(draw):
    head_dim = 2 * draw(st.integers(1, 32))
    rotary_dim = draw(st.one_of(st.none(), st.integers(1, head_dim // 2).map(lambda r: 2 * r)))
    scaling = draw(st.sampled_from(SCALINGS))
    cfg = RopeConfig(
        base=draw(st.sampled_from([100.0, 10000.0, 500000.0])),
        scaling=scaling,
        factor=1.0 if scaling == "none" else draw(st.floats(1.0, 64.0)),
        original_max_len=draw(st.integers(16, 4096)),
        layout=draw(st.sampled_from(["half", "interleaved"])),
        rotary_dim=rotary_dim,
    )
    batch, heads, length = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 40))
    offset = draw(st.sampled_from([0, 1, 777, 50_000, 1_000_000]))
    per_row = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    return cfg, head_dim, (batch, heads, length), offset, per_row, dtype


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rope_cases())
def test_rope_never_crashes_and_preserves_norm_times_attention_factor(case):
    cfg, head_dim, (batch, heads, length), offset, per_row, dtype = case
    if cfg.scaling in ("ntk", "dynamic_ntk") and (cfg.rotary_dim or head_dim) == 2:
        with pytest.raises(ValueError, match="needs a rotary dimension > 2"):  # d/(d-2) is undefined
            RotaryEmbedding(head_dim, cfg)
        return
    rope = RotaryEmbedding(head_dim, cfg)
    x = torch.randn(batch, heads, length, head_dim).to(dtype)
    if per_row:
        ids = offset + torch.arange(length).repeat(batch, 1) + torch.arange(batch)[:, None] * 3
    else:
        ids = offset + torch.arange(length)
    y = rope(x, ids)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()
    rot = rope.rotary_dim
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    expected = x[..., :rot].double().norm(dim=-1) * rope.attention_factor
    torch.testing.assert_close(y[..., :rot].double().norm(dim=-1), expected, rtol=tol, atol=tol)
    assert torch.equal(y[..., rot:], x[..., rot:])


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(
        [
            (dict(scaling="bogus"), ValueError),
            (dict(factor=0.99), ValueError),
            (dict(beta_fast=1.0, beta_slow=1.0), ValueError),
            (dict(low_freq_factor=2.0, high_freq_factor=2.0), ValueError),
            (dict(rotary_dim=3), ValueError),
            (dict(layout="diagonal"), ValueError),
            (dict(base=1.0), ValueError),
        ]
    ),
    st.integers(-5, -1),
)
def test_rope_rejects_invalid_input_with_documented_types(bad, negative):
    kwargs, error = bad
    with pytest.raises(error):
        RopeConfig(**kwargs)
    rope = RotaryEmbedding(8, RopeConfig())
    with pytest.raises(ValueError, match="non-negative"):
        rope(torch.randn(1, 3, 8), torch.tensor([negative, 0, 1]))
    with pytest.raises(TypeError, match="floating-point"):
        rope(torch.ones(1, 3, 8, dtype=torch.int32))


def test_hparams_record_the_runs_own_seed(tmp_path, corpus, monkeypatch, capsys):
    """The data module's own hparams (its `seed` is data.seed) no longer overwrite the run's config."""
    run_dir = tmp_path / "seeded"
    code, err = cli(
        tiny_overrides(tmp_path, corpus) + ["seed=5", f"hydra.run.dir={run_dir}"], monkeypatch, capsys
    )
    assert code == 0, err
    hparams = OmegaConf.load(run_dir / "hparams.yaml")
    assert hparams.seed == 5 and hparams.data.seed != 5
