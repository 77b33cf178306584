"""Markdown tables and the PNG bar plot from the benchmark's results (a dict, as in results.json)."""

from __future__ import annotations

import math
from pathlib import Path

MODE_LABELS = {
    "eager": "eager autograd",
    "torch-ca:aot_eager": "torch CA + aot_eager",
    "torch-ca:inductor": "torch CA + inductor",
    "torch-ca:eager": "torch CA + eager",
    "ours:aot_eager": "ours + aot_eager",
    "ours:inductor": "ours + inductor",
    "ours:eager": "ours + eager",
    "ours:inductor:sync": "ours + inductor (no background compile)",
    "ours:aot_eager:sync": "ours + aot_eager (no background compile)",
}


def _section(title, text):
    return [f"## {title}", "", text, ""]


def _faults(r):
    m, e = r.get("minor_faults_per_backward"), r.get("eager_minor_faults_per_backward")
    if m is None:
        return "-"
    return f"{m:.0f} ({e:.0f})" if e is not None and r["mode"] != "eager" else f"{m:.0f}"


def _num(v, scale=1.0, digits=3, fmt=None):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    x = v * scale
    if fmt:
        return fmt.format(x)
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _diff(v):
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf (grad missing/shape)"
    return "0" if v == 0 else f"{v:.1e}"


def _compiles(r):
    s = r.get("stats") or {}
    if r["mode"] == "eager":
        return "-"
    n = s.get("compiles", "-")
    text = str(n)
    if r["mode"].startswith("ours"):
        if s.get("dynamic_captures"):
            text += f" ({s['dynamic_captures']} dynamic)"
        if s.get("disk_hits"):
            text += f" ({s['disk_hits']} loaded from disk)"
        if s.get("eager_fallbacks"):
            text += f", {s['eager_fallbacks']} eager fallbacks"
    else:
        g = s.get("dynamo_unique_graphs")
        if g is not None and g != n:
            text += f" (dynamo graphs {g})"
    return text


def _status(r):
    st = r.get("status", "?")
    if st == "ok":
        s = r.get("stats") or {}
        notes = []
        if s.get("compile_failures"):
            notes.append(f"{s['compile_failures']} background compile failed: traced graph kept")
        if s.get("eager_fallbacks"):
            notes.append(f"{s['eager_fallbacks']} eager fallbacks")
        return "ok" + (" (" + "; ".join(notes) + ")" if notes else "")
    return f"**{st}**"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _repro(r):
    cmd = r.get("command")
    if not cmd:
        return None
    return f"TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) .venv/bin/python {cmd.replace(' --result ', ' --result /tmp/r.json #')}"


