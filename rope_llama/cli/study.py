"""The RoPE extrapolation study, end to end, as subprocesses of the real entry points (resumable).

    python scripts/study.py out=runs/study                      # seeds=3, two corpora (docs/extrapolation.md)
    python scripts/study.py out=runs/study seeds=1 corpora=[own]
    python scripts/study.py out=/tmp/smoke smoke=true -- data.cache_dir=/tmp/cache   # minutes, tiny model

Steps (each skipped when its output already exists, so a killed study resumes: the same command with
resume=true, which a non-empty out needs; a killed training continues from its checkpoints/last.ckpt with
ckpt_path=last):
  1. train `seeds` base models at max_len 256 with rope=none and the `recipe` experiment
     (recall_base: a model that retrieves)                        -> out/runs/base_s<k>
  2. evaluate every scaling method and attention extension zero-shot on each corpus
     (own = the held-out split of the training data; kjv = the King James Bible's test books)
                                                                   -> out/eval/<corpus>/base_s<k>
  3. fine-tune the first `finetune_seeds` bases at 1024 with PI and with YaRN (experiment=extend_context:
     pi, yarn from the first seed's base, pi_s<k>, yarn_s<k> from seed k's), evaluate their own RoPE
  4. train a model with a larger RoPE base (seed 0; large_base=null: none), evaluate it with `none`; with `pose`, fine-tune the same
     bases with PoSE (experiment=pose: 256-token windows whose position ids span 4L or 16L, same steps and
     tokens as the full-length fine-tunes; the base's RoPE, PI or YaRN: pose4_none, pose4_pi, ..., pose16_yarn);
     with `randomized`, train a base from scratch on randomized position ids (experiment=randomized_positions,
     seed 0: randomized)
  5. the retrieval suite (passkey, multi-key, variable tracking) on every base and fine-tuned model
  6. out/summary.md: per corpus, mean and across-seed range per method and length; paired
     comparisons (bootstrap over documents x seeds, or prompts' depths x seeds) marking the
     significant orderings, also between the trained extensions; each training's cost (steps, tokens,
     attention FLOPs, seconds) beside the length it reaches; retrieval accuracy with Wilson 95% intervals;
     plots beside it.
Up to `jobs` steps (default 3) run at once, each with cores / jobs torch threads and its output in
out/logs/<step>.log (jobs=1: one after another, on the terminal); a line per step says when it starts
and how long it took. Arguments after `--` go to every train.py run (e.g. data=... overrides).
docs/extrapolation.md.
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from rope_llama.cli.errors import USER_ERRORS, one_sentence_errors
from rope_llama.cli.schema import check_command
from rope_llama.study.config import StudyConfig
from rope_llama.study.lanes import run


@one_sentence_errors(errors=(*USER_ERRORS, RuntimeError))  # RuntimeError: a step that failed
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    cfg = OmegaConf.merge(OmegaConf.structured(StudyConfig), OmegaConf.from_dotlist(ours))
    check_command("study", cfg)
    run(OmegaConf.to_object(cfg), extra)


if __name__ == "__main__":
    main()
