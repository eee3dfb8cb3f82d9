"""Text sources, tokenizer, token cache and the LightningDataModule.

from data import DataError, TextDataModule, Tokenizer
"""


class DataError(ValueError):
    """A user-facing data problem; the message is one sentence naming the bad value and what is allowed."""


from data.datamodule import TextDataModule  # noqa: E402  (DataError must exist before the submodules import it)
from data.tokenizer import Tokenizer  # noqa: E402

__all__ = ["DataError", "TextDataModule", "Tokenizer"]
