"""Checkpoint files: safe loading (a crafted pickle is refused by the loader and by every entry point,
without running its code), atomic saves that keep the previous file (a failed write, a full disk), and one
sentence for a wrong shape, a truncated or foreign file, or a newer format; older formats load, and a
run's own tokenizer copy stands in for an unreadable recorded one. Kills and signals: test_reliability.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rope_llama.core.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    atomic_torch_save,
    load_checkpoint,
    safe_load,
    weights_checkpoint,
)
from rope_llama.model.config import TrainedLengths
from tests.helpers import L0, crafted_checkpoint, refusal, text_tokenizer, tiny


def test_atomic_save_failure_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "c.ckpt"
    atomic_torch_save({"v": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_torch_save({"v": 2, "x": Unpicklable()}, path)
    assert safe_load(path) == {"v": 1} and [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]


def test_crafted_checkpoint_is_refused_without_running_code(tmp_path):
    path, marker = crafted_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as info:
        safe_load(path)
    assert str(info.value) == refusal(path)
    assert not marker.exists()


def run_hydra_main(main, argv: list[str], monkeypatch, capfd) -> tuple[int, str]:
    """A Hydra entry point exactly as its command line runs it, in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["entry_point.py", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code, capfd.readouterr().err


def generate_cli(path: Path, tmp_path: Path, monkeypatch, capfd) -> tuple[int, str]:
    from rope_llama.cli import generate

    return run_hydra_main(generate.main, [f"ckpt={path}", "prompt=ROMEO:"], monkeypatch, capfd)


def export_cli(path: Path, tmp_path: Path, monkeypatch, capfd) -> tuple[int, str]:
    from rope_llama.cli import export_hf

    return run_hydra_main(export_hf.main, [f"ckpt={path}", f"out={tmp_path / 'hf'}"], monkeypatch, capfd)


def eval_cli(path: Path, tmp_path: Path, monkeypatch, capfd) -> tuple[int, str]:
    from rope_llama.cli import eval_extrapolation

    argv = [f"ckpt={path}", f"out={tmp_path / 'eval'}", "lengths=[32]"]
    return run_hydra_main(eval_extrapolation.main, argv, monkeypatch, capfd)


def passkey_cli(path: Path, tmp_path: Path, monkeypatch, capfd) -> tuple[int, str]:
    from rope_llama.cli import passkey

    argv = [f"ckpt={path}", f"out={tmp_path / 'passkey'}", "lengths=[32]"]
    return run_hydra_main(passkey.main, argv, monkeypatch, capfd)


def study_cli(path: Path, tmp_path: Path, monkeypatch, capfd) -> tuple[int, str]:
    from rope_llama.cli import study

    with pytest.raises(
        SystemExit
    ) as info:  # its first step evaluates base_ckpt in a subprocess (on the terminal)
        study.main([f"out={tmp_path / 'study'}", f"base_ckpt={path}", "seeds=1", "smoke=true", "jobs=1"])
    return info.value.code, capfd.readouterr().err


ENTRY_POINTS = {
    "generate.py": generate_cli,
    "export_hf.py": export_cli,
    "eval_extrapolation.py": eval_cli,
    "passkey.py": passkey_cli,
    "study.py base_ckpt": study_cli,
}


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_every_entry_point_refuses_a_crafted_checkpoint(entry_point, tmp_path, monkeypatch, capfd):
    path, marker = crafted_checkpoint(tmp_path)
    code, err = ENTRY_POINTS[entry_point](path, tmp_path, monkeypatch, capfd)
    assert code == 2 and f"error: {refusal(path)}" in err.splitlines(), err
    assert "Traceback" not in err and not marker.exists()


def test_a_full_disk_is_one_sentence_and_keeps_the_previous_file(tmp_path, monkeypatch):
    from rope_llama.core import checkpoint

    path = tmp_path / "last.ckpt"
    checkpoint.atomic_torch_save({"step": 1}, path)

    def full(obj, f):  # what torch's zip writer raises when the disk fills mid-write
        f.write(b"partial")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file"
        )

    monkeypatch.setattr(checkpoint.torch, "save", full)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: shutil_usage(free=1024))
    with pytest.raises(checkpoint.DiskFullError) as info:
        checkpoint.atomic_torch_save({"step": 2}, path)
    assert str(info.value) == (
        f"No space left on the disk of {tmp_path} (1.0 KiB free) while writing last.ckpt; {path} keeps its "
        "previous content. Free some space and run again."
    )
    assert checkpoint.safe_load(path) == {"step": 1} and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: shutil_usage(free=2**40))
    with pytest.raises(RuntimeError, match="PytorchStreamWriter"):  # with space left it is not a full disk
        checkpoint.atomic_torch_save({"step": 2}, path)


