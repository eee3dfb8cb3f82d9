"""Tokenize a corpus into the token cache that train.py reads: streamed, in parallel, resumable.

    python scripts/prepare_data.py data=fineweb_edu workers=16
    python scripts/prepare_data.py data=text_files 'data.source.paths=[corpus/**/*.txt]' workers=2
    python scripts/prepare_data.py data=fineweb_edu data.cache_dir=s3://bucket/caches   # any fsspec URL

It writes the directory `train.py` with the same `data=` options opens (data.cache_dir, default .cache/data),
so training then starts without tokenizing; train.py runs the same preparation itself, in one process, when
the cache is missing. Killed, it resumes at its first unfinished shard; run on a complete cache, it hashes
every shard and rebuilds from a damaged one on (verify=false skips that). docs/data.md has the layout.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.schema import check_command
from rope_llama.data.cache import prepare


def run(cfg: DictConfig) -> str:
    """Build or verify the cache for cfg.data; returns its directory."""
    data = cfg.data
    source = OmegaConf.to_container(data.source, resolve=True)
    cache = prepare(
        source,
        data.vocab_size,
        data.tokenizer_path,
        data.cache_dir,
        data.token_dtype,
        data.shard_tokens,
        data.tokenizer_sample_chars,
        workers=cfg.workers,
        verify=cfg.verify,
    )
    for split, info in cache.meta["splits"].items():
        print(
            f"{split:>5}: {info['tokens']:,} tokens, {info['documents']:,} documents, "
            f"{len(info['shards'])} shard(s)"
        )
    print(f"{'built' if cache.built else 'complete and verified' if cfg.verify else 'complete'}: {cache.dir}")
    return cache.dir


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="prepare_data")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("prepare_data", cfg)  # every option before anything is loaded or written
    run(cfg)


if __name__ == "__main__":
    main()
