// GraphWalk, everything collected for one backward call, and its parts:
//   CollectedGraph     the walk's nodes, the key, the lifted tensors and sizes
//                      (filled by collect.cpp's Collector), and what Python
//                      asks of them;
//   SavedHookHandover  the saved-tensor hooks collected with it (collect.cpp);
//   Tracer             trace support: one node's formula on the tracer's
//                      values (trace.cpp);
//   Applier            what compiled code calls on real tensors: hooks, opaque
//                      nodes, AccumulateGrad, release (calls.cpp).
// GraphWalk's methods are the API Python calls (module.cpp binds them).
#pragma once

#include "values.h"

#include <torch/version.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace compiled_autograd_native {

namespace cad = torch::dynamo::autograd;
using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// NOTE [Torch versions] (native/__init__.py): torch 2.13 holds nodes as
// c10::intrusive_ptr<Node>, earlier releases as std::shared_ptr<Node>; a
// custom Function's THPFunction holds its node strongly (2.13) or weakly.
using NodePtr = decltype(Edge::function);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
inline NodePtr node_of(THPFunction* f) {
  return f->cdata;
}
inline bool boxed_grads_call(const THPFunction* f) {
  return f->boxed_grads_call;
}
inline const THPFunction* function_of(const torch::autograd::PyNode* n) {
  return reinterpret_cast<const THPFunction*>(n->pyobj());
}
#else
inline NodePtr node_of(THPFunction* f) {
  return f->cdata.lock();
}
inline bool boxed_grads_call(const THPFunction*) {
  return false; // (no boxed grads before 2.13)
}
inline const THPFunction* function_of(const torch::autograd::PyNode* n) {
  return reinterpret_cast<const THPFunction*>(n->obj);
}
#endif

inline variable_list to_variables(const std::vector<std::optional<at::Tensor>>& xs) {
  variable_list out;
  out.reserve(xs.size());
  for (auto& x : xs) {
    out.emplace_back(x.has_value() ? *x : at::Tensor());
  }
  return out;
}

inline std::vector<std::optional<at::Tensor>> from_variables(const variable_list& xs) {
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(xs.size());
  for (auto& x : xs) {
    out.emplace_back(x.defined() ? std::optional<at::Tensor>(x) : std::nullopt);
  }
  return out;
}

struct NodeRecord {
  NodePtr fn;
  Kind kind = GENERIC;
  bool execute = true;
  bool opaque = false;
  std::string opaque_reason;
  size_t size_start = 0; // first of its SymInts in the size inputs
  size_t edge_size_start = 0; // first of its edges' metadata sizes
  std::vector<std::pair<uint32_t, size_t>> captures; // (input_nr, result index)
  uint16_t n_tensor_pre = 0, n_retains = 0, n_pre = 0, n_post = 0;
  bool post_acc = false;
};

// NOTE [Flat node table]
// A cache hit walks every node of the graph, and most of that walk is
// bookkeeping per node: with std::unordered_map each reachable node cost one
// heap allocation to insert and one free to clear (a quarter of the walk on
// the 2000-node chain, measured with perf). This table is open addressing
// (linear probing on the node's address) over one slot array, with the
// entries in a vector in insertion order, both sized from the previous walk:
// two allocations per backward instead of one per node.
template <typename Info>
class NodeTable {
 public:
  void reset(size_t expected) {
    size_t cap = 16;
    while (cap < 2 * expected) {
      cap <<= 1;
    }
    if (slots_.size() != cap) {
      slots_.assign(cap, Slot{});
    } else {
      std::fill(slots_.begin(), slots_.end(), Slot{});
    }
    entries_.clear();
    entries_.reserve(expected);
  }

  // the entry for fn, and whether it was added now
  std::pair<Info*, bool> try_emplace(const NodePtr& fn) {
    if (2 * (entries_.size() + 1) > slots_.size()) {
      grow();
    }
    size_t i = probe(fn.get());
    if (slots_[i].node != nullptr) {
      return {&entries_[slots_[i].pos], false};
    }
    slots_[i] = Slot{fn.get(), static_cast<uint32_t>(entries_.size())};
    entries_.emplace_back(fn);
    return {&entries_.back(), true};
  }

