// The run's data and its small accessors (run.h): its log, a plugin's hook called with its failure
// named, the rank's examples of an epoch, a batch on the run's device.
#include "run/run.h"

#include <algorithm>

#include <spdlog/spdlog.h>

namespace tk::detail {

Run::Run() {
  plan.dispatch = &dispatch;
  dispatch.log = [this](int level, const std::string& msg) {
    if (level > 0) warn(msg);
    else spdlog::info("{}", msg);
  };
}

void Run::call_plugin(const Slot& slot, const char* hook, const std::function<void()>& fn) {
  struct Entered {
    Dispatch& d;
    ~Entered() { d.leave(); }
  } entered{dispatch};
  dispatch.enter(slot.name, hook);
  try {
    fn();
  } catch (const RecipeError&) {
    throw;
  } catch (const std::exception& err) {
    throw Error(slot.label() + " failed in " + hook + ": " + message_of(err));
  } catch (...) {
    throw Error(slot.label() + " failed in " + hook + ": an unknown exception");
  }
}

void Run::warn_once(const std::string& msg) {
  if (std::find(warnings.begin(), warnings.end(), msg) == warnings.end()) warn(msg);
}

void Run::warn(const std::string& msg) {
  warnings.push_back(msg);
  spdlog::warn("{}", msg);
}

at::Tensor Run::shard_order(int64_t epoch) const {
  const at::Tensor all = epoch_order(data.train->size(), seed, epoch, data_opts.get_bool("shuffle"));
  if (plan.world_size == 1) return all;
  return all.slice(0, plan.rank, shard_size() * plan.world_size, plan.world_size);
}

Batch Run::fetch(const Dataset& ds, const at::Tensor& indices) const {
  Batch b = ds.get(indices);
  b.input = place(b.input, device);
  b.target = place(b.target, device);
  return b;
}

at::Tensor Run::place(const at::Tensor& t, at::Device to, bool non_blocking) const {
  return at::isFloatingType(t.scalar_type()) ? t.to(to, dtype, non_blocking) : t.to(to, non_blocking);
}

}  // namespace tk::detail
