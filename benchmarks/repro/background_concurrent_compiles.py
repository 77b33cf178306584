# ours + inductor, background compile (default): two backwards that capture two graphs in a row
# (a static one, then the dynamic one when the sizes change) start two compile threads at once;
# inductor's compile is not thread-safe (TritonBundler.begin_compile: `assert cls._entries is None`),
# so one fails: "background compile failed, the traced graph stays in use" / stats().compile_failures.
# Racy: it depends on the two compiles overlapping (they did in the quick benchmark run).
import torch, torch.nn as nn
import compiled_autograd as ca

torch.manual_seed(0)
enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False)
for b, s in [(6, 8), (5, 16), (5, 16), (6, 16)]:
    enc.zero_grad(set_to_none=True)
    with ca.enable(backend="inductor"):
        enc(torch.randn(b, s, 32)).pow(2).mean().backward()
ca.synchronize()
st = ca.stats()
print(
    f"captures={st.captures} dynamic={st.dynamic_captures} compile_failures={getattr(st, 'compile_failures', '?')} "
    f"eager_fallbacks={st.eager_fallbacks} {dict(st.fallback_reasons)}"
)
