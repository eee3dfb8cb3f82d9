"""LightningModule: next-token loss, AdamW or Muon + warmup/cosine, throughput/MFU and bits-per-char logging."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy

from rope_llama.core.checkpoint import format_entries
from rope_llama.kernels import use_kernels
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.training.compile import compile_blocks
from rope_llama.training.optim import OptimConfig, build_optimizer, lr_multiplier
from rope_llama.training.recompute import checkpoint_blocks as recompute_blocks
from rope_llama.training.throughput import matmul_dtype, measure_matmul_peak

if TYPE_CHECKING:
    from rope_llama.data.tokenizer import Tokenizer


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the run stops before a bad model can be checkpointed."""


class LitLlama(L.LightningModule):
    """Trains a Llama of `model_config` with `optim` on windows of its `lengths.trained_len` tokens; its
    checkpoints record the model config (the trained lengths included) and the tokenizer, so the model can
    be rebuilt from them alone (core/checkpoint.py's format)."""

    def __init__(
        self,
        model_config: ModelConfig,
        optim: OptimConfig | None = None,
        max_steps: int = 1000,
        compile: bool = False,
        kernels: bool = True,
        tokenizer: Tokenizer | None = None,
        chars_per_token: float | None = None,
        log_every_n_steps: int = 10,
        checkpoint_blocks: bool = False,
    ):
        super().__init__()
        self.config = model_config
        self.model = Llama(model_config)
        if kernels:  # kernels/: drop-ins for some modules, same parameters and state dict
            use_kernels(self.model)
        if checkpoint_blocks:  # recompute each block's activations in the backward (training/recompute.py)
            recompute_blocks(self.model)
        self.optim = optim or OptimConfig()
        self.max_steps = max_steps
        self.compile_model = compile
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token  # converts nats/token into bits/char (tokenizer-independent)
        self.log_every_n_steps = log_every_n_steps
        self._tokens_since, self._time_since, self._peak_flops = 0, None, None
        self._fit_start: float | None = None

    def configure_model(self) -> None:
        if self.compile_model:  # the blocks, not the model: a fraction of the compile time for the same steps
            compile_blocks(self.model)

    def forward(self, idx, position_ids=None, kv_cache=None):
        return self.model(idx, position_ids=position_ids, kv_cache=kv_cache)

    def _loss(self, batch) -> torch.Tensor:
        # (B, L) each, targets shifted by one; then optionally each target's weight (data.recall, or None)
        # and the tokens' position ids (data/positions.py): the datamodule's batch contract
        inputs, targets, target_weights, position_ids = (*batch, None, None)[:4]
        return self.model(  # the loss is fused by kernels/loss.py
            inputs, position_ids=position_ids, targets=targets, target_weights=target_weights
        )

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if not torch.isfinite(loss):  # stop before the optimizer step can poison the weights
            raise NonFiniteLossError(
                f"Loss became {loss.item()} at step {self.global_step}; stopping. The last good checkpoint "
                "is kept: lower optim.lr, raise trainer.gradient_clip_val, or check the data."
            )
        self._log_throughput(batch[0].numel())
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss * self._weight_share(batch)

    def _weight_share(self, batch) -> torch.Tensor | float:
        """W * (this process's sum of target weights) / (the sum over all W processes), or 1 unweighted.

        Data parallelism averages the processes' gradients; each process's weighted mean scaled by its
        share of the weight makes that average the weighted mean of the whole batch, sum(w * ce) / sum(w),
        as one process computes it. Unweighted, every process has the same number of targets: the plain
        average is already the batch mean."""
        world = self.trainer.world_size
        weights = (*batch, None)[2]
        if weights is None or world == 1:
            return 1.0
        local = weights.sum(dtype=torch.float32)
        total = self.trainer.strategy.reduce(local.clone(), reduce_op="sum")  # all_reduce works in place
        return local * world / total

    def _log_throughput(self, tokens: int) -> None:
        self._tokens_since += tokens
        now = time.perf_counter()
        if self._time_since is None:
            self._time_since = now
            return
        if self.global_step % self.log_every_n_steps or self.global_step == 0:
            return
        elapsed = now - self._time_since
        tokens_per_s = self._tokens_since * self.trainer.world_size / elapsed
        if self._peak_flops is None:  # the peak of the dtype the matmuls run in (bf16 under bf16-mixed)
            self._peak_flops = measure_matmul_peak(self.device, matmul_dtype(self.trainer.precision))
        lengths = self.config.lengths
        flops = self.model.flops_per_token(lengths.trained_len if lengths else 0) * tokens_per_s
        self.log("perf/tokens_per_s", tokens_per_s, prog_bar=True)
        self.log("perf/mfu", flops / (self._peak_flops * self.trainer.world_size))
        self._tokens_since, self._time_since = 0, time.perf_counter()

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, on_epoch=True, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Lightning validates only every val_check_interval steps; asking it to stop at the last step
        # makes it validate the final weights too (Final validation, best.ckpt) whatever max_steps is.
        if 0 < self.trainer.max_steps <= self.global_step:
            self.trainer.should_stop = True

    def on_train_start(self) -> None:
        self._fit_start = time.perf_counter()

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is None:
            return
        if self._fit_start is not None:  # wall-clock to this validation score: time to quality
            self.log("time/train_s", time.perf_counter() - self._fit_start)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)
        if self.chars_per_token:
            self.log("val/bpc", loss / math.log(2) / self.chars_per_token, prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self._loss(batch), on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        # Fused AdamW kernels exist for CUDA and CPU. Not under 16-mixed: its grad scaler must unscale the
        # gradients before they are clipped, and a fused step unscales them itself, too late for that.
        fused = self.device.type in ("cuda", "cpu") and self.trainer.precision != "16-mixed"
        optimizer = build_optimizer(self.model, self.optim, fused, str(self.trainer.precision))
        schedule_steps = self.optim.schedule_steps or self.max_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(self.optim, step, schedule_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clip the global gradient norm where Lightning's default refuses to: under bf16-mixed with the
        fused AdamW (it assumes a grad scaler that the fused step would unscale, but bf16 has none, so the
        gradients are already the true ones) and under FSDP (whose shards only the FSDP module's own
        `clip_grad_norm_` can sum into the global norm; Lightning issue #19235). Every other case takes
        Lightning's path."""
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            if isinstance(self.trainer.strategy, FSDPStrategy):
                self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
                return
            if self.trainer.precision == "bf16-mixed":
                torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
                return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint.update(format_entries(self.config, self.tokenizer))
