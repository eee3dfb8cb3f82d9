"""Hugging Face export/import: transformers reproduces our logits, greedy tokens and tokenizer exactly."""

import json
import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rope_llama.cli.export_hf import export, main
from rope_llama.cli.import_hf import import_hf
from rope_llama.core.checkpoint import file_sha256, load_checkpoint
from rope_llama.data.tokenizer import train_tokenizer
from rope_llama.inference.generation import GREEDY, generate
from rope_llama.inference.loading import load_model
from rope_llama.model.rope import RopeConfig
from tests.helpers import L0, ROOT, ROPES, write_checkpoint


@pytest.mark.parametrize("name", list(ROPES))
def test_transformers_matches_logits_greedy_and_round_trip(name, tmp_path, macbeth_tokenizer, macbeth):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES[name], tie=name != "yarn")
    out = export(ckpt, tmp_path / "hf")
    ours = load_checkpoint(ckpt).model
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.vocab_size == 320

    idx = torch.randint(0, 320, (2, 3 * L0))  # beyond the original length: every scaling is active
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-4, rtol=0)

    # HF's dynamic scaling re-derives the base at every decoding step (cached keys keep older ones);
    # ours fixes it for the whole generation, so the two agree while the text fits the original length.
    prompt_len, new = (8, 20) if name == "dynamic_ntk" else (16, 24)
    prompt = [macbeth_tokenizer.bos_id, *macbeth_tokenizer.encode(macbeth[5000:6000])[: prompt_len - 1]]
    hf.generation_config.eos_token_id = None  # no early stop on either side: compare `new` tokens
    mine = generate(ours, [prompt], new, GREEDY, eos_id=None).tokens[0]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, prompt_len:]
    assert len(mine) == new and len(set(mine)) > 3  # a real, non-degenerate sequence
    assert theirs.tolist() == mine

    back = import_hf(out, tmp_path / "imported" / "model.ckpt")
    imported = load_checkpoint(back)
    assert imported.config.to_dict() | {"ffn_multiple_of": 64} == ours.config.to_dict() | {
        "ffn_multiple_of": 64
    }
    original = ours.state_dict()
    assert imported.model.state_dict().keys() == original.keys()
    for key, tensor in imported.model.state_dict().items():
        assert torch.equal(tensor, original[key]), key
    assert imported.config.lengths == ours.config.lengths
    assert file_sha256(imported.tokenizer_file()) == file_sha256(out / "tokenizer.json")


def test_auto_tokenizer_encodes_and_decodes_like_ours(tmp_path, macbeth_tokenizer, macbeth):
    out = export(write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"]), tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(out)
    passage = macbeth[60000:62000] + " naïve café — ünïcode\n\n\tend"  # held out from tokenizer training
    ids = macbeth_tokenizer.encode(passage)
    assert hf(passage, add_special_tokens=False)["input_ids"] == ids
    assert hf(passage)["input_ids"] == [macbeth_tokenizer.bos_id, *ids]  # bos prepended, as generate.py does
    assert hf.decode(ids) == macbeth_tokenizer.decode(ids) == passage
    assert (hf.bos_token_id, hf.eos_token_id) == (macbeth_tokenizer.bos_id, macbeth_tokenizer.eos_id)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (
        macbeth_tokenizer.bos_id,
        macbeth_tokenizer.eos_id,
    )


def test_imported_checkpoint_runs_in_generate_py(tmp_path, macbeth_tokenizer):
    out = export(write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["yarn"]), tmp_path / "hf")
    ckpt = import_hf(out, tmp_path / "imported" / "model.ckpt")
    loaded, tok = load_model(str(ckpt), device="cpu")  # what generate.py loads
    assert tok.sha256 == file_sha256(out / "tokenizer.json")
    assert len(generate(loaded.model, [[tok.bos_id, 5, 6]], 4).tokens[0]) == 4


def test_refuses_to_overwrite_and_import_refuses_biases(tmp_path, macbeth_tokenizer):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"])
    out = export(ckpt, tmp_path / "hf")
    with pytest.raises(ValueError, match="not empty; pass overwrite=true"):
        export(ckpt, out)
    assert export(ckpt, out, overwrite=True) == out and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temp dirs left behind
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        import_hf(out, tmp_path / "imported.ckpt")
    (out / "config.json").write_text(json.dumps(config | {"rope_parameters": LONGROPE}))
    with pytest.raises(ValueError, match="rope_type 'longrope' has no equivalent"):
        import_hf(out, tmp_path / "imported.ckpt")
    assert not (tmp_path / "imported.ckpt").exists()


LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


def run_export(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "export_hf.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_exports_a_checkpoint_file(tmp_path, macbeth_tokenizer):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["ntk"])
    result = run_export(f"ckpt={ckpt}", f"out={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    assert "static ntk exported as plain RoPE" in result.stdout
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names


def test_cli_refuses_partial_rotary_dim_and_writes_nothing(tmp_path, macbeth_tokenizer, monkeypatch, capsys):
    ckpt = write_checkpoint(
        tmp_path / "run", macbeth_tokenizer, RopeConfig(rotary_dim=8, original_max_len=L0)
    )
    argv = ["export_hf.py", f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"]
    monkeypatch.setattr(
        sys, "argv", argv
    )  # the Hydra entry point in-process: a second subprocess costs ~15 s
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: transformers' Llama rotates the whole head; rotary_dim=8")
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_export_refuses_an_out_that_overlaps_the_checkpoint_run(
    tmp_path, macbeth_tokenizer, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    ckpt = write_checkpoint(run_dir / "checkpoints", macbeth_tokenizer, ROPES["none"])
    before = ckpt.read_bytes()
    (tmp_path / "link").symlink_to(run_dir)
    monkeypatch.setattr(sys, "argv", ["export_hf.py", f"ckpt={run_dir}", f"out={run_dir}", "overwrite=true"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: out={run_dir} is inside the run directory {run_dir} (it holds checkpoints/ or .hydra/); exports "
        "never write into a run directory: choose a path outside it.\n"
    )
    for out in (tmp_path / "link", run_dir / "checkpoints", run_dir / "hf"):  # is (a link to), inside
        with pytest.raises(ValueError, match=f"is inside the run directory {run_dir} "):
            export(ckpt, out, overwrite=True)
    with pytest.raises(ValueError, match=f"would replace {ckpt}, the checkpoint being exported"):
        export(ckpt, tmp_path, overwrite=True)  # above it
    assert ckpt.read_bytes() == before and sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]


def test_exports_never_write_into_another_run_directory(tmp_path, macbeth_tokenizer):
    """Not even with overwrite=true: a run directory is any folder holding checkpoints/ or .hydra/."""
    from rope_llama.cli.export_gguf import export as export_gguf

    ckpt = write_checkpoint(tmp_path / "a" / "checkpoints", macbeth_tokenizer, ROPES["none"])
    other = tmp_path / "b"
    (other / ".hydra").mkdir(parents=True)
    (other / "tokenizer.json").write_text("the other run's tokenizer")
    for out, exporter in (
        (other, export),
        (other / "tokenizer.json", export_gguf),
        (other / "x" / "m.gguf", export_gguf),
    ):
        with pytest.raises(ValueError, match=f"is inside the run directory {other} "):
            exporter(ckpt, out, overwrite=True)
    assert (other / "tokenizer.json").read_text() == "the other run's tokenizer"
    assert sorted(p.name for p in other.iterdir()) == [".hydra", "tokenizer.json"]


def test_overwrite_replaces_only_the_files_export_writes(tmp_path, macbeth_tokenizer):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    (out / "config.json").write_text("{}")  # a stale export
    export(write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"]), out, overwrite=True)
    assert (out / "README.md").read_text() == "my notes\n"
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 320
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temp dirs left behind


def test_overwrite_no_means_no(tmp_path, macbeth_tokenizer):
    """overwrite=no reached the exporters as a non-empty string, which meant yes: an existing export was
    replaced. Every exporter and importer takes a real bool only."""
    from rope_llama.cli.export_gguf import export as export_gguf
    from rope_llama.cli.import_gguf import import_gguf

    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"])
    hf = export(ckpt, tmp_path / "hf")
    files = {p.name: p.read_bytes() for p in hf.iterdir()}
    for write in (
        lambda: export(ckpt, hf, overwrite="no"),
        lambda: export_gguf(ckpt, tmp_path / "m.gguf", overwrite="no"),
        lambda: import_hf(hf, tmp_path / "m.ckpt", overwrite="no"),
        lambda: import_gguf(tmp_path / "m.gguf", tmp_path / "imported", overwrite="no"),
    ):
        with pytest.raises(ValueError, match=r"^overwrite must be true or false, got 'no'\.$"):
            write()
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


def test_import_never_writes_into_a_run_directory(tmp_path, macbeth_tokenizer):
    """import_hf out=<run>/checkpoints/last.ckpt overwrite=true replaced that run's last.ckpt with a
    weights-only checkpoint it cannot resume from (and its tokenizer.json beside it)."""
    hf = export(write_checkpoint(tmp_path / "a", macbeth_tokenizer, ROPES["none"]), tmp_path / "hf")
    run = tmp_path / "run"
    last = write_checkpoint(run / "checkpoints", macbeth_tokenizer, ROPES["none"]).rename(
        run / "checkpoints" / "last.ckpt"
    )
    before = last.read_bytes()
    for out in (last, run / "model.ckpt", run / "checkpoints" / "sub" / "x.ckpt"):
        with pytest.raises(ValueError, match=f"^out={out} is inside the run directory {run} "):
            import_hf(hf, out, overwrite=True)
    assert last.read_bytes() == before and [p.name for p in (run / "checkpoints").iterdir()] == ["last.ckpt"]
    assert [p.name for p in run.iterdir()] == ["checkpoints"]


def test_a_staged_result_is_moved_in_whole_or_not_at_all(tmp_path):
    """What every results directory is written through: a failure inside the block leaves `out` as it was
    and no staging folder; success moves the files in, keeping the other files of a non-empty `out`."""
    from rope_llama.interchange.destination import staged

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("earlier")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="killed"):
        with staged(out) as folder:
            (folder / "results.csv").write_text("half")
            raise RuntimeError("killed")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"results.csv": "earlier", "notes.txt": "mine"}
    with staged(out) as folder:
        (folder / "results.csv").write_text("new")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"results.csv": "new", "notes.txt": "mine"}
    with staged(tmp_path / "fresh") as folder:
        (folder / "a.csv").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]  # no staging folder left


def import_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    from rope_llama.cli.import_hf import main as import_main

    monkeypatch.setattr(sys, "argv", ["import_hf.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        import_main()
    return exit_info.value.code, capsys.readouterr().err


def test_import_refuses_a_corrupt_safetensors_file_in_one_sentence(
    tmp_path, macbeth_tokenizer, monkeypatch, capsys
):
    hf = export(write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"]), tmp_path / "hf")
    weights = hf / "model.safetensors"
    complete = weights.read_bytes()
    for damaged in (
        complete[: len(complete) // 2],
        bytes(random.Random(0).randrange(256) for _ in range(4096)),
    ):
        weights.write_bytes(damaged)
        code, err = import_cli(monkeypatch, capsys, f"hf_dir={hf}", f"out={tmp_path / 'imported' / 'm.ckpt'}")
        assert code == 2 and err.startswith(f"error: {weights} is not a readable safetensors file"), err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "imported").exists()


def test_import_refuses_an_out_inside_the_directory_it_reads(
    tmp_path, macbeth_tokenizer, monkeypatch, capsys
):
    hf = export(write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"]), tmp_path / "hf")
    files = {p.name: p.read_bytes() for p in hf.iterdir()}
    for out in (hf / "model.safetensors", hf, tmp_path):  # inside, is, above
        code, err = import_cli(monkeypatch, capsys, f"hf_dir={hf}", f"out={out}", "overwrite=true")
        assert code == 2 and err == (
            f"error: out={out} overlaps hf_dir={hf}, the directory being imported; write the checkpoint "
            "outside it.\n"
        )
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == files


def test_import_writes_nothing_when_the_tokenizer_is_larger_than_the_model(
    tmp_path, macbeth_tokenizer, macbeth
):
    hf = export(write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"]), tmp_path / "hf")
    train_tokenizer([macbeth[:40000]], vocab_size=400, path=str(hf / "tokenizer.json"))
    with pytest.raises(ValueError, match="The tokenizer has 400 tokens but the model only 320"):
        import_hf(hf, tmp_path / "imported" / "model.ckpt")
    assert not (tmp_path / "imported").exists()
