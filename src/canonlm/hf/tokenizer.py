"""The tokenizer an export carries, as files ``transformers.AutoTokenizer.from_pretrained`` loads.

* A ``text`` run: the tokenizer its prepared data recorded (``meta.json``: path, sha256), checked against that
  checksum (:func:`canonlm.data.text.tokenizer_sha256`) -- a tokenizer that moved or changed since ``prepare`` stops
  the export with one message --, re-saved through ``transformers.PreTrainedTokenizerFast`` with the run's EOS as
  ``eos_token`` (and as ``pad_token`` when the tokenizer has no pad token), never adding a token: a tokenizer whose
  ids reach past the model's vocabulary is refused.
* A synthetic task (Depo, Brevo, Mano, Lano, full copy): a word-level tokenizer over the task's own vocabulary
  (``task.token_names()``, id = index; tokens separated by spaces, or by ``.`` inside a multi-token name, as the
  task prints them): ``pad_token`` = id 0,
  ``bos_token`` / ``eos_token`` = the task's BOS / EOS ids when it has them. Decoding joins the names with spaces.
* Capo: the task's byte-level BPE renumbered to its compact ids (Part 4.1 App. A.3 restricts the embedding to the
  BPE ids that occur): every token that occurs in a biography gets its compact id 1..V, ``<|endoftext|>`` the task's
  EOS id (V + 1), ``<pad>`` id 0; the BPE's other tokens (merge intermediates, bytes that never occur) keep their
  merges but get ids from ``vocab_size`` on, which the model has no embedding for -- text outside the task's
  biographies and questions cannot be fed to it. The rebuilt task's vocabulary must have the model's size, else
  the task's tokenizer changed since training (the export stops).
* Imported models: no tokenizer (the export's model card says so).

Errors are :class:`~canonlm.hf.mapping.InteropError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from canonlm.hf.mapping import InteropError

SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _meta_tokenizer(task_cfg: Mapping[str, Any]) -> dict[str, Any]:
    from canonlm.config.rundir import tokenizer_record

    try:
        return tokenizer_record(dict(task_cfg))
    except (OSError, ValueError) as e:
        f = Path(str(task_cfg.get("data_dir") or "")) / "meta.json"
        raise InteropError(f"the run's prepared data {f} cannot be read ({e}); its tokenizer is needed for the "
                           "export") from None


def text_tokenizer(task_cfg: Mapping[str, Any], vocab_size: int):
    """``(PreTrainedTokenizerFast, ids)`` for a ``text`` run; ``ids`` = ``{bos,eos,pad,unk}_token_id``.
    Raises InteropError: no recorded tokenizer, the file missing or its SHA-256 not the one ``prepare`` recorded,
    or ids past ``vocab_size``."""
    from canonlm.data.text import TextTokenizer, tokenizer_sha256

    rec = _meta_tokenizer(task_cfg)
    path, want = rec.get("path"), rec.get("sha256")
    if not path:
        raise InteropError("the run's prepared data records no tokenizer (meta.json 'tokenizer.path')")
    try:
        got = tokenizer_sha256(path)
    except FileNotFoundError:
        raise InteropError(f"the run's tokenizer {path} (recorded by prepare in meta.json) no longer exists; put it "
                           "back, or the export would carry no tokenizer or the wrong one") from None
    if want and got != want:
        raise InteropError(f"the run's tokenizer {path} changed since prepare (sha256 {got[:12]}..., recorded "
                           f"{want[:12]}...); the model was trained with the recorded one -- restore it")
    tok = TextTokenizer(path, eos_token=rec.get("eos_token"))
    if tok.vocab_size > vocab_size:
        raise InteropError(f"the tokenizer {path} has ids up to {tok.vocab_size - 1}, past the model's vocabulary "
                           f"({vocab_size})")
    hf = tok.as_transformers()  # a transformers tokenizer directory keeps its class and settings
    if tok.eos_token is not None and hf.eos_token != tok.eos_token:
        hf.eos_token = tok.eos_token
    if hf.pad_token is None and hf.eos_token is not None:
        hf.pad_token = hf.eos_token
    return hf, _ids(hf, vocab_size)


def capo_tokenizer(task: Any, vocab_size: int):
    """``(PreTrainedTokenizerFast, ids)`` for a Capo task (:class:`canonlm.data.tasks.capo.CapoTask`): its
    ``tokenizers`` BPE (``task.tokenizer``, original ids) with the vocabulary renumbered to the compact ids
    (``task.compact_to_orig``), ``<pad>`` = 0 and ``<|endoftext|>`` = ``task.eos_id`` as special tokens; tokens that
    never occur in a biography get ids ``vocab_size``, ``vocab_size + 1``, ... (in original-id order) so the BPE merges
    still run. ``tokenizer(text)["input_ids"] == task.encode(text)`` for every text the task renders. Raises
    InteropError when ``task.vocab_size != vocab_size`` (the task's tokenizer changed since training)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from canonlm.data.tasks.capo.tokenizer import EOS_TEXT

    if int(task.vocab_size) != int(vocab_size):
        raise InteropError(f"the Capo task rebuilt from the run's config has a vocabulary of {task.vocab_size} ids, "
                           f"the model was trained with {vocab_size}: the task's tokenizer (task.tokenizer, or the "
                           "BPE in its cache_dir) changed since training -- restore it")
    spec = json.loads(task.tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise InteropError(f"the Capo tokenizer is a {model.get('type')!r} model; only BPE is renumbered")
    by_id = {int(i): s for s, i in model["vocab"].items()}
    by_id.update({int(a["id"]): a["content"] for a in spec.get("added_tokens") or [] if int(a["id"]) not in by_id})
    used = [int(o) for c, o in enumerate(task.compact_to_orig.tolist()) if 1 <= c < task.eos_id]
    missing = [o for o in used if o not in by_id]
    if missing:
        raise InteropError(f"the Capo tokenizer has no token with id {missing[0]}, which the task's vocabulary uses")
    vocab: dict[str, int] = {"<pad>": 0}
    for c, o in enumerate(task.compact_to_orig.tolist()):
        if 1 <= c < task.eos_id:
            vocab[by_id[int(o)]] = c
    vocab[EOS_TEXT] = int(task.eos_id)
    nxt = int(vocab_size)
    for o in sorted(by_id):
        if by_id[o] not in vocab:
            vocab[by_id[o]] = nxt
            nxt += 1
    model["vocab"] = vocab
    special = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    spec["post_processor"] = None  # a template (<s> ... </s>) would insert ids of the old numbering
    spec["added_tokens"] = [dict(id=0, content="<pad>", **special),
                            dict(id=int(task.eos_id), content=EOS_TEXT, **special)]
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), pad_token="<pad>",
                                 eos_token=EOS_TEXT)
    return hf, _ids(hf, vocab_size)


