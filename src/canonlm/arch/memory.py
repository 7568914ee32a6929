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
* gathered (FSDP2 only, ``fsdp_param_dtype`` given): the unsharded parameters FSDP2 all-gathers, in its
  ``param_dtype``: the root unit (token embedding, final norm and LM head; the root is not resharded after the
  forward, torch ``fully_shard``'s root rule) and one block (the unit whose backward runs; FSDP2 prefetches the next
  one, which makes two in practice, but one is the bound);
* buckets (DDP with more than one rank, ``ddp_buckets=True``): ``DistributedDataParallel``'s gradient buckets, one
  more copy of the gradients (Lightning's ``DDPStrategy`` leaves ``gradient_as_bucket_view`` False).

Peak: the gradients and the activations are not both whole at any one time. Between steps the gradients are None
(``optimizer.zero_grad()``'s ``set_to_none=True``, torch's default and Lightning's call); the backward pass creates
them as it frees the activations, so the step needs at least the larger of the two (``total``), on top of the
parameters, the optimizer state and the batch. With gradient accumulation (``accumulate=True``) the gradients of the
previous micro-batches stay while the next one's activations are kept: then the sum.

Not counted either: under ``*-mixed`` precision autocast's compute-dtype copies of the weights (saved for the
backward in eager mode, recomputed by a compiled graph), the CUDA context and NCCL's buffers.

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
    gathered: int = 0
    buckets: int = 0
    accumulate: bool = False

    @property
    def total(self) -> int:
        """The step's bound: parameters, optimizer state, batch data, FSDP2's gathered units and DDP's buckets, plus
        the larger of the gradients and the activations -- or their sum under gradient accumulation (module
        docstring, "peak")."""
        grads_acts = (self.gradients + self.activations if self.accumulate
                      else max(self.gradients, self.activations))
        return self.parameters + self.optimizer + grads_acts + self.batch + self.gathered + self.buckets

    @property
    def model_state(self) -> int:
        """Parameters, gradients and optimizer state (independent of the batch)."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def batch_dominated(self) -> bool:
        """Whether the micro-batch's activations and data outweigh everything the model holds whatever the batch
        (its state, FSDP2's gathered units, DDP's buckets): an over-memory refusal then names ``data.batch_size``,
        else ``model.size`` (train.py's check and ``python -m canonlm.estimate``)."""
        return self.activations + self.batch > self.model_state + self.gathered + self.buckets

    def describe(self) -> str:
        """``"parameters 1.2 MiB, gradients ..., AdamW state ..., activations ..., batch data ..."`` (binary units)."""
        extra = (f", FSDP2 all-gathered parameters {human_bytes(self.gathered)}" if self.gathered else "") + (
            f", DDP gradient buckets {human_bytes(self.buckets)}" if self.buckets else "")
        return (f"parameters {human_bytes(self.parameters)}, gradients {human_bytes(self.gradients)}, optimizer "
                f"state {human_bytes(self.optimizer)}, activations {human_bytes(self.activations)}, batch data "
                f"{human_bytes(self.batch)}{extra}")


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
    from canonlm.arch.model import compute_dtype_for

    prec = str(precision)
    # Lightning's short names are aliases of the mixed modes ("bf16" = "bf16-mixed", "16" = "16-mixed"): fp32 weights
    param = 2 if prec in ("bf16-true", "16-true") else 8 if prec.startswith("64") else 4
    return param, compute_dtype_for(precision, fsdp_param_dtype).itemsize


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


def unit_parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(root, block): parameters of FSDP2's root unit (everything outside the blocks: token embedding, final norm,
    LM head; a tied head counted once) and of the largest block, from ``CanonLM(cfg)`` built on the meta device."""
    import torch

    from canonlm.arch.model import CanonLM

    with torch.device("meta"):
        model = CanonLM(cfg)
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    return model.num_params() - sum(p.numel() for p in model.blocks.parameters()), block


def training_memory(cfg: ModelConfig, micro_batch: int, context: int, *, precision: str | int = "32-true",
                    fsdp_param_dtype: str | None = None, shards: int = 1, activation_checkpointing: bool = False,
                    optimizer_states: int = 2, n_params: int | None = None, ddp_buckets: bool = False,
                    units: tuple[int, int] | None = None, accumulate: int = 1) -> TrainingMemory:
    """Bytes per process of one training step of the model ``cfg`` on ``micro_batch`` windows of ``context`` tokens
    (a lower bound; module docstring for what is counted and why).

    precision / fsdp_param_dtype: ``trainer.precision`` and FSDP2's ``strategy.param_dtype`` (:func:`dtype_bytes`;
    given only under FSDP2, which then also counts its all-gathered root unit and one block, ``gathered``).
    shards: the FSDP2 shard count (the world size; parameters, gradients and optimizer state are divided by it), 1
    otherwise. activation_checkpointing: each block keeps only its input. optimizer_states: state tensors per
    parameter (AdamW 2). n_params: the parameter count when known (else :func:`count_parameters`). ddp_buckets: DDP
    over more than one rank (one more copy of the gradients, ``buckets``). units: (root, block) parameter counts
    when known (else :func:`unit_parameters`, needed only under FSDP2 with ``n_params`` > 0). accumulate:
    ``trainer.accumulate_grad_batches`` (above 1 the gradients and activations are added in ``total``).
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
    gathered = 0
    if fsdp_param_dtype is not None and n > 0:
        root, block = unit_parameters(cfg) if units is None else units
        gathered = (int(root) + int(block)) * c_bytes
    return TrainingMemory(parameters=state, gradients=state, optimizer=optimizer_states * state,
                          activations=tokens * per_token * c_bytes, batch=tokens * BATCH_BYTES_PER_TOKEN,
                          gathered=gathered, buckets=n * p_bytes if ddp_buckets else 0,
                          accumulate=int(accumulate) > 1)


