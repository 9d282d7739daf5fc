// flashmonoid._C: the C++ API seen from Python, and nothing more.
//
// Arrays arrive through DLPack (nb::ndarray), so NumPy, torch (CPU and CUDA) and CuPy arrays are
// viewed in place, never copied. The Python side allocates every output and the workspace, and
// passes the caller's CUDA stream as an integer; this file only converts and forwards, and the GIL
// is released while the library runs.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "api/pointer_source.hpp"
#include "dist/ring_schedule.hpp"
#include "flashmonoid/flashmonoid.hpp"

namespace nb = nanobind;
namespace fm = flashmonoid;

namespace {

// Read-only arrays are accepted so that NumPy inputs marked non-writeable still work; the library
// only writes into the outputs, which the Python side allocates fresh.
using Array = nb::ndarray<nb::ro>;
using OptArray = std::optional<Array>;

fm::DType to_dtype(const nb::dlpack::dtype& t, const char* name) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == static_cast<std::uint8_t>(Code::Float) && t.bits == 32) return fm::DType::f32;
    if (t.code == static_cast<std::uint8_t>(Code::Float) && t.bits == 16) return fm::DType::f16;
    if (t.code == static_cast<std::uint8_t>(Code::Bfloat) && t.bits == 16) return fm::DType::bf16;
    if (t.code == static_cast<std::uint8_t>(Code::Int) && t.bits == 32) return fm::DType::i32;
  }
  throw fm::Error(name, "dtype must be float32, float16, bfloat16 (or int32 for cu_seqlens), got DLPack code " +
                            std::to_string(t.code) + " with " + std::to_string(t.bits) + " bits");
}

fm::Device to_device(std::int32_t device_type, std::int32_t device_id, const char* name) {
  switch (device_type) {
    case nb::device::cpu::value:
      return fm::Device::cpu();
    // Managed memory is addressable from the device it was attached to; treat it as that GPU.
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return fm::Device::cuda(device_id);
    default:
      throw fm::Error(name, "arrays must live on the CPU or a CUDA device (DLPack device type " +
                                std::to_string(device_type) + ")");
  }
}

fm::Device to_device(const Array& a, const char* name) { return to_device(a.device_type(), a.device_id(), name); }

void check_ndim(std::size_t ndim, const char* name) {
  if (ndim > static_cast<std::size_t>(fm::TensorView::kMaxDims))
    throw fm::Error(name, "has " + std::to_string(ndim) + " dimensions; at most " +
                              std::to_string(fm::TensorView::kMaxDims) + " are supported");
}

// A TensorView over the array's memory; shape and strides are already in elements in DLPack.
fm::TensorView view(const Array& a, const char* name) {
  check_ndim(a.ndim(), name);
  fm::TensorView t;
  t.data = const_cast<void*>(a.data());
  t.dtype = to_dtype(a.dtype(), name);
  t.device = to_device(a, name);
  t.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<std::int64_t>(a.shape(i));
    t.stride[i] = a.stride(i);
  }
  return t;
}

// ---- torch tensors through DLPack's C exchange table ---------------------------------------------
// torch (2.10 and later) publishes DLPack 1.3's DLPackExchangeAPI on its tensor type as the capsule
// __dlpack_c_exchange_api__; its dltensor_from_py_object_no_sync fills a non-owning DLTensor of a
// tensor from C, its allocator makes a tensor with torch's allocator (on the device's current
// stream), and its current_work_stream gives torch's current stream. The layouts below are dlpack.h's.
struct ManagedTensor {  // DLManagedTensorVersioned
  std::uint32_t major, minor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
  std::uint64_t flags;
  nb::dlpack::dltensor dl_tensor;
};
struct DLPackExchangeApi {
  std::uint32_t major, minor;  // DLPackVersion
  const void* prev_api;
  int (*managed_tensor_allocator)(nb::dlpack::dltensor* prototype, ManagedTensor** out, void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind, const char* message));
  const void* managed_tensor_from_py_object_no_sync;
  int (*managed_tensor_to_py_object_no_sync)(ManagedTensor* tensor, void** out_py_object);  // steals tensor
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);        // may be null
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out_stream);
};

// The table of x's type (looked up once per type), or nullptr when it has none this file can use.
const DLPackExchangeApi* exchange_api(nb::handle x) {
  static std::unordered_map<PyTypeObject*, const DLPackExchangeApi*> by_type;  // under the GIL
  PyTypeObject* type = Py_TYPE(x.ptr());
  auto it = by_type.find(type);
  if (it != by_type.end()) return it->second;
  const DLPackExchangeApi* api = nullptr;
  if (PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__")) {
    api = static_cast<const DLPackExchangeApi*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
    Py_DECREF(cap);
  }
  PyErr_Clear();
  if (api != nullptr && (api->major != 1 || api->dltensor_from_py_object_no_sync == nullptr)) api = nullptr;
  by_type.emplace(type, api);
  return api;
}

// The DLTensor of a tensor (None: absent), valid while x lives unchanged: the caller holds x for the
// duration of the call. Shape and strides are copied out before the GIL is released.
bool dltensor_of(nb::handle x, const char* name, nb::dlpack::dltensor* t) {
  if (x.is_none()) return false;
  const DLPackExchangeApi* api = exchange_api(x);
  if (api == nullptr)
    throw nb::type_error((std::string(name) + ": expected a torch tensor (with __dlpack_c_exchange_api__), got " +
                          nb::type_name(x.type()).c_str()).c_str());
  if (api->dltensor_from_py_object_no_sync(x.ptr(), t) != 0) throw nb::python_error();
  return true;
}

