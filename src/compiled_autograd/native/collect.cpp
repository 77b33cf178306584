// collect: walk the graph in the exact order the eager engine runs it, and ask
// every node for ALL of its state through the node's own `compiled_args`
// visitor -- including the fields Python cannot see (TypeAndSize, ScalarType,
// TensorGeometry, CopySlices' view geometry, Cat's per-input sizes, Foreach
// nodes) -- into one key; lift the tensors and sizes; hold the saved-tensor
// hooks collected with them. What GraphWalk's constructor runs, and the
// queries Python makes of what it collected.
//
// NOTE [One key per graph]
// Every node contributes [type id][kind][hook counts][its compiled_args
// bytes][edges + the input metadata of the nodes they feed]. Lifted tensors
// contribute their id inside that stream and, at the end, their full geometry
// (sizes, strides, offset, dtype, flags). Sizes that nodes save (SymInts) are
// appended as static values. A traced node can only depend on what is in this
// stream: its formula reads its saved values (all collected), its grads (whose
// metadata is fixed by edges and lifted tensors), and nothing else. Nodes that
// run opaquely never bake anything: the graph depends only on their output
// metadata, which is the edge metadata already in the key.

#include "capture.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <functional>
#include <queue>
#include <typeindex>

namespace compiled_autograd_native {

// ---------------------------------------------------------------------------
// A node's C++ type: its kind (values.h Kind) and its id in the key, decided
// once per type
// ---------------------------------------------------------------------------
struct TypeInfo {
  uint64_t id; // FNV-1a of the mangled type name: the same in every process
  Kind kind;
};

static const TypeInfo& type_info_of(const Node& node) {
  static std::unordered_map<std::type_index, TypeInfo> infos;
  auto it = infos.find(std::type_index(typeid(node)));
  if (it != infos.end()) {
    return it->second;
  }
  std::string mangled = typeid(node).name();
  Kind kind = GENERIC;
  if (dynamic_cast<const AccumulateGrad*>(&node)) {
    kind = ACCUMULATE;
  } else if (mangled.find("PyNode") != std::string::npos) {
    kind = PYNODE;
  } else if (mangled.find("CppNode") != std::string::npos) {
    kind = OPAQUE; // C++ custom Functions: state not reachable, run as is
  }
  uint64_t id = 1469598103934665603ULL;
  for (char c : mangled) {
    id = (id ^ static_cast<uint8_t>(c)) * 1099511628211ULL;
  }
  TypeInfo info{id, kind};
  return infos.emplace(std::type_index(typeid(node)), info).first->second;
}

template <typename T>
static void append_pod(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Priority of the engine's CPU ready queue: larger sequence_nr first
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

// NOTE [Handing unpacked tensors to their saved variables]
// A tensor whose unpack hook collect() ran when the backward started (one whose
// result cannot be predicted) must not be unpacked again by anyone else in this
// backward: eager's fallback, an opaque node's own apply. A hook may pop what
// it stashed, and eager runs each once per backward. So the saved variable's
// hooks are swapped for ones that return that tensor (SavedVariable::unpack
// then does the rest as after a user's hook: grad_fn, version counter). With
// retain_graph the user's hooks are put back when the backward ends (the next
// backward runs them again, as eager's does); without, the graph is freed by
// this backward and they are dropped at once, with their packed value, as
// eager's release of that node would drop it.
//
// The same swap serves the backward that learns what a user's unpack hooks
// return (NOTE [Unpack metadata learned from the last backward], nodes/saved_tensors.py):
// it runs in eager, each hook at its node, wrapped so that what it returns is
// reported; the wrapper is taken off when the backward ends.
//
// hooks_ is private: its member pointer is named through an explicit
// instantiation, which C++ exempts from access checks.
struct SavedVariableHooksMember {
  using type = SavedHooksPtr torch::autograd::SavedVariable::*;
  friend type saved_hooks_member(SavedVariableHooksMember);
};
template <typename Tag, typename Tag::type Member>
struct NameMember {
  friend typename Tag::type saved_hooks_member(Tag) {
    return Member;
  }
};
template struct NameMember<SavedVariableHooksMember, &torch::autograd::SavedVariable::hooks_>;

// The hooks we install; `alive` tells restore_saved_hooks whether they (and so the
// saved variable that owns them) still exist: a node's release may destroy its
// saved variables themselves (Foreach and index nodes clear their vectors).
struct OurSavedHooks : torch::autograd::SavedVariableHooks {
  ~OurSavedHooks() override {
    *alive = false;
  }
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);
};

struct GivenSavedHooks : OurSavedHooks {
  explicit GivenSavedHooks(at::Tensor t) : tensor(std::move(t)) {}
  void call_pack_hook(const at::Tensor&) override {
    TORCH_INTERNAL_ASSERT(false, "compiled_autograd: a handed-over saved tensor is never packed");
  }
  at::Tensor call_unpack_hook() override {
    return tensor;
  }
  // a capture nested in this backward collects it as a tensor without hooks
  std::optional<std::pair<c10::SafePyObject, c10::SafePyObject>> retrieve_unpack_hook_data() const override {
    return std::nullopt;
  }
  at::Tensor tensor;
};

// The key and sizes entries of one lifted tensor (Collector::append_tensor_key; also
// walk/collect.py's _Lifter, for the tensors only Python sees: a custom Function's saved tensors and
// ctx attributes). Returns why the tensor cannot be keyed, or nullptr.
const char* tensor_key_into(const at::Tensor& t, std::string& key, std::vector<int64_t>& sizes) {
  if (t.is_nested() && t.key_set().has(c10::DispatchKey::Python)) {
    // a jagged nested tensor: a graph cannot hold it (its sizes hold a nested int). Keyed by its
    // dtype, device and dim, tag 'N', zeros for its geometry; walk/subclasses.py holds it beside
    // the graph where it is a root grad (NOTE [Values passed by reference]), or refuses it
    append_pod(key, static_cast<uint8_t>('N'));
    append_pod(key, static_cast<int8_t>(t.scalar_type()));
    append_pod(key, static_cast<int8_t>(t.device().type()));
    append_pod(key, static_cast<int8_t>(t.device().index()));
    append_pod(key, static_cast<uint8_t>(t.dim()));
    sizes.insert(sizes.end(), static_cast<size_t>(t.dim()) + 1, 0); // (values.py tensor_positions: dims, offset)
    return nullptr;
  }
  if (t.layout() != at::kStrided) {
    return "non-strided lifted tensor";
  }
  if (t.is_nested()) {
    return "tensor subclass";
  }
  // NOTE [Tensor subclasses in the key] (docs/design/subclasses.md): a wrapper subclass
  // (DTensor, a user's) is keyed here by its outer metadata, tag 'W', its outer geometry in the
  // sizes; walk/collect.py flattens it (__tensor_flatten__), lifts its inner tensors and keys
  // its type and metadata, or refuses it ("tensor subclass"). It has no data of its own.
  const bool wrapper = t.key_set().has(c10::DispatchKey::Python);
  if (t.key_set().has(c10::DispatchKey::FuncTorchGradWrapper) || t.key_set().has(c10::DispatchKey::FuncTorchBatched)) {
    return "a torch.func transform's wrapped tensor";
  }
  // NOTE [Lifted tensors without data]
  // A ZeroTensor has no data (sgn's backward makes one; eager's ops on it dispatch to
  // ZeroTensor kernels, which read only sizes), and those kernels copy their arguments to the
  // meta device. A graph traced on such a tensor's fake reads it as an ordinary tensor, and a
  // compiled kernel would read through a null pointer (found by the fuzzer: a segfault in a
  // second backward through a create_graph graph that returned both). Its node runs opaquely.
  if (t.is_meta()) {
    return "a meta tensor among the lifted tensors";
  }
  // A tensor whose storage was resized to nothing (FSDP2's unsharded parameters between
  // their forward and their all-gather in the backward) gets its data back from a hook
  // before its node reads it: NOTE [Tensors whose data arrives during the backward]
  // (capture/passes.py). A ZeroTensor's never comes.
  bool arrives = !wrapper && t.has_storage() && t.numel() > 0 && !t._is_zerotensor() && t.storage().nbytes() == 0;
  if (!wrapper && !arrives && (!t.has_storage() || (t.numel() > 0 && t.const_data_ptr() == nullptr))) {
    return "a lifted tensor without data";
  }
  append_pod(key, static_cast<uint8_t>(wrapper ? 'W' : arrives ? 'A' : 'H'));
  append_pod(key, static_cast<int8_t>(t.scalar_type()));
  append_pod(key, static_cast<int8_t>(t.device().type()));
  append_pod(key, static_cast<int8_t>(t.device().index()));
  append_pod(key, static_cast<uint8_t>(
      (t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0) |
      (t.unsafeGetTensorImpl()->is_wrapped_number() ? 4 : 0) |
      (t.requires_grad() ? 8 : 0)));
  append_pod(key, static_cast<uint8_t>(t.dim()));
  char layout = 'S';
  if (t.is_contiguous()) {
    layout = 'C';
  } else if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    layout = 'L';
  } else if (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
    layout = 'M';
  }
  append_pod(key, layout);
  for (auto s : t.sizes()) {
    sizes.push_back(s);
  }
  if (layout == 'S') {
    for (auto s : t.strides()) {
      sizes.push_back(s);
    }
  }
  sizes.push_back(t.storage_offset());
  return nullptr;
}

