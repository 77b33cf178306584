// compiled_autograd native helper.
//
// What Python cannot do with torch 2.13's autograd graph, this helper does:
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
// The Python side (capture/trace.py, runtime.py) drives these per node.
//
// The helper is built from these files, by stage (native/__init__.py builds
// them all; values.h mirrors the values Python defines, capture.h declares
// GraphWalk's parts):
//   collect.cpp  the walk, the key, the lifted tensors; the saved-tensor
//                hooks collected with them (NOTE [One key per graph]);
//   trace.cpp    trace support (Tracer, PyNodeSavedSwap);
//   calls.cpp    the calls from compiled code (Applier, direct);
//   module.cpp   this file: the Python module.

#include "capture.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using compiled_autograd_native::GraphWalk;
  m.def("tensor_key", &compiled_autograd_native::tensor_key);
  m.def("install_calls", &compiled_autograd_native::install_calls);
  m.def("push_replay", &compiled_autograd_native::push_replay);
  m.def("pop_replay", &compiled_autograd_native::pop_replay);
  m.def("pyobj_held_by_tensor", &compiled_autograd_native::pyobj_held_by_tensor);
  m.def(
      "direct",
      &compiled_autograd_native::direct,
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
  py::class_<GraphWalk>(m, "GraphWalk", py::module_local())
      .def(
          py::init<
              const std::vector<py::handle>&,
              const std::vector<std::optional<at::Tensor>>&,
              const std::vector<py::handle>&,
              bool,
              bool>())
      .def_readonly("unsupported", &GraphWalk::unsupported)
      .def_readonly("opaque_subclasses", &GraphWalk::opaque_subclasses)
      .def("key", &GraphWalk::key)
      .def("lifted", &GraphWalk::lifted)
      .def("sizes", &GraphWalk::sizes)
      .def("num_size_inputs", &GraphWalk::num_size_inputs)
      .def("node_key_offsets", &GraphWalk::node_key_offsets)
      .def("num_nodes", &GraphWalk::num_nodes)
      .def("wrapped", &GraphWalk::wrapped)
      .def("num_results", &GraphWalk::num_results)
      .def("nodes", &GraphWalk::nodes)
      .def("node_object", &GraphWalk::node_object)
      .def("node_name", &GraphWalk::node_name)
      .def("pynode_indices", &GraphWalk::pynode_indices)
      .def("pynodes_have_saved_hooks", &GraphWalk::pynodes_have_saved_hooks)
      .def("accumulated_grads", &GraphWalk::accumulated_grads)
      .def("roots", &GraphWalk::roots)
      .def("input_metadata", &GraphWalk::input_metadata)
      .def("subclass_inputs", &GraphWalk::subclass_inputs)
      .def("take_saved_hooks", &GraphWalk::take_saved_hooks)
      .def("hand_over", &GraphWalk::hand_over)
      .def("hand_over_saved", &GraphWalk::hand_over_saved)
      .def("learn_unpacks", &GraphWalk::learn_unpacks)
      .def("restore_saved_hooks", &GraphWalk::restore_saved_hooks)
      .def("pynode_flags", &GraphWalk::pynode_flags)
      .def("pynode_output_info", &GraphWalk::pynode_output_info)
      .def("begin_trace", &GraphWalk::begin_trace)
      .def("root_values", &GraphWalk::root_values)
      .def("apply_node", &GraphWalk::apply_node)
      .def("validate", &GraphWalk::validate)
      .def("end_trace", &GraphWalk::end_trace)
      .def("call_tensor_pre_hooks", &GraphWalk::call_tensor_pre_hooks)
      .def("call_pre_hooks", &GraphWalk::call_pre_hooks)
      .def("call_post_hooks", &GraphWalk::call_post_hooks)
      .def("call_node", &GraphWalk::call_node)
      .def("accumulate_graph_grad", &GraphWalk::accumulate_graph_grad)
      .def("apply_results", &GraphWalk::apply_results)
      .def("release", &GraphWalk::release)
      .def("release_nodes", &GraphWalk::release_nodes)
      .def("will_execute", &GraphWalk::will_execute)
      .def("hooks_added", &GraphWalk::hooks_added)
      .def("drop_lifted", &GraphWalk::drop_lifted, py::arg("keep_args") = false)
      .def("clear", &GraphWalk::clear)
      .def_readwrite("grad_mode", &GraphWalk::grad_mode);
  py::class_<PyNodeSavedSwap>(m, "PyNodeSavedSwap", py::module_local())
      .def(py::init<py::object, const std::vector<std::optional<at::Tensor>>&>())
      .def("restore", &PyNodeSavedSwap::restore);
}
