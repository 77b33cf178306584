// trace: run one node's real backward formula (`apply_with_saved`) with its
// saved tensors swapped for the tracer's fake tensors (Tracer), and swap a
// custom Function's saved tensors while Python traces its backward
// (PyNodeSavedSwap). The Python side (capture/trace.py) drives these per node.

#include "capture.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace compiled_autograd_native {

// ---------------------------------------------------------------------------
// Tracing interface. Each generated node binds its pure backward function the
// first time its `apply_with_saved` runs in this process; we keep them and
// call them directly while tracing, so the aten ops they run are recorded by
// the Python tracing modes active on this thread.
// ---------------------------------------------------------------------------
static std::unordered_map<std::string, cad::functional_apply_t>& functionals() {
  static std::unordered_map<std::string, cad::functional_apply_t> table;
  return table;
}

static variable_list copy_slices_prologue(
    const variable_list& inputs,
    const at::TensorGeometry& base,
    const at::TensorGeometry& view) {
  const at::Tensor& grad = inputs[0];
  TORCH_CHECK(grad.defined(), "CopySlices: undefined grad");
  auto result = grad.new_empty_strided_symint(base.sym_sizes(), base.sym_strides());
  result.copy_(grad);
  auto offset = view.sym_storage_offset() - base.sym_storage_offset();
  auto grad_slice = result.as_strided_symint(view.sym_sizes(), view.sym_strides(), offset);
  return {result, grad_slice, grad_slice.clone(at::MemoryFormat::Contiguous)};
}

static variable_list copy_slices_epilogue(
    const std::vector<bool>& needs_input_grad,
    const at::Tensor& result,
    const variable_list& res,
    const at::Tensor& grad_slice) {
  variable_list grad_inputs(needs_input_grad.size());
  for (size_t i = 0; i < needs_input_grad.size() && i < res.size(); ++i) {
    if (!needs_input_grad[i] || !res[i].defined()) {
      continue;
    }
    if (i == 0) {
      grad_slice.copy_(res[i]);
      grad_inputs[i] = result;
    } else {
      grad_inputs[i] = res[i];
    }
  }
  return grad_inputs;
}

// NOTE [Sharing functionals with torch's compiled autograd]
// A generated node binds its functional form once per process, through the
// compiled-autograd interface active the first time it is traced (a
// function-local static in torch's generated code), and reuses the returned
// name ever after. Whichever of torch's built-in compiled autograd and ours
// traces a node type first therefore decides where its functional lives. So
// that both keep working in one process, we register every functional we bind
// in torch's namespace too (`torch._dynamo.compiled_autograd.ops`, with the
// Python calling convention torch's own binder uses: `(grads: list[Tensor |
// None], *packed_args)` -> `list[Tensor | None]`) and use the name it assigns;
// and a name bound by torch first is called through that namespace.
static std::vector<at::Tensor> to_tensors(const std::vector<std::optional<at::Tensor>>& xs) {
  std::vector<at::Tensor> out;
  out.reserve(xs.size());
  for (const auto& x : xs) {
    out.emplace_back(x.has_value() ? *x : at::Tensor());
  }
  return out;
}

static std::string share_with_torch(
    const std::string& fn_name,
    const cad::functional_apply_t& fn,
    std::vector<at::TypePtr> schema,
    bool is_custom_function,
    bool is_traceable) {
  py::gil_scoped_acquire gil;
  try {
    auto py_fn = py::cpp_function(
        [schema = std::move(schema), fn](
            std::vector<std::optional<at::Tensor>>& grads, const py::args& py_args) -> py::object {
          TORCH_CHECK(py_args.size() == schema.size(), "functional called with ", py_args.size(),
                      " packed args, expected ", schema.size());
          std::vector<at::IValue> args;
          args.reserve(schema.size());
          for (size_t i = 0; i < schema.size(); i++) {
            py::handle arg = py_args[i];
            if (schema[i]->isSubtypeOf(*at::ListType::ofTensors())) {
              args.emplace_back(to_tensors(py::cast<std::vector<std::optional<at::Tensor>>>(arg)));
            } else {
              args.emplace_back(torch::jit::toIValue(arg, schema[i], std::nullopt));
            }
          }
          return torch::jit::toPyObject(at::IValue(fn(to_tensors(grads), args)));
        });
    py::object ops = py::module_::import("torch._dynamo.compiled_autograd").attr("ops");
    return ops.attr("add")(fn_name, py_fn, is_custom_function, is_traceable).cast<std::string>();
  } catch (const std::exception&) {
    // torch's compiled autograd unavailable or the name taken: keep ours private
    PyErr_Clear();
    return fn_name;
  }
}