// tensor_key(t) -> (key bytes, geometry): raises ValueError where the tensor cannot be keyed.
py::tuple tensor_key(const at::Tensor& t) {
  std::string key;
  std::vector<int64_t> sizes;
  const char* why = tensor_key_into(t, key, sizes);
  if (why != nullptr) {
    throw py::value_error(why);
  }
  return py::make_tuple(py::bytes(key), py::tuple(py::cast(sizes)));
}

struct LearningSavedHooks : OurSavedHooks {
  LearningSavedHooks(SavedHooksPtr original, py::object report, size_t i)
      : original(std::move(original)), report(std::move(report)), i(i) {}
  ~LearningSavedHooks() override {
    py::gil_scoped_acquire gil;
    report = py::object();
  }
  void call_pack_hook(const at::Tensor&) override {
    TORCH_INTERNAL_ASSERT(false, "compiled_autograd: a saved tensor being unpacked is never packed");
  }
  at::Tensor call_unpack_hook() override {
    at::Tensor t = original->call_unpack_hook(); // the user's hook (it takes the GIL)
    py::gil_scoped_acquire gil;
    report(i, t);
    return t;
  }
  std::optional<std::pair<c10::SafePyObject, c10::SafePyObject>> retrieve_unpack_hook_data() const override {
    return original->retrieve_unpack_hook_data();
  }
  SavedHooksPtr original;
  py::object report;
  size_t i;
};

// ---------------------------------------------------------------------------
// SavedHookHandover (capture.h)
// ---------------------------------------------------------------------------

