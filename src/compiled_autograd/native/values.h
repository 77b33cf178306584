// What the helper and Python hand each other, mirrored from its one definition
// in Python (values.py; the call's encoding: calls/protocol.py). Each definition here names its
// Python counterpart: a change there is a change here. Where C++ reads a
// Python tuple by position (or builds one Python reads by name), it uses the
// constants below, never a bare index.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

namespace compiled_autograd_native {

namespace py = pybind11;

// ---------------------------------------------------------------------------
// Node kinds, decided once per C++ type (values.NodeKind)
// ---------------------------------------------------------------------------
enum Kind : uint8_t {
  GENERIC = 0, // a node implementing compiled_args/apply_with_saved
  ACCUMULATE = 1, // AccumulateGrad
  PYNODE = 2, // custom autograd.Function (traced by Python)
  OPAQUE = 3, // always run eagerly inside the graph
};

// values.NodeRow: the fields of the tuple GraphWalk::nodes() makes per node,
// in values.NodeRow's order
struct NodeRowField {
  static constexpr size_t NAME = 0;
  static constexpr size_t KIND = 1;
  static constexpr size_t EXECUTE = 2;
  static constexpr size_t OPAQUE = 3;
  static constexpr size_t OPAQUE_REASON = 4;
  static constexpr size_t EDGES = 5;
  static constexpr size_t CAPTURES = 6;
  static constexpr size_t HOOKS = 7; // a values.Hooks (HooksField)
  static constexpr size_t NUM_INPUTS = 8;
  static constexpr size_t EDGE_SIZES = 9;
  static constexpr size_t SIZE_START = 10;
  static constexpr size_t COUNT = 11; // (the number of fields)
};

// values.Hooks: a NodeRow's hook counts, in values.Hooks' order
struct HooksField {
  static constexpr size_t TENSOR_PRE = 0;
  static constexpr size_t RETAINS = 1;
  static constexpr size_t PRE = 2;
  static constexpr size_t POST = 3;
  static constexpr size_t POST_ACCUMULATE = 4;
  static constexpr size_t COUNT = 5; // (the number of fields)
};

// torch.autograd.graph.GradientEdge (torch's, not ours): a root or an input
// given as (node, output_nr)
struct GradientEdgeField {
  static constexpr size_t NODE = 0;
  static constexpr size_t OUTPUT_NR = 1;
};

// ---------------------------------------------------------------------------
// The call protocol (protocol.CallArgs: slot, args, meta, flags)
// ---------------------------------------------------------------------------

// values.Slot and protocol.ReplayFrame are read by field name: install_calls is given each
// NamedTuple's `_fields` and finds the fields the helper reads there (calls.cpp Fields).

// The bits of a call's `flags` the helper reads (protocol.DEFINEDNESS, protocol.KEEPS_INPUTS,
// protocol.PASSES_SHIFT; the others it does not read)
static constexpr int64_t kDefinedness = 1, kKeepsInputs = 2, kPassesShift = 8;

// What the helper runs for a call (values.CallHow). Each slot kind's row in the one table
// (nodes/__init__.py SLOT_KINDS) names one, with the kind's stage; install_calls gets the rows
// of the kinds it runs (calls/kernel.py install_native), any other kind goes to Python.
enum CallHow : int {
  CALL_PYTHON = -1,
  CALL_TENSOR_PRE_HOOKS = 0,
  CALL_PRE_HOOKS = 1,
  CALL_POST_HOOKS = 2,
  CALL_NODE = 3,
  CALL_ACCUMULATE = 4,
  CALL_HOOKED_ACCUMULATE = 5
};

// protocol.encode_meta: per output of a call, these fields, then its shape, then its strides
struct MetaField {
  static constexpr Py_ssize_t RANK = 0;
  static constexpr Py_ssize_t DTYPE = 1;
  static constexpr Py_ssize_t DEVICE = 2;
  static constexpr Py_ssize_t LAYOUT = 3;
  static constexpr Py_ssize_t COUNT = 4; // (the number of fields: then the shape, then the strides)
};
// protocol.device_code: device type code * kDeviceCodeBase + (index + 1, 0 for none)
static constexpr int64_t kDeviceCodeBase = 1024;
// protocol.LAYOUTS: the layout codes
static constexpr int64_t kLayoutStrided = 0, kLayoutSparseCoo = 1;

// One output of a call as the graph was traced with it (values.OutputMeta), read from the
// call's `meta` argument (protocol.encode_meta: per output rank, dtype code, device code, layout
// code, shape, strides).
struct OutputMeta {
  std::vector<int64_t> shape, strides;
  at::ScalarType dtype;
  c10::Device device;
  bool sparse; // sparse COO (protocol.LAYOUTS[1]), else strided

  at::Tensor empty() const {
    auto options = at::TensorOptions().dtype(dtype).device(device);
    if (sparse) {
      return at::empty(shape, options.layout(at::kSparse));
    }
    return at::empty_strided(shape, strides, options);
  }
  // values.OutputMeta.has_layout: the layout, and the strides of the dims longer than 1
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

// protocol.decode_meta: `dtypes` and `device_types` are protocol.DTYPES and protocol.DEVICE_TYPES
// (as install_calls was given them)
inline std::vector<OutputMeta> decode_meta(
    const py::list& meta,
    const std::vector<at::ScalarType>& dtypes,
    const std::vector<c10::DeviceType>& device_types) {
  std::vector<OutputMeta> out;
  Py_ssize_t pos = 0, n = PyList_GET_SIZE(meta.ptr());
  while (pos < n) {
    auto rank = meta[pos + MetaField::RANK].cast<Py_ssize_t>();
    auto dtype = dtypes.at(meta[pos + MetaField::DTYPE].cast<size_t>());
    auto dev = meta[pos + MetaField::DEVICE].cast<int64_t>();
    auto index = static_cast<c10::DeviceIndex>(dev % kDeviceCodeBase - 1);
    c10::Device device(device_types.at(static_cast<size_t>(dev / kDeviceCodeBase)), index);
    bool sparse = meta[pos + MetaField::LAYOUT].cast<int64_t>() == kLayoutSparseCoo;
    pos += MetaField::COUNT;
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

} // namespace compiled_autograd_native
