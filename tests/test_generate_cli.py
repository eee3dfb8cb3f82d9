"""generate.py as users run it: streaming, prompt files, batches, scoring, stop strings, one-sentence errors."""

import copy
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rope_llama.cli import generate as cli
from rope_llama.core.checkpoint import atomic_torch_save
from rope_llama.inference.generation import (
    Generation,
    TextStream,
    generate,
    score_tokens,
)
from rope_llama.model.rope import RopeConfig
from tests.helpers import L0, ROOT, TEXT, prompt_ids, run_generate_main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """generate.py as a real process (one thread: the tiny model does not need more)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "generate.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def streamed_text(tok, ids: list[int]) -> str:
    stream = TextStream(tok.decode)
    for i in ids:
        stream.push(i)
    stream.finish()
    return stream.text


def test_cli_process_streams_the_engines_text_and_fails_cleanly(run_dir, model, tok):
    """The two things only a real process shows: what reaches stdout/stderr, and the exit code."""
    with ThreadPoolExecutor(2) as pool:  # each run pays the interpreter + torch start-up; overlap them
        single, error = pool.map(
            lambda args: run_cli(f"ckpt={run_dir}", *args),
            [
                ["prompt=ROMEO:", "greedy=true", "max_new_tokens=30", "rope=ntk", "rope.factor=8"],
                ["prompt=x", "top_p=0"],
            ],
        )
    assert single.returncode == 0, single.stderr
    ntk = copy.deepcopy(model)
    ntk.use_positions(RopeConfig(scaling="ntk", factor=8.0, original_max_len=L0))
    expected = streamed_text(tok, generate(ntk, [prompt_ids(tok, "ROMEO:")], 30, eos_id=tok.eos_id).tokens[0])
    assert single.stdout == "ROMEO:" + expected + "\n"
    plain = generate(model, [prompt_ids(tok, "ROMEO:")], 30, eos_id=tok.eos_id).tokens[0]
    assert streamed_text(tok, plain) != expected  # the rope override really applied
    assert "prompt tokens: " in single.stderr and "decode: " in single.stderr and "tokens/s" in single.stderr

    assert error.returncode == 2
    assert error.stderr == "error: top_p must be a finite number in (0, 1], got 0.\n"


def test_cli_prompt_file_batch_and_score(run_dir, model, tok, tmp_path, monkeypatch, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("ROMEO:\nJULIET: O Romeo\n")
    args = [
        f"ckpt={run_dir}",
        f"prompt_file={prompts_file}",
        "greedy=true",
        "max_new_tokens=30",
        "num_samples=2",
    ]
    code, out, _ = run_generate_main(args, monkeypatch, capsys)
    texts = ["ROMEO:", "ROMEO:", "JULIET: O Romeo", "JULIET: O Romeo"]
    rows = generate(model, [prompt_ids(tok, t) for t in texts], 30, eos_id=tok.eos_id).tokens
    expected = "".join(
        f"{'-' * 20} sample {i}\n{t}{streamed_text(tok, r)}\n" for i, (t, r) in enumerate(zip(texts, rows))
    )
    assert code == 0 and out == expected

    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT * 3)
    code, out, _ = run_generate_main(
        [f"ckpt={run_dir}", "mode=score", f"text_file={text_file}", "chunk=16"], monkeypatch, capsys
    )
    losses = score_tokens(model, torch.tensor(prompt_ids(tok, TEXT * 3)), chunk=16)
    overall = next(line for line in out.splitlines() if line.strip().startswith("overall"))
    assert code == 0 and overall.split()[1:3] == [str(losses.numel()), f"{float(losses.double().mean()):.4f}"]
    assert "32..64" in out and "64..128" in out


def corrupt_run(tmp_path: Path, run_dir: Path, what: str) -> Path:
    if what == "corrupt":
        bad = tmp_path / "bad.ckpt"
        bad.write_bytes((run_dir / "checkpoints" / "last.ckpt").read_bytes()[:500])
        return bad
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["tokenizer"] = {"path": str(tmp_path / "gone.json"), "sha256": "0" * 64}
    atomic_torch_save(ckpt, tmp_path / "no_tok" / "last.ckpt")
    return tmp_path / "no_tok" / "last.ckpt"


CLI_ERRORS = {  # args ({CKPT} = the good run dir, ...) -> the sentence on stderr
    "missing checkpoint": (["ckpt=/nonexistent/run", "prompt=x"], "does not exist"),
    "corrupt checkpoint": (["ckpt={CORRUPT}", "prompt=x"], "not a readable PyTorch checkpoint"),
    "missing tokenizer": (["ckpt={NO_TOKENIZER}", "prompt=x"], "tokenizer of"),
    "empty prompt": (["ckpt={CKPT}", "prompt="], "The prompt is empty"),
    "empty prompt line": (["ckpt={CKPT}", "prompt_file={BLANK_LINE}"], "Line 2 of"),
    "cache too small": (["ckpt={CKPT}", "prompt=ROMEO", "max_new_tokens=50", "cache_len=20"], "cache_len=20"),
    "unknown rope scaling": (
        ["ckpt={CKPT}", "prompt=x", "rope=ntk", "rope.scaling=warp"],
        "rope.scaling must be one of none, linear",
    ),
    "top_p": (["ckpt={CKPT}", "prompt=x", "top_p=1.5"], "top_p must be a finite number in (0, 1]"),
    "temperature": (
        ["ckpt={CKPT}", "prompt=x", "temperature=-1"],
        "temperature must be a finite number in [0, 100]",
    ),
    "top_k": (["ckpt={CKPT}", "prompt=x", "top_k=-3"], "top_k must be an integer >= 0"),
    "negative start_pos": (
        ["ckpt={CKPT}", "prompt=ROMEO", "start_pos=-1"],
        "start_pos must be an integer >= 0",
    ),
    "start_pos past int64": (
        ["ckpt={CKPT}", "prompt=ROMEO", "start_pos=9223372036854775800"],
        "past the largest position id 9,223,372,036,854,775,807 (int64); lower start_pos.",
    ),
    "past the RoPE capacity": (  # refused by the RoPE during the prefill: still before the prompt is echoed
        ["ckpt={CKPT}", "prompt=ROMEO", "rope=none", "rope.max_position=8"],
        "beyond the RoPE capacity max_position=8",
    ),
    "max_new_tokens not a number": (
        ["ckpt={CKPT}", "prompt=ROMEO", "max_new_tokens=many"],
        "max_new_tokens must be an integer >= 1, got 'many'.",
    ),
    "cache_len not a number": (
        ["ckpt={CKPT}", "prompt=ROMEO", "cache_len=big"],
        "cache_len must be an integer",
    ),
    "num_samples": (
        ["ckpt={CKPT}", "prompt=ROMEO", "num_samples=two"],
        "num_samples must be an integer >= 1",
    ),
    "score chunk": (
        ["ckpt={CKPT}", "mode=score", "text_file={BLANK_LINE}", "chunk=0"],
        "chunk must be an integer",
    ),
}


@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_cli_errors_are_one_sentence(case, run_dir, tmp_path, monkeypatch, capsys):
    paths = {"CKPT": run_dir, "CORRUPT": corrupt_run(tmp_path, run_dir, "corrupt")}
    paths["NO_TOKENIZER"] = corrupt_run(tmp_path, run_dir, "tok")
    paths["BLANK_LINE"] = tmp_path / "prompts.txt"
    paths["BLANK_LINE"].write_text("ROMEO:\n\nJULIET:\n")
    args, sentence = CLI_ERRORS[case]
    args = [a.format(**paths) for a in args]
    code, out, err = run_generate_main(args, monkeypatch, capsys)
    assert code == 2, err
    assert out == ""  # a refusal prints no prompt before it
    assert err.startswith("error: ") and sentence in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_stop_string(run_dir, model, tok, monkeypatch, capsys):
    assert cli.unescape(r"a\n\nb\tc\\n é") == "a\n\nb\tc\\n é"  # how stop='["\n\n"]' reaches the engine
    text = streamed_text(tok, generate(model, [prompt_ids(tok, "ROMEO:")], 30, eos_id=tok.eos_id).tokens[0])
    # a random model's text: a 2-letter string that does not occur earlier, though one of its letters does
    # (so a string split into single-letter stop strings would cut earlier)
    cut = next(
        i
        for i in range(5, len(text) - 2)
        if text[i : i + 2].isalnum()
        and text.find(text[i : i + 2]) == i
        and min(text.find(c) for c in text[i : i + 2]) < i
    )
    args = [
        f"ckpt={run_dir}",
        "prompt=ROMEO:",
        "greedy=true",
        "max_new_tokens=30",
        f"stop=[{text[cut : cut + 2]}]",
    ]
    code, out, _ = run_generate_main(args, monkeypatch, capsys)
    assert code == 0 and out == "ROMEO:" + text[:cut] + "\n"
    code, out, _ = run_generate_main(
        args[:-1] + [f"stop={text[cut : cut + 2]}"], monkeypatch, capsys
    )  # a string, not a list
    assert code == 0 and out == "ROMEO:" + text[:cut] + "\n"
    code, out, _ = run_generate_main(args + ["compile=true"], monkeypatch, capsys)  # CompiledStep
    assert code == 0 and out == "ROMEO:" + text[:cut] + "\n"
    code, out, _ = run_generate_main(args + ["native=true"], monkeypatch, capsys)  # NativeStep
    assert code == 0 and out == "ROMEO:" + text[:cut] + "\n"


def test_cli_places_the_text_at_a_far_start_pos(run_dir, model, tok, tmp_path, monkeypatch, capsys):
    """start_pos=10^12 samples and scores: nothing is sized by the position (a table up to it: terabytes)."""
    far = generate(model, [prompt_ids(tok, "ROMEO:")], 20, eos_id=tok.eos_id, start_pos=10**12).tokens[0]
    args = [f"ckpt={run_dir}", "prompt=ROMEO:", "greedy=true", "max_new_tokens=20", "start_pos=1000000000000"]
    code, out, err = run_generate_main(args, monkeypatch, capsys)
    assert code == 0, err
    assert out == "ROMEO:" + streamed_text(tok, far) + "\n"
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    args = [f"ckpt={run_dir}", "mode=score", f"text_file={text_file}", "start_pos=1000000000000"]
    code, out, err = run_generate_main(args, monkeypatch, capsys)
    assert code == 0, err
    assert "549755813888..1099511627776" in out  # the bucket [32 * 2^34, 32 * 2^35) holds 10^12


def test_cli_echoes_the_prompt_when_nothing_is_generated(run_dir, monkeypatch, capsys):
    """The prompt is echoed with the first new text; an eos as the first token still shows it."""
    monkeypatch.setattr(cli, "generate", lambda *args, **kwargs: Generation([[]], 3, 0.1, 0, 0.1))
    code, out, _ = run_generate_main([f"ckpt={run_dir}", "prompt=ROMEO:"], monkeypatch, capsys)
    assert code == 0 and out == "ROMEO:\n"


def test_cli_unknown_rope_group_is_a_config_error(run_dir, monkeypatch, capsys):
    """Hydra rejects rope=<unknown> while composing, before main: non-zero, the options listed."""
    code, _, err = run_generate_main([f"ckpt={run_dir}", "prompt=x", "rope=warp"], monkeypatch, capsys)
    assert code != 0 and "Could not find 'rope/warp'" in err and "yarn" in err
    assert "Traceback" not in err
