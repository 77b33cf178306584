"""The on-disk graph cache: a later process loads what an earlier one traced."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import compiled_autograd as ca
from compiled_autograd.cache import disk as diskcache
from helpers import assert_grads_equal, parity


def _run(model, x, **options):
    """One eager and one compiled backward of the model, the disk cache on (helpers.parity);
    the counters are the test's."""
    parity(
        lambda: model(x).pow(2).mean(), model.parameters(), lambda step: (), "aot_eager", steps=1, captures=None, disk_cache=True, **options
    )


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


@pytest.mark.slow
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
    out = [
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()[-2:]
        for _ in range(2)
    ]
    assert out == [["1", "0"], ["0", "1"]]


@pytest.mark.slow
@pytest.mark.inductor
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
    out = [
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()[-5:]
        for _ in range(2)
    ]
    assert out == [["True", "1", "0", "1", "0"], ["True", "0", "1", "1", "1"]], out


def test_a_vector_isa_probe_that_loaded_once_is_not_run_again(tmp_path, monkeypatch):
    # NOTE [Remembered vector-ISA probes]: a success is remembered by file (path, size, mtime)
    # and CPU flags, in our cache directory; a failure is probed again
    from torch._inductor.cpu_vec_isa import VecISA

    from compiled_autograd.compile import inductor_patches

    monkeypatch.setenv("COMPILED_AUTOGRAD_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def child_process_probe(self, path):
        calls.append(path)
        return "bad" not in path

    monkeypatch.setattr(VecISA, "_probe_load", child_process_probe)
    monkeypatch.setattr(inductor_patches, "_isa_probes_patched", False)
    inductor_patches._remember_vec_isa_probes()
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


def _backward(fn, **options):
    """One backward of fn on a fresh leaf, with the disk cache on; its stats."""
    x = torch.randn(3, requires_grad=True)
    with ca.enable("eager", disk_cache=True, **options):
        fn(x).sum().backward()
    return ca.stats()


def _cache_warnings(record):
    return [w for w in record if "disk cache" in str(w.message)]


@pytest.mark.parametrize("where", ["a file", "under a file"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_cache_dir_that_cannot_be_made_is_ignored_with_one_warning(tmp_path, monkeypatch, where, fullgraph):
    # review item 8: FileExistsError/FileNotFoundError made every backward an eager fallback,
    # and raised under fullgraph=True
    file = tmp_path / "file"
    file.write_text("not a directory")
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(file if where == "a file" else file / "graphs"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        s = _backward(torch.sin, fullgraph=fullgraph)
        assert (s.captures, s.eager_fallbacks) == (1, 0), s.fallback_reasons
        ca.reset()  # the next backward looks on disk again
        s = _backward(torch.sin, fullgraph=fullgraph)
        assert (s.captures, s.eager_fallbacks) == (1, 0), s.fallback_reasons
    assert len(_cache_warnings(record)) == 1, [str(w.message) for w in record]
    assert file.read_text() == "not a directory"


def test_an_os_error_on_load_or_store_never_fails_a_backward(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(tmp_path))

    def broken(*args, **kwargs):
        raise PermissionError("no")

    _backward(torch.cos)  # stored: the next process would load it
    assert len(list(tmp_path.glob("*.graph"))) == 1
    monkeypatch.setattr(diskcache, "_secret", broken)
    for _ in range(2):  # a load, then a store, that fail
        ca.reset()
        s = _backward(torch.cos, fullgraph=True)
        assert (s.captures, s.disk_hits, s.eager_fallbacks) == (1, 0, 0), s.fallback_reasons


def _graph_name(tmp_path, monkeypatch, fn):
    """The file name a graph of fn is stored under (learned in a scratch directory)."""
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(scratch))
    _backward(fn)
    ca.reset()
    (path,) = scratch.glob("*.graph")
    return path


def test_a_store_does_not_follow_a_symlink_at_its_temp_path(tmp_path, monkeypatch):
    # review item 9: the temp file was opened with O_CREAT|O_TRUNC at a predictable name
    name = _graph_name(tmp_path, monkeypatch, torch.tan).name
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("precious")
    monkeypatch.setattr(diskcache, "_tmp_suffix", lambda: "fixed", raising=False)
    stem = name[: -len(".graph")]
    for tmp in {f"{stem}.tmp{os.getpid()}", f"{stem}.tmp{os.getpid()}-fixed"}:  # before and after the fix
        (cache / tmp).symlink_to(target)
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(cache))
    s = _backward(torch.tan)
    assert (s.captures, s.eager_fallbacks) == (1, 0)
    assert target.read_text() == "precious"
    assert not (cache / name).exists()
    ca.reset()
    monkeypatch.setattr(diskcache, "_tmp_suffix", lambda: "other", raising=False)
    _backward(torch.tan)  # a name that is free: stored, and no temp file left behind
    assert (cache / name).exists()
    assert sorted(p.name for p in cache.iterdir() if not p.is_symlink()) == [name]


def test_a_cache_dir_others_can_write_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(cache))
    with pytest.warns(UserWarning, match="disk cache"):
        s = _backward(torch.sin)
    assert (s.captures, s.eager_fallbacks) == (1, 0)
    assert not list(cache.iterdir())
    assert cache.stat().st_mode & 0o777 == 0o777  # not ours to change


def test_a_cache_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    uid = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    monkeypatch.setattr(os, "getuid", lambda: uid)
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(cache))
    with pytest.warns(UserWarning, match="disk cache"):
        s = _backward(torch.sin)
    assert (s.captures, s.eager_fallbacks) == (1, 0)
    assert not list(cache.iterdir())


