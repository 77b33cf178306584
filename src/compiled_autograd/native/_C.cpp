// compiled_autograd native helper.
//
// What Python cannot do with torch 2.13's autograd graph, this file does:
//   * walk the graph in the exact order the eager engine would run it,
//   * ask every node for ALL of its state (including the fields Python cannot
//     see: TypeAndSize, ScalarType, TensorGeometry, CopySlices' view geometry,
//     Cat's per-input sizes, ...) through the node's own `compiled_args`
//     visitor, and turn that into one cache key,
//   * trace every node's real backward formula by calling `apply_with_saved`
//     with its saved tensors swapped for fake/proxy tensors,
//   * apply the outputs with eager semantics (AccumulateGrad itself), and free
//     the graph like the engine does.
//
// NOTE [One key per graph]
// Every node contributes [type id][its compiled_args bytes][edges + input
// metadata]. Lifted tensors contribute their id inside that stream plus, at the
// end, their full geometry (sizes, strides, offset, dtype, flags). Sizes that
// nodes save (SymInts) are appended as static values. A traced graph can only
// depend on what is in this stream, because tracing reads nothing else: the
// node formula sees its saved values (all collected), its grads (shapes fixed
// by the edge metadata and the lifted tensors) and nothing more.

#include <torch/extension.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <chrono>
#include <queue>
#include <typeindex>
#include <unordered_map>
#include <unordered_set>

