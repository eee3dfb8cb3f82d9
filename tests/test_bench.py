"""tools/bench.py end to end in quick mode: every section present, ratios are ours / peer.

No speed is asserted here (the machine may be busy); speed targets are reported by the script itself.
"""

import json
import math
import subprocess
import sys

import pytest

from rope_llama.model.extend import REMAP_METHODS
from tests.helpers import ROOT

pytestmark = (
    pytest.mark.hardware
)  # precision=auto's branch: .ci/run runs this file with bf16 forced on and off


def precision_native() -> bool:
    """Whether precision=auto trains in bf16 here (the suite runs this file with the answer forced both ways)."""
    from rope_llama.core.precision import bf16_is_native

    return bf16_is_native("cpu")[0]


def quick_bench(*args: str) -> subprocess.CompletedProcess:
    """`python tools/bench.py quick=true shapes=[tiny] <args>` from the repo root, output captured."""
    cmd = [sys.executable, "tools/bench.py", "quick=true", "shapes=[tiny]", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("precision, dtype", [("auto", "float32"), ("bf16", "bfloat16")])  # auto on CPU: fp32
def test_quick_bench_writes_every_section(tmp_path, precision, dtype):
    out = tmp_path / "bench.json"
    run = quick_bench(f"precision={precision}", f"out={out}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| target |" in run.stdout  # the markdown report
    assert "8/8 training step, model=tiny, eager" in run.stderr  # progress, one line per section
    r = json.loads(out.read_text())

    assert r["machine"]["cores"] >= 1 and r["machine"]["torch"] and r["machine"]["cpu"]
    assert set(r["peers"]).isdisjoint(r["peers_unavailable"])
    assert all(why for why in r["peers_unavailable"].values())  # an unavailable peer says why
    for peer, why in r["peers_unavailable"].items():  # ... at once, not only in the final report
        assert f"[bench] {peer}: skipped ({why})" in run.stderr
    if dtype == "bfloat16":  # llama.cpp decodes our fp32 GGUF, so it is left out of a bf16 run
        assert "llama.cpp" in r["peers_unavailable"]
    assert all(diff < 1e-4 for diff in r["parity_max_abs_logit_diff"].values())  # same weights on every side
    assert r["matmul_peak_flops"] > 0 and r["dtype"] == dtype

    train = r["train"][0]
    assert train["shape"] == "tiny" and not train["compile"]
    assert train["tokens_per_s"]["ours"] > 0 and 0 < train["mfu"] and train["flops_per_token"] > 0
    for peer, ratio in train["ratio"].items():  # recompute: ours / peer of the raw throughputs
        assert math.isclose(ratio, train["tokens_per_s"]["ours"] / train["tokens_per_s"][peer])

    gen = r["generate"]
    assert gen["kv_cache_bytes"] > 0 and gen["peak_rss_bytes"] > 0
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        assert all(v > 0 for v in gen[key].values()) and "ours" in gen[key]
    for peer, ratio in gen["ratio_decode"].items():
        assert math.isclose(ratio, gen["decode_tokens_per_s"]["ours"] / gen["decode_tokens_per_s"][peer])

    # ours decodes through the C step (CPU, float32 or bf16), the eager loop beside it
    decoders = ["native", "eager"]
    assert gen["decoders"] == decoders
    assert set(gen["decode_tokens_per_s"]) >= {"ours", *(f"ours_{path}" for path in decoders[1:])}
    latency = r["decode_latency"]
    assert latency["decoder"] == decoders[0] and list(latency["seconds_per_token_by_decoder"]) == decoders
    assert latency["seconds_per_token"] == latency["seconds_per_token_by_decoder"][decoders[0]]
    assert list(latency["seconds_per_token"]) == ["16", "64"]
    assert all(s > 0 for s in latency["seconds_per_token"].values())
    assert latency["kv_cache_bytes"]["64"] > latency["kv_cache_bytes"]["16"]
    assert (
        set(latency["peer_seconds_per_token"])
        == set(latency["ratio_by_context"])
        == {"llama.cpp"} & set(r["peers"])
    )

    se = r["self_extend"]  # Self-Extend off vs on, same weights, prefill and eager decode (quick: no compile)
    assert se["context"] == 96 and set(se["on_over_off"]) == {"prefill", "eager"} and not se["errors"]
    assert math.isclose(
        se["on_over_off"]["prefill"], se["prefill_tokens_per_s"]["on"] / se["prefill_tokens_per_s"]["off"]
    )
    assert se["kv_cache_bytes"]["on"] > se["kv_cache_bytes"]["off"]  # the grouped keys
    assert "| Self-Extend (W=64, G=32) at context 96 |" in run.stdout

    scoring = r["scoring"]  # ours (score_tokens) against transformers' forward + cross-entropy
    dtypes = ["float32", "bfloat16"] if precision_native() else ["float32"]
    assert (
        list(scoring["tokens_per_s"]) == [f"{d}_{n}" for d in dtypes for n in (32, 96)]
        and not scoring["errors"]
    )
    for key, rates in scoring["tokens_per_s"].items():
        assert rates["ours"] > 0
        for peer, ratio in scoring["ratio"][key].items():
            assert math.isclose(ratio, rates["ours"] / rates[peer])
    remaps = scoring["remaps"]  # every remap against plain attention, same weights, one run
    assert remaps["length"] == 96 and set(remaps["over_plain"]) == set(REMAP_METHODS)
    for method, ratio in remaps["over_plain"].items():
        assert math.isclose(ratio, remaps["tokens_per_s"][method] / remaps["tokens_per_s"]["off"])
    assert "| 96 tokens, float32 |" in run.stdout

    threads = r["threads"]  # 1 thread against one per core, quiet and beside a training-like process
    counts = [str(n) for n in threads["thread_counts"]]
    assert counts[0] == "1" and counts[-1] == str(threads["cores"]) and not threads["errors"]
    for condition in ("quiet", "loaded"):
        rates = threads["tokens_per_s"][condition]
        assert set(rates) == {"decode_eager", "decode_native", "score"}
        assert all(rates[name][c] > 0 for name in rates for c in counts)
        for name, ratio in threads["one_over_all"][condition].items():
            assert math.isclose(ratio, rates[name]["1"] / rates[name][counts[-1]])
    # the load takes every core, so auto leaves it all but one (at least one)
    assert (
        threads["auto_threads"]["loaded"] == 1
        if threads["cores"] <= 2
        else threads["auto_threads"]["loaded"] < threads["cores"]
    )
    assert "| loaded | decode_eager |" in run.stdout

    rope = r["rope"]
    assert rope["calls_per_s"]["ours"] > 0
    for peer, ratio in rope["ratio"].items():
        assert math.isclose(ratio, rope["calls_per_s"]["ours"] / rope["calls_per_s"][peer])
    expected_peers = {"transformers", "litgpt"} & set(r["peers"])
    assert expected_peers <= set(train["ratio"]) and expected_peers <= set(gen["ratio_decode"])

    assert {t["name"] for t in r["targets"]} >= {"train_eager_vs_transformers", "rope_vs_transformers"}
    assert all(t["met"] in (True, False, None) for t in r["targets"])


def test_unknown_argument_is_one_sentence():
    run = subprocess.run(
        [sys.executable, "tools/bench.py", "shape=tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "unknown arguments ['shape']" in run.stderr


def test_bad_shape_or_output_fails_before_benchmarking(tmp_path):
    """A typo in a shape or an unwritable output must stop the run at once, not after minutes."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for args, message in [
        (["shapes=[tiny,smal]"], "unknown shapes ['smal']"),
        ([f"out={blocker}/bench.json"], "cannot create the directory"),
        (["precision=fp16"], "precision=fp16 is unknown; allowed are auto, fp32, bf16"),
    ]:
        run = subprocess.run(
            [sys.executable, "tools/bench.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
        assert "[bench" not in run.stderr  # no section started


@pytest.mark.slow  # needs the llama.cpp extra (requirements-gguf.txt), which `make test-slow` installs
def test_quick_bench_times_llama_cpp_on_our_weights(tmp_path):
    import llama_cpp  # noqa: F401 (fails here, not as a skip, when the extra is missing)

    out = tmp_path / "bench.json"
    run = quick_bench("peers=[llama.cpp]", f"out={out}")
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert list(r["peers"]) == ["llama.cpp"] and r["parity_max_abs_logit_diff"]["llama.cpp"] < 1e-4
    gen = r["generate"]
    assert gen["decode_tokens_per_s"]["llama.cpp"] > 0
    assert math.isclose(
        gen["ratio_decode"]["llama.cpp"],
        gen["decode_tokens_per_s"]["ours"] / gen["decode_tokens_per_s"]["llama.cpp"],
    )
    latency = r["decode_latency"]
    theirs, ratio = latency["peer_seconds_per_token"]["llama.cpp"], latency["ratio_by_context"]["llama.cpp"]
    assert list(theirs) == list(ratio) == ["16", "64"] and all(s > 0 for s in theirs.values())
    for ctx, s in theirs.items():  # ours / llama.cpp in tokens/s = their seconds / ours
        assert math.isclose(ratio[ctx], s / latency["seconds_per_token"][ctx])
    assert "| ours / llama.cpp |" in run.stdout


def test_quick_bench_times_training_in_every_requested_precision(tmp_path):
    """precision=fp32 plus train_precisions=[bf16]: both training runs, each MFU against its own dtype's
    matmul peak, and the bf16 ratio is what the bf16 target reads."""
    out = tmp_path / "bench.json"
    run = quick_bench("precision=fp32", "train_precisions=[bf16]", "peers=[transformers]", f"out={out}")
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert [t["dtype"] for t in r["train"]] == ["float32", "bfloat16"]
    peaks = r["matmul_peak_flops_by_dtype"]
    assert set(peaks) == {"float32", "bfloat16"} and r["matmul_peak_flops"] == peaks["float32"]
    for t in r["train"]:
        assert math.isclose(t["mfu"], t["achieved_flops"] / peaks[t["dtype"]])
    targets = {t["name"]: t for t in r["targets"]}
    if "transformers" in r["peers"]:
        assert targets["train_bf16_vs_transformers"]["value"] == r["train"][1]["ratio"]["transformers"]
    assert "eager bfloat16" in run.stdout


def test_bench_refuses_an_unknown_training_precision(tmp_path):
    run = quick_bench("train_precisions=[fp8]", f"out={tmp_path / 'b.json'}")
    assert run.returncode != 0 and "train_precisions ['fp8'] are unknown" in run.stderr


@pytest.mark.parametrize(
    "native, names, expected",
    [
        (True, ["auto"], ["bf16"]),
        (False, ["auto"], []),  # emulated bf16: no training rows in it unless asked for by name
        (False, ["bf16"], ["bf16"]),
        (True, ["bf16", "auto"], ["bf16"]),
        (False, ["fp32", "auto"], ["fp32"]),
    ],
)
def test_auto_training_precisions_add_bf16_only_where_it_is_native(
    monkeypatch, capsys, native, names, expected
):
    import torch

    from rope_llama.bench import training

    monkeypatch.setattr(training, "bf16_is_native", lambda accelerator: (native, "the reason"))
    assert training.resolve_train_precisions(names, torch.device("cpu")) == expected
    assert ("the reason" in capsys.readouterr().err) == ("auto" in names)


def test_bench_prepare_measures_each_engine_and_refuses_bad_arguments(tmp_path):
    """tools/bench_prepare.py: a table row per engine and worker count (an engine that is not installed is
    reported); a bad argument is one sentence with exit status 2."""
    from tests.helpers import text_tokenizer

    tokenizer = text_tokenizer(tmp_path).path
    tool = [sys.executable, str(ROOT / "tools" / "bench_prepare.py")]
    run = subprocess.run([*tool, f"tokenizer={tokenizer}", "copies=1", "workers=[1]", "engines=[datasets,litdata]"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| datasets | 1 | ")]
    assert len(rows) == 1 and int(rows[0].split("|")[3].replace(",", "")) > 100_000  # tokens written
    assert "| litdata | 1 | " in run.stdout  # measured, or "not importable" where LitData is absent
    bad = subprocess.run(
        [*tool, f"tokenizer={tokenizer}", "engines=[arrow]"], cwd=ROOT, capture_output=True, text=True
    )
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: engines ['arrow'] are unknown; valid are datasets, litdata."
    )
