"""Pictures of what RoPE does, each with the CSV of its numbers (docs/visualize.md).

    python scripts/visualize.py view=rope out=runs/viz/rope                       # any RoPE, no checkpoint
    python scripts/visualize.py view=rope ckpt=runs/default out=runs/viz/rope-default
    python scripts/visualize.py view=attention ckpt=runs/default out=runs/viz/attn methods=[none,yarn,self_extend]
    python scripts/visualize.py view=attention ckpt=runs/smollm2 out=runs/viz/smollm2 lengths=[8192] layers=[0,15,29] needle=true

view=rope: wavelength per rotary pair for every scaling (YaRN's and Llama-3's kept / ramped / interpolated
pairs marked), the score of fixed q and k against m - n at three absolute offsets, RoFormer's long-term
decay bound for each scaling and base, and the distances each remap (Self-Extend, STRING, DCA, ReRoPE)
makes attention use.
view=attention: for each length and method, the model's own attention (rope_llama/viz/attention_maps.py):
heatmaps of the chosen layers (every head, log colour), attention mass against relative distance and
entropy against query position for every layer and head, and with needle=true a passkey prompt's needle
marked and its share of the answer token's attention. Loading and overrides are generate.py's and the
evaluation's (rope_llama/inference/loading.py, the method grid).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.options import long_documents, method_grid, method_names, option_list, require
from rope_llama.cli.schema import check_command
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.core.checks import check_number, check_switch
from rope_llama.core.memory import check_fits
from rope_llama.core.threads import apply_threads, check_threads
from rope_llama.inference.evaluation import check_method
from rope_llama.inference.loading import load_model
from rope_llama.inference.reporting import write_csv
from rope_llama.inference.retrieval import NEEDLE, build_prompt
from rope_llama.interchange.destination import claim_results_directory, staged
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.rope import SCALINGS, RopeConfig, rope_frequencies
from rope_llama.viz import plots
from rope_llama.viz.attention_maps import record_attention
from rope_llama.viz.geometry import (
    decay_bound,
    frequency_bands,
    pair_wavelengths,
    relative_scores,
    seen_distances,
)

VIEWS = ("rope", "attention")
OFFSETS = (0, 1000, 10**6)  # absolute positions of the key in the relative-property picture


# ----------------------------------------------------------------------------- view=rope


def rope_setting(cfg: DictConfig) -> tuple[RopeConfig, int, int]:
    """(the RoPE to start from, head dim, L0): a checkpoint's, else the options'."""
    if cfg.ckpt:
        loaded = load_checkpoint(cfg.ckpt)
        return loaded.config.rope, loaded.config.head_dim, loaded.context_len
    check_number("head_dim", cfg.head_dim, minimum=4, integer=True)
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary pairs), got {cfg.head_dim}.")
    check_number("training_len", cfg.training_len, minimum=2, integer=True)
    return RopeConfig(base=float(cfg.base)), int(cfg.head_dim), int(cfg.training_len)


def rope_view(cfg: DictConfig, folder: Path) -> None:
    own, head_dim, L0 = rope_setting(cfg)
    check_number("factor", cfg.factor, minimum=1)
    check_number("window", cfg.window, minimum=1, integer=True)
    check_number("group", cfg.group, minimum=1, integer=True)
    factor = float(cfg.factor)
    ropes = {
        s: RopeConfig(
            base=own.base,
            scaling=s,
            factor=1.0 if s == "none" else factor,
            original_max_len=L0,
            layout=own.layout,
            rotary_dim=own.rotary_dim,
        )  # fmt: skip
        for s in SCALINGS
    }
    dynamic_len = int(factor * L0)  # dynamic NTK drawn at the length its factor is for
    wavelengths = []
    for scaling, rope in ropes.items():
        seq_len = dynamic_len if scaling == "dynamic_ntk" else None
        bands = frequency_bands(rope, head_dim, seq_len)
        for pair, (wave, band) in enumerate(zip(pair_wavelengths(rope, head_dim, seq_len).tolist(), bands)):
            wavelengths.append({"scaling": scaling, "pair": pair, "wavelength": wave, "band": band})
    write_csv(folder / "rope_wavelengths.csv", wavelengths)
    plots.plot_wavelengths(wavelengths, L0, factor, folder / "rope_wavelengths.png")

    generator = torch.Generator().manual_seed(int(cfg.seed))
    q, k = torch.randn(head_dim, generator=generator), torch.randn(head_dim, generator=generator)
    distances = torch.arange(0, 2 * L0 + 1, max(1, L0 // 128))
    relative = [
        {"scaling": s, "offset": offset, "distance": int(d), "score": float(v)}
        for s in SCALINGS
        for offset in OFFSETS
        for d, v in zip(distances, relative_scores(q, k, ropes[s], head_dim, distances, offset))
    ]
    write_csv(folder / "rope_relative.csv", relative)
    plots.plot_relative(relative, folder / "rope_relative.png")

    far = torch.unique(torch.logspace(0, math.log10(64 * L0), 240).round().long())
    curves = {
        s: rope_frequencies(ropes[s], head_dim, dynamic_len if s == "dynamic_ntk" else None)[0]
        for s in SCALINGS
    }
    curves |= {
        f"none, base {b:g}": rope_frequencies(RopeConfig(base=float(b)), head_dim)[0] for b in cfg.bases
    }
    decay = [
        {"curve": name, "distance": int(d), "bound": float(v)}
        for name, inv_freq in curves.items()
        for d, v in zip(far, decay_bound(inv_freq, far))
    ]
    write_csv(folder / "rope_decay.csv", decay)
    plots.plot_decay(decay, L0, folder / "rope_decay.png")

    query = 16 * L0
    true = torch.arange(0, query + 1, max(1, query // 512))
    extends = {
        "none": ExtendConfig(),
        "self_extend": ExtendConfig("self_extend", int(cfg.window), int(cfg.group)),
        # the other remaps at their defaults for this training length (model/extend.py)
        **{m: ExtendConfig(m, original_max_len=L0) for m in ("string", "dca", "rerope", "leaky_rerope")},
    }
    remaps = [  # integers, but for leaky ReRoPE's fractional distances
        {"method": m, "distance": int(d), "seen": int(s) if float(s).is_integer() else round(float(s), 3)}
        for m, extend in extends.items()
        for d, s in zip(true, seen_distances(extend, query, true))
    ]
    write_csv(folder / "remap_distances.csv", remaps)
    plots.plot_remaps(remaps, L0, folder / "remap_distances.png")


# ----------------------------------------------------------------------------- view=attention


def log_buckets(n: int, count: int) -> np.ndarray:
    """Bucket index of each distance 0..n-1: 0 alone, then log-spaced edges (at most `count` buckets)."""
    edges = np.unique(np.concatenate([[0, 1], np.geomspace(1, n, count).round().astype(int)]))
    return np.searchsorted(edges, np.arange(n), side="right") - 1


def bucket_rows(
    values: torch.Tensor, index: np.ndarray, key: str, x: np.ndarray, keys: dict, layers: list[int]
) -> list[dict]:
    """values (layers, H, n) of the recorded `layers`, averaged within each bucket of `index` (n,) -> rows
    with the bucket's mean x."""
    rows = []
    arr = values.numpy()
    for b in np.unique(index):
        sel = index == b
        means = arr[:, :, sel].mean(-1)
        for layer in layers:
            for head in range(arr.shape[1]):
                rows.append(
                    {
                        **keys,
                        "layer": layer,
                        "head": head,
                        key: float(x[sel].mean()),
                        "value": float(means[layer, head]),
                    }
                )
    return rows


