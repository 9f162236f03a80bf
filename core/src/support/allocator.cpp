// The CPU block cache: tensors of 1 MiB and more keep their memory for the next tensor of their
// size class instead of handing it back to the kernel. glibc serves a block above its mmap
// threshold (32 MiB at most) with a fresh mmap and unmaps it on free, so a step that makes and
// drops the same large tensors every time (a language model's logits, its embedding's gradient)
// pays for zeroed pages, page faults and huge-page compaction on every step. Small blocks go to
// the allocator underneath unchanged: glibc keeps those itself.
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "support/support.h"
#include "tk/compat.h"

namespace tk::detail {
namespace {

constexpr size_t kMinCached = size_t{1} << 20;
constexpr uint8_t kPriority = 200;  // above LibTorch's own registration; the memory meter's too

/// n rounded up to its size class: 8 classes per power of two, so a block serves any request
/// at most 1/8 smaller than it (a micro-batch of another length) and wastes at most 1/8 of itself.
size_t size_class(size_t n) {
  size_t top = size_t{1};
  while (top <= n / 2) top <<= 1;  // the highest power of two <= n
  const size_t step = std::max<size_t>(top / 8, 4096);
  return (n + step - 1) / step * step;
}

class BlockCache final : public compat::AllocatorBase {
 public:
  static BlockCache& instance() {
    static auto* c = new BlockCache;  // never freed: a tensor may come back to it at exit
    return *c;
  }

  c10::DataPtr allocate_bytes(size_t n) const override {
    const size_t cls = size_class(n);
    Block b{};
    c10::Allocator* base = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      base = base_or_default();
      if (n >= kMinCached) {
        auto it = free_.find(cls);
        if (it != free_.end() && !it->second.empty()) {
          b = it->second.back();
          it->second.pop_back();
          free_bytes_ -= cls;
          ++stats_.hits;
        }
      }
    }
    if (n < kMinCached) return base->allocate(n);
    const bool miss = b.data == nullptr;
    if (miss) {
      c10::DataPtr inner = base->allocate(cls);
      b = {inner.get(), nullptr, inner.get_deleter(), cls};
      b.ctx = inner.release_context();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (miss) ++stats_.misses;
    held_[b.data] = b;
    live_bytes_ += cls;
    peak_live_ = std::max(peak_live_, live_bytes_);
    return {b.data, b.data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void install() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (installs_++ > 0) return;
    base_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, kPriority);
  }
  void uninstall() {
    std::vector<Block> give_back;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (installs_ == 0 || --installs_ > 0) return;
      if (c10::GetCPUAllocator() == this) c10::SetCPUAllocator(base_, kPriority);
      give_back = take_free();
    }
    for (const Block& b : give_back) b.free_fn(b.ctx);
  }
  void trim() {
    std::vector<Block> give_back;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      give_back = take_free();
      peak_live_ = live_bytes_;
    }
    for (const Block& b : give_back) b.free_fn(b.ctx);
  }
  CpuBlockCache::Stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    CpuBlockCache::Stats s = stats_;
    s.cached_bytes = static_cast<int64_t>(free_bytes_);
    s.live_bytes = static_cast<int64_t>(live_bytes_);
    s.installed = installs_ > 0;
    return s;
  }

 private:
  struct Block {
    void* data;
    void* ctx;
    c10::DeleterFnPtr free_fn;
    size_t size;
  };
  BlockCache() = default;

  c10::Allocator* base_or_default() const { return base_ ? base_ : c10::GetDefaultCPUAllocator(); }

  std::vector<Block> take_free() {
    std::vector<Block> out;
    for (auto& [cls, blocks] : free_) out.insert(out.end(), blocks.begin(), blocks.end());
    free_.clear();
    free_bytes_ = 0;
    return out;
  }

  /// A block comes back: kept for its class while the cache is installed and what it keeps free
  /// stays within the most that was ever in use at once (so the process holds at most twice its
  /// peak of large tensors); otherwise it goes back to the allocator underneath.
  static void release(void* data) {
    auto& self = instance();
    Block b{};
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.held_.find(data);
      if (it == self.held_.end()) {  // a small block, or a raw one made before it was installed
        b = {data, data, self.base_or_default()->raw_deleter(), 0};
      } else {
        b = it->second;
        self.held_.erase(it);
        self.live_bytes_ -= b.size;
        if (self.installs_ > 0 && self.free_bytes_ + b.size <= self.peak_live_) {
          self.free_[b.size].push_back(b);
          self.free_bytes_ += b.size;
          return;
        }
        ++self.stats_.returned;
      }
    }
    if (b.free_fn) b.free_fn(b.ctx);
  }

  c10::Allocator* base_ = nullptr;
  int installs_ = 0;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Block> held_;
  mutable std::unordered_map<size_t, std::vector<Block>> free_;
  mutable size_t free_bytes_ = 0, live_bytes_ = 0, peak_live_ = 0;
  mutable CpuBlockCache::Stats stats_;
};

}  // namespace

CpuBlockCache::CpuBlockCache(bool on) : on_(on) {
  if (on_) BlockCache::instance().install();
}

CpuBlockCache::~CpuBlockCache() {
  if (on_) BlockCache::instance().uninstall();
}

void CpuBlockCache::trim() { BlockCache::instance().trim(); }

CpuBlockCache::Stats CpuBlockCache::stats() { return BlockCache::instance().stats(); }

}  // namespace tk::detail
