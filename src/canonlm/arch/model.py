"""CanonLM: a pre-norm decoder with Canon layers at A, B, C, D around one token mixer per block (paper §4, §5,
App. C; official `modeling_llama_canon.py`). ``arch=llama`` is LlamaCanon; ``gla`` / ``gdn`` / ``mamba2`` swap the
attention for a linear mixer (:mod:`canonlm.arch.mixers`), everything else stays.

    input_ids (B, T) -> tok_emb -> n_layers x Block -> RMSNorm -> lm_head -> logits (B, T, V)

    Block (pre-norm; Canon sites per paper §4):
        x = x + mixer(CanonA(RMSNorm(x)))            Llama: Wo · attention(RoPE(CanonB(QKnorm(Wqkv · .))))
        x = x + W2 · act·gate(CanonD(W13 · CanonC(RMSNorm(x))))      (absent for Mamba2 without MLP)

Llama uses one fused ``wqkv`` Linear (output ``[q ; k ; v]``) and one fused ``w13`` Linear (``[W1 x ; W3 x]``) so
Canon-B / Canon-D act on the concatenations without a ``cat``; parameter counts equal those of separate Linears.

Decoding: ``model(ids, cache=model.new_cache())`` processes any number of new tokens and carries KV, Canon, short-conv
and recurrent states in the :class:`~canonlm.arch.cache.DecodeCache`; token-by-token calls give the logits of one
full forward.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from canonlm.arch.cache import DecodeCache
from canonlm.arch.canon import Canon
from canonlm.arch.config import ConfigError, ModelConfig, validate
from canonlm.arch.doc_mask import DocMask, build_doc_mask, check_doc_ids, doc_mask_problem
from canonlm.arch.mixers import GLA, Attention, GatedDeltaNet, Mamba2Mixer, build_mixer
from canonlm.arch.modules import MLP, GatedRMSNorm, RMSNorm
from canonlm.arch.positional import rope_angles
from canonlm.ops import attention as attention_ops
from canonlm.ops import canon as canon_ops
from canonlm.ops import gdn as gdn_ops
from canonlm.ops import gla as gla_ops
from canonlm.ops import ssd as ssd_ops

log = logging.getLogger("canonlm")

# The sequence ops each architecture uses (besides Canon), and their modules (each has resolve_backend).
MIXER_OP = {"llama": "attention", "gla": "gla", "gdn": "gdn", "mamba2": "ssd"}
_LINEAR_OPS = {"gla": gla_ops, "gdn": gdn_ops, "ssd": ssd_ops}
_FLA_CHUNK = 64  # fla's chunk_gla / chunk_gated_delta_rule use chunks of 64 positions whatever they are given


def _fast_shape_reason(cfg: ModelConfig, op: str, backend: str) -> str | None:
    """Why the fast kernel ``backend`` of ``op`` cannot take this model's shapes, or None (the ops own the limits)."""
    if op == "gdn" and backend == "fla":
        return gdn_ops.fla_shape_reason(cfg.head_k_dim)
    return None


def _ops_of(cfg: ModelConfig) -> tuple[str, str]:
    """The sequence ops the architecture uses: ``("canon", <mixer op>)``."""
    return ("canon", MIXER_OP[cfg.arch])


def _request(cfg: ModelConfig, op: str) -> tuple[str, str]:
    """``(requested name, config key)`` of ``op``: a pin ``cfg.kernels[op]`` wins over ``cfg.ops``."""
    if op in cfg.kernels:
        return cfg.kernels[op], f"model.kernels.{op}"
    return cfg.ops, "model.ops"


def _names_of(op: str) -> tuple[str, ...]:
    """Every name a request of ``op`` may use (the op's ``BACKENDS`` plus ``fused``)."""
    if op == "attention":
        return attention_ops.BACKENDS
    mod = canon_ops if op == "canon" else _LINEAR_OPS[op]
    return tuple(mod.BACKENDS) + ("fused",)


def check_requests(cfg: ModelConfig) -> dict[str, str]:
    """The requested backend name of every op the architecture uses, checked against the op's names only (no device,
    dtype or library probe: this holds wherever the model will run).

    Returns:
        ``{"canon": name, <mixer op>: name}`` (``auto`` | ``reference`` | ``fused`` | a pinned kernel name).
    Raises:
        ConfigError("model.kernels.<op>" when pinned, else "model.ops", name, allowed names) for an unknown name.
    """
    out = {}
    for op in _ops_of(cfg):
        name, key = _request(cfg, op)
        allowed = _names_of(op)
        if name not in allowed:
            raise ConfigError(key, name, "one of " + ", ".join(allowed))
        out[op] = name
    return out


