"""tools/bench.py's report: the targets (re-set from measured limits: docs/performance.md) and the
markdown tables of one run."""

from __future__ import annotations

from rope_llama.bench.time_to_quality import markdown as ttq_markdown
from rope_llama.model.extend import EXTEND_NAMES, REMAP_METHODS

TARGETS = [  # (name, description, comparison, threshold); re-set from measured limits, see docs/performance.md
    ("train_eager_vs_transformers", "training tokens/s, default shape, eager, vs transformers", ">=", 1.0),
    (
        "train_compile_vs_transformers",
        "training tokens/s, default shape, compiled, vs transformers",
        ">=",
        1.0,
    ),
    (
        "train_bf16_vs_transformers",
        "training tokens/s, default shape, eager, bf16 autocast, vs transformers",
        ">=",
        1.25,
    ),
    ("decode_vs_transformers", "decode tokens/s vs transformers generate", ">=", 4.0),
    ("decode_vs_litgpt", "decode tokens/s vs litgpt generate", ">=", 2.0),
    ("latency_longest_over_shortest", "decode latency at the longest context / the shortest", "<=", 2.2),
    ("rope_vs_transformers", "RoPE op (fwd + bwd, q and k) vs transformers apply_rotary_pos_emb", ">=", 1.5),
    ("train_mfu", "training MFU, default shape, eager, vs the measured matmul peak of its dtype", ">=", 0.55),
    *[  # scoring: fp32 against fp32, and bf16 against bf16 where the device multiplies it natively
        (f"score_{tag}{n}_vs_transformers", f"scoring {n:,} tokens, {what}, vs transformers + CE", ">=", 1.3)
        for tag, what in (("", "fp32"), ("bf16_", "bf16"))
        for n in (1024, 4096)
    ],
    ("prefill_vs_llama_cpp", "prefill tokens/s vs llama.cpp", ">=", 1.0),
    ("prefill_vs_litgpt", "prefill tokens/s vs litgpt", ">=", 1.0),
    *[  # every remap's scoring against plain attention, same weights, one interleaved run
        (
            f"{m}_scoring",
            f"scoring with {EXTEND_NAMES[m]} / without, at the longest scoring length",
            ">=",
            0.8,
        )
        for m in REMAP_METHODS
    ],
]


def target_values(results: dict) -> dict:
    default, dtype = results["shapes"][0], results["dtype"]
    train = {(t["shape"], t["compile"], t["dtype"]): t for t in results["train"]}
    eager, compiled = train.get((default, False, dtype), {}), train.get((default, True, dtype), {})
    bf16 = train.get((default, False, "bfloat16"), {})
    scoring = results.get("scoring", {})
    return {
        "train_eager_vs_transformers": eager.get("ratio", {}).get("transformers"),
        "train_compile_vs_transformers": compiled.get("ratio", {}).get("transformers"),
        "train_bf16_vs_transformers": bf16.get("ratio", {}).get("transformers"),
        "decode_vs_transformers": results["generate"]["ratio_decode"].get("transformers"),
        "decode_vs_litgpt": results["generate"]["ratio_decode"].get("litgpt"),
        "latency_longest_over_shortest": results["decode_latency"]["longest_over_shortest"],
        "rope_vs_transformers": results["rope"]["ratio"].get("transformers"),
        "train_mfu": eager.get("mfu"),
        **{
            f"score_{tag}{n}_vs_transformers": scoring.get("ratio", {})
            .get(f"{dtype}_{n}", {})
            .get("transformers")
            for tag, dtype in (("", "float32"), ("bf16_", "bfloat16"))
            for n in (1024, 4096)
        },
        "prefill_vs_llama_cpp": results["generate"]["ratio_prefill"].get("llama.cpp"),
        "prefill_vs_litgpt": results["generate"]["ratio_prefill"].get("litgpt"),
        **{f"{m}_scoring": scoring.get("remaps", {}).get("over_plain", {}).get(m) for m in REMAP_METHODS},
    }


def evaluate_targets(results: dict) -> list[dict]:
    values = target_values(results)
    rows = []
    for name, what, op, threshold in TARGETS:
        value = values[name]
        met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
        rows.append(dict(name=name, what=what, value=value, target=f"{op} {threshold}", met=met))
    return rows


def fmt(x) -> str:
    return "-" if x is None else f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"


