"""A jagged nested-tensor training step (forward + backward) with compiled_autograd, whose nested
nodes run opaquely with their grads held by reference (NOTE [Values passed by reference],
src/compiled_autograd/nodes/references.py), against eager, in one process:

    PYTHONPATH=src .venv/bin/python -m benchmarks.repro.nested_step

Prints the median step over 20 steps after 4 for eager, ours on aot_eager and on inductor.
"""

import torch, time, statistics, compiled_autograd as ca

torch.set_num_threads(2)
D = 256


class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.l1 = torch.nn.Linear(D, 4 * D)
        s.l2 = torch.nn.Linear(4 * D, D)
        s.ln = torch.nn.LayerNorm(D)
        s.head = torch.nn.Linear(D, D)

    def forward(s, nt):
        h = s.ln(s.l2(torch.nn.functional.gelu(s.l1(nt))) + nt)
        return s.head(h.values())  # plain from here on


torch.manual_seed(0)
m = M()
lens = [100, 80, 120, 60, 90, 110, 70, 100]


def batch():
    return torch.nested.nested_tensor([torch.randn(n, D) for n in lens], layout=torch.jagged)


def step(scope):
    loss = m(batch()).pow(2).mean()
    with scope():
        loss.backward()
    m.zero_grad(set_to_none=True)


res = {}
for name, scope in [
    ("eager", ca.disable),
    ("ours aot_eager", lambda: ca.enable(backend="aot_eager")),
    ("ours inductor", lambda: ca.enable(backend="inductor", background=False)),
]:
    for _ in range(4):
        step(scope)
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        step(scope)
        ts.append(time.perf_counter() - t)
    res[name] = statistics.median(ts)
for k, v in res.items():
    print(f"{k}: {v * 1e3:.1f} ms ({v / res['eager']:.2f}x)")
print(ca.stats())