  Info* find(const Node* fn) {
    if (slots_.empty()) {
      return nullptr;
    }
    const Slot& s = slots_[probe(fn)];
    return s.node == nullptr ? nullptr : &entries_[s.pos];
  }
  const Info* find(const Node* fn) const {
    return const_cast<NodeTable*>(this)->find(fn);
  }

  size_t size() const {
    return entries_.size();
  }
  std::vector<Info>& entries() {
    return entries_;
  }
  void clear() {
    entries_.clear();
    std::fill(slots_.begin(), slots_.end(), Slot{});
  }

 private:
  struct Slot {
    const Node* node = nullptr;
    uint32_t pos = 0;
  };

  size_t probe(const Node* fn) const {
    const size_t mask = slots_.size() - 1;
    size_t i = (reinterpret_cast<uintptr_t>(fn) >> 4) * 0x9E3779B97F4A7C15ULL >> 20 & mask;
    while (slots_[i].node != nullptr && slots_[i].node != fn) {
      i = (i + 1) & mask;
    }
    return i;
  }

  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(std::max<size_t>(16, old.size() * 2), Slot{});
    for (const Slot& s : old) {
      if (s.node != nullptr) {
        slots_[probe(s.node)] = s;
      }
    }
  }

  std::vector<Slot> slots_;
  std::vector<Info> entries_;
};

// ---------------------------------------------------------------------------
// CollectedGraph: what the walk and the key collected for one backward call
// (collect.cpp's Collector fills it), and the queries Python makes of it
// ---------------------------------------------------------------------------
struct CollectedGraph {
  explicit CollectedGraph(bool accumulate_grad) : call_(cad::SizeInput::STATIC), accumulate_grad_(accumulate_grad) {}

  // '' when the graph can be compiled, otherwise why not.
  std::string unsupported;
  // every node touching a tensor subclass's grad runs as is (NOTE [Values passed by reference])
  bool opaque_subclasses = false;

  // The grad mode the nodes' formulas are traced in and the results applied
  // in: the engine's, which is create_graph (NOTE [create_graph] in capture/create_graph.py).
  bool grad_mode = false;

  py::bytes key() const {
    return py::bytes(key_);
  }

  const std::vector<int64_t>& sizes() const {
    return sizes_;
  }

  // where each node's part of the key starts, then where the last ends (for
  // explaining a miss)
  const std::vector<size_t>& node_key_offsets() const {
    return node_key_offsets_;
  }

  size_t num_size_inputs() const {
    return call_.all_size_inputs.size();
  }

  std::vector<at::Tensor> lifted() const {
    return call_.tensor_args.inputs;
  }

  size_t num_nodes() const {
    return nodes_.size();
  }

  // the lifted indices of wrapper subclasses (NOTE [Tensor subclasses in the key], collect.cpp)
  const std::vector<size_t>& wrapped() const {
    return wrapped_;
  }

  size_t num_results() const {
    return num_results_;
  }

  // (collect.cpp)
  py::list nodes() const;
  std::string node_name(size_t idx) const;
  std::vector<size_t> pynode_indices() const;
  bool pynodes_have_saved_hooks(const std::vector<size_t>& idxs) const;
  std::vector<at::Tensor> accumulated_grads() const;
  int64_t edge_index(const Edge& e) const;
  py::object node_object(size_t idx) const;
  py::list roots();
  py::list input_metadata(size_t idx) const;
  py::list subclass_inputs(size_t idx) const;
  py::list pynode_output_info(size_t idx) const;
  py::tuple pynode_flags(size_t idx) const;

  // Drop the references to the graph (nodes, roots).
  void clear_graph();

  void fail(const std::string& why) {
    if (unsupported.empty()) {
      unsupported = why;
    }
  }

