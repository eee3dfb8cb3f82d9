"""Byte-level BPE tokenizer: train one with `tokenizers`, or load any tokenizer.json.

    tok = train_tokenizer(train_docs, vocab_size=4096, path="cache/tokenizer.json")
    tok = Tokenizer.from_file("cache/tokenizer.json")
    ids = tok.encode("To be, or not to be")     # list[int], no special tokens added
    tok.decode(ids) == "To be, or not to be"    # exact round trip: byte-level, no normalizer

Special tokens: BOS = "<|bos|>" starts every document, EOS = "<|eos|>" ends it (ids 0, 1 when trained here).
An imported tokenizer (scripts/import_gguf.py) may have a `tokenizer_config.json` beside it, in transformers'
format: its `add_bos_token` says whether prompts start with bos, its `eos_token` is the end of an instruct
model's turn (generation stops there too) and its `chat_template` wraps a prompt (`apply_chat_template`).
"""

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rope_llama.data import DataError

BOS, EOS = "<|bos|>", "<|eos|>"
# Names other tokenizer.json files use for the same roles, tried in order when BOS/EOS are absent.
_BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "<|endoftext|>")
_EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<|endoftext|>")


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` loaded from a tokenizer.json file."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        with open(self.path, "rb") as f:
            raw = f.read()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self.hf = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the tokenizers library raises a bare Exception for malformed JSON
            raise DataError(f"{self.path} is not a readable tokenizer.json ({e}).") from None
        self.bos_id = self._find(_BOS_NAMES, "BOS")
        self.eos_id = self._find(_EOS_NAMES, "EOS")
        config = read_tokenizer_config(self.path)
        self.add_bos = bool(config.get("add_bos_token", True))  # prompts start with bos, as documents do
        self.chat_template: str | None = config.get("chat_template")
        turn = config.get("eos_token")
        turn = turn.get("content") if isinstance(turn, dict) else turn
        self.end_of_turn_id = None if turn is None else self.hf.token_to_id(turn)

    @property
    def stop_ids(self) -> set[int]:
        """The ids generation stops at: eos, and an instruct model's end of turn."""
        return {self.eos_id} | ({self.end_of_turn_id} if self.end_of_turn_id is not None else set())

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt's ids: bos first unless the tokenizer's config says its model takes none."""
        return [self.bos_id, *self.encode(text)] if self.add_bos else self.encode(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """`messages` ([{"role", "content"}]) as the chat template renders them (jinja2, sandboxed, as
        transformers renders it); one sentence when the tokenizer has no template."""
        if not self.chat_template:
            raise DataError(
                f"The tokenizer {self.path} has no chat template (tokenizer_config.json beside it)."
            )
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise DataError(f"The chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        if not os.path.isfile(path):
            raise DataError(
                f"tokenizer file {path!r} does not exist; give a tokenizer.json path or null to train one."
            )
        return cls(path)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in parallel (Rust threads); the fast variant skips character offsets, which
        nothing here reads (twice the speed on long documents)."""
        return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _find(self, names: tuple[str, ...], role: str) -> int:
        for name in names:
            if (i := self.hf.token_to_id(name)) is not None:
                return i
        raise DataError(f"tokenizer {self.path!r} has no {role} token; it needs one of {list(names)}.")


def read_tokenizer_config(path: str) -> dict:
    """The `tokenizer_config.json` beside a tokenizer.json ({} when there is none); a damaged one is one
    sentence."""
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if not os.path.isfile(config):
        return {}
    try:
        with open(config, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{config} is not a readable tokenizer config ({e}).") from None
    if not isinstance(values, dict):
        raise DataError(f"{config} holds a {type(values).__name__}, not a JSON object.")
    return values


def train_tokenizer(docs: Iterable[str], vocab_size: int, path: str) -> Tokenizer:
    """Train a byte-level BPE on `docs` and save it atomically to `path`; deterministic for the same input."""
    if vocab_size < 256 + 2:
        raise DataError(
            f"vocab_size {vocab_size} is too small; byte-level BPE needs at least 258 (256 bytes, BOS, EOS)."
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # no normalizer: exact round trip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable, even unseen ones
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False, encoding="utf-8") as f:
        f.write(tok.to_str())
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)
    return Tokenizer(path)
