"""Mixtures of prepared text corpora (``task.sources``), the token budget (``data.max_tokens``) and the data side of
document masking (``task.doc_mask``: ``doc_ids``).

Oracles: the binomial distribution for the realised proportions; the sources' shards read back with numpy from the
documented layout (meta.json + .bin + .idx.npy) for what a window holds and where documents start; naive loops over
window indices for per-source counts and cap extents; stream identities for resume at other world sizes; per-source
losses recomputed with ``F.cross_entropy`` on each source's own windows; ``ceil`` arithmetic for the token budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from canonlm.data import ConfigError
from canonlm.data.prepare import main as prepare_main
from canonlm.data.tasks import build_task
from canonlm.data.text import MIX_BLOCK, apportion
from test_text import CORPUS, read_split, train_bpe

T = 16


def _prep(root: Path, name: str, lines: list[str], tok: Path, shard_tokens: int = 150) -> Path:
    src = root / f"{name}.txt"
    src.write_text("\n".join(lines) + "\n")
    out = root / name
    assert (
        prepare_main(
            [
                "--input",
                str(src),
                "--tokenizer",
                str(tok),
                "--out",
                str(out),
                "--append-eos",
                "--val-fraction",
                "0.15",
                "--test-fraction",
                "0.15",
                "--shard-tokens",
                str(shard_tokens),
                "--quiet",
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three prepared corpora with one tokenizer (even lines, odd lines, the whole fixture) and one corpus with
    another tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    tok = train_bpe(root / "tokenizer.json")
    lines = [ln for ln in CORPUS.read_text().split("\n") if ln.strip()]
    other = train_bpe(root / "other.json", vocab_size=300)
    return dict(
        a=_prep(root, "a", lines[0::2], tok),
        b=_prep(root, "b", lines[1::2], tok),
        c=_prep(root, "c", lines, tok, shard_tokens=400),
        other=_prep(root, "o", lines, other),
        root=root,
    )


def mix(corpora, weights=(0.7, 0.3), names=("a", "b"), **kw):
    sources = {n: {"data_dir": str(corpora[n]), "weight": w} for n, w in zip(names, weights)}
    for n, cap in (kw.pop("caps", None) or {}).items():
        sources[n]["max_epochs"] = cap
    return build_task("text", {"sources": sources, "context": T, "seed": 5, **kw})


def alone(path, **kw):
    return build_task("text", {"data_dir": str(path), "context": T, "seed": 5, **kw})


def slot_of(window: np.ndarray, shards: list[np.ndarray]) -> tuple[int, int]:
    """(shard, token offset) of the T-aligned slot holding ``window`` in numpy-read shards (exactly one)."""
    hits = [
        (k, s)
        for k, arr in enumerate(shards)
        for s in range(0, (arr.shape[0] // T) * T, T)
        if np.array_equal(arr[s : s + T], window)
    ]
    assert len(hits) == 1, hits
    return hits[0]


# ---------------------------------------------------------------------------------------------- proportions
@pytest.mark.parametrize(
    "weights,names,n", [((0.7, 0.3), ("a", "b"), 20_000), ((5, 3, 2), ("a", "b", "c"), 3 * MIX_BLOCK + 7_777)]
)
def test_realised_proportions_within_a_binomial_bound(corpora, weights, names, n):
    task = mix(corpora, weights, names)
    src, _, _ = task.locate("train", np.arange(n))
    counts = np.bincount(src, minlength=len(names))
    p = np.asarray(weights, dtype=float) / sum(weights)
    sd = np.sqrt(n * p * (1 - p))
    # |count - n p| <= 5 sd fails with probability < 1e-6 per source for a binomial count
    assert (np.abs(counts - n * p) <= 5 * sd).all(), (counts, n * p, sd)
    # the order is random, not a fixed pattern: over chunks of 50 windows the share of source 0 varies like a
    # binomial (variance within a factor 2 of n p (1 - p))
    chunk = np.bincount(np.arange(20_000) // 50, weights=(src[:20_000] == 0))
    assert 0.5 < chunk.var() / (50 * p[0] * (1 - p[0])) < 2.0
    # exact accounting: source_windows(m) == a naive count over windows [0, m)
    for m in (0, 1, 999, n):
        assert task.source_windows(m).tolist() == np.bincount(src[:m], minlength=len(names)).tolist()
    # another seed, another order with the same proportions
    other = build_task("text", {**task.cfg, "seed": 6})
    assert not np.array_equal(other.locate("train", np.arange(2000))[0], src[:2000])


def test_block_holds_the_apportioned_counts(corpora):
    task = mix(corpora, (5, 3, 2), ("a", "b", "c"))
    src, k, _ = task.locate("train", np.arange(MIX_BLOCK, 2 * MIX_BLOCK))  # block 1
    want = apportion([5, 3, 2], MIX_BLOCK)
    assert abs(want - MIX_BLOCK * np.array([0.5, 0.3, 0.2])).max() <= 1 and want.sum() == MIX_BLOCK
    for s in range(3):  # the block's windows of source s are its own windows [c_s, 2 c_s), in order
        assert k[src == s].tolist() == list(range(want[s], 2 * want[s]))


# ---------------------------------------------------------------------------------------------- windows
def test_mixture_windows_are_the_sources_own_windows(corpora):
    task = mix(corpora)
    solo = {"a": alone(corpora["a"]), "b": alone(corpora["b"])}
    shards = {n: read_split(corpora[n], "train")[1] for n in ("a", "b")}
    w = np.arange(300)
    got = task.gather("train", w)
    src, k, _ = task.locate("train", w)
    assert np.array_equal(got["source"], src)
    for r in range(len(w)):
        name = task.source_names[src[r]]
        np.testing.assert_array_equal(got["tokens"][r], solo[name].windows("train", [k[r]])[0])
        slot_of(got["tokens"][r], shards[name])  # a T-aligned slot of that source's own shards (numpy)
    # each source's first epoch (its own windows 0..S-1) visits each of its slots once
    for name in ("a", "b"):
        S = sum(a.shape[0] // T for a in shards[name])
        assert task.source_table()[name]["train_windows"] == S
        slots = {slot_of(x, shards[name]) for x in solo[name].windows("train", np.arange(S))}
        assert len(slots) == S


def test_eval_splits_take_every_source_in_turn(corpora):
    task = mix(corpora)
    for split in ("val", "test"):
        shards = {n: read_split(corpora[n], split)[1] for n in ("a", "b")}
        g = task.gather(split, np.arange(10))
        assert g["source"].tolist() == [0, 1] * 5
        for r in range(10):
            name = ("a", "b")[r % 2]
            np.testing.assert_array_equal(g["tokens"][r], alone(corpora[name]).windows(split, [r // 2])[0])
            slot_of(g["tokens"][r], shards[name])


def test_concat_mode_is_one_permutation_over_all_slots(corpora):
    task = build_task(
        "text",
        {"sources": {n: {"data_dir": str(corpora[n])} for n in ("a", "b")}, "mix": "concat", "context": T, "seed": 5},
    )
    shards = {n: read_split(corpora[n], "train")[1] for n in ("a", "b")}
    sizes = {n: sum(a.shape[0] // T for a in shards[n]) for n in ("a", "b")}
    S = sizes["a"] + sizes["b"]
    win = task.windows("train", np.arange(2 * S))
    seen = []
    for r in range(S):  # one epoch: every slot of every source once
        name = next(
            n
            for n in ("a", "b")
            if any(np.array_equal(win[r], a[s : s + T]) for a in shards[n] for s in range(0, (a.shape[0] // T) * T, T))
        )
        seen.append((name, slot_of(win[r], shards[name])))
    assert len(set(seen)) == S
    assert sorted(map(tuple, win[S:].tolist())) == sorted(map(tuple, win[:S].tolist()))
    src = task.locate("train", np.arange(3 * S + 5))[0]
    assert task.source_table()["a"]["share"] == pytest.approx(sizes["a"] / S)
    for m in (7, S, 2 * S + 3, 5, 3 * S + 5):  # the cached counter also when m goes down
        assert task.source_windows(m).tolist() == np.bincount(src[:m], minlength=2).tolist()


def test_single_corpus_is_unchanged(corpora):
    """task.data_dir alone: the documented window rule (slot perm_e(w mod S), key from (seed, split, T, epoch)) and
    the same batch keys as before; a one-source list gives the same windows."""
    from canonlm.data.seeding import GOLDEN, mix64, stable_hash64
    from canonlm.data.text import feistel_permute

    task = alone(corpora["c"])
    _, shards = read_split(corpora["c"], "train")
    sizes = [a.shape[0] // T for a in shards]
    S = sum(sizes)
    w = np.arange(2 * S + 3)
    keys = mix64(np.uint64(stable_hash64("text-windows", 5, "train", T)) + ((w // S).astype(np.uint64) + 1) * GOLDEN)
    slot = feistel_permute(w % S, S, keys)
    cum = np.cumsum([0] + sizes)
    want = [
        shards[np.searchsorted(cum, s, "right") - 1][(s - cum[np.searchsorted(cum, s, "right") - 1]) * T :][:T]
        for s in slot
    ]
    np.testing.assert_array_equal(task.windows("train", w), np.stack(want))
    b = task.make_stream("train", window=T, batch_size=2, seed=5).batch(0)
    assert set(b) == {"tokens", "loss_mask", "answer_id", "group"}
    one = build_task("text", {"sources": [{"data_dir": str(corpora["c"])}], "context": T, "seed": 5})
    np.testing.assert_array_equal(one.windows("train", w), task.windows("train", w))
    assert not one.is_mixture and one.source_names == ["c"]


# ---------------------------------------------------------------------------------------------- caps
def test_repetition_cap_is_respected_and_checked(corpora):
    task = mix(corpora, (0.5, 0.5), caps={"a": 1})
    S = task.source_table()["a"]["train_windows"]
    assert task.capacity(0) == S and task.source_table()["a"]["capacity"] == S and task.capacity(1) is None
    # the naive extent: 1 + the largest own window of source a among windows [0, n)
    probe = build_task(
        "text", {**task.cfg, "sources": {**task.cfg["sources"], "a": {**task.cfg["sources"]["a"], "max_epochs": None}}}
    )
    src, k, _ = probe.locate("train", np.arange(4 * S))
    ext = np.maximum.accumulate(np.where(src == 0, k + 1, 0))  # ext[n-1] = extent of [0, n)
    n_ok = int(np.searchsorted(ext, S, side="right"))  # the longest run the cap supplies
    assert ext[n_ok - 1] == S and ext[n_ok] == S + 1
    task.check_run(n_ok)
    with pytest.raises(ConfigError) as e:
        task.check_run(n_ok + 1)
    assert e.value.key == "task.sources.a.max_epochs" and "epochs" in e.value.allowed
    # within the cap source a never repeats a slot (numpy-read shards); beyond it the stream refuses
    shards = read_split(corpora["a"], "train")[1]
    toks = task.gather("train", np.arange(n_ok))
    a_rows = toks["tokens"][toks["source"] == 0]
    assert len({slot_of(x, shards) for x in a_rows}) == len(a_rows) == S
    with pytest.raises(ValueError, match="cap"):
        task.windows("train", [n_ok])
    assert task.source_windows(n_ok).tolist()[0] == S


# ---------------------------------------------------------------------------------------------- resume
def _steps(stream, n, workers=0):
    it = iter(DataLoader(stream, batch_size=None, num_workers=workers))
    return [next(it) for _ in range(n)]


def _global(task, world, batch, start, n, doc=False, workers=0):
    """Global batches of steps [start, start+n) at ``world`` ranks of ``batch // world`` windows each (the rank
    slices concatenated), each rank resumed from a state_dict."""
    per_rank = []
    for r in range(world):
        s = task.make_stream("train", window=T, batch_size=batch // world, seed=5, rank=r, world_size=world)
        s.load_state_dict({"step": start})
        per_rank.append(_steps(s, n, workers))
    return [{k: torch.cat([per_rank[r][i][k] for r in range(world)]) for k in per_rank[0][i]} for i in range(n)]


@pytest.mark.parametrize("after", [1, 3])
def test_resume_at_another_world_size(corpora, after):
    """Steps 0-3 at 2 ranks, then steps 4-7 resumed at ``after`` ranks (one with 2 DataLoader workers): the global
    sequence of windows (tokens, sources, doc_ids) equals one rank's uninterrupted stream."""
    task = mix(corpora, doc_mask=True)
    ref = _steps(task.make_stream("train", window=T, batch_size=6, seed=5), 8)
    got = _global(task, 2, 6, 0, 4) + _global(task, after, 6, 4, 4, workers=2 if after == 1 else 0)
    for x, y in zip(ref, got):
        assert x.keys() == y.keys() == {"tokens", "loss_mask", "answer_id", "group", "source", "doc_ids"}
        for key in x:
            assert torch.equal(x[key], y[key]), key
    assert set(torch.cat([b["source"] for b in ref]).tolist()) == {0, 1}


