"""Tests ported from PyTorch's own compiled-autograd test file,
`test/inductor/test_compiled_autograd.py` (class TestCompiledAutograd):

    test_accumulate_grad_polyfill_case_1_1    a dense grad stolen into `.grad` (no copy)
    test_accumulate_grad_polyfill_case_1_2    a sparse grad stolen into `.grad`
    test_accumulate_grad_polyfill_case_1_3    a sparse grad cloned into `.grad` under create_graph
    test_accumulate_grad_polyfill_case_2_3_2  a sparse grad added in place into a sparse `.grad`
    test_accumulate_grad_polyfill_case_3_2    create_graph into an existing dense `.grad`
    test_trace_run_with_rng_state             a checkpointed SDPA in a torch.compile'd forward

Each keeps the upstream test's body and its assertions, run once in eager and once compiled
(upstream's `check_output_and_recompiles`, which compares the two), on the `aot_eager`
backend and through upstream's own `compiler_fn` (torch.compile of the graph, fullgraph and
dynamic, on aot_eager) given as a callable backend, as a user gives one; and on two different
inputs through one cache entry: the second backward a hit.
Upstream's counters (captures, compiles) become ours (captures, hits, eager fallbacks).
Upstream defines each custom Function inside the test's function, a new class per call (a new
graph each time); here it is defined once, so that the second backward can hit.

Upstream's TestCase turns on `torch.sparse.check_sparse_tensor_invariants` for every test
(common_utils.TestCase.setUp). It changes what a trace sees: `torch.sparse_coo_tensor` then
validates its indices by reading their data, which a trace on fakes cannot do, so the custom
Function's backward is no longer traceable. The sparse cases run both ways (`invariants`).
"""

import pytest
import torch
import torch.nn.functional as F

import compiled_autograd as ca
from helpers import compare


def _upstream_compiler_fn(gm):
    """Upstream's `make_compiler_fn(backend="aot_eager")`: the graph torch.compile'd."""
    from torch._dynamo.backends.debugging import aot_eager

    def inner(gm_, example_inputs_):
        return aot_eager(gm_, example_inputs_)

    return torch.compile(gm, backend=inner, fullgraph=True, dynamic=True)


_HELD = []  # the storages the hooks saw, kept alive for the test's length


def _storage_id(storage):
    """Upstream compares `id()` of storage objects; a storage freed after the hook (the grad
    copied) may leave its address to the next one, and `id()` then says "same": a flaky "Should be
    copied" (seen once in a full run). The storage is held and its data pointer compared: the
    same meaning (the same memory), and no address is reused while it is held."""
    _HELD.append(storage)
    return storage.data_ptr()


def upstream_backend(gm, example_inputs):
    """Upstream's compiler_fn as a callable backend of ours (ours also passes the inputs)."""
    return _upstream_compiler_fn(gm)


# our aot_eager, and upstream's compiler_fn given as a user's backend
BACKENDS = pytest.mark.parametrize("backend", ["aot_eager", pytest.param(upstream_backend, id="upstream_compiler_fn")])


class BaseCustomOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError("must override")


@pytest.fixture(params=[False, True], ids=["invariants_off", "invariants_on"])
def invariants(request):
    """Sparse tensor invariant checks, off (the default) or on (upstream's TestCase)."""
    was = torch.sparse.check_sparse_tensor_invariants.is_enabled()
    if request.param:
        torch.sparse.check_sparse_tensor_invariants.enable()
    else:
        torch.sparse.check_sparse_tensor_invariants.disable()
    yield request.param
    if was:
        torch.sparse.check_sparse_tensor_invariants.enable()
    else:
        torch.sparse.check_sparse_tensor_invariants.disable()


def _leaf(step):
    # upstream's `torch.randn(2, 2, requires_grad=True)` after torch.manual_seed(123); a new
    # value per step
    torch.manual_seed(123 + step)
    return torch.randn(2, 2, requires_grad=True)