// Python objects stored with saved tensors that carry saved_tensors_hooks:
// [(unpack_hook, packed)] in the order apply_with_saved will ask for them.
// Handed over: we keep no reference, so that each is freed once unpacked (a
// checkpoint's hook holds its region's inputs) rather than with the capture.
py::list SavedHookHandover::take_saved_hooks() {
  py::list out;
  auto* interp = getPyInterpreter();
  struct Hooked {
    const torch::autograd::SavedVariable* sv;
    size_t hook_id, input_id;
  };
  std::vector<Hooked> hooked;
  for (auto& [sv, ids] : g_.call_.sv_to_hooks) {
    hooked.push_back(Hooked{sv, ids.first, ids.second});
  }
  std::sort(hooked.begin(), hooked.end(), [](auto& a, auto& b) { return a.input_id < b.input_id; });
  hooked_svs_.clear();
  for (auto& h : hooked) {
    hooked_svs_.push_back(const_cast<torch::autograd::SavedVariable*>(h.sv));
    out.append(py::make_tuple(
        py::reinterpret_borrow<py::object>(g_.call_.hooks.at(h.hook_id).ptr(interp)),
        py::reinterpret_borrow<py::object>(g_.call_.packed_inputs.at(h.input_id).ptr(interp))));
  }
  g_.call_.hooks.clear(); // only saved variables' hooks are collected into these
  g_.call_.packed_inputs.clear();
  return out;
}

// NOTE [Handing unpacked tensors to their saved variables]: the saved variable
// of hooked tensor `i` (take_saved_hooks' order) returns `t` when unpacked;
// `keep`: the user's hooks are put back by restore_saved_hooks.
void SavedHookHandover::hand_over(size_t i, at::Tensor t, bool keep) {
  hand_over_to(hooked_svs_.at(i), std::move(t), keep);
}

// hand_over for a custom Function's saved tensors (node idx), as its `saved_tensors`
// returned them: those with hooks are handed to their saved variables.
void SavedHookHandover::hand_over_saved(size_t idx, const std::vector<std::optional<at::Tensor>>& tensors, bool keep) {
  auto obj = g_.node_object(idx);
  TORCH_CHECK(THPFunction_Check(obj.ptr()), "not a custom Function node");
  auto& saved = reinterpret_cast<THPFunction*>(obj.ptr())->saved_variables;
  TORCH_CHECK(saved.size() == tensors.size(), "saved tensor count mismatch");
  for (size_t j = 0; j < saved.size(); ++j) {
    if (saved[j].has_hooks() && tensors[j].has_value()) {
      hand_over_to(&saved[j], *tensors[j], keep);
    }
  }
}

// The hooks of these hooked tensors report what they return: report(i, tensor)
// (NOTE [Unpack metadata learned from the last backward], nodes/saved_tensors.py).
void SavedHookHandover::learn_unpacks(const std::vector<size_t>& idxs, py::object report) {
  for (size_t i : idxs) {
    auto learning = std::make_unique<LearningSavedHooks>(nullptr, report, i);
    auto* installed = learning.get();
    installed->original = swap_hooks(hooked_svs_.at(i), std::move(learning));
    swapped_.push_back(Swapped{hooked_svs_[i], installed, installed->alive, nullptr});
  }
}

// Put the user's hooks back where a saved variable still has the ones
// hand_over or learn_unpacks gave it (its node has not released it since).
void SavedHookHandover::restore_saved_hooks() {
  auto member = saved_hooks_member(SavedVariableHooksMember{});
  for (auto& h : swapped_) {
    if (!*h.alive) { // released with its saved variable
      continue;
    }
    auto& hooks = h.sv->*member;
    if (hooks.get() != h.installed) {
      continue;
    }
    if (h.original) {
      hooks = std::move(h.original);
    } else {
      hooks = std::move(static_cast<LearningSavedHooks*>(h.installed)->original);
    }
  }
  swapped_.clear();
  swap_keepalive_.clear();
}

void SavedHookHandover::hand_over_to(torch::autograd::SavedVariable* sv, at::Tensor t, bool keep) {
  auto given = std::make_unique<GivenSavedHooks>(std::move(t));
  auto* installed = given.get();
  auto alive = installed->alive;
  auto original = swap_hooks(sv, std::move(given));
  if (keep) {
    swapped_.push_back(Swapped{sv, installed, std::move(alive), std::move(original)});
  }
}

SavedHooksPtr SavedHookHandover::swap_hooks(torch::autograd::SavedVariable* sv, SavedHooksPtr hooks) {
  TORCH_CHECK(sv != nullptr && sv->has_hooks(), "compiled_autograd: no hooked saved variable to swap");
  if (swap_keepalive_.empty()) {
    for (auto& r : g_.nodes_) {
      swap_keepalive_.push_back(r.fn);
    }
  }
  std::swap(sv->*saved_hooks_member(SavedVariableHooksMember{}), hooks);
  return hooks;
}

// NOTE [Edges in the key]
// Each edge goes in the key as torch's CompiledNodeArgs::collect(Edge)
// writes it (valid, its node, input_nr, the metadata validate_outputs
// checks), except for the node's id: torch's is a NodeCalls id, which costs
// an insert into a hash map of NodeCalls per node (an allocation, a
// shared_ptr copy, a free at the end: a tenth of a hit's walk on the
// 2000-node chain, measured with perf). Ours is the node's position in
// execution order (edge_index, known once the walk has ordered the nodes;
// -1: the node does not run), which names the same node in both graphs
// whenever the keys before it are equal.
static void collect_edges(const CollectedGraph& g, cad::CompiledNodeArgs& args, const std::vector<Edge>& edges) {
  args.collect_size(edges.size());
  for (const auto& e : edges) {
    if (args.cond(e.is_valid())) {
      args.collect_size(static_cast<size_t>(g.edge_index(e) + 1));
      args.collect_size(e.input_nr);
      const auto& m = e.function->input_metadata(e.input_nr);
      if (args.cond(m.is_nested_tensor())) {
        // (torch's collect(InputMetadata) refuses it; its sizes are no ints: not collected)
        args.collect(m.options());
        args.collect(m.is_tensor_subclass());
      } else {
        args.collect(m);
      }
    }
  }
}