  cad::AutogradCompilerCall call_;
  bool accumulate_grad_;
  std::string key_;
  std::vector<int64_t> sizes_;
  std::vector<size_t> wrapped_;
  std::vector<size_t> node_key_offsets_;
  std::vector<NodeRecord> nodes_;
  struct NodeInfo {
    explicit NodeInfo(const NodePtr& f) : fn(f) {}
    NodePtr fn;
    int deps = 0;
    int64_t index = -1; // position in nodes_, -1: does not run in this backward
  };
  NodeTable<NodeInfo> info_; // NOTE [Flat node table]
  size_t num_results_ = 0;
  std::vector<Edge> root_edges_;
  std::vector<at::Tensor> root_grads_;
  std::vector<cad::TensorArg*> lifted_args_; // each lifted tensor's, once they were dropped (Applier::drop_lifted)
  bool filtered_ = false; // `inputs=` given: only the nodes leading to them run
};

// ---------------------------------------------------------------------------
// SavedHookHandover: the saved-tensor hooks collected with the graph, and the
// swap of a saved variable's hooks (NOTE [Handing unpacked tensors to their
// saved variables], collect.cpp)
// ---------------------------------------------------------------------------
using SavedHooksPtr = std::unique_ptr<torch::autograd::SavedVariableHooks>;
struct OurSavedHooks; // collect.cpp

class SavedHookHandover {
 public:
  explicit SavedHookHandover(CollectedGraph& g) : g_(g) {}
  py::list take_saved_hooks();
  void hand_over(size_t i, at::Tensor t, bool keep);
  void hand_over_saved(size_t idx, const std::vector<std::optional<at::Tensor>>& tensors, bool keep);
  void learn_unpacks(const std::vector<size_t>& idxs, py::object report);
  void restore_saved_hooks();
  // (not swapped_: restore_saved_hooks runs after an eager fallback)
  void clear() {
    hooked_svs_.clear();
  }

 private:
  void hand_over_to(torch::autograd::SavedVariable* sv, at::Tensor t, bool keep);
  SavedHooksPtr swap_hooks(torch::autograd::SavedVariable* sv, SavedHooksPtr hooks);

  CollectedGraph& g_;
  // NOTE [Handing unpacked tensors to their saved variables]
  struct Swapped {
    torch::autograd::SavedVariable* sv; // valid while `installed` is alive (sv owns it)
    OurSavedHooks* installed;
    std::shared_ptr<bool> alive; // installed's
    SavedHooksPtr original; // (learn_unpacks': held by the installed hooks)
  };
  std::vector<torch::autograd::SavedVariable*> hooked_svs_; // take_saved_hooks' order
  std::vector<Swapped> swapped_;
  std::vector<NodePtr> swap_keepalive_; // the nodes holding those saved variables
};

// ---------------------------------------------------------------------------
// Tracer: trace services (called with the Python tracing modes active)
// (trace.cpp)
// ---------------------------------------------------------------------------
class Tracer {
 public:
  explicit Tracer(CollectedGraph& g) : g_(g) {}
  void begin_trace(
      const std::vector<at::Tensor>& proxies,
      const std::vector<std::optional<at::Tensor>>& unpacked_proxies,
      py::object unpack_in_graph,
      const std::vector<std::optional<c10::SymInt>>& sym_sizes);
  std::vector<std::optional<at::Tensor>> root_values(const std::vector<std::optional<at::Tensor>>& grads);
  std::vector<std::optional<at::Tensor>> apply_node(size_t idx, const std::vector<std::optional<at::Tensor>>& inputs);
  std::vector<std::optional<at::Tensor>> validate(size_t idx, const std::vector<std::optional<at::Tensor>>& outputs);
  void end_trace();
  void clear() {
    unpacked_proxies_.clear();
    unpack_in_graph_ = py::none();
  }

 private:
  template <typename F>
  void with_symbolic_edges(const NodePtr& fn, std::vector<Edge>& edges, size_t start, const F& f);
  void mark_task_outputs();
  void unmark_task_outputs();

  CollectedGraph& g_;
  std::unique_ptr<cad::TraceState> state_;
  std::vector<at::Tensor> unpacked_proxies_;
  py::object unpack_in_graph_ = py::none();
  std::unordered_map<Node*, torch::autograd::GraphTask::ExecInfo>* marked_ = nullptr;
};

