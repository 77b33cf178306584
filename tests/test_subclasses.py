"""Tensor subclasses in a compiled backward (docs/design/subclasses.md; issue 39): a user's traceable
wrapper subclass and DTensor, flattened into their inner tensors at collect, traced through their
__torch_dispatch__, rebuilt after the graph; tensor parallelism on a fake 2-rank group in this
process (the multi-rank jobs are in test_distributed.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import pytest
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_map

import compiled_autograd as ca
from compiled_autograd.walk import precheck


class ScaledTensor(torch.Tensor):
    """A tensor stored as `data * scale` (the scale an inner 0-dim tensor, as FP8 training's
    are): its dispatch unwraps (multiplies out), runs the op, and rewraps with the scale of its
    first ScaledTensor argument."""

    @staticmethod
    def __new__(cls, data, scale, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=requires_grad,
        )

    def __init__(self, data, scale, requires_grad=False):
        self._data = data
        self._scale = scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ScaledTensor(inner["_data"], inner["_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        scale = None

        def unwrap(t):
            nonlocal scale
            if isinstance(t, ScaledTensor):
                scale = t._scale if scale is None else scale
                return t._data * t._scale
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: ScaledTensor(t / scale, scale) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def scaled(t, scale, requires_grad=False):
    s = torch.tensor(scale, dtype=t.dtype)
    return ScaledTensor(t / s, s, requires_grad=requires_grad)


def _steps(backend, xs, scales=None, grad=False):
    """Per step: a ScaledTensor weight's grad (its inner tensors) after `tanh(x @ w.t()).sum()`'s
    backward, `.grad` accumulated across steps (or `torch.autograd.grad`'s result)."""
    torch.manual_seed(0)
    W = torch.randn(4, 8)
    w = scaled(W, 0.5, requires_grad=True)
    out = []
    for i, x in enumerate(xs):
        if scales is not None:  # a new weight, of a new scale, each step
            w = scaled(W, scales[i], requires_grad=True)
        loss = torch.tanh(x @ w.t()).sum()
        with ca.enable(backend=backend, fullgraph=True) if backend else ca.disable():
            if grad:
                (g,) = torch.autograd.grad(loss, [w])
            else:
                loss.backward()
                g = w.grad
        assert type(g) is ScaledTensor
        out.append((g._data.clone(), g._scale.clone()))
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", ["accumulate", "new_scale", "grad"])
def test_scaled_tensor_compiled(backend, case):
    xs = [torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)]
    kw = {"scales": [0.5, 0.25, 2.0]} if case == "new_scale" else {"grad": True} if case == "grad" else {}
    want = _steps(None, xs, **kw)
    ca.reset()
    got = _steps(backend, xs, **kw)
    for (a, s), (b, t) in zip(want, got):
        assert torch.equal(a, b) and torch.equal(s, t)
    st = ca.stats()
    assert (st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (1, 2, 0, 0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_hook_on_a_subclass_grad(backend):
    """A tensor hook on an activation whose grad is a ScaledTensor: called from the graph with the
    grad rebuilt from its inner tensors, its result flattened back into them (Slot.out_specs)."""

    def steps(scope):
        torch.manual_seed(0)
        w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
        out = []
        for _ in range(3):
            h = torch.tanh(torch.randn(3, 8) @ w.t())
            h.register_hook(lambda g: g * 3.0)
            with scope():
                (h * h).sum().backward()
            out.append((w.grad._data.clone(), w.grad._scale.clone()))
        return out

    want = steps(ca.disable)
    ca.reset()
    got = steps(lambda: ca.enable(backend=backend, fullgraph=True))
    assert all(torch.equal(a, b) and torch.equal(s, t) for (a, s), (b, t) in zip(want, got))
    st = ca.stats()
    assert (st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (1, 2, 0, 0)
    (slot,) = [sl for sl in ca.graphs()[0].plan.slots if sl.kind == "tensor_pre_hooks"]
    assert [spec.type for _, spec in slot.out_specs] == [ScaledTensor]


def test_hook_that_changes_a_subclass_grad_raises():
    """A hook whose result is not what the graph was traced for (here a plain tensor for a
    ScaledTensor grad; for DTensor, other placements) raises, loudly, on the run that sees it."""
    torch.manual_seed(0)
    w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
    plain = [False]
    for step in range(2):
        h = torch.tanh(torch.randn(3, 8) @ w.t())
        h.register_hook(lambda g: g._data * g._scale if plain[0] else g * 1.0)
        plain[0] = step == 1
        with ca.enable(backend="eager"):
            if step == 0:
                (h * h).sum().backward()
            else:
                with pytest.raises(RuntimeError, match="traced with a ScaledTensor"):
                    (h * h).sum().backward()


@dataclasses.dataclass(frozen=True)
class _Scale:
    factor: float
    shift: float = dataclasses.field(default=0.0, compare=False)  # (read by the backward: keyed too)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cfg):
        ctx.cfg = cfg
        return x * cfg.factor

    @staticmethod
    def backward(ctx, g):
        return g * ctx.cfg.factor + ctx.cfg.shift, None


def test_a_dataclass_on_ctx_is_keyed_by_every_field():
    """NOTE [Keys of a tensor subclass's metadata]: a frozen dataclass on ctx (as DTensor's
    DTensorSpec is) is keyed by each field, `compare=False` ones too: a new value, a new graph."""
    cfgs = [_Scale(2.0), _Scale(2.0), _Scale(2.0, shift=1.0)]

    def steps(scope):
        torch.manual_seed(0)
        out = []
        for cfg in cfgs:
            x = torch.randn(5, requires_grad=True)
            with scope():
                (_Scaled.apply(x, cfg) ** 2).sum().backward()
            out.append(x.grad)
        return out

    want = steps(ca.disable)
    ca.reset()
    got = steps(lambda: ca.enable(backend="aot_eager", fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    st = ca.stats()
    assert (st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (2, 1, 0, 0)


def test_subclass_graphs_are_not_stored_on_disk(tmp_path, monkeypatch):
    # (a subclass's type and metadata -- DTensor's mesh and its groups' names -- are not yet
    # known to mean the same in another process: docs/design/subclasses.md section 6)
    monkeypatch.setenv("COMPILED_AUTOGRAD_GRAPH_DIR", str(tmp_path))
    w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
    with ca.enable("eager", disk_cache=True):
        torch.tanh(torch.randn(3, 8) @ w.t()).sum().backward()
    assert ca.stats().captures == 1 and not list(tmp_path.glob("*.graph"))


def test_scaled_tensor_off_falls_back(monkeypatch):
    # COMPILED_AUTOGRAD_SUBCLASSES=0: a whole-backward fallback of kind "tensor subclass"
    monkeypatch.setenv("COMPILED_AUTOGRAD_SUBCLASSES", "0")
    xs = [torch.randn(3, 8)]
    assert [torch.equal(a, b) for (a, _), (b, _) in zip(_steps(None, xs), _steps(None, xs))] == [True]
    ca.reset()
    torch.manual_seed(0)
    w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
    with ca.enable(backend="eager"):
        torch.tanh(xs[0] @ w.t()).sum().backward()
    assert ca.stats().fallback_reasons == {"tensor subclass": 1}


# -- DTensor: built-in nodes only, no custom Function


@pytest.fixture(params=["gloo1", "fake2"])
def mesh(request, tmp_path):
    """A 1-rank gloo group, or a fake 2-rank one in this process (torch's FakeProcessGroup: its
    collectives do nothing, in eager and in the compiled graph alike, so parity still holds)."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("a process group is already initialized")
    if request.param == "fake2":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield init_device_mesh("cpu", (dist.get_world_size(),))
    finally:
        dist.destroy_process_group()


def _dtensor_steps(mesh, backend, layout):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    W1, W2 = torch.randn(16, 8), torch.randn(8, 16)
    p1, p2 = {"colrow": (Shard(0), Shard(1)), "repcol": (Replicate(), Shard(0))}[layout]
    w1 = distribute_tensor(W1, mesh, [p1]).requires_grad_()
    w2 = distribute_tensor(W2, mesh, [p2]).requires_grad_()
    out = []
    for _ in range(3):
        x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]).requires_grad_()
        loss = (torch.relu(x @ w1.t()) @ w2.t()).sum()  # a Partial loss: its root grad a DTensor
        with ca.enable(backend=backend, fullgraph=True) if backend else ca.disable():
            loss.backward()
        out.append([(g.placements, g.to_local().clone()) for g in (x.grad, w1.grad, w2.grad)])
    return out


def _assert_eager_placed_and_compiled(want, compiled, close=False):
    """`compiled()`'s steps against eager's `want`: per step, each grad's placements equal and
    its local tensor bitwise equal (or within inductor's rounding: `close`); one capture, then
    hits, nothing in eager."""
    ca.reset()
    for step_want, step_got in zip(want, compiled()):
        for (pw, a), (pg, b) in zip(step_want, step_got):
            assert pw == pg
            if close:
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
            else:
                assert torch.equal(a, b)
    st = ca.stats()
    assert (st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (1, 2, 0, 0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("layout", ["colrow", "repcol"])
def test_dtensor_compiled(mesh, backend, layout):
    _assert_eager_placed_and_compiled(_dtensor_steps(mesh, None, layout), lambda: _dtensor_steps(mesh, backend, layout))
    ops = [str(n.target) for n in ca.graphs()[0].graph.graph.nodes if n.op == "call_function"]
    # DTensor's redistribution of the Partial grad before relu's backward, on 2 ranks: a
    # functional all-reduce in the graph (none on 1 rank, none where the grads stay Partial)
    collective = mesh.size() == 2 and layout == "repcol"
    assert ("_c10d_functional.all_reduce.default" in ops) == collective


# -- tensor parallelism (examples/distributed.py's decoder and plans), on a fake 2-rank group


@pytest.fixture
def fake2():
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


_COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}


class _Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """The functional collectives an eager backward issues, in order: (op, input shape). DTensor
    ops are let through to DTensor's dispatch (NotImplemented), whose inner ops come back here."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        if func.namespace == "_c10d_functional" and func._opname in _COLLECTIVES:
            self.log.append((func._opname, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def _graph_collectives(gm):
    return [
        (n.target._opname, tuple(n.args[0].meta["val"].shape))
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional" and n.target._opname in _COLLECTIVES
    ]


def _tp_steps(mesh, backend, plan, log=None, opaque=()):
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    from examples.distributed import TPModel, parallelize

    sp, lp = "sp" in plan, "loss_parallel" in plan
    torch.manual_seed(0)
    model = TPModel(d=16, heads=4, layers=2, ff=32, vocab=12)
    parallelize(model, mesh, sequence_parallel=sp, loss_parallel=lp)
    if "checkpoint" in plan:  # each block recomputed in the backward (non-reentrant activation checkpointing)
        from torch.utils.checkpoint import checkpoint

        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    if "compiled" in plan:  # each block a torch.compile'd region (its DTensors carry torch's stand-in for the mesh)
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile(backend="aot_eager")
    if "hooks" in plan:  # a tensor hook on every parameter, DTensor or not: its grad scaled
        for p in model.parameters():
            p.register_hook(lambda g: g * 0.5)
    out = []
    for step in range(3):  # (.grad accumulated across the steps)
        torch.manual_seed(step)
        x, y = torch.randn(2, 8, 16), torch.randint(0, 12, (2, 16 if sp else 8))
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            with (
                ca.enable(backend=backend, fullgraph=True, background=False, opaque=opaque)
                if backend
                else _Collectives()
                if log is not None
                else ca.disable() as mode
            ):
                loss.backward()
        if log is not None and step == 0:
            log += mode.log
        out.append([(getattr(p.grad, "placements", None), getattr(p.grad, "_local_tensor", p.grad).clone()) for p in model.parameters()])
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("plan", ["tp", "sp", "sp+loss_parallel", "tp+hooks"])
def test_tensor_parallel_compiled(fake2, backend, plan):
    """Colwise/rowwise attention and feed-forward, sequence-parallel LayerNorms, a vocabulary-
    parallel loss: eager's grads and placements bitwise, one capture then hits, and the graph's
    collectives those eager issues, in eager's order (on a fake group they move no data: the
    multi-rank jobs in test_distributed.py check the data)."""
    eager_log: list = []
    _assert_eager_placed_and_compiled(_tp_steps(fake2, None, plan, eager_log), lambda: _tp_steps(fake2, backend, plan))
    assert eager_log and _graph_collectives(ca.graphs()[0].graph) == eager_log


def test_tensor_parallel_with_an_opaque_node(fake2):
    """Sequence-parallel LayerNorms run opaquely (named in opaque=): their grads are DTensors,
    held by reference (NOTE [Values passed by reference]), the nodes given them opaque too;
    eager's grads and placements bitwise, no fallback (before: a whole-backward fallback)."""
    want = _tp_steps(fake2, None, "sp")
    ca.reset()
    got = _tp_steps(fake2, "aot_eager", "sp", opaque=("NativeLayerNormBackward0",))
    for step_want, step_got in zip(want, got):
        for (pw, a), (pg, b) in zip(step_want, step_got):
            assert pw == pg and torch.equal(a, b)
    st = ca.stats()
    # (a learning backward of the opaque nodes' layouts, a capture, a hit on the third step's inputs)
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 1, 1, 0)
    assert st.opaque_reasons["marked opaque"] > 0 and st.opaque_reasons["tensor subclass"] > 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("plan", ["tp+checkpoint", "sp+checkpoint"])
def test_tensor_parallel_with_activation_checkpointing(fake2, backend, plan):
    """Checkpointed blocks recompute DTensors in the backward: what the checkpoint's unpack hook
    returns is learned by a first backward in eager (placements, local shapes), then unpacked
    in the graph as its local tensor, each when its node runs, and rebuilt there (NOTE [Unpacked
    tensor subclasses]); eager's grads and placements bitwise (before: the whole backward in
    eager, "tensor subclass with saved-tensor hooks")."""
    want = _tp_steps(fake2, None, plan)
    ca.reset()
    got = _tp_steps(fake2, backend, plan)
    for step_want, step_got in zip(want, got):
        for (pw, a), (pg, b) in zip(step_want, step_got):
            assert pw == pg and torch.equal(a, b)
    st = ca.stats()
    # (a learning backward, a capture, a hit on the third step's inputs)
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (1, 1, 1, 0, 0)
    (n,) = re.findall(r"saved-tensor hooks: (\d+) tensors unpacked in the graph", ca.explain())
    assert int(n) > 10  # (each block's saved DTensors, unpacked where its nodes run)


def _stashed_steps(scope, n=4, plain_at=None):
    """Per step, a ScaledTensor weight's grad after a backward whose saved tensors go through a
    user's stash (saved_tensors_hooks): its unpack hook returns ScaledTensors (at step
    `plain_at`, the tensors they stand for, plain)."""
    torch.manual_seed(0)
    w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
    out, stash = [], {}

    def pack(t):
        stash[len(stash)] = t
        return len(stash) - 1

    for step in range(n):

        def unpack(k, plain=step == plain_at):
            t = stash.pop(k)
            return t._data * t._scale if plain and isinstance(t, ScaledTensor) else t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = torch.tanh(torch.randn(3, 8) @ w.t()).sum()
        with scope():
            loss.backward()
        stash.clear()
        out.append([w.grad._data.clone(), w.grad._scale.clone()])
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_saved_tensor_hook_that_returns_a_subclass(backend):
    """What the hook returns is learned by a first backward in eager, then unpacked in the graph
    as its inner tensors and rebuilt (NOTE [Unpacked tensor subclasses]): bitwise, hits."""
    st = _bitwise_against_eager(_stashed_steps, backend=backend)
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 1, 2, 0)


def test_a_saved_tensor_hook_that_returns_another_type_than_learned_raises():
    """The graph, traced for a ScaledTensor, ran part way when the hook returns a plain tensor:
    it raises (as for any prediction that fails), and the next backward learns again."""
    with ca.enable(backend="aot_eager", fullgraph=True):
        with pytest.raises(
            RuntimeError,
            match=r"unpack hook of a saved tensor returned \(3, 4\)/torch.float32/cpu, "
            r"where the previous backward of this graph got \(3, 4\)/ScaledTensor",
        ):
            _stashed_steps(contextlib.nullcontext, n=4, plain_at=3)
    # the same graph again: the next backward learns the other hooks again, and that tensor is no
    # longer predicted: unpacked up front, which the graph does not take for a subclass (in eager, counted)
    want = _stashed_steps(ca.disable, n=2)
    with ca.enable(backend="aot_eager", fullgraph=False):
        got = _stashed_steps(contextlib.nullcontext, n=2)
    assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    st = ca.stats()
    assert (st.learning_backwards, st.fallback_details["saved-tensor hook returned a tensor subclass"]) == (2, 1)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_region_with_a_subclass_is_inlined(backend):
    """A torch.compile'd function of a ScaledTensor weight: its backward (on inner tensors,
    rewrapped by AOTAutograd's epilogue) is inlined on the fakes, not run opaquely (NOTE
    [Inlining AOTAutograd backwards]); bitwise, one capture, hits."""

    def steps(scope):
        torch.manual_seed(0)
        torch._dynamo.reset()
        f = torch.compile(lambda x, w: torch.tanh(x @ w.t()), backend="aot_eager")
        w, lin, out = scaled(torch.randn(4, 8), 0.5, requires_grad=True), torch.nn.Linear(8, 8), []
        for _ in range(3):
            loss = f(lin(torch.randn(3, 8)), w).sum()
            with scope():
                loss.backward()
            out.append([w.grad._data.clone(), w.grad._scale.clone(), lin.weight.grad.clone()])
        return out

    st = _bitwise_against_eager(steps, backend=backend)
    assert (st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (1, 2, 0, 0)


def test_tensor_parallel_with_compiled_blocks(fake2):
    """torch.compile'd TP blocks: the DTensors their regions return carry torch's stand-in for the
    mesh (a FakeScriptObject around it), keyed as the mesh it wraps (before: the whole backward in
    eager, "device_mesh is unkeyable"); each region's backward is inlined (NOTE [Inlining
    AOTAutograd backwards]) with the opaque objects it saved (the mesh) and its DTensor grads
    rewrapped by its epilogue on the fakes: one graph of aten ops and functional collectives,
    eager's grads and placements bitwise."""
    want = _tp_steps(fake2, None, "tp+compiled")
    ca.reset()
    got = _tp_steps(fake2, "aot_eager", "tp+compiled")
    for step_want, step_got in zip(want, got):
        for (pw, a), (pg, b) in zip(step_want, step_got):
            assert pw == pg and torch.equal(a, b)
    st = ca.stats()
    assert (st.captures, st.hits, st.eager_fallbacks, st.learning_backwards, st.opaque_nodes) == (1, 2, 0, 0, 0)
    gm = ca.graphs()[0].graph
    assert [n for n in gm.graph.nodes if n.op == "get_attr"] == []  # (the mesh is not in the graph)
    assert any(n.op == "call_function" and n.target is torch.ops._c10d_functional.all_reduce.default for n in gm.graph.nodes)


@pytest.mark.inductor
def test_tensor_parallel_with_activation_checkpointing_inductor(fake2):
    """The same on inductor: eager's placements, grads within its rounding, a hit."""
    want = _tp_steps(fake2, None, "sp+checkpoint")
    ca.reset()
    for step_want, step_got in zip(want, _tp_steps(fake2, "inductor", "sp+checkpoint")):
        for (pw, a), (pg, b) in zip(step_want, step_got):
            assert pw == pg
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    st = ca.stats()
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 1, 1, 0)


@pytest.mark.inductor
def test_tensor_parallel_inductor(fake2):
    """Inductor on the sequence-parallel TP graph: eager's placements, grads within its rounding
    (its fused kernels round differently), and a hit on the next steps."""
    _assert_eager_placed_and_compiled(_tp_steps(fake2, None, "sp"), lambda: _tp_steps(fake2, "inductor", "sp"), close=True)


def test_loss_parallel_is_in_the_key(fake2):
    """loss_parallel() swaps DTensor's cross-entropy rules: a graph traced inside it is not the
    graph of the same backward outside it (walk/precheck.py global_state)."""
    from torch.distributed.tensor.parallel import loss_parallel

    from examples.distributed import TPModel, parallelize

    torch.manual_seed(0)
    model = TPModel(d=16, heads=4, layers=1, ff=32, vocab=12)
    parallelize(model, fake2, loss_parallel=True)
    x, y = torch.randn(2, 8, 16), torch.randint(0, 12, (2, 8))
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    keys = []
    for inside in (True, False, True):
        with loss_parallel() if inside else contextlib.nullcontext(), ca.enable(backend="eager"):
            keys.append(precheck.global_state())
    assert keys[0] == keys[2] != keys[1]


def test_a_graph_of_plain_tensors_is_not_keyed_by_dtensor_state(monkeypatch):
    """DTensor's state is keyed only where a graph traces through a subclass: importing inductor
    imports DTensor, and a plain graph keyed by it was captured (and compiled) again after its
    first compile."""
    states = iter([None] + [(False, ("handlers",))] * 3)
    monkeypatch.setattr(precheck, "_dtensor_state", lambda: next(states))

    def steps(scope):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        out = []
        for _ in range(3):  # (new inputs each step)
            with scope():
                net(torch.randn(2, 4)).pow(2).sum().backward()
            out.append([net.weight.grad.clone(), net.bias.grad.clone()])
        return out

    s = _bitwise_against_eager(steps, backend="eager")
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 2, 0), s


# -- values passed by reference (NOTE [Values passed by reference], capture/trace.py): a jagged
#    NestedTensor's nodes run opaquely, each, and its grads are held beside the graph


def _bitwise_against_eager(steps, **enable):
    """`steps(scope)` (per step, a list of tensors) run in eager and under
    `ca.enable(fullgraph=True, **enable)`: bitwise equal; the stats of the compiled run."""
    want = steps(ca.disable)
    ca.reset()
    got = steps(lambda: ca.enable(fullgraph=True, **enable))
    assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    return ca.stats()


def _njt(i):
    return torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(5 + i, 4)], layout=torch.jagged, requires_grad=True)


def _njt_steps(scope, case, n=4):
    """Per step (a new ragged length each step), the grads of a jagged NestedTensor leaf and of
    a Linear's parameters after `relu(lin(nt)).values().sum()`'s backward, or a variant."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    out = []
    for i in range(n):
        nt = _njt(i)
        y = lin(nt)
        if case == "used twice":  # two grads of y's node summed, each held by reference
            loss = (torch.relu(y) * y).values().sum()
        else:
            if case == "hook":  # a tensor hook on a nested activation
                y.register_hook(lambda g: g * 2)
            loss = torch.relu(y).values().sum()
        with scope():
            if case == "grad":
                g_nt, g_w = torch.autograd.grad(loss, [nt, lin.weight])
                assert g_nt.is_nested
                out.append([g_nt.values().clone(), g_w.clone()])
                continue
            loss.backward()
        out.append([nt.grad.values().clone(), lin.weight.grad.clone(), lin.bias.grad.clone()])
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", ["plain", "used twice", "hook", "grad"])
def test_nested_tensor_runs_opaque_per_node(backend, case):
    s = _bitwise_against_eager(lambda scope: _njt_steps(scope, case), backend=backend)
    # (before: the whole backward in eager, counted as the user's misuse, then as "tensor subclass");
    # now: the first backward learns the opaque nodes' output layouts in eager, the second is
    # captured, the third (new ragged lengths: new sizes of the values' sum) captured dynamic,
    # the fourth, other lengths again, a hit
    assert (s.learning_backwards, s.captures, s.dynamic_captures, s.hits, s.eager_fallbacks) == (1, 2, 1, 1, 0), s
    assert set(s.opaque_reasons) == {"tensor subclass"}
    assert any("NestedGetValuesBackward0" in d for d in s.opaque_details)


def _njt_root_steps(scope, n=4):
    """Per step (new ragged lengths), the grads after `relu(lin(nt)).backward(g)` with a jagged
    NestedTensor `g`: the root grad itself nested."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    out = []
    for i in range(n):
        nt = _njt(i)
        y = torch.relu(lin(nt))
        g = torch.nested.nested_tensor_from_jagged(torch.randn(y.values().shape), y.offsets())
        with scope():
            y.backward(g)
        out.append([nt.grad.values().clone(), lin.weight.grad.clone(), lin.bias.grad.clone()])
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_nested_root_grad_is_held_by_reference(backend):
    """A nested root grad (was: the whole backward in eager, "non-strided lifted tensor") is held
    beside the graph, the nodes given it opaque (NOTE [Values passed by reference]); the sizes
    of the held grad are not keyed, so new ragged lengths are hits."""
    s = _bitwise_against_eager(_njt_root_steps, backend=backend)
    assert (s.learning_backwards, s.captures, s.dynamic_captures, s.hits, s.eager_fallbacks) == (1, 1, 0, 2, 0), s
    assert set(s.opaque_reasons) == {"tensor subclass"}


@pytest.mark.inductor
def test_nested_tensor_inductor():
    want = _njt_steps(ca.disable, "plain")
    ca.reset()
    got = _njt_steps(lambda: ca.enable(backend="inductor", fullgraph=True, background=False), "plain")
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            torch.testing.assert_close(b, a)
    st = ca.stats()
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 2, 1, 0)


def _scaled_opaque_steps(scope):
    torch.manual_seed(0)
    W = torch.randn(4, 8)
    w = scaled(W, 0.5, requires_grad=True)
    out = []
    for i in range(3):
        loss = torch.tanh(torch.randn(3, 8) @ w.t()).sum()
        with scope():
            loss.backward()
        assert type(w.grad) is ScaledTensor
        out.append((w.grad._data.clone(), w.grad._scale.clone()))
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_opaque_node_returning_a_subclass(backend):
    """An opaque node whose grad is a ScaledTensor hands it on by reference; the nodes given it
    run opaquely too (before: a whole-backward fallback)."""
    s = _bitwise_against_eager(_scaled_opaque_steps, backend=backend, opaque=["TanhBackward0"])
    assert s.eager_fallbacks == 0 and s.hits == 1 and s.captures == 1
    assert s.opaque_reasons == {"marked opaque": 2, "tensor subclass": 4}


def test_subclass_graph_with_new_sizes_is_captured_static():
    """A backward with a ScaledTensor whose batch changes: a static capture of the new sizes, then
    a hit (before: the dynamic capture raised under fullgraph=True)."""

    def steps(scope):
        torch.manual_seed(0)
        w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
        out = []
        for n in (3, 5, 5):
            loss = torch.tanh(torch.randn(n, 8) @ w.t()).sum()
            with scope():
                loss.backward()
            out.append((w.grad._data.clone(), w.grad._scale.clone()))
        return out

    st = _bitwise_against_eager(steps, backend="aot_eager")
    assert (st.captures, st.dynamic_captures, st.hits, st.eager_fallbacks) == (2, 0, 1, 0)


class Unflattened(torch.Tensor):
    """A wrapper subclass without __tensor_flatten__: its dispatch unwraps, runs the op, rewraps."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device, requires_grad=requires_grad)
        r.elem = elem
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(
            *tree_map(lambda t: t.elem if isinstance(t, Unflattened) else t, args),
            **tree_map(lambda t: t.elem if isinstance(t, Unflattened) else t, kwargs or {}),
        )
        return tree_map(lambda t: Unflattened(t) if isinstance(t, torch.Tensor) else t, out)


class _Unwrap(torch.autograd.Function):
    """An Unflattened in, a plain tensor out; its backward gives an Unflattened grad."""

    @staticmethod
    def forward(ctx, w):
        return w.elem * 2

    @staticmethod
    def backward(ctx, g):
        return Unflattened(g * 2)


def _unflattened_steps(scope, plain_loss=False):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    out = []
    for _ in range(3):
        x = Unflattened(torch.randn(5, 4), requires_grad=True)
        if plain_loss:  # (a custom Function unwraps it: the loss is a plain tensor)
            loss = (_Unwrap.apply(torch.tanh(lin(x))) * torch.randn(5, 3)).sum()
        else:  # (an Unflattened loss: its root grad is one too)
            loss = torch.tanh(lin(x)).sum()
        with scope():
            loss.backward()
        assert type(x.grad) is Unflattened
        out.append([x.grad.elem.clone(), getattr(lin.weight.grad, "elem", lin.weight.grad).clone()])
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_subclass_without_tensor_flatten_runs_opaque_per_node(backend):
    """Its root grad and every grad of its type are held by reference, the nodes that take or
    return one opaque (before: a whole-backward fallback, "tensor subclass root grad")."""
    st = _bitwise_against_eager(_unflattened_steps, backend=backend)
    # (the first backward learns the opaque nodes' output layouts in eager; then a capture, a hit)
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 1, 1, 0)
    assert set(st.opaque_reasons) == {"tensor subclass"}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_subclass_without_tensor_flatten_under_a_plain_loss(backend):
    """The walk finds an Unflattened among what the graph would lift and walks again with every
    node that takes or returns a subclass's grad opaque (before: a whole-backward fallback)."""
    st = _bitwise_against_eager(lambda scope: _unflattened_steps(scope, plain_loss=True), backend=backend)
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 1, 1, 0)
    assert set(st.opaque_reasons) == {"tensor subclass"}


class Dequant(torch.Tensor):
    """A weight-only quantized tensor's way, without __tensor_flatten__: its dispatch unwraps and
    returns plain tensors, so the nodes that save it have plain grads."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.elem if isinstance(t, Dequant) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_subclass_without_tensor_flatten_saved_by_nodes_whose_grads_are_plain(backend):
    """Each built-in node that saves one runs as is (NOTE [Nodes that save what a graph cannot
    hold], native helper), the rest compiled; two nodes save the same one (torch lifts a tensor
    once: both must be found). Before: the whole backward in eager."""

    def steps(scope):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4)
        out = []
        for _ in range(3):
            q = Dequant(torch.randn(5, 4))
            h = torch.tanh(lin(torch.randn(5, 4)))
            loss = (torch.mul(h, q) + torch.mul(torch.sigmoid(h), q)).sum()
            with scope():
                loss.backward()
            out.append([lin.weight.grad.clone(), lin.bias.grad.clone()])
        return out

    st = _bitwise_against_eager(steps, backend=backend)
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 1, 1, 0)
    assert set(st.opaque_reasons) == {"tensor subclass"} and st.opaque_nodes == 2 * 2  # (two MulBackward0, two steps)


@pytest.mark.parametrize("case", ["root grad", "saved"])
def test_a_subclass_inside_a_subclass_runs_opaque_per_node(case):
    """A ScaledTensor whose data is a ScaledTensor (not flattened yet): as one without
    __tensor_flatten__, its nodes run opaquely and its grads are held by reference, the rest
    compiled (before: the whole backward in eager, "a subclass inside")."""

    def steps(scope):
        torch.manual_seed(0)
        W, lin, out = torch.randn(4, 8), torch.nn.Linear(8, 4), []
        for _ in range(3):
            if case == "root grad":
                w = ScaledTensor(scaled(W, 0.5), torch.tensor(2.0), requires_grad=True)
                loss = torch.tanh(lin(torch.randn(3, 8)) @ w).sum()
            else:  # (a Dequant over one: the nodes that save it, or take its grads, run as is)
                loss = (torch.tanh(lin(torch.randn(3, 8))) * Dequant(scaled(torch.randn(3, 4), 0.5))).sum()
            with scope():
                loss.backward()
            out.append([lin.weight.grad.clone(), lin.bias.grad.clone()])
        return out

    st = _bitwise_against_eager(steps, backend="aot_eager")
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 1, 1, 0)
    assert set(st.opaque_reasons) == {"tensor subclass"}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("which", ["pre", "post"])
def test_node_hooks_given_a_subclass(backend, which):
    """A node's pre or post hook given ScaledTensor grads: what it returns is held by reference,
    the nodes after it opaque, and the weight's AccumulateGrad (in the graph: hooks could see
    `.grad`) gets the value with no other reference, as eager's engine hands it over (with one,
    AccumulateGrad copies it, which this ScaledTensor's dispatch gets wrong). Before: a fallback."""

    def steps(scope):
        torch.manual_seed(0)
        w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
        out = []
        for _ in range(3):
            loss = torch.tanh(torch.randn(3, 8) @ w.t()).sum()
            tanh = loss.grad_fn.next_functions[0][0]
            if which == "pre":
                tanh.register_prehook(lambda gO: (gO[0] * 2,))
            else:
                tanh.register_hook(lambda gI, gO: (gI[0] * 3,))
            with scope():
                loss.backward()
            assert type(w.grad) is ScaledTensor
            out.append((w.grad._data.clone(), w.grad._scale.clone()))
        return out

    st = _bitwise_against_eager(steps, backend=backend)
    assert (st.captures, st.hits, st.eager_fallbacks) == (1, 2, 0)
    assert set(st.opaque_reasons) == {"tensor subclass"}


def test_a_value_held_by_reference_lives_as_long_as_in_eager():
    """A nested grad held by reference is dropped by its last reader (ReluBackward0 here), as the
    engine drops it: a hook that runs later finds it freed (before: held to the graph's end)."""
    import weakref

    def run(scope):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        freed = []
        for i in range(4):
            y = lin(_njt(i))
            z = torch.relu(y)
            refs = []
            z.register_hook(lambda g: refs.append(weakref.ref(g)))
            y.register_hook(lambda g: freed.append(refs[0]() is None))
            with scope():
                z.values().sum().backward()
        return freed

    assert run(ca.disable) == [True] * 4
    ca.reset()
    assert run(lambda: ca.enable(backend="aot_eager", fullgraph=True, disk_cache=False)) == [True] * 4
    st = ca.stats()  # (as in test_nested_tensor_runs_opaque_per_node: the last step a hit)
    assert (st.learning_backwards, st.captures, st.hits, st.eager_fallbacks) == (1, 2, 1, 0)
