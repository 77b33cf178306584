"""One (workload, mode) measurement, run in a fresh subprocess by benchmarks/run.py.

    python -m benchmarks.worker --workload mlp256 --mode ours:inductor --result out.json

Modes:
  eager                plain eager autograd
  torch-ca:BACKEND     torch's built-in compiled autograd:
                       `with torch._dynamo.compiled_autograd._enable(torch.compile(backend=BACKEND))`
  ours:BACKEND         `with compiled_autograd.enable(backend=BACKEND)`

What is measured (all in this one process, `torch.set_num_threads(2)`):
  1. one eager backward on the workload's inputs: the reference gradients;
  2. the first backward under the mode (capture + compile for the compiled modes);
  3. `--warmup` backwards under the mode, then at least `--iters` timed backwards of each, eager
     and the mode alternating in blocks of BLOCK (the first of each block untimed, see NOTE
     [Timing in blocks]), only `.backward()` timed with `time.perf_counter` (the forward runs
     outside the timed region), with the minor page faults of each. The ratio mode/eager of the
     medians comes from the same process, so load from other processes on the machine affects
     both about equally;
  4. the largest |grad - eager grad| over every parameter, after the first and the last backward;
  5. the floor: self CPU time of the matmul/conv/attention kernels in an eager backward
     (torch.profiler, the fastest of 5);
  6. for the compiled modes, the time spent inside the compiled graph during each timed backward
     (the callable the backend returned, wrapped with a timer), so that
     overhead = backward time - graph time (the per-backward cost of the library around the graph).
The result is written (also partially, after each phase) as JSON to --result.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.workloads import Stream, build, count_nodes  # noqa: E402

pc = time.perf_counter

# Self CPU time of these ops in an eager backward is "the floor": the matmul/conv kernels alone.
FLOOR_OPS = re.compile(
    r"^aten::("
    r"mm|addmm|bmm|baddbmm|addbmm|_addmm_activation|linear_backward|"
    r"convolution_backward|mkldnn_convolution(_backward)?.*|_slow_conv2d_backward|"
    r"thnn_conv2d_backward|_convolution_double_backward|"
    r"_scaled_dot_product_[a-z_]*backward[a-z_]*|_flash_attention_backward|_efficient_attention_backward"
    r")$"
)


def _proc_mb(field: str) -> float | None:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MB; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# NOTE [Timing in blocks]
# The allocator's state carries over from one backward to the next: glibc's
# malloc returns freed memory to the OS or keeps it depending on what was
# allocated and freed before (its mmap and trim thresholds adapt), and memory
# it returned must be faulted in again (zeroed pages) at the next allocation.
# Eager and a compiled graph allocate and free differently, so a backward that
# follows the other mode's backward runs in a memory state that neither mode
# sees in a training loop of its own: on the D=1024 MLP, eager alone takes
# ~8,000 page faults per backward and ours alone ~100, but strictly
# alternated, the one that follows the other takes the 8,000. So the modes
# alternate by blocks of BLOCK backwards and the first of each block, which
# pays for the switch, is not timed; minor page faults per backward are
# reported with the times.
BLOCK = 4


_SYNC = [lambda: None]  # the device's synchronize (--device), so that a timed backward is all done


def sync() -> None:
    _SYNC[0]()


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def median(xs):
    return statistics.median(xs) if xs else None


class Mode:
    """How a backward runs: a context manager around `.backward()` plus counters."""

    def __init__(self, spec: str, graph_timing: bool = True):
        self.spec = spec
        self.kind, _, rest = spec.partition(":")
        self.backend, _, self.option = rest.partition(":")
        self.graph_times: list[float] = []
        self.graph_timing = graph_timing and self.kind != "eager"
        if self.kind == "eager":
            self.ctx = contextlib.nullcontext
        elif self.kind == "ours":
            self._setup_ours()
        elif self.kind == "torch-ca":
            self._setup_torch_ca()
        elif self.kind == "h2h":  # ours and torch's, both with this backend, in one process
            self.graph_timing = False
            self.option = "sync"
            self._setup_ours()
            self.ours_ctx = self.ctx
            self._setup_torch_ca()
            self.theirs_ctx = self.ctx
        else:
            raise ValueError(f"unknown mode {spec!r}")

    def _timed(self, fn):
        times = self.graph_times

        def timed(*args, **kwargs):
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append(pc() - t0)

        # keep the callable's markers (compiled_autograd's boxed calling convention)
        timed.__dict__.update(getattr(fn, "__dict__", {}))
        return timed

    def _setup_ours(self):
        import compiled_autograd as ca

        ca.reset()
        self.ca = ca
        # Load the C++ helper now (cpp_extension.load: a file lock + a ninja up-to-date check,
        # or a ~30 s build if the source changed) so that it is not counted in the first
        # backward; its time is reported on its own as native_load_s.
        self.native_load_s = None
        try:
            from compiled_autograd import native

            t0 = pc()
            native.load()
            self.native_load_s = pc() - t0
        except (ImportError, AttributeError):
            pass
        if self.graph_timing:
            # Wrap whatever the backend returns with a timer (compile.backends.compile_graph is
            # the one place the library turns a captured graph into a callable).
            try:
                from compiled_autograd.compile import backends

                original = backends.compile_graph

                def compile_graph(*args, **kwargs):
                    return self._timed(original(*args, **kwargs))

                backends.compile_graph = compile_graph
            except (ImportError, AttributeError):
                self.graph_timing = False
        backend = self.backend
        kwargs = {}
        if self.option == "sync":  # compile in the foreground (no background compile)
            kwargs["background"] = False
        elif self.option:
            raise ValueError(f"unknown option {self.option!r} in mode {self.spec!r}")
        self.ctx = lambda: ca.enable(backend=backend, **kwargs)

    def synchronize(self) -> float:
        """Wait for our background compiles (if any); the seconds waited."""
        if self.kind != "ours" or not hasattr(getattr(self, "ca", None), "synchronize"):
            return 0.0
        t0 = pc()
        self.ca.synchronize()
        return pc() - t0

    def _setup_torch_ca(self):
        import torch._dynamo
        from torch._dynamo import compiled_autograd as tca

        torch._dynamo.reset()
        base = torch.compile(backend=self.backend)
        if self.graph_timing:
            # torch.compile(gm) is lazy: dynamo/the backend compile on its first call, which
            # happens inside the first backward (and inside this timer).
            def compiler_fn(gm):
                return self._timed(base(gm))
        else:
            compiler_fn = base
        self.ctx = lambda: tca._enable(compiler_fn)

    def stats(self) -> dict:
        if self.kind == "h2h":
            return {"ours": self._ours_stats(), "theirs": self._torch_ca_stats()}
        if self.kind == "ours":
            return self._ours_stats()
        if self.kind == "torch-ca":
            return self._torch_ca_stats()
        return {"compiles": 0}

    def _ours_stats(self) -> dict:
        s = self.ca.stats()
        out = {}
        for k in (
            "captures",
            "dynamic_captures",
            "hits",
            "eager_fallbacks",
            "learning_backwards",
            "opaque_nodes",
            "trace_seconds",
            "compile_seconds",
            "compiles_pending",
            "compile_failures",
            "disk_hits",
        ):
            if hasattr(s, k):
                out[k] = getattr(s, k)
        for k in ("fallback_reasons", "opaque_reasons"):
            if getattr(s, k, None):
                out[k] = {str(r): n for r, n in getattr(s, k).items()}
        out["compiles"] = out.get("captures", 0)
        if out.get("disk_hits"):  # a graph loaded from the on-disk cache is still compiled
            out["compiles"] += out["disk_hits"]
        return out

    def _torch_ca_stats(self) -> dict:
        from torch._dynamo.utils import counters

        out = {f"ca_{k}": v for k, v in counters["compiled_autograd"].items()}
        out["dynamo_unique_graphs"] = counters["stats"].get("unique_graphs", 0)
        out["dynamo_calls_to_compile"] = counters["stats"].get("calls_captured", 0)
        gb = counters.get("graph_break") or {}
        if gb:
            out["graph_breaks"] = {str(k)[:200]: v for k, v in gb.items()}
        out["compiles"] = counters["compiled_autograd"].get("captures", 0)
        return out


def zero(params):
    for p in params:
        p.grad = None


def grads(params):
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def max_diff(ref, params) -> float:
    worst = 0.0
    for r, p in zip(ref, params):
        g = p.grad
        if (r is None) != (g is None):
            return float("inf")
        if r is None:
            continue
        if r.shape != g.shape:
            return float("inf")
        worst = max(worst, (r - g).abs().max().item())
    return worst


def tensor_peak_mb(fn) -> float:
    """The most tensor memory alive at once while fn runs, counting only what fn allocates (MB).

    From the profiler's allocator events (`profile_memory=True`: every allocation and free of the
    CPU allocator, compiled code's buffers included, with its time): the running sum of their
    sizes, in time order, and its maximum. Unlike the resident set, this is exact and leaves out
    the allocator's caching and the compiler's own memory."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def floor_of(wl, params, runs: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    best = None
    for _ in range(runs):
        zero(params)
        loss = wl.loss()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wl.backward(loss)
        ops = {}
        total = 0.0
        for evt in prof.key_averages():
            total += evt.self_cpu_time_total
            if FLOOR_OPS.match(evt.key):
                ops[evt.key] = ops.get(evt.key, 0.0) + evt.self_cpu_time_total
        floor = sum(ops.values())
        if best is None or floor < best["floor_s"] * 1e6:
            best = {"floor_s": floor / 1e6, "floor_ops_us": ops, "profiled_self_cpu_total_s": total / 1e6}
    return best


