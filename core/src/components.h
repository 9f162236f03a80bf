#pragma once
/// The built-in models and file-backed data sets, registered by name in builtins.cpp.
#include "tk/builtins.h"

namespace tk::detail {

// Models (models.cpp).
OptionSpecs mlp_specs();
ModelPtr make_mlp(const Options& o, const DataInfo& d);
OptionSpecs cnn_specs();
ModelPtr make_cnn(const Options& o, const DataInfo& d);
OptionSpecs gpt_specs();
ModelPtr make_gpt(const Options& o, const DataInfo& d);
OptionSpecs torchscript_specs();
ModelPtr make_torchscript(const Options& o, const DataInfo& d);

// Data sets read from files (data_files.cpp).
OptionSpecs fashion_mnist_specs();
DataSplits make_fashion_mnist(const Options& o, uint64_t seed);
OptionSpecs text_specs();
DataSplits make_text(const Options& o, uint64_t seed);

}  // namespace tk::detail