def task_tokenizer(task: Any, vocab_size: int):
    """``(PreTrainedTokenizerFast, ids)`` over a synthetic task's token names (module docstring); for Capo (a task
    with ``compact_to_orig``) :func:`capo_tokenizer`; ``(None, {})`` for a task with neither. Duplicate names (unused
    ids) get ``#<id>`` appended."""
    if getattr(task, "compact_to_orig", None) is not None and getattr(task, "tokenizer", None) is not None:
        return capo_tokenizer(task, vocab_size)
    names = list(task.token_names()) if callable(getattr(task, "token_names", None)) else []
    if not names or callable(getattr(task, "encode", None)):
        return None, {}
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for i, n in enumerate(names[:vocab_size]):
        n = str(n).replace(" ", "_") or f"<id{i}>"
        vocab[n if n not in vocab else f"{n}#{i}"] = i
    inv = {i: n for n, i in vocab.items()}
    specials = {"pad_token": inv.get(0)}
    for key, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
        i = getattr(task, attr, None)
        if isinstance(i, int) and i in inv:
            specials[key] = inv[i]
    # a task without an end token (Depo without eos) still needs one for the tools that stop on it (transformers'
    # generate, lm-evaluation-harness): the pad token, which the model is never trained to emit
    specials.setdefault("eos_token", specials["pad_token"])
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    if any("." in n for n in vocab):
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:  # the tasks print a multi-token name joined with "." (Depo's p3.e7): split there too
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                    pre_tokenizers.Split(".", behavior="removed")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, **{k: v for k, v in specials.items() if v is not None})
    if len(hf) > vocab_size:
        raise InteropError(f"the task's tokenizer has {len(hf)} tokens, more than the model's vocabulary ({vocab_size})")
    return hf, _ids(hf, vocab_size)


def _ids(hf: Any, vocab_size: int) -> dict[str, int | None]:
    out = {}
    for key in SPECIALS:
        i = getattr(hf, f"{key}_id", None)
        out[f"{key}_id"] = int(i) if isinstance(i, int) and 0 <= i < vocab_size else None
    return out


def export_tokenizer(task_cfg: Mapping[str, Any] | None, vocab_size: int) -> tuple[Any, dict[str, int | None], str]:
    """``(tokenizer or None, token ids for config.json / generation_config.json, note for the model card)`` of the
    run whose ``checkpoint["canonlm"]["task"]`` is ``task_cfg``. Raises InteropError for a ``text`` run whose
    recorded tokenizer is missing or changed (see :func:`text_tokenizer`), a synthetic task that cannot be rebuilt
    from its config here, or a Capo task whose vocabulary no longer has the model's size (:func:`capo_tokenizer`)."""
    name = (task_cfg or {}).get("name")
    if not task_cfg or name == "hf_import":
        return None, {}, "no tokenizer: the model was imported and records no task vocabulary (pass token ids)"
    if name == "text":
        hf, ids = text_tokenizer(task_cfg, vocab_size)
        return hf, ids, "the tokenizer the run's data was prepared with (checksum verified)"
    from canonlm.data.tasks import build_task

    try:
        task = build_task(name, dict(task_cfg))
    except Exception as e:  # noqa: BLE001 -- any failure to rebuild the task: the export would lack its tokenizer
        raise InteropError(f"the run's task {name!r} cannot be rebuilt here for its tokenizer ({type(e).__name__}: "
                           f"{e}); restore what it reads (e.g. task.tokenizer, task.cache_dir, data files)") from None
    hf, ids = task_tokenizer(task, vocab_size)
    if hf is None:
        return None, {}, f"no tokenizer: task {name!r} has no token names (pass token ids)"
    if name == "capo":
        return hf, ids, ("the task's byte-level BPE renumbered to its compact ids: the text of its biographies "
                         "encodes exactly as in training; tokens that never occur in them get ids past the model's "
                         f"vocabulary ({vocab_size}), so other text cannot be fed to the model")
    return hf, ids, f"a word-level tokenizer over task {name!r}'s vocabulary (tokens separated by spaces)"
