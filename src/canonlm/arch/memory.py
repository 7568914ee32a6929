"""Memory of a training step: bytes of parameters, gradients, AdamW state, activations and batch data per process,
as a function of the model config (:func:`training_memory`).

Units: **bytes per process** (one rank; under FSDP2 the sharded parts are divided by the shard count).

What is counted, and why it is a **lower bound** of the peak (a run it refuses cannot run; a run it admits may
still run out of memory — allocator fragmentation, kernel workspaces, temporaries and framework overheads are not
counted, nor are the Canon convolutions' saved inputs, biases, norms' saved statistics or attention's log-sum-exp):

* parameters: ``n_params`` x the parameter dtype (fp32 unless ``trainer.precision`` is ``bf16-true`` / ``16-true``
  (2 bytes) or ``64-true`` (8 bytes)); ``n_params`` is the model's own count (a meta-device ``CanonLM``);
* gradients: one per parameter, in the parameter dtype;
* optimizer state: ``optimizer_states`` tensors per parameter in the parameter dtype (AdamW: ``exp_avg`` and
  ``exp_avg_sq``, 2; with ``amsgrad`` 3), as ``torch.optim.AdamW`` allocates them at the first step;
* activations: per token of the micro-batch, in the compute dtype (``compute_dtype_for``: bf16 under ``bf16-*`` or
  FSDP2's bf16 ``param_dtype``), the tensors the backward pass needs from every block, whether eager or compiled
  (a compiler may recompute element-wise results but not the inputs of matrix products, which it does not
  recompute by default):

  - every block: its input (the residual stream, width ``d``);
  - Llama attention: q, k, v (``d + 2 d_kv``; twice with Canon-B: the conv's input and its output) and the
    attention output that enters the output projection (``d``);
  - GLA / GDN: q, k (``key_dim`` each), v and the output before its projection (``value_dim`` each);
  - Mamba2: the input projection's output (``2 d_inner + 2 G N + H``) and the scan output (``d_inner``);
  - the MLP (when the block has one): its input (``d``) and its hidden pre-activation (``2 d_ff`` gated, ``d_ff``
    standard; twice with a Llama's Canon-D: the conv's input and its output). Canon-A and -C convolve a norm's
    output, which can be recomputed from the block's input, so they add nothing to the bound; the linear mixers'
    Canon and short convs are not counted;
  - once per model: the final norm's input (``d``) and the logits (``vocab_size``).

  With activation checkpointing a block keeps only its input, and one block's activations exist at a time during
  its recomputation: ``n_blocks x d + one block``.
* batch: the micro-batch as the data module yields it: ``tokens`` int64, ``loss_mask`` bool, ``answer_id`` and
  ``group`` int32 (17 bytes per token; ``canonlm.data.packing``).

Example: :func:`training_memory` of a tiny CPU model (2L64D with Canon-ABCD, vocabulary 19, fp32) for 8 windows
x 128 tokens is 548.8 KiB of parameters, as much for the gradients, 1.1 MiB of AdamW state and 12.8 MiB of
activations; ``data.batch_size=100000000`` makes the activations 152.9 TiB, which no machine has.

Sources: the forward code of this package (``canonlm.arch.model`` / ``modules`` / ``mixers``); Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1) for the per-layer accounting of stored
activations; ``torch.optim.AdamW`` (torch 2.x, ``_init_group``) for the state tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from canonlm.arch.config import LINEAR_ARCHS, ModelConfig

#: Bytes per token of a batch: tokens (int64) + loss_mask (bool) + answer_id (int32) + group (int32).
BATCH_BYTES_PER_TOKEN = 8 + 1 + 4 + 4


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes per process of one training step (:func:`training_memory`); ``total`` is their sum."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    batch: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.batch

    @property
    def model_state(self) -> int:
        """Parameters, gradients and optimizer state (independent of the batch)."""
        return self.parameters + self.gradients + self.optimizer

    def describe(self) -> str:
        """``"parameters 1.2 MiB, gradients ..., AdamW state ..., activations ..., batch data ..."`` (binary units)."""
        return (f"parameters {human_bytes(self.parameters)}, gradients {human_bytes(self.gradients)}, optimizer "
                f"state {human_bytes(self.optimizer)}, activations {human_bytes(self.activations)}, batch data "
                f"{human_bytes(self.batch)}")


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``3.0 KiB``, ``10.4 GiB``, ``1.2 PiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def dtype_bytes(precision: str | int | None, fsdp_param_dtype: str | None = None) -> tuple[int, int]:
    """(parameter bytes, compute bytes) per element for a Lightning ``trainer.precision`` (and FSDP2's
    ``strategy.param_dtype``, None without FSDP2): parameters are fp32 except under ``bf16-true`` / ``16-true``
    (2) and ``64-true`` (8); the compute dtype is ``canonlm.arch.model.compute_dtype_for``'s rule (bf16 / fp16: 2,
    fp64: 8, else 4)."""
    prec = str(precision)
    param = 2 if prec in ("bf16-true", "16-true", "bf16", "16") else 8 if prec.startswith("64") else 4
    if "bf16" in prec or fsdp_param_dtype == "bf16" or prec.startswith("16"):
        compute = 2
    elif prec.startswith("64"):
        compute = 8
    else:
        compute = 4
    return param, compute


def block_activations(cfg: ModelConfig) -> int:
    """Elements per token one block keeps for its backward pass (module docstring), at least."""
    d = cfg.d_model
    if cfg.arch == "mamba2":
        mixer = (2 * cfg.value_dim + 2 * cfg.n_groups * cfg.ssm_state + cfg.n_heads) + cfg.value_dim
    elif cfg.arch in LINEAR_ARCHS:  # GLA, GDN
        mixer = 2 * cfg.key_dim + 2 * cfg.value_dim
    else:  # Llama attention: q, k, v, then the attention output; Canon-B keeps q, k, v before and after its conv
        qkv = d + 2 * cfg.kv_heads * cfg.head_dim
        mixer = qkv * (2 if cfg.canon.has("B") else 1) + d
    mlp = 0
    if cfg.has_mlp:
        hidden = 2 * cfg.ffn_dim if cfg.mlp == "gated" else cfg.ffn_dim
        mlp = d + hidden * (2 if cfg.canon.has("D") and cfg.arch not in LINEAR_ARCHS else 1)
    return d + mixer + mlp


def count_parameters(cfg: ModelConfig) -> int:
    """The model's parameter count (``CanonLM(cfg).num_params()``, built on the meta device: no memory)."""
    import torch

    from canonlm.arch.model import CanonLM

    with torch.device("meta"):
        return CanonLM(cfg).num_params()


