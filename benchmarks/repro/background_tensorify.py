# ours + inductor with the default background compile: the background compile of a chain of
# elementwise ops fails with TensorifyScalarRestartAnalysis and the traced graph stays in use.
import sys, torch
import compiled_autograd as ca

n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
background = (sys.argv[2] != "sync") if len(sys.argv) > 2 else True
torch.manual_seed(1)
x = (torch.rand(16) * 0.5 + 0.5).requires_grad_()


def loss():
    y = x
    for i in range(n - 2):
        y = y * 1.0001 if i % 3 == 0 else (y + 0.0001 if i % 3 == 1 else torch.sin(y))
    return y.sum()


with ca.enable(backend="inductor", background=background):
    loss().backward()
ca.synchronize()
s = ca.stats()
print(
    f"background={background} captures={s.captures} compile_failures={getattr(s, 'compile_failures', '?')} "
    f"fallbacks={dict(s.fallback_reasons)} compiled={[getattr(e, 'compiled', '?') for e in ca.graphs()]}"
)
