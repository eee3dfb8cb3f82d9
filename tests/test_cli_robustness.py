"""Every entry point against every class of bad input, as a user runs it: one table, one test.

Each row runs `python train.py ...`, `python generate.py ...` or `python scripts/<x>.py ...` from the
repository root and checks the exit code, the `error: ` line on stderr (never a traceback) and what must
(not) have happened on disk. The deeper test of each guarantee lives elsewhere (docs/reliability.md);
this table is the one place that shows every class of case side by side.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rope_llama.core.checkpoint import atomic_torch_save, file_sha256, load_checkpoint, safe_load
from tests.helpers import (
    CONFIGS,
    ROOT,
    crafted_checkpoint,
    refusal,
    save_run,
    small_corpus,
    text_tokenizer,
    tiny,
    tiny_overrides,
    tree,
)

TRAIN, GENERATE = "train.py", "generate.py"
EVAL, PASSKEY, STUDY = "scripts/eval_extrapolation.py", "scripts/passkey.py", "scripts/study.py"
EXPORT_HF, IMPORT_HF, EXPORT_GGUF = "scripts/export_hf.py", "scripts/import_hf.py", "scripts/export_gguf.py"
GGUF = (ROOT / EXPORT_GGUF).exists()  # being written in parallel: its row joins the table once it exists
CLASSES = (
    "bad numbers",
    "huge sizes",
    "corrupt or foreign files",
    "self-overwrite",
    "another result",
    "crafted pickles",
    "crash",
)
CORRUPT_JSON = b'{"version": "1.0", "model"'  # a tokenizer.json cut off mid-file


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    script: str  # the entry point, relative to the repository root
    args: str  # space-separated; {NAME} from the row's context (`context`, SETUPS); {TINY}, {DATA}: option lists
    code: int  # the expected exit status
    fragment: str  # in the last error line, or in a success row's output; {NAME} allowed, " ... " = any text
    setup: str = ""  # SETUPS to run first, comma-separated
    post: str = ""  # POST checks afterwards, comma-separated
    lines: int | None = 1  # stderr lines of an error row, every one `error: ...`; None: only the last one is
    # (an error found during training follows the trainer's own output)
    kind: str = ""  # the class of case, set by `rows`


def rows(kind: str, *members: Row) -> list[Row]:
    return [dataclasses.replace(row, kind=kind) for row in members]


# ----------------------------------------------------------------------------- the table

ROWS = [
    *rows("bad numbers",
        Row("train-max-steps-negative", TRAIN, "{TINY} trainer.max_steps=-1", 2,
            "trainer.max_steps must be an integer >= 1, got -1.",
            post="no run dir"),
        Row("train-compile-not-a-choice", TRAIN, "{TINY} compile=yes", 2,
            "compile must be true, false or auto, got 'yes'.", post="no run dir"),
        Row("train-batch-not-split-over-processes", TRAIN,
            "{TINY} trainer=ddp trainer.accelerator=cpu trainer.devices=2 data.batch_size=3", 2,
            "data.batch_size=3 must be a multiple of the 2 data-parallel processes", post="no run dir"),
        Row("train-rope-factor-below-one", TRAIN, "{TINY} rope=linear rope.factor=0.5", 2,
            "rope.factor must be a finite number in [1, 1048576] (1 = no scaling) or null (derived by model/context.py), got 0.5.", post="no run dir"),
        Row("generate-top-p-2", GENERATE, "ckpt={RUN} prompt=ROMEO: top_p=2", 2,
            "top_p must be a finite number in (0, 1], got 2.", post="nothing printed"),
        Row("generate-max-new-tokens-negative", GENERATE, "ckpt={RUN} prompt=ROMEO: max_new_tokens=-1", 2,
            "max_new_tokens must be an integer >= 1, got -1.", post="nothing printed"),
        Row("generate-start-pos-negative", GENERATE, "ckpt={RUN} prompt=ROMEO: start_pos=-1", 2,
            "start_pos must be an integer >= 0, got -1.", post="nothing printed"),
        # {RUN} has no saved training config: had the data been loaded first, the sentence would say so
        Row("eval-unknown-method", EVAL, "ckpt={RUN} out={OUT} lengths=[32] methods=[warp]", 2,
            "Unknown method 'warp'; a method is a RoPE method (none, linear, ", post="nothing written to out"),
        Row("passkey-zero-trials", PASSKEY, "ckpt={RUN} out={OUT} lengths=[32] trials=0", 2,
            "trials must be an integer >= 1, got 0.", post="nothing written to out"),
        Row("eval-extend-group-zero", EVAL, "ckpt={RUN} out={OUT} lengths=[32] methods=[self_extend] extend_options.group=0", 2,
            "extend_options.group must be matched or an integer >= 1 (a group size) or null (the checkpoint's), got 0.", post="nothing written to out"),
        Row("passkey-extend-group-word", PASSKEY, "ckpt={RUN} out={OUT} lengths=[32] methods=[self_extend] extend_options.group=fitted", 2,
            "extend_options.group must be matched or an integer >= 1 (a group size) or null (the checkpoint's), got 'fitted'.", post="nothing written to out"),
        # OmegaConf's own refusal of a typed field names the option only in a detail line: the error line leads with it
        Row("study-finetune-seeds-fraction", STUDY, "out={OUT} finetune_seeds=1.5", 2,
            "finetune_seeds: Value '1.5' of type 'float' could not be converted to Integer", post="nothing written to out"),
        Row("generate-extend-window-zero", GENERATE, "ckpt={RUN} prompt=ROMEO: extend=self_extend extend.window=0", 2,
            "extend.window must be an integer >= 1 (a number of positions), got 0.", post="nothing printed"),
        # the reliability probe's cases: each was a traceback, a silent wrong result or a late refusal
        Row("train-val-check-interval-zero", TRAIN, "{TINY} trainer.val_check_interval=0", 2,
            "trainer.val_check_interval must be an integer >= 1 or a finite number in (0, 1], got 0.", post="no run dir"),
        Row("train-accumulate-zero", TRAIN, "{TINY} trainer.accumulate_grad_batches=0", 2,
            "trainer.accumulate_grad_batches must be an integer >= 1, got 0.", post="no run dir"),
        Row("train-clip-negative", TRAIN, "{TINY} trainer.gradient_clip_val=-1", 2,
            "trainer.gradient_clip_val must be a finite number >= 0 or null (no clipping), got -1.", post="no run dir"),
        Row("train-precision-bogus", TRAIN, "{TINY} trainer.precision=bogus", 2,
            "trainer.precision must be one of auto, 32-true", post="no run dir"),
        Row("train-min-lr-ratio-negative", TRAIN, "{TINY} optim.min_lr_ratio=-3", 2,
            "optim.min_lr_ratio must be a finite number in [0, 1], got -3.", post="no run dir"),
        Row("train-lr-zero", TRAIN, "{TINY} optim.lr=0", 2, "optim.lr must be a finite number in (0, 10], got 0.",
            post="no run dir"),
        Row("train-lr-nan", TRAIN, "{TINY} optim.lr=nan", 2, "optim.lr must be a finite number in (0, 10], got nan.",
            post="no run dir"),
        Row("train-warmup-negative", TRAIN, "{TINY} optim.warmup_steps=-5", 2,
            "optim.warmup_steps must be an integer >= 0, got -5.", post="no run dir"),
        Row("train-weight-decay-negative", TRAIN, "{TINY} optim.weight_decay=-1", 2,
            "optim.weight_decay must be a finite number in [0, 10], got -1.", post="no run dir"),
        Row("train-beta-one", TRAIN, "{TINY} optim.betas=[0.9,1.0]", 2,
            "optim.betas must be a list, each a finite number in [0, 1), got [0.9, 1.0].", post="no run dir"),
        Row("train-kernels-maybe", TRAIN, "{TINY} kernels=maybe", 2, "kernels must be true or false, got 'maybe'.",
            post="no run dir"),
        Row("train-sample-tokens-negative", TRAIN, "{TINY} sample.max_new_tokens=-1", 2,
            "sample.max_new_tokens must be an integer >= 0 (0 = no sample), got -1.", post="no run dir"),
        Row("train-sample-temperature-nan", TRAIN, "{TINY} sample.temperature=nan", 2,
            "sample.temperature must be a finite number in [0, 100] (0 = greedy), got nan.", post="no run dir"),
        Row("train-gpu-without-cuda", TRAIN, "{TINY} trainer.accelerator=gpu", 2,
            "trainer.accelerator=gpu needs a CUDA GPU and none is available; use trainer=cpu.", post="no run dir"),
        Row("generate-stop-number", GENERATE, "ckpt={RUN} prompt=ROMEO: stop=5", 2,
            "stop must be a string or a list, each a non-empty string, got 5.", post="nothing printed"),
        Row("generate-temperature-inf", GENERATE, "ckpt={RUN} prompt=ROMEO: temperature=inf", 2,
            "temperature must be a finite number in [0, 100] (0 = greedy), got inf.",
            post="nothing printed"),
        Row("eval-n-boot-zero", EVAL, "ckpt={RUN} out={OUT} lengths=[32] n_boot=0", 2,
            "n_boot must be an integer >= 1, got 0.", post="nothing written to out"),
        Row("eval-n-boot-negative", EVAL, "ckpt={RUN} out={OUT} lengths=[32] n_boot=-1", 2,
            "n_boot must be an integer >= 1, got -1.", post="nothing written to out"),
        Row("eval-split-bogus", EVAL, "ckpt={RUN} out={OUT} lengths=[32] split=bogus", 2,
            "split must be one of val, test, got 'bogus'.", post="nothing written to out"),
        Row("eval-threads-zero", EVAL, "ckpt={RUN} out={OUT} lengths=[32] threads=0", 2,
            "threads must be auto or an integer >= 1, got 0.", post="nothing written to out"),
        Row("generate-threads-bogus", GENERATE, "ckpt={RUN} prompt=ROMEO: threads=many", 2,
            "threads must be auto or an integer >= 1, got 'many'.", post="nothing printed"),
        Row("study-threads-negative", STUDY, "out={OUT} threads=-1", 2,
            "threads must be `auto` or an integer >= 1, got -1.", post="nothing written to out"),
        Row("eval-curve-buckets-zero", EVAL, "ckpt={RUN} out={OUT} lengths=[32] curve_buckets=0", 2,
            "curve_buckets must be an integer >= 1, got 0.", post="nothing written to out"),
        Row("study-recipe-unknown", STUDY, "out={OUT} recipe=bogus", 2,
            "recipe='bogus' is not an experiment; choose one of", post="nothing written to out"),
        Row("study-lengths-empty", STUDY, "out={OUT} lengths=[]", 2,
            "lengths must be a non-empty list of integers >= 2 or multiples of the context length such as 2x, got [].", post="nothing written to out"),
        Row("passkey-focus-depths-without-focus-length", PASSKEY, "ckpt={RUN} out={OUT} lengths=[32] focus_depths=[0.5]", 2,
            "focus_depths=[0.5] applies at focus lengths, but focus_lengths is empty;", post="nothing written to out"),
        Row("study-focus-depths-without-focus-length", STUDY, "out={OUT} retrieval_focus_depths=[0.5]", 2,
            "retrieval_focus_depths=[0.5] applies at focus lengths, but focus_lengths is empty;", post="nothing written to out"),
        Row("passkey-focus-depths-outside-0-1", PASSKEY, "ckpt={RUN} out={OUT} lengths=[32,64] focus_lengths=[64] focus_depths=[2]", 2,
            "focus_depths must be a non-empty duplicate-free list, each a finite number in [0, 1] or null (depths), got [2].", post="nothing written to out"),
        Row("study-focus-depths-empty", STUDY, "out={OUT} focus_lengths=[4x] retrieval_focus_depths=[]", 2,
            "retrieval_focus_depths must be depths in [0, 1], got [].", post="nothing written to out"),
    ),
    # the tiny model's KV cache takes 512 bytes per token: 10^9 tokens are 512 GB, 10^10 are 5 TB
    # (eval's 10^8 would be only 51 GB, which a large machine grants)
    *rows("huge sizes",
        Row("generate-billion-new-tokens", GENERATE, "ckpt={RUN} prompt=ROMEO: max_new_tokens=1000000000", 2,
            "Generating 1,000,000,000 tokens after 1 prompt ... may be used (80% of the",
            post="nothing printed"),
        Row("passkey-ten-million-tokens", PASSKEY, "ckpt={RUN} out={OUT} lengths=[10000000] device=cpu", 2,
            "retrieval prompt ... of 10,000,000 tokens ... may be used (80% of the",
            post="nothing written to out"),
        Row("eval-ten-billion-tokens", EVAL, "ckpt={RUN} out={OUT} lengths=[10000000000] device=cpu", 2,
            "Scoring ... 10,000,000,000 tokens ... may be used (80% of the", post="nothing written to out"),
        Row("generate-billion-samples", GENERATE, "ckpt={RUN} prompt=ROMEO: num_samples=1000000000 max_new_tokens=4", 2,
            "Generating 4 tokens after 1,000,000,000 prompts (1 x num_samples=1,000,000,000) ... may be used (80% of "
            "the ... lower num_samples, max_new_tokens", post="nothing printed"),
        Row("eval-ten-billion-resamples", EVAL, "ckpt={RUN} out={OUT} lengths=[32] methods=[none] n_boot=10000000000 {DATA}", 2,
            "10,000,000,000 bootstrap resamples of ... may be used (80% of the ... lower n_boot.",
            post="nothing written to out", lines=None),
        # only 90,000 five-digit keys exist: drawing 99,999 decoys never ended
        Row("passkey-more-candidates-than-keys", PASSKEY,
            "ckpt={RUN} out={OUT} lengths=[300] depths=[0] trials=1 methods=[none] tasks=[passkey] candidates=100000", 2,
            "candidates must be an integer in [2, 90000] (the five-digit keys there are), got 100000.", post="nothing written to out"),
        Row("generate-start-pos-past-2-53", GENERATE,
            "ckpt={RUN} prompt=ROMEO: start_pos=9007199254740990 max_new_tokens=4", 2,
            "is beyond 2^53 - 1, the largest position RoPE keeps exact.", post="nothing printed"),
        Row("generate-far-start-pos", GENERATE,
            "ckpt={RUN} prompt=ROMEO: start_pos=1000000000000 max_new_tokens=4 greedy=true", 0,
            "generated tokens: 4", post="prompt and new text printed"),
    ),
    *rows("corrupt or foreign files",
        Row("generate-truncated-ckpt", GENERATE, "ckpt={TRUNCATED} prompt=ROMEO:", 2,
            "{TRUNCATED} is not a readable PyTorch checkpoint (truncated or foreign file)",
            setup="truncated checkpoint", post="nothing printed"),
        Row("generate-random-bytes-ckpt", GENERATE, "ckpt={RANDOM} prompt=ROMEO:", 2,
            "{RANDOM} is not a readable PyTorch checkpoint (truncated or foreign file)",
            setup="random-bytes checkpoint", post="nothing printed"),
        Row("generate-corrupt-tokenizer", GENERATE, "ckpt={BAD_TOKENIZER_CKPT} prompt=ROMEO:", 2,
            "{BAD_TOKENIZER} is not a readable tokenizer.json", setup="corrupt tokenizer",
            post="nothing printed"),
        Row("train-corrupt-tokenizer", TRAIN, "{TINY} data.tokenizer_path={BAD_TOKENIZER}", 2,
            "{BAD_TOKENIZER} is not a readable tokenizer.json", setup="corrupt tokenizer", post="no run dir"),
        Row("import-hf-corrupt-safetensors", IMPORT_HF, "hf_dir={HF} out={OUT}/model.ckpt", 2,
            "{HF}/model.safetensors is not a readable safetensors file (truncated or foreign)",
            setup="hf copy, corrupt safetensors", post="nothing written to out"),
        Row("import-hf-corrupt-tokenizer", IMPORT_HF, "hf_dir={HF} out={OUT}/model.ckpt", 2,
            "{HF}/tokenizer.json is not a readable tokenizer.json",
            setup="hf copy, corrupt hf tokenizer", post="nothing written to out"),
        Row("train-corrupt-token-cache", TRAIN, "{TINY} trainer.max_steps=2 optim.warmup_steps=1", 2,
            "train-00000.bin does not match its hash in meta.json (damaged or changed on disk); run "
            "scripts/prepare_data.py with the same data options to rebuild it.",
            setup="corrupt token cache", post="token shard kept", lines=None),
    ),
    *rows("self-overwrite",
        Row("export-hf-into-its-run-dir", EXPORT_HF, "ckpt={VICTIM} out={VICTIM} overwrite=true", 2,
            "out={VICTIM} is inside the run directory {VICTIM} (it holds checkpoints/ or .hydra/)",
            setup="run copy", post="checkpoint still loads"),
        Row("import-hf-into-its-hf-dir", IMPORT_HF, "hf_dir={HF} out={HF}/model.ckpt overwrite=true", 2,
            "out={HF}/model.ckpt overlaps hf_dir={HF}, the directory being imported",
            setup="hf copy", post="hf dir unchanged"),
    ),
    # a results directory or a run directory belongs to its command: another result is never replaced unasked
    *rows("another result",
        Row("eval-into-a-non-empty-out", EVAL, "ckpt={RUN} out={OUT} lengths=[32]", 2,
            "out={OUT} is not empty; pass overwrite=true to replace its results, or give another out.",
            setup="earlier result", post="earlier result intact"),
        Row("passkey-into-a-non-empty-out", PASSKEY, "ckpt={RUN} out={OUT} lengths=[300]", 2,
            "out={OUT} is not empty; pass overwrite=true to replace its results, or give another out.",
            setup="earlier result", post="earlier result intact"),
        Row("eval-overwrite-replaces", EVAL,
            "ckpt={RUN} out={OUT} lengths=[32] methods=[none] n_boot=20 overwrite=true {DATA}", 0,
            "Wrote {OUT}/results.csv", setup="earlier result", post="earlier result replaced"),
        Row("eval-into-a-run-directory", EVAL, "ckpt={RUN} out={VICTIM} lengths=[32] overwrite=true", 2,
            "out={VICTIM} is inside the run directory {VICTIM} (it holds checkpoints/ or .hydra/)", setup="run copy",
            post="checkpoint still loads"),
        Row("passkey-into-checkpoints", PASSKEY, "ckpt={RUN} out={VICTIM}/checkpoints/passkey lengths=[300]", 2,
            "out={VICTIM}/checkpoints/passkey is inside the run directory {VICTIM}", setup="run copy",
            post="checkpoint still loads"),
        Row("eval-into-a-folder-of-checkpoints", EVAL, "ckpt={RUN} out={IMPORTED} lengths=[32] overwrite=true", 2,
            "out={IMPORTED} holds checkpoints (.ckpt files); results never go into a checkpoints folder",
            setup="imported checkpoint", post="imported checkpoint alone"),
        Row("train-into-the-runs-folder", TRAIN, "{TINY}", 2,
            "The run directory {RUNS} holds other runs' directories", setup="runs folder, train into runs",
            post="runs folder unchanged"),
        Row("train-inside-another-runs-checkpoints", TRAIN, "{TINY}", 2,
            "The run directory {RUNS}/other/checkpoints/new is inside the run directory {RUNS}/other",
            setup="runs folder, train into its checkpoints", post="runs folder unchanged"),
        Row("train-link-to-a-locked-run", TRAIN, "{TINY}", 2,
            "{RUNS}/other is in use by another training process", setup="runs folder, train into a link to it",
            post="runs folder unchanged"),
        Row("export-hf-overwrite-no", EXPORT_HF, "ckpt={RUN} out={OUT} overwrite=no", 2,
            "overwrite must be true or false, got 'no'.", setup="earlier result", post="earlier result intact"),
        Row("import-hf-into-another-runs-checkpoints", IMPORT_HF,
            "hf_dir={HF} out={VICTIM}/checkpoints/last.ckpt overwrite=true", 2,
            "out={VICTIM}/checkpoints/last.ckpt is inside the run directory {VICTIM}", setup="hf copy, run copy",
            post="checkpoint still loads"),
    ),
    # a checkpoint whose unpickling would run `touch {MARKER}`; {REFUSAL} names posix.system
    *rows("crafted pickles",
        Row("train-ckpt-path-crafted", TRAIN, "{TINY} ckpt_path={EVIL}", 2, "{REFUSAL}",
            setup="crafted pickle", post="marker never created, no run dir"),
        Row("train-init-from-crafted", TRAIN, "{TINY} init_from={EVIL}", 2, "{REFUSAL}",
            setup="crafted pickle", post="marker never created, no run dir"),
        Row("generate-crafted", GENERATE, "ckpt={EVIL} prompt=ROMEO:", 2, "{REFUSAL}",
            setup="crafted pickle", post="marker never created, nothing printed"),
        Row("export-hf-crafted", EXPORT_HF, "ckpt={EVIL} out={OUT}", 2, "{REFUSAL}",
            setup="crafted pickle", post="marker never created, nothing written to out"),
        Row("eval-crafted", EVAL, "ckpt={EVIL} out={OUT} lengths=[32]", 2, "{REFUSAL}",
            setup="crafted pickle", post="marker never created, nothing written to out"),
        Row("passkey-crafted", PASSKEY, "ckpt={EVIL} out={OUT} lengths=[32]", 2, "{REFUSAL}",
            setup="crafted pickle", post="marker never created, nothing written to out"),
        # the study reads base_ckpt's context length before its first step: refused there, no step runs
        Row("study-base-ckpt-crafted", STUDY, "out={OUT} base_ckpt={EVIL} seeds=1 smoke=true jobs=1", 2,
            "{REFUSAL}", setup="crafted pickle", post="marker never created, nothing written to out"),
        *([Row("export-gguf-crafted", EXPORT_GGUF, "ckpt={EVIL} out={OUT}/m.gguf", 2, "{REFUSAL}",
               setup="crafted pickle", post="marker never created, nothing written to out")] if GGUF else []),
    ),
    # the step-10 text sample (40 tokens, past max_len=32) grows the shared RoPE table under
    # inference_mode; step 11 trains on that table ('Inference tensors cannot be saved for backward')
    *rows("crash",
        Row("train-sample-longer-than-max-len", TRAIN, "{TINY} sample.max_new_tokens=40", 0,
            "Final validation: val/loss=", post="trained 20 steps"),
    ),
]  # fmt: skip


# ----------------------------------------------------------------------------- shared files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """The tiny model of tests/helpers.py saved as a run directory (checkpoints/last.ckpt); rows only
    read it."""
    tok = text_tokenizer(tmp_path_factory.mktemp("tok"))
    return save_run(tiny(tok.vocab_size), tok, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def hf_dir(good_run, tmp_path_factory) -> Path:
    """good_run exported as a Hugging Face directory: import_hf's input; rows damage copies of it."""
    from rope_llama.cli.export_hf import export

    return export(good_run, tmp_path_factory.mktemp("export") / "hf")


