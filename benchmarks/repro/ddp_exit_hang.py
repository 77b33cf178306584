"""A DDP job that does not exit cleanly: how often, eager autograd against ours.

    python -m benchmarks.repro.ddp_exit_hang [--runs 20] [--modes eager,ours] [--src DIR]
        [--load 0] [--model transformer|mlp] [--bucket-cap-mb 0.0001] [--steps 5] [--timeout 60]
        [--no-stacks]

Each run is a fresh 2-rank job (gloo on loopback; a job process in its own process group starts
two rank processes), written the way users write one: a small model wrapped in DDP, `--steps`
training steps (forward, backward, SGD step), `dist.destroy_process_group()` with the DDP model
still alive (module globals, as in a script written at module level), and a normal exit. Mode
`eager` calls `loss.backward()`; mode `ours` calls it under `ca.enable(backend="aot_eager")`
(the first step a capture, then hits; each rank asserts no eager fallback and hits >= 3 and
prints ca.stats()) with compiled_autograd from this checkout, `--src DIR` or a mode `ours:DIR`
(DIR/src first on the ranks' PYTHONPATH: e.g. a git worktree of the version before a fix). The
modes alternate run by run so that the machine's drift hits them alike. Per mode: runs, hangs
(a job still running `--timeout` s after the slowest finished job, at least 30 s: its ranks'
stacks are taken with gdb and its process group killed), aborts (a rank killed by SIGABRT: the
aborting thread's stack is taken from its core file), other failures, median job time. The
stacks of the first two failures of a mode are kept in the logs folder. `--load K` runs K
busy-loop processes (`while True: pass`) beside the jobs.

The race. A gloo work holds the thread-local state of the thread that launched it, and torch's
_engine_run_backward stashes the contextvars context (a Python object) there for the whole
backward: every allreduce DDP's reducer starts from its hooks carries one, and the gloo worker
that drops the finished work needs the GIL to release it. Just after the last backward, the
worker can be late for the GIL while the main thread runs on to the interpreter's finalization:
the worker then asks for the GIL during finalization and Python ends the thread, an unwind
through a noexcept destructor, std::terminate: "terminate called without an active exception",
exit status -6 (stack: runLoop -> ~AsyncAllreduceWork -> ~AsyncWork -> ~ThreadLocalState ->
SafePyObject decref -> gil_scoped_acquire -> take_gil -> PyThread_exit_thread -> abort). When
the main thread holds the GIL in ~Reducer -> ~ProcessGroupGloo -> std::thread::join while the
worker waits, the job hangs instead (the issue's stack). Our graphs call hooks in a one-node
graph task started with the engine directly (NOTE [No Python object in the backward's
thread-local state], src/compiled_autograd/graph_task.py): their collectives carry no
Python object, and the worker never needs the GIL.

Measured (2 cores shared with other work, torch 2.13 CPU, Python 3.11.7; ours:/tmp/ca_after a
worktree of 7383a41, the fix; ours:/tmp/ca_before one of 17916f4, before it):

    python -m benchmarks.repro.ddp_exit_hang --runs 20 --load 0 --model transformer \
        --bucket-cap-mb 0.0001 --modes eager,ours:/tmp/ca_after,ours:/tmp/ca_before   # twice

    mode                runs  hangs  aborts   median job s (first run; second run)
    eager                 40      0  4 + 8    5.6; 3.2
    ours (after fix)      40      0  0 + 0    8.4; 4.4
    ours (before fix)     40      0  3 + 5    8.4; 4.5

All 8 aborts whose stacks were taken: the stack above. An MLP with DDP's default buckets and
load make it rarer: `--load 2 --model mlp --bucket-cap-mb 0`, 20 runs a mode: eager 0, ours
(with the fix) 0, ours before the fix 0; `--load 2` with the transformer and tiny buckets, 10
runs a mode: 0, 0, 0. Load lengthens the main thread's way to finalization more than the worker's
delay: the race is likelier on a quiet machine. No hang was seen in any run here (Python 3.11
ends a thread that asks for the GIL during finalization: an abort, where the issue saw a hang).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


# --- one rank: a user's DDP script ----------------------------------------------------------


def _model(kind):
    import torch

    torch.manual_seed(0)
    if kind == "transformer":
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.nn.Linear(16, 4))
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def rank_main(a):
    """The body of a user's training script; returns what its module globals would hold."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    options = dict(bucket_cap_mb=a.bucket_cap_mb) if a.bucket_cap_mb else {}
    model = DDP(_model(a.model), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if a.rank_mode == "ours":
        import compiled_autograd as ca

        print(f"rank {rank}: compiled_autograd from {os.path.dirname(ca.__file__)}", flush=True)
    for step in range(a.steps):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(4, 6, 16) if a.model == "transformer" else torch.randn(8, 16)
        loss = model(x).float().pow(2).mean()
        if a.rank_mode == "ours":
            with ca.enable(backend="aot_eager"):
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()  # the DDP model (its reducer holds the group) still alive
    # the script's last line, the same in both modes: ours checks its counters
    if a.rank_mode == "ours":
        s = ca.stats()
        assert s.eager_fallbacks == 0, dict(s.fallback_details)
        assert s.hits >= min(3, a.steps - 2), s
        print(f"rank {rank}: done: {s}", flush=True)
    else:
        print(f"rank {rank}: done", flush=True)
    return model, opt, loss


# --- one job: two ranks ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_main(a) -> int:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD))
    cmd = [sys.executable, "-m", "benchmarks.repro.ddp_exit_hang", "--rank-mode", a.rank_job, *_job_options(a)]

    def cores():  # (a rank that aborts leaves ./core, in the job's folder, for run_job)
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    ranks = [
        subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=os.getcwd(), preexec_fn=cores if a.cores else None)
        for r in range(WORLD)
    ]
    print(f"job: ranks {[p.pid for p in ranks]}", flush=True)
    codes = [p.wait() for p in ranks]
    print(f"job: exit codes {codes}", flush=True)
    return 0 if codes == [0] * WORLD else 1


