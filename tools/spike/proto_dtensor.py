"""Spike (issue 39): the step-1 prototype (COMPILED_AUTOGRAD_SUBCLASSES=1) on DTensor, no custom
Function in the graph: a 2-layer MLP with colwise/rowwise weights (Shard(0), Shard(1)), a
Replicate input, `.sum()` of the Partial output as the loss (its root grad a Partial DTensor).
`python tools/spike/proto_dtensor.py gloo|fake [backend] [colrow|repcol]`: a 1-rank gloo group, or a fake 2-rank
one in this process (its collectives do nothing, in eager and in our graph alike: parity holds)."""
import os, sys, tempfile, torch, torch.distributed as dist
os.environ["COMPILED_AUTOGRAD_SUBCLASSES"] = "1"
os.environ.setdefault("COMPILED_AUTOGRAD_DISK_CACHE", "0")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Replicate, Shard
import compiled_autograd as ca

kind = sys.argv[1] if len(sys.argv) > 1 else "gloo"
backend = sys.argv[2] if len(sys.argv) > 2 else "eager"
# "colrow": w1 Shard(0), w2 Shard(1) (no collective in the backward: DTensor keeps grads Partial);
# "repcol": w1 Replicate, w2 Shard(0): the Partial root grad meets a sharded contraction
layout = sys.argv[3] if len(sys.argv) > 3 else "colrow"
P1, P2 = {"colrow": (Shard(0), Shard(1)), "repcol": (Replicate(), Shard(0))}[layout]
if kind == "fake":
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
else:
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tempfile.mktemp()}")
    mesh = init_device_mesh("cpu", (1,))

torch.manual_seed(0)
W1, W2 = torch.randn(16, 8), torch.randn(8, 16)
xs = [torch.randn(4, 8) for _ in range(3)]

def steps(compiled):
    w1 = distribute_tensor(W1, mesh, [P1]).requires_grad_()
    w2 = distribute_tensor(W2, mesh, [P2]).requires_grad_()
    out = []
    for X in xs:
        x = distribute_tensor(X, mesh, [Replicate()]).requires_grad_()
        loss = (torch.relu(x @ w1.t()) @ w2.t()).sum()
        with ca.enable(backend=backend, fullgraph=True) if compiled else ca.disable():
            loss.backward()
        out.append([(g.placements, g.to_local().clone()) for g in (x.grad, w1.grad, w2.grad)])
    return out

want = steps(False)
got = steps(True)
same = all(pw == pg and torch.equal(a, b) for sw, sg in zip(want, got) for (pw, a), (pg, b) in zip(sw, sg))
print(f"{kind} {backend} {layout}: placements {[p for p, _ in got[0]]}; bitwise and same placements as eager: {same}")
print(ca.stats())
(entry,) = ca.graphs()
print("graph ops:", [str(n.target) for n in entry.graph.graph.nodes if n.op == "call_function"])
dist.destroy_process_group()
