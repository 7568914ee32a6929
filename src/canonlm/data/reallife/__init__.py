"""Real-life evaluations of pretrained models (paper App. B).

* :mod:`canonlm.data.reallife.multihop` -- 1-hop / 2-hop birth-year retrieval hidden in background text (App. B).
* :mod:`canonlm.data.reallife.babilong` -- Babilong qa1-qa5 prompts from local data and the label scorer.

Both take a pluggable tokenizer (any callable ``text -> list[int]``, a ``tokenizers.Tokenizer``, a transformers
tokenizer or :class:`canonlm.data.text.TextTokenizer`) and never touch the network. The model is reached only through
:class:`canonlm.data.lm.LanguageModel`. The command line lives in :mod:`canonlm.eval.reallife`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence


def _accepts_keyword(fn: Callable[..., Any], name: str, probe: Callable[[], Any]) -> bool:
    """Whether ``fn`` accepts the keyword ``name`` -- decided once: from the signature (a parameter of that name or
    ``**kwargs``); if the signature cannot be read, by calling ``probe()`` (fn with the keyword on a tiny input) a
    single time: True unless it raises TypeError."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a text signature
        try:
            probe()
        except TypeError:
            return False
        return True
    return any(
        p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
        for p in params
    )


def as_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> list[int]`` for a tokenizer of any supported kind (no special tokens added).

    Accepts an object with ``encode`` (``tokenizers.Tokenizer`` -> ``Encoding.ids``; transformers / TextTokenizer ->
    ids) or a plain callable returning ids. Whether ``encode`` takes ``add_special_tokens`` is decided once, here
    (its signature, else one probe call on ``"a"``); every call then uses that one convention, so an error raised by
    the tokenizer itself (TypeError included) propagates unchanged and the tokenizer runs once per text.
    Raises TypeError for anything else.
    """
    enc = getattr(tokenizer, "encode", None)
    if enc is not None:
        if _accepts_keyword(enc, "add_special_tokens", lambda: enc("a", add_special_tokens=False)):

            def encode(text: str) -> list[int]:
                r = enc(text, add_special_tokens=False)
                return list(map(int, getattr(r, "ids", r)))
        else:

            def encode(text: str) -> list[int]:
                r = enc(text)
                return list(map(int, getattr(r, "ids", r)))

        return encode
    if callable(tokenizer):
        return lambda text: list(map(int, tokenizer(text)))
    raise TypeError(f"tokenizer: {type(tokenizer).__name__} is neither callable nor has .encode")


def as_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """``ids -> text`` for a tokenizer with ``decode`` (``skip_special_tokens=True`` when its ``decode`` takes that
    keyword -- decided once, like :func:`as_encoder`). TypeError for a tokenizer without ``decode``."""
    dec = getattr(tokenizer, "decode", None)
    if dec is None:
        raise TypeError(f"tokenizer: {type(tokenizer).__name__} has no .decode")
    if _accepts_keyword(dec, "skip_special_tokens", lambda: dec([], skip_special_tokens=True)):
        return lambda ids: dec([int(i) for i in ids], skip_special_tokens=True)
    return lambda ids: dec([int(i) for i in ids])


__all__ = ["as_encoder", "as_decoder"]
