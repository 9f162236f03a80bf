// The device's matrix-product peak that MFU is measured against when run.peak_gflops is not
// given: square products timed once per device model, thread count, dtype and LibTorch version,
// and kept in a cache file that people can read and delete.
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loop/loop.h"
#include "tk/compat.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      std::string name = line.substr(line.find(':') + 1);
      name.erase(0, name.find_first_not_of(' '));
      return name;
    }
  return "unknown CPU";
}

/// The best rate of n x n products in `dtype` on `device`, over sizes large enough to reach the
/// kernels' steady state: each size warmed up, then three timings of about 0.1 s each. A product
/// that takes longer than kSlow (a dtype without fast kernels here: bf16 emulated on a CPU, 4
/// GFLOP/s) is at its steady state already: timed twice, and no larger size, so that the
/// measurement stays within a few seconds.
double time_products(at::Device device, at::ScalarType dtype) {
  constexpr double kSlow = 0.2;
  const auto sync = [&] {
    if (device.is_cuda()) compat::cuda_synchronize();
  };
  double best = 0;
  for (const int64_t n : device.is_cuda() ? std::vector<int64_t>{4096, 8192} : std::vector<int64_t>{1024, 2048}) {
    // Constant operands: the product's speed does not depend on the values, and the run's random
    // generators stay untouched.
    const auto opts = at::TensorOptions().device(device).dtype(dtype);
    const at::Tensor a = at::full({n, n}, 0.5, opts), b = at::full({n, n}, 0.25, opts);
    at::Tensor c = at::mm(a, b);
    sync();
    const double flop = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
    int64_t reps = 1;
    bool slow = false;
    for (int round = 0; round < (slow ? 3 : 4); ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < reps; ++i) at::mm_out(c, a, b);
      sync();
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (round > 0) best = std::max(best, flop * static_cast<double>(reps) / secs / 1e9);
      slow = slow || secs / static_cast<double>(reps) > kSlow;
      reps = std::max<int64_t>(1, static_cast<int64_t>(0.1 / std::max(secs / static_cast<double>(reps), 1e-6)));
    }
    if (slow) break;
  }
  return best;
}

}  // namespace

fs::path peak_cache_file() {
  if (const char* d = std::getenv("TK_CACHE_DIR"); d && *d) return fs::path(d) / "peak-gflops.json";
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return fs::path(x) / "trainkit" / "peak-gflops.json";
  if (const char* h = std::getenv("HOME"); h && *h) return fs::path(h) / ".cache" / "trainkit" / "peak-gflops.json";
  return {};
}

MachinePeak machine_peak(at::Device device, at::ScalarType dtype) {
  std::string name = device.is_cuda() ? compat::cuda_device_name(device) : cpu_model();
  if (name.empty()) name = device.str();
  MachinePeak p;
  const int threads = at::get_num_threads();
  p.key = name + " | " + (device.is_cuda() ? device.str() : std::to_string(threads) + (threads == 1 ? " thread" : " threads")) +
          " | " + c10::toString(dtype) + " | LibTorch " + TORCH_VERSION;
  p.file = peak_cache_file();
  // One process at a time measures (ranks of one machine would share its cores) and the others
  // then read its figure.
  std::error_code ec;
  if (!p.file.empty()) fs::create_directories(p.file.parent_path(), ec);
  const int lock = p.file.empty() ? -1 : ::open((p.file.string() + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock >= 0) ::flock(lock, LOCK_EX);
  struct Unlock {
    int fd;
    ~Unlock() {
      if (fd >= 0) ::close(fd);  // closing releases the lock
    }
  } unlock{lock};
  nlohmann::json cache = nlohmann::json::object();
  if (!p.file.empty()) {
    std::ifstream in(p.file);
    if (in) cache = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!cache.is_object()) cache = nlohmann::json::object();  // unreadable: measured again, rewritten
    if (auto it = cache.find(p.key); it != cache.end() && it->is_number() && it->get<double>() > 0) {
      p.gflops = it->get<double>();
      return p;
    }
  }
  p.gflops = time_products(device, dtype);
  p.measured = true;
  if (p.file.empty() || !(p.gflops > 0)) return p;
  cache[p.key] = std::round(p.gflops * 10) / 10;
  try {
    write_file_atomic(p.file, cache.dump(2) + "\n");
  } catch (const std::exception& e) {  // MFU still has its figure; the next run measures again
    spdlog::warn("could not keep the measured peak in {}: {}", p.file.string(), e.what());
  }
  return p;
}

}  // namespace tk::detail