def training_memory(cfg: ModelConfig, micro_batch: int, context: int, *, precision: str | int = "32-true",
                    fsdp_param_dtype: str | None = None, shards: int = 1, activation_checkpointing: bool = False,
                    optimizer_states: int = 2, n_params: int | None = None) -> TrainingMemory:
    """Bytes per process of one training step of the model ``cfg`` on ``micro_batch`` windows of ``context`` tokens
    (a lower bound; module docstring for what is counted and why).

    precision / fsdp_param_dtype: ``trainer.precision`` and FSDP2's ``strategy.param_dtype`` (:func:`dtype_bytes`).
    shards: the FSDP2 shard count (the world size; parameters, gradients and optimizer state are divided by it), 1
    otherwise. activation_checkpointing: each block keeps only its input. optimizer_states: state tensors per
    parameter (AdamW 2). n_params: the parameter count when known (else :func:`count_parameters`).
    Raises ValueError for a micro-batch, context or shard count below 1."""
    if micro_batch < 1 or context < 1 or shards < 1:
        raise ValueError(f"micro_batch={micro_batch}, context={context}, shards={shards}: each must be >= 1")
    n = count_parameters(cfg) if n_params is None else int(n_params)
    p_bytes, c_bytes = dtype_bytes(precision, fsdp_param_dtype)
    state = -(-n * p_bytes // shards)  # ceil: every shard holds its share
    block = block_activations(cfg)
    blocks = cfg.n_layers
    per_token = (blocks * cfg.d_model + block) if activation_checkpointing else blocks * block
    per_token += cfg.d_model + cfg.vocab_size  # final norm input, logits
    tokens = int(micro_batch) * int(context)
    return TrainingMemory(parameters=state, gradients=state, optimizer=optimizer_states * state,
                          activations=tokens * per_token * c_bytes, batch=tokens * BATCH_BYTES_PER_TOKEN)


__all__ = ["BATCH_BYTES_PER_TOKEN", "TrainingMemory", "block_activations", "count_parameters", "dtype_bytes",
           "human_bytes", "training_memory"]