def strategy_memory(cfg: ModelConfig, micro_batch: int, context: int, *, strategy: str, world_size: int,
                    precision: str | int = "32-true", param_dtype: str | None = None, accumulate: int = 1,
                    activation_checkpointing: bool = False, amsgrad: bool = False,
                    n_params: int | None = None) -> TrainingMemory:
    """:func:`training_memory` for a run's settings as the config names them: ``strategy`` (``strategy.name``:
    ``fsdp2`` shards parameters, gradients and optimizer state over ``world_size`` and counts its all-gathered units
    in ``param_dtype``; ``ddp`` / ``ddp_spawn`` / ``auto`` replicate them, with DDP's gradient buckets when
    ``world_size`` > 1), ``precision`` (``trainer.precision``), ``accumulate`` (``trainer.accumulate_grad_batches``),
    ``activation_checkpointing``, ``amsgrad`` (AdamW's third state tensor). One mapping for ``train.py``'s memory
    refusal and ``python -m canonlm.estimate``. Raises ValueError as :func:`training_memory`."""
    fsdp = strategy == "fsdp2"
    n = count_parameters(cfg) if n_params is None else int(n_params)
    return training_memory(cfg, micro_batch, context, precision=precision,
                           fsdp_param_dtype=(param_dtype or "fp32") if fsdp else None,
                           shards=max(1, world_size) if fsdp else 1, activation_checkpointing=activation_checkpointing,
                           optimizer_states=3 if amsgrad else 2, n_params=n, ddp_buckets=not fsdp and world_size > 1,
                           units=unit_parameters(cfg) if fsdp and n > 0 else None, accumulate=accumulate)


__all__ = ["BATCH_BYTES_PER_TOKEN", "TrainingMemory", "block_activations", "count_parameters", "dtype_bytes",
           "human_bytes", "strategy_memory", "training_memory", "unit_parameters"]
