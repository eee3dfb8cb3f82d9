"""Training position ids (data/positions.py): PoSE chunks, randomized positions, the batches and the step."""

import numpy as np
import pytest
import torch

from rope_llama.data import DataError
from rope_llama.data.positions import (
    PositionSampler,
    PositionsConfig,
    pose_position_ids,
    randomized_position_ids,
)
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.training.module import LitLlama
from tests.test_datamodule import _dm

SHAPES = [
    (16, 64, 2),
    (16, 17, 2),
    (32, 1024, 3),
    (8, 100, 8),
    (8, 8, 4),
    (1, 5, 1),
    (12, 40, 1),
]  # (L, target, chunks)


@pytest.mark.parametrize("length, target, chunks", SHAPES)
def test_pose_ids_are_chunks_of_contiguous_positions_below_the_target(length, target, chunks):
    ids = pose_position_ids(np.random.default_rng(0), 200, length, target, chunks)
    assert ids.shape == (200, length) and ids.dtype == np.int64
    assert (ids[:, 0] == 0).all() and (ids >= 0).all() and (ids < target).all()  # first chunk at 0
    steps = np.diff(ids, axis=1)
    assert (steps >= 1).all()  # increasing across chunks, contiguous (step 1) inside each
    assert ((steps > 1).sum(1) <= chunks - 1).all()  # a jump only where a new chunk starts
    if chunks > 1 and target > length:
        assert (steps > 1).any()  # the ids do jump: the check above can fail


def test_pose_ids_at_the_training_length_are_0_to_L():
    for chunks in (1, 2, 16):
        ids = pose_position_ids(np.random.default_rng(1), 4, 16, 16, chunks)
        assert (ids == np.arange(16)).all()


def test_pose_two_chunks_skip_uniformly_over_the_room():
    """The paper's draw for two chunks: the second chunk's skip is uniform in [0, target - L]."""
    length, target = 16, 64
    ids = pose_position_ids(np.random.default_rng(2), 4000, length, target, 2)
    skips = ids[:, -1] - (length - 1)  # the last token is in the second chunk
    assert skips.min() == 0 and skips.max() == target - length
    assert abs(skips.mean() - (target - length) / 2) < 1.0


@pytest.mark.parametrize("length, target", [(16, 64), (8, 9), (32, 4096)])
def test_randomized_ids_are_sorted_distinct_and_below_the_target(length, target):
    ids = randomized_position_ids(np.random.default_rng(3), 100, length, target)
    assert ids.shape == (100, length) and (np.diff(ids, axis=1) >= 1).all() and (ids < target).all()
    assert (ids >= 0).all() and len({tuple(r) for r in ids}) > 1  # rows differ
    same = randomized_position_ids(np.random.default_rng(3), 2, 16, 16)
    assert (same == np.arange(16)).all()


def test_ids_are_a_pure_function_of_seed_and_batch_index():
    config = PositionsConfig("pose", 256, 2)
    a, b = PositionSampler(config, 4, 32, seed=5), PositionSampler(config, 4, 32, seed=5)
    assert torch.equal(a.batch(7), b.batch(7)) and not torch.equal(a.batch(7), a.batch(8))
    assert not torch.equal(a.batch(7), PositionSampler(config, 4, 32, seed=6).batch(7))
    assert PositionSampler(PositionsConfig(), 4, 32, seed=5).batch(7) is None  # contiguous: no ids


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"kind": "pose", "target_len": 16},
            "positions.target_len must be an integer >= data.max_len (32) and <= 2^53 for pose, got 16.",
        ),
        (
            {"kind": "pose", "target_len": 64, "chunks": 0},
            "positions.chunks must be an integer in [1, data.max_len=32], got 0.",
        ),
        ({"kind": "pose", "target_len": 64, "chunks": 33}, "got 33."),
        ({"kind": "randomized", "target_len": None}, "for randomized, got None."),
        ({"kind": "spiral"}, "positions.kind must be one of contiguous, pose, randomized, got 'spiral'."),
        (
            {"kind": "pose", "target": 64},
            "Unknown positions option(s) target; valid are chunks, kind, target_len.",
        ),
    ],
)
def test_invalid_settings_are_one_sentence(options, message):
    with pytest.raises(DataError) as error:
        PositionsConfig.from_options(options).check(32)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 1


def test_training_batches_carry_ids_after_the_weights(tmp_path):
    pose = {"kind": "pose", "target_len": 128}
    plain = next(iter(_dm(tmp_path).train_dataloader()))
    assert len(plain) == 2  # contiguous: today's batch
    x, y, weights, ids = next(iter(_dm(tmp_path, positions=pose).train_dataloader()))
    assert torch.equal(x, plain[0]) and torch.equal(y, plain[1]) and weights is None  # same windows
    assert ids.shape == (4, 32) and ids.dtype == torch.int64 and (ids[:, 0] == 0).all()
    # with recall weights and data-parallel ranks: test_datamodule.py's rank test


def test_string_positions_name_the_kind(tmp_path):
    with pytest.raises(DataError, match="positions.target_len must be an integer"):
        _dm(tmp_path, positions="pose")


def _models():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    lit = LitLlama(config)  # training path: kernels/ drop-ins
    with torch.no_grad():  # sharper attention than at initialisation, so the positions move the loss
        for name, p in lit.model.named_parameters():
            if name.endswith("qkv.weight"):
                p.mul_(20)
    reference = Llama(config)  # the plain reference path
    reference.load_state_dict(lit.model.state_dict())
    return lit, reference


def test_training_step_with_explicit_ids_equals_the_full_forward_with_those_ids():
    lit, reference = _models()
    x = torch.randint(0, 64, (3, 16))
    y = torch.randint(0, 64, (3, 16))
    ids = PositionSampler(PositionsConfig("pose", 512, 2), 3, 16, seed=0).batch(0)
    loss = lit._loss((x, y, None, ids))
    logits = reference(x, position_ids=ids)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected.backward()
    for (name, a), b in zip(lit.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    contiguous = lit._loss((x, y))
    assert abs(contiguous - loss) > 1e-3  # the ids reach the model: the check can fail
    weights = torch.rand(3, 16)
    weighted = lit._loss((x, y, weights, ids))
    expected = (
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        * weights.flatten()
    ).sum() / weights.sum()
    torch.testing.assert_close(weighted, expected, rtol=1e-5, atol=1e-5)
