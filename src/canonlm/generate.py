"""Generate continuations from a trained model: decode-cache generation for every architecture.

    python -m canonlm.generate <run dir | checkpoint | exported dir> --prompt TEXT [--prompt TEXT ...]
        [--prompt-file FILE] [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--batch-size B]
        [--ids] [--json] [--device auto|cpu|cuda|cuda:N] [--precision auto|32-true|bf16-mixed|bf16-true|...]

The model is rebuilt by :func:`canonlm.eval.load.load_model` (run directory, or a ``.ckpt`` inside
``<run>/checkpoints/``), or, when ``canonlm.hf`` is present, from an exported Hugging Face directory
(``config.json`` and no ``.hydra/``: :func:`canonlm.hf.hf_to_canonlm`) or a checkpoint that records its model config
without a run directory (``python -m canonlm.export --from-hf``: :func:`canonlm.eval.load.load_model`). It is
decoded by :meth:`canonlm.data.lm.LanguageModel.generate` around a forward object that
offers :meth:`canonlm.arch.model.CanonLM.new_cache`, so every architecture (llama, gla, gdn, mamba2) prefills the
prompts once and then runs one position per forward call on its decode cache (KV, Canon, short-conv and recurrent
states). Greedy output (``--temperature 0``, the default) equals an argmax loop over full forward passes.

``--precision auto`` (the default) runs the model as its training run computed (the run's ``trainer.precision``:
bf16 autocast for ``bf16-mixed``, also on the CPU; bf16 parameters for ``bf16-true``; see
:func:`canonlm.eval.load.eval_precision`), so a run that pinned a bf16-only kernel (``model.kernels.attention=flash``)
loads on the GPU; an exported directory or an imported checkpoint records no training precision and runs in the
dtype of its weights (float32). A ``trainer.precision`` name (or ``fp32`` / ``bf16``) overrides it.

Prompts and outputs are text in the run's task vocabulary (:func:`make_codec`):

* tasks with a tokenizer (``capo``: ``CapoTask.encode``; ``text``: the tokenizer recorded in the prepared data's
  meta.json) encode the prompt text with it and decode the continuation with ``task.decode``;
* the synthetic tasks (``depo*``, ``brevo*``, ``mano``, ``lano``, ``fullcopy``) read the prompt as whitespace-
  separated token names, exactly as ``task.decode`` / ``python -m canonlm.data.preview`` print them (e.g. Depo:
  ``<bos> p3.e7 e2 <query_2> e2 <ans>``; a dotted word is a multi-token name, one token per part);
* an exported directory uses its ``tokenizer.json`` when it has one (a ``text`` run), else token ids;
* a task without a text form (or whose tokenizer cannot be loaded) uses space-separated token ids, like ``--ids``.

``--ids`` reads every prompt as space-separated token ids and prints the continuations as token ids. Prompts come
from ``--prompt`` (repeatable) then ``--prompt-file`` (one prompt per line, blank lines skipped). Output: one line
``<prompt> -> <continuation>`` per prompt, in order; ``--json`` prints one JSON list of objects ``{"prompt",
"prompt_ids", "continuation", "continuation_ids"}`` instead.

Sampling (``--temperature T > 0``) draws from softmax(logits / T), restricted to the ``--top-k`` highest logits when
given, with the counter-based Gumbel noise of :class:`~canonlm.data.lm.LanguageModel` keyed by (``--seed``, prompt
index): the same command gives the same output, whatever ``--batch-size``; ``--top-k 1`` gives the greedy output.

Exit status: 0 ok; 2 for bad input (a missing path, an unknown flag value, a prompt token outside the vocabulary,
a prompt plus ``--max-new-tokens`` beyond the model's context, ``--temperature`` < 0, ...), reported as one line
``canonlm.generate: error: <flag>=<value> ...; allowed: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from canonlm.errors import ConfigError
from canonlm.eval.load import EvalPrecision, ModelForward, check_precision, eval_precision

PROG = "canonlm.generate"
DEFAULT_MAX_NEW = 32


class GenerateError(ValueError):
    """A user-facing problem: printed as one line, exit status 2. ``flag``: the flag (or ``PATH``) it concerns."""

    def __init__(self, flag: str, value: Any, allowed: str, detail: str = ""):
        self.flag, self.value, self.allowed, self.detail = flag, value, allowed, detail
        detail = detail[1:-1] if detail.startswith("(") and detail.endswith(")") else detail
        what = f"{flag}={value!r}" if value is not None else f"{flag}: none given"
        super().__init__(
            f"{what}: {detail}; allowed: {allowed}"
            if detail
            else f"{what}{'' if value is None else ' is not allowed'}; allowed: {allowed}"
        )


# ============================================================================================== prompts <-> ids
@dataclass
class Codec:
    """How a run's prompts are read and its outputs printed.

    kind: ``"tokenizer"`` (the task's tokenizer), ``"names"`` (token names of the task vocabulary) or ``"ids"``
    (space-separated token ids). vocab_size: V of the model. encode: ``str -> int64 (L,)`` (raises
    :class:`GenerateError` for a token outside the vocabulary). decode: ``int sequence -> str``. note: why the codec
    fell back to ids (empty otherwise). example: a few vocabulary entries, for error messages.
    """

    kind: str
    vocab_size: int
    encode: Callable[[str], np.ndarray]
    decode: Callable[[Sequence[int]], str]
    note: str = ""
    example: str = ""


def parse_ids(text: str, vocab_size: int, flag: str = "--prompt") -> np.ndarray:
    """int64 (L,) from space-separated token ids (commas also separate). Raises :class:`GenerateError` naming
    ``flag`` for a non-integer or an id outside ``[0, vocab_size)``."""
    out = []
    for w in text.replace(",", " ").split():
        try:
            t = int(w)
        except ValueError:
            raise GenerateError(
                flag, text, f"space-separated token ids in [0, {vocab_size})", f"(token {w!r} is not an integer)"
            ) from None
        if not 0 <= t < vocab_size:
            raise GenerateError(
                flag,
                text,
                f"token ids in [0, {vocab_size}) (the model's vocabulary)",
                f"(token id {t} is outside the vocabulary)",
            )
        out.append(t)
    return np.asarray(out, dtype=np.int64)


def ids_codec(vocab_size: int, note: str = "") -> Codec:
    """The token-id codec: prompts and outputs are space-separated ids in ``[0, vocab_size)``."""
    return Codec(
        "ids",
        int(vocab_size),
        lambda s: parse_ids(s, vocab_size),
        lambda ids: " ".join(str(int(t)) for t in ids),
        note=note,
    )


def _names_codec(task: Any, vocab_size: int) -> Codec:
    names = list(task.token_names())
    index = {nm: i for i, nm in enumerate(names) if i < vocab_size and not nm.startswith("<unused")}
    special = [n for n in names[1:] if n in index and n.startswith("<")]
    plain = [n for n in names[1:] if n in index and not n.startswith("<")]
    example = ", ".join(special[:4] + plain[:3] + (["..."] if len(special) > 4 or len(plain) > 3 else []))

    def encode(text: str) -> np.ndarray:
        out: list[int] = []
        for word in text.split():
            w = word[:-1] if word.endswith("?") and len(word) > 1 else word  # decode's mark of an unfinished name
            parts = [w] if w in index else w.split(".")
            for p in parts:
                if p not in index:
                    raise GenerateError(
                        "--prompt",
                        text,
                        f"tokens of the {task.name} vocabulary ({example}; a "
                        "multi-token name as p3.e7), or token ids with --ids",
                        f"(token {p!r} is not in the vocabulary)",
                    )
                out.append(index[p])
        return np.asarray(out, dtype=np.int64)

    return Codec(
        "names", int(vocab_size), encode, lambda ids: task.decode(np.asarray(ids, dtype=np.int64)), example=example
    )


def _tokenizer_codec(task: Any, vocab_size: int) -> Codec:
    """Codec of a task with a tokenizer: ``text`` (the tokenizer recorded in its meta.json) or Capo
    (``CapoTask.encode``, compact ids); outputs by ``task.decode``."""
    if getattr(task, "name", None) == "text":
        tok = task.tokenizer()  # FileNotFoundError / ImportError when the recorded tokenizer cannot be loaded
        return tokenizer_codec(
            tok.encode,
            lambda ids: task.decode(np.asarray(ids, dtype=np.int64)),
            vocab_size,
            "text",
            tok.eos_token,
            tok.eos_id,
        )
    from canonlm.data.tasks.capo import EOS_TEXT

    return tokenizer_codec(
        task.encode,
        lambda ids: task.decode(np.asarray(ids, dtype=np.int64)),
        vocab_size,
        task.name,
        EOS_TEXT,
        task.eos_id,
    )


def tokenizer_codec(
    raw_encode: Callable[[str], Any],
    decode: Callable[[Sequence[int]], str],
    vocab_size: int,
    what: str,
    eos_text: str | None = None,
    eos_id: int | None = None,
) -> Codec:
    """Codec around a tokenizer: ``raw_encode(str) -> ids`` (a KeyError = a token without an id, as Capo's compact
    vocabulary raises), ``decode(ids) -> str``. ``eos_text`` in a prompt becomes ``eos_id``. ``what`` names the
    vocabulary in error messages. encode raises :class:`GenerateError` for ids outside ``[0, vocab_size)``."""

    def encode(text: str) -> np.ndarray:
        pieces = text.split(eos_text) if eos_text and eos_id is not None else [text]
        out: list[int] = []
        for j, piece in enumerate(pieces):
            if j:
                out.append(int(eos_id))
            if piece:
                try:
                    out.extend(int(t) for t in raw_encode(piece))
                except KeyError as e:  # capo: a token that never occurs in biographies has no compact id
                    raise GenerateError(
                        "--prompt",
                        text,
                        f"text whose tokens all occur in the {what} training data, or token ids with --ids",
                        f"(tokenizer id {e.args[0]} is not in the compact vocabulary)",
                    ) from None
        bad = [t for t in out if not 0 <= t < vocab_size]
        if bad:
            raise GenerateError(
                "--prompt",
                text,
                f"text whose token ids are below the model's vocabulary size {vocab_size}, or token ids with --ids",
                f"(token id {bad[0]} is outside it)",
            )
        return np.asarray(out, dtype=np.int64)

    return Codec("tokenizer", int(vocab_size), encode, decode)


def make_codec(task_cfg: dict[str, Any] | None, vocab_size: int) -> Codec:
    """The codec of a run's task (module docstring): tokenizer for tasks with one (``encode`` / ``text``), token
    names for tasks with ``token_names`` and ``decode``, else token ids.

    Args: task_cfg: the run's resolved ``task`` node (``LoadedModel.task_cfg``), or None (no task: ids).
        vocab_size: the model's V.
    The task is rebuilt with :func:`canonlm.data.tasks.build_task`; if that or its tokenizer fails the codec falls
    back to ids, with the reason in ``note``. Never raises for a buildable run.
    """
    if not task_cfg:
        return ids_codec(vocab_size, "the model has no task")
    if task_cfg.get("name") == "hf_import":  # python -m canonlm.export --from-hf records no task vocabulary
        return ids_codec(vocab_size, "imported from Hugging Face (no task vocabulary)")
    from canonlm.data.tasks import build_task

    try:
        task = build_task(task_cfg.get("name"), task_cfg)
        if getattr(task, "name", None) == "text" or callable(getattr(task, "encode", None)):
            return _tokenizer_codec(task, vocab_size)
        if callable(getattr(task, "token_names", None)) and callable(getattr(task, "decode", None)):
            return _names_codec(task, vocab_size)
        return ids_codec(vocab_size, f"task {task_cfg.get('name')!r} has no text form")
    except Exception as e:  # noqa: BLE001 -- a task that cannot be rebuilt here still generates ids
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return ids_codec(vocab_size, f"the task's vocabulary could not be loaded ({type(e).__name__}: {first})")


# ============================================================================================== model
class CachedForward(ModelForward):
    """:class:`canonlm.eval.load.ModelForward` (``__call__(ids, cache=None)``, ``new_cache()`` of a
    :class:`~canonlm.arch.model.CanonLM`, every forward inside ``context()``) with top-k truncation of the logits.

    Args: model: module ``model(ids (B, T) int64[, cache]) -> logits (B, T, V)`` (``new_cache`` optional: without
        it ``LanguageModel`` re-runs prefixes). top_k: keep the k largest logits of every position (the others
        become -inf; ties with the k-th value are kept); None or >= V = no truncation. context: None or a callable
        returning a context manager (:meth:`canonlm.eval.load.EvalPrecision.context`: a mixed precision's
        autocast).
    Returns (call): logits (B, T, V) in the compute dtype.
    """

    def __init__(self, model: Any, top_k: int | None = None, context: Callable[[], Any] | None = None):
        super().__init__(model, context)
        self.top_k = top_k

    def __call__(self, ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return top_k_mask(super().__call__(ids, cache), self.top_k)


def top_k_mask(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """``logits`` (..., V) with every entry below the k-th largest of its row set to -inf (``torch.topk``); ties
    with the k-th value stay. ``k`` None or >= V returns ``logits`` unchanged."""
    if k is None or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, int(k), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


@dataclass
class Generator:
    """A loaded model with what generation needs.

    model: the module (eval mode, on ``device``). vocab_size: V. max_len: positions it accepts (prompt +
    generation; the trained context). device: torch.device. precision: how it computes
    (:class:`canonlm.eval.load.EvalPrecision`). codec: :class:`Codec`. info: JSON-able description
    (``LoadedModel.describe()`` for runs).
    """

    model: Any
    vocab_size: int
    max_len: int
    device: torch.device
    precision: EvalPrecision
    codec: Codec
    info: dict[str, Any]

    def generate(
        self,
        prompts: Sequence[np.ndarray],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        batch_size: int = 8,
    ) -> list[np.ndarray]:
        """Continuations of ``prompts`` (list of n non-empty int64 arrays (L_r,)): list of n int64 arrays of exactly
        ``max_new_tokens`` tokens (no stop token). See :func:`generate_ids`."""
        return generate_ids(
            self.model,
            prompts,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            batch_size=batch_size,
            vocab_size=self.vocab_size,
            max_len=self.max_len,
            device=self.device,
            context=self.precision.context,
        )


def sampling_keys(seed: int, n: int) -> np.ndarray:
    """uint64 (n,): the noise key of prompt i = ``stable_hash64("canonlm.generate", seed, i)``
    (:func:`canonlm.data.seeding.stable_hash64`)."""
    from canonlm.data.seeding import stable_hash64

    return np.array([stable_hash64("canonlm.generate", int(seed), i) for i in range(n)], dtype=np.uint64)


@torch.no_grad()
def generate_ids(
    model: Any,
    prompts: Sequence[np.ndarray],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    vocab_size: int | None = None,
    max_len: int | None = None,
    device: torch.device | str = "cpu",
    context: Callable[[], Any] | None = None,
) -> list[np.ndarray]:
    """Generate ``max_new_tokens`` tokens after every prompt with
    :meth:`canonlm.data.lm.LanguageModel.generate` (decode caches when ``model`` has ``new_cache``).

    Args:
        model: ``CanonLM`` (or any ``model(ids (B, T) int64[, cache]) -> logits (B, T, V)``), eval mode, on device.
        prompts: n non-empty int64 arrays (L_r,) of ids in [0, V).
        max_new_tokens: >= 1; every prompt gets exactly this many tokens.
        temperature: 0 = greedy argmax (ties: lowest id); > 0 = sample softmax(logits / T).
        top_k: sample among the k highest logits only (None = all); 1 = greedy.
        seed: sampling seed (keys :func:`sampling_keys`); a sample depends on (model, prompt, seed, prompt index)
            only, not on ``batch_size`` or the other prompts.
        batch_size: prompts per forward pass. vocab_size: V (default ``model.cfg.vocab_size``). max_len: longest
            prompt + generation the model accepts (default ``model.cfg.max_seq_len``). device: where ids go.
        context: None or a callable returning the context manager of every forward
            (:meth:`canonlm.eval.load.EvalPrecision.context`).
    Returns: list of n int64 arrays (max_new_tokens,).
    Raises ValueError (from ``LanguageModel``) for an empty prompt, max_new_tokens < 1, temperature < 0, or a
    prompt that leaves no room under ``max_len``; :class:`GenerateError` when a prompt plus ``max_new_tokens``
    exceeds ``max_len``.
    """
    from canonlm.data.lm import LanguageModel

    cfg = getattr(model, "cfg", None)
    V = int(vocab_size if vocab_size is not None else cfg.vocab_size)
    L = max_len if max_len is not None else (getattr(cfg, "max_seq_len", None) if cfg is not None else None)
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    if L is not None and prompts:
        longest = max(len(p) for p in prompts)
        if longest + int(max_new_tokens) > int(L):
            raise GenerateError(
                "--max-new-tokens",
                int(max_new_tokens),
                f"an integer in [1, {int(L) - longest}] (context {int(L)} minus the longest prompt, {longest} tokens)",
            )
    fwd = CachedForward(model, top_k=top_k if temperature > 0 else None, context=context)
    lm = LanguageModel(fwd, vocab_size=V, device=device, batch_size=batch_size, max_len=L)
    keys = sampling_keys(seed, len(prompts)) if temperature > 0 else None
    return lm.generate(prompts, int(max_new_tokens), temperature=float(temperature), keys=keys)


def is_exported_dir(p: Path) -> bool:
    """True for a directory with ``config.json`` and no ``.hydra/`` (a Hugging Face export, not a run)."""
    return p.is_dir() and (p / "config.json").is_file() and not (p / ".hydra").is_dir()


def load_generator(path: str | Path, *, device: str = "auto", precision: str = "auto") -> Generator:
    """A :class:`Generator` for a run directory, a checkpoint file inside ``<run>/checkpoints/`` (both through
    :func:`canonlm.eval.load.load_model`, which also reads a checkpoint recording its own model without ``.hydra/``,
    e.g. one imported with ``python -m canonlm.export --from-hf``), or (with ``canonlm.hf``) an exported directory
    (:func:`_load_exported`).

    Args: path: as above. device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``. precision: ``auto`` (the run's
        training precision; the weights' dtype for an exported directory or an imported checkpoint) or a
        ``trainer.precision`` name / ``fp32`` / ``bf16`` (:func:`canonlm.eval.load.eval_precision`).
    Raises :class:`GenerateError` (missing path, an exported dir without ``canonlm.hf``, a bad device / precision,
    a run that does not load: the loader's FileNotFoundError / ConfigError / ValueError, reworded).
    """
    p = Path(path).expanduser()
    what = "a run directory (with .hydra/), a checkpoint file inside <run>/checkpoints/, or an exported directory"
    if not p.exists():
        raise GenerateError("PATH", str(path), what, "(no such file or directory)")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise GenerateError("--device", device, "auto | cpu | cuda | cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerateError("--device", device, "auto | cpu", "(no CUDA device is available)")
    try:
        check_precision(precision, "--precision")
    except ConfigError as e:
        raise GenerateError("--precision", precision, e.allowed) from None
    if is_exported_dir(p):
        return _load_exported(p, device, precision)
    from canonlm.eval.load import load_model

    try:
        loaded = load_model(p, device=device, precision=precision)
    except FileNotFoundError as e:  # (checkpoints recording their own model are load_model's too)
        raise GenerateError("PATH", str(path), what, f"({e})") from None
    except (ConfigError, ValueError) as e:
        raise GenerateError("PATH", str(path), "a run whose config and checkpoint load", f"({e})") from None
    mcfg = loaded.model_cfg
    return Generator(
        model=loaded.model,
        vocab_size=int(mcfg.vocab_size),
        max_len=int(mcfg.max_seq_len),
        device=loaded.device,
        precision=loaded.precision,
        codec=make_codec(loaded.task_cfg, int(mcfg.vocab_size)),
        info=loaded.describe(),
    )


def _device(device: str) -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)


def _hf() -> Any:
    """``canonlm.hf`` (Hugging Face interop), or None when this checkout does not have it."""
    try:
        import canonlm.hf as hf
    except ImportError:
        return None
    return hf


def _placed(
    cfg: Any, sd: dict[str, torch.Tensor], dev: torch.device, precision: str, path: Path
) -> tuple[Any, EvalPrecision]:
    """Build a CanonLM from ``cfg`` and the state dict ``sd``, move it to ``dev`` in the parameter dtype of
    ``precision`` and place its backends for its compute dtype (:func:`canonlm.eval.load.eval_precision`; ``auto``
    = the dtype of ``sd``); returns (model, the precision). Raises :class:`GenerateError` when it does not load or
    place on ``dev``."""
    from canonlm.arch.model import CanonLM

    from canonlm.utils.kernel_cache import configure

    prec = eval_precision(precision, dev, state_dict=sd)
    configure()  # $CANONLM_KERNEL_CACHE or the default: the kernels compiled before are reused
    try:
        model = CanonLM(cfg)
        model.load_state_dict(sd, strict=True)
        model.eval().to(dev, dtype=prec.param_dtype)
        model.place(dev, prec.compute_dtype)
    except (ConfigError, RuntimeError) as e:
        raise GenerateError(
            "PATH",
            str(path),
            "a model that loads on this device",
            f"({type(e).__name__}: {str(e).splitlines()[0][:300]})",
        ) from None
    return model, prec


def _load_exported(p: Path, device: str, precision: str) -> Generator:
    """An exported Hugging Face directory (``python -m canonlm.export``: official LlamaCanon or native Llama),
    converted in memory by :func:`canonlm.hf.hf_to_canonlm`. Prompts use its ``tokenizer.json`` when it has one
    (:class:`canonlm.data.text.TextTokenizer`), else token ids."""
    hf = _hf()
    if hf is None:
        raise GenerateError(
            "PATH",
            str(p),
            "a run directory (with .hydra/) or a checkpoint file",
            "an exported directory (config.json, no .hydra/); exported directories need canonlm.hf, "
            "which is not installed",
        )
    try:
        cfg, sd, hcfg = hf.hf_to_canonlm(p)
    except hf.InteropError as e:
        raise GenerateError(
            "PATH",
            str(p),
            "an exported directory that canonlm.hf reads (config.json + "
            "model.safetensors of a LlamaCanon / Llama model)",
            f"({e})",
        ) from None
    dev = _device(device)
    model, prec = _placed(cfg, sd, dev, precision, p)
    V = int(cfg.vocab_size)
    codec = ids_codec(V, "the exported directory has no tokenizer.json")
    if (p / "tokenizer.json").is_file():
        try:
            from canonlm.data.text import TextTokenizer

            tok = TextTokenizer(p / "tokenizer.json")
            codec = tokenizer_codec(
                tok.encode,
                lambda ids: tok.decode(ids, skip_special_tokens=False),
                V,
                "tokenizer.json",
                tok.eos_token,
                tok.eos_id,
            )
        except Exception as e:  # noqa: BLE001 -- fall back to ids, say why
            codec = ids_codec(V, f"its tokenizer.json does not load ({type(e).__name__}: {e})")
    info = dict(
        path=str(p.resolve()),
        arch=cfg.arch,
        size=f"{cfg.n_layers}L{cfg.d_model}D",
        vocab_size=V,
        max_seq_len=int(cfg.max_seq_len),
        model_type=hcfg.get("model_type"),
        canon=cfg.canon.set,
        precision=prec.describe(),
    )
    return Generator(
        model=model, vocab_size=V, max_len=int(cfg.max_seq_len), device=dev, precision=prec, codec=codec, info=info
    )


# ============================================================================================== CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (no usage dump), exit status 2 like every other bad input
        print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog=f"python -m {PROG}",
        description=(
            "Continue prompts with a trained canonlm model (decode-cache generation; greedy by default). Prompts are "
            "text in the run's task vocabulary (token names as `python -m canonlm.data.preview` prints them, or the "
            "task's tokenizer), or token ids with --ids."
        ),
    )
    ap.add_argument("path", help="run directory, checkpoint file (<run>/checkpoints/*.ckpt) or exported directory")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--prompt-file", help="a file with one prompt per line (blank lines skipped)")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens to generate per prompt (default {DEFAULT_MAX_NEW}, capped at the room left in the "
        "context; an explicit value beyond it is an error)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = sample (default 0)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0 = all)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass (default 8)")
    ap.add_argument("--ids", action="store_true", help="prompts and outputs as space-separated token ids")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of lines")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    ap.add_argument(
        "--precision",
        default="auto",
        help="auto (default: the run's training precision, trainer.precision) | 32-true | bf16-mixed | "
        "bf16-true | 16-mixed | 64-true | fp32 (= 32-true) | bf16 (= bf16-mixed)",
    )
    return ap


def _check_args(a: argparse.Namespace) -> list[str]:
    """Validate the scalar flags and read the prompts (before the model is loaded). Returns the prompt strings."""
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        raise GenerateError("--max-new-tokens", a.max_new_tokens, "an integer >= 1")
    if not a.temperature >= 0:  # also NaN
        raise GenerateError("--temperature", a.temperature, "a number >= 0 (0 = greedy)")
    if a.top_k < 0:
        raise GenerateError("--top-k", a.top_k, "an integer >= 0 (0 = no truncation)")
    if a.seed < 0:
        raise GenerateError("--seed", a.seed, "an integer >= 0")
    if a.batch_size < 1:
        raise GenerateError("--batch-size", a.batch_size, "an integer >= 1")
    prompts = list(a.prompt)
    for s in prompts:
        if not s.strip():
            raise GenerateError("--prompt", s, "a non-empty prompt")
    if a.prompt_file is not None:
        f = Path(a.prompt_file).expanduser()
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(
                "--prompt-file",
                a.prompt_file,
                "a readable UTF-8 text file, one prompt per line",
                f"({type(e).__name__}: {getattr(e, 'strerror', None) or e})",
            ) from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise GenerateError("--prompt", None, "at least one prompt (--prompt TEXT, repeatable, or --prompt-file F)")
    return prompts


def run(argv: Sequence[str] | None = None, out: Any = None) -> list[dict[str, Any]]:
    """Parse ``argv``, generate and print (to ``out``, default stdout). Returns the records printed by ``--json``:
    ``[{"prompt": str, "prompt_ids": [int], "continuation": str, "continuation_ids": [int]}, ...]``.
    Raises :class:`GenerateError` for bad input; argparse's SystemExit(2) for unknown flags / bad types."""
    a = _parser().parse_args(argv)
    out = sys.stdout if out is None else out
    texts = _check_args(a)
    g = load_generator(a.path, device=a.device, precision=a.precision)
    codec = ids_codec(g.vocab_size) if a.ids else g.codec
    ids = []
    for s in texts:
        try:
            p = codec.encode(s)
        except GenerateError as e:
            if codec.kind == "ids" and codec.note and not a.ids:
                raise GenerateError(
                    e.flag, e.value, e.allowed + f"; prompts are token ids because {codec.note}", e.detail
                ) from None
            raise
        if p.size == 0:
            raise GenerateError("--prompt", s, "a prompt of at least one token")
        ids.append(p)
    longest = max(len(p) for p in ids)
    room = g.max_len - longest
    if room < 1:
        raise GenerateError(
            "--prompt",
            texts[int(np.argmax([len(p) for p in ids]))],
            f"a prompt shorter than the model's context of {g.max_len} tokens",
            f"({longest} tokens)",
        )
    max_new = a.max_new_tokens if a.max_new_tokens is not None else min(DEFAULT_MAX_NEW, room)
    gen = g.generate(
        ids, max_new, temperature=a.temperature, top_k=a.top_k or None, seed=a.seed, batch_size=a.batch_size
    )
    records = [
        dict(
            prompt=s, prompt_ids=[int(t) for t in p], continuation=codec.decode(c), continuation_ids=[int(t) for t in c]
        )
        for s, p, c in zip(texts, ids, gen)
    ]
    if a.json:
        out.write(json.dumps(records, ensure_ascii=False) + "\n")
    else:
        for r in records:
            out.write(f"{r['prompt']} -> {r['continuation']}\n")
    out.flush()
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Returns 0, or 2 after printing ``canonlm.generate: error: <message>`` for bad input."""
    try:
        run(argv)
    except GenerateError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = [
    "Codec",
    "CachedForward",
    "Generator",
    "GenerateError",
    "generate_ids",
    "ids_codec",
    "is_exported_dir",
    "load_generator",
    "make_codec",
    "parse_ids",
    "run",
    "main",
    "sampling_keys",
    "top_k_mask",
]

if __name__ == "__main__":
    raise SystemExit(main())