# ---------------------------------------------------------------------------------------------- doc_ids
@pytest.mark.parametrize("which", ["alone", "mixture"])
def test_doc_ids_match_a_naive_scan_of_the_offsets(corpora, which):
    task = alone(corpora["c"], doc_mask=True) if which == "alone" else mix(corpora, doc_mask=True)
    dirs = [s["data_dir"] for s in task.sources]
    for split in ("train", "val"):
        g = task.gather(split, np.arange(40), doc_ids=True)
        assert g["doc_ids"].dtype == np.int32 and g["doc_ids"].shape == (40, T)
        for r in range(40):
            d = dirs[g["source"][r]]
            meta = json.loads((d / "meta.json").read_text())
            shards = [
                np.fromfile(d / sh["file"], dtype=meta["dtype"]).astype(np.int64)
                for sh in meta["splits"][split]["shards"]
            ]
            k, s0 = slot_of(g["tokens"][r], shards)
            starts = set(np.load(d / meta["splits"][split]["shards"][k]["index"])[:, 1].tolist())
            doc, want = 0, []
            for t in range(T):
                if t > 0 and s0 + t in starts:
                    doc += 1
                want.append(doc)
            assert g["doc_ids"][r].tolist() == want
    assert (g["doc_ids"].max(1) > 0).any()  # some rows cross a document start
    b = task.make_stream("val", window=T, batch_size=3, seed=5, num_steps=1).batch(0)
    np.testing.assert_array_equal(b["doc_ids"].numpy(), task.gather("val", np.arange(3), doc_ids=True)["doc_ids"])
    assert "doc_ids" not in mix(corpora).make_stream("train", window=T, batch_size=2, seed=5).batch(0)


