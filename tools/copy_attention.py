"""Where does a model's copy attend when it answers the passkey? Attention of the prompt's last token, by depth.

    python tools/copy_attention.py ckpt=runs/<recall_base run>
    python tools/copy_attention.py ckpt=runs/<run> length=256 trials=8 heads=6

The passkey question ends in " is", a token the filler repeats ("The sky is blue.") and the needle holds
once ("The pass key is 73912."). A copy head at the question's last token should attend to the position
after the needle's " is" (the key's first token) rather than to the positions after the filler's. For
each depth of the needle this prints, over `trials` prompts (scripts/passkey.py's wording, plain
attention, the checkpoint's own RoPE): the probability of the key's first token, the same with the needle
cut out of the prompt (what the question's wording alone predicts), and how often it is the most likely
token, then for the `heads` heads that attend most to the needle, their attention mass on the
needle's answer position and on the other positions after the last token, and the logit gap (needle
minus the mean of the others). A gap that falls as the needle moves away is a recency preference that
loses far keys to the repeated filler (reports/2026-11-27-recall-rounds.md, fifteenth round).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from omegaconf import OmegaConf

from rope_llama.cli.errors import USER_ERRORS, one_sentence_errors
from rope_llama.core.checks import check_number
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.loading import load_model
from rope_llama.inference.retrieval import NEEDLE, QUESTION, RetrievalPrompt, build_prompt
from rope_llama.model.llama import Llama


@dataclass
class CopyAttentionConfig:
    ckpt: str = "???"  # a .ckpt file or a run directory
    length: int = 256  # prompt length in tokens
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 4  # prompts per depth, each with its own key
    heads: int = 4  # heads shown: those with the most attention on the needle, over all depths
    question: str = "".join(
        QUESTION
    )  # asked at the end; another one (" What is the black ring? The black ring is")
    # shows what its wording alone predicts, in the line "without the needle"
    seed: int = 0


def answer_positions(tokens: list[int], needle_start: int) -> tuple[int, list[int]]:
    """The needle's answer position (the first token after the needle's copy of the prompt's last token)
    and the positions after every other earlier copy of that token, excluding the last position."""
    last = tokens[-1]
    after = [j + 1 for j in range(len(tokens) - 2) if tokens[j] == last]
    in_needle = [p for p in after if p - 1 >= needle_start]
    if not in_needle:
        raise ValueError("the prompt's last token does not occur in its needle: no copy position to look at.")
    needle = in_needle[0]
    return needle, [p for p in after if p != needle]


def asking(prompt: RetrievalPrompt, tok: Tokenizer, question: str) -> RetrievalPrompt:
    """The passkey prompt with `question` in place of its own (the same prompt when it is the passkey's)."""
    if not question.strip():
        raise ValueError(
            f"question must be a non-empty text ending where the answer starts, got {question!r}."
        )
    tokens = prompt.tokens[: len(prompt.tokens) - len(tok.encode("".join(QUESTION)))] + tok.encode(question)
    return replace(prompt, tokens=tokens)


def without_needle(prompt: RetrievalPrompt, tok: Tokenizer) -> list[int]:
    """A passkey prompt's tokens with its needle cut out: filler, then the question."""
    end = prompt.needle_start + len(tok.encode(NEEDLE.format(key=prompt.answer)))
    return prompt.tokens[: prompt.needle_start] + prompt.tokens[end:]


@contextmanager
def last_query_attention(model: Llama):
    """Within the block, each plain-attention forward records its last query's attention logits:
    yields {layer: (B, H, S)}, scaled as scaled_dot_product_attention scales them (1 / sqrt(D))."""
    logits: dict[int, torch.Tensor] = {}
    layers = [block.attn for block in model.blocks]

    def recording(attn):
        plain = attn.attend

        def attend(q, k, v, mask, is_causal, dropout_p):
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, D), GQA groups expanded
            logits[attn.layer] = (q[:, :, -1:] @ keys.transpose(-1, -2))[:, :, 0] / q.shape[-1] ** 0.5
            return plain(q, k, v, mask, is_causal, dropout_p)

        return attend

    for attn in layers:
        attn.attend = recording(attn)  # an instance attribute shadows the method until removed
    try:
        yield logits
    finally:
        for attn in layers:
            del attn.attend