def markdown(data: dict) -> str:
    m = data.get("machine", {})
    rows = data.get("rows", [])
    h2h = [r for r in rows if r.get("mode", "").startswith("h2h")]
    fixed = [r for r in rows if r.get("workload") != "stream" and r not in h2h]
    stream = [r for r in rows if r.get("workload") == "stream"]
    opts = data.get("options", {})
    lines = [
        "# Backward benchmark: eager vs torch's compiled autograd vs compiled_autograd",
        "",
        f"- Date: {data.get('date')} (finished {data.get('finished', 'not finished')}), "
        f"run time {_num((data.get('wall_s') or 0) / 60, fmt='{:.1f}')} min",
        f"- Command: `{data.get('command')}` (from the repo root)",
        f"- Machine: {m.get('cpu')}, {m.get('logical_cpus')} logical CPUs, {m.get('memory_gb')} GB RAM, "
        f"{m.get('platform')}; Python {m.get('python')}, torch {m.get('torch')}; "
        f"`torch.set_num_threads({m.get('threads')})` in every subprocess"
        + (
            ""
            if opts.get("omp_active")
            else ", with `OMP_WAIT_POLICY=PASSIVE` (OpenMP's spinning wait makes "
            "2-thread timings 10-100x slower and erratic when another process holds a core)"
        ),
        *(
            [
                f"- Device: **{opts.get('device')}** ({m.get('accelerator')}): every timed backward ends with a "
                "synchronize; no profiler floor, backward peak = device memory allocated"
            ]
            if opts.get("device", "cpu") != "cpu"
            else []
        ),
        f"- compiled_autograd at commit {m.get('git_commit')}"
        + (" (with uncommitted changes under src/)" if m.get("git_src_dirty") else ""),
        f"- Load average at start / end: {m.get('loadavg_start')} / {m.get('loadavg_end')} "
        "(the machine is shared: compare ratios, not absolute times)",
        "- Inductor cache: "
        + (
            "warm: a second process after a priming one, fixed dir"
            if opts.get("warm_cache")
            else "cold: a fresh TORCHINDUCTOR_CACHE_DIR per subprocess"
        )
        + "; "
        f"{opts.get('iters')} timed iterations after {opts.get('warmup')} warm-ups" + ("; **--quick sizes**" if opts.get("quick") else ""),
        "",
        "Modes: `eager` = plain autograd; `torch CA + B` = "
        "`with torch._dynamo.compiled_autograd._enable(torch.compile(backend=B)): loss.backward()`; "
        "`ours + B` = `with compiled_autograd.enable(backend=B): loss.backward()`.",
        "",
    ]

    # Workload descriptions
    descs = {}
    for r in rows:
        if r.get("description") and r["workload"] not in descs:
            descs[r["workload"]] = (r["description"], r.get("nodes"), r.get("num_params"))
    if descs:
        lines += ["## Workloads", ""]
        lines += [f"- **{w}**: {d} ({n} autograd nodes, {p:,} parameters)" if p else f"- **{w}**: {d}" for w, (d, n, p) in descs.items()]
        lines.append("")

    if h2h:
        lines += [
            "## Head to head in one process",
            "",
            "Mode `h2h:B`: ours (`background=False`), torch's built-in compiled autograd, both with backend B, and "
            "eager in *one* process: each compiles once, then the three alternate in blocks of "
            "4 backwards (the first of each block untimed), in a rotating order, so every ratio "
            "between them is measured under the same load and allocator state (the rows above compare "
            "torch's with ours across processes). Medians; `(min)`: the same ratio of the fastest backwards. "
            "`floor`: the eager backward's matmul/conv kernels, profiled in the same process. The first "
            "backwards are not comparable here: ours runs first and pays inductor's one-time start in the "
            "process (its import and CPU probes); the per-mode rows measure them.",
            "",
        ]
        table = []
        for r in h2h:
            table.append(
                [
                    r["workload"],
                    r["mode"].partition(":")[2],
                    _num(r.get("eager_median_s"), 1e3, digits=3),
                    _num(r.get("ours_median_s"), 1e3, digits=3),
                    _num(r.get("theirs_median_s"), 1e3, digits=3),
                    _ratio(r.get("ours_vs_eager")),
                    _ratio(r.get("theirs_vs_eager")),
                    _ratio(r.get("ours_vs_theirs")),
                    _ratio(r.get("ours_vs_theirs_min")),
                    _ratio(r.get("ours_vs_floor")),
                    _ratio(r.get("theirs_vs_floor")),
                    _num(r.get("ours_first_backward_s"), digits=3),
                    _num(r.get("theirs_first_backward_s"), digits=3),
                    f"{_diff(r.get('ours_max_grad_diff'))} / {_diff(r.get('theirs_max_grad_diff'))}",
                    _status(r),
                ]
            )
        lines += [
            _table(
                [
                    "workload",
                    "backend",
                    "eager (ms)",
                    "ours (ms)",
                    "torch CA (ms)",
                    "ours / eager",
                    "torch CA / eager",
                    "ours / torch CA",
                    "ours / torch CA (min)",
                    "ours / floor",
                    "torch CA / floor",
                    "ours first bwd (s)",
                    "torch CA first bwd (s)",
                    "max \\|Δgrad\\| ours / torch",
                    "status",
                ],
                table,
            ),
            "",
        ]

    if fixed:
        lines += [
            "## Steady state and first backward",
            "",
            "`first bwd`: the first `.backward()` in a fresh process (capture + compile). `until compiled`: "
            "the same plus, for ours + inductor, the wait for its background compile (by default ours returns "
            "from the first backward after tracing, replaying the traced graph while inductor compiles in a "
            "thread; the wait is `ca.synchronize()` right after the first backward) — this is the number to "
            "compare with torch CA's first backward. `steady`: median "
            "`.backward()` time (forward excluded), after the compile is done. `vs eager`: steady / "
            "eager-steady, where the eager backwards alternate with the mode's, in blocks, in the *same* process "
            "(for the eager row this shows the noise); `(min)`: the same ratio of the fastest backwards, "
            "less sensitive to other load on the machine. `vs floor`: steady / the floor (below). `max |Δgrad|`: over every parameter, "
            "after the first and the last backward, vs an eager backward on the same inputs. `µs/node`: "
            "steady / autograd nodes. `overhead µs/node`: (steady backward − time inside the compiled "
            "graph) / nodes, i.e. what is spent around the graph per backward. `page faults / bwd`: minor "
            "page faults per timed backward (median), the mode's and, in brackets, eager's in the same "
            "process (memory the allocator returned to the OS and must fault in again, zeroed).",
            "",
        ]
        table = []
        for r in fixed:
            table.append(
                [
                    r["workload"],
                    MODE_LABELS.get(r["mode"], r["mode"]),
                    _num(r.get("nodes")),
                    _num(r.get("first_backward_s"), digits=3),
                    _num(r.get("time_to_compiled_s") if r["mode"] != "eager" else None, digits=3),
                    _num(r.get("steady_median_s"), 1e3, digits=3),
                    _ratio(r.get("vs_eager")),
                    _ratio(r.get("vs_eager_min")),
                    _ratio(r.get("vs_floor")),
                    _compiles(r),
                    _num(r.get("peak_rss_mb"), fmt="{:.0f}"),
                    _diff(r.get("max_grad_diff")),
                    _num(r.get("per_node_us"), digits=3),
                    _num(r.get("overhead_per_node_us"), digits=3),
                    _faults(r),
                    _status(r),
                ]
            )
        lines += [
            _table(
                [
                    "workload",
                    "mode",
                    "nodes",
                    "first bwd (s)",
                    "until compiled (s)",
                    "steady (ms)",
                    "vs eager",
                    "vs eager (min)",
                    "vs floor",
                    "compiles",
                    "peak RSS (MB)",
                    "max \\|Δgrad\\|",
                    "µs/node",
                    "overhead µs/node",
                    "page faults / bwd (eager)",
                    "status",
                ],
                table,
            ),
            "",
        ]

        # Floor
        floors = {}
        for r in fixed:
            if r.get("floor_s") is not None and (r["workload"] not in floors or r["mode"] == "eager"):
                floors[r["workload"]] = r
        if floors:
            lines += [
                "## The floor",
                "",
                "Self CPU time of the matmul/conv/attention kernels alone in one eager backward "
                "(`torch.profiler`, fastest of 5; aten::mm/addmm/bmm/convolution_backward/"
                "_scaled_dot_product_*_backward ...), measured in the eager row's process. A backward cannot "
                "be faster than these kernels unless it changes them. Each mode's `vs floor` in the table above "
                "uses the floor measured in its own process.",
                "",
            ]
            t = []
            for w, r in floors.items():
                ops = ", ".join(
                    f"{k.replace('aten::', '')} {v / 1e3:.1f}" for k, v in sorted(r.get("floor_ops_us", {}).items(), key=lambda kv: -kv[1])
                )
                t.append(
                    [
                        w,
                        _num(r.get("floor_s"), 1e3),
                        _num(r.get("eager_steady_median_s"), 1e3),
                        _ratio(r.get("eager_vs_floor")),
                        ops or "(no matmul/conv: floor 0)",
                    ]
                )
            lines += [_table(["workload", "floor (ms)", "eager steady (ms)", "eager / floor", "ops (ms)"], t), ""]

        tmem = [r for r in fixed if r.get("step_tensor_peak_mb") is not None and r["mode"] != "eager"]
        if tmem:
            lines += _section(
                "Peak tensor memory of a training step",
                "The most tensor memory alive at once during one steady-state step (forward + `.backward()`), "
                "counting what the step allocates (activations, gradients, temporaries; parameters and "
                "inputs, allocated before, are left out and listed apart). From the profiler's allocator "
                "events (`profile_memory=True`): every allocation and free of the CPU allocator, the "
                "compiled graphs' buffers included, summed in time order; exact, unlike the resident set. "
                "Median of 3, mode and eager alternating in the same process. `vs eager` is the target's "
                "ratio (<= 1.10x), and stricter than one on the whole process, whose parameters are the same "
                "in both.",
            )
            t = [
                [
                    r["workload"],
                    MODE_LABELS.get(r["mode"], r["mode"]),
                    _num(r["step_tensor_peak_mb"]),
                    _num(r["eager_step_tensor_peak_mb"]),
                    _num(r["step_tensor_peak_mb"] / r["eager_step_tensor_peak_mb"], fmt="{:.2f}x")
                    if r["eager_step_tensor_peak_mb"]
                    else "-",
                    _num(r.get("param_mb")),
                ]
                for r in tmem
            ]
            lines += [_table(["workload", "mode", "step peak (MB)", "eager step peak (MB)", "vs eager", "parameters (MB)"], t), ""]

        mem = [r for r in fixed if r.get("bwd_peak_mb") is not None and r["mode"] != "eager"]
        if mem:
            lines += _section(
                "Resident set of one backward",
                "How far the process's resident set rises above its level at the start of one steady-state "
                "`.backward()` (peak reset right before it; median of 3), for the mode and for eager in the "
                "same process. Unlike peak RSS above, this leaves out the compiler and what was allocated "
                "before the backward (activations, parameters): it is what the backward itself needs on top. "
                "It is coarse: memory the allocator already holds (freed earlier) is reused without raising the "
                "resident set, so a row can read 0 and two processes can differ by tens of MB for the same "
                "graph; the test `tests/test_memory.py` checks the mechanism (saved tensors freed at their "
                "last use inside the graph) exactly.",
            )
            t = [
                [
                    r["workload"],
                    MODE_LABELS.get(r["mode"], r["mode"]),
                    _num(r["bwd_peak_mb"], fmt="{:.1f}"),
                    _num(r.get("eager_bwd_peak_mb"), fmt="{:.1f}"),
                    _num(r["bwd_peak_mb"] - r["eager_bwd_peak_mb"], fmt="{:+.1f}") if r.get("eager_bwd_peak_mb") is not None else "-",
                ]
                for r in mem
            ]
            lines += [_table(["workload", "mode", "backward peak (MB)", "eager backward peak (MB)", "difference (MB)"], t), ""]

        chain = [r for r in fixed if r["workload"] == "chain"]
        if chain:
            lines += [
                "## Per-node cost (chain workload)",
                "",
                "The chain's nodes do almost nothing, so its backward time per node is the per-node cost of "
                "each mode. `graph`: time inside the compiled callable; `overhead`: the rest of `.backward()` "
                "(for ours: collecting the graph's key and lifted tensors, the cache lookup, handing gradients "
                "to AccumulateGrad, freeing saved tensors; for torch CA: its C++ cache lookup/collection "
                "plus the runtime wrapper, while its graph also performs the gradient accumulation).",
                "",
            ]
            t = []
            for r in chain:
                n = r.get("nodes") or 1
                g = r.get("graph_median_s")
                t.append(
                    [
                        MODE_LABELS.get(r["mode"], r["mode"]),
                        _num(r.get("per_node_us")),
                        _num(r.get("eager_per_node_us")),
                        _num(g / n * 1e6 if g is not None else None),
                        _num(r.get("overhead_per_node_us")),
                        _num(r.get("overhead_median_s"), 1e3),
                    ]
                )
            lines += [
                _table(
                    [
                        "mode",
                        "backward µs/node",
                        "eager µs/node (same process)",
                        "graph µs/node",
                        "overhead µs/node",
                        "overhead per backward (ms)",
                    ],
                    t,
                ),
                "",
            ]

    if stream:
        lines += [
            "## Shape-varying stream",
            "",
            "The stream's batches in order, in one process. `loop wall`: wall time of the whole loop "
            "(forward + backward + copying the grads for the comparison), plus for ours the wait for any "
            "background compile still running at the end: all compile work is inside it, including the "
            "part of a background compile that overlaps the forwards. `bwd sum`: the sum of the 50 "
            "`.backward()` times, compiles included (for ours + inductor the background compile is partly "
            "outside them). `vs eager`: loop wall / the loop wall of an eager pass in the same process (two eager "
            "passes run first: the first warms up and gives the reference gradients of every step, the "
            "second is the baseline). `last 10 vs eager`: the last 10 "
            "backwards vs the same steps in eager (mostly hits by then).",
            "",
        ]
        t = []
        for r in stream:
            comp = r.get("compiled_at") or []
            steps = ", ".join(f"{c['step']}:{'x'.join(map(str, c['shape']))}" for c in comp[:8])
            if len(comp) > 8:
                steps += ", ..."
            l10, l10e = r.get("last10_total_s"), r.get("last10_eager_total_s")
            t.append(
                [
                    MODE_LABELS.get(r["mode"], r["mode"]),
                    _num(r.get("loop_wall_s")),
                    _num(r.get("eager_loop_wall_s")),
                    _ratio(r.get("vs_eager")),
                    _num(r.get("total_s")),
                    _num(r.get("eager_total_s")),
                    _ratio(r.get("vs_eager_backward_sum")),
                    _compiles(r),
                    _num(r.get("first_backward_s")),
                    steps or "-",
                    _ratio(l10 / l10e if l10 and l10e else None),
                    _diff(r.get("max_grad_diff")),
                    _num(r.get("peak_rss_mb"), fmt="{:.0f}"),
                    _status(r),
                ]
            )
        lines += [
            _table(
                [
                    "mode",
                    "loop wall (s)",
                    "eager loop wall (s)",
                    "vs eager",
                    "bwd sum (s)",
                    "eager bwd sum (s)",
                    "bwd sum vs eager",
                    "compiles",
                    "first bwd (s)",
                    "compiled at step:BxS",
                    "last 10 vs eager",
                    "max \\|Δgrad\\|",
                    "peak RSS (MB)",
                    "status",
                ],
                t,
            ),
            "",
        ]

    # Failures and fallbacks
    bad = [r for r in rows if r.get("status") != "ok"]
    fb = [
        r
        for r in rows
        if r.get("status") == "ok"
        and (
            (r.get("stats") or {}).get("eager_fallbacks")
            or (r.get("stats") or {}).get("opaque_nodes")
            or (r.get("stats") or {}).get("compile_failures")
            or r.get("background_compile_errors")
        )
    ]
    if bad or fb:
        lines += ["## Failures, timeouts and fallbacks", ""]
        for r in bad:
            lines += [f"### {r['workload']} / {r['mode']}: {r['status']}", "", f"{r.get('error', '')}", ""]
            if _repro(r):
                lines += ["Repro:", "", f"    {_repro(r)}", ""]
            tail = (r.get("traceback") or r.get("log_tail") or "").strip().splitlines()[-25:]
            if tail:
                lines += ["```", *tail, "```", ""]
        for r in fb:
            s = r["stats"]
            lines += [
                f"- {r['workload']} / {r['mode']}: eager_fallbacks={s.get('eager_fallbacks')} "
                f"{s.get('fallback_reasons', {})}; opaque_nodes={s.get('opaque_nodes')} "
                f"{s.get('opaque_reasons', {})}; compile_failures={s.get('compile_failures', 0)} "
                f"{r.get('background_compile_errors', [])}"
            ]
        lines.append("")

    lines += [
        "## Files",
        "",
        "- `results.json` (in the benchmark's output folder, not kept in git): every row with all measurements "
        "(per-iteration times, counters, floor ops, "
        "the worker command of each row)",
        "- `steady_state.png`: steady-state backward time relative to eager (same process), per workload and mode",
        "",
        "![steady state relative to eager](steady_state.png)",
        "",
    ]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in data.get("rows", []) if r.get("vs_eager") is not None and r.get("status") == "ok"]
    if not rows:
        return False
    workloads = [w for w in data.get("workloads", []) if any(r["workload"] == w for r in rows)]
    modes = [m for m in data.get("modes", []) if any(r["mode"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(workloads) + 2), 5))
    width = 0.8 / max(1, len(modes))
    colors = {
        "eager": "#888888",
        "torch-ca:aot_eager": "#9ecae1",
        "torch-ca:inductor": "#3182bd",
        "ours:aot_eager": "#fdae6b",
        "ours:inductor": "#e6550d",
        "ours:eager": "#fdd0a2",
        "torch-ca:eager": "#c6dbef",
        "ours:inductor:sync": "#a63603",
        "ours:aot_eager:sync": "#fdd0a2",
    }
    for j, m in enumerate(modes):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            r = next((r for r in rows if r["workload"] == w and r["mode"] == m), None)
            if r is None:
                continue
            xs.append(i + (j - (len(modes) - 1) / 2) * width)
            ys.append(r["vs_eager"])
        bars = ax.bar(xs, ys, width, label=MODE_LABELS.get(m, m), color=colors.get(m))
        for b, y in zip(bars, ys):
            ax.annotate(
                f"{y:.2f}",
                (b.get_x() + b.get_width() / 2, y),
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels([w if w != "stream" else "stream\n(loop wall incl. compiles)" for w in workloads])
    ax.set_ylabel("backward time / eager backward time (same process)\nlower is better, log scale")
    title = "Steady-state backward time relative to eager"
    if data.get("options", {}).get("quick"):
        title += " (--quick sizes)"
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=min(5, len(modes)), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(data: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    ok = plot(data, out_dir / "steady_state.png")
    text = markdown(data)
    if (out_dir / "findings.md").exists():
        text = text.replace(
            "\nModes: ", "\nRead with [findings.md](findings.md) (what the numbers say, and the problems found).\n\nModes: ", 1
        )
    if not ok:
        text = text.replace("![steady state relative to eager](steady_state.png)", "(no plot: matplotlib missing or no successful rows)")
    (out_dir / "results.md").write_text(text)