def _first_loss(wl, res: dict):
    """The workload's description in res, and a loss (the params' grads cleared) whose autograd
    nodes are counted there."""
    res["description"] = wl.description
    res["num_params"] = sum(p.numel() for p in wl.params)
    zero(wl.params)
    loss = wl.loss()
    res["nodes"] = count_nodes(loss)
    return loss


def run_fixed(wl, mode: Mode, args, res: dict, save):
    params = wl.params

    # 1. eager reference
    loss = _first_loss(wl, res)
    sync()
    t0 = pc()
    wl.backward(loss)
    sync()
    res["eager_reference_backward_s"] = pc() - t0
    ref = grads(params)
    save()

    # 2. first backward under the mode
    zero(params)
    loss = wl.loss()
    gc.collect()
    mode.graph_times.clear()
    sync()
    t0 = pc()
    with mode.ctx():
        wl.backward(loss)
    sync()
    res["first_backward_s"] = pc() - t0
    # ours with saved-tensor hooks that give no prediction: the first backward runs in eager to
    # learn what they return (stats().learning_backwards); the capture is the next one, and
    # `first_backward_s` counts both
    for _ in range(2):
        s = mode.stats() or {}
        if not s.get("learning_backwards") or s.get("captures") or s.get("disk_hits") or s.get("eager_fallbacks"):
            break
        zero(params)
        loss = wl.loss()
        sync()
        t1 = pc()
        with mode.ctx():
            wl.backward(loss)
        sync()
        res["first_backward_s"] += pc() - t1
        res["learning_backwards_before_capture"] = s["learning_backwards"]
    res["first_graph_s"] = sum(mode.graph_times) if mode.graph_times else None
    # ours + inductor compiles in a background thread by default (the first backwards replay the
    # traced graph meanwhile): wait for it, so that the steady state is the compiled graph's
    res["background_compile_wait_s"] = mode.synchronize()
    res["time_to_compiled_s"] = res["first_backward_s"] + res["background_compile_wait_s"]
    res["max_grad_diff_first"] = max_diff(ref, params)
    res["peak_rss_after_first_mb"] = rss_mb()
    res["stats_after_first"] = mode.stats()
    save()

    # 3. warm-up, then eager and mode in alternating blocks
    for _ in range(args.warmup):
        zero(params)
        loss = wl.loss()
        with mode.ctx():
            wl.backward(loss)
    eager_t, mode_t, graph_t, eager_f, mode_f = [], [], [], [], []

    def one(ctx, out, faults, graph=None):
        zero(params)
        loss = wl.loss()
        mode.graph_times.clear()
        f0 = _minor_faults()
        sync()
        t0 = pc()
        with ctx():
            wl.backward(loss)
        sync()
        out.append(pc() - t0)
        faults.append(_minor_faults() - f0)
        if graph is not None:
            graph.append(sum(mode.graph_times) if mode.graph_times else None)

    def block(ctx, out, faults, graph=None):
        # BLOCK backwards in a row, the first one untimed: it runs in the memory state the other
        # mode left behind (see NOTE [Timing in blocks])
        one(ctx, [], [], [] if graph is not None else None)
        for _ in range(BLOCK - 1):
            one(ctx, out, faults, graph)

    gc.collect()
    # at least --iters backwards each, and more for fast backwards: until the mode's backwards
    # (median x count) reach --min-time seconds (at most 25 x --iters; the median, so that a few
    # slow outliers caused by other load do not end the loop early); eager and mode alternate by
    # blocks, in alternating order
    i = 0
    while len(mode_t) < args.iters or (len(mode_t) * median(mode_t) < args.min_time and len(mode_t) < 25 * args.iters):
        i += 1
        if i % 2 == 0:
            block(contextlib.nullcontext, eager_t, eager_f)
            block(mode.ctx, mode_t, mode_f, graph_t)
        else:
            block(mode.ctx, mode_t, mode_f, graph_t)
            block(contextlib.nullcontext, eager_t, eager_f)
    res["minor_faults_per_backward"] = median(mode_f)
    res["eager_minor_faults_per_backward"] = median(eager_f)
    res["max_grad_diff_last"] = max_diff(ref, params)
    res["max_grad_diff"] = max(res["max_grad_diff_first"], res["max_grad_diff_last"])
    res["eager_backward_times_s"] = eager_t
    res["backward_times_s"] = mode_t
    res["timed_pairs"] = len(mode_t)
    res["steady_median_s"] = median(mode_t)
    res["eager_steady_median_s"] = median(eager_t)
    res["steady_min_s"] = min(mode_t) if mode_t else None
    res["eager_steady_min_s"] = min(eager_t) if eager_t else None
    if res["steady_median_s"] and res["eager_steady_median_s"]:
        res["vs_eager"] = res["steady_median_s"] / res["eager_steady_median_s"]
        res["vs_eager_min"] = res["steady_min_s"] / res["eager_steady_min_s"]
    nodes = res["nodes"]
    res["per_node_us"] = res["steady_median_s"] / nodes * 1e6 if mode_t else None
    res["eager_per_node_us"] = res["eager_steady_median_s"] / nodes * 1e6 if eager_t else None
    if mode.graph_timing and graph_t and all(g is not None for g in graph_t):
        res["graph_median_s"] = median(graph_t)
        over = [m - g for m, g in zip(mode_t, graph_t)]
        res["overhead_median_s"] = median(over)
        res["overhead_per_node_us"] = res["overhead_median_s"] / nodes * 1e6
    elif mode.graph_timing and mode_t:
        res["graph_timing_note"] = "some timed backwards did not call a compiled graph (eager fallback?)"
    res["stats"] = mode.stats()
    res["peak_rss_mb"] = rss_mb()
    save()

    # 4b. memory of one backward: how far the resident set rises above where it was when the
    # backward started (the peak is reset right before), eager and mode alternating, median of 3
    def bwd_peak(ctx):
        zero(params)
        loss = wl.loss()
        gc.collect()
        if torch.cuda.is_available() and params and params[0].is_cuda:
            # on the GPU: the most device memory allocated at once, above what the backward started with
            sync()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with ctx():
                wl.backward(loss)
            sync()
            return (torch.cuda.max_memory_allocated() - before) / 2**20
        before = _proc_mb("VmRSS")
        if before is None or not _reset_peak_rss():
            return None
        with ctx():
            wl.backward(loss)
        return _proc_mb("VmHWM") - before

    peaks, eager_peaks = [], []
    for _ in range(3):
        eager_peaks.append(bwd_peak(contextlib.nullcontext))
        peaks.append(bwd_peak(mode.ctx))
    if None not in peaks + eager_peaks:
        res["bwd_peak_mb"], res["eager_bwd_peak_mb"] = median(peaks), median(eager_peaks)
    save()

    # 4c. tensor memory of one training step (forward + backward), from the allocator's events
    # (the previous step's .grad are freed before, outside the measured region: their frees would
    # count against the step)
    def step(ctx):
        loss = wl.loss()
        with ctx():
            wl.backward(loss)

    def measured(ctx):
        zero(params)
        gc.collect()
        return tensor_peak_mb(lambda: step(ctx))

    if not args.no_profile:
        steps, eager_steps = [], []
        for _ in range(3):
            eager_steps.append(measured(contextlib.nullcontext))
            steps.append(measured(mode.ctx))
        res["step_tensor_peak_mb"], res["eager_step_tensor_peak_mb"] = median(steps), median(eager_steps)
        res["param_mb"] = sum(p.numel() * p.element_size() for p in params) / 2**20
    save()

    # 5. the floor (eager backward, profiled)
    if not args.no_profile:
        res.update(floor_of(wl, params))
        if res.get("floor_s"):
            res["vs_floor"] = res["steady_median_s"] / res["floor_s"]
            res["eager_vs_floor"] = res["eager_steady_median_s"] / res["floor_s"]
    save()


