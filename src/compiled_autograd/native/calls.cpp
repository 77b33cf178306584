// calls: what compiled code calls, on real tensors: hooks (Python or C++),
// opaque nodes, AccumulateGrad (Applier, call_direct); free the graph like
// the engine does (release).

#include "capture.h"

#include <ATen/SparseTensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>

namespace compiled_autograd_native {

// ---------------------------------------------------------------------------
// StorageSet (capture.h): NOTE [Stealing a fresh grad] (nodes/accumulate.py)
// ---------------------------------------------------------------------------
StorageSet::StorageSet(const py::list& tensors) {
  for (const auto& item : tensors) {
    if (THPVariable_Check(item.ptr())) {
      add(THPVariable_Unpack(item.ptr()));
    }
  }
}

// A sparse COO tensor has no storage of its own: its memory is its indices' and values'
// (AccumulateGrad steals a sparse grad by taking those two, eager's case 1.2), so those are
// what is added and looked up. Any other tensor without storage counts as one of the set.
static const at::SparseTensorImpl* sparse_impl(const at::Tensor& t) {
  return t.layout() == at::kSparse ? dynamic_cast<const at::SparseTensorImpl*>(t.unsafeGetTensorImpl()) : nullptr;
}

void StorageSet::add(const at::Tensor& t) {
  if (const auto* sparse = sparse_impl(t)) {
    add(sparse->indices());
    add(sparse->values());
    return;
  }
  if (t.has_storage() && ids.insert(t.storage().unsafeGetStorageImpl()).second) {
    refs.push_back(t.storage().getWeakStorageImpl());
  }
}

bool StorageSet::contains(const at::Tensor& t) const {
  if (const auto* sparse = sparse_impl(t)) {
    return contains(sparse->indices()) || contains(sparse->values());
  }
  return !t.has_storage() || ids.count(t.storage().unsafeGetStorageImpl()) > 0;
}

// ---------------------------------------------------------------------------
// Applier (capture.h)
// ---------------------------------------------------------------------------

// NOTE [Hooks and nodes run without the GIL]
// The engine calls hooks and nodes without the GIL; a Python hook or a custom Function's
// node takes it itself (PyFunctionTensorPreHook, PyNode::apply). Ours are called from the
// graph's Python code, which holds it, so they run inside `without_gil`, as the engine runs
// them. With the GIL held, a C++ hook could deadlock: DDP's reducer hook enqueues a bucket's
// allreduce under ProcessGroupGloo's work mutex, which a gloo worker holds while it frees a
// finished work whose tensors have Python objects, for which it waits for the GIL. Found as
// a gloo timeout on the other rank, about one run in five of the DDP tests under load
// (tests/test_distributed.py); both ranks' stacks showed one rank inside a reducer hook
// called from the graph.
template <class F>
static auto without_gil(F&& f) {
  py::gil_scoped_release no_gil;
  return f();
}

std::vector<std::optional<at::Tensor>> Applier::call_tensor_pre_hooks(
    size_t idx,
    const std::vector<std::optional<at::Tensor>>& inputs) {
  auto& fn = g_.nodes_.at(idx).fn;
  variable_list values = to_variables(inputs);
  without_gil([&] {
    for (const auto& hook : fn->tensor_pre_hooks()) {
      values = (*hook)(values);
    }
    for (const auto& pair : fn->retains_grad_hooks()) {
      values = (*pair.second)(values);
    }
    return 0;
  });
  return from_variables(values);
}

std::vector<std::optional<at::Tensor>> Applier::call_pre_hooks(
    size_t idx,
    const std::vector<std::optional<at::Tensor>>& inputs) {
  auto& fn = g_.nodes_.at(idx).fn;
  variable_list values = to_variables(inputs);
  without_gil([&] {
    for (const auto& hook : fn->pre_hooks()) {
      values = (*hook)(values);
    }
    return 0;
  });
  return from_variables(values);
}

std::vector<std::optional<at::Tensor>> Applier::call_post_hooks(
    size_t idx,
    const std::vector<std::optional<at::Tensor>>& outputs,
    const std::vector<std::optional<at::Tensor>>& inputs) {
  auto& fn = g_.nodes_.at(idx).fn;
  variable_list outs = to_variables(outputs);
  variable_list ins = to_variables(inputs);
  without_gil([&] {
    for (const auto& hook : fn->post_hooks()) {
      outs = (*hook)(outs, ins);
    }
    return 0;
  });
  return from_variables(outs);
}

// Run node idx as the engine would (its own apply, then validate_outputs).
std::vector<std::optional<at::Tensor>> Applier::call_node(
    size_t idx,
    const std::vector<std::optional<at::Tensor>>& inputs) {
  auto& fn = g_.nodes_.at(idx).fn;
  at::AutoGradMode grad_mode(g_.grad_mode); // the engine's: create_graph (NOTE [create_graph with an opaque node])
  variable_list in = to_variables(inputs);
  variable_list outs = without_gil([&] { return (*fn)(std::move(in)); });
  return tracer_.validate(idx, from_variables(outs));
}

// AccumulateGrad itself (layout contract, stealing, in-place accumulation,
// post-accumulate-grad hooks), in the graph (with its leaf's tensor hooks first, `hooked`), of the graph's
// buffer `grad`: when its storage is none of the graph inputs' (`inputs`, a StorageSet;
// none: never), AccumulateGrad gets a new tensor on it that nothing else refers to, which
// it may steal as eager's does; else the graph's own tensor, which it copies (NOTE
// [Stealing a fresh grad] in nodes/accumulate.py). One call, no Python tensor made for the new one.
void Applier::accumulate_graph_grad(size_t idx, const at::Tensor& grad, bool hooked, const StorageSet* inputs) {
  at::Tensor given = (inputs != nullptr && !g_.grad_mode && !inputs->contains(grad)) ? grad.detach() : grad; // (create_graph: its history kept)
  if (hooked) {
    hooked_accumulate_tensor(idx, std::move(given));
    return;
  }
  at::AutoGradMode grad_mode(g_.grad_mode); // the engine's: create_graph (AccumulateGrad clones under it)
  variable_list in;
  in.emplace_back(std::move(given));
  without_gil([&] { return (*g_.nodes_.at(idx).fn)(std::move(in)); });
}

// A leaf's tensor hooks, then its AccumulateGrad, as the engine runs them in one step
// (NOTE [A leaf's hooks and its accumulation in one call] in nodes/accumulate.py).
void Applier::hooked_accumulate_tensor(size_t idx, at::Tensor grad) {
  auto& fn = g_.nodes_.at(idx).fn;
  variable_list values;
  values.emplace_back(std::move(grad));
  without_gil([&] {
    for (const auto& hook : fn->tensor_pre_hooks()) {
      values = (*hook)(values);
    }
    for (const auto& pair : fn->retains_grad_hooks()) {
      values = (*pair.second)(values);
    }
    if (values.empty() || !values[0].defined()) {
      return 0;
    }
    at::AutoGradMode grad_mode(g_.grad_mode);
    (*fn)(std::move(values));
    return 0;
  });
}

// Accumulate the graph's results for the nodes listed in `acc` (node index,
// result index), dropping Python's references first so that AccumulateGrad
// may steal the buffer as eager does. Returns the results of grad().
std::vector<std::optional<at::Tensor>> Applier::apply_results(
    py::list results,
    const std::vector<std::pair<size_t, size_t>>& acc,
    const std::vector<int64_t>& captured) {
  at::AutoGradMode grad_mode_guard(g_.grad_mode); // AccumulateGrad clones and adds out of place under create_graph
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
    without_gil([&] { return (*g_.nodes_.at(node_idx).fn)(std::move(in)); });
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
void Applier::release() {
  for (auto& r : g_.nodes_) {
    if (r.execute) {
      r.fn->release_variables();
    }
  }
}

// Free the saved variables of these executed nodes (Plan.releases: a node's, once no
// call left in the graph may read them).
void Applier::release_nodes(const std::vector<int64_t>& idxs) {
  for (auto i : idxs) {
    auto& r = g_.nodes_.at(static_cast<size_t>(i));
    if (r.execute) {
      r.fn->release_variables();
    }
  }
}

// Drop our references to the lifted tensors (they were handed to the
// compiled graph, which frees each at its last use).
// `keep_args`: remember where each one's TensorArg is, so that a backward resumed on real
// tensors after the graph stopped at a call can still give the nodes' saved variables the
// lifted tensors (Tracer::begin_trace; NOTE [A call output not as traced] in capture/resume.py).
void Applier::drop_lifted(bool keep_args) {
  auto& args = g_.call_.tensor_args;
  if (keep_args && !args.inputs.empty()) {
    g_.lifted_args_.clear();
    for (const auto& t : args.inputs) {
      g_.lifted_args_.push_back(&args.lookup(t));
    }
  }
  std::vector<at::Tensor>().swap(args.inputs);
}

// Whether user code run at node `idx` (stage 0: its tensor pre-hooks, 1: its
// pre-hooks, 2: the node or its post hooks) gave hooks to a node this backward
// has not reached, of a kind that node had none of: the graph has no call for
// them (eager would run them). Hooks added where a call exists run with it (the
// call runs the node's hooks as they are then), and removed ones are skipped.
bool Applier::hooks_added(size_t idx, int stage) const {
  for (size_t j = idx; j < g_.nodes_.size(); ++j) {
    const auto& r = g_.nodes_[j];
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
bool Applier::will_execute(py::handle obj) const {
  const Node* fn = nullptr;
  if (THPFunction_Check(obj.ptr())) {
    fn = node_of(reinterpret_cast<THPFunction*>(obj.ptr())).get();
  } else if (torch::autograd::THPCppFunction_Check(obj.ptr())) {
    fn = reinterpret_cast<torch::autograd::THPCppFunction*>(obj.ptr())->cdata.get();
  }
  TORCH_CHECK(fn != nullptr, "_will_engine_execute_node expects a grad_fn");
  const CollectedGraph::NodeInfo* info = g_.info_.find(fn);
  if (info == nullptr) {
    return false;
  }
  return !g_.filtered_ || (info->index >= 0 && g_.nodes_[info->index].execute);
}

// ---------------------------------------------------------------------------
// The call from compiled code (NOTE [Calls in the helper] in calls/kernel.py):
// kernel._run_call's steps for AccumulateGrad, hook and opaque-node calls, without
// a Python frame; an unpack call, and every case these steps do not cover, goes
// to the Python functions installed here.
// ---------------------------------------------------------------------------
struct ReplayFrame {
  py::tuple frame; // protocol.ReplayFrame (its fields by name: CallFallbacks::frame_at)
  GraphWalk* capture;
  StorageSet* steal; // nullptr: never steal
  c10::DispatchKeySet outside; // the dispatch keys the backward call excluded
  py::list last; // kernel._replay.last: the slot of the last call, at index `pos`
  Py_ssize_t pos;
};

static thread_local std::vector<ReplayFrame> replay_frames;

// A slot kind's row, as the helper follows it (values.SlotKind, read by field name)
struct CallKindRow {
  py::object name;
  int how; // CallHow (`native`): what it runs (run_row)
  int stage; // where in its node's steps it runs (GraphWalk::hooks_added)
  bool accumulates; // hands its grad to AccumulateGrad, returns nothing
  bool new_grads_go_nowhere; // an output where the trace had None is dropped, not an error
};

// Where each field of a Python NamedTuple the helper reads is, by name: given by install_calls
// from the NamedTuple's own `_fields` (values.Slot, protocol.ReplayFrame), never assumed.
struct Fields {
  std::unordered_map<std::string, Py_ssize_t> at;
  Py_ssize_t operator[](const char* name) const {
    auto it = at.find(name);
    TORCH_CHECK(it != at.end(), "compiled_autograd: the helper reads a field '", name, "' Python's tuple has not");
    return it->second;
  }
  void read(py::handle fields) {
    at.clear();
    Py_ssize_t i = 0;
    for (auto f : py::tuple(py::reinterpret_borrow<py::object>(fields))) {
      at[f.cast<std::string>()] = i++;
    }
  }
};

struct CallFallbacks {
  py::object direct; // calls/kernel.py _direct: any call not on the fast path
  py::object call; // calls/kernel.py call: a call on the fast path these steps do not take
  std::vector<CallKindRow> kinds; // the rows of the kinds the helper runs
  std::vector<at::ScalarType> dtypes; // protocol.DTYPES
  std::vector<c10::DeviceType> device_types; // protocol.DEVICE_TYPES
  PyObject* parameter_class = nullptr; // torch.nn.Parameter: plain, as torch.Tensor is
  py::object check_versions, check_ctx, hooks_added_error, shared_modified_error, still_empty_error, conform;
  // the fields of values.Slot and protocol.ReplayFrame the helper reads
  Py_ssize_t slot_kind, slot_node, slot_mask, slot_in_flags, slot_fresh, slot_n_after, slot_shared, slot_n_watch, slot_at,
      slot_rebuild, slot_by_reference, slot_n_resume;
  Py_ssize_t frame_walk, frame_slots, frame_steal, frame_keep, frame_versions, frame_ctx, frame_releases;
};

static CallFallbacks& fallbacks() {
  static auto* f = new CallFallbacks(); // never destroyed: no Python objects freed at exit
  return *f;
}

void install_calls(py::dict fns) {
  auto& f = fallbacks();
  f.direct = fns["direct"];
  f.call = fns["call"];
  Fields kind;
  kind.read(fns["kind_fields"]);
  f.kinds.clear();
  for (auto k : py::list(fns["kinds"])) { // values.SlotKind rows
    py::tuple row = py::reinterpret_borrow<py::tuple>(k);
    f.kinds.push_back(CallKindRow{
        py::reinterpret_borrow<py::object>(row[kind["name"]]),
        row[kind["native"]].cast<int>(),
        row[kind["stage"]].cast<int>(),
        PyObject_IsTrue(row[kind["accumulates"]].ptr()) == 1,
        PyObject_IsTrue(row[kind["new_grads_go_nowhere"]].ptr()) == 1});
  }
  f.dtypes.clear();
  for (auto d : py::list(fns["dtypes"])) {
    f.dtypes.push_back(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
  }
  f.device_types.clear();
  for (auto d : py::list(fns["device_types"])) {
    f.device_types.push_back(c10::Device(d.cast<std::string>()).type());
  }
  f.parameter_class = py::object(fns["parameter_class"]).release().ptr(); // (kept: never freed)
  f.check_versions = fns["check_versions"];
  f.check_ctx = fns["check_ctx"];
  f.hooks_added_error = fns["hooks_added_error"];
  f.shared_modified_error = fns["shared_modified_error"];
  f.still_empty_error = fns["still_empty_error"];
  f.conform = fns["conform"];
  Fields slot, frame;
  slot.read(fns["slot_fields"]);
  frame.read(fns["frame_fields"]);
  f.slot_kind = slot["kind"], f.slot_node = slot["node"], f.slot_mask = slot["mask"], f.slot_in_flags = slot["in_flags"];
  f.slot_fresh = slot["fresh"], f.slot_n_after = slot["n_after"], f.slot_shared = slot["shared"], f.slot_n_watch = slot["n_watch"];
  f.slot_at = slot["at"], f.slot_rebuild = slot["rebuild"], f.slot_by_reference = slot["by_reference"];
  f.slot_n_resume = slot["n_resume"];
  f.frame_walk = frame["walk"], f.frame_slots = frame["slots"], f.frame_steal = frame["steal"], f.frame_keep = frame["keep"];
  f.frame_versions = frame["versions"], f.frame_ctx = frame["ctx"], f.frame_releases = frame["releases"];
}

void push_replay(py::tuple frame, py::list last) {
  auto& fb = fallbacks();
  py::object steal = frame[fb.frame_steal];
  replay_frames.push_back(ReplayFrame{
      frame,
      frame[fb.frame_walk].cast<GraphWalk*>(),
      steal.is_none() ? nullptr : steal.cast<StorageSet*>(),
      c10::impl::tls_local_dispatch_key_set().excluded_,
      last,
      PyList_GET_SIZE(last.ptr()) - 1});
}

void pop_replay() {
  TORCH_CHECK(!replay_frames.empty(), "compiled_autograd: no replay to leave");
  replay_frames.pop_back();
}

static const at::Tensor& tensor_at(PyObject* list, Py_ssize_t i) {
  return THPVariable_Unpack(PyList_GET_ITEM(list, i));
}

static py::object wrap(at::Tensor t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
}

// The row of a slot kind the helper runs; nullptr for a kind it leaves to Python
static const CallKindRow* call_kind(py::handle kind) {
  const auto& kinds = fallbacks().kinds;
  for (const auto& row : kinds) {
    if (kind.ptr() == row.name.ptr()) {
      return &row;
    }
  }
  for (const auto& row : kinds) {
    if (kind.equal(row.name)) {
      return &row;
    }
  }
  return nullptr;
}

// What a row runs (its CallHow), on the call's defined arguments: the one place the helper
// chooses by kind. An accumulation returns nothing.
static std::vector<std::optional<at::Tensor>> run_row(
    const CallKindRow& row,
    GraphWalk& capture,
    size_t node,
    std::vector<std::optional<at::Tensor>>& inputs,
    size_t n_mask,
    const StorageSet* steal) {
  switch (row.how) {
    case CALL_TENSOR_PRE_HOOKS:
      return capture.call_tensor_pre_hooks(node, inputs);
    case CALL_PRE_HOOKS:
      return capture.call_pre_hooks(node, inputs);
    case CALL_POST_HOOKS: { // (its node's outputs, then its inputs)
      auto split = inputs.begin() + static_cast<std::ptrdiff_t>(n_mask);
      return capture.call_post_hooks(
          node, std::vector<std::optional<at::Tensor>>(inputs.begin(), split), std::vector<std::optional<at::Tensor>>(split, inputs.end()));
    }
    case CALL_NODE:
      return capture.call_node(node, inputs);
    case CALL_ACCUMULATE:
    case CALL_HOOKED_ACCUMULATE:
      // (a second argument: its definedness, a bool tensor: accumulate.accumulate)
      if (!inputs.empty() && inputs[0].has_value() &&
          (inputs.size() < 2 || !inputs[1].has_value() || inputs[1]->item<bool>())) {
        capture.accumulate_graph_grad(node, *inputs[0], row.how == CALL_HOOKED_ACCUMULATE, steal);
      }
      return {};
    default:
      TORCH_CHECK(false, "compiled_autograd: no native call for CallHow ", row.how);
  }
}

// Whether `t` (ours) is the only reference to its tensor and storage (kernel._sole_owner). A
// tensor made in Python keeps its PyObject while C++ refers to it (that PyObject's reference
// counts in use_count, and the PyObject is referenced by the tensor while use_count > 1):
// then it is ours alone when nothing in Python refers to that PyObject.
//
// That convention is torch 2.13's (NOTE [Torch versions]): it is checked once, on a tensor
// whose PyObject only this function refers to; where it does not hold (a PyObject counts
// only its Python references), a tensor with a PyObject is never judged ours alone.
bool pyobj_held_by_tensor() {
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

// kernel._is_plain: a tensor made in C++ (no Python object), or one whose Python object is a
// torch.Tensor or a Parameter: no subclass of any kind
static bool is_plain(const at::Tensor& t) {
  PyObject* obj = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  return obj == nullptr ? !t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python)
                        : (Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
                           Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(fallbacks().parameter_class));
}

// The outputs of a hook or node call as the graph expects them, where each is as traced: per
// output traced as defined (`mask`), the tensor, copied unless the graph's code is its only
// owner or it is one of `keep`; zeros where it is None; then, with DEFINEDNESS, which were
// defined. Anything else -- an output of another type, shape, dtype, device or layout, with a
// lazy conj/neg bit, or a grad where the trace had None -- goes, untouched, to kernel._conform,
// the one place of the rules for what is not as traced (it copies, stops the graph, or raises:
// NOTE [A call output not as traced] in capture/resume.py). `args` and `values`: the call's
// arguments and what the graph holds at it, should it stop there.
static py::list conform(
    const CallKindRow& row,
    int64_t slot,
    py::handle mask,
    std::vector<std::optional<at::Tensor>> outs,
    const std::vector<at::Tensor>& keep,
    const py::list& meta_list,
    int64_t flags,
    const std::vector<PyObject*>& args,
    const py::object& values) {
  auto& fb = fallbacks();
  auto n_mask = static_cast<size_t>(PyTuple_GET_SIZE(mask.ptr()));
  if (outs.size() < n_mask) {
    outs.resize(n_mask);
  }
  auto metas = decode_meta(meta_list, fb.dtypes, fb.device_types);
  bool as_traced = true;
  for (size_t i = 0, k = 0; i < n_mask && as_traced; ++i) {
    bool traced = PyTuple_GET_ITEM(mask.ptr(), i) == Py_True;
    bool defined = outs[i].has_value() && outs[i]->defined();
    if (!traced) {
      as_traced = !defined || row.new_grads_go_nowhere; // (a node's grad where the trace had none goes nowhere)
      continue;
    }
    const OutputMeta& m = metas.at(k++);
    if (defined) {
      const at::Tensor& o = *outs[i];
      as_traced = is_plain(o) && o.sizes() == c10::IntArrayRef(m.shape) && o.scalar_type() == m.dtype && o.device() == m.device &&
          !o.is_conj() && !o.is_neg() && m.has_layout(o);
    }
  }
  if (!as_traced) {
    py::list given, kept, call_args;
    for (auto& o : outs) {
      given.append(o.has_value() && o->defined() ? wrap(std::move(*o)) : py::none());
    }
    outs.clear();
    for (const auto& t : keep) {
      kept.append(wrap(t));
    }
    for (PyObject* a : args) {
      call_args.append(py::handle(a));
    }
    return fb.conform(slot, given, kept, meta_list, flags, call_args, values);
  }
  py::list result;
  std::vector<bool> present;
  for (size_t i = 0, k = 0; i < n_mask; ++i) {
    if (PyTuple_GET_ITEM(mask.ptr(), i) != Py_True) {
      continue;
    }
    const OutputMeta& m = metas.at(k++);
    if (!outs[i].has_value() || !outs[i]->defined()) {
      present.push_back(false);
      result.append(wrap(m.empty().zero_()));
      continue;
    }
    at::Tensor o = std::move(*outs[i]);
    outs[i].reset();
    present.push_back(true);
    bool kept = std::any_of(keep.begin(), keep.end(), [&](const at::Tensor& a) {
      return a.unsafeGetTensorImpl() == o.unsafeGetTensorImpl();
    });
    if (!kept && !sole_owner(o)) {
      o = o.clone();
    }
    result.append(wrap(std::move(o)));
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

// One call as `direct` takes it: its slot's fields and where its arguments are (NOTE [The
// layout of a call's arguments], capture/lint.py): the call's own (then, with in_flags, which
// are defined), n_after that only order it, n_watch saved tensors it checks, n_resume values
// the graph holds at it, n_passed graph inputs it returns.
struct CallSite {
  ReplayFrame f;
  const CallKindRow* row;
  py::tuple slot_row;
  int64_t slot;
  py::list args;
  int64_t flags;
  py::handle kind_obj, mask;
  py::object node_obj;
  size_t node = 0;
  py::tuple shared = py::tuple(0);
  Py_ssize_t n_watch = 0, n_passed = 0, end_watch = 0, end_resume = 0;
  bool stops = false; // the call can stop its graph (Slot.n_resume >= 0)
  std::vector<PyObject*> given; // its own arguments, None where undefined
};

// The call site, or nullopt where the call goes to Python (a kind the helper does not run,
// other excluded dispatch keys, subclass arguments, values passed by reference).
static std::optional<CallSite> call_site(int64_t slot, py::list args, int64_t flags) {
  auto& fb = fallbacks();
  ReplayFrame f = replay_frames.back(); // (a copy: a hook's nested backward pushes and pops frames)
  py::tuple s = py::reinterpret_borrow<py::tuple>(py::handle(f.frame[fb.frame_slots])[py::int_(slot)]);
  const CallKindRow* row = call_kind(s[fb.slot_kind]);
  if (row == nullptr || c10::impl::tls_local_dispatch_key_set().excluded_ != f.outside ||
      PyObject_IsTrue(s[fb.slot_rebuild].ptr()) || PyObject_IsTrue(s[fb.slot_by_reference].ptr()) ||
      !PyTuple_Check(py::handle(s[fb.slot_mask]).ptr())) {
    return std::nullopt;
  }
  CallSite c{f, row, s, slot, args, flags, s[fb.slot_kind], s[fb.slot_mask], s[fb.slot_node]};
  c.node = c.node_obj.cast<size_t>();
  c.shared = s[fb.slot_shared];
  c.n_watch = s[fb.slot_n_watch].cast<Py_ssize_t>();
  auto n_resume = s[fb.slot_n_resume].cast<Py_ssize_t>(); // (-1: the call cannot stop the graph)
  c.stops = n_resume >= 0;
  c.n_passed = flags >> kPassesShift;
  c.end_resume = PyList_GET_SIZE(args.ptr()) - c.n_passed;
  c.end_watch = c.end_resume - std::max<Py_ssize_t>(n_resume, 0);
  Py_ssize_t n = c.end_watch - c.n_watch - s[fb.slot_n_after].cast<Py_ssize_t>();
  if (PyObject_IsTrue(s[fb.slot_in_flags].ptr())) {
    at::Tensor defined = tensor_at(args.ptr(), n - 1).to(at::kCPU).to(at::kBool).contiguous();
    const bool* d = defined.data_ptr<bool>();
    for (Py_ssize_t i = 0; i < n - 1; ++i) {
      c.given.push_back(d[i] ? PyList_GET_ITEM(args.ptr(), i) : Py_None);
    }
  } else {
    for (Py_ssize_t i = 0; i < n; ++i) {
      c.given.push_back(PyList_GET_ITEM(args.ptr(), i));
    }
  }
  return c;
}

// The call's row run on its arguments, its outputs as the graph expects them (kernel.call's
// steps from the row to _conform).
static py::list run_site(CallSite& c, py::list meta) {
  auto& fb = fallbacks();
  std::vector<std::optional<at::Tensor>> inputs;
  std::vector<Py_ssize_t> refcounts; // a hook that keeps its grad: never steal it (kernel.call)
  for (PyObject* a : c.given) {
    inputs.emplace_back(a == Py_None ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(a)));
    refcounts.push_back(Py_REFCNT(a));
  }
  bool fresh = PyObject_IsTrue(c.slot_row[fb.slot_fresh].ptr());
  auto results = run_row(*c.row, *c.f.capture, c.node, inputs, static_cast<size_t>(PyTuple_GET_SIZE(c.mask.ptr())), fresh ? c.f.steal : nullptr);
  if (c.row->accumulates) {
    return py::list();
  }
  if (c.f.steal != nullptr) {
    for (size_t i = 0; i < c.given.size(); ++i) {
      if (c.given[i] != Py_None && Py_REFCNT(c.given[i]) > refcounts[i]) {
        c.f.steal->add(*inputs[i]);
      }
    }
  }
  std::vector<at::Tensor> keep; // the call's inputs nothing else in the graph reads (kernel._run_and_conform)
  if (PyObject_IsTrue(c.f.frame[fb.frame_keep].ptr()) && (c.flags & kKeepsInputs)) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      bool is_shared = std::any_of(c.shared.begin(), c.shared.end(), [&](py::handle j) { return j.cast<size_t>() == i; });
      if (inputs[i].has_value() && !is_shared) {
        keep.push_back(*inputs[i]);
      }
    }
  }
  inputs.clear();
  py::object values = py::none();
  if (c.stops) {
    py::list held;
    for (Py_ssize_t i = c.end_watch; i < c.end_resume; ++i) {
      held.append(py::handle(PyList_GET_ITEM(c.args.ptr(), i)));
    }
    values = held;
  }
  return conform(*c.row, c.slot, c.mask, std::move(results), keep, meta, c.flags, c.given, values);
}

// What kernel.call checks after the call: hooks added, saved tensors and ctx values changed,
// shared arguments changed in place (`before`: their versions); then the nodes it releases.
static void check_after(CallSite& c, const std::vector<int64_t>& before) {
  auto& fb = fallbacks();
  py::handle capture = c.f.frame[fb.frame_walk];
  if (c.f.capture->hooks_added(c.node, c.row->stage)) {
    fb.hooks_added_error(c.kind_obj, capture, c.node_obj);
  }
  if (c.n_watch > 0) {
    py::list expected = py::handle(c.f.frame[fb.frame_versions])[py::int_(c.slot)];
    Py_ssize_t start = c.end_watch - c.n_watch;
    for (Py_ssize_t k = 0; k < c.n_watch; ++k) {
      if (tensor_at(c.args.ptr(), start + k)._version() != expected[k].cast<int64_t>()) {
        py::list watched;
        for (Py_ssize_t j = 0; j < c.n_watch; ++j) {
          watched.append(py::handle(PyList_GET_ITEM(c.args.ptr(), start + j)));
        }
        fb.check_versions(watched, expected); // raises eager's error
      }
    }
  }
  py::handle ctx = c.f.frame[fb.frame_ctx];
  if (!ctx.is_none() && PyDict_Contains(ctx.ptr(), py::int_(c.slot).ptr()) == 1) {
    fb.check_ctx(ctx[py::int_(c.slot)]);
  }
  size_t k = 0;
  for (auto i : c.shared) {
    PyObject* a = c.given.at(i.cast<size_t>());
    if (a != Py_None && THPVariable_Unpack(a)._version() != before[k]) {
      fb.shared_modified_error(c.kind_obj, capture, c.node_obj);
    }
    ++k;
  }
  py::handle releases = c.f.frame[fb.frame_releases];
  if (!releases.is_none() && PyDict_Contains(releases.ptr(), py::int_(c.slot).ptr()) == 1) {
    c.f.capture->release_nodes(releases[py::int_(c.slot)].cast<std::vector<int64_t>>());
  }
}

py::object direct(int64_t slot, py::list args, py::list meta, int64_t flags) {
  auto& fb = fallbacks();
  if (at::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return fb.direct(slot, args, meta, flags);
  }
  std::optional<CallSite> site = replay_frames.empty() ? std::nullopt : call_site(slot, args, flags);
  if (!site) {
    return fb.call(slot, args, meta, flags);
  }
  CallSite& c = *site;
  // the slot of the last call (kernel._replay.last); the engine runs each node in the
  // backward's grad mode (kernel.call)
  py::handle slots = c.f.frame[fb.frame_slots];
  PyObject* last = PyList_GET_ITEM(c.f.last.ptr(), c.f.pos);
  bool new_node = last == Py_None ||
      !py::handle(c.slot_row[fb.slot_at]).equal(py::handle(PyTuple_GET_ITEM(slots[py::handle(last)].ptr(), fb.slot_at)));
  PyList_SetItem(c.f.last.ptr(), c.f.pos, py::int_(slot).inc_ref().ptr());
  if (new_node && at::GradMode::is_enabled() != c.f.capture->grad_mode) {
    at::GradMode::set_enabled(c.f.capture->grad_mode);
  }
  std::vector<int64_t> before;
  for (auto i : c.shared) {
    PyObject* a = PyList_GET_ITEM(args.ptr(), i.cast<Py_ssize_t>());
    before.push_back(a == Py_None ? 0 : THPVariable_Unpack(a)._version());
  }
  py::list outs = run_site(c, meta);
  check_after(c, before);
  bool keep_passed = PyObject_IsTrue(c.f.frame[fb.frame_keep].ptr());
  for (Py_ssize_t i = c.end_resume; i < c.end_resume + c.n_passed; ++i) {
    // graph inputs read after the call, as it leaves them; a user's backend may reuse an
    // output's buffer: a copy
    PyObject* t = PyList_GET_ITEM(args.ptr(), i);
    const at::Tensor& passed = THPVariable_Unpack(t);
    if (passed.numel() > 0 && passed.storage().nbytes() == 0) {
      // NOTE [Tensors whose data arrives during the backward]: no hook refilled it
      fb.still_empty_error(c.kind_obj, py::handle(c.f.frame[fb.frame_walk]), c.node_obj);
    }
    outs.append(keep_passed ? py::reinterpret_borrow<py::object>(t) : wrap(passed.clone()));
  }
  return outs;
}

} // namespace compiled_autograd_native
