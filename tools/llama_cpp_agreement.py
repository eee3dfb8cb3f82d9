"""How closely does llama.cpp, running a GGUF file, agree with our checkpoint of it?

    python tools/llama_cpp_agreement.py ckpt=runs/smollm2 gguf=SmolLM2-135M-Instruct.Q4_1.gguf
    python tools/llama_cpp_agreement.py ckpt=runs/smollm2 gguf=exports/smollm2-f32.gguf positions=512 splits=[test]
    python tools/llama_cpp_agreement.py ckpt=runs/smollm2 gguf=<the Q4_1 file> against=exports/smollm2-f32.gguf

For the first `positions` tokens of every held-out Shakespeare play (`splits`), both score the same token
ids in one forward (llama.cpp with every position's logits and an fp32 KV cache, in plain CPU buffers):
top-1 agreement, agreement where our top token leads by `near_tie` logits or more (and the share of such
positions), and the largest and mean per-position max |logit difference|. A checkpoint imported by
scripts/import_gguf.py and its own source file are the intended pair: reports/2026-12-01-real-model-import.md.
With `against=<another .gguf>` the reference is llama.cpp itself on that file instead of our checkpoint
(the checkpoint then gives only the tokenizer): llama.cpp on a quantized file against its own run on an
f32 re-export of the same (dequantized) weights, the ceiling its quantized arithmetic leaves any importer.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from rope_llama.bench.peers import llama_cpp_model
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.data.sources import load_documents
from rope_llama.data.tokenizer import Tokenizer

DEFAULTS = {"ckpt": "???", "gguf": "???", "positions": 1024, "splits": ["val", "test"], "near_tie": 1.0}
DEFAULTS |= {"threads": 2, "against": None}


def compare(ours: np.ndarray, theirs: np.ndarray, near_tie: float) -> dict:
    agree = ours.argmax(-1) == theirs.argmax(-1)
    top2 = np.sort(ours, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= near_tie
    diff = np.abs(ours - theirs).max(-1)
    return {
        "agree": float(agree.mean()),
        "agree_clear": float(agree[clear].mean()) if clear.any() else float("nan"),
        "clear": float(clear.mean()),
        "max_diff": float(diff.max()),
        "mean_diff": float(diff.mean()),
    }


@one_sentence_errors
def main(argv: list[str]) -> list[dict]:
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_cli(argv))
    for key in ("ckpt", "gguf"):
        if OmegaConf.is_missing(cfg, key):
            raise ValueError(f"No {key} given; pass ckpt=<checkpoint or run directory> gguf=<file.gguf>.")
    torch.set_num_threads(cfg.threads)
    loaded = load_checkpoint(cfg.ckpt)
    tokenizer = Tokenizer(str(loaded.tokenizer_file()))
    documents = load_documents({"kind": "shakespeare"})
    llm = llama_cpp_model(cfg.gguf, cfg.positions, threads=cfg.threads, logits_all=True, extra_buffers=False)
    reference = None  # llama.cpp on `against`, when given, in place of our checkpoint
    if cfg.against is not None:
        reference = llama_cpp_model(
            cfg.against, cfg.positions, threads=cfg.threads, logits_all=True, extra_buffers=False
        )
    rows = []
    try:
        for split in cfg.splits:
            for document in documents[split]:
                ids = tokenizer.encode(document[: 40 * cfg.positions])[: cfg.positions]
                start = time.perf_counter()
                llm.reset()
                llm.eval(ids)
                theirs = np.array(llm.scores[: len(ids)])
                seconds = time.perf_counter() - start
                if reference is None:
                    with torch.no_grad():
                        ours = loaded.model(torch.tensor([ids]))[0].numpy()
                else:  # llama.cpp on the other file is the reference
                    reference.reset()
                    reference.eval(ids)
                    ours = np.array(reference.scores[: len(ids)])
                title = document.split("\n", 1)[0]
                row = {"split": split, "play": title, "positions": len(ids), "llama_cpp_s": seconds}
                rows.append(row | compare(ours, theirs, cfg.near_tie))
                print(
                    f"{split:5} {title[:24]:24} {len(ids):5} positions: top-1 {rows[-1]['agree']:.2%}, "
                    f"{rows[-1]['agree_clear']:.2%} where {'ours' if reference is None else 'the reference'} leads by >= {cfg.near_tie} "
                    f"({rows[-1]['clear']:.0%} of positions); max |diff| {rows[-1]['max_diff']:.2e}, "
                    f"mean {rows[-1]['mean_diff']:.2e}; llama.cpp {seconds:.1f} s"
                )
    finally:
        llm.close()
        if reference is not None:
            reference.close()
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
