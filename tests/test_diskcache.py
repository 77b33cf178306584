"""The on-disk graph cache: a later process loads what an earlier one traced."""

import os
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn

import compiled_autograd as ca
from compiled_autograd import diskcache
from helpers import assert_grads_equal, grads_of


def _run(model, x, **options):
    params = list(model.parameters())
    for p in params:
        p.grad = None
    model(x).pow(2).mean().backward()
    want = grads_of(params)
    for p in params:
        p.grad = None
    loss = model(x).pow(2).mean()
    with ca.enable("aot_eager", disk_cache=True, **options):
        loss.backward()
    assert_grads_equal(grads_of(params), want)


def test_graph_is_loaded_instead_of_traced(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    _run(model, torch.randn(4, 8))
    assert ca.stats().captures == 1 and len(list(tmp_path.glob("*.graph"))) == 1
    ca.reset()  # a new process, as far as the in-memory cache knows
    _run(model, torch.randn(4, 8))
    s = ca.stats()
    assert (s.captures, s.disk_hits) == (0, 1)
    assert "loaded from the disk cache" in ca.explain()


def test_tampered_file_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(tmp_path))
    model = nn.Linear(3, 3)
    _run(model, torch.randn(2, 3))
    (path,) = tmp_path.glob("*.graph")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    ca.reset()
    _run(model, torch.randn(2, 3))
    s = ca.stats()
    assert (s.captures, s.disk_hits) == (1, 0)  # traced again, not loaded


def test_custom_function_graphs_are_not_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(tmp_path))

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, requires_grad=True)
    with ca.enable("eager", disk_cache=True):
        Double.apply(x).sum().backward()
    assert not list(tmp_path.glob("*.graph"))


def test_second_process_skips_the_trace(tmp_path):
    script = textwrap.dedent(
        """
        import torch, torch.nn as nn, compiled_autograd as ca
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2))
        with ca.enable("aot_eager"):
            model(torch.randn(4, 8)).pow(2).mean().backward()
        s = ca.stats()
        print(s.captures, s.disk_hits)
        """
    )
    env = dict(os.environ, COMPILED_AUTOGRAD_GRAPH_DIR=str(tmp_path), COMPILED_AUTOGRAD_DISK_CACHE="1")
    out = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()[-2:] for _ in range(2)]
    assert out == [["1", "0"], ["0", "1"]]


def test_second_process_gets_inductors_code_from_its_cache(tmp_path):
    # NOTE [Inductor's FX graph cache for our graphs]: the second process loads the graph
    # (no trace) and inductor's generated code (an FX graph cache hit: no lowering, no
    # codegen); both processes' compiled backwards match eager, on a hit too
    script = textwrap.dedent(
        """
        import torch, torch.nn as nn, compiled_autograd as ca
        from torch._dynamo.utils import counters
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2))
        params = list(model.parameters())
        ok = True
        for step in range(2):
            x = torch.randn(4, 8)
            for p in params:
                p.grad = None
            model(x).pow(2).mean().backward()
            want = [p.grad.clone() for p in params]
            for p in params:
                p.grad = None
            with ca.enable("inductor", background=False):
                model(x).pow(2).mean().backward()
            ok = ok and all(torch.allclose(p.grad, w, rtol=1e-4, atol=1e-6) for p, w in zip(params, want))
        s = ca.stats()
        print(ok, s.captures, s.disk_hits, s.hits, counters["inductor"]["fxgraph_cache_hit"])
        """
    )
    env = dict(
        os.environ,
        COMPILED_AUTOGRAD_GRAPH_DIR=str(tmp_path / "graphs"),
        COMPILED_AUTOGRAD_DISK_CACHE="1",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    out = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()[-5:] for _ in range(2)]
    assert out == [["True", "1", "0", "1", "0"], ["True", "0", "1", "1", "1"]], out


def test_a_vector_isa_probe_that_loaded_once_is_not_run_again(tmp_path, monkeypatch):
    # NOTE [Remembered vector-ISA probes]: a success is remembered by file (path, size, mtime)
    # and CPU flags, in our cache directory; a failure is probed again
    from torch._inductor.cpu_vec_isa import VecISA

    from compiled_autograd import backends

    monkeypatch.setenv("COMPILED_AUTOGRAD_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def child_process_probe(self, path):
        calls.append(path)
        return "bad" not in path

    monkeypatch.setattr(VecISA, "_probe_load", child_process_probe)
    monkeypatch.setattr(backends, "_isa_probes_patched", False)
    backends._remember_vec_isa_probes()
    good, bad = tmp_path / "good.so", tmp_path / "bad.so"
    good.write_bytes(b"x")
    bad.write_bytes(b"x")
    probe = VecISA._probe_load
    assert probe(None, str(good)) and probe(None, str(good))
    assert not probe(None, str(bad)) and not probe(None, str(bad))
    assert calls == [str(good), str(bad), str(bad)]
    assert (tmp_path / "cache" / "vec_isa_probes.json").stat().st_mode & 0o777 == 0o600
    good.write_bytes(b"xy")  # another library at that path
    assert probe(None, str(good))
    assert calls[-1] == str(good) and len(calls) == 4


def test_a_loaded_graph_is_the_traced_one(tmp_path, monkeypatch):
    # NOTE [Graphs stored as their nodes]: unpickling a GraphModule traced its code again, which
    # ran the factories of the backward formulas (sgn's _efficientzerotensor, a zeros) and
    # kept their results as constants: the loaded graph returned one shared tensor, a plain
    # zero tensor where eager's and the traced graph's was a ZeroTensor
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(tmp_path))

    def step(x, w):
        x.grad = w.grad = None
        (x.sgn().sum() + torch.zeros(3).index_put((torch.tensor([0, 2]),), w).mul(x).sum()).backward()
        return x.grad, w.grad

    codes = []
    for process in range(2):
        ca.reset()
        for values in range(2):  # the second a hit of the first's entry
            torch.manual_seed(values)
            x, w = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
            want = [g.clone() for g in step(x, w)]
            want_zero = x.grad._is_zerotensor()
            with ca.enable("eager", disk_cache=True):
                got = step(x, w)
            assert_grads_equal(list(got), want)
            assert x.grad._is_zerotensor() == want_zero
        s = ca.stats()
        assert (s.captures, s.disk_hits, s.hits) == ((1, 0, 1) if process == 0 else (0, 1, 1)), s
        (entry,) = ca.graphs()
        codes.append(entry.graph.code)
    assert "_tensor_constant" not in codes[1]
    assert codes[1] == codes[0]