static variable_list call_torch_functional(
    const std::string& fn_name,
    const variable_list& grads,
    const cad::ivalue_list& packed_args) {
  py::gil_scoped_acquire gil;
  py::object op = py::module_::import("torch._dynamo.compiled_autograd").attr("ops").attr("get")(fn_name);
  py::tuple args(packed_args.size() + 1);
  std::vector<std::optional<at::Tensor>> opt_grads;
  opt_grads.reserve(grads.size());
  for (const auto& g : grads) {
    opt_grads.emplace_back(g.defined() ? std::optional<at::Tensor>(g) : std::nullopt);
  }
  args[0] = py::cast(opt_grads);
  for (size_t i = 0; i < packed_args.size(); i++) {
    args[i + 1] = torch::jit::toPyObject(packed_args[i]);
  }
  return to_tensors(py::cast<std::vector<std::optional<at::Tensor>>>(op(*args)));
}

// The message of an exception caught while tracing. A Python error raised inside an aten op
// (a dispatch mode's refusal, a fake tensor's error) reaches C++ as torch's python_error,
// thrown before its message is built: what() is empty and the error is still Python's
// pending error. Taken as is, an empty message read as "no error": the node's grads came back
// undefined and the trace went on, a graph that returned None where eager returns a gradient
// (a 0-element circular pad whose live record refused a copy_). So the pending Python error
// is fetched (and cleared) for the message, and a message is never empty.
static std::string describe(const std::exception& e) {
  std::string what = e.what();
  if (what.empty()) {
    py::gil_scoped_acquire gil;
    if (PyErr_Occurred()) {
      py::error_already_set pending;  // fetches and clears Python's error indicator
      what = pending.what();
    }
  }
  return what.empty() ? std::string("an error without a message") : what;
}

// NOTE [Deferred trace errors]
// A node's apply_with_saved swaps its saved values for proxies, calls us, and
// swaps them back. If we threw from inside, the swap-back would be skipped and
// the user's graph would keep our proxies. So the interface never throws: it
// records the first error, returns undefined grads for the rest of the node,
// and apply_node raises it once the node has restored its state.
struct TraceInterface : public cad::PyCompilerInterface {
  mutable std::string error;
  // proxies of the saved tensors unpacked before the trace; an undefined one is
  // unpacked in the graph: `unpack_in_graph(hook_input_id)` emits that call
  const std::vector<at::Tensor>* unpacked = nullptr;
  const py::object* unpack_in_graph = nullptr;

  std::string bind_function(
      PyObject* /*py_compiler*/,
      const std::string& fn_name,
      cad::functional_apply_t fn,
      std::vector<at::TypePtr> schema,
      bool is_custom_function,
      bool is_traceable) const override {
    std::string name = share_with_torch(fn_name, fn, std::move(schema), is_custom_function, is_traceable);
    functionals()[name] = std::move(fn);
    return name;
  }

  template <typename F>
  variable_list guarded(size_t n_out, const F& f) const {
    if (!error.empty()) {
      return variable_list(n_out);
    }
    try {
      return f();
    } catch (const std::exception& e) {
      error = describe(e);
      return variable_list(n_out);
    }
  }

  variable_list call_function(
      PyObject* /*py_compiler*/,
      const char* method_name,
      const std::string& fn_name,
      const variable_list& inputs,
      const cad::ivalue_list& packed_args,
      const c10::IValue& output_metadata) const override {
    size_t n_out = output_metadata.isList() ? output_metadata.toList().size() : 0;
    return guarded(n_out, [&]() -> variable_list {
      TORCH_CHECK(
          std::string(method_name) == "apply_functional",
          "unsupported trace call ", method_name);
      auto it = functionals().find(fn_name);
      if (it == functionals().end()) {
        return call_torch_functional(fn_name, inputs, packed_args);
      }
      return it->second(inputs, packed_args);
    });
  }

  variable_list call_copy_slices_prologue(
      PyObject* /*py_compiler*/,
      const variable_list& inputs,
      const at::TensorGeometry& base,
      const at::TensorGeometry& view) const override {
    return guarded(3, [&]() { return copy_slices_prologue(inputs, base, view); });
  }

