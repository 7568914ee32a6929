"""Masked next-token loss with optional z-loss (z-loss as in the official release's lingua fork)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from canonlm.arch.config import ConfigError

Z_LOSSES = ("none", "lingua", "palm")


def lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    z_loss: str = "none",
    z_coef: float = 1e-4,
) -> dict[str, torch.Tensor]:
    """Token-summed cross entropy over the masked tokens, computed in float32.

    Args:
        logits: ``(B, T, V)`` any float dtype (upcast to fp32 here).
        targets: ``(B, T)`` int64 token ids; values at unmasked positions are ignored (may be anything).
        mask: ``(B, T)`` bool, True = token counts; None = all tokens.
        z_loss: ``none`` -> per-token loss = nll; ``lingua`` -> ``nll + z_coef·nll²`` (what the PhysicsLM4 release
            implements, ⚠ not log Z); ``palm`` -> ``nll + z_coef·logsumexp(logits)²`` (PaLM's z-loss).
        z_coef: coefficient of the z term (1e-4 in the recipes).
    Returns:
        dict of 0-d float32 tensors: ``loss_sum`` (sum of per-token losses; backprop it after dividing by the
        global token count), ``nll_sum`` (sum of plain nll in nats, detached) and ``n_tokens`` (masked tokens).
    Raises:
        ConfigError("loss.z_loss", ...) for an unknown mode; ValueError for shape / dtype mismatches.
    """
    if z_loss not in Z_LOSSES:
        raise ConfigError("loss.z_loss", z_loss, " | ".join(Z_LOSSES))
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"lm_loss: logits {tuple(logits.shape)} / targets {tuple(targets.shape)}; expected (B, T, V) and (B, T)"
        )
    if mask is not None and (mask.shape != targets.shape or mask.dtype != torch.bool):
        raise ValueError(f"lm_loss: mask {tuple(mask.shape)} {mask.dtype}; expected bool {tuple(targets.shape)}")
    V = logits.shape[-1]
    flat = logits.reshape(-1, V).float()
    tgt = targets.reshape(-1)
    if mask is None:
        n_tokens = torch.tensor(float(tgt.numel()), device=logits.device)
    else:
        tgt = tgt.masked_fill(~mask.reshape(-1), -100)
        n_tokens = mask.sum().float()
    if z_loss == "palm":
        lse = torch.logsumexp(flat, dim=-1)
        keep = tgt != -100
        picked = flat.gather(1, tgt.clamp_min(0).unsqueeze(1)).squeeze(1)
        nll = torch.where(keep, lse - picked, 0.0)
        nll_sum = nll.sum()
        loss_sum = nll_sum + z_coef * torch.where(keep, lse.square(), 0.0).sum()
    elif z_loss == "lingua":
        nll = F.cross_entropy(flat, tgt, ignore_index=-100, reduction="none")  # 0 at ignored tokens
        nll_sum = nll.sum()
        loss_sum = nll_sum + z_coef * nll.square().sum()
    else:
        nll_sum = F.cross_entropy(flat, tgt, ignore_index=-100, reduction="sum")
        loss_sum = nll_sum
    return {"loss_sum": loss_sum, "nll_sum": nll_sum.detach(), "n_tokens": n_tokens}
