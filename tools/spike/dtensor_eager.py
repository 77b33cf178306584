"""Spike (issue 39), experiment (a): a DTensor Linear on a 1-rank gloo mesh, eager forward and
backward: the autograd graph, what its nodes save, and what ca.enable(backend="eager") does."""
import os, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Replicate, Shard, DTensor

store = tempfile.mktemp()
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)

def model(placement):
    lin = torch.nn.Linear(8, 4)
    w = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [placement]))
    b = torch.nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Replicate()]))
    return w, b

def walk(fn, seen=None, depth=0):
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return
    seen.add(fn)
    saved = {}
    for a in dir(fn):
        if a.startswith("_saved_"):
            v = getattr(fn, a)
            saved[a] = (type(v).__name__, getattr(v, "placements", None), tuple(v.shape) if isinstance(v, torch.Tensor) else v)
    meta = [(tuple(m.shape), getattr(m, "is_tensor_subclass", None)) for m in getattr(fn, "_input_metadata", [])]
    print("  " * depth + fn.name(), saved, "input_metadata:", meta)
    for f, _ in fn.next_functions:
        walk(f, seen, depth + 1)

for placement in (Replicate(), Shard(0)):
    w, b = model(placement)
    x = distribute_tensor(torch.randn(3, 8), mesh, [Replicate()])
    y = torch.nn.functional.linear(x, w, b)
    loss = y.sum()
    print(f"== weight {placement}: y {type(y).__name__} {y.placements}, loss {type(loss).__name__} {loss.placements}")
    walk(loss.grad_fn)
    loss.backward()
    print("w.grad:", type(w.grad).__name__, w.grad.placements, "b.grad", b.grad.placements)

# what compiled_autograd does today
import compiled_autograd as ca
ca.reset()
w, b = model(Shard(0))
x = distribute_tensor(torch.randn(3, 8), mesh, [Replicate()])
for i in range(2):
    loss = torch.nn.functional.linear(x, w, b).sum()
    with ca.enable(backend="eager"):
        loss.backward()
print(ca.stats())
ca.explain()
# a plain graph whose only subclass is the root grad
p = torch.nn.Parameter(torch.randn(4))
with ca.enable(backend="eager"):
    (p * 2).backward(distribute_tensor(torch.ones(4), mesh, [Replicate()]).to_local())
dist.destroy_process_group()