def _check_counts(invariants, steps, opaque_per_backward):
    """With invariant checks the Function's backward cannot be traced (above): it runs opaquely,
    and may first run a backward in eager to learn how its outputs are laid out (NOTE [Layouts
    of call outputs]). Either way: one capture, no fallback, and every later backward a hit."""
    s = ca.stats()
    assert s.eager_fallbacks == 0, s.fallback_reasons
    assert s.captures == 1, s
    if not invariants:
        assert (s.learning_backwards, s.hits, s.opaque_nodes) == (0, steps - 1, 0), s
    else:
        assert s.hits == steps - 1 - s.learning_backwards and s.hits >= 1, s
        assert s.opaque_nodes == opaque_per_backward * (1 + s.hits), s
    assert s.layout_copies == 0, s  # (a sparse grad copied into a dense layout: not eager's grad)


# -- Case 1.1: stealable dense new_grad ----------------------------------------------------------
# AccumulateGrad: !GradMode::is_enabled() && !new_grad.is_sparse() && ... &&
# use_count(new_grad) <= num_expected_refs && obeys_layout_contract(new_grad, variable)


class StealableDenseOp(BaseCustomOp):
    @staticmethod
    def backward(ctx, grad_output):
        return torch.ones_like(grad_output, requires_grad=False) * 5


@BACKENDS
def test_accumulate_grad_polyfill_case_1_1(backend):
    """With a user's backend too: a leaf whose only hook is its own accumulates after the graph,
    where AccumulateGrad steals what the backend returned (NOTE [A leaf's hooks under
    create_graph]; before: a copy, "Should be stolen")."""

    def run(step, scope):
        pre_hook_storage_id = None

        def check(grad):
            nonlocal pre_hook_storage_id
            assert pre_hook_storage_id is None
            pre_hook_storage_id = _storage_id(grad.untyped_storage())

        var = _leaf(step)
        var.register_hook(check)
        output = StealableDenseOp.apply(var)
        with scope:
            output.backward(torch.ones_like(output))

        assert var.grad is not None, "Grad should be defined"
        assert torch.equal(var.grad, torch.ones_like(var) * 5), "Grad content should be as returned by backward"
        assert var.grad.requires_grad is False, "Detached grad should not require grad"
        assert _storage_id(var.grad.untyped_storage()) == pre_hook_storage_id, "Should be stolen"
        return var.grad

    compare(run, backend, steps=2, captures=1, hits=1)


# -- Case 1.2: stealable sparse new_grad (upstream: expectedFailure) ------------------------------
# AccumulateGrad: !GradMode::is_enabled() && new_grad.is_sparse() && indices and values
# contiguous, used by it alone && new_grad.use_count() <= num_expected_refs


class StealableSparseOp(BaseCustomOp):
    @staticmethod
    def backward(ctx, grad_output):
        size = grad_output.size()
        indices = torch.tensor([[0, 1], [0, 1]], dtype=torch.int64)
        values = torch.tensor([5.0, 5.0])
        return torch.sparse_coo_tensor(indices, values, size, requires_grad=False)


def test_accumulate_grad_polyfill_case_1_2(invariants):
    def run(step, scope):
        pre_hook_storages_id = None

        def check(grad):
            nonlocal pre_hook_storages_id
            assert pre_hook_storages_id is None
            pre_hook_storages_id = [
                _storage_id(grad._indices().untyped_storage()),
                _storage_id(grad._values().untyped_storage()),
            ]

        var = _leaf(step)
        var.register_hook(check)
        output = StealableSparseOp.apply(var)
        with scope:
            output.backward(torch.ones_like(output))

        assert var.grad is not None, "Grad should be defined"
        assert var.grad.is_sparse, "Grad should be sparse"
        expected_dense_grad = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
        assert torch.equal(var.grad.to_dense(), expected_dense_grad), "Content should be equal after shallow copy"
        assert var.grad.requires_grad is False, "Detached grad should not require grad"
        assert _storage_id(var.grad._indices().untyped_storage()) == pre_hook_storages_id[0], "Should be stolen"
        assert _storage_id(var.grad._values().untyped_storage()) == pre_hook_storages_id[1], "Should be stolen"
        return var.grad.to_dense(), var.grad.is_sparse

    steps = 3 if invariants else 2
    compare(run, "aot_eager", steps=steps, captures=None, hits=None, learning_backwards=None, opaque_nodes=None)
    _check_counts(invariants, steps, opaque_per_backward=1)


