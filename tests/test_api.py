"""The API surface: backward/grad variants, scopes, nesting, threads, fallbacks."""

import contextlib
import threading
import warnings

import pytest
import torch

import compiled_autograd as ca
from helpers import assert_grads_equal


def test_ca_backward_and_grad_functions():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    ref = torch.autograd.grad((x @ w).tanh().sum(), [x, w])
    got = ca.grad((x @ w).tanh().sum(), [x, w], backend="eager")
    assert_grads_equal(list(got), list(ref), exact=True)
    ca.backward((x @ w).tanh().sum(), backend="eager")
    assert_grads_equal([x.grad, w.grad], list(ref), exact=True)
    s = ca.stats()
    assert s.captures == 2 and s.eager_fallbacks == 0


def test_multiple_roots_with_grad_tensors():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)

    def roots():
        return [a * b, (a + b).exp()]

    g = [torch.randn(3), torch.randn(3)]
    torch.autograd.backward(roots(), g)
    ref = [a.grad.clone(), b.grad.clone()]
    a.grad = b.grad = None
    with ca.enable("eager", fullgraph=True):
        torch.autograd.backward(roots(), g)
    assert_grads_equal([a.grad, b.grad], ref, exact=True)


def test_backward_inputs_only_accumulates_into_those():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with ca.enable("eager", fullgraph=True):
        (a * b).sum().backward(inputs=[a])
    assert b.grad is None
    torch.testing.assert_close(a.grad, b)