def context(tmp_path: Path, request) -> dict:
    """The placeholders every row can use; SETUPS add their own."""
    run_dir = tmp_path / "run"
    corpus = request.getfixturevalue("corpus")
    tiny_train = tiny_overrides(tmp_path, corpus) + [f"hydra.run.dir={run_dir}"]
    # the evaluation scripts' data: the checkpoint's own tokenizer reads the tiny corpus
    data = ["data=text_files", f"data.source.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}"]
    return {"TMP": tmp_path, "RUN": request.getfixturevalue("good_run"), "OUT": tmp_path / "out",
            "RUN_DIR": run_dir, "TINY": tiny_train, "DATA": data}  # fmt: skip


# ----------------------------------------------------------------------------- setups


def crafted_pickle(ctx: dict, request) -> None:
    ctx["EVIL"], ctx["MARKER"] = crafted_checkpoint(ctx["TMP"])
    ctx["REFUSAL"] = refusal(ctx["EVIL"])


def truncated_checkpoint(ctx: dict, request) -> None:
    good = (ctx["RUN"] / "checkpoints" / "last.ckpt").read_bytes()
    ctx["TRUNCATED"] = ctx["TMP"] / "truncated.ckpt"
    ctx["TRUNCATED"].write_bytes(good[: len(good) // 2])


def random_bytes_checkpoint(ctx: dict, request) -> None:
    ctx["RANDOM"] = ctx["TMP"] / "random.ckpt"
    ctx["RANDOM"].write_bytes(random.Random(0).randbytes(4096))


def corrupt_tokenizer(ctx: dict, request) -> None:
    """A corrupt tokenizer.json, and a checkpoint recording exactly that file (path and hash), so the
    tokenizer itself is read, not refused as changed."""
    bad = ctx["BAD_TOKENIZER"] = ctx["TMP"] / "tokenizer.json"
    bad.write_bytes(CORRUPT_JSON)
    ckpt = safe_load(ctx["RUN"] / "checkpoints" / "last.ckpt")
    ckpt["tokenizer"] = {"path": str(bad), "sha256": file_sha256(bad)}
    ctx["BAD_TOKENIZER_CKPT"] = ctx["TMP"] / "bad_tokenizer.ckpt"
    atomic_torch_save(ckpt, ctx["BAD_TOKENIZER_CKPT"])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def hf_copy(ctx: dict, request) -> None:
    ctx["HF"] = Path(shutil.copytree(request.getfixturevalue("hf_dir"), ctx["TMP"] / "hf"))
    ctx["HF_FILES"] = snapshot(ctx["HF"])


def corrupt_safetensors(ctx: dict, request) -> None:
    (ctx["HF"] / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))


def corrupt_hf_tokenizer(ctx: dict, request) -> None:
    (ctx["HF"] / "tokenizer.json").write_bytes(CORRUPT_JSON)


def run_copy(ctx: dict, request) -> None:
    ctx["VICTIM"] = Path(shutil.copytree(ctx["RUN"], ctx["TMP"] / "victim"))
    ctx["VICTIM_BYTES"] = (ctx["VICTIM"] / "checkpoints" / "last.ckpt").read_bytes()


def corrupt_token_cache(ctx: dict, request) -> None:
    """Build the token cache the row's training opens, then overwrite its train shard with random bytes of
    the same size (a size check alone would pass)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rope_llama.data.cache import prepare

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        data = compose("train", overrides=ctx["TINY"]).data  # the data settings train.py will see
    source = OmegaConf.to_container(data.source, resolve=True)
    cache = prepare(source, data.vocab_size, data.tokenizer_path, data.cache_dir, data.token_dtype)
    ctx["TRAIN_BIN"] = Path(cache.dir) / "train-00000.bin"
    ctx["TRAIN_BIN_BYTES"] = ctx["TRAIN_BIN"].read_bytes()
    ctx["TRAIN_BIN_DAMAGED"] = random.Random(0).randbytes(len(ctx["TRAIN_BIN_BYTES"]))
    ctx["TRAIN_BIN"].write_bytes(ctx["TRAIN_BIN_DAMAGED"])


def earlier_result(ctx: dict, request) -> None:
    """out holding an earlier command's results (and a file of the user's)."""
    ctx["OUT"].mkdir()
    (ctx["OUT"] / "results.csv").write_text("the earlier run's results\n")
    (ctx["OUT"] / "notes.txt").write_text("mine\n")
    ctx["EARLIER"] = snapshot(ctx["OUT"])


def runs_folder(ctx: dict, request) -> None:
    """A folder of runs holding one run, runs/other (with a checkpoint); the tiny training goes where the
    next setup says."""
    ctx["RUNS"] = ctx["TMP"] / "runs"
    (ctx["RUNS"] / "other" / "checkpoints").mkdir(parents=True)
    (ctx["RUNS"] / "other" / "checkpoints" / "last.ckpt").write_bytes(b"the other run's checkpoint")
    ctx["RUNS_TREE"] = tree(ctx["RUNS"])


def train_into(where: Callable[[dict], Path]) -> Callable[[dict, pytest.FixtureRequest], None]:
    def setup(ctx: dict, request) -> None:
        ctx["TINY"] = [*ctx["TINY"][:-1], f"hydra.run.dir={where(ctx)}"]  # its last: hydra.run.dir

    return setup


def link_to_a_locked_run(ctx: dict) -> Path:
    """runs/alias -> other, which a training (this test process) holds locked."""
    from rope_llama.training.run_dir import RunLock

    (ctx["RUNS"] / "alias").symlink_to("other")
    ctx["RUNS_TREE"] = tree(ctx["RUNS"])
    lock = RunLock(ctx["RUNS"] / "other").acquire()
    ctx["RELEASE"] = lock.release  # before the post-conditions: the lock file goes with the lock
    return ctx["RUNS"] / "alias"


def imported_checkpoint(ctx: dict, request) -> None:
    """A folder holding a checkpoint and its tokenizer, as scripts/import_gguf.py leaves it."""
    ctx["IMPORTED"] = ctx["TMP"] / "imported"
    ctx["IMPORTED"].mkdir()
    shutil.copy(ctx["RUN"] / "checkpoints" / "last.ckpt", ctx["IMPORTED"] / "model.ckpt")
    ctx["IMPORTED_FILES"] = snapshot(ctx["IMPORTED"])


SETUPS: dict[str, Callable[[dict, pytest.FixtureRequest], None]] = {
    "imported checkpoint": imported_checkpoint,
    "earlier result": earlier_result,
    "runs folder": runs_folder,
    "train into runs": train_into(lambda ctx: ctx["RUNS"]),
    "train into its checkpoints": train_into(lambda ctx: ctx["RUNS"] / "other" / "checkpoints" / "new"),
    "train into a link to it": train_into(link_to_a_locked_run),
    "crafted pickle": crafted_pickle,
    "truncated checkpoint": truncated_checkpoint,
    "random-bytes checkpoint": random_bytes_checkpoint,
    "corrupt tokenizer": corrupt_tokenizer,
    "hf copy": hf_copy,
    "corrupt safetensors": corrupt_safetensors,
    "corrupt hf tokenizer": corrupt_hf_tokenizer,
    "run copy": run_copy,
    "corrupt token cache": corrupt_token_cache,
}


# ----------------------------------------------------------------------------- post-conditions


def absent(key: str) -> Callable[[dict, subprocess.CompletedProcess], None]:
    def check(ctx: dict, proc: subprocess.CompletedProcess) -> None:
        assert not ctx[key].exists(), f"{ctx[key]} exists"

    return check


def nothing_printed(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    assert proc.stdout == ""  # a refusal prints no prompt before it


def prompt_and_new_text_printed(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout.strip()) > len("ROMEO:"), proc.stdout


def hf_dir_unchanged(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    assert snapshot(ctx["HF"]) == ctx["HF_FILES"]


def checkpoint_still_loads(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    assert (ctx["VICTIM"] / "checkpoints" / "last.ckpt").read_bytes() == ctx["VICTIM_BYTES"]
    assert load_checkpoint(ctx["VICTIM"]).model.num_parameters() > 0
    assert [p.name for p in ctx["VICTIM"].iterdir()] == ["checkpoints"]  # nothing written beside it


def trained_steps(steps: int) -> Callable[[dict, subprocess.CompletedProcess], None]:
    def check(ctx: dict, proc: subprocess.CompletedProcess) -> None:
        assert safe_load(ctx["RUN_DIR"] / "checkpoints" / "last.ckpt")["global_step"] == steps

    return check


def token_shard_kept(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    # refused, not deleted: the user's file stays for inspection; scripts/prepare_data.py rebuilds it
    assert ctx["TRAIN_BIN"].read_bytes() == ctx["TRAIN_BIN_DAMAGED"]


def earlier_result_intact(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    assert snapshot(ctx["OUT"]) == ctx["EARLIER"]
    assert not [p for p in ctx["TMP"].iterdir() if ".tmp." in p.name]  # no staging folder left


def earlier_result_replaced(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    """The command's own files replace their namesakes; the user's file stays."""
    written = snapshot(ctx["OUT"])
    assert (
        written["results.csv"].startswith(b"method,length,factor,metric")
        and written["notes.txt"] == b"mine\n"
    )
    assert {"results.md", "windows.csv", "curves.csv", "ppl_vs_length.png"} <= set(written)


def runs_folder_unchanged(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    assert tree(ctx["RUNS"]) == ctx["RUNS_TREE"]


def imported_checkpoint_alone(ctx: dict, proc: subprocess.CompletedProcess) -> None:
    assert snapshot(ctx["IMPORTED"]) == ctx["IMPORTED_FILES"]


POST: dict[str, Callable[[dict, subprocess.CompletedProcess], None]] = {
    "imported checkpoint alone": imported_checkpoint_alone,
    "earlier result intact": earlier_result_intact,
    "earlier result replaced": earlier_result_replaced,
    "runs folder unchanged": runs_folder_unchanged,
    "no run dir": absent("RUN_DIR"),
    "nothing written to out": absent("OUT"),
    "marker never created": absent("MARKER"),
    "nothing printed": nothing_printed,
    "prompt and new text printed": prompt_and_new_text_printed,
    "hf dir unchanged": hf_dir_unchanged,
    "checkpoint still loads": checkpoint_still_loads,
    "trained 20 steps": trained_steps(20),
    "token shard kept": token_shard_kept,
}


# ----------------------------------------------------------------------------- the test


def names(listing: str) -> list[str]:
    return [name.strip() for name in listing.split(",") if name.strip()]


def command_line(row: Row, ctx: dict) -> list[str]:
    """The row's arguments with placeholders filled (split first: a path never splits an argument)."""
    args = []
    for template in row.args.split():
        args += ctx[template[1:-1]] if template in ("{TINY}", "{DATA}") else [template.format(**ctx)]
    return args


