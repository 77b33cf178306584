"""Spike (issue 39), experiment (c): the ScaledTensor subclass: eager graph, fakes, make_fx of
its backward (the real graph's nodes on swapped saved tensors), and what ca does today."""
import sys, torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
sys.path.insert(0, "tools/spike")
from scaled import ScaledTensor, scaled

torch.manual_seed(0)
W = torch.randn(4, 8)
w = scaled(W, 0.5, requires_grad=True)     # a leaf ScaledTensor
x = torch.randn(3, 8)

def fwd(w, x):
    return torch.tanh(x @ w.t()).sum()

loss = fwd(w, x)
print("loss:", type(loss).__name__)
stack, seen = [loss.grad_fn], set()
while stack:
    fn = stack.pop()
    if fn is None or fn in seen: continue
    seen.add(fn)
    print("  ", fn.name(), {a: type(getattr(fn, a)).__name__ for a in dir(fn) if a.startswith("_saved_") and isinstance(getattr(fn, a), torch.Tensor)})
    stack += [f for f, _ in fn.next_functions]
loss.backward()
print("eager w.grad:", type(w.grad).__name__, "flatten:", w.grad.__tensor_flatten__())

mode = FakeTensorMode()
fw = mode.from_tensor(w)
print("(c0) FakeTensorMode.from_tensor(ScaledTensor):", type(fw).__name__, type(fw._data).__name__, type(fw._scale).__name__)

# (c1) whole fwd+grad inside make_fx, inner tensors in
def joint(data, scale, xx):
    ww = ScaledTensor.__tensor_unflatten__({"_data": data, "_scale": scale}, None, data.shape, data.stride()).requires_grad_()
    with torch.enable_grad():
        (g,) = torch.autograd.grad(fwd(ww, xx), [ww])
    return [g._data, g._scale] if isinstance(g, ScaledTensor) else [g]
gm = make_fx(joint, tracing_mode="fake")(w._data, w._scale, x)
print("(c1) ops:", [str(n.target) for n in gm.graph.nodes if n.op == "call_function"])

# (c2) the backward only, on the real graph's nodes, saved tensors swapped (our trace's way)
loss = fwd(w, x)
nodes, seen, stack = [], set(), [loss.grad_fn]
while stack:
    fn = stack.pop()
    if fn is None or fn in seen: continue
    seen.add(fn); nodes.append(fn); stack += [f for f, _ in fn.next_functions]
saved = [(fn, a, getattr(fn, "_saved_" + a[11:])) for fn in nodes for a in dir(fn) if a.startswith("_raw_saved_")]
saved = [s for s in saved if isinstance(s[2], torch.Tensor)]
swap = {}
for i, (fn, a, real) in enumerate(saved):
    getattr(fn, a).register_hooks(lambda t: None, (lambda i: lambda _: swap[i])(i))

def flat(t):
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [getattr(t, k) for k in t.__tensor_flatten__()[0]]

def backward_only(*locs):
    it = iter(locs)
    for i, (fn, a, real) in enumerate(saved):
        if is_traceable_wrapper_subclass(real):
            keys, meta = real.__tensor_flatten__()
            swap[i] = type(real).__tensor_unflatten__({k: next(it) for k in keys}, meta, real.shape, real.stride())
        else:
            swap[i] = next(it)
    g = next(it)
    order, seen = [], set()
    def topo(f):
        if f is None or f in seen: return
        seen.add(f)
        for n, _ in f.next_functions: topo(n)
        order.append(f)
    topo(loss.grad_fn); order.reverse()
    buf, out = {loss.grad_fn: [g]}, []
    for f in order:
        ins = buf.pop(f, None)
        if ins is None: continue
        if "AccumulateGrad" in f.name():
            out.append(ins[0]); continue
        res = f(*ins)
        res = res if isinstance(res, tuple) else (res,)
        for (n, nr), r in zip(f.next_functions, res):
            if n is None or r is None: continue
            b = buf.setdefault(n, [None] * len(n._input_metadata))
            b[nr] = r if b[nr] is None else b[nr] + r
    print("  (c2) leaf grad in the trace:", [type(o).__name__ for o in out])
    return [y for o in out for y in flat(o)]
ins = [y for _, _, r in saved for y in flat(r)] + flat(torch.ones_like(loss))
gm = make_fx(backward_only, tracing_mode="fake")(*ins)
print("(c2) placeholders:", len(ins), "ops:", [str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
if "-v" in sys.argv: gm.print_readable()

# (c3) what compiled_autograd does today
import compiled_autograd as ca
ca.reset()
for i in range(2):
    w.grad = None
    loss = fwd(w, torch.randn(3, 8))
    with ca.enable(backend="eager"):
        loss.backward()
print(ca.stats())
ca.explain()