def test_backward_inputs_with_a_non_leaf_accumulates_into_its_grad_as_eager():
    # eager makes the non-leaf retain its grad; nodes only leading elsewhere do not run
    def run(compiled, seed):
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        h = x * w
        loss = (h.sin() * w).sum()
        ctx = ca.enable("eager", fullgraph=True) if compiled else contextlib.nullcontext()
        with ctx:
            loss.backward(inputs=[h, w], retain_graph=True)
            loss.backward(inputs=[h])
        return h.retains_grad, [h.grad, x.grad, w.grad]

    for seed in (0, 1):
        want_retains, want = run(False, seed)
        got_retains, got = run(True, seed)
        assert got_retains and want_retains
        assert_grads_equal(got, want, what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert s.eager_fallbacks == 0, s.fallback_reasons
    assert (s.captures, s.hits) == (2, 2), s


def test_gradient_edges_as_roots_and_inputs_match_eager():
    # torch.autograd.graph.GradientEdge: of a built-in node, a custom Function's node,
    # and leaves' AccumulateGrad; as grad() inputs, grad() roots and backward() roots
    from torch.autograd.graph import get_gradient_edge as edge

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    def run(compiled, seed):
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        h = x * w
        s = Square.apply(h)
        out = s.sin()
        loss = out.sum()
        with ca.enable("eager", fullgraph=True) if compiled else contextlib.nullcontext():
            (gh,) = torch.autograd.grad(loss, edge(h), retain_graph=True)
            (gs,) = torch.autograd.grad(loss, edge(s), retain_graph=True)
            gx, gw = torch.autograd.grad((edge(h),), (edge(x), edge(w)), grad_outputs=(gh,), retain_graph=True)
            torch.autograd.backward((edge(out),), grad_tensors=(torch.ones(3),), inputs=[w])
        return [gh, gs, gx, gw, w.grad, x.grad]

    for seed in (0, 1):
        assert_grads_equal(run(True, seed), run(False, seed), what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert s.eager_fallbacks == 0, s.fallback_reasons
    assert (s.captures, s.hits) == (4, 4), s


def test_grad_with_respect_to_non_leaf():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    y = (h * h).sum()
    with ca.enable("eager", fullgraph=True):
        (gh,) = torch.autograd.grad(y, h, retain_graph=True)
    torch.testing.assert_close(gh, 2 * h)
    assert x.grad is None


def test_grad_same_tensor_twice_and_root_as_input():
    x = torch.randn(3, requires_grad=True)
    with ca.enable("eager", fullgraph=True):
        g1, g2 = torch.autograd.grad((x * 3).sum(), [x, x])
        (gx,) = torch.autograd.grad(x, x, torch.ones(3))
    torch.testing.assert_close(g1, torch.full((3,), 3.0))
    torch.testing.assert_close(g2, g1)
    torch.testing.assert_close(gx, torch.ones(3))


def test_enable_scopes_nest_and_disable():
    x = torch.randn(3, requires_grad=True)
    with ca.enable("eager"):
        with ca.disable():
            x.sin().sum().backward()
        assert ca.stats().captures == 0
        with ca.enable("aot_eager"):
            x.sin().sum().backward()
        x.sin().sum().backward()
    x.sin().sum().backward()  # outside: eager, untouched
    s = ca.stats()
    assert s.captures == 2 and s.eager_fallbacks == 0


def test_enable_is_per_thread():
    x = torch.randn(3, requires_grad=True)
    seen = {}

    def other():
        y = torch.randn(3, requires_grad=True)
        y.exp().sum().backward()
        seen["captures"] = ca.stats().captures

    with ca.enable("eager"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["captures"] == 0


def test_unsupported_falls_back_with_one_warning_and_reason():
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with ca.enable("eager"), torch.autograd.detect_anomaly():
            x.exp().sum().backward()
            x.exp().sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().exp())
    s = ca.stats()
    assert s.eager_fallbacks == 2 and s.captures == 0
    assert s.fallback_reasons["anomaly mode"] == 2
    msgs = [str(m.message) for m in w if "compiled_autograd" in str(m.message)]
    assert len(msgs) == 1, "the warning is shown once per reason"


def test_fullgraph_raises_instead_of_falling_back():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ca.CompiledAutogradError, match="anomaly"):
        with ca.enable("eager", fullgraph=True), torch.autograd.detect_anomaly():
            x.exp().sum().backward()


def test_is_grads_batched_falls_back_with_its_reason():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    for seed in range(2):
        v = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(seed))
        want = torch.autograd.grad((x @ w).tanh(), [x, w], v, is_grads_batched=True)
        with ca.enable("eager"):
            got = torch.autograd.grad((x @ w).tanh(), [x, w], v, is_grads_batched=True)
        assert_grads_equal(list(got), list(want), what=f"seed {seed}", exact=True)
    assert ca.stats().fallback_details["grads batched by vmap (is_grads_batched=True)"] == 2, ca.stats().fallback_details
    with pytest.raises(ca.CompiledAutogradError, match="vmap"):
        with ca.enable("eager", fullgraph=True):
            torch.autograd.grad((x @ w).tanh(), [x, w], v, is_grads_batched=True)


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "jacrev", "hessian", "vjp"])
def test_torch_func_transforms_fall_back_with_their_reason(transform):
    # the engine runs on the transforms' wrapped tensors (torch.func.vjp's function outside the
    # transform, where none is active): eager, counted
    from torch.func import grad, hessian, jacrev, vjp, vmap

    w = torch.randn(3, 3)

    def f(x):
        return (x @ w).tanh()

    run = {
        "grad": lambda x: grad(lambda x: f(x).sum())(x),
        "vmap_grad": lambda x: vmap(grad(lambda x: f(x).sum()))(torch.stack([x, x * 2])),
        "jacrev": lambda x: jacrev(f)(x),
        "hessian": lambda x: hessian(lambda x: f(x).sum())(x),
        "vjp": lambda x: vjp(f, x)[1](torch.ones(3))[0],
    }[transform]
    for seed in range(2):
        x = torch.randn(3, generator=torch.Generator().manual_seed(seed))
        want = run(x)
        with ca.enable("eager"):
            got = run(x)
        assert_grads_equal([got], [want], what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert (
        s.captures == 0
        and s.eager_fallbacks >= 2
        and set(s.fallback_details) == {"functorch transform active"}
        and set(s.fallback_reasons) == {"functorch"}
    ), s


def test_a_backward_inside_an_autocast_region_is_its_own_graph():
    # the engine runs the formulas under the caller's autocast state (mm in bfloat16 here): a
    # graph traced inside the region must not serve a backward outside it, nor the reverse
    w = torch.randn(8, 8, requires_grad=True)

    def step(seed, autocast, compiled):
        w.grad = None
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        loss = (x @ w).tanh().sum()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with ca.enable("eager") if compiled else contextlib.nullcontext():
                loss.backward()
        return w.grad

    for seed in range(2):
        for autocast in (True, False):
            want = step(seed, autocast, False)
            assert torch.equal(step(seed, autocast, True), want), (seed, autocast)
    s = ca.stats()
    assert (s.captures, s.hits) == (2, 2), s


def test_nested_backward_inside_hook_compiles_too():
    x = torch.randn(3, requires_grad=True)
    inner = torch.randn(3, requires_grad=True)
    seen = []

    def hook(g):
        with torch.enable_grad():  # hooks run with grad mode off, as in eager
            (gi,) = torch.autograd.grad(inner.exp().sum(), inner)  # a backward inside a hook
        seen.append(gi)
        return g * 2

    with ca.enable("eager"):
        y = x * 3
        y.register_hook(hook)
        y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 6.0))
    torch.testing.assert_close(seen[0], inner.detach().exp())
    s = ca.stats()
    assert s.eager_fallbacks == 0 and s.captures == 2  # outer and inner both compiled


