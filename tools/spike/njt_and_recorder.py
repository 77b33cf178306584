"""Spike (issue 39): (d) a jagged NestedTensor's backward: what it saves, whether it is a traceable
wrapper subclass, what ca does today; (e) whether our Recorder (capture/record.py) can record
through a subclass's __torch_dispatch__ when it returns NotImplemented for subclass types, as
make_fx's proxy mode does."""
import sys, torch
sys.path.insert(0, "tools/spike")
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from scaled import ScaledTensor, scaled
import compiled_autograd as ca

# (d) jagged nested tensor
lin = torch.nn.Linear(4, 3)
def njt_loss():
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(5, 4)], layout=torch.jagged, requires_grad=True)
    y = torch.relu(lin(nt))
    return nt, y.values().sum()
nt, loss = njt_loss()
print("(d) NJT:", type(nt).__name__, "layout", nt.layout, "traceable wrapper:", is_traceable_wrapper_subclass(nt))
keys, meta = nt.__tensor_flatten__()
print("    flatten:", keys, {k: v for k, v in meta.items() if k != "metadata_cache"}, "cache keys:", list(meta.get("metadata_cache", {}).keys()))
stack, seen = [loss.grad_fn], set()
while stack:
    fn = stack.pop()
    if fn is None or fn in seen: continue
    seen.add(fn)
    print("    ", fn.name(), {a: (type(getattr(fn, a)).__name__, str(getattr(fn, a).layout)) for a in dir(fn) if a.startswith("_saved_") and isinstance(getattr(fn, a), torch.Tensor)})
    stack += [f for f, _ in fn.next_functions]
ca.reset()
for i in range(2):
    nt, loss = njt_loss()
    with ca.enable(backend="eager"):
        loss.backward()
print("   ", ca.stats())
print("   ", ca.stats().fallback_details)

# (e) our Recorder through ScaledTensor's dispatch
from compiled_autograd.capture.record import Recorder, record
from torch._subclasses.fake_tensor import FakeTensorMode, FakeTensor

class SubclassRecorder(Recorder):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(not issubclass(t, FakeTensor) for t in types):
            return NotImplemented   # the subclass's __torch_dispatch__ runs; its inner ops come back here
        return super().__torch_dispatch__(func, types, args, kwargs)

mode = FakeTensorMode()
data, scale, g = mode.from_tensor(torch.randn(3, 4)), mode.from_tensor(torch.tensor(0.5)), mode.from_tensor(torch.randn(3, 4))
def fn(data, scale, g):
    s = ScaledTensor.__tensor_unflatten__({"_data": data, "_scale": scale}, None, data.shape, data.stride())
    out = torch.ops.aten.tanh_backward.default(g, s) * s
    return [out._data, out._scale] if isinstance(out, ScaledTensor) else [out]
for cls in (Recorder, SubclassRecorder):
    try:
        with mode:
            gm = record(fn, [data, scale, g], cls())
        print(f"(e) {cls.__name__}: ops", [str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
    except Exception as e:
        print(f"(e) {cls.__name__}: refused:", type(e).__name__, e)