// Whether a node takes or returns a nested tensor's grad, or with `subclasses` any tensor
// subclass's (NOTE [Values passed by reference])
static bool has_grads_by_reference(const Node& fn, bool subclasses) {
  auto held = [&](const torch::autograd::InputMetadata& m) {
    return !m.was_default_constructed() && (m.is_nested_tensor() || (subclasses && m.is_tensor_subclass()));
  };
  for (uint32_t i = 0; i < fn.num_inputs(); ++i) {
    if (held(fn.input_metadata(i))) {
      return true;
    }
  }
  for (const auto& e : fn.next_edges()) {
    if (e.is_valid() && held(e.function->input_metadata(e.input_nr))) {
      return true;
    }
  }
  return false;
}

// A lifted tensor a graph cannot hold: a nested tensor (its sizes hold a nested int) or a
// `__torch_dispatch__` subclass Python cannot flatten (walk/subclasses.py unflattenable: no
// __tensor_flatten__, a subclass inside, metadata that cannot be keyed by value).
static bool unholdable(const at::Tensor& t) {
  if (!t.defined()) {
    return false;
  }
  if (t.is_nested()) {
    return true;
  }
  if (!t.key_set().has(c10::DispatchKey::Python)) {
    return false;
  }
  static py::object* ask = nullptr; // (leaked: called until the interpreter ends)
  if (ask == nullptr) {
    ask = new py::object(py::module_::import("compiled_autograd.walk.subclasses").attr("unflattenable"));
  }
  return (*ask)(py::reinterpret_steal<py::object>(THPVariable_Wrap(t))).cast<bool>();
}

// NOTE [Nodes that save what a graph cannot hold]
// A node whose grads are plain may still save a subclass the graph cannot hold (a weight-only
// quantized weight without __tensor_flatten__, whose dispatch returns plain tensors). Once its
// compiled_args has lifted it, the lift cannot be taken back (TensorArgs keeps no undo). So, in
// the walk that knows the graph has one (opaque_subclasses), each built-in node is first asked
// for its state into a scratch call: one that would lift such a tensor runs as is, and nothing
// of it is collected. Its saved variables' unpack hooks are only collected there, never run.
static bool saves_unholdable(const c10::intrusive_ptr<Node>& fn, uint32_t idx) {
  cad::AutogradCompilerCall scratch(cad::SizeInput::STATIC);
  cad::NodeCall call(idx, fn);
  cad::CompiledNodeArgs args(scratch, call);
  try {
    fn->compiled_args(args);
  } catch (const c10::Error&) {
    return false; // (the real call raises it again, where it is told apart)
  }
  const auto& lifted = scratch.tensor_args.inputs;
  return std::any_of(lifted.begin(), lifted.end(), unholdable);
}

// ---------------------------------------------------------------------------
// Collector: the walk and the key of one backward, into a CollectedGraph
// ---------------------------------------------------------------------------
class Collector {
 public:
  // opaque_subclasses: every node that takes or returns a tensor subclass's grad runs as is
  // (a subclass without __tensor_flatten__ in the graph: NOTE [Values passed by reference])
  Collector(CollectedGraph& g, bool opaque_subclasses) : g_(g), opaque_subclasses_(opaque_subclasses) {}

  void collect(
      const std::vector<py::handle>& roots,
      const std::vector<std::optional<at::Tensor>>& root_grads,
      const std::vector<py::handle>& inputs) {
    read_edges(roots, root_grads, inputs);
    walk();
    key_roots();
    key_nodes();
    key_lifted();
  }

