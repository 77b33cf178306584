// compiled_autograd native helper.
//
// What Python cannot do with torch 2.13's autograd graph, this file does:
//   collect  walk the graph in the exact order the eager engine runs it, and
//            ask every node for ALL of its state through the node's own
//            `compiled_args` visitor -- including the fields Python cannot see
//            (TypeAndSize, ScalarType, TensorGeometry, CopySlices' view
//            geometry, Cat's per-input sizes, Foreach nodes) -- into one key;
//   trace    run one node's real backward formula (`apply_with_saved`) with
//            its saved tensors swapped for the tracer's fake tensors;
//   replay   call, on real tensors, what the compiled graph cannot contain:
//            hooks (Python or C++), opaque nodes, AccumulateGrad; free the
//            graph like the engine does.
// The Python side (trace.py, runtime.py) drives these per node.
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

#include <torch/extension.h>
#include <torch/version.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <queue>
#include <typeindex>
#include <unordered_map>
#include <unordered_set>

namespace py = pybind11;
namespace cad = torch::dynamo::autograd;
using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace compiled_autograd_native {

// NOTE [Torch versions] (native/__init__.py): torch 2.13 holds nodes as
// c10::intrusive_ptr<Node>, earlier releases as std::shared_ptr<Node>; a
// custom Function's THPFunction holds its node strongly (2.13) or weakly.
using NodePtr = decltype(Edge::function);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
static NodePtr node_of(THPFunction* f) {
  return f->cdata;
}
static bool boxed_grads_call(const THPFunction* f) {
  return f->boxed_grads_call;
}
static const THPFunction* function_of(const torch::autograd::PyNode* n) {
  return reinterpret_cast<const THPFunction*>(n->pyobj());
}
#else
static NodePtr node_of(THPFunction* f) {
  return f->cdata.lock();
}
static bool boxed_grads_call(const THPFunction*) {
  return false; // (no boxed grads before 2.13)
}
static const THPFunction* function_of(const torch::autograd::PyNode* n) {
  return reinterpret_cast<const THPFunction*>(n->obj);
}
#endif

// ---------------------------------------------------------------------------
// Node kinds, decided once per C++ type
// ---------------------------------------------------------------------------
enum Kind : uint8_t {
  GENERIC = 0, // a node implementing compiled_args/apply_with_saved
  ACCUMULATE = 1, // AccumulateGrad
  PYNODE = 2, // custom autograd.Function (traced by Python)
  OPAQUE = 3, // always run eagerly inside the graph
};

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
      error = e.what();
      return at::Tensor();
    }
  }
};

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

static variable_list to_variables(const std::vector<std::optional<at::Tensor>>& xs) {
  variable_list out;
  out.reserve(xs.size());
  for (auto& x : xs) {
    out.emplace_back(x.has_value() ? *x : at::Tensor());
  }
  return out;
}

static std::vector<std::optional<at::Tensor>> from_variables(const variable_list& xs) {
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(xs.size());
  for (auto& x : xs) {
    out.emplace_back(x.defined() ? std::optional<at::Tensor>(x) : std::nullopt);
  }
  return out;
}

// ---------------------------------------------------------------------------
// GraphCapture: everything collected for one backward call
// ---------------------------------------------------------------------------
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
// return (NOTE [Unpack metadata learned from the last backward], collect.py):
// it runs in eager, each hook at its node, wrapped so that what it returns is
// reported; the wrapper is taken off when the backward ends.
//
// hooks_ is private: its member pointer is named through an explicit
// instantiation, which C++ exempts from access checks.
using SavedHooksPtr = std::unique_ptr<torch::autograd::SavedVariableHooks>;
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