def _job_options(a) -> list[str]:
    out = ["--model", a.model, "--steps", str(a.steps)]
    out += ["--bucket-cap-mb", str(a.bucket_cap_mb)]
    if a.cores:
        out += ["--cores"]
    return out


# --- the driver -------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
    except OSError:
        pass
    return out


def _stacks(pid: int, path: Path) -> None:
    with open(path, "w") as f:
        try:
            f.write(open(f"/proc/{pid}/cmdline").read().replace("\0", " ") + "\n")
        except OSError:
            return
        try:
            r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"], capture_output=True, text=True, timeout=240)
            f.write(r.stdout + r.stderr)
        except (OSError, subprocess.TimeoutExpired) as e:
            f.write(f"gdb failed: {e!r}\n")


def _core_stack(core: Path, path: Path) -> None:
    """The aborting thread's stack from a rank's core file (then deleted: ~250 MB)."""
    try:
        r = subprocess.run(["gdb", "-batch", "-ex", "bt 30", sys.executable, str(core)], capture_output=True, text=True, timeout=240)
        path.write_text("\n".join(line for line in r.stdout.splitlines() if line.startswith("#") or "signal" in line) + "\n")
    except (OSError, subprocess.TimeoutExpired) as e:
        path.write_text(f"gdb failed: {e!r}\n")


