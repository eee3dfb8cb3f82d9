"""The trainer group's numbers and choices, checked before any data work or write (Lightning would
refuse some only inside fit, divide by others, or train backwards with a negative clip)."""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig, ListConfig

from rope_llama.core.checks import check_number
from rope_llama.core.precision import AUTO

PRECISIONS = (AUTO, "32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true", "64")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


def check_trainer(trainer: DictConfig) -> None:
    """One sentence for the first bad trainer.* option."""
    check_number("trainer.max_steps", trainer.max_steps, minimum=1, integer=True)
    interval = trainer.val_check_interval
    if isinstance(interval, float) and not isinstance(interval, bool) and interval <= 1.0:
        check_number("trainer.val_check_interval", interval, above=0, maximum=1.0)  # a share of an epoch
    else:
        check_number("trainer.val_check_interval", interval, minimum=1, integer=True)
    check_number("trainer.accumulate_grad_batches", trainer.accumulate_grad_batches, minimum=1, integer=True)
    check_number("trainer.gradient_clip_val", trainer.gradient_clip_val, minimum=0, allow_none=True,
                 none_means="no clipping")  # fmt: skip
    check_number("trainer.log_every_n_steps", trainer.log_every_n_steps, minimum=1, integer=True)
    check_number("trainer.limit_val_batches", trainer.limit_val_batches, minimum=0)  # 0: no validation
    check_number("trainer.num_sanity_val_steps", trainer.num_sanity_val_steps, minimum=-1, integer=True)
    check_number("trainer.num_nodes", trainer.num_nodes, minimum=1, integer=True)
    devices = trainer.devices
    if not (devices in ("auto", -1) or isinstance(devices, list | ListConfig)):
        available = (
            torch.cuda.device_count() if str(trainer.accelerator) in ("gpu", "cuda") else os.cpu_count()
        )
        check_number("trainer.devices", devices, minimum=1, maximum=max(available or 1, 1), integer=True)
    if str(trainer.precision) not in PRECISIONS:
        raise ValueError(f"trainer.precision={trainer.precision!r} is not one of {', '.join(PRECISIONS)}.")
    accelerator = str(trainer.accelerator)
    if accelerator not in ACCELERATORS:
        raise ValueError(f"trainer.accelerator={accelerator!r} is not one of {', '.join(ACCELERATORS)}.")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={accelerator} needs a CUDA GPU and none is available; use trainer=cpu."
        )