namespace py = pybind11;
namespace cad = torch::dynamo::autograd;
using torch::autograd::AccumulateGrad;
using torch::autograd::CopySlices;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace compiled_autograd_native {

// ---------------------------------------------------------------------------
// Node functionals. Each generated node binds its pure backward function the
// first time its `apply_with_saved` runs in this process; we keep them here
// and call them directly while tracing, so the aten ops they run are recorded
// by the Python tracing modes that are active on this thread.
// ---------------------------------------------------------------------------
static std::unordered_map<std::string, cad::functional_apply_t>& functionals() {
  static std::unordered_map<std::string, cad::functional_apply_t> table;
  return table;
}

static std::vector<at::Tensor> copy_slices_prologue(
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

// NOTE [Deferred trace errors]
// A node's apply_with_saved swaps its saved values for proxies, calls us, and
// swaps them back. If we threw from inside, the swap-back would be skipped and
// the user's graph would keep our proxies. So the interface never throws: it
// records the first error, returns undefined grads for the rest of the node,
// and GraphCapture::trace raises it once the node has restored its state.
struct TraceInterface : public cad::PyCompilerInterface {
  mutable std::string error;

  std::string bind_function(
      PyObject* /*py_compiler*/,
      const std::string& fn_name,
      cad::functional_apply_t fn,
      std::vector<at::TypePtr> /*schema*/,
      bool /*is_custom_function*/,
      bool /*is_traceable*/) const override {
    functionals()[fn_name] = std::move(fn);
    return fn_name;
  }

  template <typename F>
  variable_list guarded(size_t n_out, const F& f) const {
    if (!error.empty()) {
      return variable_list(n_out);
    }
    try {
      return f();
    } catch (const std::exception& e) {
      error = e.what();
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
      TORCH_CHECK(
          it != functionals().end(),
          "no functional bound for ", fn_name,
          " (torch's built-in compiled autograd bound it first in this process)");
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
};

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------
static uint16_t type_id_of(const Node& node) {
  static std::unordered_map<std::type_index, uint16_t> ids;
  auto [it, inserted] = ids.try_emplace(std::type_index(typeid(node)), ids.size());
  return it->second;
}

template <typename T>
static void append_pod(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

static bool is_accumulate_grad(const Node* node) {
  return dynamic_cast<const AccumulateGrad*>(node) != nullptr;
}

static std::string demangled_kind(const Node& node) {
  // the mangled type name is enough to recognise the handwritten node kinds
  return typeid(node).name();
}

static bool has_hooks(Node* node) {
  return !node->tensor_pre_hooks().empty() || !node->pre_hooks().empty() ||
      !node->post_hooks().empty() || !node->retains_grad_hooks().empty();
}

// Priority order of the engine's CPU ready queue: larger sequence_nr first
// (AccumulateGrad has UINT64_MAX). Same comparator and same push order as the
// engine, so std::priority_queue pops in the same order.
struct ReadyEntry {
  Node* fn;
  uint64_t seq;
};
struct CompareReady {
  bool operator()(const ReadyEntry& a, const ReadyEntry& b) const {
    return a.seq < b.seq;
  }
};

struct Capture {
  size_t node_index; // index into order
  uint32_t input_nr;
  size_t output_idx;
};

// ---------------------------------------------------------------------------
// GraphCapture: everything collected for one backward call
// ---------------------------------------------------------------------------
class GraphCapture {
 public:
  GraphCapture(
      const std::vector<at::Tensor>& roots,
      const std::vector<std::optional<at::Tensor>>& root_grads,
      const std::vector<at::Tensor>& inputs,
      bool accumulate_grad)
      : call_(cad::SizeInput::STATIC), accumulate_grad_(accumulate_grad) {
    collect(roots, root_grads, inputs);
  }

  // '' when the graph can be compiled, otherwise why not.
  std::string unsupported;

  py::bytes key() const {
    return py::bytes(key_);
  }

  std::vector<at::Tensor> lifted() const {
    return call_.tensor_args.inputs;
  }

  std::vector<std::string> node_names() const {
    std::vector<std::string> names;
    names.reserve(order_.size());
    for (auto& n : order_) {
      names.push_back(n->name());
    }
    return names;
  }

  size_t num_nodes() const {
    return order_.size();
  }

  size_t num_accumulate() const {
    return accumulate_nodes_.size();
  }

  size_t num_captures() const {
    return num_captures_;
  }

  // Trace the whole backward with `proxies` standing in for the lifted tensors.
  // Must be called with the Python tracing modes active. Returns the graph
  // outputs: one grad per AccumulateGrad node (in execution order), then one
  // per captured input.
  variable_list trace(const std::vector<at::Tensor>& proxies) {
    auto& args = call_.tensor_args;
    TORCH_CHECK(proxies.size() == args.inputs.size(), "proxy count mismatch");
    for (size_t i = 0; i < proxies.size(); ++i) {
      args.lookup(args.inputs[i]).proxy_tensor = proxies[i];
    }
    std::vector<std::optional<c10::SymInt>> sym_sizes(call_.all_size_inputs.size());
    cad::TraceState state(std::move(sym_sizes), 0);

    auto iface_owned = std::make_unique<TraceInterface>();
    TraceInterface* iface = iface_owned.get();
    cad::PyCompilerGuard guard(std::move(iface_owned));
    at::NoGradGuard no_grad;

    std::unordered_map<Node*, variable_list> buffers;
    auto buffer_of = [&](Node* fn) -> variable_list& {
      auto it = buffers.find(fn);
      if (it == buffers.end()) {
        it = buffers.emplace(fn, variable_list(fn->num_inputs())).first;
      }
      return it->second;
    };
    auto add_to = [&](const Edge& edge, at::Tensor grad) {
      if (!edge.is_valid() || !grad.defined()) {
        return;
      }
      if (!in_graph_.count(edge.function.get())) {
        return;
      }
      auto& slot = buffer_of(edge.function.get())[edge.input_nr];
      slot = slot.defined() ? slot + grad : std::move(grad);
    };

    // root grads, validated against the root edges as Engine::execute does
    variable_list root_values;
    for (auto& g : root_grads_) {
      root_values.push_back(g.defined() ? args.lookup(g).proxy_tensor : at::Tensor());
    }
    torch::autograd::validate_outputs(
        root_edges_, root_values, [](const std::string& m) { return m; });
    for (size_t i = 0; i < root_edges_.size(); ++i) {
      add_to(root_edges_[i], root_values[i]);
    }

    variable_list outputs(accumulate_nodes_.size() + num_captures_);
    size_t acc_i = 0;
    for (size_t idx = 0; idx < order_.size(); ++idx) {
      Node* fn = order_[idx].get();
      variable_list inputs = std::move(buffer_of(fn));
      buffers.erase(fn);
      auto cap = captures_.find(idx);
      if (cap != captures_.end()) {
        for (auto& c : cap->second) {
          outputs[accumulate_nodes_.size() + c.output_idx] = inputs[c.input_nr];
        }
      }
      if (!execute_[idx]) {
        continue;
      }
      if (is_accumulate_grad(fn)) {
        outputs[acc_i++] = inputs[0];
        continue;
      }
      auto& node_call = call_.node_calls.lookup(order_[idx]);
      cad::SwapSavedVariables saved(call_, state, Py_None, node_call);
      variable_list outs = fn->apply_with_saved(inputs, saved);
      saved.debug_asserts();
      TORCH_CHECK(iface->error.empty(), fn->name(), ": ", iface->error);
      torch::autograd::validate_outputs(
          fn->next_edges(), outs, [&](const std::string& m) {
            return fn->name() + ": " + m;
          });
      const auto& edges = fn->next_edges();
      for (size_t i = 0; i < outs.size() && i < edges.size(); ++i) {
        add_to(edges[i], std::move(outs[i]));
      }
    }
    return outputs;
  }

  // Run AccumulateGrad for each accumulated output, exactly as the engine
  // would (the node itself does the layout contract, stealing, in-place
  // accumulation and post-accumulate-grad hooks). Returns the captured grads.
  std::vector<std::optional<at::Tensor>> apply_outputs(py::list outputs) {
    TORCH_CHECK(
        outputs.size() == accumulate_nodes_.size() + num_captures_,
        "compiled_autograd: graph returned ", outputs.size(), " outputs, expected ",
        accumulate_nodes_.size() + num_captures_);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < accumulate_nodes_.size(); ++i) {
      py::object item = outputs[i];
      if (item.is_none()) {
        continue;
      }
      at::Tensor grad = THPVariable_Unpack(item.ptr());
      // drop the Python references so that the node may steal the buffer
      outputs[i] = py::none();
      item = py::object();
      variable_list in;
      in.emplace_back(std::move(grad));
      (*accumulate_nodes_[i])(std::move(in));
    }
    std::vector<std::optional<at::Tensor>> captured;
    for (size_t i = 0; i < num_captures_; ++i) {
      py::object item = outputs[accumulate_nodes_.size() + i];
      if (item.is_none()) {
        captured.emplace_back(std::nullopt);
      } else {
        captured.emplace_back(THPVariable_Unpack(item.ptr()));
      }
    }
    return captured;
  }

  // Free saved variables of every executed node, as the engine does when
  // retain_graph is False.
  void release() {
    for (size_t idx = 0; idx < order_.size(); ++idx) {
      if (execute_[idx]) {
        order_[idx]->release_variables();
      }
    }
  }

  // Drop every reference to the graph (nodes, lifted tensors).
  void clear() {
    order_.clear();
    accumulate_nodes_.clear();
    root_edges_.clear();
    root_grads_.clear();
    in_graph_.clear();
  }

 private:
  void fail(const std::string& why) {
    if (unsupported.empty()) {
      unsupported = why;
    }
  }

  void collect(
      const std::vector<at::Tensor>& roots,
      const std::vector<std::optional<at::Tensor>>& root_grads,
      const std::vector<at::Tensor>& inputs) {
    // -- roots
    for (size_t i = 0; i < roots.size(); ++i) {
      Edge edge = torch::autograd::impl::gradient_edge(roots[i]);
      TORCH_CHECK(edge.is_valid(), "root ", i, " has no grad_fn"); // checked in Python
      root_edges_.push_back(edge);
      const auto& g = root_grads[i];
      root_grads_.push_back(g.has_value() ? *g : at::Tensor());
    }
    // -- output edges (inputs=)
    std::vector<Edge> output_edges;
    for (auto& t : inputs) {
      Edge e = torch::autograd::impl::gradient_edge(t);
      if (!e.is_valid()) {
        e = Edge(torch::autograd::impl::try_get_grad_accumulator(t), 0);
      }
      output_edges.push_back(e);
    }

    // -- reachable graph and dependency counts
    std::unordered_map<Node*, c10::intrusive_ptr<Node>> nodes;
    std::unordered_map<Node*, int> deps;
    std::vector<Node*> stack;
    for (auto& e : root_edges_) {
      if (nodes.emplace(e.function.get(), e.function).second) {
        stack.push_back(e.function.get());
      }
    }
    while (!stack.empty()) {
      Node* fn = stack.back();
      stack.pop_back();
      for (const auto& next : fn->next_edges()) {
        if (!next.is_valid()) {
          continue;
        }
        deps[next.function.get()] += 1;
        if (nodes.emplace(next.function.get(), next.function).second) {
          stack.push_back(next.function.get());
        }
      }
    }

    // -- which nodes run (all, or the ones on a path to an output edge)
    std::unordered_set<Node*> needed;
    std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>> capture_spec;
    const bool filtered = !output_edges.empty();
    if (filtered) {
      std::unordered_set<Node*> targets;
      for (size_t i = 0; i < output_edges.size(); ++i) {
        auto& e = output_edges[i];
        if (!e.is_valid() || !nodes.count(e.function.get())) {
          continue; // unreachable: grad stays None
        }
        targets.insert(e.function.get());
        if (accumulate_grad_) {
          needed.insert(e.function.get());
        } else {
          capture_spec[e.function.get()].emplace_back(e.input_nr, i);
        }
      }
      // a node runs if some path from it reaches a target
      std::unordered_map<Node*, int> memo; // 0 unknown, 1 yes, 2 no
      std::function<bool(Node*)> leads = [&](Node* fn) -> bool {
        auto it = memo.find(fn);
        if (it != memo.end()) {
          return it->second == 1;
        }
        memo[fn] = 2; // graph is a DAG; provisional
        bool r = false;
        for (const auto& next : fn->next_edges()) {
          if (next.is_valid() &&
              (targets.count(next.function.get()) || leads(next.function.get()))) {
            r = true;
          }
        }
        memo[fn] = r ? 1 : 2;
        return r;
      };
      for (auto& [fn, _] : nodes) {
        if (leads(fn)) {
          needed.insert(fn);
        }
      }
    }
    num_captures_ = output_edges.empty() || accumulate_grad_ ? 0 : output_edges.size();
    auto should_run = [&](Node* fn) {
      return !filtered || needed.count(fn) || capture_spec.count(fn);
    };

    // -- engine order
    std::priority_queue<ReadyEntry, std::vector<ReadyEntry>, CompareReady> ready;
    std::unordered_map<Node*, int> remaining = deps;
    auto push_if_ready = [&](Node* fn) {
      if (remaining[fn] == 0 && should_run(fn)) {
        ready.push({fn, fn->sequence_nr()});
      }
    };
    {
      // roots: the engine starts at a single root node (or GraphRoot, whose
      // outputs are the root edges, visited in order)
      std::unordered_set<Node*> seen;
      for (auto& e : root_edges_) {
        Node* fn = e.function.get();
        if (seen.insert(fn).second) {
          push_if_ready(fn);
        }
      }
    }
    while (!ready.empty()) {
      Node* fn = ready.top().fn;
      ready.pop();
      order_.push_back(nodes.at(fn));
      in_graph_.insert(fn);
      bool runs = !filtered || needed.count(fn);
      execute_.push_back(runs);
      auto cs = capture_spec.find(fn);
      if (cs != capture_spec.end()) {
        for (auto& [input_nr, out_idx] : cs->second) {
          captures_[order_.size() - 1].push_back({order_.size() - 1, input_nr, out_idx});
        }
      }
      if (!runs) {
        continue;
      }
      for (const auto& next : fn->next_edges()) {
        if (!next.is_valid()) {
          continue;
        }
        Node* n = next.function.get();
        remaining[n] -= 1;
        push_if_ready(n);
      }
    }

    // -- key: roots
    key_.reserve(64 * order_.size());
    append_pod(key_, static_cast<uint32_t>(root_edges_.size()));
    append_pod(key_, static_cast<uint8_t>(accumulate_grad_));
    append_pod(key_, static_cast<uint32_t>(output_edges.size()));
    for (auto& g : root_grads_) {
      uint32_t id = g.defined() ? call_.tensor_args.add(g).id : 0;
      append_pod(key_, id);
    }
    // node ids are assigned in execution order
    for (auto& fn : order_) {
      call_.node_calls.lookup(fn);
    }
    for (auto& e : root_edges_) {
      append_pod(key_, call_.node_calls.lookup(e.function).id);
      append_pod(key_, e.input_nr);
    }
    for (auto& e : output_edges) {
      bool in = e.is_valid() && in_graph_.count(e.function.get());
      append_pod(key_, in ? call_.node_calls.lookup(e.function).id : UINT32_MAX);
      append_pod(key_, e.input_nr);
    }

    // -- key: nodes
    for (size_t idx = 0; idx < order_.size(); ++idx) {
      const auto& fn = order_[idx];
      if (has_hooks(fn.get())) {
        fail("hooks on " + fn->name());
      }
      append_pod(key_, type_id_of(*fn));
      append_pod(key_, static_cast<uint8_t>(execute_[idx]));
      if (!execute_[idx]) {
        continue;
      }
      if (auto* acc = dynamic_cast<AccumulateGrad*>(fn.get())) {
        if (acc->tensor_post_acc_grad_hooks() != nullptr) {
          fail("post-accumulate-grad hook on a parameter");
        }
        accumulate_nodes_.push_back(fn);
        continue;
      }
      std::string kind = demangled_kind(*fn);
      if (kind.find("PyNode") != std::string::npos) {
        fail("custom autograd.Function " + fn->name());
        continue;
      }
      if (kind.find("CppNode") != std::string::npos) {
        fail("C++ custom autograd function " + fn->name());
        continue;
      }
      if (!unsupported.empty()) {
        continue; // keep walking only to report the first reason cheaply
      }
      auto& node_call = call_.node_calls.lookup(fn);
      cad::CompiledNodeArgs node_args(call_, node_call);
      try {
        fn->compiled_args(node_args);
        node_args.collect(fn->next_edges());
      } catch (const c10::Error& e) {
        std::string msg = e.what_without_backtrace();
        // the version-counter and freed-graph errors are the user's: raise them
        if (msg.find("modified by an inplace operation") != std::string::npos ||
            msg.find("backward through the graph a second time") != std::string::npos) {
          throw;
        }
        fail(fn->name() + ": " + msg.substr(0, msg.find('\n')));
        continue;
      }
      auto k = node_args.key();
      append_pod(key_, static_cast<uint32_t>(k.key_size));
      key_.append(reinterpret_cast<const char*>(k.key), k.key_size);
    }
    if (!unsupported.empty()) {
      return;
    }
    if (!call_.sv_to_hooks.empty()) {
      fail("saved tensors with saved_tensors_hooks");
    }
    if (!call_.lifted_ivalue_args.args.empty() || !call_.hooks.empty() ||
        !call_.cpp_tensor_pre_hooks.empty() || !call_.packed_inputs.empty()) {
      fail("hooks or lifted scalars collected");
    }

    // -- key: static sizes
    append_pod(key_, static_cast<uint32_t>(call_.all_size_inputs.size()));
    for (auto& s : call_.all_size_inputs) {
      append_pod(key_, s.value);
    }
    // -- key: lifted tensors' geometry
    append_pod(key_, static_cast<uint32_t>(call_.tensor_args.inputs.size()));
    for (auto& t : call_.tensor_args.inputs) {
      if (t.layout() != at::kStrided) {
        fail("non-strided tensor");
        return;
      }
      if (t.unsafeGetTensorImpl()->is_python_dispatch() ||
          t.key_set().has(c10::DispatchKey::Python) ||
          t.is_nested()) {
        fail("tensor subclass");
        return;
      }
      append_pod(key_, static_cast<int8_t>(t.scalar_type()));
      append_pod(key_, static_cast<int8_t>(t.device().type()));
      append_pod(key_, static_cast<int8_t>(t.device().index()));
      append_pod(key_, static_cast<uint8_t>(
          (t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0) |
          (t.unsafeGetTensorImpl()->is_wrapped_number() ? 4 : 0) |
          (t.requires_grad() ? 8 : 0)));
      append_pod(key_, static_cast<uint8_t>(t.dim()));
      for (auto s : t.sizes()) {
        append_pod(key_, s);
      }
      for (auto s : t.strides()) {
        append_pod(key_, s);
      }
      append_pod(key_, t.storage_offset());
    }
  }

  cad::AutogradCompilerCall call_;
  bool accumulate_grad_;
  std::string key_;
  std::vector<c10::intrusive_ptr<Node>> order_;
  std::vector<bool> execute_;
  std::unordered_set<Node*> in_graph_;
  std::unordered_map<size_t, std::vector<Capture>> captures_;
  size_t num_captures_ = 0;
  std::vector<c10::intrusive_ptr<Node>> accumulate_nodes_;
  std::vector<Edge> root_edges_;
  std::vector<at::Tensor> root_grads_;
};

} // namespace compiled_autograd_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using compiled_autograd_native::GraphCapture;
  py::class_<GraphCapture>(m, "GraphCapture")
      .def(
          py::init<
              const std::vector<at::Tensor>&,
              const std::vector<std::optional<at::Tensor>>&,
              const std::vector<at::Tensor>&,
              bool>())
      .def_readonly("unsupported", &GraphCapture::unsupported)
      .def("key", &GraphCapture::key)
      .def("lifted", &GraphCapture::lifted)
      .def("node_names", &GraphCapture::node_names)
      .def("num_nodes", &GraphCapture::num_nodes)
      .def("num_accumulate", &GraphCapture::num_accumulate)
      .def("num_captures", &GraphCapture::num_captures)
      .def("trace", &GraphCapture::trace)
      .def("apply_outputs", &GraphCapture::apply_outputs)
      .def("release", &GraphCapture::release)
      .def("clear", &GraphCapture::clear);
}