 private:
  // The edge a root or an input stands for, as the engine's run_backward
  // reads it: a tensor's gradient edge (an input leaf: its grad accumulator,
  // if it has one), or a GradientEdge as given.
  static Edge edge_of(py::handle obj, bool input) {
    if (THPVariable_Check(obj.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(obj.ptr());
      Edge e = torch::autograd::impl::gradient_edge(t);
      if (input && !e.is_valid()) {
        e = Edge(torch::autograd::impl::try_get_grad_accumulator(t), 0);
      }
      return e;
    }
    auto edge = py::reinterpret_borrow<py::tuple>(obj);
    PyObject* node = edge[GradientEdgeField::NODE].ptr();
    NodePtr fn;
    if (THPFunction_Check(node)) {
      fn = node_of(reinterpret_cast<THPFunction*>(node));
    } else if (torch::autograd::THPCppFunction_Check(node)) {
      fn = reinterpret_cast<torch::autograd::THPCppFunction*>(node)->cdata;
    }
    TORCH_CHECK(fn, "GradientEdge without an autograd node"); // checked in Python
    return Edge(std::move(fn), edge[GradientEdgeField::OUTPUT_NR].cast<uint32_t>());
  }

  // the roots' edges and grads; the edges of `inputs=` (output_edges_)
  void read_edges(
      const std::vector<py::handle>& roots,
      const std::vector<std::optional<at::Tensor>>& root_grads,
      const std::vector<py::handle>& inputs) {
    for (size_t i = 0; i < roots.size(); ++i) {
      Edge edge = edge_of(roots[i], false);
      TORCH_CHECK(edge.is_valid(), "root ", i, " has no grad_fn"); // checked in Python
      g_.root_edges_.push_back(edge);
      const auto& g = root_grads[i];
      g_.root_grads_.push_back(g.has_value() ? *g : at::Tensor());
    }
    output_edges_.reserve(inputs.size());
    for (auto& t : inputs) {
      output_edges_.push_back(edge_of(t, true));
    }
  }

  // which nodes run, in the engine's order (nodes_): the reachable graph with its dependency
  // counts, which of its nodes run (the engine's exec_info), then the engine's ready order
  void walk() {
    static thread_local size_t size_hint = 64;
    count_reachable(size_hint);
    Needed needed = mark_needed();
    order_nodes(needed);
    size_hint = std::max<size_t>(64, g_.info_.size());
  }

  // which nodes run, and the results grad() captures at each node
  struct Needed {
    std::unordered_set<Node*> nodes;
    std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>> captures;
  };

  // the reachable graph and its dependency counts (one map for both, sized like the previous
  // graph: hashing is a large part of a hit's cost)
  void count_reachable(size_t size_hint) {
    g_.info_.reset(size_hint);
    auto& reach = g_.info_;
    std::vector<Node*> stack;
    for (auto& e : g_.root_edges_) {
      if (reach.try_emplace(e.function).second) {
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
        auto [info, inserted] = reach.try_emplace(next.function);
        info->deps += 1;
        if (inserted) {
          stack.push_back(next.function.get());
        }
      }
    }
  }

  // which nodes run: all, or those on a path to an output edge (the engine's exec_info);
  // grad() captures instead of accumulating
  Needed mark_needed() {
    Needed needed;
    auto& reach = g_.info_;
    g_.filtered_ = !output_edges_.empty();
    g_.num_results_ = g_.accumulate_grad_ ? 0 : output_edges_.size();
    if (!g_.filtered_) {
      return needed;
    }
    std::unordered_set<Node*> targets;
    for (size_t i = 0; i < output_edges_.size(); ++i) {
      auto& e = output_edges_[i];
      if (!e.is_valid() || reach.find(e.function.get()) == nullptr) {
        continue; // unreachable: the result stays None
      }
      targets.insert(e.function.get());
      if (g_.accumulate_grad_) {
        needed.nodes.insert(e.function.get());
      } else {
        needed.captures[e.function.get()].emplace_back(e.input_nr, i);
      }
    }
    std::unordered_map<Node*, int> memo; // 1 yes, 2 no
    std::function<bool(Node*)> leads = [&](Node* fn) -> bool {
      auto it = memo.find(fn);
      if (it != memo.end()) {
        return it->second == 1;
      }
      memo[fn] = 2;
      bool r = false;
      for (const auto& next : fn->next_edges()) {
        if (next.is_valid() && (targets.count(next.function.get()) || leads(next.function.get()))) {
          r = true;
        }
      }
      memo[fn] = r ? 1 : 2;
      return r;
    };
    for (auto& info : reach.entries()) {
      if (leads(info.fn.get())) {
        needed.nodes.insert(info.fn.get());
      }
    }
    return needed;
  }

  // the engine's order: ready nodes by sequence number (nodes_)
  void order_nodes(const Needed& needed) {
    auto& reach = g_.info_;
    const bool filtered = g_.filtered_;
    // The engine evaluates its graph root whatever exec_info says: with one
    // root edge that is the root's own node (no dummy GraphRoot), which, when
    // it leads to none of the inputs, still runs its tensor pre-hooks and
    // retain_grad (evaluate_function), though not itself.
    Node* visited_root = g_.root_edges_.size() == 1 ? g_.root_edges_[0].function.get() : nullptr;
    auto should_run = [&](Node* fn) {
      return !filtered || needed.nodes.count(fn) || needed.captures.count(fn) || fn == visited_root;
    };
    std::priority_queue<ReadyEntry, std::vector<ReadyEntry>, CompareReady> ready;
    auto push_if_ready = [&](Node* fn) {
      if (reach.find(fn)->deps == 0 && should_run(fn)) {
        ready.push({fn, fn->sequence_nr()});
      }
    };
    {
      std::unordered_set<Node*> seen;
      for (auto& e : g_.root_edges_) {
        if (seen.insert(e.function.get()).second) {
          push_if_ready(e.function.get());
        }
      }
    }
    while (!ready.empty()) {
      Node* fn = ready.top().fn;
      ready.pop();
      auto& info = *reach.find(fn);
      info.index = static_cast<int64_t>(g_.nodes_.size());
      NodeRecord r;
      r.fn = info.fn;
      r.execute = !filtered || needed.nodes.count(fn);
      auto cs = needed.captures.find(fn);
      if (cs != needed.captures.end()) {
        r.captures = cs->second;
      }
      g_.nodes_.push_back(std::move(r));
      if (!g_.nodes_.back().execute) {
        continue;
      }
      for (const auto& next : fn->next_edges()) {
        if (next.is_valid()) {
          reach.find(next.function.get())->deps -= 1;
          push_if_ready(next.function.get());
        }
      }
    }
  }

  void key_roots() {
    // -- key: roots and results
    g_.key_.reserve(64 * g_.nodes_.size());
    append_pod(g_.key_, static_cast<uint32_t>(g_.root_edges_.size()));
    append_pod(g_.key_, static_cast<uint8_t>(g_.accumulate_grad_));
    append_pod(g_.key_, static_cast<uint32_t>(output_edges_.size()));
    for (auto& g : g_.root_grads_) {
      uint32_t id = g.defined() ? g_.call_.tensor_args.add(g).id : 0;
      append_pod(g_.key_, id);
    }
    for (auto& e : g_.root_edges_) {
      append_pod(g_.key_, g_.edge_index(e));
      append_pod(g_.key_, e.input_nr);
    }
    for (auto& e : output_edges_) {
      append_pod(g_.key_, g_.edge_index(e));
      append_pod(g_.key_, e.input_nr);
    }

    // -- key: the metadata root grads are validated against
    if (!g_.nodes_.empty()) {
      cad::NodeCall first_call(0, g_.nodes_[0].fn);
      cad::CompiledNodeArgs root_args(g_.call_, first_call);
      collect_edges(g_, root_args, g_.root_edges_);
      auto k = root_args.key();
      append_pod(g_.key_, static_cast<uint32_t>(k.key_size));
      g_.key_.append(reinterpret_cast<const char*>(k.key), k.key_size);
    }
  }

  void key_nodes() {
    // -- key: nodes
    for (size_t idx = 0; idx < g_.nodes_.size(); ++idx) {
      auto& r = g_.nodes_[idx];
      const auto& fn = r.fn;
      const TypeInfo& ti = type_info_of(*fn);
      r.kind = ti.kind;
      g_.node_key_offsets_.push_back(g_.key_.size());
      append_pod(g_.key_, ti.id);
      append_pod(g_.key_, static_cast<uint8_t>(r.execute));
      // a node grad() only captures at still runs its tensor pre-hooks and retain_grad
      // before the capture, as the engine's evaluate_function does
      r.n_tensor_pre = fn->tensor_pre_hooks().size();
      r.n_retains = fn->retains_grad_hooks().size();
      if (!r.execute) {
        append_pod(g_.key_, r.n_tensor_pre);
        append_pod(g_.key_, r.n_retains);
        continue;
      }
      if (!on_current_streams(*fn)) {
        g_.fail("a node's forward ran on another stream than the backward's current one "
                "(a compiled graph runs on one stream)");
      }
      r.n_pre = fn->pre_hooks().size();
      r.n_post = fn->post_hooks().size();
      if (r.kind == ACCUMULATE) {
        r.post_acc = static_cast<AccumulateGrad*>(fn.get())->tensor_post_acc_grad_hooks() != nullptr;
      }
      append_pod(g_.key_, r.n_tensor_pre);
      append_pod(g_.key_, r.n_retains);
      append_pod(g_.key_, r.n_pre);
      append_pod(g_.key_, r.n_post);
      append_pod(g_.key_, static_cast<uint8_t>(r.post_acc));

      // The NodeCall lives on the stack: compiled_args reads only its node
      // (a saved output's grad_fn). The trace looks nodes up in
      // call_.node_calls; a hit never fills that map (NOTE [Edges in the key]).
      cad::NodeCall node_call(static_cast<uint32_t>(idx), r.fn);
      cad::CompiledNodeArgs node_args(g_.call_, node_call);
      r.size_start = g_.call_.all_size_inputs.size();
      if (r.kind != ACCUMULATE && has_grads_by_reference(*fn, opaque_subclasses_)) {
        // NOTE [Values passed by reference] (nodes/references.py): a graph cannot hold a nested
        // tensor (its sizes hold a nested int), so a node that takes or returns one runs as is,
        // and what it returns is handed to the next call by reference. Nothing of it is collected:
        // its saved nested tensors are never lifted (torch's collect(InputMetadata) refuses them).
        r.opaque = true;
        r.opaque_reason = opaque_subclasses_
            ? "takes or returns a tensor subclass's grad, in a graph with one the graph cannot hold (passed by reference)"
            : "takes or returns a nested tensor's grad (a tensor subclass the graph cannot hold: passed by reference)";
      } else if (r.kind == GENERIC && opaque_subclasses_ && saves_unholdable(fn, static_cast<uint32_t>(idx))) {
        // NOTE [Nodes that save what a graph cannot hold]
        r.opaque = true;
        r.opaque_reason = "saves a tensor subclass the graph cannot hold (a nested tensor, or one without __tensor_flatten__)";
      } else if (r.kind == GENERIC) {
        try {
          fn->compiled_args(node_args);
        } catch (const c10::Error& e) {
          std::string msg = e.what_without_backtrace();
          // the version-counter and freed-graph errors are the user's: raise them
          if (msg.find("modified by an inplace operation") != std::string::npos ||
              msg.find("backward through the graph a second time") != std::string::npos) {
            throw;
          }
          r.opaque = true;
          r.opaque_reason = msg.substr(0, msg.find('\n'));
        }
      } else if (r.kind == OPAQUE) {
        r.opaque = true;
        r.opaque_reason = "C++ custom autograd Function";
      } else if (r.kind == PYNODE) {
        // The trace bakes in how many grads the backward takes and, for a None
        // grad, the zeros standing in for it, shaped like the forward output
        // (torch's PyNode::compiled_args collects these too); an unused output
        // has no edge whose metadata would key them. Its sizes are size inputs
        // (from size_start: a dynamic graph makes them symbolic).
        const auto* f = function_of(static_cast<const torch::autograd::PyNode*>(fn.get()));
        node_args.collect_size(fn->num_inputs());
        node_args.collect(f->output_info);
      }
      append_pod(g_.key_, static_cast<uint8_t>(r.opaque));
      // edges and the metadata of what they feed, for validate_outputs
      r.edge_size_start = g_.call_.all_size_inputs.size();
      collect_edges(g_, node_args, fn->next_edges());
      auto k = node_args.key();
      append_pod(g_.key_, static_cast<uint32_t>(k.key_size));
      g_.key_.append(reinterpret_cast<const char*>(k.key), k.key_size);
    }
    g_.node_key_offsets_.push_back(g_.key_.size()); // end of the last node
    if (!g_.call_.lifted_ivalue_args.args.empty()) {
      g_.fail("lifted scalars of C++ custom functions");
    }
  }

  void key_lifted() {
    // -- sizes: the node SymInts, then every lifted tensor's dims. They are
    //    not in the key bytes: a static graph is keyed by (key, sizes), a
    //    dynamic one by (key, its static sizes) plus guards (cache.py).
    append_pod(g_.key_, static_cast<uint32_t>(g_.call_.all_size_inputs.size()));
    g_.sizes_.reserve(g_.call_.all_size_inputs.size() + 4 * g_.call_.tensor_args.inputs.size());
    for (auto& s : g_.call_.all_size_inputs) {
      g_.sizes_.push_back(s.value);
    }
    // -- key: lifted tensors' metadata and layout
    append_pod(g_.key_, static_cast<uint32_t>(g_.call_.tensor_args.inputs.size()));
    for (size_t i = 0; i < g_.call_.tensor_args.inputs.size(); ++i) {
      const auto& t = g_.call_.tensor_args.inputs[i];
      append_tensor_key(t);
      if (t.key_set().has(c10::DispatchKey::Python)) {
        g_.wrapped_.push_back(i); // NOTE [Tensor subclasses in the key] (a jagged nested tensor too)
      }
    }
  }

  // NOTE [Streams]
  // Eager runs each node on the stream its forward op ran on (the stream in its
  // input metadata) and syncs the streams where grads cross them. A compiled
  // graph runs on the stream current when backward() is called: right only
  // when every node's stream is that one (a forward and backward on one
  // stream, the default one or a side stream, as training loops run). A node
  // on another stream (a forward on a side stream, a backward outside it)
  // makes the backward run in eager, with its reason.
  bool on_current_streams(const Node& fn) {
    for (size_t i = 0; i < fn.num_inputs(); ++i) {
      const auto& m = fn.input_metadata(i);
      auto device = m.device();
      if (device.is_cpu() || device.is_meta()) {
        continue;
      }
      if (!(stream_device_ && *stream_device_ == device)) {
        try {
          current_stream_ = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
        } catch (const c10::Error&) {
          return false; // a device without a stream guard: the engine's own rules then
        }
        stream_device_ = device;
      }
      if (m.stream() != *current_stream_) {
        return false;
      }
    }
    return true;
  }

  // Dtype, device, flags and layout class of a lifted tensor go in the key;
  // its geometry goes in sizes_: the sizes, the strides unless they follow
  // from the sizes (contiguous, channels_last: layout 'C'/'L'/'M'), and the
  // storage offset.
  void append_tensor_key(const at::Tensor& t) {
    const char* why = tensor_key_into(t, g_.key_, g_.sizes_);
    if (why != nullptr) {
      g_.fail(why);
    }
  }

  CollectedGraph& g_;
  bool opaque_subclasses_;
  std::vector<Edge> output_edges_;
  std::optional<c10::Device> stream_device_;
  std::optional<c10::Stream> current_stream_;
};

// ---------------------------------------------------------------------------
// CollectedGraph: what Python asks of the collected graph (capture.h)
// ---------------------------------------------------------------------------

// One tuple per node in execution order (values.NodeRow; NodeRowField):
// (name, kind, execute, opaque, opaque_reason, edges, captures,
//  (n_tensor_pre, n_retains, n_pre, n_post, post_acc), num_inputs,
//  edge_sizes, size_start) where edge_sizes[i] is the position of edge
//  i's input metadata sizes among the size inputs (-1: invalid edge) and
//  size_start the position of the node's own first size input
py::list CollectedGraph::nodes() const {
  py::list out;
  for (auto& r : nodes_) {
    py::list edges;
    py::list edge_sizes;
    size_t pos = r.edge_size_start;
    const auto& next = r.fn->next_edges();
    for (size_t k = 0; r.execute && k < next.size(); ++k) {
      edges.append(py::make_tuple(edge_index(next[k]), next[k].input_nr));
      if (next[k].is_valid()) {
        edge_sizes.append(static_cast<int64_t>(pos));
        const auto& m = next[k].function->input_metadata(next[k].input_nr);
        pos += m.is_nested_tensor() ? 0 : m.shape_as_dim_vector().size();
      } else {
        edge_sizes.append(-1);
      }
    }
    py::list caps;
    for (auto& [nr, o] : r.captures) {
      caps.append(py::make_tuple(nr, o));
    }
    py::tuple hooks(HooksField::COUNT);
    hooks[HooksField::TENSOR_PRE] = r.n_tensor_pre;
    hooks[HooksField::RETAINS] = r.n_retains;
    hooks[HooksField::PRE] = r.n_pre;
    hooks[HooksField::POST] = r.n_post;
    hooks[HooksField::POST_ACCUMULATE] = r.post_acc;
    py::tuple row(NodeRowField::COUNT);
    row[NodeRowField::NAME] = r.fn->name();
    row[NodeRowField::KIND] = static_cast<int>(r.kind);
    row[NodeRowField::EXECUTE] = r.execute;
    row[NodeRowField::OPAQUE] = r.opaque;
    row[NodeRowField::OPAQUE_REASON] = r.opaque_reason;
    row[NodeRowField::EDGES] = edges;
    row[NodeRowField::CAPTURES] = caps;
    row[NodeRowField::HOOKS] = hooks;
    row[NodeRowField::NUM_INPUTS] = r.fn->num_inputs();
    row[NodeRowField::EDGE_SIZES] = edge_sizes;
    row[NodeRowField::SIZE_START] = r.size_start;
    out.append(row);
  }
  return out;
}

std::string CollectedGraph::node_name(size_t idx) const {
  return nodes_.at(idx).fn->name();
}

// executed custom Function nodes (their state is collected by Python)
std::vector<size_t> CollectedGraph::pynode_indices() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].kind == PYNODE && nodes_[i].execute) {
      out.push_back(i);
    }
  }
  return out;
}