  variable_list call_copy_slices_epilogue(
      PyObject* /*py_compiler*/,
      const std::vector<bool>& needs_input_grad,
      const at::Tensor& result,
      const variable_list& res,
      const at::Tensor& grad_slice) const override {
    return guarded(needs_input_grad.size(), [&]() {
      return copy_slices_epilogue(needs_input_grad, result, res, grad_slice);
    });
  }

  at::Tensor call_unpack(
      PyObject* /*py_compiler*/,
      std::optional<size_t> /*hook_id*/,
      size_t hook_input_id) const override {
    if (!error.empty()) {
      return at::Tensor();
    }
    if (unpacked == nullptr || hook_input_id >= unpacked->size()) {
      error = "saved tensor unpacked by a hook was not collected";
      return at::Tensor();
    }
    const at::Tensor& proxy = (*unpacked)[hook_input_id];
    if (proxy.defined()) {
      return proxy;
    }
    try {
      return py::cast<at::Tensor>((*unpack_in_graph)(hook_input_id));
    } catch (const std::exception& e) {
      error = describe(e);
      return at::Tensor();
    }
  }
};

// ---------------------------------------------------------------------------
// Tracer (capture.h)
// ---------------------------------------------------------------------------

void Tracer::begin_trace(
    const std::vector<at::Tensor>& proxies,
    const std::vector<std::optional<at::Tensor>>& unpacked_proxies,
    py::object unpack_in_graph,
    const std::vector<std::optional<c10::SymInt>>& sym_sizes) {
  auto& args = g_.call_.tensor_args;
  if (args.inputs.empty() && !g_.lifted_args_.empty()) { // dropped (a hit), their args kept: Applier::drop_lifted
    TORCH_CHECK(proxies.size() == g_.lifted_args_.size(), "proxy count mismatch");
    for (size_t i = 0; i < proxies.size(); ++i) {
      g_.lifted_args_[i]->proxy_tensor = proxies[i];
    }
  } else {
    TORCH_CHECK(proxies.size() == args.inputs.size(), "proxy count mismatch");
    for (size_t i = 0; i < proxies.size(); ++i) {
      args.lookup(args.inputs[i]).proxy_tensor = proxies[i];
    }
  }
  unpacked_proxies_ = to_variables(unpacked_proxies);
  unpack_in_graph_ = std::move(unpack_in_graph);
  TORCH_CHECK(sym_sizes.size() == g_.call_.all_size_inputs.size(), "size count mismatch");
  mark_task_outputs();
  state_ = std::make_unique<cad::TraceState>(
      std::vector<std::optional<c10::SymInt>>(sym_sizes), 0);
}

// Root grads validated against the root edges, as Engine::execute does.
std::vector<std::optional<at::Tensor>> Tracer::root_values(
    const std::vector<std::optional<at::Tensor>>& grads) {
  variable_list values = to_variables(grads);
  if (g_.nodes_.empty()) {
    return grads;
  }
  with_symbolic_edges(g_.nodes_[0].fn, g_.root_edges_, 0, [&]() {
    torch::autograd::validate_outputs(g_.root_edges_, values, [](const std::string& m) { return m; });
  });
  return from_variables(values);
}

// Run f with the input metadata that `edges` point to swapped for the
// trace's symbolic sizes (collected from `start`), so that validating a
// grad of symbolic shape does not specialize it. Restored even on error.
template <typename F>
void Tracer::with_symbolic_edges(const NodePtr& fn, std::vector<Edge>& edges, size_t start, const F& f) {
  if (!state_) {
    f();
    return;
  }
  auto& node_call = g_.call_.node_calls.lookup(fn);
  cad::SwapSavedVariables saved(g_.call_, *state_, Py_None, node_call);
  state_->sym_sizes_index = start;
  for (auto& e : edges) {
    saved.before(e);
  }
  try {
    f();
  } catch (...) {
    for (auto& e : edges) {
      saved.after(e);
    }
    throw;
  }
  for (auto& e : edges) {
    saved.after(e);
  }
}

