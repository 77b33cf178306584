"""Whole models: compiled gradients equal eager's, one capture, then hits."""

import pytest
import torch
import torch.nn as nn

from helpers import assert_grads_equal, parity


def mlp():
    layers = []
    for _ in range(3):
        layers += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    return nn.Sequential(*layers, nn.Linear(16, 4))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    ).train()


def transformer():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class EmbeddingLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True)
        self.out = nn.Linear(24, 7)

    def forward(self, tokens):
        return self.out(self.lstm(self.emb(tokens))[0])


MODELS = {
    "mlp": (mlp, lambda s: (torch.randn(8, 16),)),
    "cnn": (cnn, lambda s: (torch.randn(2, 3, 12, 12),)),
    "transformer": (transformer, lambda s: (torch.randn(3, 10, 32),)),
    "embedding_lstm": (EmbeddingLSTM, lambda s: (torch.randint(0, 50, (3, 9)),)),
}


def _check(name, backend, steps=2):
    torch.manual_seed(0)
    build, make_inputs = MODELS[name]
    model = build()

    def loss_fn(x):
        out = model(x)
        return (out.float() ** 2).mean() + out.float().sum() * 0.1

    parity(loss_fn, list(model.parameters()), make_inputs, backend=backend, steps=steps)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "transformer" else n for n in MODELS])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_model_parity(name, backend):
    _check(name, backend)


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_model_parity_inductor(name):
    _check(name, "inductor")


def test_training_loop_with_optimizer_hits_every_step():
    torch.manual_seed(0)
    model, ref = mlp(), mlp()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    import compiled_autograd as ca

    for step in range(4):
        x = torch.randn(8, 16)
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        with ca.enable("aot_eager"):
            model(x).pow(2).mean().backward()
        opt.step()
    assert_grads_equal([p.detach() for p in model.parameters()], [q.detach() for q in ref.parameters()], what="weights", exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 3, 0)
