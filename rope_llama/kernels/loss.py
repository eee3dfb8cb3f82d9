"""Fused LM head + cross-entropy: a drop-in for model/llama.py's `LMHead.loss` without the
(tokens, vocab) logits tensor.

`F.cross_entropy(hidden @ W.T, targets)` materialises the logits (4096 x 4096 float32 = 64 MiB per
default training step), writes them again in log_softmax, zero-fills and scatters their gradient,
and reads them twice more in the backward: five passes over a tensor far larger than the cache.
Here the rows go through the head `chunk_rows` at a time; each chunk's softmax gradient
(softmax - onehot) is turned into the gradients of `hidden` and `W` while it is still in cache, so
the backward only scales two saved gradients. Same loss and gradients (float32 softmax, float32 sums
of the chunks' weight gradients), and the peak memory of the step drops by the logits and their
gradient (docs/performance.md, Kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rope_llama.model.llama import LMHead, autocast_dtype

CHUNK_ROWS = 256  # 256 x 4096 float32 logits = 4 MiB: one chunk stays in a CPU core's L2 cache


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, target_weights, chunk_rows, need_grad):
        n = hidden.shape[0]
        dtype = autocast_dtype(hidden)
        acc = torch.promote_types(dtype, torch.float32)  # softmax and sums: float32 at least
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly below
            h_all, w = hidden.to(dtype), weight.to(dtype)
            total = torch.zeros((), device=hidden.device, dtype=acc)
            grad_hidden = torch.empty_like(h_all) if need_grad else None
            grad_weight = torch.zeros_like(weight, dtype=acc) if need_grad else None
            for start in range(0, n, chunk_rows):
                h, t = h_all[start : start + chunk_rows], targets[start : start + chunk_rows]
                row_weights = (
                    None if target_weights is None else target_weights[start : start + chunk_rows, None]
                )
                logits = (h @ w.T).to(acc)  # (rows, V): the only logits that ever exist
                picked = logits.gather(1, t[:, None])  # (rows, 1), read before the in-place ops below
                # Every step below is in place: a fresh (rows, V) buffer per op costs more than its math.
                row_max = logits.amax(dim=-1, keepdim=True)
                probs = logits.sub_(row_max).exp_()  # unnormalised softmax
                sum_exp = probs.sum(dim=-1, keepdim=True)
                row_loss = row_max + sum_exp.log() - picked  # log-sum-exp minus the target's logit
                total += row_loss.sum() if row_weights is None else (row_loss * row_weights).sum()
                if not need_grad:
                    continue
                grad_logits = probs.div_(sum_exp)  # softmax
                grad_logits[torch.arange(t.numel(), device=t.device), t] -= 1  # - onehot(target)
                if row_weights is not None:
                    grad_logits.mul_(row_weights)
                grad_logits = grad_logits.to(dtype)
                grad_hidden[start : start + chunk_rows] = grad_logits @ w
                # in the compute dtype (a bf16 matmul beats an fp32 addmm_ of upcast copies), summed in acc
                grad_weight += grad_logits.T @ h
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
        # the mean's denominator: rows, or the sum of the rows' weights (a tensor: no device sync)
        ctx.n = n if target_weights is None else target_weights.sum()
        ctx.dtypes = hidden.dtype, weight.dtype
        return total / ctx.n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss / ctx.n  # d(mean)/d(sum), times the upstream gradient
        return (
            (grad_hidden * scale).to(ctx.dtypes[0]),
            (grad_weight * scale).to(ctx.dtypes[1]),
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int = CHUNK_ROWS,
    *,
    target_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, chunked over rows.

    hidden: (..., C) final hidden states; weight: (V, C) LM head; targets: (...) class ids in [0, V);
    target_weights: (...) per-target weights, or None (all 1).
    Returns a float32 (float64 for float64 inputs) scalar equal to
    F.cross_entropy(hidden @ weight.T, targets) (mean reduction), or with weights to the weighted mean
    sum(w * ce) / sum(w).
    Every target must be a real class: there is no ignore_index (training windows have no padding).
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive number of rows, got {chunk_rows}.")
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but {targets.shape[0]} targets; they must match.")
    if target_weights is not None:
        target_weights = target_weights.reshape(-1).to(
            torch.promote_types(autocast_dtype(hidden), torch.float32)
        )
        if target_weights.shape != targets.shape:
            raise ValueError(
                f"{target_weights.numel()} target weights but {targets.numel()} targets; they must match."
            )
    # Decided here, not from ctx.needs_input_grad inside forward, which ignores no_grad/inference_mode:
    # validation must not compute the head's gradients it would throw away.
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, target_weights, chunk_rows, need_grad)


@torch.no_grad()
def linear_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int = CHUNK_ROWS
) -> torch.Tensor:
    """Cross-entropy of each target, chunked over rows: `LMHead.token_losses` without the (rows, V) logits.

    hidden: (..., C); weight: (V, C); targets: (...) ids in [0, V) -> (...) float32 (float64 for
    float64 inputs). No gradient: scoring only reads the losses.
    """
    dtype = autocast_dtype(hidden)
    acc = torch.promote_types(dtype, torch.float32)
    rows, flat = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    losses = torch.empty(flat.shape, device=hidden.device, dtype=acc)
    with torch.autocast(hidden.device.type, enabled=False):
        h_all, w = rows.to(dtype), weight.to(dtype)
        for start in range(0, flat.numel(), chunk_rows):
            end = min(start + chunk_rows, flat.numel())
            logits = (h_all[start:end] @ w.T).to(acc)  # (rows, V): one chunk at a time
            # cross_entropy's fused log-softmax: one vectorized pass where logsumexp makes five
            losses[start:end] = F.cross_entropy(logits, flat[start:end], reduction="none")
    return losses.view(targets.shape)


class KernelLMHead(LMHead):
    """LMHead whose loss is `linear_cross_entropy` and whose per-target losses (scoring) are
    `linear_token_losses`: same weight, same values, no logits tensor."""

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad):
            return super().token_losses(hidden, targets)  # a backward follows: the plain autograd path
        return linear_token_losses(hidden, self.weight, targets)

    def loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, target_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear_cross_entropy(hidden, self.weight, targets, target_weights=target_weights)
