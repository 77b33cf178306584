"""A graph you can run (issue 45 item 3): `ca.dump(path)` writes graph_<i>.py, a script that runs
the captured graph on its own -- nothing of ours imported -- and compares a backend with the
eager run of the same graph; a backend that fails names such a file in its error (NOTE [A graph
you can run], compile/repro.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import compiled_autograd as ca


def _run(script, *args, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILED_AUTOGRAD")}
    env["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__))  # (tests/: a user's backend by module:function)
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _mlp_steps(backend, hooked: bool, steps=2):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for step in range(steps):
        torch.manual_seed(step)
        h = m[0](torch.randn(5, 8))
        if hooked:
            h.register_hook(lambda g: g * 2)
        with ca.enable(backend, disk_cache=False):
            m[2](m[1](h)).square().sum().backward()
    return m


_CHILD = """
import runpy, sys, torch
from torch._dynamo.debug_utils import InputReader
assert "compiled_autograd" not in sys.modules
g = runpy.run_path(sys.argv[1], run_name="repro")
assert "compiled_autograd" not in sys.modules  # (the script stands on torch alone)
torch.manual_seed(0)
reader = InputReader(None)
g["load_args"](reader)
with torch.no_grad():
    outs = list(g["mod"](*reader.args))
torch.save((reader.args, outs), sys.argv[2])
"""


def test_a_dumped_graph_reproduces_the_graph_in_a_fresh_process(tmp_path):
    """The dumped script, run in a fresh process that imports nothing of ours, computes what the
    cached graph computes on the same inputs (its random ones, saved by the child): bitwise."""
    _mlp_steps("aot_eager", hooked=False)
    (entry,) = ca.graphs()
    files = ca.dump(tmp_path)
    script = str(tmp_path / "graph_0.py")
    assert script in files and str(tmp_path / "graph_0.txt") in files
    child = tmp_path / "child.py"
    child.write_text(_CHILD)
    out = tmp_path / "outs.pt"
    r = _run(str(child), script, str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    args, outs = torch.load(out)
    with torch.no_grad():
        want = list(entry.fn(list(args)))  # (the compiled graph, boxed: it takes the list)
    assert len(outs) == len(want) > 0
    for o, w in zip(outs, want):
        assert torch.equal(o, w)
    for backend in ("eager", "aot_eager"):
        r = _run(script, "--backend", backend)
        assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.inductor
def test_a_dumped_graph_with_calls_runs_on_inductor(tmp_path):
    """A graph with calls (a hook, in-graph AccumulateGrad): the calls stand in as zeros, what
    they are given is compared too; aot_eager and inductor each agree with the eager run."""
    _mlp_steps("aot_eager", hooked=True)
    ca.dump(tmp_path)
    text = (tmp_path / "graph_0.py").read_text()
    assert "compiled_autograd::call" in text
    for backend in ("aot_eager", "inductor"):
        r = _run(str(tmp_path / "graph_0.py"), "--backend", backend)
        assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]
        compared = int(r.stdout.strip().rsplit(" of ", 1)[1].split()[0])
        assert compared > 1, r.stdout  # (what the calls were given was compared, beside the graph's output)


def wrong_backend(gm, example_inputs):
    """A backend whose code returns its floating outputs in float64 (found by the first run's check)."""

    def run(*args):
        return [o.double() if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in gm(*args)]

    return run


def broken_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile")


def test_a_backend_whose_outputs_fail_the_check_names_a_script(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_AUTOGRAD_REPRO_DIR", str(tmp_path))
    with pytest.raises(ca.BackendOutputError, match=r"A script that reproduces it: (\S+\.py)") as info:
        _mlp_steps(wrong_backend, hooked=False, steps=1)
    path = str(info.value).rsplit("A script that reproduces it: ", 1)[1].strip()
    assert os.path.dirname(path) == str(tmp_path)
    r = _run(path, "--backend", "aot_eager")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    r = _run(path, "--backend", "test_repro:wrong_backend")  # the user's backend: its bug shows
    assert r.returncode == 1 and "torch.float64 vs eager's" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_backend_that_raises_names_a_script_with_the_real_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_AUTOGRAD_REPRO_DIR", str(tmp_path))
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="this backend cannot compile") as info:
        with ca.enable(broken_backend, fullgraph=True, disk_cache=False):
            (torch.randn(3, 4) @ w).sin().sum().backward()
    (note,) = [n for n in getattr(info.value, "__notes__", []) if "reproduces" in n]
    path = note.rsplit(": ", 1)[1]
    assert os.path.exists(path) and os.path.isdir(os.path.splitext(path)[0] + "_inputs")
    r = _run(path, "--real", "--backend", "aot_eager")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]
    r = _run(path, "--backend", "test_repro:broken_backend")
    assert r.returncode != 0 and "this backend cannot compile" in r.stderr