def run_job(a, mode: str, deadline: float, dumps: bool, log: Path) -> tuple[str, float]:
    """One job of `mode` ('eager', 'ours' or 'ours:DIR'): ('ok' | 'hang' | 'abort' | 'failed', seconds).
    With `dumps`: a hung job's ranks' stacks (gdb, attached) and an aborted rank's (its core)."""
    kind, _, src = mode.partition(":")
    src = src or (a.src if kind == "ours" else None)
    paths = ([str(Path(src).resolve() / "src")] if src else []) + [str(ROOT)]
    env = dict(os.environ, COMPILED_AUTOGRAD_DISK_CACHE="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "benchmarks.repro.ddp_exit_hang", "--rank-job", kind, *_job_options(a)]
    cwd = log.with_suffix("")  # (the ranks' working folder: their core files)
    cwd.mkdir()
    t0 = time.monotonic()
    try:
        with open(log, "w") as out:
            p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = p.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                took = time.monotonic() - t0
                if dumps:
                    for pid in _children(p.pid):
                        _stacks(pid, log.parent / f"{log.stem}_pid{pid}.txt")
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                return "hang", took
        took = time.monotonic() - t0
        if code == 0:
            return "ok", took
        codes = re.findall(r"job: exit codes \[(.*)\]", log.read_text(errors="replace"))
        if codes and str(-signal.SIGABRT) in codes[0].replace(" ", "").split(","):
            core = sorted(cwd.glob("core*"))
            if dumps and core:
                _core_stack(core[0], log.parent / f"{log.stem}_core_stack.txt")
            return "abort", took
        return "failed", took
    finally:
        for f in cwd.iterdir():
            f.unlink()
        cwd.rmdir()


def main(a) -> int:
    modes = a.modes.split(",")
    logs = Path(tempfile.mkdtemp(prefix="ddp_exit_hang-"))
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.load)]
    results: dict[str, list[tuple[str, float, str]]] = {m: [] for m in modes}
    print(
        f"{a.runs} runs a mode, modes {modes} alternating, load {a.load}, model {a.model}, steps {a.steps}, "
        f"bucket_cap_mb {a.bucket_cap_mb}, "
        f"ours from {a.src or ROOT} unless named; logs in {logs}",
        flush=True,
    )
    try:
        for i in range(a.runs):
            for mode in modes:
                done = [t for m in modes for s, t, _ in results[m] if s in ("ok", "abort")]
                deadline = max([30.0] + done) + a.timeout
                log = logs / f"{re.sub(r'[^A-Za-z0-9]+', '_', mode).strip('_')}_{i:02d}.log"
                dumps = a.stacks and sum(s != "ok" for s, _, _ in results[mode]) < 2
                state, took = run_job(a, mode, deadline, dumps, log)
                text = log.read_text(errors="replace")
                if state == "hang":
                    gone = len(re.findall(r"rank \d: done", text))
                    state = "hang" if gone == WORLD else f"hang ({WORLD - gone} of {WORLD} ranks did not finish training)"
                stats = re.findall(r"rank 0: done: (captures=.*)", text)
                results[mode].append((state, took, log.name))
                print(f"run {i:2d} {mode}: {state:5s} {took:6.1f} s  {stats[0][:100] if stats else ''}", flush=True)
                if state in ("failed", "abort"):
                    print("  " + "\n  ".join(text.splitlines()[-15:]), flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
    w = max(len(m) for m in modes)
    print(f"\n{'mode':{w}s} {'runs':>4s} {'hangs':>5s} {'aborts':>6s} {'failed':>6s} {'median job s':>12s}")
    for mode in modes:
        r = results[mode]
        ok = [t for s, t, _ in r if s in ("ok", "abort")]
        hangs = sum(s.startswith("hang") for s, _, _ in r)
        aborts = sum(s == "abort" for s, _, _ in r)
        failed = sum(s == "failed" for s, _, _ in r)
        med = f"{statistics.median(ok):.1f}" if ok else "-"
        print(f"{mode:{w}s} {len(r):4d} {hangs:5d} {aborts:6d} {failed:6d} {med:>12s}")
        for s, _, name in r:
            if s != "ok":
                print(f"    {name}: {s}")
    print(f"logs{' and stacks (hung ranks: *_pid*.txt, aborted ones: *_core_stack.txt)' if a.stacks else ''}: {logs}")
    return 0


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="jobs per mode")
    p.add_argument("--modes", default="eager,ours", help="eager, ours, ours:DIR (compiled_autograd from DIR/src), comma-separated")
    p.add_argument("--load", type=int, default=0, help="busy-loop processes running beside the jobs")
    p.add_argument("--src", help="mode ours imports compiled_autograd from SRC/src (another checkout)")
    p.add_argument("--model", choices=("mlp", "transformer"), default="transformer")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket-cap-mb", type=float, default=0.0001, help="DDP's bucket_cap_mb (0: DDP's default, 25)")
    p.add_argument("--timeout", type=float, default=60, help="seconds beyond the slowest finished job before a hang")
    p.add_argument("--no-stacks", dest="stacks", action="store_false", help="no stacks of hung or aborted ranks (gdb)")
    p.add_argument("--cores", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank-job", choices=("eager", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--rank-mode", choices=("eager", "ours"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = _args()
    if not (args.rank_job or args.rank_mode):
        args.cores = args.stacks
    if args.rank_mode:
        # as in a script written at module level: the model, the optimizer and the last loss
        # are module globals, freed in the interpreter's teardown (~Reducer -> ~ProcessGroupGloo
        # -> join the gloo workers, with the GIL held), and the process exits normally
        MODEL, OPT, LOSS = rank_main(args)
        sys.exit(0)
    sys.exit(job_main(args) if args.rank_job else main(args))
