"""Memory of a training step: bytes of parameters, gradients, AdamW state, activations and batch data per process,
as a function of the model config (:func:`training_memory`).

Units: **bytes per process** (one rank; under FSDP2 the sharded parts are divided by the shard count).

What is counted, and why it is a **lower bound** of the peak (a run it refuses cannot run; a run it admits may
still run out of memory — allocator fragmentation, kernel workspaces, temporaries and framework overheads are not
counted, nor are the convolutions' other saved copies, biases, norms' saved statistics or attention's log-sum-exp):

* parameters: ``n_params`` x the parameter dtype (fp32 unless ``trainer.precision`` is ``bf16-true`` / ``16-true``
  (2 bytes) or ``64-true`` (8 bytes)); ``n_params`` is the model's own count (a meta-device ``CanonLM``);
* gradients: one per parameter, in the parameter dtype;
* optimizer state: ``optimizer_states`` tensors per parameter in the parameter dtype (AdamW: ``exp_avg`` and
  ``exp_avg_sq``, 2; with ``amsgrad`` 3), as ``torch.optim.AdamW`` allocates them at the first step;
* activations: per token of the micro-batch, the tensors the backward pass needs from every block, whether eager or
  compiled (a compiler may recompute element-wise results but not the inputs of matrix products, which it does not
  recompute by default), in the dtype autograd saves them in:

  - every block: its input, the residual stream (width ``d``), saved by the block's first RMSNorm, in the
    **stream dtype** (:func:`stream_bytes`): under ``*-mixed`` precision the parameters are fp32 and autocast leaves
    the stream in fp32 (the embedding lookup is not autocast, so its output is fp32, and every block adds its bf16
    sub-layer outputs into it: fp32 + bf16 = fp32), 4 bytes; under FSDP2's bf16 ``param_dtype`` or ``bf16-true`` the
    embedding output is bf16 and so is the stream, 2 bytes (eager RMSNorm saves an fp32 upcast there, a compiled
    one may keep the bf16 input: 2 is the bound). Everything else is in the **compute dtype** (``compute_dtype_for``:
    bf16 under ``bf16-*`` or FSDP2's bf16 ``param_dtype``);
  - Llama attention: q, k, v (``d + 2 d_kv``; twice with Canon-B: the conv's input and its output) and the
    attention output that enters the output projection (``d``);
  - GLA / GDN: q, k (``key_dim`` each), v and the output before its projection (``value_dim`` each);
  - Mamba2: the input projection's output (``2 d_inner + 2 G N + H``) and the scan output (``d_inner``);
  - the MLP (when the block has one): its input (``d``) and its hidden pre-activation (``2 d_ff`` gated, ``d_ff``
    standard; twice with a Llama's Canon-D: the conv's input and its output);
  - Canon-A and Canon-C (any architecture): ``d`` each. Each convolves a norm's output ``h`` and feeds the next
    matrix product (``wqkv`` / the mixer's projections after A, ``w13`` after C). Without the conv that product
    saves ``h`` itself; with it, the product saves the conv's output and the conv saves its input ``h`` for its
    weight gradient (every Canon backend: the reference, the shift-and-add path, Dao's and fla's kernels): one more
    ``(B, T, d)`` tensor in the compute dtype per site. The linear mixers' own short convs (``b``) and their
    Canon-D are not counted;
  - once per model: the final norm's input (``d``, stream dtype) and the loss' **fp32 log-softmax**: ``4 V`` bytes a
    token whatever the compute dtype. ``canonlm.arch.loss.lm_loss`` upcasts the logits to fp32 and
    ``F.cross_entropy`` saves its log-softmax output (fp32) for the backward (``z_loss=palm``'s ``logsumexp`` saves
    its fp32 input instead: the same size); the compute-dtype logits are not saved by the LM head (a product saves
    its input) and are not counted.

  With activation checkpointing a block keeps only its input, and one block's activations exist at a time during
  its recomputation: ``n_blocks x d`` (stream dtype) + one block, whose input is the tensor the checkpoint holds
  (not counted twice).
* document masking (``doc_mask=True``: ``task.doc_mask``, the batches carry ``doc_ids``; :func:`doc_masking`),
  once per micro-batch, added to the activations:

  - Llama attention with ``sdpa`` (``auto``, ``fused``) or ``reference``: ONE additive block-causal mask
    ``(B, 1, T, T)`` in the compute dtype, built once per forward and given to every layer
    (``canonlm.arch.doc_mask.build_doc_mask``); each layer's attention keeps a reference to that same tensor for its
    backward, so it costs ``B T^2 x compute bytes`` once, whatever the number of layers. Under grouped-query
    attention the masked kernels also take k and v repeated to the H query heads (SDPA's memory-efficient kernel has
    no GQA) and save those: ``2 (H - H_kv) d_head`` more elements a token per layer. ``flash``
    (``model.kernels.attention=flash``): flash-attn's varlen kernel on the documents' ``cu_seqlens``, no mask (0);
  - the index tensors built once per forward (``canonlm.ops.varlen.documents``): each token's position in its
    document (int64) and its document index (int32), 12 bytes a token, and where a varlen kernel takes them (GLA,
    GDN, ``flash`` attention) the cumulative lengths ``cu_seqlens`` (int64, at least ``B + 1`` entries: every row
    holds at least one document). They live for the whole forward (and through the backward where a kernel saves
    them or activation checkpointing keeps them); if they are freed before the loss, the compute-dtype logits of the
    forward's last product, alive then and not counted, are larger;
  - Canon layers and short convs run the masked forms of the same kernels (Dao's ``seq_idx``, fla's
    ``cu_seqlens``): the same saved tensors as without masking, nothing more;
  - the batch's ``doc_ids`` (int32, 4 bytes a token), added to the batch data.
* batch: the micro-batch as the data module yields it: ``tokens`` int64, ``loss_mask`` bool, ``answer_id`` and
  ``group`` int32 (17 bytes per token; ``canonlm.data.packing``), + ``doc_ids`` under document masking.
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
x 128 tokens is 548.8 KiB of parameters, as much for the gradients, 1.1 MiB of AdamW state and 13.8 MiB of
activations; ``data.batch_size=100000000`` makes the activations 164.8 TiB, which no machine has.

Sources: the forward code of this package (``canonlm.arch.model`` / ``modules`` / ``mixers`` / ``loss`` /
``doc_mask``, ``canonlm.ops.attention``'s masked paths); Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", §4.1) for the per-layer accounting of stored activations; ``torch.optim.AdamW``
(torch 2.x, ``_init_group``) for the state tensors; ``torch.autograd``'s saved tensors of ``log_softmax``
(its result) and of ``F.scaled_dot_product_attention`` (q, k, v, ``attn_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

from canonlm.arch.config import LINEAR_ARCHS, ModelConfig

#: Bytes per token of a batch: tokens (int64) + loss_mask (bool) + answer_id (int32) + group (int32).
BATCH_BYTES_PER_TOKEN = 8 + 1 + 4 + 4
#: Bytes per token document masking adds to a batch: ``doc_ids`` (int32).
DOC_IDS_BYTES_PER_TOKEN = 4
#: Bytes per token of the index tensors a document-masked forward builds: position in document (int64) + document
#: index (int32) (``canonlm.ops.varlen.documents``).
DOC_INDEX_BYTES_PER_TOKEN = 8 + 4
#: Bytes per element of the loss' saved log-softmax (fp32 whatever the compute dtype; ``canonlm.arch.loss``).
LOSS_BYTES = 4
#: Attention requests that run document masking with the shared additive mask (``flash`` runs varlen, no mask).
MASKED_ATTENTION = ("auto", "fused", "sdpa", "reference")


@dataclass(frozen=True)
class DocMasking:
    """What document masking adds to one micro-batch of ``micro_batch`` x ``context`` tokens (bytes per process;
    :func:`doc_masking`): ``mask`` the shared (B, 1, T, T) attention mask, ``kv_repeat`` grouped-query k / v repeated
    to the query heads in every layer, ``index`` the per-forward index tensors (all three in the activations),
    ``batch`` the batch's ``doc_ids`` (in the batch data); ``attention`` the attention request counted (``sdpa``,
    ``flash``, ...; ``none`` for the linear mixers), ``dtype_bytes`` the mask's element size, ``layers`` the blocks
    that share it."""

    micro_batch: int
    context: int
    attention: str
    dtype_bytes: int
    layers: int
    mask: int
    kv_repeat: int
    index: int
    batch: int

    @property
    def activations(self) -> int:
        """The bytes added to the activations: mask + repeated k / v + index tensors."""
        return self.mask + self.kv_repeat + self.index

    def describe(self) -> str:
        """One line: what was counted, e.g. ``"attention sdpa: one (6, 1, 4096, 4096) mask of 2-byte elements shared
        by the 24 layers 192.0 MiB, index tensors 288.0 KiB; batch doc_ids 96.0 KiB"``."""
        b, t = self.micro_batch, self.context
        if self.mask:
            backend = (
                self.attention if self.attention in ("sdpa", "reference") else f"sdpa (requested: {self.attention})"
            )
            what = (
                f"attention {backend}: one ({b}, 1, {t}, {t}) mask of {self.dtype_bytes}-byte elements shared by "
                f"the {self.layers} layers {human_bytes(self.mask)}"
            )
        elif self.attention == "flash":
            what = "attention flash: varlen kernel on cu_seqlens, no mask"
        else:
            what = "no attention mask (linear mixer: states restart per document)"
        kv = f", k/v repeated to the query heads {human_bytes(self.kv_repeat)}" if self.kv_repeat else ""
        return f"{what}{kv}, index tensors {human_bytes(self.index)}; batch doc_ids {human_bytes(self.batch)}"


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes per process of one training step (:func:`training_memory`); ``total`` is their sum. ``doc_masking``:
    what document masking added (already in ``activations`` and ``batch``), or None without it."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    batch: int
    gathered: int = 0
    buckets: int = 0
    accumulate: bool = False
    doc_masking: DocMasking | None = None

    @property
    def total(self) -> int:
        """The step's bound: parameters, optimizer state, batch data, FSDP2's gathered units and DDP's buckets, plus
        the larger of the gradients and the activations -- or their sum under gradient accumulation (module
        docstring, "peak")."""
        grads_acts = self.gradients + self.activations if self.accumulate else max(self.gradients, self.activations)
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
            f", DDP gradient buckets {human_bytes(self.buckets)}" if self.buckets else ""
        )
        masked = (
            f" (document masking {human_bytes(self.doc_masking.activations)} of them)"
            if self.doc_masking is not None
            else ""
        )
        return (
            f"parameters {human_bytes(self.parameters)}, gradients {human_bytes(self.gradients)}, optimizer "
            f"state {human_bytes(self.optimizer)}, activations {human_bytes(self.activations)}{masked}, batch "
            f"data {human_bytes(self.batch)}{extra}"
        )


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