// NOTE [Stealing a fresh grad] (nodes/accumulate.py): the storages of a graph's tensor inputs, by
// identity. Weak references pin their StorageImpls for the graph's run: a boxed graph frees
// inputs as it goes, and a new grad may get a freed input's memory (by data address it read
// as that input, and was copied: a flaky extra copy) but never its StorageImpl while a weak
// reference holds it. A sparse COO tensor's storages are its indices' and values'; another
// tensor without storage counts as one of them (never stolen).
// (calls.cpp)
struct StorageSet {
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> refs;
  std::unordered_set<const c10::StorageImpl*> ids;

  explicit StorageSet(const py::list& tensors);
  void add(const at::Tensor& t);
  bool contains(const at::Tensor& t) const;
};

// ---------------------------------------------------------------------------
// Applier: replay services (real tensors, called from the compiled graph)
// (calls.cpp)
// ---------------------------------------------------------------------------
class Applier {
 public:
  Applier(CollectedGraph& g, Tracer& tracer) : g_(g), tracer_(tracer) {}
  std::vector<std::optional<at::Tensor>> call_tensor_pre_hooks(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& inputs);
  std::vector<std::optional<at::Tensor>> call_pre_hooks(size_t idx, const std::vector<std::optional<at::Tensor>>& inputs);
  std::vector<std::optional<at::Tensor>> call_post_hooks(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& outputs,
      const std::vector<std::optional<at::Tensor>>& inputs);
  std::vector<std::optional<at::Tensor>> call_node(size_t idx, const std::vector<std::optional<at::Tensor>>& inputs);
  void accumulate_graph_grad(size_t idx, const at::Tensor& grad, bool hooked, const StorageSet* inputs);
  void hooked_accumulate_tensor(size_t idx, at::Tensor grad);
  std::vector<std::optional<at::Tensor>> apply_results(
      py::list results,
      const std::vector<std::pair<size_t, size_t>>& acc,
      const std::vector<int64_t>& captured);
  void release();
  void release_nodes(const std::vector<int64_t>& idxs);
  void drop_lifted(bool keep_args = false);
  bool hooks_added(size_t idx, int stage) const;
  bool will_execute(py::handle obj) const;

 private:
  CollectedGraph& g_;
  Tracer& tracer_; // (call_node validates as a traced node does)
};

// ---------------------------------------------------------------------------
// GraphWalk: everything collected for one backward call. Python's API:
// CollectedGraph's queries (its base) and the parts' services below.
// ---------------------------------------------------------------------------
class GraphWalk : public CollectedGraph {
 public:
  // roots and inputs: tensors or GradientEdges (node, output_nr) (collect.cpp)
  GraphWalk(
      const std::vector<py::handle>& roots,
      const std::vector<std::optional<at::Tensor>>& root_grads,
      const std::vector<py::handle>& inputs,
      bool accumulate_grad,
      bool opaque_subclasses);
  GraphWalk(const GraphWalk&) = delete; // (the parts refer to this graph)
  GraphWalk& operator=(const GraphWalk&) = delete;

  // ---- saved-tensor hooks (collect.cpp) ------------------------------------
  py::list take_saved_hooks() {
    return saved_hooks_.take_saved_hooks();
  }
  void hand_over(size_t i, at::Tensor t, bool keep) {
    saved_hooks_.hand_over(i, std::move(t), keep);
  }
  void hand_over_saved(size_t idx, const std::vector<std::optional<at::Tensor>>& tensors, bool keep) {
    saved_hooks_.hand_over_saved(idx, tensors, keep);
  }
  void learn_unpacks(const std::vector<size_t>& idxs, py::object report) {
    saved_hooks_.learn_unpacks(idxs, std::move(report));
  }
  void restore_saved_hooks() {
    saved_hooks_.restore_saved_hooks();
  }