def test_the_secret_is_not_read_or_written_through_a_symlink(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("COMPILED_AUTOGRAD_CACHE_DIR", str(root))
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(root / "graphs"))
    known = tmp_path / "known"
    known.write_bytes(b"k" * 40)  # a key its writer knows: graphs signed with it could be forged
    (root / "secret").symlink_to(known)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        s = _backward(torch.exp)
    assert (s.captures, s.eager_fallbacks) == (1, 0)
    assert known.read_bytes() == b"k" * 40
    assert not list((root / "graphs").glob("*.graph"))


def test_the_secret_is_made_once_and_private(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_AUTOGRAD_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(tmp_path / "graphs"))
    _backward(torch.exp)
    secret = tmp_path / "root" / "secret"
    data = secret.read_bytes()
    assert len(data) == 32 and secret.stat().st_mode & 0o777 == 0o600
    ca.reset()
    s = _backward(torch.exp)
    assert s.disk_hits == 1 and secret.read_bytes() == data


def test_the_disk_cache_is_bounded_least_recently_used_first(tmp_path, monkeypatch):
    # review item 10: every structure left a file, forever
    fns = [torch.sin, torch.cos, torch.exp, torch.tanh]
    sizes = []
    for fn in fns:  # each graph's size on disk, learned in scratch directories
        scratch = tmp_path / f"scratch{len(sizes)}"
        monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(scratch))
        _backward(fn)
        ca.reset()
        (path,) = scratch.glob("*.graph")
        sizes.append(path.stat().st_size)
    cache = tmp_path / "cache"
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(cache))
    names = []
    for i, fn in enumerate(fns[:3]):
        _backward(fn)
        (path,) = set(cache.glob("*.graph")) - set(names)
        names.append(path)
        t = 1_000_000_000 + i * 1000  # stored long ago, in this order
        os.utime(path, (t, t))
    ca.reset()
    s = _backward(fns[0])  # the oldest file, loaded: now the most recently used
    assert s.disk_hits == 1
    budget = sizes[0] + sizes[3] + sizes[2] - 1  # room for fns[0] and fns[3], not for fns[1] or fns[2]
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR_MAX_BYTES", str(budget))
    _backward(fns[3])
    left = set(cache.glob("*.graph"))
    assert names[0] in left and names[1] not in left and names[2] not in left and len(left) == 2
    assert sum(p.stat().st_size for p in left) <= budget