# ---------------------------------------------------------------------------------------------- refusals
def test_bad_mixtures_are_one_config_error(corpora, tmp_path):
    a, b = str(corpora["a"]), str(corpora["b"])

    def err(cfg, key):
        with pytest.raises(ConfigError) as e:
            build_task("text", {"context": T, **cfg})
        assert e.value.key == key, e.value
        return e.value.allowed

    two = lambda wa, wb: {"a": {"data_dir": a, "weight": wa}, "b": {"data_dir": b, "weight": wb}}
    err({"data_dir": a, "sources": two(1, 1)}, "task.sources")
    err({"sources": two(0, 1)}, "task.sources.a.weight")
    err({"sources": two(-1, 1)}, "task.sources.a.weight")
    err({"sources": two("abc", 1)}, "task.sources.a.weight")
    err({"sources": two(True, 1)}, "task.sources.a.weight")
    err({"sources": two(float("nan"), 1)}, "task.sources.a.weight")
    err({"sources": two(1e-9, 1)}, "task.sources.a.weight")  # below 1 / MIX_BLOCK of the total
    err({"sources": {"a": {"data_dir": a}, "b": {"data_dir": b, "weight": 1}}}, "task.sources.a.weight")
    err({"sources": {"a": {"data_dir": a, "weight": 1}, "b": {"data_dir": a, "weight": 1}}}, "task.sources.b.data_dir")
    err({"sources": [{"data_dir": a, "weight": 1}, {"data_dir": a, "weight": 1, "name": "a"}]}, "task.sources.1")
    err({"sources": {"a": {"data_dir": a, "weight": 1}, "b": {"weight": 1}}}, "task.sources.b.data_dir")
    err(
        {"sources": {"a": {"data_dir": a, "weight": 1}, "b": {"data_dir": str(tmp_path / "no"), "weight": 1}}},
        "task.sources.b.data_dir",
    )
    assert "tokenizer" in err(
        {"sources": {"a": {"data_dir": a, "weight": 1}, "o": {"data_dir": str(corpora["other"]), "weight": 1}}},
        "task.sources.o.data_dir",
    )
    err({"sources": {**two(1, 1), "a": {"data_dir": a, "weight": 1, "colour": 2}}}, "task.sources.a.colour")
    err({"sources": {"a/b": {"data_dir": a, "weight": 1}}}, "task.sources.a/b")
    err({"sources": {**two(1, 1), "b": {"data_dir": b, "weight": 1, "max_epochs": 0}}}, "task.sources.b.max_epochs")
    err(
        {"sources": {**two(1, 1), "b": {"data_dir": b, "weight": 1, "max_epochs": 1e-6}}}, "task.sources.b.max_epochs"
    )  # gives no window
    err({"sources": two(1, 1), "mix": "concat"}, "task.sources.a.weight")
    err({"sources": two(1, 1), "mix": "zip"}, "task.mix")
    err({"sources": [], "data_dir": None}, "task.sources")
    err({"sources": "a,b"}, "task.sources")
    err({"sources": two(1, 1), "doc_mask": "yes"}, "task.doc_mask")
    err({"sources": two(1, 1), "context": 10**6}, "task.context")  # too short for the context