# -- Case 1.3: cloning a sparse new_grad (create_graph) ------------------------------------------
# AccumulateGrad, grad mode on: new_grad.is_sparse() -> update_grad(new_grad.clone())


class CloneSparseGradOp(BaseCustomOp):
    @staticmethod
    def backward(ctx, grad_output):
        size = grad_output.size()
        indices = torch.tensor([[0, 1], [0, 1]], dtype=torch.int64)
        values = torch.tensor([5.0, 5.0], requires_grad=True)  # Requires grad
        return torch.sparse_coo_tensor(indices, values, size, requires_grad=True)


@pytest.mark.parametrize(
    "backend, invariants",
    [("aot_eager", False), ("aot_eager", True), pytest.param(upstream_backend, True, id="upstream_compiler_fn-True")],
    indirect=["invariants"],
)
def test_accumulate_grad_polyfill_case_1_3(backend, invariants):
    """With invariant checks (upstream's harness) the Function's backward cannot be traced
    (torch.sparse_coo_tensor reads its indices): it runs opaquely, and the create_graph graph
    runs as traced, in grad mode (NOTE [create_graph with an opaque node]; before: the whole
    backward in eager). (Upstream's compiler_fn cannot take the traced sparse grad without
    invariants: dynamo "cannot wrap a sparse Tensor", the backend's own limit.)"""

    def run(step, scope):
        pre_hook_storages_id = None

        def check(grad):
            nonlocal pre_hook_storages_id
            assert pre_hook_storages_id is None
            pre_hook_storages_id = [
                _storage_id(grad._indices().untyped_storage()),
                _storage_id(grad._values().untyped_storage()),
            ]

        var = _leaf(step)
        var.register_hook(check)
        output = CloneSparseGradOp.apply(var)
        with scope:
            output.backward(torch.ones_like(output), create_graph=True)  # grad mode == create_graph

        assert var.grad is not None, "Grad should be defined"
        assert var.grad.is_sparse, "Grad should be sparse"
        expected_dense_grad = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
        assert torch.equal(var.grad.to_dense(), expected_dense_grad), "Content should be equal after clone"
        assert var.grad.requires_grad, "Grad should require grad for double backward"
        assert _storage_id(var.grad._indices().untyped_storage()) != pre_hook_storages_id[0], "Should be copied"
        assert _storage_id(var.grad._values().untyped_storage()) != pre_hook_storages_id[1], "Should be copied"
        return var.grad.detach().to_dense(), var.grad.is_sparse, var.grad.requires_grad

    steps = 3 if invariants else 2
    compare(run, backend, steps=steps, captures=None, hits=None, learning_backwards=None, opaque_nodes=None)
    _check_counts(invariants, steps, opaque_per_backward=1)


# -- Case 2.3.2: sparse .grad += sparse new_grad, in place ---------------------------------------
# AccumulateGrad, grad mode off, variable_grad defined: variable_grad += new_grad


class SparseVarGradSparseNewGradOp(BaseCustomOp):
    @staticmethod
    def backward(ctx, grad_output):
        size = grad_output.size()
        indices = torch.tensor([[0, 1], [0, 1]], dtype=torch.int64)
        values = torch.tensor([3.0, 3.0])
        return torch.sparse_coo_tensor(indices, values, size, requires_grad=False)


def test_accumulate_grad_polyfill_case_2_3_2(invariants):
    def run(step, scope):
        var = _leaf(step)
        indices_v = torch.tensor([[0, 0], [0, 1]], dtype=torch.int64)
        values_v = torch.tensor([1.0, 2.0])
        var.grad = torch.sparse_coo_tensor(indices_v, values_v, var.size(), requires_grad=False)
        initial_grad_ref = var.grad

        output = SparseVarGradSparseNewGradOp.apply(var)

        new_grad_for_sum = torch.sparse_coo_tensor(
            torch.tensor([[0, 1], [0, 1]], dtype=torch.int64),
            torch.tensor([3.0, 3.0]),
            var.size(),
        )
        expected_sum_dense = initial_grad_ref.to_dense() + new_grad_for_sum.to_dense()

        with scope:
            output.backward(torch.ones_like(output))

        assert var.grad is not None, "Grad should be defined"
        assert var.grad.is_sparse, "Resulting grad should remain sparse"
        assert torch.equal(var.grad.to_dense(), expected_sum_dense), "Grad content should be the sum of sparse grads"
        assert var.grad is initial_grad_ref, "Grad object should be modified in-place (same object)"
        return var.grad.to_dense(), var.grad.is_sparse

    steps = 3 if invariants else 2
    compare(run, "aot_eager", steps=steps, captures=None, hits=None, learning_backwards=None, opaque_nodes=None)
    _check_counts(invariants, steps, opaque_per_backward=1)


