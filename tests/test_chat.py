"""An instruct model's tokenizer config: prompts without bos when it says so, its chat template, and
generation stopping at its end of turn."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken

from rope_llama.data import DataError
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import GREEDY, generate
from tests.helpers import run_generate_main, save_run, text_tokenizer, tiny

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def instruct_tokenizer(folder, template: str | None = TEMPLATE) -> Tokenizer:
    """The test tokenizer with <|im_start|> / <|im_end|> added and a transformers-style config beside it."""
    base = text_tokenizer(folder)
    base.hf.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    base.hf.save(str(folder / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>"}, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config | ({"chat_template": template} if template else {}))
    )
    return Tokenizer(str(folder / "tokenizer.json"))


def test_the_config_sets_bos_end_of_turn_and_the_template(tmp_path):
    tok = instruct_tokenizer(tmp_path)
    end = tok.hf.token_to_id("<|im_end|>")
    assert tok.end_of_turn_id == end and tok.stop_ids == {tok.eos_id, end}
    assert tok.prompt_ids("To be") == tok.encode("To be")  # add_bos_token false: no bos
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok.hf.token_to_id("<|im_start|>") and end in ids  # special tokens parsed, not spelled
    (tmp_path / "plain").mkdir()
    plain = text_tokenizer(tmp_path / "plain")
    assert plain.prompt_ids("To be")[0] == plain.bos_id and plain.stop_ids == {plain.eos_id}
    with pytest.raises(DataError, match="has no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_generation_stops_at_any_stop_id(tmp_path):
    tok = text_tokenizer(tmp_path)
    model = tiny(tok.vocab_size)
    prompt = tok.prompt_ids("To be, or not")
    free = generate(model, [prompt], 8, GREEDY).tokens[0]
    stopped = generate(model, [prompt], 8, GREEDY, eos_id={tok.eos_id, free[3]}).tokens[0]
    assert stopped == free[: free.index(free[3])]  # stops at the first sample of a stop id, without it


def test_chat_cli_wraps_the_prompt_and_refuses_a_tokenizer_without_template(tmp_path, monkeypatch, capsys):
    (tmp_path / "run").mkdir()
    tok = instruct_tokenizer(tmp_path / "run")
    run = save_run(tiny(tok.vocab_size), tok, tmp_path / "run")
    args = [f"ckpt={run}", "prompt=Hi", "chat=true", "greedy=true", "max_new_tokens=4", "stream=false"]
    code, out, _ = run_generate_main(args, monkeypatch, capsys)
    assert code == 0 and out.startswith("Hi")
    (tmp_path / "run" / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    code, _, err = run_generate_main(args, monkeypatch, capsys)
    assert code == 2 and "chat=true: The tokenizer" in err and "has no chat template" in err
    code, _, err = run_generate_main([*args[:-1], "chat=maybe"], monkeypatch, capsys)
    assert code == 2 and "chat must be true or false, got 'maybe'." in err
