"""scripts/visualize.py and rope_llama/viz/: the plotted numbers against closed forms and the model's own
softmax, every picture written, refusals in one sentence."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from rope_llama.cli import visualize
from rope_llama.core import memory
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import ExtendConfig, grouped_key_positions, grouped_query_positions
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig, rope_frequencies
from rope_llama.viz.attention_maps import record_attention
from rope_llama.viz.geometry import decay_bound, relative_scores, relative_scores_closed_form, seen_distances
from tests.helpers import CONFIGS, L0, ROOT, ROPES, save_run, text_tokenizer, tiny

# every RoPE whose frequencies do not depend on the total length (dynamic NTK's do), and a partial one
RELATIVE_ROPES = {n: r for n, r in ROPES.items() if n != "dynamic_ntk"} | {
    "partial": RopeConfig(rotary_dim=8, original_max_len=L0)
}


def compose_viz(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("visualize", overrides=list(overrides))


def read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", RELATIVE_ROPES)
def test_relative_property_equals_the_closed_form_at_every_offset(name):
    rope = RELATIVE_ROPES[name]
    q, k = torch.randn(16, generator=torch.Generator().manual_seed(0)), torch.randn(16)
    distances = torch.arange(0, 200, 7)
    closed = relative_scores_closed_form(q, k, rope, 16, distances)
    for offset in (0, 1000, 10**6):
        torch.testing.assert_close(
            relative_scores(q, k, rope, 16, distances, offset), closed, atol=1e-5, rtol=0
        )
    assert closed.std() > 0.1  # the score does move with the distance: the check can fail


def test_decay_bound_is_the_mean_of_the_partial_sums():
    inv_freq = rope_frequencies(RopeConfig(), 16)[0]
    for m in (0, 1, 17, 500):
        partial = [
            abs(sum(complex(math.cos(m * t), math.sin(m * t)) for t in inv_freq[:j].tolist()))
            for j in range(1, 9)
        ]
        assert float(decay_bound(inv_freq, torch.tensor([m]))[0]) == pytest.approx(sum(partial) / 8, rel=1e-6)
    assert float(decay_bound(inv_freq, torch.tensor([0]))[0]) == pytest.approx(4.5)  # (1 + ... + 8) / 8


def test_seen_distances_are_self_extends_merge_rule():
    extend = ExtendConfig("self_extend", window=8, group=4)
    d = torch.arange(0, 100)
    q = torch.full_like(d, 99)
    expected = torch.where(d < 8, d, grouped_query_positions(q, 8, 4) - grouped_key_positions(q - d, 4))
    assert torch.equal(seen_distances(extend, 99, d), expected.double())
    assert torch.equal(seen_distances(ExtendConfig(), 99, d), d.double())


def reference_probabilities(model: Llama, idx: torch.Tensor, layer: int) -> torch.Tensor:
    """(H, L, L): softmax over causal scores from the layer's own q and k, computed here pair by pair
    rule (true distance inside Self-Extend's window, grouped past it)."""
    seen = {}

    def observe(_, q, k, q_far, k_far, region, mask):
        seen.update(q=q, k=k, q_grouped=q_far[0] if q_far else None, k_grouped=k_far)

    model.blocks[layer].attn.observer = observe
    with torch.no_grad():
        model(idx)
    model.blocks[layer].attn.observer = None
    q = seen["q"][0]  # (H, L, D)
    k = seen["k"][0].repeat_interleave(q.shape[0] // seen["k"].shape[1], 0)
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    extend, L = model.config.extend, idx.shape[1]
    if seen["q_grouped"] is not None:
        kg = seen["k_grouped"][0].repeat_interleave(q.shape[0] // seen["k"].shape[1], 0)
        grouped = seen["q_grouped"][0] @ kg.mT / math.sqrt(q.shape[-1])
        pos = torch.arange(L)
        scores = torch.where((pos[:, None] - pos[None]) < extend.window, scores, grouped)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1)


@pytest.mark.parametrize("extend", [ExtendConfig(), ExtendConfig("self_extend", window=8, group=4)])
def test_recorded_attention_is_the_models_softmax(extend):
    model = tiny(97, extend=extend)
    idx = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(idx)
    maps = record_attention(model, idx[0], heat_layers=[0, 1], grid=40, needle=(5, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), plain, atol=0, rtol=0)  # recording changes nothing
    for layer in (0, 1):
        probs = reference_probabilities(model, idx, layer).double()  # (H, L, L)
        torch.testing.assert_close(probs.sum(-1), torch.ones(4, 40, dtype=torch.float64), atol=1e-6, rtol=0)
        torch.testing.assert_close(
            maps.heatmaps[layer], probs, atol=1e-5, rtol=0
        )  # grid = L: one pair a cell
        entropy = -torch.special.xlogy(probs, probs).sum(-1)
        torch.testing.assert_close(maps.entropy[layer], entropy, atol=1e-5, rtol=0)
        by_distance = torch.stack([probs.diagonal(-d, 1, 2).sum(-1) for d in range(40)], -1) / 40
        torch.testing.assert_close(maps.distance_mass[layer], by_distance, atol=1e-6, rtol=0)
        torch.testing.assert_close(maps.needle_mass[layer], probs[:, -1, 5:9].sum(-1), atol=1e-6, rtol=0)


def test_rope_view_writes_its_numbers_and_pictures(tmp_path):
    names = visualize.run(
        compose_viz("view=rope", f"out={tmp_path / 'rope'}", "head_dim=16", "training_len=64")
    )
    assert {n for n in names if n.endswith(".png")} == {
        "rope_wavelengths.png", "rope_relative.png", "rope_decay.png", "remap_distances.png"
    }  # fmt: skip
    for name in names:
        assert (tmp_path / "rope" / name).stat().st_size > 1000, name
    rows = read_csv(tmp_path / "rope" / "rope_wavelengths.csv")
    yarn = RopeConfig(scaling="yarn", factor=4.0, original_max_len=64)
    expected = (2 * math.pi / rope_frequencies(yarn, 16)[0].double()).tolist()
    assert [float(r["wavelength"]) for r in rows if r["scaling"] == "yarn"] == pytest.approx(expected)
    assert {r["band"] for r in rows if r["scaling"] == "yarn"} >= {"kept", "interpolated"}
    relative = read_csv(tmp_path / "rope" / "rope_relative.csv")
    for scaling in ("none", "yarn"):  # the same curve at every offset (dynamic NTK's frequencies move)
        curves = {
            o: [float(r["score"]) for r in relative if r["scaling"] == scaling and r["offset"] == o]
            for o in ("0", "1000", "1000000")
        }
        assert curves["1000"] == pytest.approx(curves["0"], abs=1e-5)
        assert curves["1000000"] == pytest.approx(curves["0"], abs=1e-5)


def test_attention_view_draws_every_method_and_length(tmp_path):
    tok = text_tokenizer(tmp_path)
    run = save_run(tiny(tok.vocab_size), tok, tmp_path / "run")
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "README.md").read_text(encoding="utf-8"))
    out = tmp_path / "attn"
    cfg = compose_viz("view=attention", f"ckpt={run}", f"out={out}", f"text_file={text}", "lengths=[32,128]",
                      "methods=[none,yarn,self_extend]", "extend_options.window=8", "extend_options.group=4",
                      "device=cpu", "threads=1", "grid=16")  # fmt: skip
    names = visualize.run(cfg)
    for method in ("none", "yarn", "self_extend"):
        for length in (32, 128):
            assert f"attention_heatmap_{method}_{length}.png" in names
    for name in names:
        assert (out / name).stat().st_size > 500, name
    mass = read_csv(out / "attention_distance.csv")
    total = sum(
        float(r["mass"])
        for r in mass
        if r["method"] == "none" and r["length"] == "128" and r["layer"] == "0" and r["head"] == "0"
    )
    assert 0 < total  # bucket means of a distribution over distances
    self_extend = [
        float(r["entropy"])
        for r in read_csv(out / "attention_entropy.csv")
        if r["method"] == "self_extend" and r["length"] == "128"
    ]
    plain = [
        float(r["entropy"])
        for r in read_csv(out / "attention_entropy.csv")
        if r["method"] == "none" and r["length"] == "128"
    ]
    assert self_extend != plain  # the merge changes what attention sees past the window


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["view=sideways"], "view must be one of rope, attention, got 'sideways'."),
        (["view=attention"], "view=attention needs ckpt=<.ckpt file or run directory>."),
        (
            ["view=attention", "CKPT", "layers=[2]"],
            "layers must name layers of the model, integers in [0, 1], got 2.",
        ),
        (["view=rope", "head_dim=7"], "head_dim must be even (rotary pairs), got 7."),
        (["view=rope", "overwrite=maybe"], "overwrite must be true or false, got 'maybe'."),
    ],
)
def test_bad_options_are_one_sentence(tmp_path, overrides, message):
    tok = text_tokenizer(tmp_path)
    run = save_run(tiny(tok.vocab_size), tok, tmp_path / "run")
    args = [f"ckpt={run}" if o == "CKPT" else o for o in overrides]
    command = [
        sys.executable,
        str(ROOT / "scripts" / "visualize.py"),
        *args,
        f"out={tmp_path / 'out'}",
        "device=cpu",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_outputs_are_owned_like_run_directories(tmp_path, monkeypatch):
    tok = text_tokenizer(tmp_path)
    run = save_run(tiny(tok.vocab_size), tok, tmp_path / "run")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="is not empty; pass overwrite=true"):
        visualize.run(compose_viz("view=rope", f"out={tmp_path / 'taken'}"))
    with pytest.raises(ValueError, match="is inside the run directory"):
        visualize.run(compose_viz("view=rope", f"out={run / 'checkpoints' / 'viz'}"))
    monkeypatch.setattr(memory, "available_memory", lambda device: 2**20)  # 1 MiB free
    with pytest.raises(memory.MemoryBudgetError, match="Drawing the attention of 4,096 tokens needs"):
        visualize.run(
            compose_viz(
                "view=attention", f"ckpt={run}", f"out={tmp_path / 'big'}", "lengths=[4096]", "device=cpu"
            )
        )
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep" and not (tmp_path / "big").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]  # the staging folder is removed