# ---------------------------------------------------------------------------------------------- metrics
def test_validation_loss_per_source_through_the_module(corpora):
    """LMModule's evaluation over a mixture's val stream: val/<source>/loss equals the mean cross-entropy of the
    model on that source's own val windows (F.cross_entropy, source alone)."""
    from canonlm.arch.config import build_model_config
    from canonlm.train.module import LMModule

    task = mix(corpora)
    mcfg = build_model_config(
        dict(arch="llama", n_heads=2, vocab_size=task.vocab_size, n_layers=1, d_model=32, max_seq_len=T),
        {"set": ""},
        {"type": "rope"},
    )
    torch.manual_seed(0)
    module = LMModule(
        mcfg,
        optimizer=lambda g: torch.optim.AdamW(g),
        sched={"name": "constant"},
        total_steps=1,
        loss={"z_loss": "none"},
        num_groups=1,
        task=task,
    )
    module.model.eval()
    with torch.no_grad():
        for i, b in enumerate(task.make_stream("val", window=T, batch_size=4, seed=5, num_steps=3)):
            module.validation_step(b, i)
        module._eval_end("val")
        res = module.results["val"]["sources"]
        for name in ("a", "b"):  # windows 0..5 of each source alone (12 mixture windows, in turn)
            x = torch.from_numpy(alone(corpora[name]).windows("val", np.arange(6)))
            logits = module.model(x)
            want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
            assert res[name]["loss"] == pytest.approx(float(want), rel=1e-5)
            assert res[name]["tokens"] == 6 * (T - 1)


