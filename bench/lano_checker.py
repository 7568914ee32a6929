"""Lano evaluation-side and generator cost per core vs the official release.

For cfg3f / cfg3j / cfg3k -- the official grammar files when ``--grammar-dir`` holds them (default: the shared
compatibility folder if present), otherwise canonlm's generated grammar of the same family (grammar_seed 0) -- prints:

* recogniser (:func:`canonlm.data.cfg.check`): ms per sampled (valid) sentence, ms per sentence with one token
  flipped (mostly invalid), and peak memory;
* exact next-symbol DP (:func:`canonlm.data.cfg.next_symbol_probs`, what the KL needs): ms per sentence and for one
  sentence of the official reference length (305 tokens cfg3f, 625 tokens cfg3k), and peak memory;
* sampler tokens/s (``<bos>`` counted, as officially): the raw kernel on batches of 1024 keys without a length cap,
  and ``LanoTask.generate`` with the paper context's cap, batches of 256.

Ratios divide the official time by ours (official per-sentence times, measured: the midpoint of the stated range for
the validity DP -- cfg3f (2.5+9.7)/2 = 6.1 s, cfg3j (9.2+32.9)/2 = 21.05 s, cfg3k (14.0+27.9)/2 = 20.95 s; the
stated single values for one flipped sentence -- 5.3 / 34.8 / 24.8 s -- and for the KL DP -- cfg3f 3.4 s at 305
tokens, cfg3k 19.4 s at 625 tokens, none for cfg3j) and our rate by the official tokens/s (cfg3f
1,051,000; cfg3j 985,100; cfg3k 1,034,700). Note the official ranges were measured on particular sentences; ours
are averages over fresh samples (their lengths are printed).

Peak memory = the high-water mark of the resident set (``ru_maxrss``) of a forked child that runs only that
measurement, minus its resident set when it started. Single thread: pinned to one core, NUMBA_NUM_THREADS=1,
OMP_NUM_THREADS=1; times are CPU seconds (``time.process_time``).

    .venv/bin/python bench/lano_checker.py                      # full (about 1 min)
    .venv/bin/python bench/lano_checker.py --quick              # fewer sentences
    .venv/bin/python bench/lano_checker.py --grammar-dir /path/to/Lano-cfg/configs
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import multiprocessing as mp
import resource
import time
from pathlib import Path

import numpy as np

from canonlm.data.cfg import check, load_grammar, next_symbol_probs, preset_grammar, sample_sentences
from canonlm.data.seeding import instance_keys

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT.parent / "shared" / "data" / "physicslm4" / "lano"
CONTEXT = {"cfg3f": 512, "cfg3j": 1536, "cfg3k": 1536}
OFF_VALID = {"cfg3f": 6.1, "cfg3j": 21.05, "cfg3k": 20.95}  # s, midpoints of the measured ranges
OFF_FLIP = {"cfg3f": 5.3, "cfg3j": 34.8, "cfg3k": 24.8}  # s, one flipped sentence
OFF_KL = {"cfg3f": (3.4, 305), "cfg3k": (19.4, 625)}  # s at (tokens)
OFF_GEN = {"cfg3f": 1_051_000, "cfg3j": 985_100, "cfg3k": 1_034_700}  # tokens/s, measured


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _child(conn, fn, args):
    base = _rss_kb()
    out = fn(*args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    conn.send((out, max(0, peak - base) / 1024.0))
    conn.close()


def isolated(fn, *args):
    """Run fn(*args) in a forked child; returns (result, peak extra memory in MB)."""
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(b, fn, args))
    p.start()
    res = a.recv()
    p.join()
    return res


def time_check(g, sents):
    t0 = time.process_time()
    ok = check(g, sents)
    return (time.process_time() - t0) / len(sents), float(ok.mean())


def time_dp(g, sents):
    t0 = time.process_time()
    worst = 0.0
    for s in sents:
        p = next_symbol_probs(g, s)
        worst = max(worst, float(np.abs(p.sum(1) - 1).max()))
    return (time.process_time() - t0) / len(sents), worst


def rate(fn, seconds):
    fn()
    tok, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        tok += fn()
    return tok / (time.process_time() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grammar-dir", default=None, help="folder with the official cfg3f/j/k.json")
    ap.add_argument("--sentences", type=int, default=100, help="sentences per checker measurement")
    ap.add_argument("--seconds", type=float, default=3.0, help="CPU seconds per sampler measurement")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu", type=int, default=None)
    a = ap.parse_args()
    if a.quick:
        a.sentences, a.seconds = 30, 1.0
    cpu = a.cpu if a.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    gdir = Path(a.grammar_dir) if a.grammar_dir else (DEFAULT_DIR if DEFAULT_DIR.exists() else None)
    print(
        f"pinned to core {cpu}; NUMBA_NUM_THREADS={os.environ['NUMBA_NUM_THREADS']}; CPU time; "
        f"official anchors measured on one core (validity: range midpoints; flipped / KL: stated single values)"
    )
    from canonlm.data.tasks import build_task

    for name in ("cfg3f", "cfg3j", "cfg3k"):
        f = gdir / f"{name}.json" if gdir else None
        if f is not None and f.exists():
            g, src = load_grammar(f), f"official {f}"
        else:
            g, src = preset_grammar(name, 0), "generated family grammar (grammar_seed 0; not the official file)"
        print(f"\n== {name}: {src}; {g!r}")
        n = a.sentences
        tok, off, _ = sample_sentences(
            g, instance_keys(1, np.arange(n), np.zeros(n, np.int64)), max_len=CONTEXT[name] - 1
        )
        sents = [tok[off[r] : off[r + 1]] for r in range(n)]
        lens = np.diff(off)
        flips = []
        for r, s in enumerate(sents):
            x = s.copy()
            p = (r * 7919) % len(x)
            x[p] = 1 + x[p] % g.num_terminals
            flips.append(x)
        check(g, sents[:1])
        next_symbol_probs(g, sents[0])  # compile / load the kernels outside the measurements
        (t_ok, acc), mem = isolated(time_check, g, sents)
        print(
            f"recogniser, valid   : {t_ok * 1e3:8.3f} ms/sentence (len mean {lens.mean():.0f}, max {lens.max()}; "
            f"accepted {acc:.0%}); peak +{mem:.1f} MB; official {OFF_VALID[name]} s "
            f"-> x{OFF_VALID[name] / t_ok:,.0f}"
        )
        (t_fl, acc), mem = isolated(time_check, g, flips)
        print(
            f"recogniser, flipped : {t_fl * 1e3:8.3f} ms/sentence (accepted {acc:.0%}); peak +{mem:.1f} MB; "
            f"official {OFF_FLIP[name]} s -> x{OFF_FLIP[name] / t_fl:,.0f}"
        )
        m = max(5, n // 4)
        (t_dp, worst), mem = isolated(time_dp, g, sents[:m])
        print(
            f"next-symbol DP      : {t_dp * 1e3:8.3f} ms/sentence over {m} (len mean {lens[:m].mean():.0f}); "
            f"peak +{mem:.1f} MB; max |row sum - 1| = {worst:.1e}"
        )
        if name in OFF_KL:
            secs, L = OFF_KL[name]
            big, bo, _ = sample_sentences(
                g, instance_keys(2, np.arange(400), np.zeros(400, np.int64)), max_len=CONTEXT[name] - 1
            )
            r = int(np.argmin(np.abs(np.diff(bo) - L)))
            s = big[bo[r] : bo[r + 1]]
            (t1, _), mem = isolated(time_dp, g, [s] * 5)
            print(
                f"next-symbol DP @{len(s)} tok: {t1 * 1e3:8.3f} ms; peak +{mem:.1f} MB; official {secs} s at {L} "
                f"tokens -> x{secs / t1:,.0f}"
            )
        keys = instance_keys(3, np.arange(1024), np.zeros(1024, np.int64))
        r_raw = rate(lambda: sample_sentences(g, keys, prefix_bos=True)[0].shape[0], a.seconds)
        task = build_task(
            "lano",
            dict(grammar=name, grammar_file=str(f) if f is not None and f.exists() else None, context=CONTEXT[name]),
        )
        ctr = [0]

        def gen():
            ctr[0] += 1
            w = np.arange(256, dtype=np.int64) + 256 * ctr[0]
            return task.generate("train", w, np.zeros(256, np.int64)).tokens.shape[0]

        r_task = rate(gen, a.seconds)
        print(
            f"sampler (kernel)    : {r_raw / 1e6:8.2f} M tokens/s; official {OFF_GEN[name] / 1e6:.3f} M -> "
            f"x{r_raw / OFF_GEN[name]:.1f}"
        )
        print(
            f"LanoTask.generate   : {r_task / 1e6:8.2f} M tokens/s (cap {task.max_len}); -> "
            f"x{r_task / OFF_GEN[name]:.1f}"
        )


if __name__ == "__main__":
    main()
