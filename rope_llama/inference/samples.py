"""The text sample a training run writes at each validation, made by the same engine as generate.py
(`sample` in configs/train.yaml instantiates it; train.py passes the data module's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from rope_llama.core.checks import check_number
from rope_llama.inference.generation import SamplingConfig, generate


class TextSample(L.Callback):
    """Generates a short continuation of `prompt` after each validation: printed, and logged
    as text (wandb table / samples.txt) so a person can watch the model learn."""

    def __init__(
        self, tokenizer, run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int
    ):
        """Checked here, so a bad sample.* fails before training starts, not at the first validation."""
        check_number("sample.max_new_tokens", max_new_tokens, minimum=0, integer=True)  # 0: no sample
        self.sampling = SamplingConfig(temperature=temperature, top_k=top_k)
        self.tokenizer, self.run_dir, self.prompt = tokenizer, Path(run_dir), prompt
        self.max_new_tokens = max_new_tokens
        self.rows: list[list] = []

    @torch.no_grad()
    def on_validation_end(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or self.max_new_tokens <= 0:
            return
        prompt = [self.tokenizer.bos_id, *self.tokenizer.encode(self.prompt)]
        was_training = pl_module.training
        pl_module.eval()
        # Eager under compile=true: a KV-cache decode has other shapes and arguments than the compiled
        # training and validation steps, and would recompile the blocks for every layer and length.
        with torch.compiler.set_stance("force_eager"):
            out = generate(
                pl_module.model,
                [prompt],
                self.max_new_tokens,
                self.sampling,
                eos_id=self.tokenizer.eos_id,
                seed=0,  # the same draw at every validation, so samples are comparable
            )
        pl_module.train(was_training)
        text = self.prompt + self.tokenizer.decode(out.tokens[0])
        step = trainer.global_step
        self.rows.append([step, text])
        print(f"\n--- sample at step {step} ---\n{text}\n---", flush=True)
        with open(self.run_dir / "samples.txt", "a", encoding="utf-8") as f:
            f.write(f"--- step {step} ---\n{text}\n")
        for logger in trainer.loggers:
            if hasattr(logger, "log_text"):  # WandbLogger: a table that grows with each validation
                logger.log_text(key="samples", columns=["step", "text"], data=self.rows, step=step)