def stream_bytes(precision: str | int | None, fsdp_param_dtype: str | None = None) -> int:
    """Bytes per element of the residual stream (each block's input; module docstring): the dtype of the
    parameters the forward sees, since the stream starts as the embedding's output and autocast does not cast it --
    FSDP2's ``param_dtype`` when given (``bf16``: 2, else 4), else the parameter dtype of :func:`dtype_bytes` (fp32
    under ``*-mixed`` and ``32-true``: 4; ``bf16-true`` / ``16-true``: 2; ``64-true``: 8)."""
    if fsdp_param_dtype is not None:
        return 2 if str(fsdp_param_dtype) == "bf16" else 4
    return dtype_bytes(precision)[0]


def block_activations(cfg: ModelConfig) -> tuple[int, int]:
    """Elements per token one block keeps for its backward pass, at least (module docstring): (in the stream dtype:
    its input, ``d``; in the compute dtype: everything else)."""
    d = cfg.d_model
    if cfg.arch == "mamba2":
        mixer = (2 * cfg.value_dim + 2 * cfg.n_groups * cfg.ssm_state + cfg.n_heads) + cfg.value_dim
    elif cfg.arch in LINEAR_ARCHS:  # GLA, GDN
        mixer = 2 * cfg.key_dim + 2 * cfg.value_dim
    else:  # Llama attention: q, k, v, then the attention output; Canon-B keeps q, k, v before and after its conv
        qkv = d + 2 * cfg.kv_heads * cfg.head_dim
        mixer = qkv * (2 if cfg.canon.has("B") else 1) + d
    mixer += d if cfg.canon.has("A") else 0  # Canon-A's input (the norm's output), saved for its weight gradient
    mlp = 0
    if cfg.has_mlp:
        hidden = 2 * cfg.ffn_dim if cfg.mlp == "gated" else cfg.ffn_dim
        mlp = d + hidden * (2 if cfg.canon.has("D") and cfg.arch not in LINEAR_ARCHS else 1)
        mlp += d if cfg.canon.has("C") else 0  # Canon-C's input, likewise
    return d, mixer + mlp