def test_user_backend_callable_receives_graph():
    calls = []

    def my_backend(gm, example_inputs):
        calls.append((gm, len(example_inputs)))
        return gm

    x = torch.randn(3, requires_grad=True)
    for _ in range(2):
        with ca.enable(my_backend, fullgraph=True):
            x.exp().sum().backward()
    assert len(calls) == 1 and isinstance(calls[0][0], torch.fx.GraphModule)
    torch.testing.assert_close(x.grad, 2 * x.detach().exp())


def test_failing_backend_falls_back_and_is_not_cached():
    def broken(gm, example_inputs):
        raise RuntimeError("backend exploded")

    x = torch.randn(3, requires_grad=True)
    with ca.enable(broken):
        x.exp().sum().backward()
        x.exp().sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().exp())
    s = ca.stats()
    assert s.eager_fallbacks == 2 and s.hits == 0
    assert "backend exploded" in ca.explain()


def test_explain_mentions_each_capture_and_reason():
    x = torch.randn(3, requires_grad=True)
    with ca.enable("eager"):
        x.pow(2).sum().backward()
        x.pow(3).sum().backward()
        x.exp().sum().backward()
    text = ca.explain()
    assert "first backward" in text
    assert "PowBackward0: a saved constant" in text
    assert "new graph structure" in text


def test_dump_writes_code_and_pictures(tmp_path):
    x = torch.randn(3, 4, requires_grad=True)
    h = x.exp()
    h.register_hook(lambda g: g * 2)
    with ca.enable("eager"):
        (h * x).sin().sum().backward()
    files = ca.dump(tmp_path)
    names = sorted(p.rsplit("/", 1)[-1] for p in files)
    assert names == ["graph_0.dot", "graph_0.py", "graph_0.svg", "graph_0.txt"]
    described = (tmp_path / "graph_0.txt").read_text()  # (the code with its shapes; graph_0.py runs it: tests/test_repro.py)
    assert "f32[3, 4]" in described and "compiled_autograd.call" in described
    assert "compiled_autograd.call" in (tmp_path / "graph_0.py").read_text()
    svg = (tmp_path / "graph_0.svg").read_text()
    assert "ExpBackward0" in svg and "tensor hooks" in svg


def test_logging_status_lines(caplog):
    import logging

    x = torch.randn(3, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="compiled_autograd"):
        with ca.enable("eager"):
            x.exp().sum().backward()
    text = caplog.text
    assert "compiling a backward graph of" in text and "done in" in text


def test_garbage_collector_paused_on_hits_only_and_restored():
    # NOTE [No garbage collection on a hit]
    import gc

    states = []

    def hook(g):
        states.append(gc.isenabled())
        return g

    def step(fn, seed):
        torch.manual_seed(seed)
        x = torch.randn(4, requires_grad=True)  # new values each step, one cache entry
        y = (x * 2).sin()
        y.register_hook(hook)
        fn(y.sum())
        torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()))

    assert gc.isenabled()
    with ca.enable("eager"):
        step(lambda l: l.backward(), 0)  # miss: the capture runs with the collector on
        step(lambda l: l.backward(), 1)  # hit: paused while the graph (and its hook) runs
        step(lambda l: l.backward(create_graph=True), 2)  # eager fallback (a hook under create_graph): on
    assert states == [True, False, True]
    assert gc.isenabled()
    gc.disable()  # the user's choice is left alone
    try:
        with ca.enable("eager"):
            step(lambda l: l.backward(), 3)
        assert not gc.isenabled()
    finally:
        gc.enable()
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 2, 1)