def measure(cfg: CopyAttentionConfig) -> dict:
    """Per depth: 'p_answer' (mean probability of the key's first token), 'p_answer_no_needle' (the same
    with the needle cut out), 'top' (share of prompts where it is the most likely token), 'needle' and
    'others' (L, H) attention masses, 'gap' (L, H) logit gaps."""
    for name in ("length", "trials", "heads"):
        value = getattr(cfg, name)
        check_number(name, value, minimum=1, integer=True, allowed="a positive integer")
    loaded, tok = load_model(cfg.ckpt)
    model = loaded.model.eval()
    rng = np.random.default_rng(cfg.seed)
    results = {}
    for depth in cfg.depths:
        rows = []
        for _ in range(cfg.trials):
            prompt = asking(build_prompt("passkey", tok, cfg.length, depth, rng), tok, cfg.question)
            needle, others = answer_positions(prompt.tokens, prompt.needle_start)
            with torch.no_grad(), last_query_attention(model) as logits:
                out = model(torch.tensor([prompt.tokens]))
            probs = out[0, -1].float().softmax(-1)
            answer = prompt.tokens[needle]  # the key's first token, copied from the needle
            with torch.no_grad():
                unprompted = model(torch.tensor([without_needle(prompt, tok)]))
            scores = torch.stack([logits[layer][0] for layer in sorted(logits)])  # (L, H, S)
            attention = scores.softmax(-1)
            rows.append(
                (
                    probs[answer].item(),
                    unprompted[0, -1].float().softmax(-1)[answer].item(),
                    float(probs.argmax().item() == answer),
                    attention[..., needle],
                    attention[..., others].sum(-1),
                    scores[..., needle] - scores[..., others].mean(-1),
                )
            )
        p, p_alone, top, needle_mass, other_mass, gap = zip(*rows)
        results[depth] = {
            "p_answer": float(np.mean(p)),
            "p_answer_no_needle": float(np.mean(p_alone)),
            "top": float(np.mean(top)),
            "needle": torch.stack(needle_mass).mean(0),
            "others": torch.stack(other_mass).mean(0),
            "gap": torch.stack(gap).mean(0),
        }
    return results


def report(results: dict, heads: int) -> str:
    """The table `measure`'s results make: one line per depth, then one per shown head."""
    depths = list(results)
    needle_mean = torch.stack([results[d]["needle"] for d in depths]).mean(0)  # (L, H)
    n_heads = needle_mean.shape[1]
    shown = needle_mean.flatten().argsort(descending=True)[:heads].tolist()
    lines = ["depth:                    " + "".join(f"{d:>18}" for d in depths)]
    lines.append("P(key's first token):     " + "".join(f"{results[d]['p_answer']:>18.2f}" for d in depths))
    lines.append(
        "... without the needle:   " + "".join(f"{results[d]['p_answer_no_needle']:>18.2f}" for d in depths)
    )
    lines.append("most likely token:        " + "".join(f"{results[d]['top']:>17.0%} " for d in depths))
    lines.append("layer.head: needle mass / other matches' mass / logit gap")
    for i in sorted(shown):
        layer, head = divmod(i, n_heads)
        cells = [
            f"{results[d]['needle'][layer, head]:.2f}/{results[d]['others'][layer, head]:.2f}/"
            f"{results[d]['gap'][layer, head]:+.1f}"
            for d in depths
        ]
        lines.append(f"  {layer}.{head}:                    " + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


@one_sentence_errors(errors=USER_ERRORS)
def main(argv: list[str]) -> None:
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(CopyAttentionConfig), OmegaConf.from_dotlist(argv))
    )
    print(report(measure(cfg), cfg.heads))


if __name__ == "__main__":
    main(sys.argv[1:])
