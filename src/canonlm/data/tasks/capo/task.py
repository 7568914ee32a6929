"""The Capo task object (one job: validate the config, compose the parts, answer the task protocol, score bits).

:class:`CapoTask` composes :mod:`.assets` (lists, templates), :mod:`.tokenizer` (the BPE), :mod:`.fragments` (token ids,
compact vocabulary), :mod:`.population` (the people), :mod:`.render` (biographies), :mod:`.stream` (training windows)
and :mod:`.evaluation` (val/test windows), and implements the protocol of :mod:`canonlm.data.tasks` on top of them.

Scoring (Part 3.3 Def. 4.3; Part 4.1 §5). Per biography seven answers (spans of tokens): group 1 = the full name at its
start, 2 = birth-date value, 3 = birth city, 4 = university, 5 = major, 6 = employer (work city is excluded), 7 = the
first He/She token (gender). ``num_groups = 8`` (group 0 unused). :meth:`CapoTask.finalize_metrics` turns the
teacher-forced per-group NLL sums into bits and bits per parameter.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from canonlm.data import ConfigError
from canonlm.data.tasks import Instance, InstanceBatch, check_split
from canonlm.data.tasks._common import (
    check_bool,
    check_choice,
    check_indices,
    check_int,
    is_int,
    merge_config,
    parse_index,
)
from canonlm.data.tasks.capo.assets import MAX_TEMPLATES, PRONOUNS, load_assets
from canonlm.data.tasks.capo.evaluation import EvalWindows
from canonlm.data.tasks.capo.fragments import Fragments
from canonlm.data.tasks.capo.population import Population
from canonlm.data.tasks.capo.render import Renderer, field_texts
from canonlm.data.tasks.capo.stream import CapoStream, TrainLayout
from canonlm.data.tasks.capo.tokenizer import bpe_training_texts, cached_bpe, default_cache_dir, load_tokenizer

GROUP_LABELS = {1: "name", 2: "birth_date", 3: "birth_city", 4: "university", 5: "major", 6: "employer", 7: "gender"}
PAPER_N = (50_000, 100_000, 200_000, 500_000, 1_000_000, 2_000_000)

DEFAULTS: dict[str, Any] = dict(
    name="capo",
    N=100_000,
    exposures=100,
    templates_per_attribute=50,
    birth_years=[1900, 2099],
    gender="random",
    permute_sentences=True,
    window="consecutive",
    context=512,
    tail="drop",
    seed=0,
    tokenizer=None,
    bpe_vocab_size=4096,
    bpe_train_bios=20_000,
    cache_dir=None,
    val_people=None,
    eval_renderings_per_person=1,
)
KEYS = tuple(DEFAULTS)


def _int(key: str, v: Any, lo: int, hi: int | None = None) -> int:
    """:func:`check_int` with Capo's wording of a bounded range (``"an integer >= lo and <= hi"``)."""
    return check_int(key, v, lo, hi, None if hi is None else f"an integer >= {lo} and <= {hi}")