def layer_list(cfg: DictConfig, key: str, n_layers: int, default: list[int]) -> list[int]:
    """cfg[key] as sorted layer indices (null = `default`); one sentence for a layer the model lacks."""
    layers = default if cfg[key] is None else option_list(cfg, key, "[0,3]")
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(
                f"{key} must name layers of the model, integers in [0, {n_layers - 1}], got {layer!r}."
            )
    return sorted(set(layers))


def attention_options(cfg: DictConfig, n_layers: int) -> tuple[list[int], list[int], list[int]]:
    """(lengths or [], recorded layers, heatmap layers), checked before any data work."""
    for name, low in (("grid", 1), ("buckets", 2), ("start_pos", 0), ("seed", 0)):
        check_number(name, cfg[name], minimum=low, integer=True)
    check_number("queries", cfg.queries, minimum=1, integer=True, allow_none=True, none_means="all")
    for method in option_list(cfg, "methods", "[none,yarn]"):
        check_method(str(method))
    lengths = [] if cfg.lengths is None else option_list(cfg, "lengths", "[256,1024]")
    for t in lengths:
        check_number("lengths", t, minimum=2, integer=True)
    layers = layer_list(cfg, "layers", n_layers, list(range(n_layers)))
    heat = layer_list(cfg, "heatmap_layers", n_layers, [layers[0], layers[-1]])
    return lengths, layers, heat