def _resolve_op(
    cfg: ModelConfig, op: str, device: torch.device, dtype: torch.dtype, canon_shape: tuple[int, int] | None = None
) -> str:
    """Concrete backend of one op on (device, dtype) (see :func:`resolve_backends`); for Canon, of a layer of
    ``canon_shape`` = (C, K) when given (see :func:`resolve_canon_layers`). Raises ConfigError."""
    name, key = _request(cfg, op)
    try:
        if op == "attention":
            return attention_ops.resolve_backend(name, device, dtype, head_dim=cfg.head_dim)
        if device.type == "meta":  # nothing is probed: a concrete request stays itself, fused is decided later
            return "auto" if name == "fused" else name
        if op == "canon":
            C, K = canon_shape or (None, None)
            if name != "fused":
                return canon_ops.resolve_backend(name, device, dtype, C, K)
            got = canon_ops.resolve_backend("auto", device, dtype, C, K)
            if got in ("torch", "reference"):
                raise ConfigError(
                    key,
                    name,
                    f"auto | reference (no fused Canon kernel for {device.type}/"
                    f"{dtype}: {canon_ops.available_backends(device, dtype, C, K)})",
                )
            return got
        mod = _LINEAR_OPS[op]
        got = mod.resolve_backend("auto" if name == "fused" else name, device, dtype)
        if name == "fused" and got == "reference":
            fast = [b for b in mod.BACKENDS if b not in ("auto", "reference")]
            raise ConfigError(
                key,
                name,
                f"auto | reference (no fused {op} kernel for {device.type}/{dtype}: "
                f"{' / '.join(fast)} need a CUDA device and the library)",
            )
        reason = _fast_shape_reason(cfg, op, got)
        if reason is not None:
            if name != "auto":
                raise ConfigError(key, name, f"auto | reference ({reason})")
            warnings.warn(f"canonlm: {reason}; using the reference {op} op", RuntimeWarning, stacklevel=3)
            got = "reference"
        if op == "ssd" and got == "mamba_ssm":  # the fully fused conv + scan: a pin must be able to fuse, auto warns
            di = cfg.mamba_expand * cfg.d_model
            ssd_ops.check_fused_split(
                name,
                device,
                dtype,
                cfg.conv_kernel,
                d_inner=di,
                conv_dim=di + 2 * cfg.n_groups * cfg.ssm_state,
                nheads=cfg.n_heads,
                key=key,
            )
        return got
    except ConfigError as e:
        raise ConfigError(key, name, e.allowed) from None
    except ValueError as e:
        raise ConfigError(key, name, str(e)) from None


