"""tools/induction_probe.py: the copy targets are exactly the tokens a copy can predict."""

import numpy as np
import pytest

from tools.induction_probe import ProbeConfig, repeat_windows, run


def test_copy_mask_marks_the_targets_inside_repeated_segments():
    cfg = ProbeConfig(batch_size=4, seq_len=200)
    windows, copyable = repeat_windows(np.random.default_rng(0), cfg)
    assert windows.shape == (4, 201) and copyable.shape == (4, 200)
    chance = 0
    for row, mask in zip(windows.tolist(), copyable.tolist()):
        for t, is_copy in enumerate(mask):  # target t is row[t + 1], predicted from row[: t + 1]
            followed_before = any(row[j] == row[t] and row[j + 1] == row[t + 1] for j in range(t))
            if is_copy:  # inside a repeat: the same (token, target) pair occurred in the first copy
                assert followed_before
            else:  # a first occurrence, or a segment's first token (whose predecessor repeats only when
                chance += followed_before  # the shuffle happens to repeat a pair of adjacent segments)
    assert chance <= 0.02 * (~copyable).sum()
    assert 0.3 < copyable.float().mean() < 0.6  # about half of each window repeats an earlier segment


def test_probe_runs_and_reports(capsys):
    assert run(ProbeConfig(steps=2, every=1, batch_size=2, seq_len=32, vocab_size=256, d_model=32,
                           n_layers=1, n_heads=2, n_kv_heads=1, threshold=1.01)) is None  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("copy accuracy") == 3 and "stayed below 101% for 2 steps (128 tokens)" in out
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        run(ProbeConfig(steps=0))
    with pytest.raises(ValueError, match=r"alphabet must lie in \[0, vocab_size - 2 = 254\], got 300"):
        run(ProbeConfig(vocab_size=256, alphabet=300))


def test_small_alphabet_and_previous_token_mixing_reach_the_model():
    cfg = ProbeConfig(batch_size=2, seq_len=64, alphabet=10)
    windows, _ = repeat_windows(np.random.default_rng(0), cfg)
    assert int(windows.min()) >= 2 and int(windows.max()) < 12
    assert run(ProbeConfig(steps=1, every=1, batch_size=2, seq_len=64, vocab_size=64, d_model=32, n_layers=1,
                           n_heads=2, n_kv_heads=1, mix_previous_tokens=2, optim="muon")) is None  # fmt: skip