fm::TensorView view_of(const nb::dlpack::dltensor& d, const char* name) {
  check_ndim(static_cast<std::size_t>(d.ndim), name);
  fm::TensorView t;
  t.data = static_cast<char*>(d.data) + d.byte_offset;
  t.dtype = to_dtype(d.dtype, name);
  t.device = to_device(d.device.device_type, d.device.device_id, name);
  t.ndim = d.ndim;
  std::int64_t compact = 1;  // strides == nullptr: compact row-major
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = d.shape[i];
    t.stride[i] = d.strides ? d.strides[i] : compact;
    compact *= d.shape[i];
  }
  return t;
}

fm::TensorView torch_view(nb::handle x, const char* name) {
  nb::dlpack::dltensor d;
  return dltensor_of(x, name, &d) ? view_of(d, name) : fm::TensorView{};
}

// A byte buffer (the workspace) on q's device: its base and size.
void torch_workspace(nb::handle x, const fm::TensorView& q, fm::Context* ctx) {
  nb::dlpack::dltensor d;
  if (!dltensor_of(x, "workspace", &d)) return;
  if (to_device(d.device.device_type, d.device.device_id, "workspace") != q.device)
    throw fm::Error("workspace", "must be on q's device");
  std::size_t n = static_cast<std::size_t>(d.dtype.bits) / 8;
  for (int i = 0; i < d.ndim; ++i) n *= static_cast<std::size_t>(d.shape[i]);
  ctx->workspace = static_cast<char*>(d.data) + d.byte_offset;
  ctx->workspace_bytes = n;
}

// ---- flash_attn_with_kvcache's eager route (kvcache_eager_torch) ----------------------------------

// A tensor made by torch's allocator through the exchange table, freed with this object unless
// released (to Python, or kept as a workspace).
struct OwnedTensor {
  ManagedTensor* t = nullptr;
  std::size_t bytes = 0;  // as asked of the allocator
  OwnedTensor() = default;
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  ~OwnedTensor() { reset(); }
  void reset(ManagedTensor* next = nullptr) {
    if (t != nullptr && t->deleter != nullptr) t->deleter(t);
    t = next;
  }
  void* data() const { return static_cast<char*>(t->dl_tensor.data) + t->dl_tensor.byte_offset; }
};

// The tensor as a Python object (torch's); ownership passes to it.
nb::object to_python(const DLPackExchangeApi* api, OwnedTensor* x) {
  ManagedTensor* t = x->t;
  x->t = nullptr;
  void* obj = nullptr;
  if (api->managed_tensor_to_py_object_no_sync(t, &obj) != 0) throw nb::python_error();
  return nb::steal(static_cast<PyObject*>(obj));
}

// A new compact tensor of `shape` and `dtype` on `device` (torch's allocator; on CUDA, on the
// device's current stream, as torch.empty).
void torch_alloc(const DLPackExchangeApi* api, nb::dlpack::dtype dtype, nb::dlpack::device device, int ndim,
                 std::int64_t* shape, OwnedTensor* out) {
  nb::dlpack::dltensor proto{};
  proto.device = device;
  proto.ndim = ndim;
  proto.dtype = dtype;
  proto.shape = shape;
  std::string error;
  auto set_error = [](void* ctx, const char* kind, const char* message) {
    *static_cast<std::string*>(ctx) = std::string(kind) + ": " + message;
  };
  ManagedTensor* t = nullptr;
  std::size_t bytes = dtype.bits / 8;
  for (int i = 0; i < ndim; ++i) bytes *= static_cast<std::size_t>(shape[i]);
  if (api->managed_tensor_allocator(&proto, &t, &error, set_error) != 0 || t == nullptr) {
    if (PyErr_Occurred()) throw nb::python_error();
    throw std::runtime_error("flashmonoid: torch's allocator failed: " + error);
  }
  out->reset(t);
  out->bytes = bytes;
}

// Python's torch.Tensor and torch.nn.Parameter (set_torch_types): the only types the eager route
// takes; a subclass (FakeTensor, DTensor, ...) must go through torch's dispatcher.
PyTypeObject* g_tensor_type = nullptr;
PyTypeObject* g_parameter_type = nullptr;

// Whether x (not None) may take the eager route: a plain tensor, not requiring grad under grad
// mode, compact (whole) or with a contiguous last dimension (last_dim); its DLTensor in *d.
bool eager_tensor(nb::handle x, bool grad_enabled, bool whole, nb::dlpack::dltensor* d) {
  PyTypeObject* type = Py_TYPE(x.ptr());
  if (type != g_tensor_type && type != g_parameter_type) return false;
  if (grad_enabled) {
    static PyObject* requires_grad = PyUnicode_InternFromString("requires_grad");
    PyObject* r = PyObject_GetAttr(x.ptr(), requires_grad);
    if (r == nullptr) throw nb::python_error();
    const bool needs = r == Py_True;
    Py_DECREF(r);
    if (needs) return false;
  }
  if (!dltensor_of(x, "tensor", d)) return false;
  if (d->strides == nullptr) return true;
  std::int64_t compact = 1;
  for (int i = d->ndim - 1; i >= 0; --i) {
    if (d->shape[i] != 1 && d->strides[i] != compact) return false;
    compact *= d->shape[i];
    if (!whole) break;  // the last dimension only
  }
  return true;
}

