#include "tk/output.h"

#include <sys/resource.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>

#include "support/support.h"
#include "tk/error.h"

namespace tk {

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

void JsonLine::key(const std::string& k) {
  if (!body_.empty()) body_ += ", ";
  body_ += json_quote(k) + ": ";
}

JsonLine& JsonLine::add(const std::string& k, double v) {
  key(k);
  if (std::isfinite(v)) {
    char buf[32];  // as printf's %.10g, without its locale and format parsing
    const auto end = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, 10).ptr;
    body_.append(buf, end);
  } else {
    body_ += "null";  // JSON has no NaN or infinity
  }
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, int64_t v) {
  key(k);
  body_ += std::to_string(v);
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, const std::string& v) {
  key(k);
  body_ += json_quote(v);
  return *this;
}

std::string format_duration(double s) {
  char buf[32];
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 60) std::snprintf(buf, sizeof buf, "%.1fs", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  else if (s < 3600.0 * 1e6)
    std::snprintf(buf, sizeof buf, "%lldh%02dm", static_cast<long long>(s / 3600), static_cast<int>(std::fmod(s, 3600.0) / 60));
  else return "over 1000000h";
  return buf;
}

Progress::Progress(ProgressMode mode, int64_t total_steps, int64_t every)
    : total_(total_steps), every_(std::max<int64_t>(1, every)) {
  if (mode == ProgressMode::Auto) mode = isatty(STDERR_FILENO) ? ProgressMode::Bar : ProgressMode::Plain;
  live_ = mode == ProgressMode::Bar;
  quiet_ = mode == ProgressMode::None;
}

void Progress::update(int64_t step, int64_t epoch, double loss, double lr, double samples_per_s, double elapsed) {
  update(step, epoch, loss, lr, samples_per_s, elapsed, std::nan(""));
}

void Progress::update(int64_t step, int64_t epoch, double loss, double lr, double samples_per_s, double elapsed,
                      double mfu) {
  if (quiet_) return;
  const bool last = step == total_;
  if (!live_ && step % every_ != 0 && !last && step != first_ + 1) return;
  const double eta = step > first_ ? elapsed / static_cast<double>(step - first_) * static_cast<double>(total_ - step) : 0.0;
  char rate[32] = "";
  if (std::isfinite(mfu)) std::snprintf(rate, sizeof rate, "  mfu %.2f", mfu);
  char line[288];
  std::snprintf(line, sizeof line, "step %lld/%lld  epoch %lld  loss %.4f  lr %.3g  %.0f samples/s%s  %s  eta %s",
                static_cast<long long>(step), static_cast<long long>(total_), static_cast<long long>(epoch + 1), loss,
                lr, samples_per_s, rate, format_duration(elapsed).c_str(), format_duration(eta).c_str());
  if (live_) {
    std::fprintf(stderr, "\r\033[K%s", line);
    open_ = true;
  } else {
    std::fprintf(stderr, "%s\n", line);
  }
  std::fflush(stderr);
}

void Progress::note(const std::string& line) {
  if (quiet_) return;
  if (open_) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "%s\n", line.c_str());
  open_ = false;
  std::fflush(stderr);
}

void Progress::finish() {
  if (open_) std::fprintf(stderr, "\n");
  open_ = false;
}

}  // namespace tk

namespace tk::detail {

double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

std::string fmt_loss(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

}  // namespace tk::detail