def markdown(results: dict) -> str:
    lines = ["| measurement | side | ours | peer | ours / peer |", "|---|---|---|---|---|"]

    def rows(label, values, ratio):
        for side, r in ratio.items():
            lines.append(f"| {label} | {side} | {fmt(values['ours'])} | {fmt(values[side])} | {r:.2f}x |")
        if not ratio and "ours" in values:
            lines.append(f"| {label} | - | {fmt(values['ours'])} | - | - |")

    for t in results["train"]:
        mode = "compiled" if t["compile"] else "eager"
        label = f"train tok/s {t['shape']} {t['batch']}x{t['seq_len']} {mode} {t['dtype']}"
        rows(label, t["tokens_per_s"], t["ratio"])
    g = results["generate"]
    rows(f"prefill tok/s (prompt {g['prompt_len']})", g["prefill_tokens_per_s"], g["ratio_prefill"])
    rows(f"decode tok/s ({g['new_tokens']} new)", g["decode_tokens_per_s"], g["ratio_decode"])
    r = results["rope"]
    rows(f"RoPE fwd+bwd calls/s {tuple(r['shape_BHLD'])}", r["calls_per_s"], r["ratio"])
    latency = results["decode_latency"]
    columns = {f"ours ({path})": s for path, s in latency["seconds_per_token_by_decoder"].items()}
    columns |= latency["peer_seconds_per_token"]  # {side: {context: seconds}}
    ratios_by_context = latency["ratio_by_context"]
    header = [f"{side} ms / token" for side in columns] + [f"ours / {peer}" for peer in ratios_by_context]
    lines += ["", "| context | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for ctx in latency["seconds_per_token"]:
        cells = [f"{1000 * s[ctx]:.2f}" for s in columns.values()]
        cells += [f"{r[ctx]:.2f}x" for r in ratios_by_context.values()]
        lines.append(f"| {ctx} | " + " | ".join(cells) + " |")
    if "scoring" in results:
        lines += ["", scoring_markdown(results["scoring"])]
    se = results["self_extend"]
    lines += [
        "",
        f"| Self-Extend (W={se['window']}, G={se['group']}) at context {se['context']} | off | on | on / off |",
    ]
    lines.append("|---|---|---|---|")
    for what, ratio in se["on_over_off"].items():
        rates = (
            se["prefill_tokens_per_s"]
            if what == "prefill"
            else {side: se["decode_tokens_per_s"][f"{side}_{what}"] for side in ("off", "on")}
        )
        label = "prefill tok/s" if what == "prefill" else f"decode tok/s ({what})"
        lines.append(f"| {label} | {fmt(rates['off'])} | {fmt(rates['on'])} | {ratio:.2f}x |")
    if "threads" in results:
        lines += ["", threads_markdown(results["threads"])]
    if "time_to_quality" in results:
        lines += [
            "",
            ttq_markdown(results["time_to_quality"], sorted(results["args"]["ttq_thresholds"], reverse=True)),
        ]
    lines += ["", "| target | value | wanted | met |", "|---|---|---|---|"]
    for t in results["targets"]:
        met = "not measured" if t["met"] is None else "yes" if t["met"] else "no"
        lines.append(f"| {t['what']} | {fmt(t['value'])} | {t['target']} | {met} |")
    errors = {**results["peers_unavailable"]}
    for section in (*results["train"], results["generate"], results["self_extend"], results["rope"]):
        errors |= {
            f"{side} ({section.get('shape', '')}{' compiled' if section.get('compile') else ''})": e
            for side, e in section["errors"].items()
        }
    errors |= results.get("threads", {}).get("errors", {}) | results.get("scoring", {}).get("errors", {})
    lines += [f"\nunavailable / failed: {name}: {why}" for name, why in errors.items()]
    return "\n".join(lines)


def threads_markdown(t: dict) -> str:
    """tokens/s by thread count, quiet and loaded, with 1 / all and the count threads=auto picked."""
    counts = [str(n) for n in t["thread_counts"]]
    header = [f"{c} thread{'s' * (c != '1')} tok/s" for c in counts]
    lines = [
        "| condition | workload | " + " | ".join(header) + " | 1 / all | auto picks |",
        "|---|---|" + "---|" * (len(header) + 2),
    ]
    for condition, by_name in t["tokens_per_s"].items():
        for name, rates in by_name.items():
            cells = [fmt(rates.get(c)) for c in counts]
            ratio = t["one_over_all"][condition].get(name)
            ratio_cell = "-" if ratio is None else f"{ratio:.2f}x"
            lines.append(
                f"| {condition} | {name} | "
                + " | ".join(cells)
                + f" | {ratio_cell} | {t['auto_threads'][condition]} |"
            )
    return "\n".join(lines)


def remap_scoring_markdown(r: dict) -> str:
    """Scoring tokens/s with each remap and without, and the ratio, at one length."""
    plain = r["tokens_per_s"].get("off")
    lines = [
        f"| scoring {r['length']:,} tokens, fp32 | parameters | tok/s | over plain attention ({fmt(plain)} tok/s) |",
        "|---|---|---|---|",
    ]
    for method, params in r["parameters"].items():
        ratio = r["over_plain"].get(method)
        cells = ", ".join(f"{k}={v}" for k, v in params.items())
        lines.append(
            f"| {method} | {cells} | {fmt(r['tokens_per_s'].get(method))} | "
            + ("-" if ratio is None else f"{ratio:.2f}x")
            + " |"
        )
    return "\n".join(lines)


def scoring_markdown(r: dict) -> str:
    """Scoring tokens/s per dtype and length, ours against transformers, and every remap against plain."""
    lines = ["| scoring (tok/s) | ours | transformers | ours / transformers |", "|---|---|---|---|"]
    for key, rates in r["tokens_per_s"].items():
        dtype, length = key.rsplit("_", 1)
        ratio = r["ratio"][key].get("transformers")
        lines.append(
            f"| {int(length):,} tokens, {dtype} | {fmt(rates.get('ours'))} | {fmt(rates.get('transformers'))} | "
            + ("-" if ratio is None else f"{ratio:.2f}x")
            + " |"
        )
    if "remaps" in r:
        lines += ["", remap_scoring_markdown(r["remaps"])]
    return "\n".join(lines)
