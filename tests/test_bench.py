"""The benchmarks' own arithmetic: the memory measure (the peak of the allocator's events, exact
to the byte) and the time-to-train totals and their repeated rounds."""

import torch

from benchmarks.time_to_train import rounds, summarize
from benchmarks.worker import tensor_peak_mb

MB = 2**20


def test_tensor_peak_counts_what_is_alive_at_once():
    def fn():
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(MB // 2, dtype=torch.uint8)
        del b, c

    assert tensor_peak_mb(fn) == 3.0


def _row(mode, times, rnd=0, **extra):
    return {"workload": "w", "mode": mode, "status": "ok", "round": rnd, "steps": [dict(s=t, **extra) for t in times]}


def test_time_to_train_totals_and_rounds():
    data = {
        "steps": 3,
        "target_seconds": 2.0,
        "rows": [
            _row("eager", [1.0, 1.0, 1.0, 1.0]),  # N15 here: 2 steps to reach 2.0 s
            _row("ours", [2.0, 1.0, 1.0], eager_while_compiling=1),
            _row("ours", [1.5, 1.0, 1.0], rnd=1),  # later rounds: not in the main table
            _row("eager", [1.0, 1.0, 2.0], rnd=1),
        ],
    }
    rows = summarize(data)
    assert [r["mode"] for r in rows] == ["eager", "ours"]
    ours = rows[1]
    assert ours["n_target"] == 2 and ours["totals"]["2"]["total_s"] == 3.0 and ours["totals"]["3"]["vs_eager"] == 4.0 / 3.0
    assert ours["steps_while_compiling"] == 2 and ours["compiled_from_step"] is None
    rep = rounds(data, {"w": [2, 3]})["w"]
    assert [r["round"] for r in rep["rounds"]] == [0, 1]
    assert rep["rounds"][1]["vs_eager"]["ours"] == {2: 1.25, 3: 3.5 / 4.0}
    assert rep["median_vs_eager"]["ours 3"] == (4.0 / 3.0 + 3.5 / 4.0) / 2
    assert rep["range_vs_eager"]["ours 2"] == [1.25, 1.5]
