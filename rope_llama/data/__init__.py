"""Data: text sources (sources.py, markdown.py), the tokenizer (tokenizer.py), the token cache and its shards
(cache.py, shards.py), training position ids (positions.py), recall windows and their wording (recall.py,
templates.py), and the LightningDataModule (datamodule.py).

from rope_llama.data import DataError, TextDataModule, Tokenizer
"""


class DataError(ValueError):
    """A user-facing data problem; the message is one sentence naming the bad value and what is allowed."""


def __getattr__(name: str):
    # Lazy, so `import rope_llama.data.tokenizer` or `.cache` does not pay for importing Lightning (~8 s).
    if name == "TextDataModule":
        from rope_llama.data.datamodule import TextDataModule

        return TextDataModule
    if name == "Tokenizer":
        from rope_llama.data.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'data' has no attribute {name!r}")


__all__ = ["DataError", "TextDataModule", "Tokenizer"]
