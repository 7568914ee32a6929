"""The tokenizer an export carries, as files that ``transformers.AutoTokenizer.from_pretrained`` reads the same way in
transformers 4.x (4.51.3, the version of the official LlamaCanon classes) and 5.x, with no remote code.

Files (:func:`tokenizer_files`, written by :func:`save_tokenizer`):

* ``tokenizer.json`` -- the ``tokenizers`` serialization (model, normalizer, pre-tokenizer, decoder, added tokens);
  both versions build their backend from it unchanged (transformers 4.51.3 with ``tokenizers`` 0.21, 5.x with 0.22+).
* ``tokenizer_config.json`` -- ``tokenizer_class: "PreTrainedTokenizerFast"`` (the generic fast class: 4.x's own
  name, an alias of ``TokenizersBackend`` in 5.x; ``save_pretrained`` of 5.x would write ``TokenizersBackend``, which
  4.x does not know), the special tokens, ``added_tokens_decoder``, ``model_max_length`` = the model's context
  (``max_seq_len``), ``clean_up_tokenization_spaces: false`` (decoding returns what the decoder builds) and
  ``padding_side: "left"`` (batched generation with a decoder-only model). Because ``tokenizer_class`` is set,
  transformers 4.x never reads ``config.json`` for the tokenizer (``AutoTokenizer.from_pretrained`` in
  ``models/auto/tokenization_auto.py``); transformers 5.x always loads ``config.json`` through ``AutoConfig`` first,
  so there the absence of a trust-remote-code question depends on ``config.json``, not on these files.
* ``special_tokens_map.json`` -- the named special tokens, as 4.x writes them.

What each task gets:

* A synthetic task (Depo, Brevo, Mano, Lano, full copy): a word-level tokenizer over the task's own vocabulary
  (``task.token_names()``, id = index) that encodes and decodes the text exactly as the task prints it
  (``task.decode``; ``python -m canonlm.data.preview`` and ``python -m canonlm.generate`` print the same): tokens
  separated by spaces, the tokens of a multi-token name joined by ``.`` (Depo's ``p3.e8``), an unfinished name
  ending in ``?`` (``p3?``). Which ids are non-final name tokens and which may continue a name is read off the
  task's own ``decode`` (:func:`_name_structure`); a non-final token's vocabulary string carries its ``.``
  (``p3.``), the pre-tokenizer splits words after each ``.``, a normalizer reads ``?`` as ``.``, and the decoder
  (``tokenizers`` ``Replace`` / ``Fuse`` steps) appends a space to every token not ending in ``.``, turns a ``.``
  that no name token follows into ``?`` and drops the last space. ``pad_token`` = the task's pad (id 0,
  ``<pad>``), ``bos_token`` = the task's BOS, ``eos_token`` = the task's EOS. The token ids for ``config.json`` /
  ``generation_config.json`` are the task's: pad 0, BOS, and EOS or None for a task without an end token, so
  transformers' ``generate`` never stops where the task goes on; the tokenizer of such a task still names
  ``<pad>`` as its ``eos_token``, because lm-evaluation-harness decodes the tokenizer's EOS as a stop string in
  every ``generate_until`` and fails on a tokenizer without one. Nothing is added to the text on encoding (the
  task's text carries its own ``<bos>``).
* Capo: the task's byte-level BPE renumbered to its compact ids (Part 4.1 App. A.3 restricts the embedding to the
  BPE ids that occur): every token that occurs in a biography gets its compact id 1..V, ``<|endoftext|>`` the task's
  EOS id (V + 1), ``<pad>`` id 0; the BPE's other tokens (merge intermediates, bytes that never occur) keep their
  merges but get ids from ``vocab_size`` on, which the model has no embedding for -- text outside the task's
  biographies and questions cannot be fed to it. The rebuilt task's vocabulary must have the model's size, else
  the task's tokenizer changed since training (the export stops).
* A ``text`` run: the tokenizer its prepared data recorded (``meta.json``: path, sha256), checked against that
  checksum (:func:`canonlm.data.text.tokenizer_sha256`) -- a tokenizer that moved or changed since ``prepare`` stops
  the export with one message --, written from its own ``tokenizers`` pipeline (so it encodes and decodes as the
  run's :class:`canonlm.data.text.TextTokenizer` does), with the run's EOS as ``eos_token`` and, when the tokenizer
  has no pad token, the EOS as ``pad_token`` (id 0 is an ordinary token of most text tokenizers, so it cannot be
  the pad), never adding a token: a tokenizer whose ids reach past the model's vocabulary is refused.
* Imported models: no tokenizer (the export's model card says so).

Errors are :class:`~canonlm.hf.mapping.InteropError`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from canonlm.hf.mapping import InteropError

SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # the class both transformers 4.x and 5.x know by this name
_HF_DEFAULTS = dict(clean_up_tokenization_spaces=False, padding_side="left")


def _meta_tokenizer(task_cfg: Mapping[str, Any]) -> dict[str, Any]:
    from canonlm.config.rundir import tokenizer_record

    try:
        return tokenizer_record(dict(task_cfg))
    except (OSError, ValueError) as e:
        from canonlm.config.rundir import text_data_dirs

        f = Path((text_data_dirs(dict(task_cfg)) or [""])[0]) / "meta.json"
        raise InteropError(
            f"the run's prepared data {f} cannot be read ({e}); its tokenizer is needed for the export"
        ) from None


def _context(hf: Any, max_seq_len: int | None) -> Any:
    """Set ``model_max_length`` (the model's context) and the decoding / padding defaults of every export."""
    if max_seq_len is not None:
        hf.model_max_length = int(max_seq_len)
    for k, v in _HF_DEFAULTS.items():
        setattr(hf, k, v)
    return hf


def text_tokenizer(task_cfg: Mapping[str, Any], vocab_size: int, max_seq_len: int | None = None):
    """``(PreTrainedTokenizerFast, ids)`` for a ``text`` run; ``ids`` = ``{bos,eos,pad,unk}_token_id``.
    ``max_seq_len``: the model's context, becomes ``model_max_length`` (None: transformers' default).
    Raises InteropError: no recorded tokenizer, the file missing or its SHA-256 not the one ``prepare`` recorded,
    ids past ``vocab_size``, or a tokenizer without a ``tokenizers`` pipeline (a slow-only one)."""
    from canonlm.data.text import TextTokenizer, tokenizer_sha256

    rec = _meta_tokenizer(task_cfg)
    path, want = rec.get("path"), rec.get("sha256")
    if not path:
        raise InteropError("the run's prepared data records no tokenizer (meta.json 'tokenizer.path')")
    try:
        got = tokenizer_sha256(path)
    except FileNotFoundError:
        raise InteropError(
            f"the run's tokenizer {path} (recorded by prepare in meta.json) no longer exists; put it "
            "back, or the export would carry no tokenizer or the wrong one"
        ) from None
    if want and got != want:
        raise InteropError(
            f"the run's tokenizer {path} changed since prepare (sha256 {got[:12]}..., recorded "
            f"{want[:12]}...); the model was trained with the recorded one -- restore it"
        )
    tok = TextTokenizer(path, eos_token=rec.get("eos_token"))
    if tok.vocab_size > vocab_size:
        raise InteropError(
            f"the tokenizer {path} has ids up to {tok.vocab_size - 1}, past the model's vocabulary ({vocab_size})"
        )
    hf = tok.as_transformers()  # a transformers tokenizer directory keeps its settings (its pipeline is written)
    if getattr(hf, "backend_tokenizer", None) is None:
        raise InteropError(
            f"the tokenizer {path} loads as {type(hf).__name__}, which has no `tokenizers` pipeline "
            "(tokenizer.json); only such a tokenizer is written in the form transformers 4 and 5 both "
            "read -- prepare the data with its tokenizer.json"
        )
    if tok.eos_token is not None and hf.eos_token != tok.eos_token:
        hf.eos_token = tok.eos_token
    if hf.pad_token is None and hf.eos_token is not None:
        hf.pad_token = hf.eos_token  # id 0 is an ordinary token of most text tokenizers: it cannot be the pad
    return _context(hf, max_seq_len), _ids(hf, vocab_size)


def capo_tokenizer(task: Any, vocab_size: int, max_seq_len: int | None = None):
    """``(PreTrainedTokenizerFast, ids)`` for a Capo task (:class:`canonlm.data.tasks.capo.CapoTask`): its
    ``tokenizers`` BPE (``task.tokenizer``, original ids) with the vocabulary renumbered to the compact ids
    (``task.compact_to_orig``), ``<pad>`` = 0 and ``<|endoftext|>`` = ``task.eos_id`` as special tokens; tokens that
    never occur in a biography get ids ``vocab_size``, ``vocab_size + 1``, ... (in original-id order) so the BPE merges
    still run. ``tokenizer(text)["input_ids"] == task.encode(text)`` for every text the task renders, and
    ``decode(ids) == task.decode(ids)``. ``max_seq_len`` becomes ``model_max_length``. Raises InteropError when
    ``task.vocab_size != vocab_size`` (the task's tokenizer changed since training)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from canonlm.data.tasks.capo.tokenizer import EOS_TEXT

    if int(task.vocab_size) != int(vocab_size):
        raise InteropError(
            f"the Capo task rebuilt from the run's config has a vocabulary of {task.vocab_size} ids, "
            f"the model was trained with {vocab_size}: the task's tokenizer (task.tokenizer, or the "
            "BPE in its cache_dir) changed since training -- restore it"
        )
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
    spec["added_tokens"] = [
        dict(id=0, content="<pad>", **special),
        dict(id=int(task.eos_id), content=EOS_TEXT, **special),
    ]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), pad_token="<pad>", eos_token=EOS_TEXT
    )
    return _context(hf, max_seq_len), _ids(hf, vocab_size)


def _name_structure(task: Any, names: Sequence[str]) -> tuple[set[int], set[int]]:
    """``(non_final, name_ids)`` of a synthetic task, read off its own printer ``task.decode``: ``non_final`` = the ids
    printed alone as ``<name>?`` (a name token that does not end a name, Depo's ``p3``); ``name_ids`` = the ids that
    continue a name after a non-final token (printed ``p3.<name>``). Empty sets for a task whose names are single
    tokens. Every other way of printing (not the token's name, another joiner) raises InteropError. Two ``decode``
    calls over all ids, each token followed by the task's BOS (a token that is no name)."""
    V = len(names)
    sep = getattr(task, "bos_id", None)
    if not isinstance(sep, int) or not 0 <= sep < V or task.decode([sep]) != names[sep]:
        raise InteropError(
            f"task {getattr(task, 'name', '?')!r} has no BOS token printed as its name; its printed "
            "text cannot be checked for multi-token names"
        )
    S = names[sep]

    def bad(ids: list[int], got: str) -> InteropError:
        return InteropError(
            f"task {getattr(task, 'name', '?')!r} prints ids {ids} as {got!r}, which a word-level "
            "tokenizer (tokens separated by spaces, a multi-token name joined with '.') cannot "
            "reproduce"
        )

    words = task.decode([t for i in range(V) for t in (i, sep)]).split(" ")
    if len(words) != 2 * V:
        raise bad([0, sep], " ".join(words[:4]))
    non_final = set()
    for i in range(V):
        w, s = words[2 * i], words[2 * i + 1]
        if s != S or w not in (names[i], names[i] + "?"):
            raise bad([i, sep], f"{w} {s}")
        if w == names[i] + "?":
            non_final.add(i)
    if not non_final:
        return set(), set()
    nf = min(non_final)
    words = task.decode([t for j in range(V) for t in (nf, j, sep)]).split(" ")
    name_ids, p = set(), 0
    for j in range(V):
        w = words[p] if p < len(words) else ""
        if w in (f"{names[nf]}.{names[j]}", f"{names[nf]}.{names[j]}?") and words[p + 1 : p + 2] == [S]:
            name_ids.add(j)
            p += 2
        elif w == names[nf] + "?" and words[p + 1 : p + 3] == [names[j], S]:
            p += 3
        else:
            raise bad([nf, j, sep], " ".join(words[p : p + 3]))
    if not non_final <= name_ids:
        raise bad([nf, min(non_final - name_ids)], "a name token that cannot continue a name")
    return non_final, name_ids


def task_tokenizer(task: Any, vocab_size: int, max_seq_len: int | None = None):
    """``(PreTrainedTokenizerFast, ids)`` over a synthetic task's token names (module docstring): ``decode`` of any
    ids equals ``task.decode`` of them and ``encode`` of the task's printed text gives its ids back. For Capo (a task
    with ``compact_to_orig``) :func:`capo_tokenizer`; ``(None, {})`` for a task with neither. ``max_seq_len``
    becomes ``model_max_length``. Duplicate names (unused ids) get ``#<id>`` appended. Raises InteropError for a
    name with whitespace (its printed text cannot be split back), a task whose printed form a word-level tokenizer
    cannot reproduce (:func:`_name_structure`), or more tokens than ``vocab_size``."""
    if getattr(task, "compact_to_orig", None) is not None and getattr(task, "tokenizer", None) is not None:
        return capo_tokenizer(task, vocab_size, max_seq_len)
    names = list(task.token_names()) if callable(getattr(task, "token_names", None)) else []
    if not names or callable(getattr(task, "encode", None)):
        return None, {}
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [str(n) for n in names[:vocab_size]]
    for i, n in enumerate(names):
        if not n or any(c.isspace() for c in n):
            raise InteropError(
                f"task {getattr(task, 'name', '?')!r} names id {i} {n!r}: a token name needs at least "
                "one character and no whitespace, else its printed text cannot be split back"
            )
    non_final, name_ids = _name_structure(task, names)
    if non_final and any("." in n or "?" in n for n in names):
        bad = next(n for n in names if "." in n or "?" in n)
        raise InteropError(
            f"task {getattr(task, 'name', '?')!r} joins multi-token names with '.' (unfinished: "
            f"'?') but has a token named {bad!r}: its printed text is ambiguous"
        )
    strings: list[str] = []
    seen: set[str] = set()
    for i, n in enumerate(names):
        s = n + ("." if i in non_final else "")
        s = s if s not in seen else f"{s}#{i}"
        seen.add(s)
        strings.append(s)
    tk = Tokenizer(models.WordLevel(vocab={s: i for i, s in enumerate(strings)}, unk_token=None))
    if non_final:
        tk.normalizer = normalizers.Replace("?", ".")  # an unfinished name (p3?) is read as its tokens
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(".", behavior="merged_with_previous")]
        )
        cont = "|".join(
            re.escape(strings[j]) + ("" if j in non_final else " ")
            for j in sorted(name_ids, key=lambda j: -len(strings[j]))
        )
        tk.decoder = decoders.Sequence(
            [
                decoders.Replace(Regex(r"(?<!\.)\z"), " "),  # every token but a non-final one ends in a space
                decoders.Fuse(),
                decoders.Replace(Regex(rf"\.(?!(?:{cont}))"), "? "),  # a name no name token continues is unfinished
                decoders.Replace(Regex(r" \z"), ""),
            ]
        )
    else:
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # decoding joins the tokens with spaces
    specials = {"pad_token": strings[0]}
    for key, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
        i = getattr(task, attr, None)
        if isinstance(i, int) and 0 <= i < len(strings):
            specials[key] = strings[i]
    has_eos = "eos_token" in specials
    # A task without an end token still names one in its tokenizer: lm-evaluation-harness decodes
    # `tokenizer.eos_token_id` as a stop string in every generate_until (lm_eval/models/huggingface.py, 0.4.13), and
    # decoding None raises TypeError in both transformers versions. The pad token serves (the model is never trained
    # to emit it); the ids for config.json / generation_config.json keep eos_token_id None, so transformers'
    # generate does not stop there (it reads those, not the tokenizer).
    specials.setdefault("eos_token", specials["pad_token"])
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in dict.fromkeys(specials.values())])
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, **specials)
    if len(hf) > vocab_size:
        raise InteropError(
            f"the task's tokenizer has {len(hf)} tokens, more than the model's vocabulary ({vocab_size})"
        )
    ids = _ids(hf, vocab_size)
    if not has_eos:
        ids["eos_token_id"] = None
    return _context(hf, max_seq_len), ids