def test_model_config_default_is_not_touched_by_recording():
    model = Llama(
        ModelConfig(
            vocab_size=32, d_model=32, n_layers=1, n_heads=2, rope=RopeConfig(original_max_len=8), lengths=8
        )
    )
    record_attention(model.eval(), torch.arange(10) % 32)
    assert all(block.attn.observer is None for block in model.blocks)


def test_wandb_logs_the_pictures_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "rope"
    visualize.run(compose_viz("view=rope", f"out={out}", "head_dim=16", "training_len=32", "wandb=true"))
    images = list((out / "wandb").glob("offline-run-*/files/media/images/*.png"))
    assert {p.name.split("_")[0] for p in images} >= {"rope"} and len(images) == 4


def test_recording_the_last_queries_of_chosen_layers_keeps_their_numbers():
    model = tiny(97, extend=ExtendConfig("self_extend", window=8, group=4))
    idx = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(2))
    full = record_attention(model, idx, heat_layers=[1], grid=60)
    last = record_attention(model, idx, heat_layers=[1], grid=20, layers=[1], queries=20)
    torch.testing.assert_close(last.entropy[1], full.entropy[1, :, -20:], atol=1e-9, rtol=0)
    torch.testing.assert_close(last.heatmaps[1], full.heatmaps[1][:, -20:].unflatten(-1, (20, 3)).mean(-1))
    assert not last.entropy[0].any()  # layer 0 was not recorded
