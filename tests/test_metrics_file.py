"""metrics.jsonl read back across resumes: later attempts win per (step, metric), torn lines skipped and counted."""

import math

from canonlm.train.metrics_file import metric_series, read_metrics

# Attempt 1 checkpoints at step 20, trains to 40 and is killed while writing its step-40 validation line.
# Attempt 2 resumes from step 20 (redoes 30 and 40), appending right after the torn fragment (no newline in
# between), and is killed after step 60. Attempt 3 resumes from step 50, redoes 60, and is killed while writing
# its step-70 validation line (the file ends in a truncated line).
FILE = (
    '{"step": 10, "time": 1001.0, "train/loss": 4.0, "lr-AdamW": 0.001}\n'
    '{"step": 20, "time": 1002.0, "train/loss": 3.5, "lr-AdamW": 0.002}\n'
    '{"step": 20, "time": 1002.5, "val/loss": 3.6, "val/acc": 0.1}\n'
    '{"step": 30, "time": 1003.0, "train/loss": 3.0, "lr-AdamW": 0.002}\n'
    '{"step": 40, "time": 1004.0, "train/loss": "nan", "lr-AdamW": 0.002}\n'
    '{"step": 40, "time": 1004.5, "val/lo'
    '{"step": 30, "time": 2003.0, "train/loss": 3.1, "lr-AdamW": 0.002}\n'
    '{"step": 40, "time": 2004.0, "train/loss": 2.9, "lr-AdamW": 0.002}\n'
    '{"step": 40, "time": 2004.5, "val/loss": 3.0, "val/acc": 0.2}\n'
    '{"step": 50, "time": 2005.0, "train/loss": "inf", "lr-AdamW": 0.001}\n'
    '{"step": 60, "time": 2006.0, "train/loss": 2.5, "lr-AdamW": 0.001}\n'
    '{"step": 60, "time": 2006.5, "val/loss": 2.7, "val/acc": 0.3}\n'
    "\n"
    '{"step": 60, "time": 3006.0, "train/loss": 2.4, "lr-AdamW": 0.001}\n'
    '{"step": 70, "time": 3007.0, "train/loss": "nan", "lr-AdamW": 0.0005}\n'
    '{"step": 70, "time": 3007.5, "val/loss": 2.8, "val/ac'
)

NAN = "NAN"  # placeholder in the expected rows below (NaN != NaN)
EXPECTED = [
    {"step": 10, "time": 1001.0, "train/loss": 4.0, "lr-AdamW": 0.001},
    {"step": 20, "time": 1002.5, "train/loss": 3.5, "lr-AdamW": 0.002, "val/loss": 3.6, "val/acc": 0.1},
    {"step": 30, "time": 2003.0, "train/loss": 3.1, "lr-AdamW": 0.002},  # the redo wins
    {"step": 40, "time": 2004.5, "train/loss": 2.9, "lr-AdamW": 0.002, "val/loss": 3.0, "val/acc": 0.2},
    {"step": 50, "time": 2005.0, "train/loss": math.inf, "lr-AdamW": 0.001},
    {"step": 60, "time": 3006.0, "train/loss": 2.4, "lr-AdamW": 0.001, "val/loss": 2.7, "val/acc": 0.3},
    {"step": 70, "time": 3007.0, "train/loss": NAN, "lr-AdamW": 0.0005},  # torn val line dropped
]


def _same(got, want):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert set(g) == set(w), (g, w)
        for k, v in w.items():
            if v == NAN:
                assert isinstance(g[k], float) and math.isnan(g[k]), (k, g)
            else:
                assert g[k] == v and type(g[k]) is type(v), (k, g[k], v)


def test_resumed_file_merges_last_attempt_and_skips_torn_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(FILE)
    rows = read_metrics(p)
    _same(rows, EXPECTED)
    assert rows.skipped == 2  # the fragment glued to attempt 2's first line, and the truncated last line
    assert metric_series(rows, "val/acc") == ([20, 40, 60], [0.1, 0.2, 0.3])
    steps, loss = metric_series(rows, "train/loss")
    assert steps == [10, 20, 30, 40, 50, 60, 70]
    assert loss[:6] == [4.0, 3.5, 3.1, 2.9, math.inf, 2.4] and math.isnan(loss[6])
    assert metric_series(rows, "absent") == ([], [])


def test_whole_row_without_newline_and_invalid_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(
        '{"step": 1, "time": 1.0, "a": 1.0}'  # complete, but its newline was never written
        '{"step": 1, "time": 2.0, "a": 2.0}\n'  # ... and the next attempt's row is glued to it
        "not json\n"
        "[1, 2]\n"
        '{"step": null, "time": 3.0, "a": 3.0}\n'  # not a row of a step
        '{"step": 2, "time": 4.0, "a": "-inf", "b": 0}\n'
    )
    rows = read_metrics(p)
    _same(rows, [{"step": 1, "time": 2.0, "a": 2.0}, {"step": 2, "time": 4.0, "a": -math.inf, "b": 0}])
    assert rows.skipped == 3


def test_empty_file(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("")
    rows = read_metrics(p)
    assert rows == [] and rows.skipped == 0
