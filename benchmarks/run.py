"""Backward-pass benchmark: eager autograd vs torch's built-in compiled autograd vs ours.

    python benchmarks/run.py [--quick] [--workloads mlp256,chain] [--modes eager,ours:inductor]
    python -m benchmarks.run [same options]

Every (workload, mode) runs in a fresh subprocess (benchmarks/worker.py) with
torch.set_num_threads(--threads) and, by default, a fresh empty inductor cache
(TORCHINDUCTOR_CACHE_DIR), so the first backward includes the whole cold
capture + compile. `--warm-cache` runs each compiled (workload, mode) once to
fill a fixed cache directory and then measures a second process against it.

Writes OUT/results.json (every row, written after each row as well),
OUT/results.md (tables) and OUT/steady_state.png (steady-state time relative to
eager, per workload and mode). `--report-only` re-renders the Markdown and the
plot from an existing results.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402

_OMP_ACTIVE = False

MODES = ["eager", "torch-ca:aot_eager", "torch-ca:inductor", "ours:aot_eager", "ours:inductor"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return None


def machine_info(threads: int) -> dict:
    import torch

    dirty = _git("status", "--porcelain", "--", "src")
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "memory_gb": _mem_gb(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": threads,
        "accelerator": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_src_dirty": bool(dirty),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _env(cache_dir: str, threads: int) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    # compiled_autograd's on-disk cache of captured graphs follows the inductor cache: cold (a fresh
    # dir) by default, the fixed dir with --warm-cache. (Its C++ helper stays in its usual cache.)
    env["COMPILED_AUTOGRAD_GRAPH_DIR"] = os.path.join(cache_dir, "compiled_autograd_graphs")
    env["OMP_NUM_THREADS"] = str(threads)
    if not _OMP_ACTIVE:
        # On a shared machine, OpenMP's default active (spinning) wait turns a busy core into
        # 100x slower parallel regions: a thread spins at a barrier while the thread it waits for
        # is not scheduled (measured here: a 2-thread MLP backward, median 836 ms with spinning
        # vs 12 ms passive, 1.7 ms unloaded). Passive waiting keeps the timings meaningful.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONWARNINGS", "default")
    return env


def _tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if not ln.startswith("USDT:")]
    return "\n".join(lines)[-n:]


def _background_compile_errors(text: str) -> list[str]:
    """The exception line of each 'background compile failed' traceback that ours logged."""
    out = []
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if "background compile failed" in ln:
            for nxt in lines[i + 1 :]:
                if nxt.startswith(("Traceback", " ")) or not nxt.strip():
                    continue
                out.append(nxt.strip()[:300])
                break
    return out


def run_worker(workload, mode, args, cache_dir, tmp: Path, tag="") -> dict:
    result = tmp / f"{workload}-{mode.replace(':', '_')}{tag}.json"
    log = tmp / f"{workload}-{mode.replace(':', '_')}{tag}.log"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.worker",
        "--workload",
        workload,
        "--mode",
        mode,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--min-time",
        str(args.min_time),
        "--threads",
        str(args.threads),
        "--result",
        str(result),
    ]
    if args.quick:
        cmd.append("--quick")
    if args.device != "cpu":
        cmd += ["--device", args.device]
    if args.no_profile:
        cmd.append("--no-profile")
    if tag == "-prime":
        cmd[cmd.index("--iters") + 1] = "1"
        cmd[cmd.index("--warmup") + 1] = "0"
        cmd[cmd.index("--min-time") + 1] = "0"
        cmd.append("--no-profile")
    commit = _git("rev-parse", "--short", "HEAD")
    t0 = time.perf_counter()
    status = None
    rc = None
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=_env(cache_dir, args.threads), stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    wall = time.perf_counter() - t0
    row = {"workload": workload, "mode": mode}
    if result.exists():
        try:
            row = json.loads(result.read_text())
        except json.JSONDecodeError:
            pass
    if status == "timeout":
        row["status"] = "timeout"
        row["error"] = f"subprocess ran past --timeout {args.timeout} s (partial results kept)"
    elif row.get("status") in (None, "running"):
        row["status"] = "crashed"
        row["error"] = f"worker exited with code {rc} without a result"
    errors = _background_compile_errors(_tail(log, 10**7))
    if errors:
        row["background_compile_errors"] = errors
    if row["status"] != "ok":
        row["log_tail"] = _tail(log)
    else:
        warn = [ln for ln in _tail(log, 20000).splitlines() if "Warning" in ln or "compiled_autograd:" in ln]
        if warn:
            row["warnings"] = warn[:20]
    row["subprocess_wall_s"] = wall
    row["git_commit"] = commit
    row["returncode"] = rc
    row["command"] = " ".join(shlex.quote(c) for c in cmd[1:])
    return row


def prebuild(args, tmp: Path) -> dict:
    """Build/load our C++ helper once, so no measured subprocess pays for building it."""
    code = (
        "import time, torch; t=time.perf_counter(); import compiled_autograd as ca\n"
        "x = torch.ones(3, requires_grad=True)\n"
        "with ca.enable(backend='eager'):\n    (x * 2).sum().backward()\n"
        "print(round(time.perf_counter() - t, 2), ca.stats())\n"
    )
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=_env(str(tmp / "prebuild-cache"), args.threads),
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        out = {"ok": p.returncode == 0, "output": (p.stdout + p.stderr)[-1500:]}
    except subprocess.TimeoutExpired:
        out = {"ok": False, "output": "timeout"}
    out["seconds"] = time.perf_counter() - t0
    return out


def _summary(row) -> str:
    def f(k, scale=1.0, fmt="{:.3g}"):
        v = row.get(k)
        return "-" if v is None else fmt.format(v * scale)

    s = (
        f"{row['workload']:12s} {row['mode']:20s} {row['status']:8s} first={f('first_backward_s')}s "
        f"steady={f('steady_median_s', 1e3)}ms vs_eager={f('vs_eager')} compiles={row.get('stats', {}).get('compiles', '-')} "
        f"diff={f('max_grad_diff')} rss={f('peak_rss_mb', 1, '{:.0f}')}MB wall={f('subprocess_wall_s', 1, '{:.0f}')}s"
    )
    if row.get("mode", "").startswith("h2h"):
        s += (
            f" ours/eager={f('ours_vs_eager')} torch/eager={f('theirs_vs_eager')} ours/torch={f('ours_vs_theirs')} "
            f"(min {f('ours_vs_theirs_min')}) ours/floor={f('ours_vs_floor')}"
        )
    elif row.get("workload") == "stream":
        s += f" bwd_sum={f('total_s')}s (eager {f('eager_total_s')}s) loop={f('loop_wall_s')}s (eager {f('eager_loop_wall_s')}s)"
    elif row.get("time_to_compiled_s") is not None and row.get("background_compile_wait_s"):
        s += f" until_compiled={f('time_to_compiled_s')}s"
    if row["status"] != "ok":
        s += f"\n    {row.get('error', '')}"
    return s


def main(argv=None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {','.join(WORKLOADS)}")
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma list of {','.join(MODES)} (also ours:eager, torch-ca:eager, "
        "ours:inductor:sync = ours with background=False, and h2h:inductor = ours (background=False), "
        "torch's and eager alternating in one process)",
    )
    ap.add_argument("--iters", type=int, default=20, help="timed backwards per mode (steady state), default 20")
    ap.add_argument("--warmup", type=int, default=3, help="untimed backwards after the first, default 3")
    ap.add_argument(
        "--min-time",
        type=float,
        default=2.0,
        help="keep timing pairs past --iters until the mode's backwards add up to this many seconds (at most 25 x --iters), default 2",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every subprocess, default 2")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the workloads run (cpu, cuda), default cpu; on an "
        "accelerator every timed backward ends with a synchronize, and the floor and tensor-peak "
        "profiles are skipped",
    )
    ap.add_argument("--out", default="docs/bench", help="output folder (relative to the repo root), default docs/bench")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per subprocess, default 900")
    ap.add_argument(
        "--warm-cache",
        action="store_true",
        help="use a fixed inductor cache dir and prime it with one unmeasured process per row, "
        "so the measured first backward is a second process's",
    )
    ap.add_argument(
        "--cache-dir", default=None, help="the fixed cache dir for --warm-cache (default: $TMPDIR/compiled_autograd_bench_inductor_cache)"
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the profiler floor")
    ap.add_argument(
        "--omp-active", action="store_true", help="keep OpenMP's default (spinning) wait policy instead of OMP_WAIT_POLICY=PASSIVE"
    )
    ap.add_argument("--report-only", action="store_true", help="re-render results.md/png from OUT/results.json")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)

    out_dir = Path(args.out)
    if not out_dir.is_absolute():
        out_dir = ROOT / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        data = json.loads((out_dir / "results.json").read_text())
        write_report(data, out_dir)
        print(f"wrote {out_dir}/results.md and steady_state.png")
        return 0

    global _OMP_ACTIVE
    _OMP_ACTIVE = args.omp_active
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}")
    for m in modes:
        kind, _, backend = m.partition(":")
        backend, _, option = backend.partition(":")
        if not (
            m == "eager"
            or (
                kind in ("ours", "torch-ca", "h2h")
                and backend in ("eager", "aot_eager", "inductor")
                and option in ("", "sync")
                and not (option and kind != "ours")
            )
        ):
            ap.error(f"unknown mode {m!r}")
        if kind == "h2h" and "stream" in workloads:
            ap.error("the head-to-head mode (h2h:B) takes the fixed workloads, not the stream")

    command = " ".join([prog or "python benchmarks/run.py", *map(shlex.quote, argv)])
    started = _dt.datetime.now().astimezone()
    t_start = time.perf_counter()
    data = {
        "date": started.isoformat(timespec="seconds"),
        "command": command,
        "machine": machine_info(args.threads),
        "options": {k: v for k, v in vars(args).items() if k != "report_only"},
        "workloads": workloads,
        "modes": modes,
        "rows": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="ca_bench_"))
    print(f"benchmark: {len(workloads)} workloads x {len(modes)} modes, logs in {tmp}", flush=True)
    if any(m.startswith(("ours", "h2h")) for m in modes):
        data["prebuild"] = prebuild(args, tmp)
        print(f"prebuild of the native helper: {data['prebuild']['seconds']:.1f}s ok={data['prebuild']['ok']}", flush=True)

    warm_dir = None
    if args.warm_cache:
        warm_dir = Path(args.cache_dir or Path(tempfile.gettempdir()) / "compiled_autograd_bench_inductor_cache")
        warm_dir.mkdir(parents=True, exist_ok=True)
        data["options"]["cache_dir"] = str(warm_dir)

    def save():
        data["wall_s"] = time.perf_counter() - t_start
        (out_dir / "results.json").write_text(json.dumps(data, indent=1, default=str))

    for w in workloads:
        for m in modes:
            if warm_dir is not None:
                cache = str(warm_dir)
                if m != "eager":
                    prime = run_worker(w, m, args, cache, tmp, tag="-prime")
                    print(f"  primed {w} {m}: {prime['status']} in {prime['subprocess_wall_s']:.0f}s", flush=True)
            else:
                cache = tempfile.mkdtemp(prefix="inductor_", dir=tmp)
            row = run_worker(w, m, args, cache, tmp)
            row["inductor_cache"] = "warm (second process)" if warm_dir is not None else "cold (fresh dir)"
            if warm_dir is None:
                shutil.rmtree(cache, ignore_errors=True)
            data["rows"].append(row)
            print(_summary(row), flush=True)
            save()

    finished = _dt.datetime.now().astimezone()
    data["finished"] = finished.isoformat(timespec="seconds")
    data["machine"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    save()
    write_report(data, out_dir)
    print(f"done in {data['wall_s'] / 60:.1f} min; wrote {out_dir}/results.md, results.json, steady_state.png", flush=True)
    bad = [r for r in data["rows"] if r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
