"""Rotary position embeddings: full RoPE, partial RoPE, NoPE (Su et al. 2021; NoPE and reduced RoPE: paper Result 3).

Rotated width ``r`` (= ``head_dim`` for RoPE, ``rope_dim = round(fraction * head_dim)`` for partial RoPE): pair ``i``
(``i = 0 .. r/2 - 1``) of every head is rotated by the angle ``p * theta_i`` at position ``p`` with
``theta_i = base ** (-2 i / r)``; channels ``r .. head_dim - 1`` pass through unchanged.

Pairing (which two channels form pair ``i``):

* ``half``        -- channels ``(i, i + r/2)`` (HF ``rotate_half``; flash-attn ``apply_rotary_emb(interleaved=False)``).
* ``interleaved`` -- channels ``(2i, 2i + 1)`` (lingua / the PhysicsLM4 release; flash-attn ``interleaved=True``).

:func:`interleaved_to_half_permutation` converts checkpoints between the two.
"""

from __future__ import annotations

import torch

PAIRINGS = ("half", "interleaved")


def rope_angles(
    rope_dim: int, seq_len: int, theta: float = 10000.0, *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of the rotation angles ``p * theta**(-2i/rope_dim)``.

    Args:
        rope_dim: rotated width r (even, >= 2).
        seq_len: number of positions p = 0 .. seq_len-1.
        theta: RoPE base (10 000 in the paper's models; 1e5 for the 8B recipe).
        device: where to build the tables.
    Returns:
        ``(cos, sin)``, each float32 of shape ``(seq_len, rope_dim // 2)``; angles are computed in float64 and
        rounded once (HF computes them in float32; the difference is below 1e-6 at 4k positions).
    Raises:
        ValueError: ``rope_dim`` odd or < 2, ``seq_len`` < 1, ``theta`` <= 0.
    """
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"rope_dim={rope_dim!r}: must be an even integer >= 2")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: must be >= 1")
    if not theta > 0:
        raise ValueError(f"theta={theta!r}: must be > 0")
    # built on the CPU in float64 (every device, incl. meta), then moved
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device="cpu") / rope_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64, device="cpu"), inv_freq)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str = "half") -> torch.Tensor:
    """Rotate the first ``r = 2 * cos.shape[-1]`` channels of every head; the remaining channels pass through.

    Args:
        x: ``(B, T, H, D)`` queries and/or keys (any float dtype; q and k may be stacked along H).
        cos, sin: ``(T, r/2)`` tables from :func:`rope_angles` (sliced to T); cast to ``x.dtype`` (as HF does),
            so the rotation runs in the compute dtype.
        pairing: ``"half"`` | ``"interleaved"`` (module docstring).
    Returns:
        A new ``(B, T, H, D)`` tensor of ``x.dtype``.
    Raises:
        ValueError: bad pairing, ``r > D``, or ``cos``/``sin`` shape not ``(T, r/2)``.
    """
    B, T, H, D = x.shape
    half = cos.shape[-1]
    r = 2 * half
    if cos.shape != (T, half) or sin.shape != (T, half) or r > D:
        raise ValueError(
            f"cos/sin shape {tuple(cos.shape)}/{tuple(sin.shape)}: expected (T={T}, r/2) with r <= head_dim={D}"
        )
    cos = cos.to(x.dtype)[:, None, :]  # (T, 1, r/2), broadcasts over heads
    sin = sin.to(x.dtype)[:, None, :]
    if pairing == "half":
        x1, x2 = x[..., :half], x[..., half:r]
        rot = [torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin)]
        return torch.cat(rot + [x[..., r:]] if r < D else rot, dim=-1)
    if pairing == "interleaved":
        xr = x[..., :r].unflatten(-1, (half, 2))
        xe, xo = xr[..., 0], xr[..., 1]
        rot = torch.stack([xe * cos - xo * sin, xo * cos + xe * sin], dim=-1).flatten(-2)
        return torch.cat([rot, x[..., r:]], dim=-1) if r < D else rot
    raise ValueError(f"pairing={pairing!r}: allowed {' | '.join(PAIRINGS)}")


def interleaved_to_half_permutation(head_dim: int, rope_dim: int) -> torch.Tensor:
    """Channel permutation converting an ``interleaved``-pairing checkpoint to ``half`` pairing.

    New channel ``i`` takes old channel ``2i`` and new channel ``i + r/2`` takes old channel ``2i + 1`` for
    ``i < r/2``; channels ``>= r`` are unchanged. Apply the same permutation to the rows of every head's block of
    Wq and Wk (``W.view(H, head_dim, d)[:, perm]``, also to QK-norm gains); all q·k products are preserved.

    Returns:
        int64 tensor ``(head_dim,)``: ``new[..., j] = old[..., perm[j]]``.
    Raises:
        ValueError: ``rope_dim`` odd, < 2 or > ``head_dim``.
    """
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(f"rope_dim={rope_dim!r}: must be even, >= 2 and <= head_dim={head_dim}")
    rotated = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    return torch.cat([rotated, torch.arange(rope_dim, head_dim)])