fm::TensorView view(const OptArray& a, const char* name) { return a ? view(*a, name) : fm::TensorView{}; }

fm::Options with_alibi(fm::Options o, const OptArray& alibi_slopes) {
  o.alibi_slopes = view(alibi_slopes, "alibi_slopes");
  return o;
}

fm::Context with_workspace(fm::Context c, const OptArray& workspace) {
  if (workspace) {
    c.workspace = const_cast<void*>(workspace->data());
    c.workspace_bytes = workspace->nbytes();
  }
  return c;
}

fm::Varlen make_varlen(const Array& cu_seqlens_q, const OptArray& cu_seqlens_k, std::int64_t max_seqlen_q,
                       std::int64_t max_seqlen_k, const OptArray& seqused_q = {}, const OptArray& seqused_k = {}) {
  fm::Varlen vl{view(cu_seqlens_q, "cu_seqlens_q"), view(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k};
  vl.seqused_q = view(seqused_q, "seqused_q");
  vl.seqused_k = view(seqused_k, "seqused_k");
  return vl;
}

// The KVCache of a forward_kvcache call's arrays, each made a view by view_of(array, name).
template <class ViewOf, class A, class OptA>
fm::KVCache make_kv_cache(ViewOf view_of, const A& k_cache, const A& v_cache, const OptA& seqlens, int seqlen,
                          const OptA& batch_idx, const OptA& leftpad, const OptA& block_table) {
  fm::KVCache c;
  c.k = view_of(k_cache, "k_cache");
  c.v = view_of(v_cache, "v_cache");
  c.seqlens = view_of(seqlens, "seqlens");
  c.seqlen = seqlen;
  c.batch_idx = view_of(batch_idx, "batch_idx");
  c.leftpad = view_of(leftpad, "leftpad");
  c.block_table = view_of(block_table, "block_table");
  return c;
}

// Raised for fm::NotSupported: a NotImplementedError (the inputs are fine, this build or device
// cannot run them) that is also a ValueError, as NotSupported is an Error in C++.
PyObject* g_not_supported = nullptr;

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flashmonoid C++ API (private; use the flashmonoid package)";

  nb::object bases = nb::make_tuple(nb::handle(PyExc_NotImplementedError), nb::handle(PyExc_ValueError));
  g_not_supported = PyErr_NewExceptionWithDoc(
      "flashmonoid._C.NotSupportedError",
      "Valid inputs that no backend of this build can run (flashmonoid::NotSupported).", bases.ptr(), nullptr);
  m.attr("NotSupportedError") = nb::handle(g_not_supported);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const fm::NotSupported& e) {
      PyErr_SetString(g_not_supported, e.what());
    } catch (const fm::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const fm::DeviceError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  nb::enum_<fm::CpuAlgorithm>(m, "CpuAlgorithm")
      .value("flash", fm::CpuAlgorithm::flash)
      .value("reference", fm::CpuAlgorithm::reference);
  nb::enum_<fm::CpuIsa>(m, "CpuIsa").value("best", fm::CpuIsa::best).value("avx2", fm::CpuIsa::avx2);

  // alibi_slopes is a view and is passed with each call instead, so that its array stays owned
  // by the Python caller for exactly the duration of the call.
  nb::class_<fm::Options>(m, "Options")
      .def(
          "__init__",
          [](fm::Options* o, std::optional<float> softmax_scale, bool causal, int window_left, int window_right,
             float softcap, float dropout_p, std::uint64_t dropout_seed, std::uint64_t dropout_offset,
             bool deterministic) {
            new (o) fm::Options{};
            o->softmax_scale = softmax_scale;
            o->causal = causal;
            o->window_left = window_left;
            o->window_right = window_right;
            o->softcap = softcap;
            o->dropout_p = dropout_p;
            o->dropout_seed = dropout_seed;
            o->dropout_offset = dropout_offset;
            o->deterministic = deterministic;
          },
          nb::kw_only(), nb::arg("softmax_scale") = nb::none(), nb::arg("causal") = false,
          nb::arg("window_left") = -1, nb::arg("window_right") = -1, nb::arg("softcap") = 0.0f,
          nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0, nb::arg("dropout_offset") = 0,
          nb::arg("deterministic") = false)
      .def_rw("softmax_scale", &fm::Options::softmax_scale)
      .def_rw("causal", &fm::Options::causal)
      .def_rw("window_left", &fm::Options::window_left)
      .def_rw("window_right", &fm::Options::window_right)
      .def_rw("softcap", &fm::Options::softcap)
      .def_rw("dropout_p", &fm::Options::dropout_p)
      .def_rw("dropout_seed", &fm::Options::dropout_seed)
      .def_rw("dropout_offset", &fm::Options::dropout_offset)
      .def_rw("deterministic", &fm::Options::deterministic);

  // The stream is a cudaStream_t passed as an integer (torch: torch.cuda.current_stream().cuda_stream,
  // CuPy: cupy.cuda.get_current_stream().ptr); 0 is the legacy default stream.
  nb::class_<fm::Context>(m, "Context")
      .def(
          "__init__",
          [](fm::Context* c, std::uintptr_t stream, int num_splits, fm::CpuAlgorithm cpu_algorithm, fm::CpuIsa cpu_isa,
             int num_threads, int sm_margin, bool persistent_kernels) {
            new (c) fm::Context{};
            c->stream = reinterpret_cast<void*>(stream);
            c->num_splits = num_splits;
            c->cpu_algorithm = cpu_algorithm;
            c->cpu_isa = cpu_isa;
            c->num_threads = num_threads;
            c->sm_margin = sm_margin;
            c->persistent_kernels = persistent_kernels;
          },
          nb::kw_only(), nb::arg("stream") = 0, nb::arg("num_splits") = 0,
          nb::arg("cpu_algorithm") = fm::CpuAlgorithm::flash, nb::arg("cpu_isa") = fm::CpuIsa::best,
          nb::arg("num_threads") = 0, nb::arg("sm_margin") = 0, nb::arg("persistent_kernels") = true)
      .def_prop_ro("stream", [](const fm::Context& c) { return reinterpret_cast<std::uintptr_t>(c.stream); })
      .def_rw("num_splits", &fm::Context::num_splits)
      .def_rw("cpu_algorithm", &fm::Context::cpu_algorithm)
      .def_rw("cpu_isa", &fm::Context::cpu_isa)
      .def_rw("num_threads", &fm::Context::num_threads)
      .def_rw("sm_margin", &fm::Context::sm_margin)
      .def_rw("persistent_kernels", &fm::Context::persistent_kernels);

  m.def(
      "forward",
      [](const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse, const fm::Options& options,
         const fm::Context& ctx, const OptArray& alibi_slopes, const OptArray& workspace) {
        auto tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"), to = view(out, "out"), tl = view(lse, "lse");
        auto o = with_alibi(options, alibi_slopes);
        auto c = with_workspace(ctx, workspace);
        nb::gil_scoped_release release;
        fm::forward(tq, tk, tv, to, tl, o, c);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("options"),
      nb::arg("ctx"), nb::arg("alibi_slopes").none() = nb::none(), nb::arg("workspace").none() = nb::none());

  m.def(
      "forward_varlen",
      [](const Array& q, const Array& k, const Array& v, const Array& cu_seqlens_q, const OptArray& cu_seqlens_k,
         std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, const Array& out, const Array& lse,
         const fm::Options& options, const fm::Context& ctx, const OptArray& alibi_slopes, const OptArray& workspace,
         const OptArray& block_table, const OptArray& seqused_q, const OptArray& seqused_k) {
        auto tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"), to = view(out, "out"), tl = view(lse, "lse");
        auto vl = make_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k);
        vl.block_table = view(block_table, "block_table");
        auto o = with_alibi(options, alibi_slopes);
        auto c = with_workspace(ctx, workspace);
        nb::gil_scoped_release release;
        fm::forward_varlen(tq, tk, tv, vl, to, tl, o, c);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k").none(),
      nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("out"), nb::arg("lse"), nb::arg("options"),
      nb::arg("ctx"), nb::arg("alibi_slopes").none() = nb::none(), nb::arg("workspace").none() = nb::none(),
      nb::arg("block_table").none() = nb::none(), nb::arg("seqused_q").none() = nb::none(),
      nb::arg("seqused_k").none() = nb::none());

  // forward_kvcache: the cache arrays are written in place (k_new, v_new appended).
  auto kv_cache = [](const Array& k_cache, const Array& v_cache, const OptArray& seqlens, int seqlen,
                     const OptArray& batch_idx, const OptArray& leftpad, const OptArray& block_table) {
    auto view_of = [](const auto& a, const char* name) { return view(a, name); };
    return make_kv_cache(view_of, k_cache, v_cache, seqlens, seqlen, batch_idx, leftpad, block_table);
  };
  auto rotary_of = [](const OptArray& cos, const OptArray& sin, bool interleaved) {
    return fm::Rotary{view(cos, "rotary.cos"), view(sin, "rotary.sin"), interleaved};
  };
  m.def(
      "forward_kvcache",
      [kv_cache, rotary_of](const Array& q, const Array& k_cache, const Array& v_cache, const OptArray& k_new,
                            const OptArray& v_new, const OptArray& cos, const OptArray& sin, bool interleaved,
                            const OptArray& seqlens, int seqlen, const OptArray& batch_idx, const OptArray& leftpad,
                            const OptArray& block_table, const Array& out, const Array& lse,
                            const fm::Options& options, const fm::Context& ctx, const OptArray& alibi_slopes,
                            const OptArray& workspace) {
        auto tq = view(q, "q"), to = view(out, "out"), tl = view(lse, "lse");
        auto c = kv_cache(k_cache, v_cache, seqlens, seqlen, batch_idx, leftpad, block_table);
        auto kn = view(k_new, "k_new"), vn = view(v_new, "v_new");
        auto r = rotary_of(cos, sin, interleaved);
        auto o = with_alibi(options, alibi_slopes);
        auto cx = with_workspace(ctx, workspace);
        if (workspace && to_device(*workspace, "workspace") != tq.device)
          throw fm::Error("workspace", "must be on q's device");
        nb::gil_scoped_release release;
        // Every pointer is a DLPack array's, on the device its producer declared: validation
        // matches the devices, and the runtime query per pointer is skipped (pointer_source.hpp).
        fm::detail::forward_kvcache(tq, c, kn, vn, r, to, tl, o, cx, fm::detail::PointerSource::dlpack, false);
      },
      nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("k_new").none(), nb::arg("v_new").none(),
      nb::arg("cos").none(), nb::arg("sin").none(), nb::arg("interleaved"), nb::arg("seqlens").none(),
      nb::arg("seqlen"), nb::arg("batch_idx").none(), nb::arg("leftpad").none(), nb::arg("block_table").none(),
      nb::arg("out"), nb::arg("lse"), nb::arg("options"), nb::arg("ctx"),
      nb::arg("alibi_slopes").none() = nb::none(), nb::arg("workspace").none() = nb::none());
  m.def(
      "forward_kvcache_workspace_size",
      [kv_cache, rotary_of](const Array& q, const Array& k_cache, const Array& v_cache, const OptArray& k_new,
                            const OptArray& cos, const OptArray& sin, bool interleaved, const OptArray& seqlens,
                            int seqlen, const OptArray& batch_idx, const OptArray& leftpad,
                            const OptArray& block_table, const fm::Options& options) {
        auto c = kv_cache(k_cache, v_cache, seqlens, seqlen, batch_idx, leftpad, block_table);
        return fm::forward_kvcache_workspace_size(view(q, "q"), c, view(k_new, "k_new"), rotary_of(cos, sin, interleaved),
                                                  options);
      },
      nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("k_new").none(), nb::arg("cos").none(),
      nb::arg("sin").none(), nb::arg("interleaved"), nb::arg("seqlens").none(), nb::arg("seqlen"),
      nb::arg("batch_idx").none(), nb::arg("leftpad").none(), nb::arg("block_table").none(), nb::arg("options"));

  // forward_kvcache of torch tensors, the decoding step's route (flashmonoid._backend._Torch): the
  // tensors themselves, read through torch's exchange table (~0.05 us each, against 0.45 us to
  // export a to_dlpack capsule and nanobind's import of it), and the Context as scalars. Same
  // validation and errors as forward_kvcache; returns 0, or, running nothing, the workspace bytes
  // the call needs when `workspace` is smaller (the caller keeps one buffer and grows it).
  m.def("forward_kvcache_torch",
        [](nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle k_new, nb::handle v_new, nb::handle cos,
           nb::handle sin, bool interleaved, nb::handle seqlens, int seqlen, nb::handle batch_idx, nb::handle leftpad,
           nb::handle block_table, nb::handle out, nb::handle lse, const fm::Options& options, nb::handle alibi_slopes,
           nb::handle workspace, std::uintptr_t stream, int num_splits, fm::CpuAlgorithm cpu_algorithm,
           fm::CpuIsa cpu_isa) {
          const fm::TensorView tq = torch_view(q, "q"), to = torch_view(out, "out"), tl = torch_view(lse, "lse");
          const fm::KVCache c =
              make_kv_cache(torch_view, k_cache, v_cache, seqlens, seqlen, batch_idx, leftpad, block_table);
          const fm::TensorView kn = torch_view(k_new, "k_new"), vn = torch_view(v_new, "v_new");
          const fm::Rotary r{torch_view(cos, "rotary.cos"), torch_view(sin, "rotary.sin"), interleaved};
          fm::Options o = options;
          o.alibi_slopes = torch_view(alibi_slopes, "alibi_slopes");
          fm::Context cx;
          cx.stream = reinterpret_cast<void*>(stream);
          cx.num_splits = num_splits;
          cx.cpu_algorithm = cpu_algorithm;
          cx.cpu_isa = cpu_isa;
          torch_workspace(workspace, tq, &cx);
          nb::gil_scoped_release release;
          return fm::detail::forward_kvcache(tq, c, kn, vn, r, to, tl, o, cx, fm::detail::PointerSource::dlpack,
                                             true);
        },
        // Optional tensors are None (nanobind refuses None for an argument not marked so).
        nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("k_new").none(), nb::arg("v_new").none(),
        nb::arg("cos").none(), nb::arg("sin").none(), nb::arg("interleaved"), nb::arg("seqlens").none(),
        nb::arg("seqlen"), nb::arg("batch_idx").none(), nb::arg("leftpad").none(), nb::arg("block_table").none(),
        nb::arg("out"), nb::arg("lse"), nb::arg("options"), nb::arg("alibi_slopes").none(),
        nb::arg("workspace").none(), nb::arg("stream"), nb::arg("num_splits"), nb::arg("cpu_algorithm"),
        nb::arg("cpu_isa"));
  // flash_attn_with_kvcache's eager route, for a decoding loop's host time (issue 10): the checks that
  // let a call skip torch's dispatcher, out and lse from torch's allocator, torch's current stream,
  // a workspace kept per (device, stream) and grown, and the call, in one step (the same work in
  // Python layers took ~10 us of an 18.4 us call on the H200 VM). Returns (out, lse), or None when a
  // tensor is not a plain torch tensor, requires grad under grad mode (grad_enabled), or is not
  // compact (q, k_new, v_new, the block table) or last-dimension contiguous (the caches, the rest),
  // or q is not 4-D with a batch and a head dim <= 256 and a multiple of 8: the caller then takes
  // the dispatcher's route. cache_seqlens: an int tensor, an int (every sequence holds that many
  // rows) or None (the full capacity). softmax_scale None: head_dim ** -0.5, as flash-attn. Errors
  // as forward_kvcache's.
  m.def("set_torch_types", [](nb::handle tensor, nb::handle parameter) {
    g_tensor_type = reinterpret_cast<PyTypeObject*>(tensor.ptr());
    g_parameter_type = reinterpret_cast<PyTypeObject*>(parameter.ptr());
    Py_INCREF(tensor.ptr());
    Py_INCREF(parameter.ptr());
  });
  m.def(
      "kvcache_eager_torch",
      [](nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle k_new, nb::handle v_new, nb::handle cos,
         nb::handle sin, nb::handle cache_seqlens, nb::handle batch_idx, nb::handle leftpad, nb::handle block_table,
         nb::handle softmax_scale, bool causal, int window_left, int window_right, float softcap, bool interleaved,
         int num_splits, bool grad_enabled, bool deterministic, bool return_lse, fm::CpuAlgorithm cpu_algorithm,
         fm::CpuIsa cpu_isa) -> nb::object {
        if (g_tensor_type == nullptr) return nb::none();
        nb::dlpack::dltensor dq, dkc, dvc, dkn, dvn, dcos, dsin, dsl, dbi, dlp, dbt;
        const bool has_seqlens = !cache_seqlens.is_none() && !PyLong_Check(cache_seqlens.ptr());
        struct Arg {
          nb::handle x;
          bool whole;
          nb::dlpack::dltensor* d;
        };
        // The caches need only a contiguous last dimension, as flash-attn's: head-major caches
        // (transformers' (b, h_k, s, d) seen as (b, s, h_k, d)) take this route too.
        for (const Arg& a : {Arg{q, true, &dq}, Arg{k_cache, false, &dkc}, Arg{v_cache, false, &dvc},
                             Arg{k_new, true, &dkn}, Arg{v_new, true, &dvn}, Arg{block_table, true, &dbt},
                             Arg{cos, false, &dcos}, Arg{sin, false, &dsin},
                             Arg{has_seqlens ? cache_seqlens : nb::handle(Py_None), false, &dsl},
                             Arg{batch_idx, false, &dbi}, Arg{leftpad, false, &dlp}})
          if (!a.x.is_none() && !eager_tensor(a.x, grad_enabled, a.whole, a.d)) return nb::none();
        if (dq.ndim != 4 || dq.shape[0] <= 0 || dq.shape[3] > 256 || dq.shape[3] % 8 != 0) return nb::none();
        const DLPackExchangeApi* api = exchange_api(q);
        if (api->managed_tensor_allocator == nullptr || api->managed_tensor_to_py_object_no_sync == nullptr ||
            api->current_work_stream == nullptr)
          return nb::none();

        auto opt = [](nb::handle x, const nb::dlpack::dltensor& d, const char* name) {
          return x.is_none() ? fm::TensorView{} : view_of(d, name);
        };
        const fm::TensorView tq = view_of(dq, "q");
        fm::KVCache c;
        c.k = view_of(dkc, "k_cache");
        c.v = view_of(dvc, "v_cache");
        c.seqlens = has_seqlens ? view_of(dsl, "seqlens") : fm::TensorView{};
        c.seqlen = cache_seqlens.is_none() || has_seqlens ? -1 : nb::cast<int>(cache_seqlens);
        c.batch_idx = opt(batch_idx, dbi, "batch_idx");
        c.leftpad = opt(leftpad, dlp, "leftpad");
        c.block_table = opt(block_table, dbt, "block_table");
        const fm::TensorView kn = opt(k_new, dkn, "k_new"), vn = opt(v_new, dvn, "v_new");
        const fm::Rotary r{opt(cos, dcos, "rotary.cos"), opt(sin, dsin, "rotary.sin"), interleaved};
        fm::Options o;
        // Python's head_dim ** -0.5 (a double) rounded to float, as the dispatcher's route passes it.
        o.softmax_scale = softmax_scale.is_none() ? static_cast<float>(std::pow(static_cast<double>(dq.shape[3]), -0.5))
                                                  : nb::cast<float>(softmax_scale);
        o.causal = causal;
        o.window_left = window_left;
        o.window_right = window_right;
        o.softcap = softcap;
        o.deterministic = deterministic;

        // out like q (compact), lse (b, h, s_q) float32, on q's device. An lse the caller does not
        // want (flash-attn's default) goes into the kept workspace's last bytes instead of a torch
        // tensor of its own: one allocation and one Python object less per call.
        OwnedTensor out, lse;
        torch_alloc(api, dq.dtype, dq.device, 4, dq.shape, &out);
        std::int64_t lse_shape[3] = {dq.shape[0], dq.shape[2], dq.shape[1]};
        if (return_lse)
          torch_alloc(api, nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 32, 1},
                      dq.device, 3, lse_shape, &lse);
        const fm::TensorView to(out.data(), tq.dtype, tq.device,
                                {dq.shape[0], dq.shape[1], dq.shape[2], dq.shape[3]});
        const std::size_t lse_bytes = static_cast<std::size_t>(lse_shape[0] * lse_shape[1] * lse_shape[2]) * 4;
        constexpr std::size_t kLseAlign = 256;
        const std::size_t lse_room = return_lse ? 0 : lse_bytes + kLseAlign;  // what the workspace holds for it

        fm::Context cx;
        cx.num_splits = num_splits;
        cx.cpu_algorithm = cpu_algorithm;
        cx.cpu_isa = cpu_isa;
        // The workspace: kept per (device, stream) and grown, or, while the stream is captured, a fresh
        // one (the graph's memory pool keeps it as long as the graph lives). Held by this call as
        // well, so another thread on the same stream that grows it cannot free it under this call.
        using Workspace = std::shared_ptr<OwnedTensor>;
        static std::map<std::pair<int, void*>, Workspace> kept;  // under the GIL; never freed
        Workspace ws;
        std::pair<int, void*> key{dq.device.device_id, nullptr};
        bool keep = false;
        if (tq.device.kind == fm::DeviceKind::cuda) {
          if (api->current_work_stream(dq.device.device_type, dq.device.device_id, &key.second) != 0)
            throw nb::python_error();
          cx.stream = key.second;
          // Work on one stream runs in order: a call never overwrites what an earlier call on that
          // stream still reads, and a replaced buffer is freed in stream order.
          keep = !fm::detail::stream_is_capturing(cx.stream);
          if (keep) ws = kept[key];
        }
        // Attempts: the kept workspace; one grown to what the library reports short (or, where the
        // workspace has no room for an unwanted lse, to the size query's answer); once more where forced
        // splits need more than the query's heuristic plan.
        for (int attempt = 0; attempt < 3; ++attempt) {
          const std::size_t avail = ws ? ws->bytes : 0;
          std::size_t need;
          if (avail >= lse_room) {
            // The unwanted lse at the workspace's last kLseAlign-aligned lse_bytes; the library gets the rest.
            const std::size_t lse_at = return_lse ? avail : (avail - lse_bytes) / kLseAlign * kLseAlign;
            cx.workspace = ws ? ws->data() : nullptr;
            cx.workspace_bytes = lse_at;
            void* lse_data = return_lse ? lse.data() : static_cast<char*>(ws->data()) + lse_at;
            const fm::TensorView tl(lse_data, fm::DType::f32, tq.device, {lse_shape[0], lse_shape[1], lse_shape[2]});
            nb::gil_scoped_release release;
            need = fm::detail::forward_kvcache(tq, c, kn, vn, r, to, tl, o, cx, fm::detail::PointerSource::dlpack,
                                               true);
            if (need == 0) break;
          } else {
            need = fm::forward_kvcache_workspace_size(tq, c, kn, r, o);
          }
          if (attempt == 2) throw std::runtime_error("flashmonoid: the workspace stayed short of the call's need");
          std::int64_t bytes = static_cast<std::int64_t>(need + lse_room);
          ws = std::make_shared<OwnedTensor>();
          torch_alloc(api, nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt), 8, 1}, dq.device,
                      1, &bytes, ws.get());
          if (keep) kept[key] = ws;
        }
        nb::object out_py = to_python(api, &out);
        return nb::make_tuple(out_py, return_lse ? to_python(api, &lse) : nb::none());
      },
      nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("k_new").none(), nb::arg("v_new").none(),
      nb::arg("cos").none(), nb::arg("sin").none(), nb::arg("cache_seqlens").none(), nb::arg("batch_idx").none(),
      nb::arg("leftpad").none(), nb::arg("block_table").none(), nb::arg("softmax_scale").none(), nb::arg("causal"),
      nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"), nb::arg("interleaved"),
      nb::arg("num_splits"), nb::arg("grad_enabled"), nb::arg("deterministic"), nb::arg("return_lse"),
      nb::arg("cpu_algorithm"), nb::arg("cpu_isa"));
  m.def("has_torch_exchange", [](nb::handle x) { return exchange_api(x) != nullptr; },
        "Whether forward_kvcache_torch can read arrays of x's type.");

  m.def(
      "backward",
      [](const Array& dout, const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse,
         const Array& dq, const Array& dk, const Array& dv, const fm::Options& options, const fm::Context& ctx,
         const OptArray& alibi_slopes, const OptArray& workspace) {
        auto tdo = view(dout, "dout"), tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v");
        auto to = view(out, "out"), tl = view(lse, "lse");
        auto tdq = view(dq, "dq"), tdk = view(dk, "dk"), tdv = view(dv, "dv");
        auto o = with_alibi(options, alibi_slopes);
        auto c = with_workspace(ctx, workspace);
        nb::gil_scoped_release release;
        fm::backward(tdo, tq, tk, tv, to, tl, tdq, tdk, tdv, o, c);
      },
      nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("options"), nb::arg("ctx"), nb::arg("alibi_slopes").none() = nb::none(),
      nb::arg("workspace").none() = nb::none());

  m.def(
      "backward_varlen",
      [](const Array& dout, const Array& q, const Array& k, const Array& v, const Array& cu_seqlens_q,
         const Array& cu_seqlens_k, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, const Array& out,
         const Array& lse, const Array& dq, const Array& dk, const Array& dv, const fm::Options& options,
         const fm::Context& ctx, const OptArray& alibi_slopes, const OptArray& workspace, const OptArray& seqused_q,
         const OptArray& seqused_k) {
        auto tdo = view(dout, "dout"), tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v");
        auto to = view(out, "out"), tl = view(lse, "lse");
        auto tdq = view(dq, "dq"), tdk = view(dk, "dk"), tdv = view(dv, "dv");
        auto vl = make_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k);
        auto o = with_alibi(options, alibi_slopes);
        auto c = with_workspace(ctx, workspace);
        nb::gil_scoped_release release;
        fm::backward_varlen(tdo, tq, tk, tv, vl, to, tl, tdq, tdk, tdv, o, c);
      },
      nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"),
      nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("out"), nb::arg("lse"), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("options"), nb::arg("ctx"), nb::arg("alibi_slopes").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("seqused_q").none() = nb::none(),
      nb::arg("seqused_k").none() = nb::none());

  m.def(
      "merge",
      [](const std::vector<Array>& outs, const std::vector<Array>& lses, const Array& out, const Array& lse,
         const fm::Context& ctx) {
        std::vector<fm::TensorView> vo, vl;
        for (const auto& a : outs) vo.push_back(view(a, "outs"));
        for (const auto& a : lses) vl.push_back(view(a, "lses"));
        auto to = view(out, "out"), tl = view(lse, "lse");
        nb::gil_scoped_release release;
        fm::merge(vo, vl, to, tl, ctx);
      },
      nb::arg("outs"), nb::arg("lses"), nb::arg("out"), nb::arg("lse"), nb::arg("ctx"));

  // Size and support queries read only shapes, dtypes and devices; alibi_slopes is irrelevant to them.
  auto varlen_of = [](const OptArray& cu_q, const OptArray& cu_k, std::int64_t max_q, std::int64_t max_k) {
    return cu_q ? std::optional<fm::Varlen>(make_varlen(*cu_q, *cu_k, max_q, max_k)) : std::nullopt;
  };
  m.def(
      "forward_workspace_size",
      [varlen_of](const Array& q, const Array& k, const fm::Options& options, const OptArray& cu_seqlens_q,
                  const OptArray& cu_seqlens_k, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k) {
        auto vl = varlen_of(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
        return fm::forward_workspace_size(view(q, "q"), view(k, "k"), options, vl ? &*vl : nullptr);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("options"), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("max_seqlen_q") = 0, nb::arg("max_seqlen_k") = 0);
  m.def(
      "backward_workspace_size",
      [varlen_of](const Array& q, const Array& k, const fm::Options& options, const OptArray& cu_seqlens_q,
                  const OptArray& cu_seqlens_k, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k) {
        auto vl = varlen_of(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
        return fm::backward_workspace_size(view(q, "q"), view(k, "k"), options, vl ? &*vl : nullptr);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("options"), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("max_seqlen_q") = 0, nb::arg("max_seqlen_k") = 0);

  m.def(
      "supports",
      [](const Array& q, const Array& k, const fm::Options& options) {
        auto s = fm::supports(view(q, "q"), view(k, "k"), options);
        return std::make_pair(s.ok, s.reason);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("options"),
      "(ok, reason): whether a backend of this build runs these inputs on their device, and why not.");

  m.def("cuda_available", &fm::cuda_available);

  // The ring schedule (src/dist/ring_schedule.hpp) that flashmonoid.distributed runs over
  // torch.distributed: the same steps, tasks and layers as the C++ ring.
  using Seg = std::tuple<std::int64_t, std::int64_t, std::int64_t>;
  using TaskT = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, int, int>;
  using StepT = std::pair<int, std::vector<std::vector<TaskT>>>;
  m.def(
      "ring_schedule",
      [](int world_size, std::int64_t seqlen_total, const std::string& layout, int window_left, int window_right,
         int rank) {
        if (layout != "zigzag" && layout != "contiguous")
          throw fm::Error("layout", "must be 'zigzag' or 'contiguous', got '" + layout + "'");
        const fm::dist::RingSchedule s(world_size, seqlen_total,
                                       layout == "zigzag" ? fm::dist::Layout::zigzag : fm::dist::Layout::contiguous,
                                       window_left, window_right);
        if (rank < 0 || rank >= world_size)
          throw fm::Error("rank", "must be in [0, " + std::to_string(world_size) + "), got " + std::to_string(rank));
        std::vector<std::vector<Seg>> segments;
        for (int r = 0; r < world_size; ++r) {
          segments.emplace_back();
          for (const auto& g : s.segments(r)) segments.back().emplace_back(g.global_begin, g.local_begin, g.length);
        }
        std::vector<StepT> steps;
        for (const auto& st : s.steps(rank)) {
          StepT out{st.src, {}};
          for (const auto& layer : st.layers) {
            out.second.emplace_back();
            for (const auto& t : layer)
              out.second.back().emplace_back(t.q_begin, t.q_end, t.k_begin, t.k_end, t.window_left, t.window_right);
          }
          steps.push_back(std::move(out));
        }
        return std::make_tuple(segments, steps, s.home_shift());
      },
      nb::arg("world_size"), nb::arg("seqlen_total"), nb::arg("layout"), nb::arg("window_left"),
      nb::arg("window_right"), nb::arg("rank"),
      "(segments, steps, home_shift): segments[r] = [(global_begin, local_begin, length)] of every rank; steps "
      "of `rank`: [(src, layers)], each layer a list of tasks (q_begin, q_end, k_begin, k_end, window_left, "
      "window_right); after the last step dK/dV go to rank + home_shift (0: already home).");
  m.attr("__version__") = FLASHMONOID_VERSION;
}