// Whether a saved tensor of one of these custom Function nodes has saved-tensor hooks (its
// unpack hook runs when Python reads ctx.saved_tensors).
bool CollectedGraph::pynodes_have_saved_hooks(const std::vector<size_t>& idxs) const {
  for (auto i : idxs) {
    auto obj = node_object(i);
    if (!THPFunction_Check(obj.ptr())) {
      return true; // (not ours to judge: as if it had)
    }
    for (const auto& sv : reinterpret_cast<THPFunction*>(obj.ptr())->saved_variables) {
      if (sv.has_hooks()) {
        return true;
      }
    }
  }
  return false;
}

// the defined `.grad` of each leaf whose AccumulateGrad runs in this backward
std::vector<at::Tensor> CollectedGraph::accumulated_grads() const {
  std::vector<at::Tensor> out;
  for (auto& r : nodes_) {
    if (r.kind == ACCUMULATE && r.execute) {
      const auto& g = static_cast<AccumulateGrad*>(r.fn.get())->variable.grad();
      if (g.defined()) {
        out.push_back(g);
      }
    }
  }
  return out;
}

// position of an edge's node in execution order; -1: not run in this
// backward; -2: invalid edge
int64_t CollectedGraph::edge_index(const Edge& e) const {
  if (!e.is_valid()) {
    return -2;
  }
  const NodeInfo* info = info_.find(e.function.get());
  return info == nullptr ? -1 : info->index;
}