def resolve_backends(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """Concrete backend of every op the architecture uses for ``device`` and compute ``dtype``: ``canon`` always,
    plus ``attention`` (llama), ``gla``, ``gdn`` or ``ssd`` (Mamba2).

    The requested name of op ``o`` is ``cfg.kernels[o]`` if pinned (a pin wins over ``cfg.ops``), else ``cfg.ops``:
    ``auto`` (fast path when available), ``reference`` (pure-PyTorch oracles), ``fused`` (a fast kernel is
    required). Canon names go to ``canonlm.ops.canon.resolve_backend`` (``fused`` = its ``auto`` choice, refused
    when that is a plain-torch path); attention names to :func:`canonlm.ops.attention.resolve_backend` with the
    model's head dim (``auto``/``fused`` = SDPA); GLA / GDN / SSD names to ``canonlm.ops.<op>.resolve_backend``
    (``fused`` = their ``auto`` choice, refused when that is the reference). On the ``meta`` device nothing is
    probed: names are only checked, a pinned name stays itself and ``fused`` becomes ``auto`` (attention: ``sdpa``).
    Pins of ops the architecture does not use are ignored. ``dtype`` is the dtype the kernels see:
    ``torch.bfloat16`` under bf16 autocast or an FSDP2 bf16 ``param_dtype`` (:func:`compute_dtype_for`), else the
    parameters' dtype.

    Returns:
        ``{"canon": name, <mixer op>: name}``.
    Raises:
        ConfigError("model.kernels.<op>" when pinned, else "model.ops", name, allowed) when a requested backend is
        unknown or cannot run on (device, dtype) -- before any tensor work.
    """
    device = torch.device(device)
    check_requests(cfg)
    return {op: _resolve_op(cfg, op, device, dtype) for op in _ops_of(cfg)}


def resolve_canon_layers(
    cfg: ModelConfig, shapes: dict[str, tuple[int, int]], device: torch.device | str, dtype: torch.dtype
) -> dict[str, str]:
    """Concrete backend of every Canon layer (Canon-A/B/C/D and the linear mixers' short convs ``b``) on ``device``
    with compute ``dtype``, by its shape: ``shapes`` maps a layer's module name to ``(C, K)`` (channels, taps).

    The request (``model.kernels.canon``, else ``model.ops``) goes to ``canonlm.ops.canon.resolve_backend`` with the
    layer's C and K: ``auto`` / ``fused`` pick the first fast kernel that takes the shape (CUDA: Dao's
    ``causal_conv1d_fn`` needs K in {2, 3, 4} and C % 8 == 0, else fla's Triton ``causal_conv1d``, which has no such
    limit); ``fused`` is refused where that leaves a plain-torch path; a pinned name must take every layer's shape.
    On the ``meta`` device nothing is probed (as :func:`resolve_backends`).

    Returns:
        ``{module name: backend}``.
    Raises:
        ConfigError("model.kernels.canon" when pinned, else "model.ops", name, allowed) for the first layer whose
        shape the request cannot take here; ``allowed`` names that layer, its C and K, what runs there and why the
        request does not.
    """
    device = torch.device(device)
    out = {}
    for where, (C, K) in shapes.items():
        try:
            out[where] = _resolve_op(cfg, "canon", device, dtype, (C, K))
        except ConfigError as e:
            raise ConfigError(e.key, e.value, f"{e.allowed} [Canon layer {where}: C={C}, K={K}]") from None
    return out


_FAST = {"gla": "fla", "gdn": "fla", "ssd": "mamba_ssm"}
_said: set = set()


def placement_notes(
    cfg: ModelConfig,
    backends: dict[str, str],
    canon_layers: dict[str, str],
    canon_shapes: dict[str, tuple[int, int]],
    device: torch.device,
    dtype: torch.dtype,
    compile_friendly: bool = False,
) -> tuple[dict[str, str], dict[str, str]]:
    """``(fallbacks, notes)`` of a placement (:meth:`CanonLM.place`), each ``{op: one sentence}``.

    ``fallbacks``: on a CUDA device, every op whose ``auto`` request resolved to a pure-PyTorch path, with the reason
    the fast kernel cannot run -- Canon layers on ``torch`` (neither Dao's nor fla's kernel can take them: the op's
    ``available_backends`` for the first such layer's C and K; not when the blocks are compiled, where ``torch`` is
    the choice), GLA / GDN / SSD on ``reference`` (``available_backends`` of the op, or its shape limit). Each new
    fallback is also logged once per process as a warning. ``notes``: Canon on ``torch`` because the blocks are
    compiled; for Mamba2 on ``mamba_ssm``, whether training runs the fused conv + scan kernel
    (``mamba_split_conv1d_scan_combined``) or why not, and whether mamba-ssm's Triton SSD was imported without its
    failing package ``__init__`` (:func:`canonlm.ops.ssd._mamba.package_problem`). ``canon_layers`` / ``canon_shapes``:
    ``{module name: backend}`` / ``{module name: (C, K)}`` of the Canon layers."""
    fallbacks: dict[str, str] = {}
    notes: dict[str, str] = {}
    cuda = device.type == "cuda"
    if cuda and _request(cfg, "canon")[0] == "auto" and canon_layers:
        slow = sorted(w for w, b in canon_layers.items() if b in ("torch", "reference"))
        if compile_friendly:
            notes["canon"] = "torch shift-and-add on every Canon layer: the blocks are compiled (inductor fuses it)"
        elif slow:
            C, K = canon_shapes[slow[0]]
            why = canon_ops.available_backends(device, dtype, C, K)
            fallbacks["canon"] = (
                f"{len(slow)} Canon layer(s) on the torch path ({slow[0]}: C={C}, K={K}): dao "
                f"{why['dao']}; fla {why['fla']}"
            )
    op = MIXER_OP[cfg.arch]
    got = backends.get(op)
    if op in _FAST and cuda and _request(cfg, op)[0] == "auto" and got == "reference":
        why = _LINEAR_OPS[op].available_backends(device, dtype).get(_FAST[op]) or _fast_shape_reason(cfg, op, _FAST[op])
        fallbacks[op] = f"{_FAST[op]}: {why or 'cannot run here'}"
    if op == "ssd" and got == "mamba_ssm":
        from canonlm.ops.ssd import _mamba

        di = cfg.mamba_expand * cfg.d_model
        why = ssd_ops.fused_split_reason(
            device,
            dtype,
            cfg.conv_kernel,
            d_inner=di,
            conv_dim=di + 2 * cfg.n_groups * cfg.ssm_state,
            nheads=cfg.n_heads,
        )
        parts = [
            "training runs the fused conv + scan (mamba_split_conv1d_scan_combined; not with document masking)"
            if why is None
            else f"conv and scan run separately (mamba_split_conv1d_scan_combined: {why})"
        ]
        if _mamba.package_problem():
            parts.append(
                f"mamba-ssm's Triton SSD imported without the mamba_ssm package __init__, which fails here "
                f"({_mamba.package_problem()})"
            )
        notes["ssd"] = "; ".join(parts)
    for op_, why in fallbacks.items():
        if (op_, why) not in _said:
            _said.add((op_, why))
            log.warning(
                "%s: auto fell back to the %s path on %s: %s",
                op_,
                "torch" if op_ == "canon" else "reference",
                device,
                why,
            )
    return fallbacks, notes


def _canon_report(layers: dict[str, str], op_level: str) -> str:
    """``backends["canon"]``: the backend every Canon layer runs, ``"+"``-joined names (sorted) when their shapes need
    different kernels (e.g. ``"dao+fla"``), or the op-level choice when the model has no Canon layer."""
    return "+".join(sorted(set(layers.values()))) or op_level


def compute_dtype_for(precision: str | int | None, fsdp_param_dtype: str | None = None) -> torch.dtype:
    """The dtype the model's kernels compute in for a Lightning ``trainer.precision`` and, under FSDP2, the
    ``strategy.param_dtype`` (``bf16`` | ``fp32``; None when FSDP2 is not used).

    Returns ``torch.bfloat16`` when the precision names bf16 (``bf16-mixed``, ``bf16-true``) or FSDP2 casts the
    parameters to bf16; ``torch.float16`` for ``16-mixed`` / ``16-true``; ``torch.float64`` for ``64-true``;
    else ``torch.float32``. Pure function, no Lightning import (used by ``prepare_run`` before Lightning loads).
    """
    prec = str(precision)
    if "bf16" in prec or fsdp_param_dtype == "bf16":
        return torch.bfloat16
    if prec.startswith("16"):
        return torch.float16
    if prec.startswith("64"):
        return torch.float64
    return torch.float32


def _module_backends(cfg: ModelConfig, resolved: dict[str, str]) -> dict[str, str]:
    """Names handed to the modules: the resolved ones, except an ``auto`` request of Canon or a linear op stays
    ``auto`` so the op can still fall back per shape (e.g. dao needs C % 8 == 0, fla's GDN d_k <= 256) and follow the
    tensors' device."""
    out = dict(resolved)
    for op in resolved:
        if op != "attention" and _request(cfg, op)[0] == "auto":
            out[op] = "auto"
    return out


# Module backend names that run on any device (the others are bound to the device they were resolved for).
_PORTABLE = frozenset({"auto", "fused", "reference", "torch", "sdpa"})


class Block(nn.Module):
    """Pre-norm block: ``attn_norm`` → Canon-A → token mixer ``attn`` (:mod:`canonlm.arch.mixers`) → +residual;
    ``mlp_norm`` → Canon-C → MLP (with Canon-D) → +residual (no MLP sub-layer when ``model.mlp=none``).

    Forward: ``x (B, T, d)`` residual stream, ``cos``/``sin`` RoPE tables of these positions (or None), ``cache`` a
    layer dict of :class:`~canonlm.arch.cache.DecodeCache` (or None), ``docs`` a
    :class:`~canonlm.arch.doc_mask.DocMask` (document masking) or None -> ``(B, T, d)``.

    Activation checkpointing (``checkpointed = True``, set by :meth:`CanonLM.set_activation_checkpointing`): a forward
    with gradients and no cache runs its body under ``torch.utils.checkpoint.checkpoint`` (non-reentrant) *inside*
    ``forward``, so a compiled block (``block.compile()``) traces the checkpoint too and the compiler sees the
    recompute -- torchtitan's order (activation checkpointing, then compile, then ``fully_shard``;
    ``torchtitan/models/llama3/infra/parallelize.py``).
    """

    def __init__(self, cfg: ModelConfig, backends: dict[str, str]):
        super().__init__()
        self.checkpointed = False
        d, c = cfg.d_model, cfg.canon
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.canon_a = Canon(d, c, backends["canon"], cache_key="canon_a") if c.has("A") else None
        self.attn = build_mixer(cfg, backends)
        if cfg.has_mlp:
            self.mlp_norm = RMSNorm(d, cfg.norm_eps)
            self.canon_c = Canon(d, c, backends["canon"], cache_key="canon_c") if c.has("C") else None
            self.mlp = MLP(d, cfg.ffn_dim, cfg.mlp, cfg.mlp_act, c, backends["canon"])
        else:
            self.mlp_norm = self.canon_c = self.mlp = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: dict | None = None,
        docs: DocMask | None = None,
    ) -> torch.Tensor:
        if self.checkpointed and cache is None and torch.is_grad_enabled():
            return checkpoint(self._body, x, cos, sin, None, docs, use_reentrant=False)
        return self._body(x, cos, sin, cache, docs)

    def _body(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: dict | None = None,
        docs: DocMask | None = None,
    ) -> torch.Tensor:
        if docs is not None:
            return self._forward_docs(x, cos, sin, docs)
        h = self.attn_norm(x)
        if self.canon_a is not None:
            h = self.canon_a(h, cache)
        x = x + self.attn(h, cos, sin, cache)
        if self.mlp is None:
            return x
        h = self.mlp_norm(x)
        if self.canon_c is not None:
            h = self.canon_c(h, cache)
        return x + self.mlp(h, cache)

    def _forward_docs(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, docs: DocMask
    ) -> torch.Tensor:
        """The forward with document masking (no cache): every Canon layer and the mixer get ``docs``."""
        h = self.attn_norm(x)
        if self.canon_a is not None:
            h = self.canon_a(h, None, docs)
        x = x + self.attn(h, cos, sin, None, docs)
        if self.mlp is None:
            return x
        h = self.mlp_norm(x)
        if self.canon_c is not None:
            h = self.canon_c(h, None, docs)
        return x + self.mlp(h, None, docs)


