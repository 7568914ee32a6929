"""A thin, model-agnostic view of a causal LM for evaluators: batched generation and per-position log-probabilities.

Evaluators in :mod:`canonlm.data` (Brevo/Lano generation accuracy, Lano KL, the real-life evals) talk to models only
through :class:`LanguageModel`, so ``canonlm.data`` never imports ``canonlm.arch``. Any callable mapping int64 token
ids (B, T) to logits (B, T, V) works (``LlamaCanon``, a Hugging Face model wrapped in a lambda, a test oracle).

Generation is exact for every architecture. When the forward object offers decode caches (``forward.new_cache()``
and ``forward(tokens, cache)``, as :class:`canonlm.arch.CanonLM` does: KV, Canon, short-conv and recurrent states),
a batch of right-padded prompts is prefilled over its shortest prompt, then stepped one position at a time: a row
still inside its prompt is fed its next prompt token, a row past it samples the next token; finished rows leave the
cache. That is O(T) token-forwards per generation. Otherwise (a plain callable, or sharded models that must run in
lockstep) every step re-runs the forward pass on the unfinished rows' prefixes (causal masking makes the padding
invisible to the positions that are read): the same tokens at O(T^2) cost.

Sampling noise is counter-based (Gumbel-max with SplitMix64 words keyed by the prompt's key and the step), so a
sample is a pure function of (model, prompt, key), whatever else is in the batch and whatever the batch size.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import numpy as np
import torch

from canonlm.data.seeding import to_unit, words

_P_GUMBEL = 7  # purpose id of the sampling noise words


class LanguageModel:
    """Batched greedy/temperature generation and log-probabilities around a forward function.

    Args:
        forward: callable ``forward(tokens) -> logits``; tokens int64 (B, T) on ``device``, logits float (B, T, V)
            where ``logits[b, t]`` predicts token t+1.
        vocab_size: V (the logits' last dimension).
        device: where token tensors are created (default: cpu).
        batch_size: prompts per forward pass.
        max_len: longest sequence the model accepts (prompt + generation); None = unbounded.
        context: callable returning a context manager entered around every forward pass (e.g. the trainer's
            precision plugin ``forward_context``, so generation runs under the same autocast as training).
        sync: for sharded models (FSDP), a callable ``sync(local_any_active: bool) -> bool`` that returns whether
            any rank still generates (an all-reduce MAX); ranks then run the same number of forward passes (a rank
            with nothing left runs a 1-token dummy pass), so the collectives inside the forward stay matched. All
            ranks must be given the same number of prompts. Generation then uses the uncached path.
        use_cache: None (default) = decode with caches when ``forward`` has ``new_cache`` and ``sync`` is None;
            False = always re-run prefixes; True = require caches (ValueError if ``forward`` has none or with sync).
    Raises ValueError for batch_size < 1 or vocab_size < 1, or an impossible ``use_cache``.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        vocab_size: int,
        device: str | torch.device = "cpu",
        batch_size: int = 32,
        max_len: int | None = None,
        context: Callable[[], Any] | None = None,
        sync: Callable[[bool], bool] | None = None,
        use_cache: bool | None = None,
    ):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r} is not allowed; allowed: an integer >= 1")
        if int(vocab_size) < 1:
            raise ValueError(f"vocab_size={vocab_size!r} is not allowed; allowed: an integer >= 1")
        self.forward = forward
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_len = max_len
        self.context = context or contextlib.nullcontext
        self.sync = sync
        can = callable(getattr(forward, "new_cache", None))
        if use_cache and (not can or sync is not None):
            raise ValueError(
                "use_cache=True: the forward object has no new_cache() or generation is synced across "
                "ranks (sharded models decode without caches); allowed: None | False"
            )
        self.use_cache = can and sync is None if use_cache is None else bool(use_cache)

    # ------------------------------------------------------------------ log-probabilities
    @torch.no_grad()
    def logprobs(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Log-softmax of the model at every position of every sequence.

        Args: sequences: list of n int64 arrays (L_r,).
        Returns: list of n float32 arrays (L_r, V); row t is log p(token t+1 = · | tokens 0..t).
        """
        out: list[np.ndarray] = []
        for b0 in range(0, len(sequences), self.batch_size):
            chunk = [np.asarray(s, dtype=np.int64) for s in sequences[b0 : b0 + self.batch_size]]
            T = max(len(s) for s in chunk)
            x = torch.zeros(len(chunk), T, dtype=torch.long)
            for r, s in enumerate(chunk):
                x[r, : len(s)] = torch.from_numpy(s)
            with self.context():
                logits = self.forward(x.to(self.device))
            lp = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
            out.extend(lp[r, : len(s)] for r, s in enumerate(chunk))
        return out

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[np.ndarray],
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        temperature: float = 0.0,
        keys: np.ndarray | None = None,
    ) -> list[np.ndarray]:
        """Continue every prompt by up to ``max_new_tokens`` tokens.

        Args:
            prompts: list of n int64 arrays (non-empty).
            max_new_tokens: cap on generated tokens (>= 1).
            stop_ids: a generation ends right after emitting one of these (the stop token is kept).
            temperature: 0 = greedy argmax (ties: lowest id); > 0 = sample from softmax(logits / temperature) by
                Gumbel-max with counter-based noise.
            keys: uint64 (n,), per-prompt noise keys (required when temperature > 0).
        Returns: list of n int64 arrays: the generated tokens only (without the prompt).
        Raises ValueError for an empty prompt, a prompt with no room left under ``max_len``, max_new_tokens < 1,
        temperature < 0, or missing/mismatched keys.
        """
        n = len(prompts)
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} is not allowed; allowed: an integer >= 1")
        if temperature < 0:
            raise ValueError(f"temperature={temperature!r} is not allowed; allowed: a number >= 0")
        if temperature > 0:
            if keys is None or len(keys) != n:
                raise ValueError("keys: one uint64 key per prompt is required when temperature > 0")
            keys = np.asarray(keys, dtype=np.uint64)
        out: list[np.ndarray] = [np.zeros(0, np.int64)] * n
        # sort by prompt length so a batch wastes little padding (results do not depend on the order)
        order = np.argsort([len(p) for p in prompts], kind="stable")
        for b0 in range(0, n, self.batch_size):
            rows = order[b0 : b0 + self.batch_size]
            gen = self._generate_batch(
                [np.asarray(prompts[r], dtype=np.int64) for r in rows],
                int(max_new_tokens),
                set(int(s) for s in stop_ids),
                float(temperature),
                None if keys is None else keys[rows],
            )
            for r, g in zip(rows, gen):
                out[int(r)] = g
        return out

    def _pick(
        self, last: torch.Tensor, n_gen: torch.Tensor, temperature: float, keys: np.ndarray | None
    ) -> torch.Tensor:
        """Next tokens (A,) from the last logits (A, V) of A rows; ``n_gen`` (A,) = tokens each row generated so far
        (the sampling noise of a row's j-th token is keyed by (key, j), so it does not depend on the batch)."""
        last = last.float().cpu()[:, : self.vocab_size]
        if temperature > 0:
            j = n_gen.numpy()[:, None].astype(np.int64) * self.vocab_size + np.arange(self.vocab_size, dtype=np.int64)
            u = to_unit(words(keys[:, None], _P_GUMBEL, j))
            g = -np.log(-np.log(np.clip(u, 1e-300, None)))
            return (last / temperature + torch.from_numpy(g).float()).argmax(-1)
        return last.argmax(-1)

    def _buffer(self, prompts: list[np.ndarray], max_new: int) -> tuple[np.ndarray, int, torch.Tensor]:
        """``(lens (B,), total, buf (B, total) int64)``: the prompts right-padded with room for ``max_new`` tokens
        (capped at ``max_len``). Raises ValueError for an empty prompt or one that leaves no room under max_len."""
        lens = np.array([len(p) for p in prompts], dtype=np.int64)
        if (lens < 1).any():
            raise ValueError("prompts must be non-empty")
        if self.max_len is not None and int(lens.max()) >= int(self.max_len):
            raise ValueError(
                f"a prompt of {int(lens.max())} tokens leaves no room to generate within the model's "
                f"max_len={self.max_len}"
            )
        total = int(lens.max()) + max_new
        if self.max_len is not None:
            total = min(total, int(self.max_len))
        buf = torch.zeros(len(prompts), total, dtype=torch.long)
        for r, p in enumerate(prompts):
            buf[r, : len(p)] = torch.from_numpy(p)
        return lens, total, buf

    def _generate_batch(
        self, prompts: list[np.ndarray], max_new: int, stops: set[int], temperature: float, keys: np.ndarray | None
    ) -> list[np.ndarray]:
        if self.use_cache:
            return self._generate_batch_cached(prompts, max_new, stops, temperature, keys)
        B = len(prompts)
        lens, total, buf = self._buffer(prompts, max_new)
        cur = torch.from_numpy(lens.copy())  # next write position per row
        done = torch.zeros(B, dtype=torch.bool)
        n_gen = torch.zeros(B, dtype=torch.long)
        buf_dev = buf.to(self.device)
        while True:  # at most max_new steps with local work (n_gen caps every row), then dummies if syncing
            active = (~done) & (cur < total)
            any_active = bool(active.any())
            if self.sync is not None:  # sharded models: every rank runs the same number of forward passes
                if not self.sync(any_active):
                    break
                if not any_active:
                    with self.context():
                        self.forward(buf_dev[:1, :1])
                    continue
            elif not any_active:
                break
            idx = torch.nonzero(active).flatten()  # only unfinished rows are recomputed
            hi = int(cur[idx].max())
            with self.context():
                logits = self.forward(buf_dev[idx.to(self.device), :hi])  # (A, hi, V)
            last = logits[torch.arange(idx.numel(), device=logits.device), (cur[idx] - 1).to(logits.device)]
            nxt = self._pick(last, n_gen[idx], temperature, None if keys is None else keys[idx.numpy()])
            buf[idx, cur[idx]] = nxt
            buf_dev[idx.to(self.device), cur[idx].to(self.device)] = nxt.to(self.device)
            cur[idx] += 1
            n_gen[idx] += 1
            if stops:
                hit = torch.tensor([int(t) in stops for t in nxt.tolist()], dtype=torch.bool)
                done[idx] |= hit
            done |= n_gen >= max_new
        return [buf[r, int(lens[r]) : int(lens[r]) + int(n_gen[r])].numpy().copy() for r in range(B)]

    def _generate_batch_cached(
        self, prompts: list[np.ndarray], max_new: int, stops: set[int], temperature: float, keys: np.ndarray | None
    ) -> list[np.ndarray]:
        """Decode-cache generation (module docstring): prefill the shortest prompt's length for all rows, then one
        position per forward call; finished rows are dropped from the batch and the cache."""
        B = len(prompts)
        lens, total, buf = self._buffer(prompts, max_new)
        lens_t = torch.from_numpy(lens)
        n_gen = torch.zeros(B, dtype=torch.long)
        rows = torch.arange(B)  # original row of each cache row
        pos = int(lens.min())  # next position to fill / feed
        cache = self.forward.new_cache()
        with self.context():
            logits = self.forward(buf[:, :pos].to(self.device), cache)
        last = logits[:, -1]
        while rows.numel():
            gen = lens_t[rows] <= pos  # rows whose position `pos` is generated (the others are still in the prompt)
            finished = torch.zeros(rows.numel(), dtype=torch.bool)
            if bool(gen.any()):
                g = torch.nonzero(gen).flatten()
                r = rows[g]
                nxt = self._pick(
                    last[g.to(last.device)], n_gen[r], temperature, None if keys is None else keys[r.numpy()]
                )
                buf[r, pos] = nxt
                n_gen[r] += 1
                stop = n_gen[r] >= max_new
                if stops:
                    stop |= torch.tensor([int(t) in stops for t in nxt.tolist()], dtype=torch.bool)
                finished[g] = stop
            if pos + 1 >= total:
                break
            if bool(finished.any()):
                keep = torch.nonzero(~finished).flatten()
                if keep.numel() == 0:
                    break
                rows = rows[keep]
                cache.select(keep.to(self.device))
            with self.context():
                logits = self.forward(buf[rows, pos : pos + 1].to(self.device), cache)
            last = logits[:, -1]
            pos += 1
        return [buf[r, int(lens[r]) : int(lens[r]) + int(n_gen[r])].numpy().copy() for r in range(B)]


__all__ = ["LanguageModel"]