def _compose_mix(corpora, out, extra):
    from conftest import compose

    src = "{" + ",".join(f"{n}:{{data_dir:'{corpora[n]}',weight:{w}}}" for n, w in (("a", 0.7), ("b", 0.3))) + "}"
    return compose(
        [
            "task=text",
            "task.data_dir=null",
            f"task.sources={src}",
            f"task.context={T}",
            "model.size=1L32D",
            "model.n_heads=2",
            "canon=none",
            "data.batch_size=4",
            "data.val_windows=8",
            "data.test_windows=8",
            "trainer.log_every_n_steps=2",
            "trainer.val_check_interval=4",
            "logger=none",
            "callbacks=default",
            "callbacks.progress.force=lines",
            *extra,
        ],
        output_dir=out,
    )


def test_token_budget_resolves_steps_and_refuses_both_or_neither(corpora, tmp_path):
    from omegaconf import open_dict

    from canonlm.train.run import check_job

    cfg = _compose_mix(corpora, tmp_path / "r", ["trainer.max_steps=null", "+data.max_tokens=1000"])
    check_job(cfg, device_checks=False)
    assert cfg.trainer.max_steps == math.ceil(1000 / (4 * T)) == 16
    for extra, key in (
        (["+data.max_tokens=1000"], "data.max_tokens"),  # and the default max_steps
        (["trainer.max_steps=null"], "trainer.max_steps"),
        (["trainer.max_steps=null", "+data.max_tokens=0"], "data.max_tokens"),
        (["trainer.max_steps=null", "+data.max_tokens=abc"], "data.max_tokens"),
    ):
        cfg = _compose_mix(corpora, tmp_path / "r", extra)
        with pytest.raises(ConfigError) as e:
            check_job(cfg, device_checks=False)
        assert e.value.key == key, e.value
    assert not (tmp_path / "r").exists()  # nothing written
    # a cap that cannot supply the run's length is refused before it starts
    cfg = _compose_mix(corpora, tmp_path / "r", ["trainer.max_steps=null", "+data.max_tokens=1e6"])
    with open_dict(cfg):
        cfg.task.sources.b.max_epochs = 1
    with pytest.raises(ConfigError) as e:
        check_job(cfg, device_checks=False)
    assert e.value.key == "task.sources.b.max_epochs" and "data.max_tokens=1e+06" in e.value.allowed


