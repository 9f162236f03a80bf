#pragma once
// Figures of a run for people (output.cpp). Not installed.
#include <string>

namespace tk::detail {

/// Peak resident memory of this process so far, in MiB.
double peak_rss_mib();
/// A loss or perplexity for people: 4 significant digits.
std::string fmt_loss(double v);

}  // namespace tk::detail