def run_head_to_head(wl, mode: Mode, args, res: dict, save):
    """Ours and torch's compiled autograd, both with one backend (ours compiling in the
    foreground), and eager, in one process: each compiles once, then the three alternate in
    blocks, in a rotating order, so that every ratio between them is measured under the same
    load and process history (the per-mode rows compare torch's with ours across processes,
    where the allocator's state alone moves a backward by 10-20%)."""
    params = wl.params
    wl.backward(_first_loss(wl, res))
    ref = grads(params)
    ctxs = {"eager": contextlib.nullcontext, "ours": mode.ours_ctx, "theirs": mode.theirs_ctx}

    def one(name):
        zero(params)
        loss = wl.loss()
        sync()
        t0 = pc()
        with ctxs[name]():
            wl.backward(loss)
        sync()
        return pc() - t0

    for name in ("ours", "theirs"):
        gc.collect()
        res[f"{name}_first_backward_s"] = one(name)
        res[f"{name}_max_grad_diff"] = max_diff(ref, params)
        save()
    for _ in range(args.warmup):
        for name in ctxs:
            one(name)
    times: dict = {name: [] for name in ctxs}
    orders = [("eager", "ours", "theirs"), ("ours", "theirs", "eager"), ("theirs", "eager", "ours")]
    gc.collect()
    i = 0
    while len(times["ours"]) < args.iters or (
        len(times["ours"]) * median(times["ours"]) < args.min_time and len(times["ours"]) < 25 * args.iters
    ):
        for name in orders[i % 3]:
            one(name)  # (untimed: it runs in the memory state the previous mode left behind)
            times[name] += [one(name) for _ in range(BLOCK - 1)]
            if name != "eager":
                res[f"{name}_max_grad_diff"] = max(res[f"{name}_max_grad_diff"], max_diff(ref, params))
        i += 1
    for name, ts in times.items():
        res[f"{name}_times_s"] = ts
        res[f"{name}_median_s"] = median(ts)
        res[f"{name}_min_s"] = min(ts)
    for a, b in (("ours", "eager"), ("theirs", "eager"), ("ours", "theirs")):
        res[f"{a}_vs_{b}"] = res[f"{a}_median_s"] / res[f"{b}_median_s"]
        res[f"{a}_vs_{b}_min"] = res[f"{a}_min_s"] / res[f"{b}_min_s"]
    res["stats"] = mode.stats()
    save()
    if not args.no_profile:
        res.update(floor_of(wl, params))
        if res.get("floor_s"):
            for name in ctxs:
                res[f"{name}_vs_floor"] = res[f"{name}_median_s"] / res["floor_s"]
    save()