def shutil_usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(2**41, 2**41 - free, free)


def test_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    from rope_llama.model.config import ModelConfig
    from rope_llama.model.llama import Llama

    small = ModelConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=64, lengths=8
    )
    path = tmp_path / "mismatch.ckpt"
    atomic_torch_save(  # weights of a 32-wide model under the config of a 48-wide one
        {
            "state_dict": {"model." + k: v for k, v in Llama(small).state_dict().items()},
            "model_config": small.to_dict() | {"d_model": 48},
        },
        path,
    )
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value).startswith(
        f"{path} weights do not match its model_config: tensor 'embed.weight' has shape [64, 32] in the "
        "checkpoint but [64, 48] in the model (and "
    )
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_weights_are_one_sentence(tmp_path, bad):
    from rope_llama.model.config import ModelConfig
    from rope_llama.model.llama import Llama

    model = Llama(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, lengths=8))
    path = tmp_path / "diverged.ckpt"
    atomic_torch_save(weights_checkpoint(model, None), path)
    load_checkpoint(path)  # finite: loads
    with torch.no_grad():
        model.blocks[0].mlp.down_proj.weight[0, 0] = bad
    atomic_torch_save(weights_checkpoint(model, None), path)
    with pytest.raises(
        CheckpointError, match=r"holds non-finite weights \(nan or inf\) in 'blocks.0.mlp.down_proj.weight'"
    ):
        load_checkpoint(path)


def test_truncated_and_foreign_files_give_one_sentence(tmp_path):
    good = tmp_path / "good.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.ones(1000)}}, good)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "notes.ckpt"
    foreign.write_text("these are my notes, not a checkpoint\n")
    for path in (truncated, foreign):
        with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint") as info:
            safe_load(path)
        assert "\n" not in str(info.value)


def test_checkpoint_of_format_1_loads_and_a_newer_one_is_refused(tmp_path):
    """Format 1 (no `format_version` entry) named the training length `train_max_len`, format 2 `max_len`;
    format 3 records both trained lengths in model_config. An older one's length becomes both."""
    tok = text_tokenizer(tmp_path)
    ckpt = weights_checkpoint(tiny(tok.vocab_size, lengths=TrainedLengths(L0, 4 * L0)), tok)
    assert ckpt["format_version"] == 3 and "max_len" not in ckpt
    assert ckpt["model_config"]["lengths"] == {"trained_len": L0, "context_len": 4 * L0}
    atomic_torch_save(ckpt, tmp_path / "v3.ckpt")
    assert load_checkpoint(tmp_path / "v3.ckpt").config.lengths == TrainedLengths(L0, 4 * L0)
    older = {k: v for k, v in ckpt.items() if k != "format_version"}
    older["model_config"] = {k: v for k, v in ckpt["model_config"].items() if k != "lengths"}
    for version, entry in ((None, "train_max_len"), (2, "max_len")):
        old = older | {entry: 2 * L0} | ({"format_version": version} if version else {})
        atomic_torch_save(old, tmp_path / f"v{version}.ckpt")
        loaded = load_checkpoint(tmp_path / f"v{version}.ckpt")  # not the RoPE's original_max_len
        assert loaded.config.lengths == TrainedLengths(2 * L0, 2 * L0) and loaded.context_len == 2 * L0
    newer = tmp_path / "newer.ckpt"
    atomic_torch_save(ckpt | {"format_version": FORMAT_VERSION + 1}, newer)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(newer)
    assert str(info.value) == (
        f"{newer} is in checkpoint format {FORMAT_VERSION + 1}, but this code reads formats up to {FORMAT_VERSION}; "
        "use the version of this project that wrote it."
    )


def test_an_unreadable_recorded_tokenizer_falls_back_to_the_copy_beside_the_run(tmp_path, monkeypatch):
    from rope_llama.core import checkpoint

    (tmp_path / "elsewhere").mkdir()
    tok = text_tokenizer(tmp_path / "elsewhere")  # the recorded path
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    atomic_torch_save(weights_checkpoint(tiny(tok.vocab_size), tok), run / "checkpoints" / "last.ckpt")
    (run / "tokenizer.json").write_bytes(Path(tok.path).read_bytes())  # what train.py copies there
    real = checkpoint.file_sha256

    def unreadable(path):
        if Path(path) == Path(tok.path).resolve():
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(checkpoint, "file_sha256", unreadable)
    assert load_checkpoint(run / "checkpoints" / "last.ckpt").tokenizer_file() == run / "tokenizer.json"
