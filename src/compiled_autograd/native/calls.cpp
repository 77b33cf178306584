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
  at::NoGradGuard no_grad;
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
  at::Tensor given = (inputs != nullptr && !inputs->contains(grad)) ? grad.detach() : grad;
  if (hooked) {
    hooked_accumulate_tensor(idx, std::move(given));
    return;
  }
  at::NoGradGuard no_grad;
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
    at::NoGradGuard no_grad;
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
void Applier::drop_lifted() {
  std::vector<at::Tensor>().swap(g_.call_.tensor_args.inputs);
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
  py::tuple frame; // protocol.ReplayFrame: (capture, slots, outside, hooks, steal, keep, versions, ctx, releases, observed) (FrameField)
  GraphCapture* capture;
  StorageSet* steal; // nullptr: never steal
  c10::DispatchKeySet outside; // the dispatch keys the backward call excluded
  py::list last; // kernel._replay.last: the slot of the last call, at index `pos`
  Py_ssize_t pos;
};

static thread_local std::vector<ReplayFrame> replay_frames;

// A slot kind's row, as the helper follows it (values.SlotKind: its name, native, stage)
struct CallKindRow {
  py::object name;
  int how; // CallHow
  int stage; // where in its node's steps it runs (GraphCapture::hooks_added)
};

struct CallFallbacks {
  py::object call_direct; // calls/kernel.py call_direct: any call not on the fast path
  py::object run_call; // calls/kernel.py _run_call: a call on the fast path these steps do not take
  std::vector<CallKindRow> kinds; // the rows of the kinds the helper runs
  std::vector<at::ScalarType> dtypes; // protocol.DTYPES
  std::vector<c10::DeviceType> device_types; // protocol.DEVICE_TYPES
  py::object check_versions, check_ctx, hooks_added_error, shared_modified_error, still_empty_error, conform_error, observed_layout, conformed;
};

static CallFallbacks& fallbacks() {
  static auto* f = new CallFallbacks(); // never destroyed: no Python objects freed at exit
  return *f;
}

