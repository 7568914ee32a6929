"""Capo: knowledge capacity on bioS(N) biographies (Part 4.1 §5 of Physics of Language Models; bioS of Part 3.3).

N people with unique names and six uniform attributes are rendered as six-sentence biographies, re-rendered on every
exposure; a model is trained on the stream of biographies and scored on the bits of knowledge it stores (Part 3.3
Def. 4.3). Build the task with ``canonlm.data.tasks.build_task("capo", cfg)`` (keys: ``conf/task/capo.yaml``).

One module per job:

* :mod:`.assets` -- canonlm's own name/attribute lists and template pools (``capo_assets/``), validated;
* :mod:`.tokenizer` -- the byte-level BPE: trained on a fixed biography sample, cached, or a local tokenizer;
* :mod:`.fragments` -- every template fragment and value tokenised once; the compact vocabulary;
* :mod:`.population` -- the N people and their facts;
* :mod:`.render` -- one exposure of a person: biography text and token ids, with the answer spans;
* :mod:`.stream` -- the training stream (passes cut into windows) and :class:`CapoStream`;
* :mod:`.evaluation` -- val/test renderings packed into windows, each scored once;
* :mod:`.task` -- :class:`CapoTask`: the config, the task protocol of :mod:`canonlm.data.tasks`, the bits metrics.

The names below are the package's public API.
"""

from canonlm.data.tasks.capo.assets import ASSETS, ATTRIBUTES, MONTHS, PRONOUNS, load_assets, parse_template
from canonlm.data.tasks.capo.stream import CapoStream
from canonlm.data.tasks.capo.task import DEFAULTS, GROUP_LABELS, KEYS, PAPER_N, CapoTask
from canonlm.data.tasks.capo.tokenizer import EOS_TEXT, default_cache_dir, load_tokenizer, train_bpe

__all__ = [
    "CapoTask",
    "CapoStream",
    "load_assets",
    "load_tokenizer",
    "train_bpe",
    "parse_template",
    "default_cache_dir",
    "ATTRIBUTES",
    "GROUP_LABELS",
    "PAPER_N",
    "EOS_TEXT",
    "ASSETS",
    "MONTHS",
    "PRONOUNS",
    "DEFAULTS",
    "KEYS",
]