def test_mixture_run_with_token_budget_logs_tokens_per_source_across_a_resume(corpora, tmp_path):
    """A tiny model trained in-process on a 70/30 mixture for a token budget of 6 steps (checkpoint at 4), then
    resumed to 8 steps: results.json and metrics.jsonl record the tokens seen, in all and per source (a naive count
    of the sources of the windows consumed), and a validation loss per source."""
    from canonlm.train.run import run

    out = tmp_path / "run"
    per_step = 4 * T
    first = run(
        _compose_mix(
            corpora,
            out,
            [
                "trainer.max_steps=null",
                f"+data.max_tokens={6 * per_step - 5}",
                "callbacks.checkpoint.every_n_train_steps=4",
                "test=false",
            ],
        )
    )
    assert first["steps"] == 6 and first["tokens_seen"] == 6 * per_step and first["max_tokens"] == 6 * per_step - 5
    res = run(_compose_mix(corpora, out, ["trainer.max_steps=8", "ckpt_path=auto"]))
    assert res["steps"] == 8 and res["tokens_seen"] == 8 * per_step and res["attempts"] == 2
    task = mix(corpora, seed=0)  # the run's task (task.seed: 0)
    naive = lambda steps: np.bincount(task.locate("train", np.arange(steps * 4))[0], minlength=2) * T
    assert [res["sources"][n]["tokens_seen"] for n in ("a", "b")] == naive(8).tolist()
    assert res["sources"]["a"]["share"] == pytest.approx(0.7, abs=1e-4)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # optimizer step s is logged at Lightning's global_step s - 1 (the step being completed)
    logged = {r["step"] + 1: r for r in rows if "train/tokens/a" in r}
    assert set(logged) == {2, 4, 6, 8}  # every 2 steps; 6 ends the first attempt, 8 is after the resume
    for step, r in logged.items():
        assert [r["train/tokens/a"], r["train/tokens/b"]] == naive(step).tolist()
        assert r["train/tokens/a"] + r["train/tokens/b"] == r["perf/tokens_seen"] == step * per_step
    val = [r for r in rows if "val/a/loss" in r]
    assert val and all(math.isfinite(r["val/a/loss"]) and math.isfinite(r["val/b/loss"]) for r in val)
    assert set(res["val"]["sources"]) == {"a", "b"} and set(res["test"]["sources"]) == {"a", "b"}