py::object CollectedGraph::node_object(size_t idx) const {
  return py::reinterpret_steal<py::object>(
      torch::autograd::functionToPyObject(nodes_.at(idx).fn));
}

// (node index, input_nr) of each root, and the lifted index of its grad (-1: none)
py::list CollectedGraph::roots() {
  py::list out;
  for (size_t i = 0; i < root_edges_.size(); ++i) {
    auto& e = root_edges_[i];
    const NodeInfo* info = info_.find(e.function.get());
    int64_t idx = info == nullptr ? -1 : info->index;
    int64_t g = -1;
    if (root_grads_[i].defined()) {
      g = static_cast<int64_t>(call_.tensor_args.lookup(root_grads_[i]).index());
    }
    out.append(py::make_tuple(idx, e.input_nr, g));
  }
  return out;
}

// the inputs of node idx whose grads are tensor subclasses (their metadata says so: a DTensor's,
// whose shape is the global one); a call that would return one is refused (docs/design/subclasses.md)
py::list CollectedGraph::subclass_inputs(size_t idx) const {
  py::list out;
  auto& fn = nodes_.at(idx).fn;
  for (uint32_t i = 0; i < fn->num_inputs(); ++i) {
    const auto& m = fn->input_metadata(i);
    if (!m.was_default_constructed() && m.is_tensor_subclass()) {
      out.append(i);
    }
  }
  return out;
}

