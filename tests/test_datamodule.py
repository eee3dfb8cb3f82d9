"""The DataModule: training and evaluation windows, sampling, data-parallel ranks, workers, exact resume."""

import os
import time
from itertools import islice

import numpy as np
import pytest
import torch

from rope_llama.data import DataError
from rope_llama.data.cache import prepare
from rope_llama.data.tokenizer import Tokenizer
from tests.helpers import CONFIGS, garbage, overwrite_bytes, small_source

VOCAB = 512


def _dm(tmp_path, **kw):
    from rope_llama.data import TextDataModule

    if "source" not in kw:  # writing the corpus again changes its mtimes, hence the cache key
        kw["source"] = small_source(tmp_path)
    dm = TextDataModule(
        **{"max_len": 32, "batch_size": 4, "vocab_size": VOCAB, "cache_dir": str(tmp_path / "c"), **kw}
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_datamodule_windows_shapes_targets_and_seed(tmp_path):
    dm = _dm(tmp_path, seed=7)
    tokens = dm.cache.tokens("train")
    batches = list(islice(iter(dm.train_dataloader()), 3))
    for i, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
        starts = np.random.default_rng([7, i]).integers(0, len(tokens) - 32, size=4)
        for row, s in enumerate(starts):  # every row is a real window; the target is shifted by one
            assert (
                x[row].tolist() == tokens[s : s + 32].tolist()
                and y[row].tolist() == tokens[s + 1 : s + 33].tolist()
            )
    again = list(islice(iter(_dm(tmp_path, seed=7).train_dataloader()), 3))
    other = next(iter(_dm(tmp_path, seed=8).train_dataloader()))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    assert not torch.equal(other[0], batches[0][0])


def test_shuffled_sampling_trains_on_every_window_once_per_epoch(tmp_path):
    dm = _dm(tmp_path, seed=7, sampling="shuffled")
    tokens, windows = dm.cache.tokens("train"), dm.train_set
    epoch = [windows.starts(i) for i in range(2 * len(windows))]
    first, second = np.concatenate(epoch[: len(windows)]), np.concatenate(epoch[len(windows) :])
    # one offset per epoch, then the non-overlapping windows from it, each once
    for starts in (first, second):
        offset = starts.min()
        cut = range(offset, len(tokens) - 32, 32)
        assert offset < 32 and set(starts.tolist()) <= set(cut)
        # all of them but what the epoch's whole batches cannot hold
        assert len(set(starts.tolist())) == min(len(starts), len(cut))
    # each epoch its own cut and order
    assert first.min() != second.min() or not np.array_equal(first, second)
    x, y = next(iter(dm.train_dataloader()))
    s = epoch[0][0]
    assert x[0].tolist() == tokens[s : s + 32].tolist() and y[0].tolist() == tokens[s + 1 : s + 33].tolist()
    fresh = _dm(tmp_path, seed=7, sampling="shuffled").train_set  # a pure function of (seed, i): resumable
    assert all(np.array_equal(fresh.starts(i), epoch[i]) for i in reversed(range(len(epoch))))


def test_an_unknown_sampling_is_one_sentence(tmp_path):
    with pytest.raises(DataError, match=r"^sampling must be one of random, shuffled, got 'sorted'\.$"):
        _dm(tmp_path, sampling="sorted")


def test_datamodule_eval_windows_are_contiguous_and_capped(tmp_path):
    dm = _dm(
        tmp_path, source=small_source(tmp_path, n_files=12), val_max_batches=None, batch_size=2, max_len=16
    )
    for split, loader in [("val", dm.val_dataloader()), ("test", dm.test_dataloader())]:
        tokens = dm.cache.tokens(split)
        xs, ys = zip(*loader)
        x, y = torch.cat(xs), torch.cat(ys)
        n = (len(tokens) - 1) // 16
        assert x.shape == (n, 16) and n > 2
        assert (
            x.flatten().tolist() == tokens[: n * 16].tolist()
            and y.flatten().tolist() == tokens[1 : n * 16 + 1].tolist()
        )
    dm.val_max_batches = 1
    assert len(dm.val_dataloader()) == 1
    assert sum(map(len, dm.documents("test"))) == len(dm.cache.tokens("test"))
    assert dm.chars_per_token("val") == dm.cache.meta["splits"]["val"]["chars"] / len(dm.cache.tokens("val"))


def test_val_batch_size_keeps_the_val_windows_when_batch_size_changes(tmp_path):
    source = small_source(tmp_path, n_files=12)

    def val_windows(**kw) -> torch.Tensor:
        loader = _dm(tmp_path, source=source, max_len=16, val_max_batches=2, **kw).val_dataloader()
        return torch.cat([x for x, _ in loader])

    fixed = [val_windows(batch_size=b, val_batch_size=3) for b in (2, 5)]
    assert fixed[0].shape == (6, 16) and torch.equal(fixed[0], fixed[1])
    assert val_windows(batch_size=5).shape == (10, 16)  # null: the training batch size, as before
    with pytest.raises(DataError, match="val_batch_size must be a positive integer, got 0"):
        _dm(tmp_path, source=source, val_batch_size=0)


class _Rank:
    """Stands in for the Lightning trainer the data module reads its data-parallel rank from."""

    def __init__(self, rank: int, world: int):
        self.global_rank, self.world_size = rank, world


def _as_rank(dm, rank: int, world: int):
    dm.trainer = _Rank(rank, world)
    return dm


@pytest.mark.parametrize("world, positions", [(2, None), (4, None), (2, {"kind": "pose", "target_len": 800})])
def test_data_parallel_ranks_split_every_batch_into_the_one_process_batch(tmp_path, world, positions):
    source = small_source(tmp_path, n_files=12)
    recall = {"fraction": 0.5, "seed": 3, "min_pairs": 2, "max_pairs": 3, "answer_weight": 5}
    kw = dict(source=source, max_len=200, batch_size=8, val_batch_size=4, recall=recall, positions=positions)
    one = _dm(tmp_path, **kw)
    ranks = [_as_rank(_dm(tmp_path, **kw), r, world) for r in range(world)]
    # training: rank r's batch i is rows [r * 8 / W, (r + 1) * 8 / W) of the one-process batch i,
    # recall windows and loss weights included
    whole = list(islice(iter(one.train_dataloader()), 3))
    shares = [list(islice(iter(dm.train_dataloader()), 3)) for dm in ranks]
    for i, batch in enumerate(whole):
        # (inputs, targets, weights[, position ids]) with weighted answers
        assert len(batch) == (3 if positions is None else 4) and batch[2].max() == 5
        for part, joined in zip(batch, zip(*(share[i] for share in shares))):
            assert joined[0].shape[0] == 8 // world
            assert torch.equal(torch.cat(joined), part)
    # validation: the ranks' k-th batches make the one-process k-th batch, the short last one too
    val_whole = list(one.val_dataloader())
    val_shares = [list(dm.val_dataloader()) for dm in ranks]
    n = sum(len(x) for x, _ in val_whole)
    assert n % 4 and len(val_whole) >= 2  # the split ends in a short batch
    assert sum(len(x) for share in val_shares for x, _ in share) == n
    for k, (x, y) in enumerate(val_whole):
        parts = [share[k] for share in val_shares if k < len(share)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_a_batch_that_does_not_split_over_the_processes_is_one_sentence(tmp_path):
    dm = _as_rank(_dm(tmp_path, batch_size=6, val_batch_size=4), 0, 4)
    with pytest.raises(DataError, match=r"data.batch_size=6 must be a multiple of the 4 data-parallel"):
        dm.train_dataloader()
    dm = _as_rank(_dm(tmp_path, batch_size=8, val_batch_size=6), 1, 4)
    with pytest.raises(DataError, match=r"data.val_batch_size=6 must be a multiple of the 4"):
        dm.val_dataloader()


def test_worker_processes_keep_the_batch_order(tmp_path):
    from torch.utils.data import DataLoader

    dm = _dm(tmp_path)
    n = len(dm.train_set)
    single = list(dm.train_dataloader())
    multi = list(DataLoader(dm.train_set, batch_size=None, num_workers=2))
    assert len(single) == len(multi) == n and all(torch.equal(a[0], b[0]) for a, b in zip(single, multi))


class _Recorder:
    """A tiny LightningModule factory that records the input batches it trains on."""

    @staticmethod
    def make(vocab_size):
        import lightning as L

        class Tiny(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(vocab_size, 8)
                self.out = torch.nn.Linear(8, vocab_size)
                self.seen = []

            def training_step(self, batch, batch_idx):
                x, y = batch
                self.seen.append(x.clone())
                return torch.nn.functional.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Tiny()


def _fit(dm, max_steps, ckpt_path=None, save_to=None):
    import lightning as L

    model = _Recorder.make(dm.vocab_size)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    return model.seen


def test_resume_from_checkpoint_sees_the_same_batches(tmp_path):
    steps_per_epoch = len(_dm(tmp_path).train_set)
    total, cut = 2 * steps_per_epoch + 2, steps_per_epoch + 1  # resume mid-epoch and cross an epoch boundary
    uninterrupted = _fit(_dm(tmp_path), total)
    ckpt = str(tmp_path / "mid.ckpt")
    first = _fit(_dm(tmp_path), cut, save_to=ckpt)
    assert torch.load(ckpt, weights_only=True)["TextDataModule"]["train_batches"] == cut
    resumed = _fit(_dm(tmp_path), total, ckpt_path=ckpt)
    assert len(uninterrupted) == total and len(resumed) == total - cut
    assert all(torch.equal(a, b) for a, b in zip(first + resumed, uninterrupted))


@pytest.mark.parametrize("damage", ["random_bytes", "zeros"])
def test_training_on_a_damaged_shard_is_refused_and_verify_rebuilds_it(tmp_path, damage):
    dm = _dm(tmp_path)
    clean = _fit(dm, 2)
    train_bin = os.path.join(dm.cache.dir, "train-00000.bin")
    overwrite_bytes(train_bin, 0, garbage(damage, os.path.getsize(train_bin)))
    with pytest.raises(DataError, match=r"^token shard .*train-00000\.bin does not match its hash") as error:
        _fit(_dm(tmp_path, source=dm.source), 2)
    assert len(str(error.value).splitlines()) == 1
    hp = dm.hparams
    # what scripts/prepare_data.py runs
    prepare(dm.source, hp.vocab_size, cache_root=hp.cache_dir, verify=True)
    after = _fit(_dm(tmp_path, source=dm.source), 2)
    assert len(after) == len(clean) == 2 and all(torch.equal(a, b) for a, b in zip(after, clean))


def test_hydra_configs_instantiate_and_full_shakespeare_prepares_in_budget(tmp_path, capsys):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    config_dir = str(CONFIGS / "data")
    with initialize_config_dir(config_dir, version_base=None):
        for name in ("tinystories", "wikitext103", "fineweb_edu", "text_files"):
            cfg = compose(name)
            assert cfg.source.kind in ("hf", "text_files") and cfg.max_len == 256
        cfg = compose("shakespeare", overrides=[f"cache_dir={tmp_path}"])
    dm = instantiate(cfg)
    t0 = time.perf_counter()
    dm.prepare_data()
    seconds = time.perf_counter() - t0
    dm.setup("fit")
    assert seconds < 60 and "tokens/s" in capsys.readouterr().out
    assert dm.vocab_size == 4096 and dm.cache.meta["splits"]["train"]["documents"] == 34
    assert all(len(doc) > 16 * 256 for doc in dm.documents("test") + dm.documents("val"))
    assert 2.5 < dm.chars_per_token("test") < 4.5


@pytest.mark.parametrize("content", [b'{"version": "1.0", "model"', b"\xff\xfe not json"])
def test_a_corrupt_tokenizer_file_is_one_sentence(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=r"is not a readable tokenizer\.json") as error:
        Tokenizer.from_file(str(path))
    assert len(str(error.value).splitlines()) == 1