def attention_request(cfg: ModelConfig) -> str:
    """The attention backend a Llama ``cfg`` asks for: ``model.kernels.attention`` when pinned, else ``model.ops``
    (``auto`` | ``reference`` | ``fused`` | ``sdpa`` | ``flash``)."""
    return str(cfg.kernels.get("attention", cfg.ops))


def doc_masking(
    cfg: ModelConfig,
    micro_batch: int,
    context: int,
    compute_bytes: int,
    attention: str | None = None,
    activation_checkpointing: bool = False,
) -> DocMasking:
    """What document masking costs one micro-batch of ``micro_batch`` windows (B) of ``context`` tokens (T) of the
    model ``cfg`` (module docstring, "document masking"; bytes per process). ``compute_bytes``: the compute dtype's
    element size (the mask's). ``attention``: the Llama attention request (default :func:`attention_request`):
    ``flash`` runs varlen (no mask, ``cu_seqlens``), the others (:data:`MASKED_ATTENTION`) share one
    ``(B, 1, T, T)`` mask; ignored for the linear mixers (no mask; ``cu_seqlens`` for GLA / GDN).
    activation_checkpointing: one block's grouped-query k / v copies exist at a time (the mask and the index tensors
    are kept whole: the checkpoints hold them). Raises ValueError for a micro-batch or context below 1 or an
    attention request that is none of ``auto | fused | sdpa | reference | flash``."""
    if micro_batch < 1 or context < 1:
        raise ValueError(f"micro_batch={micro_batch}, context={context}: each must be >= 1")
    B, T = int(micro_batch), int(context)
    attn = "none"
    mask = kv = 0
    cu = cfg.arch in ("gla", "gdn")
    if cfg.arch not in LINEAR_ARCHS:
        attn = attention_request(cfg) if attention is None else str(attention)
        if attn not in (*MASKED_ATTENTION, "flash"):
            raise ValueError(f"attention={attn!r}; allowed: {' | '.join(MASKED_ATTENTION)} | flash")
        if attn == "flash":
            cu = True
        else:
            mask = B * T * T * int(compute_bytes)
            layers = 1 if activation_checkpointing else cfg.n_layers
            kv = B * T * layers * 2 * (cfg.n_heads - cfg.kv_heads) * cfg.head_dim * int(compute_bytes)
    index = B * T * DOC_INDEX_BYTES_PER_TOKEN + ((B + 1) * 8 if cu else 0)
    return DocMasking(
        micro_batch=B,
        context=T,
        attention=attn,
        dtype_bytes=int(compute_bytes),
        layers=cfg.n_layers,
        mask=mask,
        kv_repeat=kv,
        index=index,
        batch=B * T * DOC_IDS_BYTES_PER_TOKEN,
    )


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