def test_inductor_mode_and_options_are_checked():
    with pytest.raises(ValueError, match="need backend='inductor'"):
        ca.enable(backend="eager", options={"max_autotune": True})
    with pytest.raises(ValueError, match="both can't be specified"):
        ca.enable(mode="max-autotune", options={"max_autotune": True})
    with pytest.raises(ValueError, match="unknown mode"):
        ca.enable(mode="fastest")
    with pytest.raises(RuntimeError, match="unexpected inductor option"):
        ca.enable(options={"no_such_option": 1})


def test_inductor_options_apply_while_our_graphs_compile(monkeypatch):
    # inductor itself is replaced by a stub that records the config it compiles under and runs
    # the graph as is; the options key the cache: same options hit, other options capture anew
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    seen = []

    def fake_compile_fx(wrapper, example_inputs):
        seen.append((inductor_config.max_autotune, inductor_config.epilogue_fusion))
        return lambda args: wrapper(*args)

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    w = torch.randn(4, 3, requires_grad=True)
    default = (inductor_config.max_autotune, inductor_config.epilogue_fusion)

    def step(x, **kw):
        w.grad = None
        with ca.enable(background=False, **kw):
            (x @ w).tanh().sum().backward()
        got = w.grad.clone()
        w.grad = None
        (x @ w).tanh().sum().backward()
        assert_grads_equal([got], [w.grad])

    for x in (torch.randn(2, 4), torch.randn(2, 4)):  # the second is a hit
        step(x, options={"max_autotune": True, "epilogue_fusion": not default[1]})
    assert seen == [(True, not default[1])]
    assert (inductor_config.max_autotune, inductor_config.epilogue_fusion) == default  # restored
    step(torch.randn(2, 4), mode="max-autotune-no-cudagraphs")
    step(torch.randn(2, 4))
    assert seen[1:] == [(True, default[1]), default]
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (3, 1, 0), s


def test_grad_with_inputs_computes_only_the_outputs_it_needs():
    """NOTE [Which outputs a node computes]: with `inputs=`, eager's formulas skip the grads
    nobody asked for (a convolution's weight grad when only its input's is wanted); so does
    the traced graph, and the values are eager's over two inputs through one entry."""
    conv = torch.nn.Conv2d(3, 4, 3)
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        want = torch.autograd.grad(conv(x).sum(), x)[0]
        with ca.enable("eager", fullgraph=True):
            (got,) = torch.autograd.grad(conv(x).sum(), x)
        assert_grads_equal([got], [want], what=f"seed {seed}", exact=True)
    masks = [n.args[-1] for n in ca.graphs()[0].graph.graph.nodes if "convolution_backward" in str(n.target)]
    assert masks == [[True, False, False]], masks
    assert (ca.stats().captures, ca.stats().hits) == (1, 1)
    with ca.enable("eager", fullgraph=True):
        conv(x).sum().backward()  # no inputs=: every grad
    masks = [n.args[-1] for e in ca.graphs() for n in e.graph.graph.nodes if "convolution_backward" in str(n.target)]
    assert sorted(masks) == [[True, False, False], [True, True, True]], masks


