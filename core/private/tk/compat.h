#pragma once
/// Differences between LibTorch versions live here and only here (with tk/kernels.h, the
/// arithmetic trainkit computes its own way where a version lacks LibTorch's, which is installed).
/// Private: built into trainkit and its own plugins, not installed; a plugin uses LibTorch's API as
/// it is.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <torch/version.h>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "tk/version.h"
#if TK_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

/// Whether the LibTorch these headers are compiled against is `major.minor` or later.
#ifndef TK_TORCH_AT_LEAST
#define TK_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#endif

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace tk::compat {

/// The c10d::ProcessGroup over one collective backend (a ProcessGroupGloo on CPU or a
/// ProcessGroupNCCL on CUDA): what c10d's Reducer, broadcast_coalesced and collectives take.
/// LibTorch 1.x's backends are ProcessGroups; 2.x puts a dispatching ProcessGroup in front of
/// per-device Backends (2.6 dropped its Options). The caller includes ProcessGroup.hpp.
template <class Backend, class Store, class Group = c10d::ProcessGroup>
c10::intrusive_ptr<Group> process_group(c10::intrusive_ptr<Backend> backend, const c10::intrusive_ptr<Store>& store,
                                        int rank, int size, bool nccl) {
#if TK_TORCH_AT_LEAST(2, 0)
  const auto type = nccl ? Group::BackendType::NCCL : Group::BackendType::GLOO;
#if TK_TORCH_AT_LEAST(2, 6)
  auto group = c10::make_intrusive<Group>(store, rank, size);
#else
  auto group = c10::make_intrusive<Group>(store, rank, size,
                                          c10::make_intrusive<typename Group::Options>(nccl ? "nccl" : "gloo"));
#endif
  group->setBackend(c10::DeviceType::CUDA, type, backend);      // Gloo reduces CUDA tensors too
  if (!nccl) group->setBackend(c10::DeviceType::CPU, type, backend);
  group->setDefaultBackend(type);
  return group;
#else
  (void)store, (void)rank, (void)size, (void)nccl;
  return backend;
#endif
}

/// A c10d Reducer (`R`: c10d::Reducer or a class that inherits its constructors) over `params` in
/// `buckets`. Its constructor changed over LibTorch's versions: 1.x to 2.6 take the buckets' size
/// limits third; later ones drop them and add trailing arguments (skip_all_reduce_unused_params,
/// use_python_reducer, bucket_bytes_cap_list), given here as what keeps the earlier behaviour
/// (false, false, none: the rebuilt buckets use `first` and `cap`). The form is chosen by what `R`
/// can be constructed from, not by version numbers.
template <class R, class Group>
std::unique_ptr<R> make_reducer(const std::vector<at::Tensor>& params, const std::vector<std::vector<size_t>>& buckets,
                                const std::vector<size_t>& limits, const c10::intrusive_ptr<Group>& group,
                                const std::vector<bool>& sparse, int64_t cap, bool unused, bool view,
                                const std::unordered_map<size_t, std::string>& names, int64_t first) {
  using T = std::vector<at::Tensor>;
  using B = std::vector<std::vector<size_t>>;
  using P = c10::intrusive_ptr<Group>;
  using S = std::vector<bool>;
  using N = std::unordered_map<size_t, std::string>;
  using L = std::vector<int64_t>;
  const L none;
  if constexpr (std::is_constructible_v<R, T, B, std::vector<size_t>, P, S, int64_t, bool, bool, N, int64_t>) {
    return std::make_unique<R>(params, buckets, limits, group, sparse, cap, unused, view, names, first);
  } else if constexpr (std::is_constructible_v<R, T, B, P, S, int64_t, bool, bool, N, int64_t, bool, bool, L>) {
    return std::make_unique<R>(params, buckets, group, sparse, cap, unused, view, names, first, false, false, none);
  } else if constexpr (std::is_constructible_v<R, T, B, P, S, int64_t, bool, bool, N, int64_t, bool, bool>) {
    return std::make_unique<R>(params, buckets, group, sparse, cap, unused, view, names, first, false, false);
  } else if constexpr (std::is_constructible_v<R, T, B, P, S, int64_t, bool, bool, N, int64_t, bool>) {
    return std::make_unique<R>(params, buckets, group, sparse, cap, unused, view, names, first, false);
  } else {
    return std::make_unique<R>(params, buckets, group, sparse, cap, unused, view, names, first);
  }
}

/// Sends LibTorch's warnings (TORCH_WARN, e.g. the DDP reducer's) to `sink` rather than to glog's
/// stderr lines. Install it once, at start-up, and keep it alive. LibTorch 2.0 moved the handler
/// to c10::WarningUtils and passes it one c10::Warning.
class WarningForwarder final : public c10::WarningHandler {
 public:
  explicit WarningForwarder(void (*sink)(const std::string&)) : sink_(sink) {}
#if TK_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& w) override { sink_(w.msg()); }
  void install() { c10::WarningUtils::set_warning_handler(this); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override { sink_(msg); }
  void install() { c10::Warning::set_warning_handler(this); }
#endif

 private:
  void (*sink_)(const std::string&);
};

/// While alive, drops LibTorch's warnings whose text holds `drop` and passes the others on to the
/// handler that was in place: for a warning that trainkit says in its own words instead. The
/// handler is per thread on LibTorch 2.x and for the process on 1.x: make and drop it on one thread.
class WarningFilter final : public c10::WarningHandler {
 public:
  explicit WarningFilter(std::string drop) : drop_(std::move(drop)), previous_(get()) { set(this); }
  ~WarningFilter() override { set(previous_); }
  WarningFilter(const WarningFilter&) = delete;
  WarningFilter& operator=(const WarningFilter&) = delete;
#if TK_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& w) override {
    if (w.msg().find(drop_) == std::string::npos) previous_->process(w);
  }

 private:
  static c10::WarningHandler* get() { return c10::WarningUtils::get_warning_handler(); }
  static void set(c10::WarningHandler* h) { c10::WarningUtils::set_warning_handler(h); }
#else
  void process(const c10::SourceLocation& where, const std::string& msg, const bool verbatim) override {
    if (msg.find(drop_) == std::string::npos) previous_->process(where, msg, verbatim);
  }

 private:
  static c10::WarningHandler* get() { return c10::Warning::get_warning_handler(); }
  static void set(c10::WarningHandler* h) { c10::Warning::set_warning_handler(h); }
#endif
  std::string drop_;
  c10::WarningHandler* previous_;
};

/// CPU threads for LibTorch and for the BLAS under its matrix products. LibTorch's thread count
/// does not reach the BLAS it was built on: OpenBLAS (Debian's libopenblas0-pthread) keeps a thread
/// per core of its own, so one LibTorch thread would still multiply on every core. The BLAS is told
/// too, where the loaded one has a setter (OpenBLAS's openblas_set_num_threads).
inline void set_cpu_threads(int n) {
  at::set_num_threads(n);
  using Setter = void (*)(int);
  if (auto set = reinterpret_cast<Setter>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(n);
}

/// Turns autocast on or off for `device` (CPU or CUDA) with the given lower-precision dtype.
/// LibTorch 2.4 made the autocast API device-generic; 1.x has one function pair per device.
inline void set_autocast(at::DeviceType device, bool enabled, at::ScalarType dtype) {
#if TK_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == at::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

/// Whether autocast is on for `device`.
inline bool autocast_enabled(at::DeviceType device) {
#if TK_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == at::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

/// The autocast dtype currently set for `device`.
inline at::ScalarType autocast_dtype(at::DeviceType device) {
#if TK_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == at::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
#endif
}

/// Asks c10d's TCPStore for its classic socket backend: LibTorch 2.4+ defaults to libuv, which
/// Debian's LibTorch is built without. (Older versions have no such option.)
template <class StoreOptions>
auto use_classic_tcpstore(StoreOptions& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <class StoreOptions>
void use_classic_tcpstore(StoreOptions&, long) {}

/// The key of parameter `p` in an optimizer's state map (`Map`, Optimizer::state()'s type): its
/// TensorImpl's address, printed in LibTorch 1.x (std::string keys), the pointer itself in 2.x.
template <class Map>
typename Map::key_type optimizer_state_key(const Map&, const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << p.unsafeGetTensorImpl();
    return s.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

/// A CPU allocator that forwards to `allocate_bytes`: LibTorch 2.3 made Allocator::allocate
/// non-const and added the pure virtual copy_data.
struct AllocatorBase : c10::Allocator {
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;
#if TK_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return allocate_bytes(n); }
#endif
};

/// CUDA memory figures of the caching allocator (a build against a CUDA LibTorch sets
/// TK_WITH_CUDA in tk/version.h); 0 elsewhere.
#if TK_WITH_CUDA
inline void cuda_synchronize() { cudaDeviceSynchronize(); }
inline void cuda_reset_peak(at::Device d) { c10::cuda::CUDACachingAllocator::resetPeakStats(d.index() < 0 ? 0 : d.index()); }
inline double cuda_peak_bytes(at::Device d) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index() < 0 ? 0 : d.index());
  return static_cast<double>(stats.allocated_bytes[0].peak);  // [0]: the aggregate over pool kinds
}
inline std::string cuda_device_name(at::Device d) {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, d.index() < 0 ? 0 : d.index()) == cudaSuccess ? std::string(prop.name) : "";
}
inline double cuda_free_bytes(at::Device) {
  size_t free = 0, total = 0;
  return cudaMemGetInfo(&free, &total) == cudaSuccess ? static_cast<double>(free) : 0.0;
}
#else
inline void cuda_synchronize() {}
inline void cuda_reset_peak(at::Device) {}
inline double cuda_peak_bytes(at::Device) { return 0.0; }
inline double cuda_free_bytes(at::Device) { return 0.0; }
inline std::string cuda_device_name(at::Device) { return ""; }
#endif

}  // namespace tk::compat
