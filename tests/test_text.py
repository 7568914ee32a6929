"""Real-text pretraining: ``python -m canonlm.data.prepare`` and the ``text`` task / TextStream.

Oracles: documents re-read from the fixture and tokenized directly with the ``tokenizers`` library; shards read back
with numpy from the documented layout (not through the package); the split hash recomputed with a pure-Python
SplitMix64; window membership checked by brute-force search in the split's shards; stream identities (worker count,
world size, resume)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from canonlm.data import ConfigError
from canonlm.data.prepare import main as prepare_main
from canonlm.data.seeding import stable_hash64
from canonlm.data.tasks import build_task
from canonlm.data.text import TextStream, feistel_permute

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "corpus.txt"
M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


# ---------------------------------------------------------------------------------------------- fixtures
def train_bpe(path: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer trained on the fixture corpus (exact decode round trip), with </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], tr)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def raw_tok(tok_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_path))


def documents() -> list[str]:
    """The fixture's documents (one per non-empty line), read independently of the package."""
    return [ln for ln in CORPUS.read_text().split("\n") if ln.strip()]


def prep(args: list[str]) -> int:
    return prepare_main([*args, "--quiet"])


def prepare_fixture(root: Path, tok_path: Path | None = None, shard_tokens: int = 600) -> Path:
    """Prepare the fixture corpus under ``root`` (training a tokenizer there if none is given); returns the prepared
    directory (usable as ``task.data_dir`` with ``task.context`` <= 64)."""
    root.mkdir(parents=True, exist_ok=True)
    tok_path = tok_path or train_bpe(root / "tokenizer.json")
    out = root / "corpus"
    assert (
        prep(
            [
                "--input",
                str(CORPUS),
                "--tokenizer",
                str(tok_path),
                "--out",
                str(out),
                "--append-eos",
                "--val-fraction",
                "0.15",
                "--test-fraction",
                "0.15",
                "--shard-tokens",
                str(shard_tokens),
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok_path) -> Path:
    return prepare_fixture(tmp_path_factory.mktemp("prep"), tok_path)


def read_split(d: Path, split: str) -> tuple[dict[int, np.ndarray], list[np.ndarray]]:
    """{doc index: ids} and the raw shard arrays of a split, from meta.json + .bin + .idx.npy (documented layout)."""
    meta = json.loads((d / "meta.json").read_text())
    docs, shards = {}, []
    for sh in meta["splits"][split]["shards"]:
        arr = np.fromfile(d / sh["file"], dtype=meta["dtype"]).astype(np.int64)
        idx = np.load(d / sh["index"])
        assert arr.shape[0] == sh["tokens"] and idx.shape == (sh["documents"], 2)
        for r, (i, s) in enumerate(idx):
            e = idx[r + 1, 1] if r + 1 < len(idx) else arr.shape[0]
            docs[int(i)] = arr[s:e]
        shards.append(arr)
    return docs, shards


def mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def split_u(seed: int, i: int) -> float:
    """u_i of the documented split rule, in pure Python."""
    ns = stable_hash64("canonlm-text-split", seed)
    key = mix64((mix64(ns & M64) + i * G) & M64)
    return (key >> 11) * 2.0**-53


# ---------------------------------------------------------------------------------------------- prepare
def test_prepare_round_trip_eos_and_splits(prepared, raw_tok):
    meta = json.loads((prepared / "meta.json").read_text())
    docs = documents()
    eos = raw_tok.token_to_id("</s>")
    assert meta["eos_id"] == eos and meta["vocab_size"] == raw_tok.get_vocab_size() and meta["dtype"] == "uint16"
    assert meta["documents"] == len(docs) and meta["append_eos"] is True
    got: dict[int, tuple[str, np.ndarray]] = {}
    for split in ("train", "val", "test"):
        d, shards = read_split(prepared, split)
        for i, ids in d.items():
            assert i not in got, f"document {i} in two splits"
            got[i] = (split, ids)
        # a shard is its documents back to back, each ending with EOS
        for arr in shards:
            assert arr[-1] == eos
        assert len(d) == meta["splits"][split]["documents"] > 0
    assert sorted(got) == list(range(len(docs)))
    for i, text in enumerate(docs):
        split, ids = got[i]
        assert ids[-1] == eos and eos not in ids[:-1]
        assert ids[:-1].tolist() == raw_tok.encode(text, add_special_tokens=False).ids
        assert raw_tok.decode(ids[:-1].tolist()) == text
        u = split_u(0, i)
        want = "val" if u < 0.15 else "test" if u < 0.30 else "train"
        assert split == want, (i, u, split)
    assert sum(sh["tokens"] for s in meta["splits"].values() for sh in s["shards"]) == meta["tokens"]
    assert meta["tokenizer"]["sha256"] and Path(meta["tokenizer"]["path"]).is_file()


def test_prepare_formats_agree_and_uint32(tmp_path, tok_path):
    docs = documents()
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as f:
        for d in docs[:10]:
            f.write(json.dumps({"body": d}) + "\n\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs[10:]}), tmp_path / "in" / "b.parquet")
    common = ["--tokenizer", str(tok_path), "--val-fraction", "0.15", "--test-fraction", "0.15", "--append-eos"]
    assert prep(["--input", str(tmp_path / "in"), "--text-key", "body", "--out", str(tmp_path / "o1"), *common]) == 0
    assert prep(["--input", str(CORPUS), "--out", str(tmp_path / "o2"), *common]) == 0
    for split in ("train", "val", "test"):
        a, _ = read_split(tmp_path / "o1", split)
        b, _ = read_split(tmp_path / "o2", split)
        assert a.keys() == b.keys() and all(np.array_equal(a[i], b[i]) for i in a)
    # a word-level vocabulary above 2**16 ids -> uint32 shards holding ids >= 65536
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for d in docs for w in d.split()})
    vocab = {"<unk>": 0, "</s>": 1, **{f"x{i}": i + 2 for i in range(70_000)}}
    vocab.update({w: 70_002 + j for j, w in enumerate(words)})
    wl = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wl.save(str(tmp_path / "wl.json"))
    assert (
        prep(
            [
                "--input",
                str(CORPUS),
                "--tokenizer",
                str(tmp_path / "wl.json"),
                "--out",
                str(tmp_path / "o3"),
                "--val-fraction",
                "0.15",
                "--test-fraction",
                "0.15",
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "o3" / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["eos_id"] == 1
    got = {}
    for split in ("train", "val", "test"):
        got.update(read_split(tmp_path / "o3", split)[0])
    for i, d in enumerate(docs):  # no --append-eos: documents are exactly their words
        assert got[i].tolist() == [vocab[w] for w in d.split()]


def test_prepare_tiny_corpus_fallback_and_text_units(tmp_path, tok_path):
    f = tmp_path / "three.txt"
    f.write_text("First document here.\n\nSecond one, two lines\ncontinued.\n\nThird.\n")
    assert (
        prep(
            [
                "--input",
                str(f),
                "--tokenizer",
                str(tok_path),
                "--out",
                str(tmp_path / "p"),
                "--text-unit",
                "paragraph",
                "--val-fraction",
                "0.001",
                "--test-fraction",
                "0.001",
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["documents"] == 3
    assert [meta["splits"][s]["documents"] for s in ("train", "val", "test")] == [1, 1, 1]
    # fallback: val takes the smallest u, test the next (all u >> 0.002 here)
    us = sorted(range(3), key=lambda i: split_u(0, i))
    assert all(split_u(0, i) >= 0.002 for i in range(3))
    assert set(read_split(tmp_path / "p", "val")[0]) == {us[0]}
    assert set(read_split(tmp_path / "p", "test")[0]) == {us[1]}
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok_path))
    (d2,) = read_split(tmp_path / "p", "val")[0].values()
    paras = ["First document here.", "Second one, two lines\ncontinued.", "Third."]
    assert t.decode(d2.tolist()) == paras[us[0]]
    assert (
        prep(
            [
                "--input",
                str(f),
                "--tokenizer",
                str(tok_path),
                "--out",
                str(tmp_path / "q"),
                "--text-unit",
                "file",
                "--val-fraction",
                "0",
                "--test-fraction",
                "0",
            ]
        )
        == 0
    )
    (d,) = read_split(tmp_path / "q", "train")[0].values()
    assert t.decode(d.tolist()) == f.read_text()


def test_prepare_errors_and_overwrite(tmp_path, tok_path, capsys):
    out = tmp_path / "o"
    assert prep(["--input", str(tmp_path / "missing.txt"), "--tokenizer", str(tok_path), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert prep(["--input", str(CORPUS), "--tokenizer", str(tmp_path / "nope.json"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    assert prep(["--input", str(bad), "--tokenizer", str(tok_path), "--out", str(out)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".o.tmp-*"))  # nothing half-written
    from tokenizers import Tokenizer, models

    noeos = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    noeos.save(str(tmp_path / "noeos.json"))
    assert (
        prep(["--input", str(CORPUS), "--tokenizer", str(tmp_path / "noeos.json"), "--out", str(out), "--append-eos"])
        == 2
    )
    assert "--eos-token" in capsys.readouterr().err
    args = ["--input", str(CORPUS), "--tokenizer", str(tok_path), "--out", str(out), "--val-fraction", "0.2"]
    assert prep(args) == 0
    before = (out / "meta.json").read_text()
    assert prep(args) == 2 and "--force" in capsys.readouterr().err
    assert (out / "meta.json").read_text() == before
    assert prep([*args, "--seed", "5", "--force"]) == 0
    assert json.loads((out / "meta.json").read_text())["split_rule"]["seed"] == 5
    assert not list(tmp_path.glob(".o.*"))


def test_a_folder_of_unknown_suffixes_names_format_text(tmp_path, tok_path, capsys):
    """A folder of source files (no .txt / .jsonl / .parquet) is refused in one line that names what it holds and
    the way out, ``--format text``; with it the same folder is prepared (each file read as text)."""
    src = tmp_path / "code"
    src.mkdir()
    for i in range(3):
        (src / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(40)))
    out = tmp_path / "o"
    assert prep(["--input", str(src), "--tokenizer", str(tok_path), "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "holds no file with a known suffix" in line and ".py files" in line and "--format text" in line
    assert not out.exists()
    assert prep(["--input", str(src), "--tokenizer", str(tok_path), "--out", str(out), "--format", "text"]) == 0
    assert (out / "meta.json").exists()


def _tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (relative path -> bytes), read directly."""
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("canonlm.data.prepare: error: "), err
    return lines[0]


def test_force_never_deletes_a_foreign_directory(tmp_path, tok_path, capsys):
    """Regression: ``--force`` used to delete ANY existing --out (victim/notes.txt was removed)."""
    base = ["--input", str(CORPUS), "--tokenizer", str(tok_path), "--val-fraction", "0.2", "--force"]
    cases = {
        "victim": {"notes.txt": b"my notes\n"},
        "tagless": {"meta.json": b'{"documents": 3}', "keep.bin": b"\x00\x01"},
        "othertag": {"meta.json": b'{"format": "someone-else-v1"}'},
        "badjson": {"meta.json": b"{not json", "x.txt": b"x"},
        "listjson": {"meta.json": b'["canonlm-text-v1"]'},
    }
    for name, files in cases.items():
        d = tmp_path / name
        d.mkdir()
        for rel, data in files.items():
            (d / rel).write_bytes(data)
        before = _tree(d)
        assert prep([*base, "--out", str(d)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert str(d) in line and "not a canonlm prepared corpus" in line
        assert _tree(d) == before, name  # untouched
    # a regular file as --out: refused with or without --force, left as it was
    f = tmp_path / "plain.txt"
    f.write_bytes(b"precious")
    for extra in ([], ["--force"]):
        assert prep(["--input", str(CORPUS), "--tokenizer", str(tok_path), "--out", str(f), *extra]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert str(f) in line and "not a directory" in line
        assert f.read_bytes() == b"precious"
    # an empty directory is used without --force; a prepared corpus (format tag) is replaced with --force
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        prep(["--input", str(CORPUS), "--tokenizer", str(tok_path), "--out", str(empty), "--val-fraction", "0.2"]) == 0
    )
    assert json.loads((empty / "meta.json").read_text())["format"].startswith("canonlm-text-v")
    (empty / "stale.txt").write_text("left by an older run")
    assert prep([*base, "--out", str(empty), "--seed", "7"]) == 0
    assert json.loads((empty / "meta.json").read_text())["split_rule"]["seed"] == 7
    assert not (empty / "stale.txt").exists()
    assert not list(tmp_path.glob(".*.tmp-*")) and not list(tmp_path.glob(".*.old-*"))


def _first_bad_line(data: bytes) -> int:
    """1-based number of the first line (split at b"\\n") that is not valid UTF-8 -- a naive oracle."""
    for n, ln in enumerate(data.split(b"\n"), 1):
        try:
            ln.decode("utf-8")
        except UnicodeDecodeError:
            return n
    raise AssertionError("all lines decode")


def test_non_utf8_input_is_a_clean_error_naming_file_and_line(tmp_path, tok_path, capsys):
    """Regression: a Latin-1 file used to crash with a raw UnicodeDecodeError traceback."""
    import gzip

    good = "A perfectly fine line of text.\n" * 3000  # > one decoder chunk, so the bad line is far from the start
    latin = (good + "Caf\u00e9 au lait, na\u00efve.\nlast line\n").encode("latin-1")
    jsonl = b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(4)) + b'{"text": "se\xf1or"}\n'
    inputs = {"latin.txt": latin, "latin.txt.gz": gzip.compress(latin), "bad.jsonl": jsonl}
    for name, data in inputs.items():
        p = tmp_path / name
        p.write_bytes(data)
        raw = gzip.decompress(data) if name.endswith(".gz") else data
        want = _first_bad_line(raw)
        assert want == (3001 if "latin" in name else 5)
        out = tmp_path / ("o_" + name.replace(".", "_"))
        assert prep(["--input", str(p), "--tokenizer", str(tok_path), "--out", str(out)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"{p}:{want}:" in line and "UTF-8" in line, line
        assert not out.exists() and not list(tmp_path.glob(".o_*"))


def test_unreadable_input_and_unwritable_output_are_clean_errors(tmp_path, tok_path, capsys):
    import os

    from canonlm.data.prepare import PrepareError, prepare

    # a corrupt .gz cannot be read
    bad_gz = tmp_path / "broken.txt.gz"
    bad_gz.write_bytes(b"this is not gzip data at all\n")
    assert prep(["--input", str(bad_gz), "--tokenizer", str(tok_path), "--out", str(tmp_path / "o1")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(bad_gz) in line and "cannot read" in line
    # a file whose read fails with an OS error (EIO)
    if Path("/proc/self/mem").exists():
        with pytest.raises(PrepareError, match=r"/proc/self/mem: cannot read"):
            prepare([Path("/proc/self/mem")], tok_path, tmp_path / "o2", fmt="text", progress=False)
    if os.geteuid() != 0:  # permissions do not stop root
        locked = tmp_path / "locked.txt"
        locked.write_text("secret\n")
        locked.chmod(0)
        try:
            assert prep(["--input", str(locked), "--tokenizer", str(tok_path), "--out", str(tmp_path / "o3")]) == 2
            line = _one_error_line(capsys.readouterr().err)
            assert str(locked) in line and "cannot read" in line
        finally:
            locked.chmod(0o600)
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert prep(["--input", str(CORPUS), "--tokenizer", str(tok_path), "--out", str(ro / "x")]) == 2
            line = _one_error_line(capsys.readouterr().err)
            assert str(ro / "x") in line and "cannot create" in line
        finally:
            ro.chmod(0o700)
    # the output folder cannot be created: a path component is a regular file
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    out = blocker / "sub" / "corpus"
    assert prep(["--input", str(CORPUS), "--tokenizer", str(tok_path), "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(out) in line and "cannot create" in line and f"{blocker} is a file" in line
    assert blocker.read_text() == "a file, not a folder"


def test_prepare_main_docstring_documents_exit_codes(tmp_path, tok_path, capsys):
    doc = prepare_main.__doc__ or ""
    assert re.search(r"\b0 = ", doc) and re.search(r"\b2 = ", doc), doc
    # ... and the codes are the ones the command really returns
    assert prep(["--input", str(CORPUS), "--tokenizer", str(tok_path), "--out", str(tmp_path / "a")]) == 0
    assert (
        prep(["--input", str(tmp_path / "none.txt"), "--tokenizer", str(tok_path), "--out", str(tmp_path / "b")]) == 2
    )
    with pytest.raises(SystemExit) as e:
        prepare_main(["--tokenizer", str(tok_path)])  # missing --input: argparse, status 2 as documented
    assert e.value.code == 2
    capsys.readouterr()


def test_transformers_tokenizer_directory(tmp_path, tok_path, raw_tok):
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    from canonlm.data.text import load_tokenizer

    PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token="</s>").save_pretrained(tmp_path / "hf")
    t = load_tokenizer(tmp_path / "hf")
    assert t.kind == "transformers" and t.eos_id == raw_tok.token_to_id("</s>") and t.vocab_size == 400
    text = documents()[3]
    assert t.encode(text) == raw_tok.encode(text, add_special_tokens=False).ids
    assert (
        prep(
            [
                "--input",
                str(CORPUS),
                "--tokenizer",
                str(tmp_path / "hf"),
                "--out",
                str(tmp_path / "p"),
                "--append-eos",
                "--val-fraction",
                "0.2",
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "transformers" and meta["eos_id"] == t.eos_id


def test_prepare_module_entry_point(tmp_path, tok_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "canonlm.data.prepare",
            "--input",
            str(CORPUS),
            "--tokenizer",
            str(tok_path),
            "--out",
            str(tmp_path / "x"),
            "--val-fraction",
            "0.2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "[prepare]" in p.stderr and "wrote" in p.stdout


# ---------------------------------------------------------------------------------------------- task + stream
T = 32


@pytest.fixture(scope="module")
def task(prepared):
    return build_task("text", {"name": "text", "data_dir": str(prepared), "context": T, "seed": 3})


def test_task_attributes(task, prepared, raw_tok):
    meta = json.loads((prepared / "meta.json").read_text())
    assert task.vocab_size == meta["vocab_size"] == raw_tok.get_vocab_size()
    assert (task.num_groups, task.group_name, task.chance, task.eval_mode) == (1, "text", None, "teacher_forced")
    assert task.max_instance_len("train") == task.min_instance_len("test") == 1
    with pytest.raises(NotImplementedError, match="make_stream"):
        task.generate("train", np.zeros(1), np.zeros(1), 0)
    t64 = build_task("text", {"data_dir": str(prepared), "context": T, "vocab_multiple": 64})
    assert t64.vocab_size == -(-meta["vocab_size"] // 64) * 64
    assert task.decode(raw_tok.encode("The lighthouse").ids) == "The lighthouse"


def _find(window: np.ndarray, shards: list[np.ndarray]) -> list[tuple[int, int]]:
    hits = []
    for k, arr in enumerate(shards):
        for s in range(0, arr.shape[0] - window.shape[0] + 1):
            if np.array_equal(arr[s : s + window.shape[0]], window):
                hits.append((k, s))
    return hits


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_windows_are_slots_of_their_split_and_cover_an_epoch(task, prepared, split):
    _, shards = read_split(prepared, split)
    S = sum(a.shape[0] // T for a in shards)
    assert task.num_windows(split) == S > 0
    win = task.windows(split, np.arange(2 * S))
    slots = []
    for w in range(S):
        hits = [h for h in _find(win[w], shards) if h[1] % T == 0 and h[1] + T <= (shards[h[0]].shape[0] // T) * T]
        assert hits, f"window {w} is not a slot of the {split} shards"
        slots.append(hits[0])
    assert len(set(slots)) == S  # one epoch = every slot once
    # the next epoch is another permutation of the same slots
    assert sorted(map(tuple, win[S : 2 * S].tolist())) == sorted(map(tuple, win[:S].tolist()))
    assert not np.array_equal(win[S : 2 * S], win[:S]) or S == 1


def test_windows_never_cross_splits(task, prepared):
    _, val = read_split(prepared, "val")
    _, train = read_split(prepared, "train")
    for w in task.windows("train", np.arange(12)):
        assert not _find(w, val)
    for w in task.windows("val", np.arange(task.num_windows("val"))):
        assert not _find(w, train)


def test_window_is_pure_function_of_seed_split_index(task, prepared):
    a = task.windows("train", [5, 0, 17], seed=3)
    b = build_task("text", {"data_dir": str(prepared), "context": T, "seed": 3}).windows("train", [17, 5])
    np.testing.assert_array_equal(a[[2, 0]], b)
    assert not np.array_equal(task.windows("train", np.arange(8), seed=4), task.windows("train", np.arange(8), seed=3))


def collect(ds, n, workers=0):
    dl = DataLoader(ds, batch_size=None, num_workers=workers)
    out = []
    for b in dl:
        out.append(b)
        if len(out) == n:
            break
    return out


def test_stream_format_workers_world_size_and_resume(task):
    s = task.make_stream("train", window=T, batch_size=3, seed=3)
    assert isinstance(s, TextStream)
    ref = collect(s, 6)
    b = ref[0]
    assert b["tokens"].shape == (3, T) and b["tokens"].dtype == torch.int64
    assert b["loss_mask"].dtype == torch.bool and not b["loss_mask"][:, 0].any() and b["loss_mask"][:, 1:].all()
    assert b["answer_id"].dtype == torch.int32 and (b["answer_id"] == -1).all()
    assert b["group"].dtype == torch.int32 and (b["group"] == 0).all()
    for st, bt in enumerate(ref):  # step s = windows [3s, 3s+3)
        np.testing.assert_array_equal(bt["tokens"].numpy(), task.windows("train", np.arange(3 * st, 3 * st + 3), T, 3))
    two = collect(task.make_stream("train", window=T, batch_size=3, seed=3), 6, workers=2)
    for x, y in zip(ref, two):
        assert torch.equal(x["tokens"], y["tokens"])
    # world size 3 with per-rank batch 1: concatenated rank slices == the world-size-1 batch
    for step in range(2):
        parts = [
            task.make_stream("train", window=T, batch_size=1, seed=3, rank=r, world_size=3).batch(step)["tokens"]
            for r in range(3)
        ]
        assert torch.equal(torch.cat(parts), ref[step]["tokens"])
    # resume from the cursor of an infinite stream
    s1 = task.make_stream("train", window=T, batch_size=3, seed=3)
    it = iter(s1)
    for _ in range(4):
        next(it)
    state = s1.state_dict()
    assert state == {"step": 4}
    s2 = task.make_stream("train", window=T, batch_size=3, seed=3)
    s2.load_state_dict(state)
    assert torch.equal(next(iter(s2))["tokens"], ref[4]["tokens"])
    s3 = task.make_stream("train", window=T, batch_size=3, seed=3, start_step=5)
    assert torch.equal(next(iter(s3))["tokens"], ref[5]["tokens"])
    # finite streams replay the same steps
    fin = task.make_stream("val", window=T, batch_size=2, seed=3, num_steps=3)
    assert len(fin) == 3
    a, b2 = list(fin), list(fin)
    assert len(a) == 3 and all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b2))


def test_config_errors(tmp_path, prepared):
    def err(cfg, key):
        with pytest.raises(ConfigError) as e:
            build_task("text", cfg)
        assert e.value.key == key, e.value
        return str(e.value)

    assert "prepare" in err({"data_dir": str(tmp_path / "none"), "context": T}, "task.data_dir")
    (tmp_path / "empty").mkdir()
    assert "meta.json" in err({"data_dir": str(tmp_path / "empty"), "context": T}, "task.data_dir")
    err({"data_dir": None, "context": T}, "task.data_dir")
    err({"data_dir": "???", "context": T}, "task.data_dir")
    err({"data_dir": str(prepared), "context": 10**6}, "task.context")
    err({"data_dir": str(prepared), "context": 1}, "task.context")
    err({"data_dir": str(prepared), "context": T, "tail": "carry"}, "task.tail")
    err({"data_dir": str(prepared), "context": T, "colour": 1}, "task.colour")
    err({"data_dir": str(prepared), "context": T, "seed": -1}, "task.seed")
    # a damaged shard
    import shutil

    dmg = tmp_path / "dmg"
    shutil.copytree(prepared, dmg)
    f = next(dmg.glob("train_*.bin"))
    f.write_bytes(f.read_bytes()[:-2])
    assert "bytes" in err({"data_dir": str(dmg), "context": T}, "task.data_dir")
    with pytest.raises(ConfigError):
        build_task("text", {"data_dir": str(prepared), "context": T}).make_stream(
            "train", window=T, batch_size=1, seed=0, tail="carry"
        )


def test_feistel_permutation_is_a_bijection():
    for n in (1, 2, 3, 5, 16, 17, 100, 1023, 1025, 4097):
        for key in (0, 1, 2**63 + 5):
            p = feistel_permute(np.arange(n), n, np.uint64(key))
            assert sorted(p.tolist()) == list(range(n))
    a = feistel_permute(np.arange(1000), 1000, np.uint64(1))
    b = feistel_permute(np.arange(1000), 1000, np.uint64(2))
    assert (a != b).mean() > 0.9 and (a != np.arange(1000)).mean() > 0.9
    keys = np.array([1, 2] * 500, dtype=np.uint64)  # per-element keys
    c = feistel_permute(np.arange(1000), 1000, keys)
    assert np.array_equal(c[::2], a[::2]) and np.array_equal(c[1::2], b[1::2])