def run_entry_point(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """`python <script> <args>` from the repository root, as a user runs it (one thread: tiny models)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_entry_point(row: Row, tmp_path, request):
    ctx = context(tmp_path, request)
    for name in names(row.setup):
        SETUPS[name](ctx, request)
    try:
        proc = run_entry_point(row.script, command_line(row, ctx))
    finally:
        ctx.get("RELEASE", lambda: None)()  # a lock a setup holds
    fragment = re.compile(".*".join(re.escape(part) for part in row.fragment.format(**ctx).split(" ... ")))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if row.code == 0:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert fragment.search(proc.stdout + proc.stderr), proc.stdout[-3000:]
    else:
        assert proc.returncode == row.code, proc.stderr[-3000:]
        lines = proc.stderr.splitlines()
        errors = lines if row.lines is not None else lines[-1:]
        assert len(errors) == (row.lines or 1), proc.stderr
        assert all(line.startswith("error: ") for line in errors), proc.stderr
        assert fragment.search(lines[-1]), proc.stderr
    for name in names(row.post):
        POST[name](ctx, proc)


def test_the_table_has_every_class_and_a_crafted_pickle_for_every_checkpoint_reader():
    """A row deleted by mistake shows here."""
    assert {row.kind for row in ROWS} == set(CLASSES)
    readers = {
        (row.script, arg.split("=")[0])
        for row in ROWS
        if row.kind == "crafted pickles"
        for arg in row.args.split()
        if "{EVIL}" in arg
    }
    expected = {(TRAIN, "ckpt_path"), (TRAIN, "init_from"), (GENERATE, "ckpt"), (EXPORT_HF, "ckpt"),
                (EVAL, "ckpt"), (PASSKEY, "ckpt"), (STUDY, "base_ckpt")}  # fmt: skip
    assert readers == expected | ({(EXPORT_GGUF, "ckpt")} if GGUF else set())
    assert len({row.id for row in ROWS}) == len(ROWS)
    assert all(set(names(row.setup)) <= set(SETUPS) and set(names(row.post)) <= set(POST) for row in ROWS)