// The key and sizes entries of one lifted tensor (GraphCapture::append_tensor_key; also
// collect.py's _Lifter, for the tensors only Python sees: a custom Function's saved tensors and
// ctx attributes). Returns why the tensor cannot be keyed, or nullptr.
const char* tensor_key_into(const at::Tensor& t, std::string& key, std::vector<int64_t>& sizes) {
  if (t.layout() != at::kStrided) {
    return "non-strided lifted tensor";
  }
  if (t.key_set().has(c10::DispatchKey::Python) || t.is_nested()) {
    return "tensor subclass";
  }
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
  if (!t.has_storage() || (t.numel() > 0 && t.const_data_ptr() == nullptr)) {
    return "a lifted tensor without data";
  }
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

// NOTE [Stealing a fresh grad] (ops.py): the storages of a graph's tensor inputs, by
// identity. Weak references pin their StorageImpls for the graph's run: a boxed graph frees
// inputs as it goes, and a new grad may get a freed input's memory (by data address it read
// as that input, and was copied: a flaky extra copy) but never its StorageImpl while a weak
// reference holds it. A tensor without storage counts as one of them (never stolen).
struct StorageSet {
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> refs;
  std::unordered_set<const c10::StorageImpl*> ids;

  explicit StorageSet(const py::list& tensors) {
    for (const auto& item : tensors) {
      if (THPVariable_Check(item.ptr())) {
        add(THPVariable_Unpack(item.ptr()));
      }
    }
  }

  void add(const at::Tensor& t) {
    if (t.has_storage() && ids.insert(t.storage().unsafeGetStorageImpl()).second) {
      refs.push_back(t.storage().getWeakStorageImpl());
    }
  }

  bool contains(const at::Tensor& t) const {
    return !t.has_storage() || ids.count(t.storage().unsafeGetStorageImpl()) > 0;
  }
};

class GraphCapture {
 public:
  // roots and inputs: tensors or GradientEdges (node, output_nr)
  GraphCapture(
      const std::vector<py::handle>& roots,
      const std::vector<std::optional<at::Tensor>>& root_grads,
      const std::vector<py::handle>& inputs,
      bool accumulate_grad)
      : call_(cad::SizeInput::STATIC), accumulate_grad_(accumulate_grad) {
    collect(roots, root_grads, inputs);
  }

  // '' when the graph can be compiled, otherwise why not.
  std::string unsupported;

  // The grad mode the nodes' formulas are traced in and the results applied
  // in: the engine's, which is create_graph (NOTE [create_graph] in runtime.py).
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

  size_t num_results() const {
    return num_results_;
  }

  // One tuple per node in execution order:
  // (name, kind, execute, opaque, opaque_reason, edges, captures,
  //  (n_tensor_pre, n_retains, n_pre, n_post, post_acc), num_inputs,
  //  edge_sizes, size_start) where edge_sizes[i] is the position of edge
  //  i's input metadata sizes among the size inputs (-1: invalid edge) and
  //  size_start the position of the node's own first size input
  py::list nodes() const {
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
          pos += next[k].function->input_metadata(next[k].input_nr).shape_as_dim_vector().size();
        } else {
          edge_sizes.append(-1);
        }
      }
      py::list caps;
      for (auto& [nr, o] : r.captures) {
        caps.append(py::make_tuple(nr, o));
      }
      out.append(py::make_tuple(
          r.fn->name(),
          static_cast<int>(r.kind),
          r.execute,
          r.opaque,
          r.opaque_reason,
          edges,
          caps,
          py::make_tuple(r.n_tensor_pre, r.n_retains, r.n_pre, r.n_post, r.post_acc),
          r.fn->num_inputs(),
          edge_sizes,
          r.size_start));
    }
    return out;
  }

  std::string node_name(size_t idx) const {
    return nodes_.at(idx).fn->name();
  }

  // executed custom Function nodes (their state is collected by Python)
  std::vector<size_t> pynode_indices() const {
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
  bool pynodes_have_saved_hooks(const std::vector<size_t>& idxs) const {
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
  std::vector<at::Tensor> accumulated_grads() const {
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
  int64_t edge_index(const Edge& e) const {
    if (!e.is_valid()) {
      return -2;
    }
    const NodeInfo* info = info_.find(e.function.get());
    return info == nullptr ? -1 : info->index;
  }

  py::object node_object(size_t idx) const {
    return py::reinterpret_steal<py::object>(
        torch::autograd::functionToPyObject(nodes_.at(idx).fn));
  }

  // (node index, input_nr) of each root, and the lifted index of its grad (-1: none)
  py::list roots() {
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

  // (metadata of each input of node idx): (shape, dtype, device) or None
  py::list input_metadata(size_t idx) const {
    py::list out;
    auto& fn = nodes_.at(idx).fn;
    for (uint32_t i = 0; i < fn->num_inputs(); ++i) {
      const auto& m = fn->input_metadata(i);
      if (m.was_default_constructed()) {
        out.append(py::none());
        continue;
      }
      std::vector<int64_t> shape;
      for (auto& s : m.shape_as_dim_vector()) {
        shape.push_back(s.guard_int(__FILE__, __LINE__));
      }
      auto dtype = py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(m.dtype().toScalarType())));
      out.append(py::make_tuple(shape, dtype, m.device().str()));
    }
    return out;
  }

  // Python objects stored with saved tensors that carry saved_tensors_hooks:
  // [(unpack_hook, packed)] in the order apply_with_saved will ask for them.
  // Handed over: we keep no reference, so that each is freed once unpacked (a
  // checkpoint's hook holds its region's inputs) rather than with the capture.
  py::list take_saved_hooks() {
    py::list out;
    auto* interp = getPyInterpreter();
    struct Hooked {
      const torch::autograd::SavedVariable* sv;
      size_t hook_id, input_id;
    };
    std::vector<Hooked> hooked;
    for (auto& [sv, ids] : call_.sv_to_hooks) {
      hooked.push_back(Hooked{sv, ids.first, ids.second});
    }
    std::sort(hooked.begin(), hooked.end(), [](auto& a, auto& b) { return a.input_id < b.input_id; });
    hooked_svs_.clear();
    for (auto& h : hooked) {
      hooked_svs_.push_back(const_cast<torch::autograd::SavedVariable*>(h.sv));
      out.append(py::make_tuple(
          py::reinterpret_borrow<py::object>(call_.hooks.at(h.hook_id).ptr(interp)),
          py::reinterpret_borrow<py::object>(call_.packed_inputs.at(h.input_id).ptr(interp))));
    }
    call_.hooks.clear(); // only saved variables' hooks are collected into these
    call_.packed_inputs.clear();
    return out;
  }

  // NOTE [Handing unpacked tensors to their saved variables]: the saved variable
  // of hooked tensor `i` (take_saved_hooks' order) returns `t` when unpacked;
  // `keep`: the user's hooks are put back by restore_saved_hooks.
  void hand_over(size_t i, at::Tensor t, bool keep) {
    hand_over_to(hooked_svs_.at(i), std::move(t), keep);
  }

  // hand_over for a custom Function's saved tensors (node idx), as its `saved_tensors`
  // returned them: those with hooks are handed to their saved variables.
  void hand_over_saved(size_t idx, const std::vector<std::optional<at::Tensor>>& tensors, bool keep) {
    auto obj = node_object(idx);
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
  // (NOTE [Unpack metadata learned from the last backward], collect.py).
  void learn_unpacks(const std::vector<size_t>& idxs, py::object report) {
    for (size_t i : idxs) {
      auto learning = std::make_unique<LearningSavedHooks>(nullptr, report, i);
      auto* installed = learning.get();
      installed->original = swap_hooks(hooked_svs_.at(i), std::move(learning));
      swapped_.push_back(Swapped{hooked_svs_[i], installed, installed->alive, nullptr});
    }
  }

  // Put the user's hooks back where a saved variable still has the ones
  // hand_over or learn_unpacks gave it (its node has not released it since).
  void restore_saved_hooks() {
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

  // A custom Function's forward outputs (what materialized grads look like):
  // (shape, dtype, device) or None when the output was empty
  py::list pynode_output_info(size_t idx) const {
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
  py::tuple pynode_flags(size_t idx) const {
    auto obj = node_object(idx);
    TORCH_CHECK(THPFunction_Check(obj.ptr()), "not a custom Function node");
    auto* f = reinterpret_cast<THPFunction*>(obj.ptr());
    return py::make_tuple(
        f->materialize_grads, f->materialize_non_diff_grads, boxed_grads_call(f),
        f->is_variable_input);
  }

  // ---- trace services (called with the Python tracing modes active) -------

  void begin_trace(
      const std::vector<at::Tensor>& proxies,
      const std::vector<std::optional<at::Tensor>>& unpacked_proxies,
      py::object unpack_in_graph,
      const std::vector<std::optional<c10::SymInt>>& sym_sizes) {
    auto& args = call_.tensor_args;
    TORCH_CHECK(proxies.size() == args.inputs.size(), "proxy count mismatch");
    for (size_t i = 0; i < proxies.size(); ++i) {
      args.lookup(args.inputs[i]).proxy_tensor = proxies[i];
    }
    unpacked_proxies_ = to_variables(unpacked_proxies);
    unpack_in_graph_ = std::move(unpack_in_graph);
    TORCH_CHECK(sym_sizes.size() == call_.all_size_inputs.size(), "size count mismatch");
    mark_task_outputs();
    state_ = std::make_unique<cad::TraceState>(
        std::vector<std::optional<c10::SymInt>>(sym_sizes), 0);
  }

  // Root grads validated against the root edges, as Engine::execute does.
  std::vector<std::optional<at::Tensor>> root_values(
      const std::vector<std::optional<at::Tensor>>& grads) {
    variable_list values = to_variables(grads);
    if (nodes_.empty()) {
      return grads;
    }
    with_symbolic_edges(nodes_[0].fn, root_edges_, 0, [&]() {
      torch::autograd::validate_outputs(root_edges_, values, [](const std::string& m) { return m; });
    });
    return from_variables(values);
  }

  // Run f with the input metadata that `edges` point to swapped for the
  // trace's symbolic sizes (collected from `start`), so that validating a
  // grad of symbolic shape does not specialize it. Restored even on error.
  template <typename F>
  void with_symbolic_edges(const NodePtr& fn, std::vector<Edge>& edges, size_t start, const F& f) {
    if (!state_) {
      f();
      return;
    }
    auto& node_call = call_.node_calls.lookup(fn);
    cad::SwapSavedVariables saved(call_, *state_, Py_None, node_call);
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

  std::vector<std::optional<at::Tensor>> apply_node(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& inputs) {
    auto& r = nodes_.at(idx);
    TORCH_CHECK(state_, "begin_trace first");
    auto iface_owned = std::make_unique<TraceInterface>();
    TraceInterface* iface = iface_owned.get();
    iface->unpacked = &unpacked_proxies_;
    iface->unpack_in_graph = &unpack_in_graph_;
    cad::PyCompilerGuard guard(std::move(iface_owned));
    at::AutoGradMode grad_mode_guard(grad_mode);
    state_->sym_sizes_index = r.size_start;
    auto& node_call = call_.node_calls.lookup(r.fn);
    cad::SwapSavedVariables saved(call_, *state_, Py_None, node_call);
    variable_list outs = r.fn->apply_with_saved(to_variables(inputs), saved);
    saved.debug_asserts();
    TORCH_CHECK(iface->error.empty(), r.fn->name(), ": ", iface->error);
    return validate(idx, from_variables(outs));
  }

  // The engine's validate_outputs for node idx (sum to shape, cast, device).
  std::vector<std::optional<at::Tensor>> validate(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& outputs) {
    auto& r = nodes_.at(idx);
    auto& fn = r.fn;
    variable_list outs = to_variables(outputs);
    with_symbolic_edges(fn, fn->next_edges(), r.edge_size_start, [&]() {
      torch::autograd::validate_outputs(
          fn->next_edges(), outs, [&](const std::string& m) { return "Function " + fn->name() + " returned an " + m; });  // (the engine's wording)
    });
    return from_variables(outs);
  }

  void end_trace() {
    unmark_task_outputs();
    state_.reset();
    unpacked_proxies_.clear();
    unpack_in_graph_ = py::none();
  }

  // ---- replay services (real tensors, called from the compiled graph) -----

  std::vector<std::optional<at::Tensor>> call_tensor_pre_hooks(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& inputs) {
    auto& fn = nodes_.at(idx).fn;
    variable_list values = to_variables(inputs);
    for (const auto& hook : fn->tensor_pre_hooks()) {
      values = (*hook)(values);
    }
    for (const auto& pair : fn->retains_grad_hooks()) {
      values = (*pair.second)(values);
    }
    return from_variables(values);
  }

  std::vector<std::optional<at::Tensor>> call_pre_hooks(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& inputs) {
    auto& fn = nodes_.at(idx).fn;
    variable_list values = to_variables(inputs);
    for (const auto& hook : fn->pre_hooks()) {
      values = (*hook)(values);
    }
    return from_variables(values);
  }

  std::vector<std::optional<at::Tensor>> call_post_hooks(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& outputs,
      const std::vector<std::optional<at::Tensor>>& inputs) {
    auto& fn = nodes_.at(idx).fn;
    variable_list outs = to_variables(outputs);
    variable_list ins = to_variables(inputs);
    for (const auto& hook : fn->post_hooks()) {
      outs = (*hook)(outs, ins);
    }
    return from_variables(outs);
  }

  // Run node idx as the engine would (its own apply, then validate_outputs).
  std::vector<std::optional<at::Tensor>> call_node(
      size_t idx,
      const std::vector<std::optional<at::Tensor>>& inputs) {
    auto& fn = nodes_.at(idx).fn;
    at::NoGradGuard no_grad;
    variable_list outs = (*fn)(to_variables(inputs));
    return validate(idx, from_variables(outs));
  }

  // AccumulateGrad itself (layout contract, stealing, in-place accumulation,
  // post-accumulate-grad hooks), in the graph (with its leaf's tensor hooks first, `hooked`), of the graph's
  // buffer `grad`: when its storage is none of the graph inputs' (`inputs`, a StorageSet;
  // none: never), AccumulateGrad gets a new tensor on it that nothing else refers to, which
  // it may steal as eager's does; else the graph's own tensor, which it copies (NOTE
  // [Stealing a fresh grad] in ops.py). One call, no Python tensor made for the new one.
  void accumulate_graph_grad(size_t idx, const at::Tensor& grad, bool hooked, const StorageSet* inputs) {
    at::Tensor given = (inputs != nullptr && !inputs->contains(grad)) ? grad.detach() : grad;
    if (hooked) {
      hooked_accumulate_tensor(idx, std::move(given));
      return;
    }
    at::NoGradGuard no_grad;
    variable_list in;
    in.emplace_back(std::move(given));
    (*nodes_.at(idx).fn)(std::move(in));
  }

  // A leaf's tensor hooks, then its AccumulateGrad, as the engine runs them in one step
  // (NOTE [A leaf's hooks and its accumulation in one call] in ops.py).
  void hooked_accumulate_tensor(size_t idx, at::Tensor grad) {
    auto& fn = nodes_.at(idx).fn;
    variable_list values;
    values.emplace_back(std::move(grad));
    for (const auto& hook : fn->tensor_pre_hooks()) {
      values = (*hook)(values);
    }
    for (const auto& pair : fn->retains_grad_hooks()) {
      values = (*pair.second)(values);
    }
    if (values.empty() || !values[0].defined()) {
      return;
    }
    at::NoGradGuard no_grad;
    (*fn)(std::move(values));
  }

  // Accumulate the graph's results for the nodes listed in `acc` (node index,
  // result index), dropping Python's references first so that AccumulateGrad
  // may steal the buffer as eager does. Returns the results of grad().
  std::vector<std::optional<at::Tensor>> apply_results(
      py::list results,
      const std::vector<std::pair<size_t, size_t>>& acc,
      const std::vector<int64_t>& captured) {
    at::AutoGradMode grad_mode_guard(grad_mode); // AccumulateGrad clones and adds out of place under create_graph
    for (auto& [node_idx, res_idx] : acc) {
      py::object item = results[res_idx];
      if (item.is_none()) {
        continue;
      }
      at::Tensor grad = THPVariable_Unpack(item.ptr());
      results[res_idx] = py::none();
      item = py::object();
      variable_list in;
      in.emplace_back(std::move(grad));
      (*nodes_.at(node_idx).fn)(std::move(in));
    }
    std::vector<std::optional<at::Tensor>> out;
    for (auto res_idx : captured) {
      py::object item = res_idx < 0 ? py::none() : py::object(results[res_idx]);
      if (item.is_none()) {
        out.emplace_back(std::nullopt);
      } else {
        out.emplace_back(THPVariable_Unpack(item.ptr()));
      }
    }
    return out;
  }

  // Free saved variables of every executed node (retain_graph=False).
  void release() {
    for (auto& r : nodes_) {
      if (r.execute) {
        r.fn->release_variables();
      }
    }
  }

  // Free the saved variables of these executed nodes (Plan.releases: a node's, once no
  // call left in the graph may read them).
  void release_nodes(const std::vector<int64_t>& idxs) {
    for (auto i : idxs) {
      auto& r = nodes_.at(static_cast<size_t>(i));
      if (r.execute) {
        r.fn->release_variables();
      }
    }
  }

  // Drop our references to the lifted tensors (they were handed to the
  // compiled graph, which frees each at its last use).
  void drop_lifted() {
    std::vector<at::Tensor>().swap(call_.tensor_args.inputs);
  }

  // Whether user code run at node `idx` (stage 0: its tensor pre-hooks, 1: its
  // pre-hooks, 2: the node or its post hooks) gave hooks to a node this backward
  // has not reached, of a kind that node had none of: the graph has no call for
  // them (eager would run them). Hooks added where a call exists run with it (the
  // call runs the node's hooks as they are then), and removed ones are skipped.
  bool hooks_added(size_t idx, int stage) const {
    for (size_t j = idx; j < nodes_.size(); ++j) {
      const auto& r = nodes_[j];
      const auto& fn = r.fn;
      if (j > idx && r.n_tensor_pre == 0 && r.n_retains == 0 &&
          (!fn->tensor_pre_hooks().empty() || !fn->retains_grad_hooks().empty())) {
        return true;
      }
      if (!r.execute) {
        continue;
      }
      if ((j > idx || stage < 1) && r.n_pre == 0 && !fn->pre_hooks().empty()) {
        return true;
      }
      if ((j > idx || stage < 2) && r.n_post == 0 && !fn->post_hooks().empty()) {
        return true;
      }
    }
    return false;
  }

  // torch._C._will_engine_execute_node for a node of this backward, as the
  // engine answers it: the node is reachable and, under grad(inputs=...), on a
  // path to an input (register_multi_grad_hook counts the calls it waits for so)
  bool will_execute(py::handle obj) const {
    const Node* fn = nullptr;
    if (THPFunction_Check(obj.ptr())) {
      fn = node_of(reinterpret_cast<THPFunction*>(obj.ptr())).get();
    } else if (torch::autograd::THPCppFunction_Check(obj.ptr())) {
      fn = reinterpret_cast<torch::autograd::THPCppFunction*>(obj.ptr())->cdata.get();
    }
    TORCH_CHECK(fn != nullptr, "_will_engine_execute_node expects a grad_fn");
    const NodeInfo* info = info_.find(fn);
    if (info == nullptr) {
      return false;
    }
    return !filtered_ || (info->index >= 0 && nodes_[info->index].execute);
  }

  // Drop every reference to the graph (nodes, lifted tensors).
  void clear() {
    nodes_.clear();
    root_edges_.clear();
    root_grads_.clear();
    info_.clear();
    unpacked_proxies_.clear();
    unpack_in_graph_ = py::none();
    hooked_svs_.clear(); // (not swapped_: restore_saved_hooks runs after an eager fallback)
  }

 private:
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
  void mark_task_outputs() {
    if (!filtered_ || marked_ != nullptr) {
      return;
    }
    auto* info = const_cast<std::unordered_map<Node*, torch::autograd::GraphTask::ExecInfo>*>(
        torch::autograd::get_current_graph_task_exec_info());
    if (info == nullptr || !info->empty()) {
      return;
    }
    for (auto& r : nodes_) {
      if (r.execute || !r.captures.empty()) {
        (*info)[r.fn.get()].needed_ = true;
      }
    }
    marked_ = info;
  }

  void unmark_task_outputs() {
    if (marked_ != nullptr) {
      marked_->clear();
      marked_ = nullptr;
    }
  }

  void fail(const std::string& why) {
    if (unsupported.empty()) {
      unsupported = why;
    }
  }

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
    PyObject* node = edge[0].ptr();
    NodePtr fn;
    if (THPFunction_Check(node)) {
      fn = node_of(reinterpret_cast<THPFunction*>(node));
    } else if (torch::autograd::THPCppFunction_Check(node)) {
      fn = reinterpret_cast<torch::autograd::THPCppFunction*>(node)->cdata;
    }
    TORCH_CHECK(fn, "GradientEdge without an autograd node"); // checked in Python
    return Edge(std::move(fn), edge[1].cast<uint32_t>());
  }

  void collect(
      const std::vector<py::handle>& roots,
      const std::vector<std::optional<at::Tensor>>& root_grads,
      const std::vector<py::handle>& inputs) {
    for (size_t i = 0; i < roots.size(); ++i) {
      Edge edge = edge_of(roots[i], false);
      TORCH_CHECK(edge.is_valid(), "root ", i, " has no grad_fn"); // checked in Python
      root_edges_.push_back(edge);
      const auto& g = root_grads[i];
      root_grads_.push_back(g.has_value() ? *g : at::Tensor());
    }
    std::vector<Edge> output_edges;
    output_edges.reserve(inputs.size());
    for (auto& t : inputs) {
      output_edges.push_back(edge_of(t, true));
    }

    // -- reachable graph and dependency counts (one map for both, sized
    //    like the previous graph: hashing is a large part of a hit's cost)
    static thread_local size_t size_hint = 64;
    info_.reset(size_hint);
    auto& reach = info_;
    std::vector<Node*> stack;
    for (auto& e : root_edges_) {
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

    // -- which nodes run: all, or those on a path to an output edge (the
    //    engine's exec_info); grad() captures instead of accumulating
    std::unordered_set<Node*> needed;
    std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>> capture_spec;
    const bool filtered = !output_edges.empty();
    filtered_ = filtered;
    if (filtered) {
      std::unordered_set<Node*> targets;
      for (size_t i = 0; i < output_edges.size(); ++i) {
        auto& e = output_edges[i];
        if (!e.is_valid() || reach.find(e.function.get()) == nullptr) {
          continue; // unreachable: the result stays None
        }
        targets.insert(e.function.get());
        if (accumulate_grad_) {
          needed.insert(e.function.get());
        } else {
          capture_spec[e.function.get()].emplace_back(e.input_nr, i);
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
          if (next.is_valid() &&
              (targets.count(next.function.get()) || leads(next.function.get()))) {
            r = true;
          }
        }
        memo[fn] = r ? 1 : 2;
        return r;
      };
      for (auto& info : reach.entries()) {
        if (leads(info.fn.get())) {
          needed.insert(info.fn.get());
        }
      }
    }
    num_results_ = accumulate_grad_ ? 0 : output_edges.size();
    // The engine evaluates its graph root whatever exec_info says: with one
    // root edge that is the root's own node (no dummy GraphRoot), which, when
    // it leads to none of the inputs, still runs its tensor pre-hooks and
    // retain_grad (evaluate_function), though not itself.
    Node* visited_root = root_edges_.size() == 1 ? root_edges_[0].function.get() : nullptr;
    auto should_run = [&](Node* fn) {
      return !filtered || needed.count(fn) || capture_spec.count(fn) || fn == visited_root;
    };

    // -- engine order
    std::priority_queue<ReadyEntry, std::vector<ReadyEntry>, CompareReady> ready;
    auto push_if_ready = [&](Node* fn) {
      if (reach.find(fn)->deps == 0 && should_run(fn)) {
        ready.push({fn, fn->sequence_nr()});
      }
    };
    {
      std::unordered_set<Node*> seen;
      for (auto& e : root_edges_) {
        if (seen.insert(e.function.get()).second) {
          push_if_ready(e.function.get());
        }
      }
    }
    while (!ready.empty()) {
      Node* fn = ready.top().fn;
      ready.pop();
      auto& info = *reach.find(fn);
      info.index = static_cast<int64_t>(nodes_.size());
      NodeRecord r;
      r.fn = info.fn;
      r.execute = !filtered || needed.count(fn);
      auto cs = capture_spec.find(fn);
      if (cs != capture_spec.end()) {
        r.captures = cs->second;
      }
      nodes_.push_back(std::move(r));
      if (!nodes_.back().execute) {
        continue;
      }
      for (const auto& next : fn->next_edges()) {
        if (next.is_valid()) {
          reach.find(next.function.get())->deps -= 1;
          push_if_ready(next.function.get());
        }
      }
    }

    size_hint = std::max<size_t>(64, reach.size());

    // -- key: roots and results
    key_.reserve(64 * nodes_.size());
    append_pod(key_, static_cast<uint32_t>(root_edges_.size()));
    append_pod(key_, static_cast<uint8_t>(accumulate_grad_));
    append_pod(key_, static_cast<uint32_t>(output_edges.size()));
    for (auto& g : root_grads_) {
      uint32_t id = g.defined() ? call_.tensor_args.add(g).id : 0;
      append_pod(key_, id);
    }
    for (auto& e : root_edges_) {
      append_pod(key_, edge_index(e));
      append_pod(key_, e.input_nr);
    }
    for (auto& e : output_edges) {
      append_pod(key_, edge_index(e));
      append_pod(key_, e.input_nr);
    }

    // -- key: the metadata root grads are validated against
    if (!nodes_.empty()) {
      cad::NodeCall first_call(0, nodes_[0].fn);
      cad::CompiledNodeArgs root_args(call_, first_call);
      collect_edges(root_args, root_edges_);
      auto k = root_args.key();
      append_pod(key_, static_cast<uint32_t>(k.key_size));
      key_.append(reinterpret_cast<const char*>(k.key), k.key_size);
    }

    // -- key: nodes
    for (size_t idx = 0; idx < nodes_.size(); ++idx) {
      auto& r = nodes_[idx];
      const auto& fn = r.fn;
      const TypeInfo& ti = type_info_of(*fn);
      r.kind = ti.kind;
      node_key_offsets_.push_back(key_.size());
      append_pod(key_, ti.id);
      append_pod(key_, static_cast<uint8_t>(r.execute));
      // a node grad() only captures at still runs its tensor pre-hooks and retain_grad
      // before the capture, as the engine's evaluate_function does
      r.n_tensor_pre = fn->tensor_pre_hooks().size();
      r.n_retains = fn->retains_grad_hooks().size();
      if (!r.execute) {
        append_pod(key_, r.n_tensor_pre);
        append_pod(key_, r.n_retains);
        continue;
      }
      if (!on_current_streams(*fn)) {
        fail("a node's forward ran on another stream than the backward's current one "
             "(a compiled graph runs on one stream)");
      }
      r.n_pre = fn->pre_hooks().size();
      r.n_post = fn->post_hooks().size();
      if (r.kind == ACCUMULATE) {
        r.post_acc = static_cast<AccumulateGrad*>(fn.get())->tensor_post_acc_grad_hooks() != nullptr;
      }
      append_pod(key_, r.n_tensor_pre);
      append_pod(key_, r.n_retains);
      append_pod(key_, r.n_pre);
      append_pod(key_, r.n_post);
      append_pod(key_, static_cast<uint8_t>(r.post_acc));

      // The NodeCall lives on the stack: compiled_args reads only its node
      // (a saved output's grad_fn). The trace looks nodes up in
      // call_.node_calls; a hit never fills that map (NOTE [Edges in the key]).
      cad::NodeCall node_call(static_cast<uint32_t>(idx), r.fn);
      cad::CompiledNodeArgs node_args(call_, node_call);
      r.size_start = call_.all_size_inputs.size();
      if (r.kind == GENERIC) {
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
      append_pod(key_, static_cast<uint8_t>(r.opaque));
      // edges and the metadata of what they feed, for validate_outputs
      r.edge_size_start = call_.all_size_inputs.size();
      collect_edges(node_args, fn->next_edges());
      auto k = node_args.key();
      append_pod(key_, static_cast<uint32_t>(k.key_size));
      key_.append(reinterpret_cast<const char*>(k.key), k.key_size);
    }
    node_key_offsets_.push_back(key_.size()); // end of the last node
    if (!call_.lifted_ivalue_args.args.empty()) {
      fail("lifted scalars of C++ custom functions");
    }

    // -- sizes: the node SymInts, then every lifted tensor's dims. They are
    //    not in the key bytes: a static graph is keyed by (key, sizes), a
    //    dynamic one by (key, its static sizes) plus guards (cache.py).
    append_pod(key_, static_cast<uint32_t>(call_.all_size_inputs.size()));
    sizes_.reserve(call_.all_size_inputs.size() + 4 * call_.tensor_args.inputs.size());
    for (auto& s : call_.all_size_inputs) {
      sizes_.push_back(s.value);
    }
    // -- key: lifted tensors' metadata and layout
    append_pod(key_, static_cast<uint32_t>(call_.tensor_args.inputs.size()));
    for (auto& t : call_.tensor_args.inputs) {
      append_tensor_key(t);
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
  std::optional<c10::Device> stream_device_;
  std::optional<c10::Stream> current_stream_;

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
  void collect_edges(cad::CompiledNodeArgs& args, const std::vector<Edge>& edges) const {
    args.collect_size(edges.size());
    for (const auto& e : edges) {
      if (args.cond(e.is_valid())) {
        args.collect_size(static_cast<size_t>(edge_index(e) + 1));
        args.collect_size(e.input_nr);
        args.collect(e.function->input_metadata(e.input_nr));
      }
    }
  }

  // Dtype, device, flags and layout class of a lifted tensor go in the key;
  // its geometry goes in sizes_: the sizes, the strides unless they follow
  // from the sizes (contiguous, channels_last: layout 'C'/'L'/'M'), and the
  // storage offset.
  void append_tensor_key(const at::Tensor& t) {
    const char* why = tensor_key_into(t, key_, sizes_);
    if (why != nullptr) {
      fail(why);
    }
  }

  cad::AutogradCompilerCall call_;
  bool accumulate_grad_;
  std::string key_;
  std::vector<int64_t> sizes_;
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
  std::unique_ptr<cad::TraceState> state_;
  std::vector<at::Tensor> unpacked_proxies_;
  py::object unpack_in_graph_ = py::none();
  bool filtered_ = false; // `inputs=` given: only the nodes leading to them run
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

  void hand_over_to(torch::autograd::SavedVariable* sv, at::Tensor t, bool keep) {
    auto given = std::make_unique<GivenSavedHooks>(std::move(t));
    auto* installed = given.get();
    auto alive = installed->alive;
    auto original = swap_hooks(sv, std::move(given));
    if (keep) {
      swapped_.push_back(Swapped{sv, installed, std::move(alive), std::move(original)});
    }
  }

  SavedHooksPtr swap_hooks(torch::autograd::SavedVariable* sv, SavedHooksPtr hooks) {
    TORCH_CHECK(sv != nullptr && sv->has_hooks(), "compiled_autograd: no hooked saved variable to swap");
    if (swap_keepalive_.empty()) {
      for (auto& r : nodes_) {
        swap_keepalive_.push_back(r.fn);
      }
    }
    std::swap(sv->*saved_hooks_member(SavedVariableHooksMember{}), hooks);
    return hooks;
  }
  std::unordered_map<Node*, torch::autograd::GraphTask::ExecInfo>* marked_ = nullptr;
};

// ---------------------------------------------------------------------------
// The call from compiled code (NOTE [Calls in the helper] in ops.py):
// ops._run_call's steps for AccumulateGrad, hook and opaque-node calls, without
// a Python frame; an unpack call, and every case these steps do not cover, goes
// to the Python functions installed here.
// ---------------------------------------------------------------------------
struct ReplayFrame {
  py::tuple frame; // ops.replaying.frame: (capture, slots, outside, hooks, steal, keep, versions, ctx, releases, observed)
  GraphCapture* capture;
  StorageSet* steal; // nullptr: never steal
  c10::DispatchKeySet outside; // the dispatch keys the backward call excluded
  py::list last; // ops._replay.last: the slot of the last call, at index `pos`
  Py_ssize_t pos;
};

static thread_local std::vector<ReplayFrame> replay_frames;

// the slot kinds (ops.py), as this file numbers them
enum CallKind : int { CALL_OTHER = -1, CALL_TENSOR_PRE_HOOKS = 0, CALL_PRE_HOOKS, CALL_POST_HOOKS, CALL_NODE, CALL_ACCUMULATE, CALL_HOOKED_ACCUMULATE };
static constexpr int kStage[] = {0, 1, 2, 2, 2, 0}; // ops._STAGE
static constexpr int64_t kDefinedness = 1, kKeepsInputs = 2, kPassesShift = 8; // ops.DEFINEDNESS, ...

struct CallFallbacks {
  py::object call_direct; // ops.call_direct: any call not on the fast path
  py::object run_call; // ops._run_call: a call on the fast path these steps do not take
  std::vector<py::object> kinds; // the slot kinds, in CallKind's order
  std::vector<at::ScalarType> dtypes; // ops._DTYPES
  std::vector<c10::DeviceType> device_types; // ops._DEVICE_TYPES
  py::object check_versions, check_ctx, hooks_added_error, shared_modified_error, conform_error, observed_layout, conformed;
};

static CallFallbacks& fallbacks() {
  static auto* f = new CallFallbacks(); // never destroyed: no Python objects freed at exit
  return *f;
}

static void install_calls(py::dict fns) {
  auto& f = fallbacks();
  f.call_direct = fns["call_direct"];
  f.run_call = fns["run_call"];
  f.kinds.clear();
  for (auto k : py::list(fns["kinds"])) {
    f.kinds.push_back(py::reinterpret_borrow<py::object>(k));
  }
  f.dtypes.clear();
  for (auto d : py::list(fns["dtypes"])) {
    f.dtypes.push_back(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
  }
  f.device_types.clear();
  for (auto d : py::list(fns["device_types"])) {
    f.device_types.push_back(c10::Device(d.cast<std::string>()).type());
  }
  f.check_versions = fns["check_versions"];
  f.check_ctx = fns["check_ctx"];
  f.hooks_added_error = fns["hooks_added_error"];
  f.shared_modified_error = fns["shared_modified_error"];
  f.conform_error = fns["conform_error"];
  f.observed_layout = fns["observed_layout"];
  f.conformed = fns["conformed"];
}

static void push_replay(py::tuple frame, py::list last) {
  py::object steal = frame[4];
  replay_frames.push_back(ReplayFrame{
      frame,
      frame[0].cast<GraphCapture*>(),
      steal.is_none() ? nullptr : steal.cast<StorageSet*>(),
      c10::impl::tls_local_dispatch_key_set().excluded_,
      last,
      PyList_GET_SIZE(last.ptr()) - 1});
}

static void pop_replay() {
  TORCH_CHECK(!replay_frames.empty(), "compiled_autograd: no replay to leave");
  replay_frames.pop_back();
}

static const at::Tensor& tensor_at(PyObject* list, Py_ssize_t i) {
  return THPVariable_Unpack(PyList_GET_ITEM(list, i));
}

static py::object wrap(at::Tensor t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
}

static int call_kind(py::handle kind) {
  const auto& kinds = fallbacks().kinds;
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kind.ptr() == kinds[i].ptr()) {
      return static_cast<int>(i);
    }
  }
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kind.equal(kinds[i])) {
      return static_cast<int>(i);
    }
  }
  return CALL_OTHER;
}

// Whether `t` (ours) is the only reference to its tensor and storage (ops._sole_owner). A
// tensor made in Python keeps its PyObject while C++ refers to it (that PyObject's reference
// counts in use_count, and the PyObject is referenced by the tensor while use_count > 1):
// then it is ours alone when nothing in Python refers to that PyObject.
//
// That convention is torch 2.13's (NOTE [Torch versions]): it is checked once, on a tensor
// whose PyObject only this function refers to; where it does not hold (a PyObject counts
// only its Python references), a tensor with a PyObject is never judged ours alone.
static bool pyobj_held_by_tensor() {
  static const bool held = [] {
    at::Tensor t = at::empty({1});
    PyObject* obj = THPVariable_Wrap(t); // a new reference: ours; t holds the tensor too
    bool counted = Py_REFCNT(obj) == 2 && t.use_count() == 2;
    Py_DECREF(obj);
    return counted;
  }();
  return held;
}

static bool sole_owner(const at::Tensor& t) {
  PyObject* obj = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  bool alone = obj == nullptr ? t.use_count() == 1
                              : (t.use_count() == 2 && Py_REFCNT(obj) == 1 && pyobj_held_by_tensor());
  return alone && t.has_storage() && t.storage().use_count() == 1;
}

// One output of a call as the graph was traced with it (ops.OutputMeta), read from the
// call's `meta` argument (ops.encode_meta: per output rank, dtype code, device code, shape,
// strides).
struct OutputMeta {
  std::vector<int64_t> shape, strides;
  at::ScalarType dtype;
  c10::Device device;
  bool sparse; // sparse COO (ops._LAYOUTS[1]), else strided

  at::Tensor empty() const {
    auto options = at::TensorOptions().dtype(dtype).device(device);
    if (sparse) {
      return at::empty(shape, options.layout(at::kSparse));
    }
    return at::empty_strided(shape, strides, options);
  }
  // ops.OutputMeta.has_layout: the layout, and the strides of the dims longer than 1
  bool has_layout(const at::Tensor& t) const {
    if ((t.layout() == at::kSparse) != sparse || (!sparse && t.layout() != at::kStrided)) {
      return false;
    }
    if (sparse || t.numel() == 0) {
      return true;
    }
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] > 1 && t.stride(static_cast<int64_t>(d)) != strides[d]) {
        return false;
      }
    }
    return true;
  }
};

static std::vector<OutputMeta> decode_meta(const py::list& meta) {
  auto& fb = fallbacks();
  std::vector<OutputMeta> out;
  Py_ssize_t pos = 0, n = PyList_GET_SIZE(meta.ptr());
  while (pos < n) {
    auto rank = meta[pos].cast<Py_ssize_t>();
    auto dtype = fb.dtypes.at(meta[pos + 1].cast<size_t>());
    auto dev = meta[pos + 2].cast<int64_t>();
    auto index = static_cast<c10::DeviceIndex>(dev % 1024 - 1);
    c10::Device device(fb.device_types.at(static_cast<size_t>(dev / 1024)), index);
    bool sparse = meta[pos + 3].cast<int64_t>() == 1;
    pos += 4;
    OutputMeta m{{}, {}, dtype, device, sparse};
    for (Py_ssize_t r = 0; r < rank; ++r) {
      m.shape.push_back(meta[pos + r].cast<int64_t>());
      m.strides.push_back(meta[pos + rank + r].cast<int64_t>());
    }
    pos += 2 * rank;
    out.push_back(std::move(m));
  }
  return out;
}

// The outputs of a hook or node call as the graph expects them (ops._conform): per output
// traced as defined (`mask`), the tensor, in the traced layout (copied into it, and its own
// layout reported to `observed`, where it had another: NOTE [Layouts of call outputs]) and
// without lazy conj/neg bits, copied unless the graph's code is its only owner or it is one
// of `keep`; zeros where it is None; then, with DEFINEDNESS, which were defined. Anything
// else: ops._conform's error.
static py::list conform(
    int kind,
    ReplayFrame& f,
    int64_t slot,
    py::handle kind_obj,
    py::handle node_obj,
    py::handle mask,
    std::vector<std::optional<at::Tensor>> outs,
    const std::vector<at::Tensor>& keep,
    const py::list& meta_list,
    int64_t flags) {
  auto& fb = fallbacks();
  auto n_mask = static_cast<size_t>(PyTuple_GET_SIZE(mask.ptr()));
  auto fail = [&]() {
    py::list given;
    for (auto& o : outs) {
      given.append(o.has_value() && o->defined() ? wrap(*o) : py::none());
    }
    fb.conform_error(kind_obj, py::handle(f.frame[0]), node_obj, mask, given, meta_list, flags);
    throw std::runtime_error("compiled_autograd: ops._conform accepted what the helper did not");
  };
  if (outs.size() < n_mask) {
    outs.resize(n_mask);
  }
  auto metas = decode_meta(meta_list);
  py::list result;
  std::vector<bool> present;
  size_t k = 0;
  for (size_t i = 0; i < n_mask; ++i) {
    bool traced = PyTuple_GET_ITEM(mask.ptr(), i) == Py_True;
    bool defined = outs[i].has_value() && outs[i]->defined();
    if (!traced) {
      if (defined && kind != CALL_NODE) {
        fail(); // a hook made a None grad defined
      }
      continue;
    }
    const OutputMeta& m = metas.at(k);
    if (!defined) {
      present.push_back(false);
      result.append(wrap(m.empty().zero_()));
      ++k;
      continue;
    }
    at::Tensor o = std::move(*outs[i]);
    outs[i].reset();
    if (o.sizes() != c10::IntArrayRef(m.shape) || o.scalar_type() != m.dtype || o.device() != m.device) {
      outs[i] = std::move(o);
      fail();
    }
    present.push_back(true);
    o = o.resolve_conj().resolve_neg();
    if (!m.has_layout(o)) {
      py::object given = wrap(o);
      py::handle observed = f.frame[9];
      if (!observed.is_none()) {
        observed[py::make_tuple(slot, k)] = fb.observed_layout(given);
      }
      o = THPVariable_Unpack(fb.conformed(meta_list, k, given).ptr());
    }
    bool kept = std::any_of(keep.begin(), keep.end(), [&](const at::Tensor& a) {
      return a.unsafeGetTensorImpl() == o.unsafeGetTensorImpl();
    });
    if (!kept && !sole_owner(o)) {
      o = o.clone();
    }
    result.append(wrap(std::move(o)));
    ++k;
  }
  if (flags & kDefinedness) {
    auto flags_t = at::empty({static_cast<int64_t>(present.size())}, at::TensorOptions().dtype(at::kBool));
    auto* data = flags_t.data_ptr<bool>();
    for (size_t i = 0; i < present.size(); ++i) {
      data[i] = present[i];
    }
    result.append(wrap(std::move(flags_t)));
  }
  return result;
}

static py::object call_direct(int64_t slot, py::list args, py::list meta, int64_t flags) {
  auto& fb = fallbacks();
  if (at::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return fb.call_direct(slot, args, meta, flags);
  }
  auto python = [&]() { return fb.run_call(slot, args, meta, flags); };
  if (replay_frames.empty()) {
    return python();
  }
  ReplayFrame f = replay_frames.back(); // (a copy: a hook's nested backward pushes and pops frames)
  py::tuple s = py::reinterpret_borrow<py::tuple>(py::handle(f.frame[1])[py::int_(slot)]);
  // Slot: (kind, node, mask, in_flags, fresh, n_after, shared, n_watch, at)
  py::handle kind_obj = s[0];
  int kind = call_kind(kind_obj);
  if (kind == CALL_OTHER || c10::impl::tls_local_dispatch_key_set().excluded_ != f.outside) {
    return python();
  }
  py::object node_obj = s[1];
  auto node = node_obj.cast<size_t>();
  py::handle mask = s[2];
  if (!PyTuple_Check(mask.ptr())) {
    return python();
  }
  bool in_flags = PyObject_IsTrue(s[3].ptr());
  bool fresh = PyObject_IsTrue(s[4].ptr());
  auto n_after = s[5].cast<Py_ssize_t>();
  py::tuple shared = s[6];
  auto n_watch = s[7].cast<Py_ssize_t>();
  // the arguments: the call's own (then, with in_flags, which are defined), n_after that
  // only order it, n_watch saved tensors it checks, n_passed graph inputs it returns
  Py_ssize_t n_passed = flags >> kPassesShift;
  Py_ssize_t end_watch = PyList_GET_SIZE(args.ptr()) - n_passed;
  Py_ssize_t n = end_watch - n_watch - n_after;
  // the slot of the last call (ops._replay.last); the engine runs each node in the
  // backward's grad mode (ops._run_call)
  py::object at_obj = s[8];
  PyObject* last = PyList_GET_ITEM(f.last.ptr(), f.pos);
  bool new_node = last == Py_None ||
      !at_obj.equal(py::handle(PyTuple_GET_ITEM(py::handle(f.frame[1])[py::handle(last)].ptr(), 8)));
  py::int_ slot_obj(slot);
  PyList_SetItem(f.last.ptr(), f.pos, slot_obj.inc_ref().ptr());
  if (new_node) {
    if (at::GradMode::is_enabled() != f.capture->grad_mode) {
      at::GradMode::set_enabled(f.capture->grad_mode);
    }
  }
  std::vector<int64_t> before;
  for (auto i : shared) {
    PyObject* a = PyList_GET_ITEM(args.ptr(), i.cast<Py_ssize_t>());
    before.push_back(a == Py_None ? 0 : THPVariable_Unpack(a)._version());
  }
  // the call's arguments, None where undefined
  std::vector<PyObject*> given;
  if (in_flags) {
    at::Tensor defined = tensor_at(args.ptr(), n - 1).to(at::kCPU).to(at::kBool).contiguous();
    const bool* d = defined.data_ptr<bool>();
    for (Py_ssize_t i = 0; i < n - 1; ++i) {
      given.push_back(d[i] ? PyList_GET_ITEM(args.ptr(), i) : Py_None);
    }
  } else {
    for (Py_ssize_t i = 0; i < n; ++i) {
      given.push_back(PyList_GET_ITEM(args.ptr(), i));
    }
  }
  py::list outs;
  if (kind == CALL_ACCUMULATE || kind == CALL_HOOKED_ACCUMULATE) {
    // (a second argument: its definedness, a bool tensor: ops._accumulate)
    bool defined = !given.empty() && given[0] != Py_None &&
        (given.size() < 2 || given[1] == Py_None || THPVariable_Unpack(given[1]).item<bool>());
    if (defined) {
      f.capture->accumulate_graph_grad(
          node, THPVariable_Unpack(given[0]), kind == CALL_HOOKED_ACCUMULATE, fresh ? f.steal : nullptr);
    }
  } else {
    std::vector<std::optional<at::Tensor>> inputs;
    std::vector<Py_ssize_t> refcounts; // a hook that keeps its grad: never steal it (ops._run_call)
    for (PyObject* a : given) {
      inputs.emplace_back(a == Py_None ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(a)));
      refcounts.push_back(Py_REFCNT(a));
    }
    std::vector<std::optional<at::Tensor>> results;
    if (kind == CALL_TENSOR_PRE_HOOKS) {
      results = f.capture->call_tensor_pre_hooks(node, inputs);
    } else if (kind == CALL_PRE_HOOKS) {
      results = f.capture->call_pre_hooks(node, inputs);
    } else if (kind == CALL_POST_HOOKS) {
      auto split = inputs.begin() + PyTuple_GET_SIZE(mask.ptr());
      results = f.capture->call_post_hooks(
          node, std::vector<std::optional<at::Tensor>>(inputs.begin(), split), std::vector<std::optional<at::Tensor>>(split, inputs.end()));
    } else {
      results = f.capture->call_node(node, inputs);
    }
    if (f.steal != nullptr) {
      for (size_t i = 0; i < given.size(); ++i) {
        if (given[i] != Py_None && Py_REFCNT(given[i]) > refcounts[i]) {
          f.steal->add(*inputs[i]);
        }
      }
    }
    std::vector<at::Tensor> keep; // the call's inputs nothing else in the graph reads (ops._run_slot)
    if (PyObject_IsTrue(f.frame[5].ptr()) && (flags & kKeepsInputs)) {
      for (size_t i = 0; i < inputs.size(); ++i) {
        bool is_shared = std::any_of(shared.begin(), shared.end(), [&](py::handle j) { return j.cast<size_t>() == i; });
        if (inputs[i].has_value() && !is_shared) {
          keep.push_back(*inputs[i]);
        }
      }
    }
    inputs.clear();
    outs = conform(kind, f, slot, kind_obj, node_obj, mask, std::move(results), keep, meta, flags);
  }
  if (f.capture->hooks_added(node, kStage[kind])) {
    fb.hooks_added_error(kind_obj, py::handle(f.frame[0]), node_obj);
  }
  if (n_watch > 0) {
    py::list expected = py::handle(f.frame[6])[py::int_(slot)];
    Py_ssize_t start = end_watch - n_watch;
    for (Py_ssize_t k = 0; k < n_watch; ++k) {
      if (tensor_at(args.ptr(), start + k)._version() != expected[k].cast<int64_t>()) {
        py::list watched;
        for (Py_ssize_t j = 0; j < n_watch; ++j) {
          watched.append(py::handle(PyList_GET_ITEM(args.ptr(), start + j)));
        }
        fb.check_versions(watched, expected); // raises eager's error
      }
    }
  }
  py::handle ctx = f.frame[7];
  if (!ctx.is_none() && PyDict_Contains(ctx.ptr(), py::int_(slot).ptr()) == 1) {
    fb.check_ctx(ctx[py::int_(slot)]);
  }
  size_t k = 0;
  for (auto i : shared) {
    PyObject* a = given.at(i.cast<size_t>());
    if (a != Py_None && THPVariable_Unpack(a)._version() != before[k]) {
      fb.shared_modified_error(kind_obj, py::handle(f.frame[0]), node_obj);
    }
    ++k;
  }
  py::handle releases = f.frame[8];
  if (!releases.is_none() && PyDict_Contains(releases.ptr(), py::int_(slot).ptr()) == 1) {
    f.capture->release_nodes(releases[py::int_(slot)].cast<std::vector<int64_t>>());
  }
  bool keep_passed = PyObject_IsTrue(f.frame[5].ptr());
  for (Py_ssize_t i = end_watch; i < end_watch + n_passed; ++i) {
    // graph inputs read after the call, as it leaves them; a user's backend may reuse an
    // output's buffer: a copy
    PyObject* t = PyList_GET_ITEM(args.ptr(), i);
    outs.append(keep_passed ? py::reinterpret_borrow<py::object>(t) : wrap(THPVariable_Unpack(t).clone()));
  }
  return outs;
}

// Swap a custom Function's saved tensors for proxies while Python traces its
// backward (its ctx.saved_tensors then returns the proxies), and restore them.
class PyNodeSavedSwap {
 public:
  PyNodeSavedSwap(py::object node, const std::vector<std::optional<at::Tensor>>& proxies)
      : node_(std::move(node)) {
    TORCH_CHECK(THPFunction_Check(node_.ptr()), "not a custom Function node");
    auto* f = reinterpret_cast<THPFunction*>(node_.ptr());
    TORCH_CHECK(proxies.size() == f->saved_variables.size(), "saved tensor count mismatch");
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
  void restore() {
    if (restored_) {
      return;
    }
    auto* f = reinterpret_cast<THPFunction*>(node_.ptr());
    f->saved_variables = std::move(stashed_);
    restored_ = true;
  }
  ~PyNodeSavedSwap() {
    restore();
  }

 private:
  py::object node_;
  std::vector<torch::autograd::SavedVariable> stashed_;
  bool restored_ = false;
};

} // namespace compiled_autograd_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using compiled_autograd_native::GraphCapture;
  m.def("tensor_key", &compiled_autograd_native::tensor_key);
  m.def("install_calls", &compiled_autograd_native::install_calls);
  m.def("push_replay", &compiled_autograd_native::push_replay);
  m.def("pop_replay", &compiled_autograd_native::pop_replay);
  m.def("pyobj_held_by_tensor", &compiled_autograd_native::pyobj_held_by_tensor);
  m.def(
      "call_direct",
      &compiled_autograd_native::call_direct,
      py::arg("slot"),
      py::arg("args"),
      py::arg("meta"),
      py::arg("flags"));
  using compiled_autograd_native::PyNodeSavedSwap;
  using compiled_autograd_native::StorageSet;
  py::class_<StorageSet>(m, "StorageSet", py::module_local())
      .def(py::init<const py::list&>())
      .def("add", &StorageSet::add)
      .def("__contains__", &StorageSet::contains);
  py::class_<GraphCapture>(m, "GraphCapture", py::module_local())
      .def(
          py::init<
              const std::vector<py::handle>&,
              const std::vector<std::optional<at::Tensor>>&,
              const std::vector<py::handle>&,
              bool>())
      .def_readonly("unsupported", &GraphCapture::unsupported)
      .def("key", &GraphCapture::key)
      .def("lifted", &GraphCapture::lifted)
      .def("sizes", &GraphCapture::sizes)
      .def("num_size_inputs", &GraphCapture::num_size_inputs)
      .def("node_key_offsets", &GraphCapture::node_key_offsets)
      .def("num_nodes", &GraphCapture::num_nodes)
      .def("num_results", &GraphCapture::num_results)
      .def("nodes", &GraphCapture::nodes)
      .def("node_object", &GraphCapture::node_object)
      .def("node_name", &GraphCapture::node_name)
      .def("pynode_indices", &GraphCapture::pynode_indices)
      .def("pynodes_have_saved_hooks", &GraphCapture::pynodes_have_saved_hooks)
      .def("accumulated_grads", &GraphCapture::accumulated_grads)
      .def("roots", &GraphCapture::roots)
      .def("input_metadata", &GraphCapture::input_metadata)
      .def("take_saved_hooks", &GraphCapture::take_saved_hooks)
      .def("hand_over", &GraphCapture::hand_over)
      .def("hand_over_saved", &GraphCapture::hand_over_saved)
      .def("learn_unpacks", &GraphCapture::learn_unpacks)
      .def("restore_saved_hooks", &GraphCapture::restore_saved_hooks)
      .def("pynode_flags", &GraphCapture::pynode_flags)
      .def("pynode_output_info", &GraphCapture::pynode_output_info)
      .def("begin_trace", &GraphCapture::begin_trace)
      .def("root_values", &GraphCapture::root_values)
      .def("apply_node", &GraphCapture::apply_node)
      .def("validate", &GraphCapture::validate)
      .def("end_trace", &GraphCapture::end_trace)
      .def("call_tensor_pre_hooks", &GraphCapture::call_tensor_pre_hooks)
      .def("call_pre_hooks", &GraphCapture::call_pre_hooks)
      .def("call_post_hooks", &GraphCapture::call_post_hooks)
      .def("call_node", &GraphCapture::call_node)
      .def("accumulate_graph_grad", &GraphCapture::accumulate_graph_grad)
      .def("apply_results", &GraphCapture::apply_results)
      .def("release", &GraphCapture::release)
      .def("release_nodes", &GraphCapture::release_nodes)
      .def("will_execute", &GraphCapture::will_execute)
      .def("hooks_added", &GraphCapture::hooks_added)
      .def("drop_lifted", &GraphCapture::drop_lifted)
      .def("clear", &GraphCapture::clear)
      .def_readwrite("grad_mode", &GraphCapture::grad_mode);
  py::class_<PyNodeSavedSwap>(m, "PyNodeSavedSwap", py::module_local())
      .def(py::init<py::object, const std::vector<std::optional<at::Tensor>>&>())
      .def("restore", &PyNodeSavedSwap::restore);
}