class CanonLM(nn.Module):
    """Decoder LM + Canon layers: Llama (paper §4) or GLA / GDN / Mamba2 (App. C), by ``cfg.arch``.
    Build with a validated :class:`ModelConfig`. ``LlamaCanon`` is the same class.

    Modules: ``tok_emb`` (V, d) · ``blocks`` (``nn.ModuleList`` of :class:`Block`; the FSDP2 / compile unit) ·
    ``norm`` (final RMSNorm) · ``lm_head`` (d -> V, no bias; shares ``tok_emb.weight`` iff ``cfg.tie_embeddings``).
    Buffers (non-persistent, float32): ``rope_cos``/``rope_sin`` ``(max_seq_len, rope_dim/2)``, absent for NoPE.

    Backends: construction checks every requested name (``model.ops``, ``model.kernels.<op>``; an unknown name is
    a ConfigError here) and resolves the requests for the current default device (``torch.empty(0).device``) and
    dtype, without raising when a request cannot run *there* (e.g. ``kernels.attention=flash`` built on the CPU
    before moving to a GPU): such requests stay pending. :meth:`place` resolves every op for the device and compute
    dtype the model really runs on and sets each Canon / mixer module's backend; it raises the ConfigError of a
    request that cannot be met. A forward with a pending request, or on another device type than the one the
    modules' kernels were resolved for, raises that ConfigError instead of failing inside a kernel. Training
    (``LMModule.configure_model``) and ``canonlm.eval.load.load_model`` call :meth:`place`. A ``meta``-device build
    checks names only and is not placed (:attr:`placement` None).

    Attributes: ``requests`` (``{"canon": name, <op>: name}`` as configured), ``backends`` (the concrete names for
    :attr:`placement`; a pending op shows its unchecked request; ``"canon"`` is what the Canon layers run, names joined
    by ``"+"`` when their shapes need different kernels), ``canon_backends`` (``{module name: backend}`` of every Canon
    layer, resolved by its shape: e.g. fla where Dao's kernel cannot take C or K; empty when not placed),
    ``placement`` (``(device, dtype)`` or None),
    ``pending`` (``{op: (key, name, why)}``, the ConfigError of each request not met at the construction device).
    Raises ConfigError (bad config or unknown backend name).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = validate(cfg)
        self.requests = check_requests(cfg)
        self.placement: tuple[torch.device, torch.dtype] | None = None
        self.pending: dict[str, tuple[str, str, str]] = {}  # plain tuples: the model stays picklable
        self._bound_type: str | None = None
        device, dtype = torch.empty(0).device, torch.get_default_dtype()
        self.backends = {}
        for op in _ops_of(cfg):
            try:
                self.backends[op] = _resolve_op(cfg, op, device, dtype)
            except ConfigError as e:  # cannot run on the construction device: decided by place()
                self.pending[op] = (e.key, e.value, e.allowed)
                self.backends[op] = _resolve_op(cfg, op, torch.device("meta"), dtype)
            if device.type == "meta" and op != "attention" and self.requests[op] == "fused":
                name, key = _request(cfg, op)  # which fused kernel runs is only known where the model is placed
                self.pending[op] = (key, name, f"a fused {op} kernel chosen by CanonLM.place")
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, _module_backends(cfg, self.backends)) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if cfg.rope_dim:
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.rope_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.rope_dim // 2), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.activation_checkpointing = False
        self.compile_friendly = False  # place(compiled=True) on CUDA with an auto Canon request: Canon on `torch`
        self.init_weights()
        self.canon_backends: dict[str, str] = {}
        self.fallbacks: dict[str, str] = {}  # set by place(): auto requests that fell back on CUDA, and why
        self.backend_notes: dict[str, str] = {}  # set by place(): see placement_notes
        if device.type != "meta":
            if "canon" not in self.pending:
                try:
                    self.canon_backends = resolve_canon_layers(cfg, self._canon_shapes(), device, dtype)
                    self.backends["canon"] = _canon_report(self.canon_backends, self.backends["canon"])
                except ConfigError as e:  # a Canon shape the request cannot take on this device: decided by place()
                    self.pending["canon"] = (e.key, e.value, e.allowed)
            self._set_placement(device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cache: DecodeCache | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        hidden_states: list | None = None,
        checkpoint_fn: Callable | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids`` LongTensor (B, T) -> logits (B, T, V) in the compute dtype (fp32, or the autocast dtype).

        With ``cache`` (from :meth:`new_cache`), the T tokens continue the sequences the cache has seen: positions
        ``cache.seen .. cache.seen + T - 1``; the cache is updated in place (``seen += T``). Prefill, chunked
        prefill and one-token decode steps all give the logits of one full forward over the whole sequence.

        The keyword arguments serve the transformers interface of an export (``modeling_canonlm``), as
        ``LlamaModel`` does: ``inputs_embeds`` (B, T, d_model) replaces ``input_ids`` (the token embedding is
        skipped; give exactly one of the two); ``hidden_states``, a list, receives ``n_layers + 1`` tensors (B, T, d):
        the input of every block (the first is the embedding output), then the output of the final norm (what the LM
        head reads); ``checkpoint_fn(block, x, cos, sin)`` runs every block (e.g. transformers' gradient-checkpointing
        function, ``torch.utils.checkpoint.checkpoint`` with its arguments bound) instead of calling it.

        ``doc_ids`` (B, T) integer tensor (int32 / int64), the index of each token's document within its row (a
        change of id starts a document), or None (the default: the window is one sequence, the paper's setting).
        With it, no token sees another document: block-causal attention, Canon and short convs restarting at each
        document, GLA / GDN / Mamba2 states reset at each document (:mod:`canonlm.arch.doc_mask`); RoPE keeps the
        window's positions. ``checkpoint_fn`` then gets ``(block, x, cos, sin, None, docs)``. ``doc_ids=None`` is
        exactly the call without the argument. Raises ValueError when ``doc_ids`` comes with a ``cache`` (decoding is
        one sequence per row), has the wrong shape / dtype / device, or the architecture cannot run document-masked
        (:func:`~canonlm.arch.doc_mask.doc_mask_problem`).
        Raises ValueError on a bad rank or width, both or neither of ``input_ids`` / ``inputs_embeds``, a cache of
        another batch size, or (Llama) positions beyond ``cfg.max_seq_len`` (:attr:`max_positions`); ConfigError
        when a backend request was not met where the model was placed, or the input is on another device type than
        the device-bound kernels were resolved for (see :meth:`place`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("CanonLM.forward: give exactly one of input_ids (B, T) and inputs_embeds (B, T, d_model)")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.cfg.d_model:
                raise ValueError(
                    f"inputs_embeds: shape {tuple(inputs_embeds.shape)}, expected (B, T, d_model={self.cfg.d_model})"
                )
            lead = inputs_embeds
        else:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected (B, T)")
            lead = input_ids
        if self.pending or self._bound_type is not None:
            self._check_placed(lead)
        T = lead.shape[1]
        t0 = 0 if cache is None else cache.seen
        if cache is not None:
            if len(cache.layers) != len(self.blocks):
                raise ValueError(f"cache: {len(cache.layers)} layers, the model has {len(self.blocks)}")
            if cache.batch_size not in (None, lead.shape[0]):
                raise ValueError(f"cache: holds {cache.batch_size} rows, the input has {lead.shape[0]}")
        limit = self.max_positions
        if limit is not None and t0 + T > limit:
            raise ValueError(f"input_ids: positions up to {t0 + T} exceed model.max_seq_len={limit}")
        if doc_ids is not None:
            if cache is not None:
                raise ValueError(
                    "CanonLM.forward: doc_ids (document masking) is not supported with a decode cache; "
                    "generate one sequence per row without doc_ids"
                )
            problem = doc_mask_problem(self.cfg)
            if problem is not None:
                raise ValueError(f"CanonLM.forward: doc_ids: {problem}")
            check_doc_ids(doc_ids, lead)
        cos = sin = None
        if self.rope_cos is not None:
            cos, sin = self.rope_cos[t0 : t0 + T], self.rope_sin[t0 : t0 + T]
        x = self.tok_emb(input_ids) if inputs_embeds is None else inputs_embeds
        docs = None
        if doc_ids is not None:  # once per forward, shared by every layer; the mask in the dtype q will have
            dev = x.device.type
            dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
            docs = build_doc_mask(
                doc_ids,
                self.cfg.arch,
                self.backends.get("attention"),
                cu_seqlens="fla" in self.canon_backends.values(),
                dtype=dtype,
            )
        for i, block in enumerate(self.blocks):
            if hidden_states is not None:
                hidden_states.append(x)
            if cache is not None:
                x = block(x, cos, sin, cache.layers[i])
            elif checkpoint_fn is not None:
                x = checkpoint_fn(block, x, cos, sin) if docs is None else checkpoint_fn(block, x, cos, sin, None, docs)
            else:  # activation checkpointing, when on, is inside Block.forward (compiled with it)
                x = block(x, cos, sin) if docs is None else block(x, cos, sin, None, docs)
        if cache is not None:
            cache.seen += T
        x = self.norm(x)
        if hidden_states is not None:
            hidden_states.append(x)
        return self.lm_head(x)

    @property
    def max_positions(self) -> int | None:
        """The most positions a sequence may take: ``cfg.max_seq_len`` for Llama (its RoPE tables end there and
        :meth:`forward` refuses more), None for GLA / GDN / Mamba2 (recurrent: no positional limit)."""
        return self.cfg.max_seq_len if self.cfg.arch == "llama" else None

    def new_cache(self) -> DecodeCache:
        """An empty :class:`~canonlm.arch.cache.DecodeCache` for this model (filled by the first forward)."""
        return DecodeCache(len(self.blocks))

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in backward instead of storing its activations (``torch.utils.checkpoint``,
        non-reentrant, one checkpoint per block, inside :meth:`Block.forward`): each block then keeps only its input.
        Apply before :meth:`compile_blocks` and ``fully_shard`` (torchtitan's order): a compiled block traces the
        checkpoint, so the compiler sees (and may fuse) the recompute."""
        self.activation_checkpointing = bool(enabled)
        for block in self.blocks:
            block.checkpointed = self.activation_checkpointing

    def compile_blocks(self, **kwargs) -> None:
        """``torch.compile`` every block in place (``nn.Module.compile(**kwargs)``: ``backend``, ``fullgraph``,
        ``dynamic``, ``mode``), after :meth:`set_activation_checkpointing` and before ``fully_shard`` (torchtitan's
        order). Any sequence length runs without a graph break from the model's own code: the first call compiles
        for its shapes, the first call at another length recompiles once with dynamic sizes
        (``torch._dynamo``'s automatic dynamic shapes), and later lengths reuse that graph. What still breaks the
        graph is a library kernel the compiler cannot trace: fla's ``chunk_gla`` and ``chunk_gated_delta_rule``
        are ``torch.compiler.disable`` d (fla-core 0.6.0, ``fla/ops/gla/chunk.py``,
        ``fla/ops/gated_delta_rule/chunk.py``), one break per GLA / GDN block on a GPU; tests/test_compile.py counts
        the breaks of every architecture on the CPU paths."""
        for block in self.blocks:
            block.compile(**kwargs)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables (as the official release's models).

        ``hf_normal``: Linear/Embedding weights ~ N(0, init_std), biases 0 (the paper's synthetic Llama = HF, and
        GLA / GDN = fla's ``initializer_range``). ``linear_0.02_split`` (GLA5 / GDN2): the same, except the halves
        of a low-rank product (``split_init = r``) get σ = √init_std / r^¼. For both, a mixer's own short conv
        (``b``) is drawn like a Linear (normal(0, init_std)), as fla does. ``lingua``: trunc-normal (±3σ) with
        σ = d^-1/2, except MLP ``w2`` σ = d_ff^-1/2. ``mamba2_default`` (HF Mamba2): Linear layers keep PyTorch's
        default (kaiming-uniform) draw with zero biases, embedding ~ N(0, 0.1), conv1d default with a zero bias.
        Norm gains = 1. Canon weights are redrawn by :meth:`Canon.reset_parameters` (PyTorch default
        U(-1/√K, 1/√K), or identity / fixed), never by the model-level scheme. GDN / Mamba2 decay parameters
        (``A_log``, ``dt_bias``, ``D``) get their own init (``init_special_``). Re-runnable after ``to_empty``
        (meta-device / FSDP2 builds).
        """
        cfg = self.cfg
        for name, m in self.named_modules():
            if isinstance(m, (RMSNorm, GatedRMSNorm)):
                m.reset_parameters()
            elif isinstance(m, Canon):
                m.reset_parameters()
                if m.native and cfg.init in ("hf_normal", "linear_0.02_split"):
                    nn.init.normal_(m.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                if cfg.init == "mamba2_default":
                    if isinstance(m, nn.Embedding):
                        nn.init.normal_(m.weight, mean=0.0, std=0.1)
                    else:
                        m.reset_parameters()
                elif cfg.init == "lingua":
                    std = (cfg.ffn_dim if name.endswith("mlp.w2") else cfg.d_model) ** -0.5
                    nn.init.trunc_normal_(m.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
                else:
                    r = getattr(m, "split_init", None)
                    std = cfg.init_std**0.5 / r**0.25 if (r and cfg.init == "linear_0.02_split") else cfg.init_std
                    nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, (GatedDeltaNet, Mamba2Mixer)):
                m.init_special_()
        if self.rope_cos is not None and self.rope_cos.device.type != "meta":
            cos, sin = rope_angles(cfg.rope_dim, cfg.max_seq_len, cfg.pos.theta, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def place(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None, compiled: bool = False
    ) -> dict[str, str]:
        """Resolve every op's backend for the device and compute dtype the model runs on, and set it on every Canon
        layer (Canon-A/B/C/D and the mixers' short convs) and token-mixer module. Call it after moving the model
        (it moves nothing), with the dtype the kernels will see: ``torch.bfloat16`` under bf16 autocast or FSDP2
        with a bf16 ``param_dtype`` (:func:`compute_dtype_for`), else the parameters' dtype.

        Canon is resolved per layer, by its channels C and taps K (:func:`resolve_canon_layers`, recorded in
        :attr:`canon_backends`): ``ops=fused`` gives a layer Dao's kernel where it takes (C, K) and fla's Triton kernel
        elsewhere, and a pinned ``model.kernels.canon`` that cannot take some layer's shape is refused here, so the
        forward and the decode steps run what was resolved.

        With ``compiled=True`` (the blocks will be compiled with ``torch.compile``, as ``compile=true`` does) an
        ``auto`` Canon request on CUDA resolves to the ``torch`` shift-and-add path for every Canon layer: fla's and
        Dao's kernels are opaque to the compiler (fla's dispatch is a ``torch.compiler.disable`` graph break), while
        the shift-and-add ops are fused by inductor with the RMSNorm before Canon-A/C, the RoPE after Canon-B and the
        SiLU gate after Canon-D. A pinned ``model.kernels.canon`` or ``ops=fused`` keeps its kernel.

        Args:
            device: where the model runs (default: the device of its parameters).
            dtype: compute dtype (default: ``torch.float32``).
            compiled: whether the blocks are compiled (see above).
        Returns:
            The concrete ``{"canon": name, <op>: name}`` (also :attr:`backends`; ``"canon"`` joins the layers' names
            with ``"+"`` when they differ, e.g. ``"dao+fla"``). An ``auto`` request of Canon or a
            linear op stays ``auto`` in the modules, so the op can still fall back per shape (:func:`_module_backends`).
        Raises:
            ConfigError("model.kernels.<op>" | "model.ops", name, allowed) like :func:`resolve_backends` and
            :func:`resolve_canon_layers` when a request cannot be met there (for one Canon layer's shape: the layer,
            its C and K are named); the modules are then left as they were.
        """
        if device is None:
            p = next(self.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
        device = torch.device(device)
        dtype = torch.float32 if dtype is None else dtype
        backends = resolve_backends(self.cfg, device, dtype)  # checks the requests' names too
        layers = resolve_canon_layers(self.cfg, self._canon_shapes(), device, dtype)
        self.compile_friendly = bool(compiled) and device.type == "cuda" and _request(self.cfg, "canon")[0] == "auto"
        if self.compile_friendly:
            layers = {where: "torch" for where in layers}
            backends["canon"] = "torch"
        backends["canon"] = _canon_report(layers, backends["canon"])
        self.backends, self.canon_backends, self.pending = backends, layers, {}
        self.fallbacks, self.backend_notes = placement_notes(
            self.cfg, backends, layers, self._canon_shapes(), device, dtype, self.compile_friendly
        )
        self._set_placement(device, dtype)
        return dict(self.backends)

    def backend_report(self) -> dict:
        """What the model runs where it was placed, for a run's start line, ``hparams.json`` and ``results.json``:
        ``{"device": "cuda:0", "compute_dtype": "bfloat16", "canon": ..., <mixer op>: ..., "fallbacks": {op: why},
        "notes": {op: ...}}`` -- the concrete backend of every op (:attr:`backends`; Canon's names joined by ``+``
        when layers differ), the ``auto`` requests that fell back to a pure-PyTorch path on CUDA and why
        (:func:`placement_notes`), and the notes (the Mamba2 fused kernel, a mamba-ssm imported without its package
        ``__init__``, Canon on ``torch`` under compile). Before :meth:`place` the device is the construction one."""
        device, dtype = self.placement or (None, None)
        out = {"device": str(device), "compute_dtype": str(dtype).replace("torch.", ""), **self.backends}
        out["fallbacks"] = dict(self.fallbacks)
        out["notes"] = dict(self.backend_notes)
        return out

    def backend_line(self) -> str:
        """One line for a run's start: ``backends on cpu (float32): canon=cpu, ssd=reference (mamba_ssm: needs a
        CUDA device ...)`` -- each op's concrete backend (:meth:`backend_report`), with the reason beside an
        ``auto`` request that runs the pure-PyTorch path, on any device."""
        device, dtype = self.placement or (torch.device("cpu"), torch.float32)
        parts = []
        for op, name in self.backends.items():
            why = None
            if op in _FAST and name == "reference" and _request(self.cfg, op)[0] == "auto":
                why = _LINEAR_OPS[op].available_backends(device, dtype).get(_FAST[op])
                why = why and f"{_FAST[op]}: {why}"
            elif op == "canon" and op in self.fallbacks:
                why = self.fallbacks[op]
            parts.append(f"{op}={name}" + (f" ({why})" if why else ""))
        return f"backends on {device} ({str(dtype).replace('torch.', '')}): " + ", ".join(parts)

    def _canon_shapes(self) -> dict[str, tuple[int, int]]:
        """``{module name: (channels C, taps K)}`` of every Canon layer."""
        return {n: (m.channels, m.kernel) for n, m in self.named_modules() if isinstance(m, Canon)}

    def _set_placement(self, device: torch.device, dtype: torch.dtype) -> None:
        """Hand the resolved names to the modules (each Canon layer its own, unless the request is ``auto``) and
        remember where they hold (:attr:`placement`)."""
        names = _module_backends(self.cfg, self.backends)
        op = MIXER_OP[self.cfg.arch]
        for where, m in self.named_modules():
            if isinstance(m, Canon):
                own = self.canon_backends.get(where, names["canon"])
                m.backend = "auto" if names["canon"] == "auto" and not self.compile_friendly else own
            elif isinstance(m, (Attention, GLA, GatedDeltaNet, Mamba2Mixer)):
                m.backend = names[op]
        self.placement = (device, dtype)
        bound = any(names[o] not in _PORTABLE for o in names if o not in self.pending)
        self._bound_type = device.type if bound else None

    def _check_placed(self, input_ids: torch.Tensor) -> None:
        """Raise the ConfigError of a request not met where the model was resolved, or when the input sits on another
        device type than the device-bound kernels (e.g. the native CPU Canon kernel of ``ops=fused`` on CUDA)."""
        if self.pending:
            key, name, allowed = next(iter(self.pending.values()))
            dev = "meta" if self.placement is None else self.placement[0]
            raise ConfigError(
                key,
                name,
                f"{allowed} [not placed: the model was resolved for {dev}; call "
                f"CanonLM.place(device, dtype) where it runs, before the first forward]",
            )
        if self._bound_type is not None and input_ids.device.type != self._bound_type:
            op = next(o for o, n in _module_backends(self.cfg, self.backends).items() if n not in _PORTABLE)
            name, key = _request(self.cfg, op)
            raise ConfigError(
                key,
                name,
                f"backends resolved for {self._bound_type} ({op}: {self.backends[op]!r}), "
                f"but the input is on {input_ids.device.type}; call CanonLM.place(device, "
                f"dtype) after moving the model",
            )

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (shared/tied tensors counted once; DTensors by global size). ``non_embedding``
        drops the token embedding and the LM head (the "≈ 12·d²·layers" count of paper §3)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel() + (0 if self.cfg.tie_embeddings else self.lm_head.weight.numel())
        return n

    def flops_per_token(self, seq_len: int, convention: str = "dense") -> float:
        """Training FLOPs per token (forward + backward = 3 x forward) of this model on windows of ``seq_len``
        tokens, for MFU: the ``"total"`` of :func:`canonlm.arch.flops.flops_per_token` (every matmul, attention /
        chunked-scan product and depthwise conv; ``convention`` ``dense`` | ``causal`` | ``reference``, see there).
        The GLA / GDN chunk is the one the resolved kernel runs with (fla: 64, whatever ``cfg.chunk_size`` says).
        Raises ValueError (bad ``seq_len`` or ``convention``)."""
        from canonlm.arch import flops

        chunk = _FLA_CHUNK if self.backends.get(MIXER_OP[self.cfg.arch]) == "fla" else None
        return flops.flops_per_token(self.cfg, seq_len, training=True, chunk_size=chunk, convention=convention)["total"]


LlamaCanon = CanonLM  # the Transformer is ``arch=llama``; kept as the name the paper and the release use