def test_a_text_checkpoint_from_before_mixtures_resumes(corpora, tmp_path):
    """A one-corpus run whose checkpoint's task config lacks sources / mix / doc_mask (written before they existed)
    resumes while they hold their defaults; doc_mask=true is still a difference and refused."""
    from conftest import compose

    from canonlm.train.checkpoint import CheckpointError
    from canonlm.train.run import run

    out = tmp_path / "run"
    base = [
        "task=text",
        f"task.data_dir={corpora['c']}",
        f"task.context={T}",
        "model.size=1L32D",
        "model.n_heads=2",
        "canon=none",
        "data.batch_size=2",
        "data.val_windows=2",
        "data.test_windows=2",
        "test=false",
        "logger=none",
        "callbacks=default",
        "callbacks.progress.force=lines",
        "trainer.val_check_interval=2",
    ]
    run(compose([*base, "trainer.max_steps=2"], output_dir=out))
    ck = out / "checkpoints" / "last.ckpt"
    state = torch.load(ck, weights_only=False)
    for k in ("sources", "mix", "doc_mask"):
        del state["canonlm"]["task"][k]
    torch.save(state, ck)
    with pytest.raises(CheckpointError, match="doc_mask"):
        run(compose([*base, "trainer.max_steps=3", "ckpt_path=auto", "task.doc_mask=true"], output_dir=out))
    assert run(compose([*base, "trainer.max_steps=3", "ckpt_path=auto"], output_dir=out))["steps"] == 3


def test_doc_mask_run_hands_each_batch_doc_ids_to_the_model(corpora, tmp_path, monkeypatch):
    """``task.doc_mask=true`` end to end in a tiny in-process run: every forward of training and validation gets the
    batch's ``doc_ids`` (oracle: a naive scan of the windows' document offsets, as above), and the model's logits are
    the document-masked ones (CanonLM.forward's doc_ids path, checked against each document alone in
    tests/test_doc_mask.py)."""
    from canonlm.arch.model import CanonLM
    from canonlm.train.run import run

    seen: list[tuple[torch.Size, torch.Tensor | None]] = []
    forward = CanonLM.forward

    def spy(self, input_ids=None, cache=None, **kw):
        if cache is None and input_ids is not None and input_ids.dim() == 2:
            d = kw.get("doc_ids")
            seen.append((input_ids.shape, None if d is None else d.detach().clone()))
        return forward(self, input_ids, cache, **kw)

    monkeypatch.setattr(CanonLM, "forward", spy)
    steps = 6
    res = run(
        _compose_mix(
            corpora,
            tmp_path / "run",
            [
                f"trainer.max_steps={steps}",
                "task.doc_mask=true",
                "test=false",
                "trainer.num_sanity_val_steps=0",
                f"trainer.val_check_interval={steps}",
            ],
        )
    )
    assert res["steps"] == steps
    assert res["doc_mask"] is True  # results.json says document masking was on (hparams.json: resolved.doc_mask)
    assert json.loads((tmp_path / "run" / "hparams.json").read_text())["resolved"]["doc_mask"] is True
    assert all(d is not None and d.shape == s and d.dtype == torch.int32 for s, d in seen)
    task = mix(corpora, seed=0, doc_mask=True)
    stream = task.make_stream("train", window=T, batch_size=4, seed=0)
    want = [torch.as_tensor(stream.batch(i)["doc_ids"]) for i in range(steps)]
    assert [torch.equal(d.cpu(), w) for (_, d), w in zip(seen[:steps], want)] == [True] * steps
    # some training window holds more than one document, so the mask is not trivially one document per row
    assert any(int(w.max()) > 0 for w in want)
    assert len(seen) > steps  # validation's forwards got their doc_ids too