def training_memory(
    cfg: ModelConfig,
    micro_batch: int,
    context: int,
    *,
    precision: str | int = "32-true",
    fsdp_param_dtype: str | None = None,
    shards: int = 1,
    activation_checkpointing: bool = False,
    optimizer_states: int = 2,
    n_params: int | None = None,
    ddp_buckets: bool = False,
    units: tuple[int, int] | None = None,
    accumulate: int = 1,
    doc_mask: bool = False,
    attention: str | None = None,
) -> TrainingMemory:
    """Bytes per process of one training step of the model ``cfg`` on ``micro_batch`` windows of ``context`` tokens
    (a lower bound; module docstring for what is counted and why).

    precision / fsdp_param_dtype: ``trainer.precision`` and FSDP2's ``strategy.param_dtype`` (:func:`dtype_bytes`,
    :func:`stream_bytes`; given only under FSDP2, which then also counts its all-gathered root unit and one block,
    ``gathered``). shards: the FSDP2 shard count (the world size; parameters, gradients and optimizer state are
    divided by it), 1 otherwise. activation_checkpointing: each block keeps only its input. optimizer_states: state
    tensors per parameter (AdamW 2). n_params: the parameter count when known (else :func:`count_parameters`).
    ddp_buckets: DDP over more than one rank (one more copy of the gradients, ``buckets``). units: (root, block)
    parameter counts when known (else :func:`unit_parameters`, needed only under FSDP2 with ``n_params`` > 0).
    accumulate: ``trainer.accumulate_grad_batches`` (above 1 the gradients and activations are added in ``total``).
    doc_mask: document masking (``task.doc_mask``; :func:`doc_masking`'s costs, with the attention request
    ``attention``, default the model's own). Raises ValueError for a micro-batch, context or shard count below 1 and
    as :func:`doc_masking`."""
    if micro_batch < 1 or context < 1 or shards < 1:
        raise ValueError(f"micro_batch={micro_batch}, context={context}, shards={shards}: each must be >= 1")
    n = count_parameters(cfg) if n_params is None else int(n_params)
    p_bytes, c_bytes = dtype_bytes(precision, fsdp_param_dtype)
    r_bytes = stream_bytes(precision, fsdp_param_dtype)
    state = -(-n * p_bytes // shards)  # ceil: every shard holds its share
    stream, compute = block_activations(cfg)
    block = stream * r_bytes + compute * c_bytes
    blocks = cfg.n_layers
    # checkpointing: every block's input, and one block recomputed whose input is the one the checkpoint holds
    per_token = blocks * stream * r_bytes + compute * c_bytes if activation_checkpointing else blocks * block
    per_token += cfg.d_model * r_bytes + LOSS_BYTES * cfg.vocab_size  # final norm input, fp32 log-softmax
    tokens = int(micro_batch) * int(context)
    masking = doc_masking(cfg, micro_batch, context, c_bytes, attention, activation_checkpointing) if doc_mask else None
    gathered = 0
    if fsdp_param_dtype is not None and n > 0:
        root, block_params = unit_parameters(cfg) if units is None else units
        gathered = (int(root) + int(block_params)) * c_bytes
    return TrainingMemory(
        parameters=state,
        gradients=state,
        optimizer=optimizer_states * state,
        activations=tokens * per_token + (masking.activations if masking else 0),
        batch=tokens * BATCH_BYTES_PER_TOKEN + (masking.batch if masking else 0),
        gathered=gathered,
        buckets=n * p_bytes if ddp_buckets else 0,
        accumulate=int(accumulate) > 1,
        doc_masking=masking,
    )


def strategy_memory(
    cfg: ModelConfig,
    micro_batch: int,
    context: int,
    *,
    strategy: str,
    world_size: int,
    precision: str | int = "32-true",
    param_dtype: str | None = None,
    accumulate: int = 1,
    activation_checkpointing: bool = False,
    amsgrad: bool = False,
    n_params: int | None = None,
    doc_mask: bool = False,
) -> TrainingMemory:
    """:func:`training_memory` for a run's settings as the config names them: ``strategy`` (``strategy.name``:
    ``fsdp2`` shards parameters, gradients and optimizer state over ``world_size`` and counts its all-gathered units
    in ``param_dtype``; ``ddp`` / ``ddp_spawn`` / ``auto`` replicate them, with DDP's gradient buckets when
    ``world_size`` > 1), ``precision`` (``trainer.precision``), ``accumulate`` (``trainer.accumulate_grad_batches``),
    ``activation_checkpointing``, ``amsgrad`` (AdamW's third state tensor), ``doc_mask`` (``task.doc_mask``; the
    attention backend is the model config's, ``model.kernels.attention`` / ``model.ops``). One mapping for
    ``train.py``'s memory refusal and ``python -m canonlm.estimate``. Raises ValueError as :func:`training_memory`."""
    fsdp = strategy == "fsdp2"
    n = count_parameters(cfg) if n_params is None else int(n_params)
    return training_memory(
        cfg,
        micro_batch,
        context,
        precision=precision,
        fsdp_param_dtype=(param_dtype or "fp32") if fsdp else None,
        shards=max(1, world_size) if fsdp else 1,
        activation_checkpointing=activation_checkpointing,
        optimizer_states=3 if amsgrad else 2,
        n_params=n,
        ddp_buckets=not fsdp and world_size > 1,
        units=unit_parameters(cfg) if fsdp and n > 0 else None,
        accumulate=accumulate,
        doc_mask=doc_mask,
    )


__all__ = [
    "BATCH_BYTES_PER_TOKEN",
    "DOC_IDS_BYTES_PER_TOKEN",
    "DOC_INDEX_BYTES_PER_TOKEN",
    "LOSS_BYTES",
    "MASKED_ATTENTION",
    "DocMasking",
    "TrainingMemory",
    "attention_request",
    "block_activations",
    "count_parameters",
    "doc_masking",
    "dtype_bytes",
    "human_bytes",
    "stream_bytes",
    "strategy_memory",
    "training_memory",
    "unit_parameters",
]
