"""Trainer plumbing: atomic + safe checkpoint IO, checkpoint callbacks, the recall probe and the text
sample at validation, and the Hydra callback that tells train.py whether it created its run directory.

configs/callbacks/default.yaml instantiates the Lightning callbacks (these and Lightning's own), one
entry each; the text sample is train.yaml's `sample` (TextSample, made by inference/generation.py,
the engine generate.py runs; train.py passes it the data module's tokenizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import lightning as L
import numpy as np
import torch
from hydra.experimental.callback import Callback as HydraCallback
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from rope_llama.core.checkpoint import atomic_torch_save, safe_load
from rope_llama.core.checks import check_number
from rope_llama.data.recall import answer_accuracy, held_out_windows
from rope_llama.inference.generation import SamplingConfig, generate


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints are written to a temp file, fsynced and renamed (a kill mid-save keeps the
    previous file), and read back with weights_only=True (a checkpoint can never run code)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return safe_load(path, map_location=map_location or "cpu")


class RecallProbe(L.Callback):
    """After each validation, the teacher-forced answers of `windows` held-out recall windows (the run's own
    `data.recall` format, haystacks from the validation split): logs `val/recall_digits` (share of answer
    digits predicted; chance about 0.1) and `val/recall_exact` (share of answers right to the last digit), and
    `val/digit_similarity`, the mean pairwise cosine of the ten digits' input embeddings (when each digit is
    one token). A base that never learns to copy ends with a val bpc like one that does; its digits stay at
    chance and their embeddings near one direction (docs/data.md, Recall windows). From `warn_after` of
    max_steps on, digits below `warn_below` print a warning: every such base so far never learned to copy.
    Does nothing in a run without recall windows."""

    def __init__(
        self,
        windows: int = 64,
        batch_size: int = 16,
        seed: int = 0,
        warn_after: float = 0.75,
        warn_below: float = 0.5,
    ):
        self.count, self.batch_size, self.seed = windows, batch_size, seed
        self.warn_after, self.warn_below = warn_after, warn_below
        self.windows: list = []
        self.digit_ids: list[int] = []

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        data = trainer.datamodule
        recall = getattr(data, "recall", None)
        if self.count < 1 or recall is None or recall.fraction == 0:
            return
        tokens = np.concatenate(data.documents("val"))
        self.windows = held_out_windows(
            data.tokenizer, recall, tokens, data.max_len + 1, self.count, self.seed
        )
        digits = [data.tokenizer.encode(str(d)) for d in range(10)]
        self.digit_ids = [ids[0] for ids in digits] if all(len(ids) == 1 for ids in digits) else []
        if not self.windows and trainer.is_global_zero:
            print(f"RecallProbe: the validation split ({len(tokens)} tokens) cannot fill one window; off.")

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        if not self.windows or trainer.sanity_checking:
            return
        tokens = torch.from_numpy(np.stack([w.tokens for w in self.windows]))  # (N, max_len + 1)
        predictions = []
        with trainer.precision_plugin.val_step_context():  # the dtype validation runs in
            for batch in tokens.split(self.batch_size):
                logits = pl_module.model(batch[:, :-1].to(pl_module.device))  # (b, max_len, V)
                predictions.append(logits.argmax(-1).cpu())
        exact, digits = answer_accuracy(torch.cat(predictions).numpy(), self.windows)
        pl_module.log("val/recall_digits", digits, prog_bar=True)
        pl_module.log("val/recall_exact", exact)
        embedding = pl_module.model.embed.weight  # (V, C); a sharded FSDP parameter holds no whole rows here
        if self.digit_ids and embedding.dim() == 2 and embedding.shape[0] > max(self.digit_ids):
            pl_module.log("val/digit_similarity", mean_cosine(embedding[self.digit_ids]))
        step, max_steps = trainer.global_step, trainer.max_steps
        if 0 < self.warn_after * max_steps <= step and digits < self.warn_below and trainer.is_global_zero:
            print(
                f"RecallProbe: at step {step} of {max_steps} the held-out recall digits are at {digits:.2f} "
                "(chance about 0.1); every recall_base run that low at step 1950 of 2600 never learned to copy "
                "(reports/2026-11-27-recall-rounds.md, twenty-first round): another seed is the remedy.",
                flush=True,
            )


def mean_cosine(vectors: torch.Tensor) -> float:
    """Mean cosine similarity over the distinct pairs of the rows of `vectors` (n, C), n >= 2."""
    unit = torch.nn.functional.normalize(vectors.detach().float(), dim=-1)
    n = len(unit)
    return float(((unit @ unit.T).sum() - n) / (n * (n - 1)))


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
        prompt = self.tokenizer.prompt_ids(self.prompt)  # bos first unless the tokenizer's model takes none
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
                eos_id=self.tokenizer.stop_ids,  # eos, and an instruct model's end of turn
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


class SaveLastCheckpoint(L.Callback):
    """Writes checkpoints/last.ckpt when training ends (whatever the save interval) and on SIGTERM
    (what schedulers send before preemption: Lightning stops after the current batch, and this
    saves at that boundary), so `ckpt_path=last` always resumes from the latest state."""

    def __init__(self, ckpt_dir: str | Path):
        self.path = Path(ckpt_dir) / "last.ckpt"

    def _save(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self._save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            self._save(trainer)
            if trainer.is_global_zero:
                print(f"\nSIGTERM at step {trainer.global_step}: saved {self.path}", flush=True)


class EMAWeights(EMAWeightAveraging):
    """Lightning's EMA of the weights (validation, checkpoints' `state_dict` and the final weights are the
    average; the raw weights stay under `current_model_state`), except before its first update: Lightning's
    would validate, save and end training with the initial weights it copied at setup, so with
    `update_starting_at_step` every earlier validation and checkpoint would score an untrained model."""

    def _averaging(self) -> bool:
        return self._average_model is not None and int(self._average_model.n_averaged) > 0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module) -> None:
        if self._averaging():
            super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        if self._averaging():  # n_averaged does not change during validation: the swap is undone
            super().on_validation_epoch_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        if self._averaging():
            super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if self._averaging():
            super().on_train_end(trainer, pl_module)


def step_checkpoint(dirpath: str | Path, every_n_train_steps: int, keep_all: bool = False) -> ModelCheckpoint:
    """checkpoints/last.ckpt every `every_n_train_steps` steps (resume with ckpt_path=last); `keep_all`
    also keeps checkpoints/stepNNNNNN.ckpt from every save (e.g. to resume mid-run)."""
    return ModelCheckpoint(
        dirpath=dirpath,
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        save_last=True,
        save_top_k=-1 if keep_all else 0,
        every_n_train_steps=every_n_train_steps,
        # A run that ends before its first save gets last.ckpt from SaveLastCheckpoint, then from this
        # callback's own on_train_end: overwrite it, not a second copy last-v1.ckpt.
        enable_version_counter=False,
    )


class NewRunDirectories(HydraCallback):
    """Hydra creates the run directory before train.py's main runs; this notes first which directories are
    new, so a run refused before training removes only what it created (configs/train.yaml registers it
    under hydra.callbacks)."""

    created: ClassVar[set[Path]] = set()

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._note(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._note(config.hydra.sweep.dir)  # the job directories inside a new sweep directory are new too

    def _note(self, directory: str) -> None:
        path = Path(directory).resolve()
        if path.exists():
            return
        while not path.parent.exists():  # the highest directory Hydra is about to create
            path = path.parent
        self.created.add(path)

    @classmethod
    def created_root(cls, run_dir: Path) -> Path | None:
        """The highest directory this process created on the way to `run_dir` (None: it created none)."""
        run_dir = Path(run_dir).resolve()
        return next((made for made in cls.created if made == run_dir or made in run_dir.parents), None)
