import warnings

import pytest
import torch

import compiled_autograd as ca

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _fresh_cache():
    ca.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
    ca.reset()