  // ---- trace services (trace.cpp) ------------------------------------------
  void begin_trace(
      const std::vector<at::Tensor>& proxies,
      const std::vector<std::optional<at::Tensor>>& unpacked_proxies,
      py::object unpack_in_graph,
      const std::vector<std::optional<c10::SymInt>>& sym_sizes) {
    tracer_.begin_trace(proxies, unpacked_proxies, std::move(unpack_in_graph), sym_sizes);
  }
  std::vector<std::optional<at::Tensor>> root_values(const std::vector<std::optional<at::Tensor>>& grads) {
    return tracer_.root_values(grads);
  }
  std::vector<std::optional<at::Tensor>> apply_node(size_t idx, const std::vector<std::optional<at::Tensor>>& inputs) {
    return tracer_.apply_node(idx, inputs);
  }
  std::vector<std::optional<at::Tensor>> validate(size_t idx, const std::vector<std::optional<at::Tensor>>& outputs) {
    return tracer_.validate(idx, outputs);
  }
  void end_trace() {
    tracer_.end_trace();
  }

  // ---- replay services (calls.cpp) -----------------------------------------
  std::vector<std::optional<at::Tensor>> call_tensor_pre_hooks(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& inputs) {
    return applier_.call_tensor_pre_hooks(idx, inputs);
  }
  std::vector<std::optional<at::Tensor>> call_pre_hooks(size_t idx, const std::vector<std::optional<at::Tensor>>& inputs) {
    return applier_.call_pre_hooks(idx, inputs);
  }
  std::vector<std::optional<at::Tensor>> call_post_hooks(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& outputs,
      const std::vector<std::optional<at::Tensor>>& inputs) {
    return applier_.call_post_hooks(idx, outputs, inputs);
  }
  std::vector<std::optional<at::Tensor>> call_node(size_t idx, const std::vector<std::optional<at::Tensor>>& inputs) {
    return applier_.call_node(idx, inputs);
  }
  void accumulate_graph_grad(size_t idx, const at::Tensor& grad, bool hooked, const StorageSet* inputs) {
    applier_.accumulate_graph_grad(idx, grad, hooked, inputs);
  }
  std::vector<std::optional<at::Tensor>> apply_results(
      py::list results,
      const std::vector<std::pair<size_t, size_t>>& acc,
      const std::vector<int64_t>& captured) {
    return applier_.apply_results(std::move(results), acc, captured);
  }
  void release() {
    applier_.release();
  }
  void release_nodes(const std::vector<int64_t>& idxs) {
    applier_.release_nodes(idxs);
  }
  void drop_lifted(bool keep_args) {
    applier_.drop_lifted(keep_args);
  }
  bool hooks_added(size_t idx, int stage) const {
    return applier_.hooks_added(idx, stage);
  }
  bool will_execute(py::handle obj) const {
    return applier_.will_execute(obj);
  }

  // Drop every reference to the graph (nodes, lifted tensors): a backward that eager's
  // engine runs after the walk frees each saved tensor when its node has run only if
  // nothing here still holds it (NOTE [Steps while a graph compiles]).
  void clear() {
    clear_graph();
    applier_.drop_lifted();
    lifted_args_.clear();
    tracer_.clear();
    saved_hooks_.clear();
  }

 private:
  SavedHookHandover saved_hooks_{*this};
  Tracer tracer_{*this};
  Applier applier_{*this, tracer_};
};

// Swap a custom Function's saved tensors for proxies while Python traces its
// backward (its ctx.saved_tensors then returns the proxies), and restore them.
// (trace.cpp)
class PyNodeSavedSwap {
 public:
  PyNodeSavedSwap(py::object node, const std::vector<std::optional<at::Tensor>>& proxies);
  void restore();
  ~PyNodeSavedSwap() {
    restore();
  }

 private:
  py::object node_;
  std::vector<torch::autograd::SavedVariable> stashed_;
  bool restored_ = false;
  bool freed_ = false; // the node's saved tensors were released (a backward resumed on a hit)
};

// ---- module functions --------------------------------------------------------
// collect.cpp
const char* tensor_key_into(const at::Tensor& t, std::string& key, std::vector<int64_t>& sizes);
py::tuple tensor_key(const at::Tensor& t);
// calls.cpp
void install_calls(py::dict fns);
void push_replay(py::tuple frame, py::list last);
void pop_replay();
bool pyobj_held_by_tensor();
py::object direct(int64_t slot, py::list args, py::list meta, int64_t flags);

} // namespace compiled_autograd_native
