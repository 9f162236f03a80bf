#pragma once
// The file-backed data sets (files.cpp), registered with the others in synthetic.cpp.
#include <tk/components.h>
#include <tk/registry.h>

namespace tk::data {

OptionSpecs fashion_mnist_specs();
DataSplits make_fashion_mnist(const Options& o, uint64_t seed);
OptionSpecs text_specs();
DataSplits make_text(const Options& o, uint64_t seed);
OptionSpecs tokens_specs();
DataSplits make_tokens(const Options& o, uint64_t seed);

}  // namespace tk::data