void install_calls(py::dict fns) {
  auto& f = fallbacks();
  f.call_direct = fns["call_direct"];
  f.run_call = fns["run_call"];
  f.kinds.clear();
  for (auto k : py::list(fns["kinds"])) {
    py::tuple row = py::reinterpret_borrow<py::tuple>(k);
    f.kinds.push_back(CallKindRow{py::reinterpret_borrow<py::object>(row[0]), row[1].cast<int>(), row[2].cast<int>()});
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
  f.still_empty_error = fns["still_empty_error"];
  f.conform_error = fns["conform_error"];
  f.observed_layout = fns["observed_layout"];
  f.conformed = fns["conformed"];
}

void push_replay(py::tuple frame, py::list last) {
  py::object steal = frame[FrameField::STEAL];
  replay_frames.push_back(ReplayFrame{
      frame,
      frame[FrameField::CAPTURE].cast<GraphCapture*>(),
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

// The row of a slot kind the helper runs: (how, stage); (CALL_PYTHON, -1) for any other
static std::pair<int, int> call_kind(py::handle kind) {
  const auto& kinds = fallbacks().kinds;
  for (const auto& row : kinds) {
    if (kind.ptr() == row.name.ptr()) {
      return {row.how, row.stage};
    }
  }
  for (const auto& row : kinds) {
    if (kind.equal(row.name)) {
      return {row.how, row.stage};
    }
  }
  return {CALL_PYTHON, -1};
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

// The outputs of a hook or node call as the graph expects them (kernel._conform): per output
// traced as defined (`mask`), the tensor, in the traced layout (copied into it, and its own
// layout reported to `observed`, where it had another: NOTE [Layouts of call outputs]) and
// without lazy conj/neg bits, copied unless the graph's code is its only owner or it is one
// of `keep`; zeros where it is None; then, with DEFINEDNESS, which were defined. Anything
// else: kernel._conform's error.
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
    fb.conform_error(kind_obj, py::handle(f.frame[FrameField::CAPTURE]), node_obj, mask, given, meta_list, flags);
    throw std::runtime_error("compiled_autograd: kernel._conform accepted what the helper did not");
  };
  if (outs.size() < n_mask) {
    outs.resize(n_mask);
  }
  auto metas = decode_meta(meta_list, fb.dtypes, fb.device_types);
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
      py::handle observed = f.frame[FrameField::OBSERVED];
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

py::object call_direct(int64_t slot, py::list args, py::list meta, int64_t flags) {
  auto& fb = fallbacks();
  if (at::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return fb.call_direct(slot, args, meta, flags);
  }
  auto python = [&]() { return fb.run_call(slot, args, meta, flags); };
  if (replay_frames.empty()) {
    return python();
  }
  ReplayFrame f = replay_frames.back(); // (a copy: a hook's nested backward pushes and pops frames)
  py::tuple s = py::reinterpret_borrow<py::tuple>(py::handle(f.frame[FrameField::SLOTS])[py::int_(slot)]);
  // values.Slot: (kind, node, mask, in_flags, fresh, n_after, shared, n_watch, at, rebuild, out_specs, by_reference) (SlotField)
  py::handle kind_obj = s[SlotField::KIND];
  auto [kind, stage] = call_kind(kind_obj);
  if (kind == CALL_PYTHON || c10::impl::tls_local_dispatch_key_set().excluded_ != f.outside) {
    return python();
  }
  if (PyTuple_GET_SIZE(s.ptr()) > static_cast<Py_ssize_t>(SlotField::REBUILD) && PyObject_IsTrue(s[SlotField::REBUILD].ptr())) {
    return python(); // tensor subclass arguments, rebuilt from their inner tensors (kernel._run_call)
  }
  if (PyTuple_GET_SIZE(s.ptr()) > static_cast<Py_ssize_t>(SlotField::BY_REFERENCE) &&
      PyObject_IsTrue(s[SlotField::BY_REFERENCE].ptr())) {
    return python(); // values passed by reference (kernel._run_call)
  }
  py::object node_obj = s[SlotField::NODE];
  auto node = node_obj.cast<size_t>();
  py::handle mask = s[SlotField::MASK];
  if (!PyTuple_Check(mask.ptr())) {
    return python();
  }
  bool in_flags = PyObject_IsTrue(s[SlotField::IN_FLAGS].ptr());
  bool fresh = PyObject_IsTrue(s[SlotField::FRESH].ptr());
  auto n_after = s[SlotField::N_AFTER].cast<Py_ssize_t>();
  py::tuple shared = s[SlotField::SHARED];
  auto n_watch = s[SlotField::N_WATCH].cast<Py_ssize_t>();
  // the arguments: the call's own (then, with in_flags, which are defined), n_after that
  // only order it, n_watch saved tensors it checks, n_passed graph inputs it returns
  Py_ssize_t n_passed = flags >> kPassesShift;
  Py_ssize_t end_watch = PyList_GET_SIZE(args.ptr()) - n_passed;
  Py_ssize_t n = end_watch - n_watch - n_after;
  // the slot of the last call (kernel._replay.last); the engine runs each node in the
  // backward's grad mode (kernel._run_call)
  py::object at_obj = s[SlotField::AT];
  PyObject* last = PyList_GET_ITEM(f.last.ptr(), f.pos);
  bool new_node = last == Py_None ||
      !at_obj.equal(py::handle(PyTuple_GET_ITEM(py::handle(f.frame[FrameField::SLOTS])[py::handle(last)].ptr(), SlotField::AT)));
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
    // (a second argument: its definedness, a bool tensor: accumulate.accumulate)
    bool defined = !given.empty() && given[0] != Py_None &&
        (given.size() < 2 || given[1] == Py_None || THPVariable_Unpack(given[1]).item<bool>());
    if (defined) {
      f.capture->accumulate_graph_grad(
          node, THPVariable_Unpack(given[0]), kind == CALL_HOOKED_ACCUMULATE, fresh ? f.steal : nullptr);
    }
  } else {
    std::vector<std::optional<at::Tensor>> inputs;
    std::vector<Py_ssize_t> refcounts; // a hook that keeps its grad: never steal it (kernel._run_call)
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
    std::vector<at::Tensor> keep; // the call's inputs nothing else in the graph reads (kernel._run_slot)
    if (PyObject_IsTrue(f.frame[FrameField::KEEP].ptr()) && (flags & kKeepsInputs)) {
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
  if (f.capture->hooks_added(node, stage)) {
    fb.hooks_added_error(kind_obj, py::handle(f.frame[FrameField::CAPTURE]), node_obj);
  }
  if (n_watch > 0) {
    py::list expected = py::handle(f.frame[FrameField::VERSIONS])[py::int_(slot)];
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
  py::handle ctx = f.frame[FrameField::CTX];
  if (!ctx.is_none() && PyDict_Contains(ctx.ptr(), py::int_(slot).ptr()) == 1) {
    fb.check_ctx(ctx[py::int_(slot)]);
  }
  size_t k = 0;
  for (auto i : shared) {
    PyObject* a = given.at(i.cast<size_t>());
    if (a != Py_None && THPVariable_Unpack(a)._version() != before[k]) {
      fb.shared_modified_error(kind_obj, py::handle(f.frame[FrameField::CAPTURE]), node_obj);
    }
    ++k;
  }
  py::handle releases = f.frame[FrameField::RELEASES];
  if (!releases.is_none() && PyDict_Contains(releases.ptr(), py::int_(slot).ptr()) == 1) {
    f.capture->release_nodes(releases[py::int_(slot)].cast<std::vector<int64_t>>());
  }
  bool keep_passed = PyObject_IsTrue(f.frame[FrameField::KEEP].ptr());
  for (Py_ssize_t i = end_watch; i < end_watch + n_passed; ++i) {
    // graph inputs read after the call, as it leaves them; a user's backend may reuse an
    // output's buffer: a copy
    PyObject* t = PyList_GET_ITEM(args.ptr(), i);
    const at::Tensor& passed = THPVariable_Unpack(t);
    if (passed.numel() > 0 && passed.storage().nbytes() == 0) {
      // NOTE [Tensors whose data arrives during the backward]: no hook refilled it
      fb.still_empty_error(kind_obj, py::handle(f.frame[FrameField::CAPTURE]), node_obj);
    }
    outs.append(keep_passed ? py::reinterpret_borrow<py::object>(t) : wrap(passed.clone()));
  }
  return outs;
}

} // namespace compiled_autograd_native