# -- Case 3.2: create_graph into an existing dense .grad -----------------------------------------
# AccumulateGrad, grad mode on, variable_grad defined: result = variable_grad + new_grad


class DenseVarGradDenseNewGradDoubleBackwardOp(BaseCustomOp):
    @staticmethod
    def backward(ctx, grad_output):
        return torch.ones_like(grad_output, requires_grad=True) * 3.0


@BACKENDS
def test_accumulate_grad_polyfill_case_3_2(backend):
    def run(step, scope):
        var = _leaf(step)
        var.grad = torch.ones_like(var) * 1.0
        initial_grad_ref = var.grad

        output = DenseVarGradDenseNewGradDoubleBackwardOp.apply(var)

        expected_sum = initial_grad_ref + (torch.ones_like(var, requires_grad=True) * 3.0)

        with scope:
            output.backward(torch.ones_like(output), create_graph=True)

        assert var.grad is not None, "Grad should be defined"
        assert not var.grad.is_sparse, "Resulting grad should be dense"
        assert torch.equal(var.grad, expected_sum), "Grad content should be the sum"
        assert var.grad is not initial_grad_ref, "Grad object should be replaced (out-of-place)"
        assert var.grad.requires_grad, "Resulting grad should track history for double backward"
        return var.grad

    compare(run, backend, steps=2, captures=1, hits=1, requires_grad=True)


# -- run_with_rng_state ---------------------------------------------------------------------------


def _sdpa(xq, xk):
    return F.scaled_dot_product_attention(xq, xk, xk, is_causal=True)


def _g(xq_1, xk_1, xq_2, xk_2):
    # xq: (bs, n_local_heads, seqlen, head_dim)
    # xk: (bs, n_local_heads, cache_len + seqlen, head_dim)
    y1 = _sdpa(xq_1, xk_1)
    y2 = torch.utils.checkpoint.checkpoint(_sdpa, xq_2, xk_2, use_reentrant=False)
    y = torch.mul(y1, y2)
    z = torch.matmul(y, y)
    return z


@BACKENDS
def test_trace_run_with_rng_state(backend):
    """`run_with_rng_state` only shows up in the backward of the compiled region (the
    partitioner inserts it for the recomputed SDPA): our graph must trace it in, not run the
    region's backward opaquely. Upstream also checks inductor's post-grad graph; on aot_eager,
    the captured graph is what is checked."""
    torch._dynamo.reset()
    compiled_g = torch.compile(_g, fullgraph=True)

    def run(step, scope):
        bs, n_local_heads, seqlen, head_dim, cache_len = 1, 1, 2, 2, 2
        # upstream's torch.ones inputs; the second step's differ
        xq_list = [(torch.ones((bs, n_local_heads, seqlen, head_dim)) + step * i).requires_grad_() for i in range(2)]
        xk_list = [(torch.ones((bs, n_local_heads, cache_len + seqlen, head_dim)) - step * i / 4).requires_grad_() for i in range(2)]
        torch.manual_seed(123)
        out = compiled_g(xq_list[0], xk_list[0], xq_list[1], xk_list[1])
        with scope:
            out.sum().backward()
        return out.detach(), *[x.grad for x in xq_list + xk_list]

    compare(run, backend, steps=2, captures=1, hits=1, opaque_nodes=0)
    (entry,) = ca.graphs()
    assert any(node.target is torch.ops.higher_order.run_with_rng_state for node in entry.graph.graph.nodes), entry.graph.code
