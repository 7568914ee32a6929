"""Capo population: the N people of bioS(N) and their facts (one job: who exists, as list indices).

Part 3.3 §2 (bioS(N)); Part 4.1 §5. N people with unique full names (first x middle x last from the three name lists,
:mod:`canonlm.data.tasks.capo.assets`), and independent uniform attributes: birth date (12 months x days 1-28 x the
years of ``birth_years``), birth city, university, major, employer (the work city is the employer's headquarters city,
so it carries no extra information) and gender (``gender: random``, paper; or ``id_parity``: person id % 2, the
release's choice; 0 = "He", 1 = "She"). Person i is a pure function of (seed, birth_years, gender, i): names are the
first N distinct names of a counter-based stream of draws, so the population of a larger N extends the smaller one.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from canonlm.data.seeding import below, instance_keys, stable_hash64, words

# purposes of the counter-based words under a population namespace (values are part of the populations)
_P_NAME, _P_DATE, _P_CITY, _P_UNIV, _P_MAJOR, _P_EMP, _P_GENDER = range(7)


class Population:
    """The people of a task, per seed (cached).

    Args: N: people. N0: possible full names. list_sizes: name -> length of each list (``first_names``, ...,
        ``employers``). years: (first, last) birth years. gender: ``random`` | ``id_parity``. digest: the assets'
        digest (part of the namespace). seed: the task's seed. frags: the task's
        :class:`~canonlm.data.tasks.capo.fragments.Fragments` (for ``base_len``).
    """

    def __init__(
        self,
        N: int,
        N0: int,
        list_sizes: Mapping[str, int],
        years: tuple[int, int],
        gender: str,
        digest: str,
        seed: int,
        frags: Any,
    ):
        self.N, self.N0, self.list_sizes, self.years, self.gender = N, N0, list_sizes, years, gender
        self.digest, self.seed, self.frags = digest, seed, frags
        self.n_years = years[1] - years[0] + 1
        self._cache: dict[int, dict[str, np.ndarray]] = {}

    def get(self, seed: int | None = None) -> dict[str, np.ndarray]:
        """The N people of ``seed`` (None = the task's seed). Dict of (N,) arrays (indices into the lists in use):
        ``first``, ``middle``, ``last``, ``month`` (0-11), ``day`` (0-27 = days 1-28), ``year`` (0 =
        birth_years[0]), ``city``, ``univ``, ``major``, ``emp`` (work city = ``hq_cities[emp]``), ``gender`` (0 He,
        1 She), ``base_len`` (tokens of a biography outside the templates, <EOS> included)."""
        seed = self.seed if seed is None else int(seed)
        pop = self._cache.get(seed)
        if pop is None:
            ns = stable_hash64(
                "canonlm.data",
                "capo",
                "population",
                self.digest,
                dict(birth_years=list(self.years), gender=self.gender),
                int(seed),
            )
            pop = self._cache[seed] = self._make(ns, self.N, self.gender)
        return pop

    def sample(self, n: int) -> dict[str, np.ndarray]:
        """A fixed random population of ``n`` people (gender random; for the fragment alignment self-check)."""
        return self._make(stable_hash64("canonlm.data", "capo", "selfcheck"), n, "random")

    def _make(self, ns: int, N: int, gender: str) -> dict[str, np.ndarray]:
        s = self.list_sizes
        nm, nl = s["middle_names"], s["last_names"]
        key0 = instance_keys(ns, np.zeros(1, np.int64), np.zeros(1, np.int64))
        # first N distinct name codes of the stream of uniform draws
        m = N + 16 + int(4 * math.sqrt(N) + 2 * N * N / self.N0)
        while True:
            code = below(words(key0, _P_NAME, np.arange(m, dtype=np.int64)), self.N0)
            _, first_idx = np.unique(code, return_index=True)
            if first_idx.shape[0] >= N:
                break
            m *= 2
        code = code[np.sort(first_idx)[:N]]
        keys = instance_keys(ns, np.ones(N, np.int64), np.arange(N, dtype=np.int64))
        date = below(words(keys, _P_DATE, 0), 12 * 28 * self.n_years)
        pop = dict(
            first=(code // (nm * nl)).astype(np.int16),
            middle=((code // nl) % nm).astype(np.int16),
            last=(code % nl).astype(np.int16),
            month=(date % 12).astype(np.int8),
            day=((date // 12) % 28).astype(np.int8),
            year=(date // (12 * 28)).astype(np.int16),
            city=below(words(keys, _P_CITY, 0), s["birth_cities"]).astype(np.int16),
            univ=below(words(keys, _P_UNIV, 0), s["universities"]).astype(np.int16),
            major=below(words(keys, _P_MAJOR, 0), s["majors"]).astype(np.int16),
            emp=below(words(keys, _P_EMP, 0), s["employers"]).astype(np.int16),
        )
        if gender == "random":
            pop["gender"] = below(words(keys, _P_GENDER, 0), 2).astype(np.int8)
        else:
            pop["gender"] = (np.arange(N) % 2).astype(np.int8)
        pop["base_len"] = self.frags.base_len(pop)
        return pop
