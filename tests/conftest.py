import os
import warnings

os.environ.setdefault("COMPILED_AUTOGRAD_DISK_CACHE", "0")  # tests count captures; test_diskcache opts in
os.environ.setdefault("COMPILED_AUTOGRAD_LINT", "1")  # every captured graph is linted (capture/lint.py)

import pytest
import torch
import torch._functorch.config

import compiled_autograd as ca

torch.set_num_threads(min(2, torch.get_num_threads()))
# Where the environment sets CI, torch raises (elsewhere it warns) when a compiled function's
# first call sees a custom op's output alias its input; run the tests as CI does everywhere.
torch._functorch.config.error_on_custom_op_aliasing = True


@pytest.fixture(autouse=True)
def _fresh_cache():
    ca.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
    ca.reset()
