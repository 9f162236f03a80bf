// The process's random generators, in one place: their states saved and put back around trial
// steps and back-offs (save_rng / restore_rng), and written to and read from checkpoints.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <mutex>

#include "support/support.h"
#include "tk/error.h"

namespace tk::detail {

std::vector<std::pair<std::string, at::Generator>> generators() {
  // The CPU's, and each visible GPU's (dropout and other random ops on CUDA draw from those).
  std::vector<std::pair<std::string, at::Generator>> out{{"cpu_rng", at::detail::getDefaultCPUGenerator()}};
  const int gpus = at::hasCUDA() ? static_cast<int>(at::detail::getCUDAHooks().getNumGPUs()) : 0;
  for (int i = 0; i < gpus; ++i)
    out.emplace_back("cuda_rng_" + std::to_string(i), at::globalContext().defaultGenerator(at::Device(at::kCUDA, i)));
  return out;
}

RngStates save_rng() {
  RngStates out;
  for (auto& [name, gen] : generators()) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back(gen, gen.get_state());
  }
  return out;
}

void restore_rng(const RngStates& states) {
  for (auto [gen, state] : states) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

NamedTensors rng_tensors() {
  NamedTensors out;
  const auto gens = generators();
  const RngStates states = save_rng();
  for (size_t i = 0; i < gens.size(); ++i) out.emplace_back(gens[i].first, states[i].second);
  return out;
}

void load_rng_tensors(const std::map<std::string, at::Tensor>& saved, const std::string& where) {
  RngStates states;
  for (auto& [name, gen] : generators()) {
    auto it = saved.find(name);
    if (it == saved.end()) {
      if (name == "cpu_rng") throw Error(where + " has no cpu_rng");
      continue;  // a GPU the saving process did not have
    }
    states.emplace_back(gen, it->second);
  }
  restore_rng(states);
}

}  // namespace tk::detail
