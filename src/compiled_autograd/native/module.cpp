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
// GraphCapture's parts):
//   collect.cpp  the walk, the key, the lifted tensors; the saved-tensor
//                hooks collected with them (NOTE [One key per graph]);
//   trace.cpp    trace support (Tracer, PyNodeSavedSwap);
//   calls.cpp    the calls from compiled code (Applier, direct);
//   module.cpp   this file: the Python module.

#include "capture.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using compiled_autograd_native::GraphCapture;
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
  py::class_<GraphCapture>(m, "GraphCapture", py::module_local())
      .def(
          py::init<
              const std::vector<py::handle>&,
              const std::vector<std::optional<at::Tensor>>&,
              const std::vector<py::handle>&,
              bool,
              bool>())
      .def_readonly("unsupported", &GraphCapture::unsupported)
      .def_readonly("opaque_subclasses", &GraphCapture::opaque_subclasses)
      .def("key", &GraphCapture::key)
      .def("lifted", &GraphCapture::lifted)
      .def("sizes", &GraphCapture::sizes)
      .def("num_size_inputs", &GraphCapture::num_size_inputs)
      .def("node_key_offsets", &GraphCapture::node_key_offsets)
      .def("num_nodes", &GraphCapture::num_nodes)
      .def("wrapped", &GraphCapture::wrapped)
      .def("num_results", &GraphCapture::num_results)
      .def("nodes", &GraphCapture::nodes)
      .def("node_object", &GraphCapture::node_object)
      .def("node_name", &GraphCapture::node_name)
      .def("pynode_indices", &GraphCapture::pynode_indices)
      .def("pynodes_have_saved_hooks", &GraphCapture::pynodes_have_saved_hooks)
      .def("accumulated_grads", &GraphCapture::accumulated_grads)
      .def("roots", &GraphCapture::roots)
      .def("input_metadata", &GraphCapture::input_metadata)
      .def("subclass_inputs", &GraphCapture::subclass_inputs)
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
      .def("drop_lifted", &GraphCapture::drop_lifted, py::arg("keep_args") = false)
      .def("clear", &GraphCapture::clear)
      .def_readwrite("grad_mode", &GraphCapture::grad_mode);
  py::class_<PyNodeSavedSwap>(m, "PyNodeSavedSwap", py::module_local())
      .def(py::init<py::object, const std::vector<std::optional<at::Tensor>>&>())
      .def("restore", &PyNodeSavedSwap::restore);
}
