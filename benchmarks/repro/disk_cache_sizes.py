# Two processes, same structure, different sizes: the second loads the first's graph from the
# on-disk cache and falls back to eager on every backward. Run:
#   export COMPILED_AUTOGRAD_GRAPH_DIR=$(mktemp -d)
#   python disk_repro.py 16; python disk_repro.py 32
import sys, torch, torch.nn as nn
import compiled_autograd as ca

d = int(sys.argv[1])
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
x = torch.randn(4, d)
for _ in range(3):
    net.zero_grad(set_to_none=True)
    with ca.enable(backend="aot_eager"):
        net(x).pow(2).mean().backward()
s = ca.stats()
print(
    f"d={d}: captures={s.captures} disk_hits={getattr(s, 'disk_hits', '?')} hits={s.hits} "
    f"eager_fallbacks={s.eager_fallbacks} {dict(s.fallback_reasons)}"
)
