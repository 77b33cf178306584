# ours + inductor (background compile on by default): while inductor compiles in the background thread,
# AOTAutograd enters torch.autograd.detect_anomaly(check_nan=False), which is process-wide, so the
# main thread sees anomaly mode on: its backwards fall back to eager ("anomaly mode") and its forwards
# run with anomaly mode (traceback recording).
import torch, torch.nn as nn
import compiled_autograd as ca

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
x = torch.randn(8, 64)
with ca.enable(backend="inductor"):
    net(x).sum().backward()  # capture; inductor compiles in a background thread
steps = anomaly_seen = 0
while ca.stats().compiles_pending:
    anomaly_seen += torch.is_anomaly_enabled()
    with ca.enable(backend="inductor"):
        net(x).sum().backward()
    steps += 1
ca.synchronize()
s = ca.stats()
print(f"backwards during the background compile: {steps}; main thread saw is_anomaly_enabled(): {anomaly_seen} times")
print(f"eager_fallbacks={s.eager_fallbacks} reasons={dict(s.fallback_reasons)} hits={s.hits}")
