"""Time to N training steps: the wall time of the first steps of training, compiles included.

    python -m benchmarks.time_to_train                       # transformer + MLP D=1024, 60+ steps
    python -m benchmarks.time_to_train --quick --out /tmp/ttt  # smoke run (small models, few steps)
    python -m benchmarks.time_to_train --report-only --out DIR # redraw results.md and the plot

Every (workload, mode) runs in a fresh subprocess with a fresh, empty inductor cache
(TORCHINDUCTOR_CACHE_DIR) and our disk cache off (COMPILED_AUTOGRAD_DISK_CACHE=0): the cold start
a new user sees. Our C++ helper is loaded before the first step (it is built once per machine, not
per run). A step is forward + backward + optimizer step (SGD with momentum), its wall time
recorded with `time.perf_counter`. Modes:

  eager          eager autograd
  torch.compile  the forward compiled with `torch.compile` (inductor): forward and backward
                 compiled by AOTAutograd, the optimizer in eager
  torch-ca       torch's built-in compiled autograd around the backward:
                 `torch._dynamo.compiled_autograd._enable(torch.compile(backend="inductor"))`
  ours           `compiled_autograd.enable("inductor")` around the backward (its default
                 background compile: the steps while it compiles run in eager autograd, the
                 compile runs in a child process at low priority)
  ours-thread    (not by default) ours with COMPILED_AUTOGRAD_COMPILE_PROCESS=0: the compile in a
                 thread of the training process

Eager runs first; the number of steps is the larger of --steps and the number eager needs to reach
--target-seconds (N15), so that every mode's total of the first N15 steps is measured too.

A single pair of runs is noisy here: eager's own 60-step total moved by 8% between back-to-back
runs on this 2-core machine, which is more than the difference being measured. `--repeat K` runs
the modes of --repeat-modes (default eager,ours) K-1 more times, alternating their order each
round, and reports each round's ratio of totals and their median; the first round's rows are the
ones the main tables and the plot show.

Writes OUT/results.json, OUT/results.md and OUT/cumulative_time.png (cumulative seconds over
steps, one line per mode, one panel per workload; needs matplotlib, which the report part imports
without torch: `--report-only` can be run by any Python that has matplotlib).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ["eager", "torch.compile", "torch-ca", "ours"]
WORKLOADS = ["transformer", "mlp1024"]
pc = time.perf_counter


# ---------------------------------------------------------------------------------------- worker


def _worker(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.workloads import build

    res: dict = {"workload": args.workload, "mode": args.mode, "steps": []}

    def save():
        Path(args.result).write_text(json.dumps(res, indent=1))

    wl = build(args.workload, quick=args.quick)
    res["description"] = wl.description
    params = wl.params
    opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    loss_fn = wl.loss
    ctx = None
    ca = None
    if args.mode == "torch.compile":
        loss_fn = torch.compile(wl.loss, backend="inductor")
    elif args.mode == "torch-ca":
        from torch._dynamo import compiled_autograd as tca

        compiler = torch.compile(backend="inductor")
        ctx = lambda: tca._enable(compiler)  # noqa: E731
    elif args.mode in ("ours", "ours-thread"):
        import compiled_autograd as ca

        res["compiled_autograd_file"] = ca.__file__
        from compiled_autograd import native

        t0 = pc()
        native.load()  # (built once per machine: not part of the time to train)
        res["native_load_s"] = pc() - t0
        ctx = lambda: ca.enable("inductor")  # noqa: E731
    elif args.mode != "eager":
        raise ValueError(f"unknown mode {args.mode!r}")

    import contextlib

    ctx = ctx or contextlib.nullcontext
    prev = ca.stats() if ca else None
    t_start = pc()
    i = 0
    stepped = 0.0  # (the sum of the step times, which N15 is counted by: not the loop's wall time)
    while i < args.steps or (args.until_seconds and stepped < args.until_seconds):
        i += 1
        t0 = pc()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        with ctx():
            loss.backward()
        opt.step()
        t1 = pc()
        stepped += t1 - t0
        step = {"s": t1 - t0, "loss": float(loss.detach())}
        if ca is not None:
            s = ca.stats()
            step["eager_while_compiling"] = s.eager_while_compiling - prev.eager_while_compiling
            step["hits"] = s.hits - prev.hits
            step["captures"] = s.captures - prev.captures
            step["fallbacks"] = s.eager_fallbacks - prev.eager_fallbacks
            step["pending"] = s.compiles_pending
            prev = s
        res["steps"].append(step)
        if args.deadline and t1 - t_start > args.deadline:
            res["stopped"] = f"deadline {args.deadline}s reached after {i} steps"
            break
    res["total_s"] = pc() - t_start
    if ca is not None:
        s = ca.stats()
        res["stats"] = {
            k: getattr(s, k)
            for k in (
                "captures",
                "hits",
                "eager_fallbacks",
                "eager_while_compiling",
                "compile_seconds",
                "trace_seconds",
                "compiles_pending",
                "compile_failures",
                "child_compiles",
            )
        }
        res["stats"]["fallback_reasons"] = {str(k): v for k, v in s.fallback_reasons.items()}
    save()
    if ca is not None:
        ca.synchronize(0)  # (the exit waits up to COMPILED_AUTOGRAD_EXIT_WAIT for a pending compile)
    return 0


# ---------------------------------------------------------------------------------------- driver


def _env(cache_dir: str, threads: int) -> dict:
    from benchmarks.run import _env as base_env

    env = base_env(cache_dir, threads)
    if "OMP_WAIT_POLICY" not in os.environ:
        # OpenMP's default wait, as a user's training has it (benchmarks.run sets PASSIVE for
        # steady-state timings on a shared machine): with PASSIVE, training's threads sleep at
        # every barrier and the compile in the child takes those moments, so every step while
        # it compiles pays the wake-ups (measured: 1.55x eager's step with the child at
        # SCHED_IDLE, 1.0x with the default wait)
        env.pop("OMP_WAIT_POLICY", None)
    env["COMPILED_AUTOGRAD_DISK_CACHE"] = "0"
    env["COMPILED_AUTOGRAD_EXIT_WAIT"] = "0"  # a compile still running at the end is not waited for,
    env["COMPILED_AUTOGRAD_FINISH_AFTER_EXIT"] = "0"  # nor left to finish beside the next run (--warm primes it)
    return env


def _run_one(args, workload: str, mode: str, steps: int, out_dir: Path, until: float = 0.0) -> dict:
    cache = tempfile.mkdtemp(prefix=f"ttt-{workload}-{mode}-")
    if args.warm and mode.startswith("ours"):
        # a first process with the same model ran until its compile was in (its exit waits for
        # it), sharing its caches (inductor's, and our disk cache): the next one is measured
        # (and its compiled package made: NOTE [Compiled graphs loaded without inductor])
        # --prime-exits: the first process runs as many steps and exits without waiting, its
        # compile left to finish after it (the default, up to 300 s) while the measured one starts
        wait = "0" if args.prime_exits else "inf"
        prime_env = dict(COMPILED_AUTOGRAD_EXIT_WAIT=wait, COMPILED_AUTOGRAD_FINISH_AFTER_EXIT="600", COMPILED_AUTOGRAD_DISK_CACHE="1")
        prime = _worker_run(args, workload, mode, steps if args.prime_exits else 2, out_dir, cache, prime_env)
        if prime[0] != 0:
            print(f"    priming run failed: {prime[1][-500:]}", flush=True)
    rc, err, wall, load = _worker_run(
        args, workload, mode, steps, out_dir, cache, dict(COMPILED_AUTOGRAD_DISK_CACHE="1") if args.warm else {}, until
    )
    result = out_dir / f".{workload}-{mode}.json"
    shutil.rmtree(cache, ignore_errors=True)
    try:
        row = json.loads(result.read_text())
        result.unlink()
    except (OSError, ValueError):
        row = {"workload": workload, "mode": mode, "steps": []}
    row.update(
        status="ok" if rc == 0 else f"rc={rc}",
        process_wall_s=wall,
        loadavg_before=load,
        loadavg_after=os.getloadavg(),
        warm=("after a first process that exited before its compile finished" if args.prime_exits else "after a compiled first process")
        if args.warm
        else False,
    )
    if rc != 0:
        row["stderr_tail"] = err[-3000:]
    return row


def _worker_run(args, workload, mode, steps, out_dir, cache, extra_env, until=0.0):
    result = out_dir / f".{workload}-{mode}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.time_to_train",
        "--worker",
        "--workload",
        workload,
        "--mode",
        mode,
        "--steps",
        str(steps),
        "--threads",
        str(args.threads),
        "--result",
        str(result),
    ]
    if args.quick:
        cmd.append("--quick")
    if args.deadline:
        cmd += ["--deadline", str(args.deadline)]
    if until:
        cmd += ["--until-seconds", str(until)]
    env = _env(cache, args.threads)
    env.update(extra_env)
    if mode == "ours-thread":  # the compile in a thread of this process only (no child process)
        env["COMPILED_AUTOGRAD_COMPILE_PROCESS"] = "0"
    load = os.getloadavg()
    t0 = pc()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)
    return rc, err, pc() - t0, load


def _main(args) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        data = json.loads((out_dir / "results.json").read_text())
        write_report(data, out_dir)
        return 0
    import platform

    from benchmarks.run import machine_info

    # our C++ helper, built (once per machine) before anything is timed; and the package's
    # bytecode, which pip writes when it installs a package (torch's is there): where
    # PYTHONDONTWRITEBYTECODE is set, as on our CI machine, every worker otherwise compiled
    # our sources again inside its first backward (17 ms of the MLP's first step)
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import compileall, os, compiled_autograd as ca; "
            "compileall.compile_dir(os.path.dirname(ca.__file__), quiet=1); "
            "from compiled_autograd import native; native.load()",
        ],
        cwd=ROOT,
        env=_env(tempfile.gettempdir(), args.threads),
        check=False,
    )
    workloads = args.workloads.split(",")
    modes = args.modes.split(",")
    if "eager" in modes:
        modes = ["eager"] + [m for m in modes if m != "eager"]
    data = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.time_to_train"] + sys.argv[1:]),
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(args.threads),
        "python_platform": platform.platform(),
        "steps": args.steps,
        "target_seconds": args.target_seconds,
        "rows": [],
    }

    def save():
        (out_dir / "results.json").write_text(json.dumps(data, indent=1))

    repeated = [m for m in modes if m in args.repeat_modes.split(",")]
    for wl in workloads:
        steps = args.steps
        for rnd in range(max(1, args.repeat)):
            order = modes if rnd == 0 else (repeated if rnd % 2 == 0 else repeated[::-1])
            for mode in order:
                print(f"[{wl}] round {rnd}, {mode}: {steps} steps (load {os.getloadavg()[0]:.2f})", flush=True)
                # (eager's first run goes until it reaches the target, and sets the steps of the others)
                until = args.target_seconds if mode == "eager" and rnd == 0 else 0.0
                row = _run_one(args, wl, mode, steps, out_dir, until=until)
                row["round"] = rnd
                data["rows"].append(row)
                save()
                times = [s["s"] for s in row["steps"]]
                print(f"    {row['status']}: {len(times)} steps, total {sum(times):.2f}s", flush=True)
                if mode == "eager" and rnd == 0 and times:
                    steps = max(steps, len(times))
    data["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    data["machine"]["loadavg_end"] = os.getloadavg()
    save()
    write_report(data, out_dir)
    print(f"wrote {out_dir}/results.md, results.json, cumulative_time.png", flush=True)
    return 0 if all(r["status"] == "ok" for r in data["rows"]) else 1


# ---------------------------------------------------------------------------------------- report


def _median(xs):
    return statistics.median(xs) if xs else None


def _n_at(times: list, seconds: float):
    """The first number of steps whose total reaches `seconds` (None if never)."""
    total = 0.0
    for i, t in enumerate(times):
        total += t
        if total >= seconds:
            return i + 1
    return None


def summarize(data: dict) -> list:
    """One dict per (workload, mode): the step times that matter and the totals of the first N."""
    out = []
    by_wl: dict = {}
    for r in data["rows"]:
        if r.get("round", 0) == 0:
            by_wl.setdefault(r["workload"], []).append(r)
    for wl, rows in by_wl.items():
        eager = next((r for r in rows if r["mode"] == "eager"), None)
        e_times = [s["s"] for s in eager["steps"]] if eager else []
        n15 = _n_at(e_times, data.get("target_seconds", 15.0)) if e_times else None
        ns = sorted({n for n in (data.get("steps"), n15) if n})
        e_tail = _median(e_times[len(e_times) // 2 :]) if e_times else None
        sums = {}
        for r in rows:
            times = [s["s"] for s in r["steps"]]
            sums[r["mode"]] = {n: sum(times[:n]) for n in ns if len(times) >= n}
        for r in rows:
            times = [s["s"] for s in r["steps"]]
            steady = _median(times[len(times) // 2 :]) if times else None
            row = {
                "workload": wl,
                "mode": r["mode"],
                "status": r.get("status"),
                "steps_run": len(times),
                "first_step_s": times[0] if times else None,
                "steady_step_s": steady,
                "steady_vs_eager": steady / e_tail if steady and e_tail else None,
                "loadavg": [r.get("loadavg_before", [None])[0], r.get("loadavg_after", [None])[0]],
            }
            if r["mode"].startswith("ours") and times:
                compiling = [s["s"] for s in r["steps"][1:] if s.get("eager_while_compiling")]
                row["steps_while_compiling"] = len(compiling)
                row["while_compiling_s"] = _median(compiling)
                row["while_compiling_max_s"] = max(compiling) if compiling else None
                row["while_compiling_vs_eager"] = row["while_compiling_s"] / e_tail if compiling and e_tail else None
                done = next((i for i, s in enumerate(r["steps"]) if s.get("hits")), None)
                row["compiled_from_step"] = None if done is None else done + 1
                row["time_to_compiled_s"] = None if done is None else sum(times[:done])
                row["compile_seconds"] = (r.get("stats") or {}).get("compile_seconds")
            totals = {}
            for n in ns:
                t = sums[r["mode"]].get(n)
                if t is None:
                    continue
                d = {"steps": n, "total_s": t}
                for ref in ("eager", "torch-ca", "torch.compile"):
                    rt = sums.get(ref, {}).get(n)
                    if rt:
                        d[f"vs_{ref}"] = t / rt
                totals[str(n)] = d
            row["totals"] = totals
            row["n_target"] = n15
            out.append(row)
    return out


def rounds(data: dict, ns_of: dict) -> dict:
    """workload -> one dict per round: each repeated mode's total of the first n steps (n in
    `ns_of[workload]`), and the median over rounds of each mode's ratio to eager's total of the
    same round."""
    out: dict = {}
    for wl, ns in ns_of.items():
        by_round: dict = {}
        for r in data["rows"]:
            if r["workload"] == wl and r.get("status") == "ok":
                times = [s["s"] for s in r["steps"]]
                by_round.setdefault(r.get("round", 0), {})[r["mode"]] = {n: sum(times[:n]) for n in ns if len(times) >= n}
        if len(by_round) < 2:
            continue
        ratios: dict = {}
        table = []
        for rnd, totals in sorted(by_round.items()):
            eager = totals.get("eager", {})
            row = {"round": rnd, "totals": totals, "vs_eager": {}}
            for mode, t in totals.items():
                for n, v in t.items():
                    if mode != "eager" and eager.get(n):
                        row["vs_eager"].setdefault(mode, {})[n] = v / eager[n]
                        ratios.setdefault((mode, n), []).append(v / eager[n])
            table.append(row)
        out[wl] = {
            "rounds": table,
            "median_vs_eager": {f"{m} {n}": _median(v) for (m, n), v in ratios.items()},
            "range_vs_eager": {f"{m} {n}": [min(v), max(v)] for (m, n), v in ratios.items()},
        }
    return out


def _rounds_lines(rep: dict, ns: list) -> list:
    modes = [m for m in dict.fromkeys(m for row in rep["rounds"] for m in row["totals"]) if m != "eager"]
    head = "| round | " + " | ".join(f"eager, {n} steps | " + " | ".join(f"{m}, {n} steps (vs eager)" for m in modes) for n in ns) + " |"
    lines = [
        "Repeated runs (each round one fresh process per mode, the order alternating):",
        "",
        head,
        "|" + "---|" * (1 + len(ns) * (1 + len(modes))),
    ]
    for row in rep["rounds"]:
        cells = [str(row["round"])]
        for n in ns:
            cells.append(_f(row["totals"].get("eager", {}).get(n), "{:.2f} s"))
            for m in modes:
                cells.append(f"{_f(row['totals'].get(m, {}).get(n), '{:.2f} s')} ({_f(row['vs_eager'].get(m, {}).get(n), '{:.3f}x')})")
        lines.append("| " + " | ".join(cells) + " |")
    med = rep["median_vs_eager"]
    rng = rep["range_vs_eager"]
    lines += [
        "",
        "Median of the rounds' ratios to eager: "
        + "; ".join(f"{k.split()[0]}, {k.split()[1]} steps: {v:.3f}x ({rng[k][0]:.3f}-{rng[k][1]:.3f}x)" for k, v in med.items())
        + ".",
        "",
    ]
    return lines


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def write_report(data: dict, out_dir: Path) -> None:
    rows = summarize(data)
    data["summary"] = rows
    ns_of = {
        wl: sorted({int(n) for r in rows if r["workload"] == wl for n in r["totals"]}) for wl in dict.fromkeys(r["workload"] for r in rows)
    }
    data["rounds"] = rounds(data, ns_of)
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    m = data.get("machine", {})
    lines = [
        "# Time to N training steps",
        "",
        f"Command: `{data.get('command')}`; started {data.get('started')}, finished {data.get('finished')}.",
        f"Machine: {m.get('cpu')}, {m.get('logical_cpus')} logical CPUs, torch {m.get('torch')}, "
        f"{m.get('threads')} threads, commit {m.get('git_commit')}{' (src modified)' if m.get('git_src_dirty') else ''}; "
        f"1-minute load average {_f((m.get('loadavg_start') or [None])[0], '{:.2f}')} at the start, "
        f"{_f((m.get('loadavg_end') or [None])[0], '{:.2f}')} at the end (per row below).",
        "",
        (
            "One fresh process per (workload, mode), warm: ours measured in a second process on the caches of a first, "
            + str(data["rows"][0].get("warm"))
            if any(r.get("warm") for r in data["rows"])
            else "One fresh process per (workload, mode), cold inductor cache, our disk cache off"
        )
        + "; a step is "
        "forward + backward + SGD step. `N` = " + str(data.get("steps")) + " steps, and `N15` = the steps "
        f"eager needs to reach {data.get('target_seconds')} s.",
        "",
        "![cumulative time over steps](cumulative_time.png)",
        "",
    ]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        wr = [r for r in rows if r["workload"] == wl]
        ns = sorted({int(n) for r in wr for n in r["totals"]})
        desc = next((x.get("description") for x in data["rows"] if x["workload"] == wl and x.get("description")), "")
        lines += [f"## {wl}", "", desc, "", f"N15 = {wr[0].get('n_target')} steps.", ""]
        head = "| mode | first step | steady step (vs eager) | steps while compiling: median (max; vs eager) | compiled from step |"
        sep = "|---|---|---|---|---|"
        for n in ns:
            head += f" total of {n} steps (vs eager; vs built-in; vs torch.compile) |"
            sep += "---|"
        lines += [head, sep]
        for r in wr:
            cells = [
                r["mode"] + ("" if r["status"] == "ok" else f" ({r['status']})"),
                _f(r["first_step_s"], "{:.2f} s"),
                f"{_f(r['steady_step_s'], '{:.3f} s')} ({_f(r['steady_vs_eager'], '{:.2f}x')})",
            ]
            if r["mode"].startswith("ours"):
                cells.append(
                    f"{_f(r.get('while_compiling_s'), '{:.3f} s')} ({_f(r.get('while_compiling_max_s'), '{:.3f} s')}; "
                    f"{_f(r.get('while_compiling_vs_eager'), '{:.2f}x')}; {r.get('steps_while_compiling')} steps)"
                )
                cells.append(f"{r.get('compiled_from_step') or 'never'} (after {_f(r.get('time_to_compiled_s'), '{:.1f} s')})")
            else:
                cells += ["", ""]
            for n in ns:
                t = r["totals"].get(str(n))
                if t is None:
                    cells.append("-")
                    continue
                cells.append(
                    f"{t['total_s']:.2f} s ({_f(t.get('vs_eager'), '{:.2f}x')}; {_f(t.get('vs_torch-ca'), '{:.2f}x')}; "
                    f"{_f(t.get('vs_torch.compile'), '{:.2f}x')})"
                )
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "Load average (1 min) before/after each row: "
            + ", ".join(f"{r['mode']} {_f(r['loadavg'][0], '{:.2f}')}/{_f(r['loadavg'][1], '{:.2f}')}" for r in wr)
            + ".",
            "",
        ]
        if wl in data["rounds"]:
            lines += _rounds_lines(data["rounds"][wl], ns)
    notes = data.get("notes")
    if notes:
        lines += ["## Notes", "", notes, ""]
    if not plot(data, out_dir / "cumulative_time.png"):
        lines = [ln for ln in lines if "cumulative_time.png" not in ln]
        lines.insert(8, "(no plot: matplotlib missing; `--report-only` with a Python that has it draws it)\n")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    wls = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(wls), figsize=(6.5 * len(wls), 4.8), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        for r in data["rows"]:
            if r["workload"] != wl or not r["steps"] or r.get("round", 0) != 0:
                continue
            ys, total = [0.0], 0.0
            for s in r["steps"]:
                total += s["s"]
                ys.append(total)
            ax.plot(range(len(ys)), ys, label=r["mode"], lw=2 if r["mode"] in ("ours", "eager") else 1.3)
        ax.set_title(wl)
        ax.set_xlabel("step")
        ax.set_ylabel("cumulative wall time (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Time to N training steps (forward + backward + optimizer, cold caches)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--target-seconds", type=float, default=15.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--repeat", type=int, default=1, help="rounds of the --repeat-modes (the first round runs every mode)")
    p.add_argument("--repeat-modes", default="eager,ours")
    p.add_argument("--until-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help="stop a mode's steps after this many seconds (0: never)")
    p.add_argument("--quick", action="store_true", help="small models, 8 steps, a 0.1 s target: a smoke run")
    p.add_argument(
        "--warm",
        action="store_true",
        help="ours: measure a second process, after a first one with the same model compiled its graph "
        "(sharing inductor's caches and our disk cache)",
    )
    p.add_argument(
        "--prime-exits",
        action="store_true",
        help="with --warm: the first process runs the same steps and exits without waiting for its compile (which finishes "
        "after it); the measured one starts at once",
    )
    p.add_argument("--out", default=None, help="default docs/bench/time_to_train (--quick: a temporary folder)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.out is None:
        args.out = (
            os.path.join(tempfile.gettempdir(), "time_to_train_quick") if args.quick else str(ROOT / "docs" / "bench" / "time_to_train")
        )
    if args.quick:
        args.steps = min(args.steps, 8)
        args.target_seconds = min(args.target_seconds, 0.1)
    return _main(args)


if __name__ == "__main__":
    sys.exit(main())
