"""Spike (issue 39), experiment (b): does a DTensor backward trace to plain aten ops and
functional collectives under make_fx? A fake process group of 2 ranks (one process; its
collectives do nothing), a TP MLP (colwise then rowwise)."""
import sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor, Replicate, Shard, Partial
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)

def ops_of(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

def show(title, gm):
    print(f"--- {title}")
    print("  ops:", ops_of(gm))
    print("  placeholders:", [(n.name, type(n.meta.get('val')).__name__) for n in gm.graph.nodes if n.op == "placeholder"])

W1 = torch.randn(16, 8)   # colwise: Shard(0)
W2 = torch.randn(8, 16)   # rowwise: Shard(1)
X = torch.randn(4, 8)

def fwd(x, w1, w2):
    h = torch.relu(x @ w1.t())           # Shard(1)
    out = h @ w2.t()                      # Partial
    return out.redistribute(mesh, [Replicate()]).sum()

# eager reference on real DTensors
x = distribute_tensor(X, mesh, [Replicate()]).requires_grad_()
w1 = distribute_tensor(W1, mesh, [Shard(0)]).requires_grad_()
w2 = distribute_tensor(W2, mesh, [Shard(1)]).requires_grad_()
loss = fwd(x, w1, w2)
print("eager: loss", loss.placements, "grad_fn chain:")
fn, seen, stack = None, set(), [loss.grad_fn]
while stack:
    fn = stack.pop()
    if fn is None or fn in seen: continue
    seen.add(fn); print("   ", fn.name(), {a: (type(getattr(fn, a)).__name__, getattr(getattr(fn, a), 'placements', None)) for a in dir(fn) if a.startswith('_saved_') and isinstance(getattr(fn, a), torch.Tensor)})
    stack += [f for f, _ in fn.next_functions]
gx, gw1, gw2 = torch.autograd.grad(loss, [x, w1, w2])
print("eager grads:", [(g.placements, tuple(g.to_local().shape)) for g in (gx, gw1, gw2)])

# (b0) FakeTensorMode.from_tensor on a DTensor
mode = FakeTensorMode()
fw1 = mode.from_tensor(w1)
print("(b0) from_tensor(DTensor):", type(fw1).__name__, fw1.placements, type(fw1._local_tensor).__name__, fw1._local_tensor.shape)
print("     __tensor_flatten__:", w1.__tensor_flatten__()[0], "meta:", w1.__tensor_flatten__()[1])

specs = [(x, [Replicate()]), (w1, [Shard(0)]), (w2, [Shard(1)])]

def unflatten(locals_):
    # the way AOTAutograd rebuilds a subclass from its flat inner tensors
    out = []
    for t_local, (d, _) in zip(locals_, specs):
        attrs, meta = d.__tensor_flatten__()
        inner = {"_local_tensor": t_local, "device_mesh": d.device_mesh}
        out.append(type(d).__tensor_unflatten__(inner, meta, d.shape, d.stride()))
    return out

# (b1) forward + autograd.grad inside make_fx, on flat local tensors
def joint(xl, w1l, w2l):
    xx, ww1, ww2 = unflatten([xl, w1l, w2l])
    xx, ww1, ww2 = [t.detach().requires_grad_() for t in (xx, ww1, ww2)]
    with torch.enable_grad():
        l = fwd(xx, ww1, ww2)
        gs = torch.autograd.grad(l, [xx, ww1, ww2])
    return [g.to_local() for g in gs], [g.placements for g in gs]

placements = {}
def joint_flat(*a):
    gs, pl = joint(*a)
    placements["b1"] = pl
    return gs
try:
    gm = make_fx(joint_flat, tracing_mode="fake")(x.to_local(), w1.to_local(), w2.to_local())
    show("(b1) make_fx fake: fwd+grad over DTensors built from flat locals", gm)
    print("  grad placements seen in the trace:", placements["b1"])
except Exception as e:
    print("(b1) FAILED:", type(e).__name__, str(e)[:400])

# (b2) the backward only: the real graph's saved DTensors swapped for DTensors over traced
# fakes (what our native trace does with SavedVariables), the engine's loop run by hand: each
# built-in node called, a custom Function's backward through node.apply.
def trace_backward(title, loss):
    nodes, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen: continue
        seen.add(fn); nodes.append(fn); stack += [f for f, _ in fn.next_functions]
    saved = []  # (node, name, real DTensor)
    for fn in nodes:
        for a in dir(fn):
            if a.startswith("_raw_saved_") and a != "_raw_saved_tensors":
                real = getattr(fn, "_saved_" + a[len("_raw_saved_"):])
                if isinstance(real, torch.Tensor):
                    saved.append((fn, a, real))
    print(f"({title}) nodes:", [fn.name() for fn in nodes])
    print(f"({title}) saved tensors:", [(fn.name(), a, type(r).__name__, getattr(r, 'placements', None)) for fn, a, r in saved])
    swap = {}
    for i, (fn, a, real) in enumerate(saved):
        getattr(fn, a).register_hooks(lambda t: None, (lambda i: lambda _: swap[i])(i))
    got = {}

    def rebuild(real, loc):
        if not is_traceable_wrapper_subclass(real):
            return loc
        attrs, meta = real.__tensor_flatten__()
        return type(real).__tensor_unflatten__({"_local_tensor": loc, "device_mesh": real.device_mesh}, meta, real.shape, real.stride())

    def backward_only(root_grad_local, *saved_locals):
        for i, ((fn, a, real), loc) in enumerate(zip(saved, saved_locals)):
            swap[i] = rebuild(real, loc)
        g = rebuild(loss, root_grad_local)
        order, seen = [], set()
        def topo(f):
            if f is None or f in seen: return
            seen.add(f)
            for n, _ in f.next_functions: topo(n)
            order.append(f)
        topo(loss.grad_fn)
        order.reverse()
        buf = {loss.grad_fn: [g]}
        out = []
        for f in order:
            ins = buf.pop(f, None)
            if ins is None: continue
            if "AccumulateGrad" in f.name():
                out.append(ins[0]); got.setdefault("leaf", []).append((type(ins[0]).__name__, getattr(ins[0], "placements", None))); continue
            res = f(*ins) if callable(f) else f.apply(*ins)  # (a custom Function: its backward)
            res = res if isinstance(res, tuple) else (res,)
            for (n, nr), r in zip(f.next_functions, res):
                if n is None or r is None: continue
                b = buf.setdefault(n, [None] * len(n._input_metadata))
                b[nr] = r if b[nr] is None else b[nr] + r
        return [o.to_local() if isinstance(o, DTensor) else o for o in out]

    root = torch.ones_like(loss)
    try:
        gm = make_fx(backward_only, tracing_mode="fake")(root.to_local() if isinstance(root, DTensor) else root,
                                                         *[r.to_local() if isinstance(r, DTensor) else r for _, _, r in saved])
        show(f"({title}) make_fx fake: the real graph's nodes called on swapped saved tensors", gm)
        print("  leaf grads in the trace:", got.get("leaf"))
        gm.print_readable() if "-v" in sys.argv else None
    except Exception as e:
        import traceback; traceback.print_exc()
        print(f"({title}) FAILED:", type(e).__name__, str(e)[:600])

trace_backward("b2", fwd(x, w1, w2))

# (b3) TP as parallelize_module builds it: a plain input made a Replicate DTensor by
# from_local (ColwiseParallel's input), a plain output by to_local (RowwiseParallel's output after
# its all-reduce): the backward's collective sits in from_local's backward (Partial -> Replicate).
x_plain = X.clone().requires_grad_()
def tp_fwd(xp):
    xd = DTensor.from_local(xp, mesh, [Replicate()], run_check=False)
    h = torch.relu(xd @ w1.t())
    out = (h @ w2.t()).redistribute(mesh, [Replicate()]).to_local()
    return out.sum()
trace_backward("b3", tp_fwd(x_plain))

# (b4) our Recorder (capture/record.py) through DTensor's dispatch, when it returns NotImplemented
# for subclass types (as make_fx's proxy mode does): the Partial -> Replicate redistribution of
# the colwise input's grad, recorded on fakes
from compiled_autograd.capture.record import Recorder, record
from torch._subclasses.fake_tensor import FakeTensor

class SubclassRecorder(Recorder):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(not issubclass(t, FakeTensor) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)

fm = FakeTensorMode()
def rec_fn(g_local, w_local):
    gd = DTensor.from_local(g_local, mesh, [Shard(1)], run_check=False)
    wd = DTensor.from_local(w_local, mesh, [Shard(0)], run_check=False)
    gx = (gd @ wd).redistribute(mesh, [Replicate()])    # Partial -> Replicate: an all-reduce
    return [gx.to_local()]
for cls in (Recorder, SubclassRecorder):
    try:
        with fm:
            gm = record(rec_fn, [fm.from_tensor(torch.randn(4, 8)), fm.from_tensor(torch.randn(8, 8))], cls())
        print(f"(b4) {cls.__name__}: ops", ops_of(gm))
    except Exception as e:
        print(f"(b4) {cls.__name__}: refused:", type(e).__name__, str(e)[:300])
dist.destroy_process_group()