class CapoTask:
    """Capo / bioS(N) task (Part 4.1 §5; Part 3.3 §2). Build with :func:`canonlm.data.tasks.build_task` (``"capo"``).

    Attributes:
        cfg: validated config (every key of ``KEYS``). N, exposures, T_tmpl (templates_per_attribute), years
            (tuple first, last), gender, permute_sentences, window, context, tail, seed: config values.
        vocab_size: compact vocabulary size (pad 0, tokens 1..V, ``eos_id`` = V + 1). pad_id = 0. eos_id.
        num_groups = 8, group_name = "attribute", group_labels (1 name .. 7 gender), chance = None,
        eval_mode = "teacher_forced".
        N0: number of possible full names (product of the three name-list sizes); S0: number of possible attribute
            tuples 2 x (12 x 28 x #years) x #cities x #universities x #majors x #employers (Part 3.3 Def. 4.3).
        tokenizer: the ``tokenizers.Tokenizer`` (original ids); tokenizer_path: file it was loaded from / cached at.
        compact_to_orig: int64 (vocab_size,) original id of each compact id (-1 for pad and <EOS>).
    Raises ConfigError (``task.<key>``) for unknown keys, wrong types or values (N outside [1, N0/4], exposures < 1,
    templates_per_attribute outside [1, 50], birth_years not [first, last] with 1 <= first <= last <= 9999, unknown
    gender / window / tail, bpe_vocab_size outside [257, 65536], bpe_train_bios outside [1, 10**6], val_people outside
    [1, N], eval_renderings_per_person < 1, a tokenizer path that does not load or breaks the fragment rule, a
    context shorter than the longest evaluation window content).
    """

    group_name = "attribute"
    group_labels: ClassVar[dict[int, str]] = dict(GROUP_LABELS)
    pad_id = 0
    chance = None
    eval_mode = "teacher_forced"
    num_groups = 8

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, {"capo": DEFAULTS}, KEYS, mismatch="capo")
        self.name = name
        A = load_assets()
        self._A = A
        self.list_sizes = {
            k: len(A[k])
            for k in (
                "first_names",
                "middle_names",
                "last_names",
                "birth_cities",
                "universities",
                "majors",
                "employers",
            )
        }
        n_first, n_mid, n_last = (self.list_sizes[k] for k in ("first_names", "middle_names", "last_names"))
        self.N0 = n_first * n_mid * n_last
        self.N = _int("N", c["N"], 1, self.N0 // 4)
        self.exposures = _int("exposures", c["exposures"], 1)
        self.T_tmpl = _int("templates_per_attribute", c["templates_per_attribute"], 1, MAX_TEMPLATES)
        by = c["birth_years"]
        if (
            isinstance(by, (str, bytes))
            or not isinstance(by, Sequence)
            or len(by) != 2
            or not all(is_int(y) for y in by)
            or not 1 <= by[0] <= by[1] <= 9999
        ):
            raise ConfigError("task.birth_years", by, "[first, last]: integers with 1 <= first <= last <= 9999")
        self.years = (int(by[0]), int(by[1]))
        self.n_years = self.years[1] - self.years[0] + 1
        self.gender = check_choice("gender", c["gender"], ("random", "id_parity"))
        self.permute_sentences = check_bool("permute_sentences", c["permute_sentences"])
        self.window = check_choice("window", c["window"], ("consecutive", "random_offset"))
        self.context = _int("context", c["context"], 1)
        self.tail = check_choice("tail", c["tail"], ("drop", "carry"))
        self.seed = _int("seed", c["seed"], 0)
        tok_path = c["tokenizer"]
        if tok_path is not None and (not isinstance(tok_path, (str, os.PathLike)) or str(tok_path) == ""):
            raise ConfigError(
                "task.tokenizer",
                tok_path,
                "null (train/cache canonlm's BPE) or a local path to a "
                "tokenizer.json or a Hugging Face tokenizer directory",
            )
        self.bpe_vocab_size = _int("bpe_vocab_size", c["bpe_vocab_size"], 257, 65536)
        self.bpe_train_bios = _int("bpe_train_bios", c["bpe_train_bios"], 1, 10**6)
        cd = c["cache_dir"]
        if cd is not None and (not isinstance(cd, (str, os.PathLike)) or str(cd) == ""):
            raise ConfigError("task.cache_dir", cd, "null (default cache) or a directory path")
        self.cache_dir = default_cache_dir() if cd is None else Path(cd).expanduser()
        vp = c["val_people"]
        self.val_people = min(self.N, 1000) if vp is None else _int("val_people", vp, 1, self.N)
        self.eval_renderings = _int("eval_renderings_per_person", c["eval_renderings_per_person"], 1)
        self.cfg = {**c, "birth_years": list(self.years), "val_people": vp}
        self.S0 = (
            2
            * (12 * 28 * self.n_years)
            * self.list_sizes["birth_cities"]
            * self.list_sizes["universities"]
            * self.list_sizes["majors"]
            * self.list_sizes["employers"]
        )

        # ---- tokenizer (train or load), fragments, compact vocabulary
        foreign = tok_path is not None
        if not foreign:
            tokenizer, self.tokenizer_path = cached_bpe(self.cache_dir, A, self.bpe_vocab_size, self.bpe_train_bios)
        else:
            try:
                tokenizer = load_tokenizer(tok_path)
            except Exception as e:  # noqa: BLE001 - any load failure is a config error
                raise ConfigError(
                    "task.tokenizer",
                    tok_path,
                    f"a loadable tokenizer.json or tokenizer directory ({type(e).__name__}: {e})",
                ) from None
            self.tokenizer_path = Path(tok_path).expanduser()
        self._frags = F = Fragments(tokenizer, A, self.T_tmpl, self.years, self.list_sizes)
        self.vocab_size, self.eos_id, self.n_used_tokens = F.vocab_size, F.eos_id, F.n_used_tokens
        self.compact_to_orig = F.compact_to_orig

        # ---- the parts built on the fragments (their caches are rebuilt lazily in every process)
        self._pop = Population(self.N, self.N0, self.list_sizes, self.years, self.gender, A["digest"], self.seed, F)
        self._renderer = Renderer(
            F, A, self.T_tmpl, self.permute_sentences, self.years, self.gender, self.N, self.val_people, self.seed
        )
        self._train = TrainLayout(self.N, self.window, self.seed, self._pop, self._renderer)
        self._eval = EvalWindows(
            self.N, self.val_people, self.eval_renderings, self.seed, self.eos_id, self._pop, self._renderer
        )
        bad = self._renderer.first_misaligned(self._pop.sample(48), F.encode)
        if bad is not None:
            if foreign:
                raise ConfigError(
                    "task.tokenizer",
                    tok_path,
                    "a byte-level BPE whose pre-tokenizer splits before a space+word and around "
                    "punctuation like GPT-2's (concatenated fragment ids differ from tokenizing the "
                    "whole biography)",
                )
            raise RuntimeError(f"capo fragments are not pre-token aligned for {bad!r}")
        if foreign:
            conflicts = F.prefix_conflicts()
            if conflicts:
                raise ConfigError(
                    "task.tokenizer",
                    tok_path,
                    "a tokenizer under which no template prefix is a token-level prefix of another "
                    f"(value losses would include template uncertainty); conflicts: {conflicts[:3]}",
                )
        need = self.max_instance_len("test")
        if self.context < need:
            raise ConfigError(
                "task.context",
                self.context,
                f"an integer >= {need} (an evaluation window holds <EOS> + the longest biography + <EOS>)",
            )

    @property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` (original ids)."""
        return self._frags.tokenizer

    @property
    def templates(self) -> dict[str, list[str]]:
        """The template pools in use: attribute -> the first ``templates_per_attribute`` templates."""
        return {a: list(v) for a, v in self._frags.templates.items()}

    def bpe_training_texts(self) -> list[str]:
        """The ``bpe_train_bios`` biographies the BPE is trained on (:func:`.tokenizer.bpe_training_texts`)."""
        return bpe_training_texts(self._A, self.bpe_train_bios)

    # ------------------------------------------------------------------ vocabulary (Fragments)
    def template_prefix_conflicts(self) -> list[tuple[str, str]]:
        """Template pairs whose prefix tokens are equal or a prefix of the other's
        (:meth:`.fragments.Fragments.prefix_conflicts`); empty for the shipped templates."""
        return self._frags.prefix_conflicts()

    def encode(self, text: str) -> np.ndarray:
        """Compact ids (int64) of ``text`` tokenised as a whole (no special tokens). KeyError for a token that never
        occurs in biographies."""
        return self._frags.encode(text)

    def token_names(self) -> list[str]:
        """Printable text of every compact id (index = id): ``<pad>``, the decoded token (with its leading space),
        ``<EOS>``."""
        return self._frags.token_names()

    def decode(self, ids: Any) -> str:
        """Text of compact ids (list, numpy or torch): tokens decoded by the tokenizer, ``<EOS>`` printed as
        ``<|endoftext|>``, pad as ``<pad>``, unknown ids as ``<unk_id>``."""
        return self._frags.decode(ids)

    # ------------------------------------------------------------------ population and renderings
    def population(self, seed: int | None = None) -> dict[str, np.ndarray]:
        """The N people (cached per seed; dict of (N,) arrays, :meth:`.population.Population.get`)."""
        return self._pop.get(seed)

    def person_record(self, i: int, seed: int | None = None) -> dict[str, Any]:
        """Facts of person ``i`` as text: ``name``, ``birth_date`` ("October 2, 1996"), ``birth_city``,
        ``university``, ``major``, ``employer``, ``work_city``, ``gender`` ("male" | "female"), ``pronoun``
        ("He" | "She"). IndexError outside [0, N)."""
        if not 0 <= int(i) < self.N:
            raise IndexError(f"person {i} outside [0, N={self.N})")
        pop = self.population(seed)
        r = {k: int(v[int(i)]) for k, v in pop.items()}
        out: dict[str, Any] = field_texts(self._A, r, self.years[0])
        out["gender"] = ("male", "female")[r["gender"]]
        out["pronoun"] = PRONOUNS[r["gender"]]
        return out

    def biography_text(self, split: str, r: int, person: int, seed: int | None = None) -> str:
        """Text of rendering ``r`` (training pass, or evaluation rendering) of person ``person`` (no <EOS>)."""
        check_split(split)
        return self._renderer.texts(self.population(seed), self._renderer.namespace(split, seed), [r], [person])[0]

    def render(self, split: str, r: Any, person: Any, seed: int | None = None) -> dict[str, np.ndarray]:
        """Token ids of renderings ``(r[b], person[b])`` of ``split`` (dict of :meth:`.render.Renderer.tokens`);
        person indices in [0, N); ValueError otherwise."""
        check_split(split)
        person = np.asarray(person, dtype=np.int64).reshape(-1)
        if person.size and (person.min() < 0 or person.max() >= self.N):
            raise ValueError(f"person indices must lie in [0, N={self.N})")
        r = np.broadcast_to(np.asarray(r, dtype=np.int64).reshape(-1), person.shape)
        if r.size and r.min() < 0:
            raise ValueError("rendering indices must be >= 0")
        return self._renderer.tokens(self.population(seed), self._renderer.namespace(split, seed), r, person)

    # ------------------------------------------------------------------ sizes
    def max_bio_len(self) -> int:
        """Tokens of the longest possible biography, <EOS> included (each part at its maximum; exact)."""
        return self._frags.max_bio_len()

    def min_bio_len(self) -> int:
        """Tokens of the shortest possible biography, <EOS> included."""
        return self._frags.min_bio_len()

    def mean_bio_len(self) -> float:
        """Expected tokens per biography (<EOS> included) under uniform attributes and templates."""
        return self._frags.mean_bio_len()

    def max_instance_len(self, split: str) -> int:
        """Longest biography + <EOS> (train); + 1 leading <EOS> for val/test (an evaluation window starts with
        <EOS> so the first name is predicted)."""
        check_split(split)
        return self.max_bio_len() + (0 if split == "train" else 1)

    def min_instance_len(self, split: str) -> int:
        """Shortest biography + <EOS>."""
        check_split(split)
        return self.min_bio_len()

    # ------------------------------------------------------------------ protocol: generate / instance
    def _instance_people(self, split: str, w: np.ndarray, i: np.ndarray, seed: int | None) -> np.ndarray:
        if split == "train":
            if i.size and i.max() >= self.N:
                raise ValueError(f"train instance index i must lie in [0, N={self.N}) (position in pass w)")
            out = np.empty(i.shape[0], dtype=np.int64)
            for p in np.unique(w):
                sel = w == p
                out[sel] = self._train.pass_(int(p), seed)["perm"][i[sel]]
            return out
        people = self.eval_people(split, seed)
        if i.size and i.max() >= people.shape[0]:
            raise ValueError(f"{split} instance index i must lie in [0, {people.shape[0]}) (evaluated people)")
        return people[i]

    def estimate_lengths(self, split: str, w: Any, i: Any, seed: int | None = None) -> np.ndarray:
        """float64 (I,): exact lengths of instances (w, i) (biography + <EOS>); see :meth:`generate`."""
        check_split(split)
        w = np.asarray(w, dtype=np.int64).reshape(-1)
        i = np.asarray(i, dtype=np.int64).reshape(-1)
        person = self._instance_people(split, w, i, seed)
        return self._renderer.lengths(self.population(seed), self._renderer.namespace(split, seed), w, person).astype(
            np.float64
        )

    def generate(self, split: str, w: Any, i: Any, seed: int | None = None) -> InstanceBatch:
        """Biographies as instances (the generic protocol; Capo's training schedule is :meth:`make_stream`).

        Instance (w, i): train -> pass w, i-th biography of the pass (person ``perm_w[i]``, i < N); val/test ->
        rendering w of the i-th evaluated person (:meth:`eval_people`). Each instance is the biography followed by
        <EOS>; loss on every token; 7 answers per instance (groups 1..7, in order of position).
        Returns :class:`InstanceBatch`; meta: ``person`` int64 (I,), ``gender`` int64 (I,), ``span_start`` /
        ``span_len`` int64 (I, 7) [the answer spans in group order 1..7, tokens from the instance start].
        Raises ValueError for a bad split, negative or out-of-range indices, mismatched lengths.
        """
        check_split(split)
        w, i = check_indices(w, i)
        person = self._instance_people(split, w, i, seed)
        pop = self.population(seed)
        b = self._renderer.tokens(pop, self._renderer.namespace(split, seed), w, person)
        I = person.shape[0]
        ss, sl = b["span_start"], b["span_len"]
        order = np.argsort(ss, axis=1, kind="stable")
        grp = np.broadcast_to(np.arange(1, 8, dtype=np.int32), (I, 7))
        return InstanceBatch(
            tokens=b["tokens"],
            loss_mask=np.ones(b["tokens"].shape[0], dtype=bool),
            offsets=b["offsets"],
            ans_inst=np.repeat(np.arange(I, dtype=np.int64), 7),
            ans_start=np.take_along_axis(ss, order, 1).reshape(-1),
            ans_len=np.take_along_axis(sl, order, 1).reshape(-1),
            ans_group=np.take_along_axis(grp, order, 1).reshape(-1).astype(np.int32),
            ans_offsets=np.arange(0, 7 * I + 1, 7, dtype=np.int64),
            meta={"person": person, "gender": pop["gender"][person].astype(np.int64), "span_start": ss, "span_len": sl},
        )

    def instance(self, split: str, index: int | tuple[int, int], seed: int | None = None) -> Instance:
        """One biography (+ <EOS>). ``index`` = (w, i) as in :meth:`generate`, or an int k meaning biography k of
        the split's sequence (train: pass k // N, position k % N; val/test: rendering k // n, person k % n of the n
        evaluated people). Meta: ``person``, ``gender`` (ints), ``text`` (str). ValueError on bad input."""
        check_split(split)
        w, i = parse_index(
            index, lambda k: divmod(k, self.N if split == "train" else self.eval_people(split, seed).shape[0])
        )
        b = self.generate(split, [w], [i], seed)
        aid, grp = b.token_answers()
        person = int(b.meta["person"][0])
        return Instance(
            tokens=b.tokens,
            loss_mask=b.loss_mask,
            answer_id=aid,
            group=grp,
            meta={
                "person": person,
                "gender": int(b.meta["gender"][0]),
                "text": self.biography_text(split, w, person, seed),
            },
        )

    # ------------------------------------------------------------------ training stream (TrainLayout)
    def pass_starts(self, upto: int, seed: int | None = None) -> np.ndarray:
        """int64 (upto+1,): token offset of the start of passes 0..upto in the training stream."""
        return self._train.pass_starts(upto, seed)

    def stream_segment(self, lo: int, hi: int, seed: int | None = None) -> dict[str, np.ndarray]:
        """Training stream tokens [lo, hi) and the answers overlapping them (dict of
        :meth:`.stream.TrainLayout.segment`). ValueError for an empty or negative segment."""
        return self._train.segment(lo, hi, seed)

    def window_starts(self, w: np.ndarray, window: int, seed: int | None = None) -> np.ndarray:
        """int64: stream offset of training windows ``w`` (``consecutive``: w T; ``random_offset``: w T + o_w)."""
        return self._train.window_starts(w, window, seed)

    def train_windows(self, w: Any, window: int, seed: int | None = None) -> dict[str, np.ndarray]:
        """Training windows ``w`` (int64 (W,)) of ``window`` tokens: dict of (W, T) arrays ``tokens`` int64,
        ``loss_mask`` bool (all but position 0), ``answer_id`` int32 (dense per window, -1 = not scored; answers
        must lie in [1, T)), ``group`` int32 (1..7 on scored tokens, 0 elsewhere)."""
        return self._train.windows(w, window, seed)

    # ------------------------------------------------------------------ evaluation windows (EvalWindows)
    def eval_people(self, split: str, seed: int | None = None) -> np.ndarray:
        """int64: people evaluated in ``split``: train/test -> 0..N-1; val -> a seeded subset of ``val_people``
        people (sorted)."""
        return self._eval.people(split, seed)

    def eval_windows(self, split: str, window: int | None = None, seed: int | None = None) -> int:
        """Number of windows that hold every evaluated rendering of ``split`` once (``window`` default: context).
        ``train`` counts the windows of one evaluation-style pass over all N people."""
        check_split(split)
        return int(self._eval.layout(split, int(window or self.context), seed)["b0"].shape[0])

    def eval_batch_windows(self, split: str, w: Any, window: int, seed: int | None = None) -> dict[str, np.ndarray]:
        """Evaluation windows ``w`` (int64 (W,)) of ``split``, as :meth:`train_windows` returns: window w =
        <EOS> + whole biographies b0[w]..b1[w]-1 (each + <EOS>) + the beginning of the next biography (loss on,
        not scored); windows >= :meth:`eval_windows` are all pad (0, loss off, no answers). ValueError for a
        ``window`` shorter than :meth:`max_instance_len`."""
        T = int(window)
        if T < self.max_instance_len(split):
            raise ValueError(f"window {T} < {self.max_instance_len(split)} (longest evaluation window content)")
        return self._eval.batch(split, w, T, seed)

    # ------------------------------------------------------------------ stream, schedule, metrics
    def make_stream(
        self,
        split: str,
        *,
        window: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
        num_steps: int | None = None,
        tail: str = "drop",
    ) -> CapoStream:
        """The Capo data stream of ``split`` (:class:`CapoStream`; same interface and yield format as
        :class:`canonlm.data.stream.SyntheticStream`). ``tail`` is validated but has no effect (the training stream
        is consecutive; evaluation windows always hold whole biographies)."""
        return CapoStream(
            self,
            split,
            window=window,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            start_step=start_step,
            num_steps=num_steps,
            tail=tail,
        )

    def exposure_tokens(self, seed: int | None = None) -> int:
        """Tokens of passes 0..exposures-1 of the training stream (every person seen ``exposures`` times)."""
        return int(self.pass_starts(self.exposures, seed)[-1])

    def steps_for_exposures(self, batch_size: int, window: int | None = None, seed: int | None = None) -> int:
        """Optimizer steps of ``batch_size`` global windows after which every person has been seen ``exposures``
        times: ceil(W / batch_size) with W = ceil(exposure_tokens / T) windows (+1 for ``random_offset``). The last
        step may run up to batch_size * T tokens into pass ``exposures``: its first people are seen once more (and,
        with ``random_offset``, biographies in the gaps between windows can be missed). ValueError for batch_size < 1.
        """
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is not allowed; allowed: an integer >= 1")
        T = int(window or self.context)
        n_win = -(-self.exposure_tokens(seed) // T) + (1 if self.window == "random_offset" else 0)
        return -(-n_win // int(batch_size))

    def model_overrides(self) -> dict[str, Any]:
        """Model keys Capo requires: tied input/output embeddings (paper App. C)."""
        return {"tie_embeddings": True}

    def params_counted(self, model_info: Mapping[str, Any]) -> int:
        """P of Part 3.3 Def. 4.3: ``num_params`` minus the embedding rows of ids that never occur (the pad row, and
        rows beyond the compact vocabulary if the model's vocabulary is larger), counted once with tied embeddings
        and twice (input + output) without. ``model_info``: ``num_params``, ``d_model``, ``tie_embeddings``,
        optional ``vocab_size`` (default: the task's). KeyError/ValueError for missing/invalid entries."""
        P = int(model_info["num_params"])
        d = int(model_info["d_model"])
        tied = bool(model_info.get("tie_embeddings", True))
        rows = int(model_info.get("vocab_size", self.vocab_size))
        unused = rows - self.n_used_tokens
        if unused < 0 or P <= 0 or d <= 0:
            raise ValueError(
                f"model_info {dict(model_info)!r} inconsistent with the task's vocabulary "
                f"({self.n_used_tokens} used ids)"
            )
        return P - unused * d * (1 if tied else 2)

    def finalize_metrics(self, split: str, table: Mapping[str, Any], model_info: Mapping[str, Any]) -> dict[str, float]:
        """Bits of knowledge and bits per parameter (Part 3.3 Def. 4.3).

        Args:
            table: ``{"by_group": {g: {"answers": int, "acc", "tokens", "token_acc", "nll_sum": float}}, ...}``
                (g int or str; nll_sum = natural-log cross-entropy summed over the group's scored tokens).
            model_info: see :meth:`params_counted`.
        Returns: ``bits`` = N log2(N0 / e^p1) + N log2(S0 / e^p2) with p1 = nll_sum[name] / answers[name] and
            p2 = sum over groups 2..7 of nll_sum[g] / answers[g]; ``bits_per_param`` = bits / P;
            ``bits_per_param_max`` = [N log2(N0/N) + N log2 S0] / P (R_max of a perfect model); ``p1_name_nats``,
            ``p2_value_nats``, ``params_counted`` (P), ``bits_total_max`` (numerator of bits_per_param_max, in bits),
            ``bits_uniform``: the bits of a model that predicts every answer token uniformly over the model's V
            vocabulary ids (an untrained model's loss is close to ln V a token), i.e. the same formula with
            p_g = (tokens_g / answers_g) ln V (only when every group has its ``tokens`` count); negative, since a name
            or value spans more tokens than it has choices.
        Raises KeyError if a group is missing from the table, ValueError if one has no answers.
        """
        by = table["by_group"]
        get = lambda g: by[g] if g in by else by[str(g)]
        avg, toks = {}, {}
        for g in range(1, 8):
            row = get(g)
            n = float(row["answers"])
            if n <= 0:
                raise ValueError(f"group {g} ({GROUP_LABELS[g]}) has no scored answers")
            avg[g] = float(row["nll_sum"]) / n
            if "tokens" in row:
                toks[g] = float(row["tokens"]) / n
        N, ln2 = self.N, math.log(2.0)

        def bits_of(p1: float, p2: float) -> float:
            return N * (math.log2(self.N0) - p1 / ln2) + N * (math.log2(self.S0) - p2 / ln2)

        p1 = avg[1]
        p2 = sum(avg[g] for g in range(2, 8))
        bits = bits_of(p1, p2)
        ln_v = math.log(int(model_info.get("vocab_size", self.vocab_size)))
        uniform = (
            {"bits_uniform": bits_of(toks[1] * ln_v, sum(toks[g] for g in range(2, 8)) * ln_v)}
            if len(toks) == 7
            else {}
        )
        bmax = N * math.log2(self.N0 / N) + N * math.log2(self.S0)
        P = self.params_counted(model_info)
        return {
            "bits": bits,
            "bits_per_param": bits / P,
            "bits_per_param_max": bmax / P,
            "bits_total_max": bmax,
            "p1_name_nats": p1,
            "p2_value_nats": p2,
            "params_counted": float(P),
            **uniform,
        }

    def explain_metrics(self, metrics: Mapping[str, float]) -> list[str]:
        """Lines that say how to read :meth:`finalize_metrics`'s numbers (printed under a run's closing table).

        Part 3.3 Def. 4.3 counts the bits a model's loss proves it stores beyond a uniform guess among the valid
        answers (N0 names, S0 value tuples): 0 bits = no better than that guess; a negative count = a loss above
        that guess (probability spent on tokens that are no valid answer, as early in training), i.e. nothing
        stored yet. Returns a list of str; never raises on missing keys (those lines are left out)."""
        out = []
        if "bits" in metrics:
            sign = (
                "negative: the loss on the answers is still above a uniform guess among the valid names and "
                "values, so nothing is proven stored yet"
                if metrics["bits"] < 0
                else "positive: the loss on the answers is below a uniform guess among the valid names and values"
            )
            out.append(
                f"bits = N log2(N0/e^p1) + N log2(S0/e^p2) (Part 3.3 Def. 4.3, N={self.N}, log2 N0 = "
                f"{math.log2(self.N0):.1f}, log2 S0 = {math.log2(self.S0):.1f}); 0 = a uniform guess among "
                f"the valid answers; here {sign}"
            )
        if "bits_uniform" in metrics and "bits_total_max" in metrics:
            out.append(
                f"scale: a model uniform over the vocabulary (about an untrained one) scores bits "
                f"{metrics['bits_uniform']:.6g}; a perfect one {metrics['bits_total_max']:.6g} "
                f"(bits_per_param_max {metrics.get('bits_per_param_max', float('nan')):.4g})"
            )
        return out

    def __repr__(self) -> str:
        return (
            f"CapoTask(N={self.N}, exposures={self.exposures}, templates={self.T_tmpl}, "
            f"vocab_size={self.vocab_size}, context={self.context})"
        )