std::vector<std::optional<at::Tensor>> Tracer::apply_node(
    size_t idx,
    const std::vector<std::optional<at::Tensor>>& inputs) {
  auto& r = g_.nodes_.at(idx);
  TORCH_CHECK(state_, "begin_trace first");
  auto iface_owned = std::make_unique<TraceInterface>();
  TraceInterface* iface = iface_owned.get();
  iface->unpacked = &unpacked_proxies_;
  iface->unpack_in_graph = &unpack_in_graph_;
  cad::PyCompilerGuard guard(std::move(iface_owned));
  at::AutoGradMode grad_mode_guard(g_.grad_mode);
  state_->sym_sizes_index = r.size_start;
  auto& node_call = g_.call_.node_calls.lookup(r.fn);
  cad::SwapSavedVariables saved(g_.call_, *state_, Py_None, node_call);
  variable_list outs = r.fn->apply_with_saved(to_variables(inputs), saved);
  saved.debug_asserts();
  TORCH_CHECK(iface->error.empty(), r.fn->name(), ": ", iface->error);
  return validate(idx, from_variables(outs));
}

// The engine's validate_outputs for node idx (sum to shape, cast, device).
std::vector<std::optional<at::Tensor>> Tracer::validate(
    size_t idx,
    const std::vector<std::optional<at::Tensor>>& outputs) {
  auto& r = g_.nodes_.at(idx);
  auto& fn = r.fn;
  variable_list outs = to_variables(outputs);
  with_symbolic_edges(fn, fn->next_edges(), r.edge_size_start, [&]() {
    torch::autograd::validate_outputs(
        fn->next_edges(), outs, [&](const std::string& m) { return "Function " + fn->name() + " returned an " + m; });  // (the engine's wording)
  });
  return from_variables(outs);
}

void Tracer::end_trace() {
  unmark_task_outputs();
  state_.reset();
  unpacked_proxies_.clear();
  unpack_in_graph_ = py::none();
}

// NOTE [Which outputs a node computes]
// A formula computes only the outputs its graph task needs
// (task_should_compute_output: with `inputs=`, a convolution's weight grad
// is skipped when only the input's grad is asked for). That reads the
// exec_info of the current graph task. The trace runs inside a one-node
// eager task of ours (graph_task.py), whose exec_info is empty: every
// output would be computed, and then dropped. So while the trace runs, that
// exec_info marks the nodes this backward runs, as the engine's would (it
// is empty again before the engine looks at it after our hook). Without
// `inputs=` eager's is empty too, and so is ours.
void Tracer::mark_task_outputs() {
  if (!g_.filtered_ || marked_ != nullptr) {
    return;
  }
  auto* info = const_cast<std::unordered_map<Node*, torch::autograd::GraphTask::ExecInfo>*>(
      torch::autograd::get_current_graph_task_exec_info());
  if (info == nullptr || !info->empty()) {
    return;
  }
  for (auto& r : g_.nodes_) {
    if (r.execute || !r.captures.empty()) {
      (*info)[r.fn.get()].needed_ = true;
    }
  }
  marked_ = info;
}

void Tracer::unmark_task_outputs() {
  if (marked_ != nullptr) {
    marked_->clear();
    marked_ = nullptr;
  }
}

// ---------------------------------------------------------------------------
// PyNodeSavedSwap (capture.h)
// ---------------------------------------------------------------------------
PyNodeSavedSwap::PyNodeSavedSwap(py::object node, const std::vector<std::optional<at::Tensor>>& proxies)
    : node_(std::move(node)) {
  TORCH_CHECK(THPFunction_Check(node_.ptr()), "not a custom Function node");
  auto* f = reinterpret_cast<THPFunction*>(node_.ptr());
  // (released before a hit's graph ran, and a backward resumed after it: the proxies stand in)
  freed_ = f->has_freed_buffers && f->saved_variables.empty();
  TORCH_CHECK(freed_ || proxies.size() == f->saved_variables.size(), "saved tensor count mismatch");
  f->has_freed_buffers = 0;
  stashed_ = std::move(f->saved_variables);
  f->saved_variables.clear();
  bool prior = at::SavedTensorDefaultHooks::set_tracing(true);
  for (auto& p : proxies) {
    if (p.has_value()) {
      f->saved_variables.emplace_back(*p, false);
    } else {
      f->saved_variables.emplace_back(); // a None saved with save_for_backward
    }
  }
  at::SavedTensorDefaultHooks::set_tracing(prior);
}

void PyNodeSavedSwap::restore() {
  if (restored_) {
    return;
  }
  auto* f = reinterpret_cast<THPFunction*>(node_.ptr());
  f->saved_variables = std::move(stashed_);
  f->has_freed_buffers = freed_ ? 1 : 0;
  restored_ = true;
}

} // namespace compiled_autograd_native