def _ids(hf: Any, vocab_size: int) -> dict[str, int | None]:
    out = {}
    for key in SPECIALS:
        i = getattr(hf, f"{key}_id", None)
        out[f"{key}_id"] = int(i) if isinstance(i, int) and 0 <= i < vocab_size else None
    return out


def export_tokenizer(
    task_cfg: Mapping[str, Any] | None, vocab_size: int, max_seq_len: int | None = None
) -> tuple[Any, dict[str, int | None], str]:
    """``(tokenizer or None, token ids for config.json / generation_config.json, note for the model card)`` of the
    run whose ``checkpoint["canonlm"]["task"]`` is ``task_cfg``; ``max_seq_len`` (the model's context) becomes the
    tokenizer's ``model_max_length``. Write it with :func:`save_tokenizer`. The ids are
    ``{bos,eos,pad,unk}_token_id`` (None where the task has no such token): for a synthetic task and Capo
    ``pad_token_id`` = 0 and ``eos_token_id`` = the task's EOS or None (the tokenizer of a task without EOS names its
    pad as ``eos_token``, for lm-evaluation-harness; see :func:`task_tokenizer`); for a ``text`` run the recorded
    EOS, and the tokenizer's pad token or else that EOS as ``pad_token_id``. Raises InteropError for a ``text`` run
    whose recorded tokenizer is missing or changed (see :func:`text_tokenizer`), a synthetic task that cannot be
    rebuilt from its config here, or a Capo task whose vocabulary no longer has the model's size
    (:func:`capo_tokenizer`)."""
    name = (task_cfg or {}).get("name")
    if not task_cfg or name == "hf_import":
        return None, {}, "no tokenizer: the model was imported and records no task vocabulary (pass token ids)"
    if name == "text":
        hf, ids = text_tokenizer(task_cfg, vocab_size, max_seq_len)
        return hf, ids, "the tokenizer the run's data was prepared with (checksum verified)"
    from canonlm.data.tasks import build_task

    try:
        task = build_task(name, dict(task_cfg))
    except Exception as e:  # noqa: BLE001 -- any failure to rebuild the task: the export would lack its tokenizer
        raise InteropError(
            f"the run's task {name!r} cannot be rebuilt here for its tokenizer ({type(e).__name__}: "
            f"{e}); restore what it reads (e.g. task.tokenizer, task.cache_dir, data files)"
        ) from None
    hf, ids = task_tokenizer(task, vocab_size, max_seq_len)
    if hf is None:
        return None, {}, f"no tokenizer: task {name!r} has no token names (pass token ids)"
    if name == "capo":
        return (
            hf,
            ids,
            (
                "the task's byte-level BPE renumbered to its compact ids: the text of its biographies "
                "encodes exactly as in training; tokens that never occur in them get ids past the model's "
                f"vocabulary ({vocab_size}), so other text cannot be fed to the model"
            ),
        )
    return (
        hf,
        ids,
        (
            f"a word-level tokenizer over task {name!r}'s vocabulary: it reads and writes the text as the "
            "task prints it (tokens separated by spaces, a multi-token name joined with '.', e.g. p3.e8)"
        ),
    )