def check_attention_memory(model, length: int, heat_layers: list[int], grid: int) -> None:
    """The forward of one window (activations, one block of scores) and the recorded maps."""
    cfg = model.config
    item = model.embed.weight.element_size()
    activations = length * (4 * cfg.d_model + 2 * cfg.ffn_hidden + cfg.vocab_size // length + 1) * item
    qkv = length * (cfg.n_heads + 4 * cfg.n_kv_heads) * cfg.head_dim * item
    maps = 2 * cfg.n_layers * cfg.n_heads * length * 8 + len(heat_layers) * cfg.n_heads * grid * grid * 8
    block = 3 * 64 * 2**20  # model/extend.py's SCORE_BLOCK_BYTES of scores, probabilities and a mask
    check_fits(
        activations + 2 * qkv + maps + block,
        f"drawing the attention of {length:,} tokens",
        "lengths",
        model.embed.weight.device,
    )


def window_tokens(cfg: DictConfig, ckpt, tok, length: int):
    """(tokens (length,), needle span or None): a passkey prompt, the text file, or a held-out document."""
    if cfg.needle:
        prompt = build_prompt("passkey", tok, length, 0.5, np.random.default_rng([int(cfg.seed), length]))
        span = (prompt.needle_start, prompt.needle_start + len(tok.encode(NEEDLE.format(key=prompt.answer))))
        return torch.tensor(prompt.tokens), span
    if cfg.text_file:
        ids = tok.encode(Path(cfg.text_file).read_text(encoding="utf-8"))
        if len(ids) < length:
            raise ValueError(f"text_file={cfg.text_file} has {len(ids)} tokens, fewer than length {length}.")
        return torch.tensor(ids[:length]), None
    document = long_documents(cfg, ckpt, length)[0]
    return torch.from_numpy(document[:length].astype(np.int64)), None


def attention_view(cfg: DictConfig, folder: Path) -> None:
    if not cfg.ckpt:
        raise ValueError("view=attention needs ckpt=<.ckpt file or run directory>.")
    check_threads(cfg.threads)
    ckpt, tok = load_model(cfg.ckpt, cfg.device, cfg.dtype)
    apply_threads(cfg.threads)
    lengths, layers, heat_layers = attention_options(cfg, ckpt.config.n_layers)
    lengths = lengths or [ckpt.context_len, 4 * ckpt.context_len]
    for length in lengths:
        check_attention_memory(ckpt.model, length, heat_layers, int(cfg.grid))
    grid_cfg = OmegaConf.create(
        {"factor": cfg.factor_mode, "rope_options": cfg.rope_options, "extend_options": cfg.extend_options}
    )
    methods = method_names(cfg.methods, ckpt)
    distance_rows, entropy_rows, heat_rows, needle_rows = [], [], [], []
    for length in lengths:
        tokens, span = window_tokens(cfg, ckpt, tok, length)
        length = len(tokens)  # a needle prompt is as long as asked, up to its wording
        positions = torch.arange(cfg.start_pos, cfg.start_pos + length, device=ckpt.model.embed.weight.device)
        queries = min(cfg.queries or length, length)  # the recorded rows: the window's last ones
        dist_index, pos_index = log_buckets(length, cfg.buckets), np.arange(queries) * cfg.buckets // queries
        query_positions = np.arange(length - queries, length) + cfg.start_pos
        for method, cell in method_grid(grid_cfg, ckpt, methods, length).items():
            ckpt.model.use_positions(cell.rope, cell.extend)
            maps = record_attention(
                ckpt.model, tokens, positions, heat_layers, int(cfg.grid), span, layers, cfg.queries
            )
            keys = {"method": method, "length": length}
            distance_rows += bucket_rows(
                maps.distance_mass, dist_index, "distance", np.arange(length), keys, layers
            )
            entropy_rows += bucket_rows(maps.entropy, pos_index, "position", query_positions, keys, layers)
            for layer, heat in maps.heatmaps.items():
                for head, qi, ki in np.ndindex(*heat.shape):
                    heat_rows.append(
                        {
                            **keys,
                            "layer": layer,
                            "head": head,
                            "query_cell": qi,
                            "key_cell": ki,
                            "prob": float(heat[head, qi, ki]),
                        }
                    )
            if maps.needle_mass is not None:
                needle_rows += [
                    {
                        **keys,
                        "layer": layer,
                        "head": head,
                        "needle_mass": float(maps.needle_mass[layer, head]),
                    }
                    for layer, head in np.ndindex(*maps.needle_mass.shape)
                ]
            marks = None if span is None else (span[0] / length, span[1] / length)
            title = f"{method}, T={length}, positions {cfg.start_pos}..{cfg.start_pos + length - 1}"
            plots.plot_heatmaps({n: h.numpy() for n, h in maps.heatmaps.items()}, title, marks,
                                folder / f"attention_heatmap_{method}_{length}.png")  # fmt: skip
    mass = [{**r, "mass": r.pop("value")} for r in distance_rows]
    entropy = [{**r, "entropy": r.pop("value")} for r in entropy_rows]
    write_csv(folder / "attention_distance.csv", mass)
    write_csv(folder / "attention_entropy.csv", entropy)
    write_csv(folder / "attention_heatmap.csv", heat_rows)
    plots.plot_curves(mass, "distance", "mass", "relative distance", "attention mass (mean over queries)",
                      folder / "attention_distance.png", log_x=True, log_y=True)  # fmt: skip
    plots.plot_curves(entropy, "position", "entropy", "query position", "entropy (nats)",
                      folder / "attention_entropy.png", log_x=False)  # fmt: skip
    if needle_rows:
        write_csv(folder / "attention_needle.csv", needle_rows)
        plots.plot_needle(needle_rows, folder / "attention_needle.png")
        for method in methods:
            best = max(r["needle_mass"] for r in needle_rows if r["method"] == method)
            print(f"{method:>12}: the answer token's attention on the needle, best head: {best:.1%}")


@torch.inference_mode()
def run(cfg: DictConfig) -> list[str]:
    require(cfg, ("view", "out"), "view=rope|attention out=<directory for the pictures>")
    if cfg.view not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {cfg.view!r}.")
    for switch in ("wandb", "needle"):
        check_switch(switch, cfg[switch])
    out = claim_results_directory(cfg.out, "overwrite", cfg.overwrite)
    with staged(out) as folder:  # a failed or killed run leaves no half-drawn pictures in out
        (rope_view if cfg.view == "rope" else attention_view)(cfg, folder)
        names = sorted(p.name for p in folder.iterdir())
    print(f"Wrote {cfg.out}/: {', '.join(names)}", file=sys.stderr)
    if cfg.wandb:
        log_to_wandb(cfg, out, [n for n in names if n.endswith(".png")])
    return names


def log_to_wandb(cfg: DictConfig, out: Path, pictures: list[str]) -> None:
    """The pictures as images of one wandb run (offline unless WANDB_MODE says otherwise), under out/wandb."""
    import wandb

    run = wandb.init(
        project="rope-llama",
        job_type=f"visualize-{cfg.view}",
        mode=os.environ.get("WANDB_MODE", "offline"),
        dir=str(out),
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    run.log({name.removesuffix(".png"): wandb.Image(str(out / name)) for name in pictures})
    run.finish()


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="visualize")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("visualize", cfg)  # every option before anything is loaded or written
    run(cfg)


if __name__ == "__main__":
    main()