def test_a_backward_whose_capture_fails_twice_is_not_traced_again():
    calls = []

    def broken_backend(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("backend broke")

    x = torch.randn(3, requires_grad=True)
    for step in range(4):
        x.grad = None
        with ca.enable(broken_backend):
            (x * (step + 2)).sin().sum().backward()
        torch.testing.assert_close(x.grad, (step + 2) * torch.cos((step + 2) * x.detach()))
    s = ca.stats()
    assert len(calls) == 2 and s.eager_fallbacks == 4 and s.captures == 0, (len(calls), s)
    assert sum(s.fallback_reasons.values()) == 4 and all("backend broke" in r for r in s.fallback_details), s


def test_in_graph_task_is_a_new_graph_task_each_time_nests_and_survives_errors():
    # graph_task.in_graph_task reuses its one-node graph (retained): each run must still be
    # its own graph task, a nested run gets another graph, and an error leaves it usable
    from compiled_autograd.graph_task import in_graph_task

    task_id = torch._C._current_graph_task_id
    ids = [in_graph_task(task_id) for _ in range(3)]
    assert -1 not in ids and len(set(ids)) == 3, ids
    outer, inner = in_graph_task(lambda: (task_id(), in_graph_task(task_id)))
    assert -1 not in (outer, inner) and outer != inner

    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        in_graph_task(boom)
    assert in_graph_task(lambda: 7) == 7
    called = []
    in_graph_task(lambda: torch.autograd.Variable._execution_engine.queue_callback(lambda: called.append(task_id())))
    assert len(called) == 1 and called[0] != -1
    assert torch.is_grad_enabled()  # the caller's grad mode is untouched


def _mlp_step(model, x, compiled, **kwargs):
    for p in model.parameters():
        p.grad = None
    loss = model(x).tanh().sum()
    with ca.enable("eager", **kwargs) if compiled else contextlib.nullcontext():
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_untested_torch_runs_every_backward_in_eager(monkeypatch):
    """NOTE [Torch versions]: on a torch release the helper was not written for, it does not
    load: every backward runs in eager, right, counted with the reason; fullgraph raises."""
    from compiled_autograd import native

    monkeypatch.delenv("COMPILED_AUTOGRAD_UNTESTED_TORCH", raising=False)
    for version in ("2.13.0+cpu", "2.14.1+cu130", "2.15.0+cu132"):
        assert native.version_problem(version) is None, version
    assert "2.16.0" in native.version_problem("2.16.0") and "2.13-2.15" in native.version_problem("2.16.0")
    why = native.version_problem("2.11.0+cu130")
    assert "2.11.0+cu130" in why and "COMPILED_AUTOGRAD_UNTESTED_TORCH" in why
    monkeypatch.setenv("COMPILED_AUTOGRAD_UNTESTED_TORCH", "1")
    assert native.version_problem("2.11.0") is None
    monkeypatch.delenv("COMPILED_AUTOGRAD_UNTESTED_TORCH")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", why)
    ca.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    for step in range(2):
        x = torch.randn(3, 4) + step
        want = _mlp_step(model, x, compiled=False)
        with pytest.warns(UserWarning, match="not a release") if step == 0 else contextlib.nullcontext():
            got = _mlp_step(model, x, compiled=True)
        assert_grads_equal(got, want, what=f"step {step}", exact=True)
    s = ca.stats()
    assert s.captures == 0 and s.eager_fallbacks == 2 and s.fallback_details[why] == 2
    with pytest.raises(ca.CompiledAutogradError, match="not a release"):
        _mlp_step(model, torch.randn(3, 4), compiled=True, fullgraph=True)


def test_patches_are_in_force_on_the_releases_they_were_written_for(monkeypatch):
    """NOTE [Torch versions]: one table of releases; a patch a later release made unneeded stays
    off there, even where COMPILED_AUTOGRAD_UNTESTED_TORCH=1 tries a release beyond the table."""
    from compiled_autograd import releases
    from compiled_autograd.compile import torch_patches

    monkeypatch.delenv("COMPILED_AUTOGRAD_UNTESTED_TORCH", raising=False)
    assert {p.name for p in torch_patches.PATCHES} | {releases.HELPER} == set(releases.WRITTEN_FOR)
    assert releases.in_force("mutation renames", "2.13.0") and not releases.in_force("mutation renames", "2.14.1")
    for version in ("2.13.0", "2.14.1", "2.15.0"):
        assert releases.in_force("fx traces", version) and releases.problem(releases.HELPER, version) is None
    assert not releases.in_force("fx traces", "2.16.0") and not releases.in_force("fx traces", "2.12.0")
    monkeypatch.setenv("COMPILED_AUTOGRAD_UNTESTED_TORCH", "1")
    assert releases.in_force("fx traces", "2.16.0") and not releases.in_force("mutation renames", "2.16.0")
    assert releases.in_force("fx traces", "2.11.0") and releases.in_force("mutation renames", "2.11.0")
    assert releases.problem(releases.HELPER, "2.16.0") is None


def test_a_patch_that_does_not_fit_this_torch_names_what_differs(monkeypatch):
    """NOTE [Torch versions]: a patch whose target this torch lacks leaves torch alone and says
    what differs: a compile-time one fails its compile with it, each time; an import-time one
    makes every backward run in eager with it."""
    from compiled_autograd import native, releases
    from compiled_autograd.compile import torch_patches

    class Inductorish:
        pass

    patch = torch_patches.Patch(
        "freed buffers",
        "Inductorish.codegen_free",
        "NOTE [Freed, never reused]",
        "-",
        "test moment",
        lambda: torch_patches._attr(Inductorish, "codegen_free"),
    )
    monkeypatch.setattr(torch_patches, "PATCHES", (patch,))
    monkeypatch.setattr(releases, "LAYOUT_DIFFERS", {})
    for _ in range(2):
        with pytest.raises(torch_patches.LayoutDiffers, match="Inductorish.codegen_free is not in this torch"):
            torch_patches.install("test moment")
    why = releases.LAYOUT_DIFFERS["freed buffers"]
    assert "NOTE [Freed, never reused]" in why and torch.__version__ in why
    torch_patches._installed.discard("test moment")
    torch_patches._failed.pop("test moment")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    ca.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    want = _mlp_step(model, x, compiled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _mlp_step(model, x, compiled=True)
    assert_grads_equal(got, want, what="eager fallback", exact=True)
    s = ca.stats()
    assert s.captures == 0 and s.fallback_details[why] == 1 and s.fallback_reasons["torch release"] == 1


def test_helper_that_fails_to_build_is_tried_once_and_every_backward_runs_in_eager(monkeypatch):
    from compiled_autograd import native

    tries = []

    def broken():
        tries.append(1)
        raise RuntimeError("Error building extension 'compiled_autograd_native'\nninja: build stopped")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "_load", broken)
    ca.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for step in range(2):
        x = torch.randn(3, 4) * (step + 1)
        want = _mlp_step(model, x, compiled=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _mlp_step(model, x, compiled=True)
        assert_grads_equal(got, want, what=f"step {step}", exact=True)
    assert len(tries) == 1
    (reason,) = ca.stats().fallback_details
    assert "could not be built" in reason and "Error building extension" in reason and "ninja" not in reason
    with pytest.raises(native.Unavailable):
        native.load()


def test_explain_stays_readable_with_many_guards_captures_and_opaque_nodes():
    """issue 36 item 6 (NOTE [explain() stays readable]): a transformer's dynamic graph carries
    hundreds of guards, once printed on one line of 17,196 characters; every list is now
    bounded, and so is every line, with dump() named for the rest."""
    from compiled_autograd.observe import explain as ex

    torch.manual_seed(0)
    m = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    with ca.enable("eager"):
        for b, t in [(2, 5), (3, 7), (4, 9)]:  # static, then one dynamic graph, then a hit
            m(torch.randn(b, t, 16)).sum().backward()
    s = ca.stats()
    assert (s.captures, s.dynamic_captures, s.hits) == (2, 1, 1), s
    text = ca.explain(file=None)
    guards = next(line for line in text.splitlines() if line.strip().startswith("guards:"))
    n = int(guards.split("guards:")[1].split()[0])
    assert n > 20 and "ca.dump(path)" in guards, guards
    # many captures, then many opaque nodes in one capture
    x = torch.randn(3, requires_grad=True)
    with ca.enable("eager", opaque=("MulBackward0",)):
        for k in range(ex.MAX_CAPTURES + 5):
            (x + 1).pow(k + 2).sum().backward()  # a new saved constant: a capture each
        for _ in range(2):  # (the first backward of a graph with opaque nodes learns their layouts)
            y = x
            for _ in range(15):
                y = y * 1.01
            y.sum().backward()
    text = ca.explain(file=None)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= ex.MAX_LINE, max(lines, key=len)
    last = max(i for i, line in enumerate(lines) if line.startswith("  capture "))
    assert sum(line.strip().startswith("opaque: MulBackward0") for line in lines[last:]) == ex.MAX_ITEMS
    assert "opaque: ... 5 more nodes" in text
    assert sum(line.startswith("  capture ") for line in lines) == ex.MAX_CAPTURES
    assert "earlier captures not shown" in text


def test_importing_the_library_changes_nothing_in_torch():
    """Issue 46 item 3: `import compiled_autograd` leaves torch as it was; the first scope entered
    installs what it needs (the engine's entry point, the call op, fx's and the engine's patches)."""
    import subprocess
    import sys

    probe = """
import torch, torch.fx
before = (torch.autograd._engine_run_backward, torch._C._will_engine_execute_node, torch.fx.Tracer.trace)
import compiled_autograd as ca
after = (torch.autograd._engine_run_backward, torch._C._will_engine_execute_node, torch.fx.Tracer.trace)
print(all(a is b for a, b in zip(before, after)), hasattr(torch.ops.compiled_autograd, "call"))
with ca.enable("eager"):
    pass
print(torch.autograd._engine_run_backward is not before[0], hasattr(torch.ops.compiled_autograd, "call"))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "True", "True"], out