def run_stream(st: Stream, mode: Mode, args, res: dict, save):
    """The whole stream, in order. Two totals per pass: the sum of the `.backward()` times, and the
    wall time of the whole loop (forward + backward + copying the grads), plus, for ours, waiting
    for background compiles at the end: with a background compile part of the compile work
    overlaps the forwards, so only the loop's wall time counts all of it."""
    params = st.params
    res["description"] = st.description
    res["num_params"] = sum(p.numel() for p in params)
    res["batches"] = len(st.batches)

    def one_pass(ctx, after_each=None):
        times, got = [], []
        gc.collect()
        t_loop = pc()
        for i, (x, _) in enumerate(st.batches):
            zero(params)
            loss = st.loss_of(x)
            sync()
            t0 = pc()
            with ctx():
                loss.backward()
            sync()
            times.append(pc() - t0)
            got.append(grads(params))
            if after_each is not None:
                after_each(i, times[-1])
        wait = mode.synchronize() if ctx is not contextlib.nullcontext else 0.0
        return times, got, pc() - t_loop, wait

    # eager: a first pass warms eager up and gives the reference gradients; a second pass gives the
    # same-process eager totals (so every mode's pass, like the second eager one, runs warm)
    _, ref, first_eager_wall, _ = one_pass(contextlib.nullcontext)
    res["eager_first_pass_loop_wall_s"] = first_eager_wall
    eager_t, _, eager_wall, _ = one_pass(contextlib.nullcontext)
    zero(params)
    res["nodes"] = count_nodes(st.loss_of(st.batches[0][0]))
    res["eager_total_s"] = sum(eager_t)
    res["eager_loop_wall_s"] = eager_wall
    save()

    compiled_at = []
    state = {"before": mode.stats().get("compiles", 0)}

    def after_each(i, t):
        after = mode.stats().get("compiles", 0)
        if after != state["before"]:
            compiled_at.append({"step": i, "shape": list(st.batches[i][1]), "new_compiles": after - state["before"], "time_s": t})
        state["before"] = after
        if i == 0:
            res["peak_rss_after_first_mb"] = rss_mb()

    times, got, wall, wait = one_pass(mode.ctx, after_each)
    diffs = []
    for r, g in zip(ref, got):
        worst = 0.0
        for a, b in zip(r, g):
            if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
                worst = float("inf")
                break
            if a is not None:
                worst = max(worst, (a - b).abs().max().item())
        diffs.append(worst)
    res["first_backward_s"] = times[0]
    res["total_s"] = sum(times)
    res["loop_wall_s"] = wall
    res["background_compile_wait_s"] = wait
    res["vs_eager"] = res["loop_wall_s"] / res["eager_loop_wall_s"]
    res["vs_eager_backward_sum"] = res["total_s"] / res["eager_total_s"]
    res["backward_times_s"] = times
    res["eager_backward_times_s"] = eager_t
    res["shapes"] = [list(s) for _, s in st.batches]
    res["distinct_shapes"] = len({tuple(s) for _, s in st.batches})
    res["compiled_at"] = compiled_at
    compiling_steps = {c["step"] for c in compiled_at}
    rest = [t for i, t in enumerate(times) if i not in compiling_steps]
    rest_eager = [t for i, t in enumerate(eager_t) if i not in compiling_steps]
    res["non_compiling_steps"] = len(rest)
    res["non_compiling_total_s"] = sum(rest)
    res["non_compiling_eager_total_s"] = sum(rest_eager)
    res["last10_total_s"] = sum(times[-10:])
    res["last10_eager_total_s"] = sum(eager_t[-10:])
    res["max_grad_diff"] = max(diffs)
    res["max_grad_diff_per_step"] = diffs
    res["stats"] = mode.stats()
    res["peak_rss_mb"] = rss_mb()
    save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-graph-timing", action="store_true")
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.device != "cpu":
        # every workload's modules and inputs are made on the device; the floor's and the tensor
        # peak's profiles read the CPU allocator and CPU-side op times: not measured there
        torch.set_default_device(args.device)
        args.no_profile = True
        args.no_graph_timing = True  # (the compiled graph's CPU time says nothing of its kernels')
        _SYNC[0] = getattr(torch, torch.device(args.device).type).synchronize
    res = {
        "workload": args.workload,
        "mode": args.mode,
        "status": "running",
        "iters": args.iters,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "device": args.device,
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "graph_cache_dir": os.environ.get("COMPILED_AUTOGRAD_GRAPH_DIR"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg_start": os.getloadavg(),
        "pid": os.getpid(),
    }
    out = Path(args.result)

    def save():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        tmp.replace(out)

    t_start = pc()
    try:
        mode = Mode(args.mode, graph_timing=not args.no_graph_timing)
        wl = build(args.workload, args.quick)
        res["setup_s"] = pc() - t_start
        res["native_load_s"] = getattr(mode, "native_load_s", None)
        if mode.kind == "h2h":
            if isinstance(wl, Stream):
                raise ValueError("the head-to-head mode takes the fixed workloads, not the stream")
            run_head_to_head(wl, mode, args, res, save)
        elif isinstance(wl, Stream):
            run_stream(wl, mode, args, res, save)
        else:
            run_fixed(wl, mode, args, res, save)
        res["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - report every failure as a row
        res["status"] = "error"
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-6000:]
        try:
            res["stats"] = mode.stats()  # noqa: F821
        except Exception:
            pass
    res["process_s"] = pc() - t_start
    res["loadavg_end"] = os.getloadavg()
    res["peak_rss_mb"] = rss_mb()
    save()
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