// (metadata of each input of node idx): (shape, dtype, device) or None; a nested tensor's shape None
py::list CollectedGraph::input_metadata(size_t idx) const {
  py::list out;
  auto& fn = nodes_.at(idx).fn;
  for (uint32_t i = 0; i < fn->num_inputs(); ++i) {
    const auto& m = fn->input_metadata(i);
    if (m.was_default_constructed()) {
      out.append(py::none());
      continue;
    }
    auto dtype = py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(m.dtype().toScalarType())));
    if (m.is_nested_tensor()) { // (no int sizes: passed by reference, NOTE [Values passed by reference])
      out.append(py::make_tuple(py::none(), dtype, m.device().str()));
      continue;
    }
    std::vector<int64_t> shape;
    for (auto& s : m.shape_as_dim_vector()) {
      shape.push_back(s.guard_int(__FILE__, __LINE__));
    }
    out.append(py::make_tuple(shape, dtype, m.device().str()));
  }
  return out;
}

// A custom Function's forward outputs (what materialized grads look like):
// (shape, dtype, device) or None when the output was empty
py::list CollectedGraph::pynode_output_info(size_t idx) const {
  auto obj = node_object(idx);
  TORCH_CHECK(THPFunction_Check(obj.ptr()), "not a custom Function node");
  auto* f = reinterpret_cast<THPFunction*>(obj.ptr());
  py::list out;
  for (auto& info : f->output_info) {
    if (info.is_empty) {
      out.append(py::none());
      continue;
    }
    std::vector<int64_t> shape;
    for (auto& s : info.size) {
      shape.push_back(s.guard_int(__FILE__, __LINE__));
    }
    auto dtype = py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(info.scalar_type)));
    out.append(py::make_tuple(shape, dtype, info.device.str()));
  }
  return out;
}

// PyNode flags Python cannot read: (materialize_grads,
// materialize_non_diff_grads, boxed_grads_call, is_variable_input)
py::tuple CollectedGraph::pynode_flags(size_t idx) const {
  auto obj = node_object(idx);
  TORCH_CHECK(THPFunction_Check(obj.ptr()), "not a custom Function node");
  auto* f = reinterpret_cast<THPFunction*>(obj.ptr());
  return py::make_tuple(
      f->materialize_grads, f->materialize_non_diff_grads, boxed_grads_call(f),
      f->is_variable_input);
}

void CollectedGraph::clear_graph() {
  nodes_.clear();
  root_edges_.clear();
  root_grads_.clear();
  info_.clear();
}

// ---------------------------------------------------------------------------
// GraphWalk (capture.h)
// ---------------------------------------------------------------------------
GraphWalk::GraphWalk(
    const std::vector<py::handle>& roots,
    const std::vector<std::optional<at::Tensor>>& root_grads,
    const std::vector<py::handle>& inputs,
    bool accumulate_grad,
    bool opaque_subclasses)
    : CollectedGraph(accumulate_grad) {
  this->opaque_subclasses = opaque_subclasses;
  Collector(*this, opaque_subclasses).collect(roots, root_grads, inputs);
}

} // namespace compiled_autograd_native