def _added(tok: Any) -> dict[str, dict[str, Any]]:
    out = {}
    for i, a in sorted(tok.backend_tokenizer.get_added_tokens_decoder().items()):
        out[str(int(i))] = dict(
            content=a.content,
            lstrip=bool(a.lstrip),
            normalized=bool(a.normalized),
            rstrip=bool(a.rstrip),
            single_word=bool(a.single_word),
            special=bool(a.special),
        )
    return out


def tokenizer_files(tok: Any) -> dict[str, str]:
    """``{file name: text}`` of a fast tokenizer (a ``PreTrainedTokenizerFast`` / 5.x ``TokenizersBackend`` with a
    ``backend_tokenizer``) as both transformers 4.x and 5.x read it (module docstring): ``tokenizer.json`` (its
    ``tokenizers`` pipeline, padding and truncation off), ``tokenizer_config.json`` (``tokenizer_class``
    ``PreTrainedTokenizerFast``, special tokens, ``added_tokens_decoder``, ``model_max_length``,
    ``clean_up_tokenization_spaces``, ``padding_side``, a ``chat_template`` when it has one) and
    ``special_tokens_map.json``. Raises InteropError for a tokenizer without a ``tokenizers`` backend."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise InteropError(
            f"the tokenizer ({type(tok).__name__}) has no `tokenizers` backend; only fast tokenizers "
            "are written in the form transformers 4 and 5 both read"
        )
    spec = json.loads(backend.to_str())
    spec["truncation"] = None
    spec["padding"] = None
    added = _added(tok)
    by_content = {a["content"]: a for a in added.values()}
    smap: dict[str, Any] = {}
    for key in SPECIALS:
        t = getattr(tok, key, None)
        if t is not None:
            a = by_content.get(
                str(t), dict(content=str(t), lstrip=False, normalized=False, rstrip=False, single_word=False)
            )
            smap[key] = {k: v for k, v in a.items() if k != "special"}
    extra = [
        str(t)
        for t in (getattr(tok, "additional_special_tokens", None) or [])
        if str(t) not in {s["content"] for s in smap.values()}
    ]
    if extra:
        smap["additional_special_tokens"] = extra
    mml = getattr(tok, "model_max_length", None)
    cfg: dict[str, Any] = {
        "tokenizer_class": TOKENIZER_CLASS,
        "added_tokens_decoder": added,
        **{k: (v["content"] if isinstance(v, dict) else v) for k, v in smap.items()},
        "model_max_length": int(mml) if isinstance(mml, int) and mml < 2**62 else None,
        "clean_up_tokenization_spaces": bool(getattr(tok, "clean_up_tokenization_spaces", False)),
        "padding_side": getattr(tok, "padding_side", "right") or "right",
        "model_input_names": list(getattr(tok, "model_input_names", None) or ["input_ids", "attention_mask"]),
    }
    if cfg["model_max_length"] is None:
        del cfg["model_max_length"]
    if isinstance(getattr(tok, "chat_template", None), str):
        cfg["chat_template"] = tok.chat_template
    dump = lambda d: json.dumps(d, indent=2, ensure_ascii=False) + "\n"
    return {
        "tokenizer.json": json.dumps(spec, ensure_ascii=False),
        "tokenizer_config.json": dump(cfg),
        "special_tokens_map.json": dump(smap),
    }


def save_tokenizer(tok: Any, out_dir: str | os.PathLike) -> list[str]:
    """Write :func:`tokenizer_files` of ``tok`` into the existing directory ``out_dir`` (an export's temporary
    directory: files of these names are replaced). Returns the file names written. Raises InteropError (see
    :func:`tokenizer_files`) before anything is written."""
    files = tokenizer_files(tok)
    out = Path(out_dir)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return list(files)


__all__ = [
    "SPECIALS",
    "TOKENIZER_CLASS",
    "capo_tokenizer",
    "export_tokenizer",
    "save_tokenizer",
    "task_tokenizer",
    "text_tokenizer",
    "tokenizer_files",
]
