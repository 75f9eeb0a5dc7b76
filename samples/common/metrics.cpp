#include "samples/common/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>

#include "engine/serialization.h"
#include "kernels/core/error.h"
#include "parallel/diagnostics/json.h"

namespace loom::samples {
namespace {

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

std::string tick_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace

std::string to_json(const MetricRecord& record) {
  dist::diagnostics::Json out = dist::diagnostics::Json::object();
  for (const auto& field : record) std::visit([&](const auto& v) { out.set(field.first, v); }, field.second);
  return out.dump_line();
}

MetricsLog::MetricsLog(const std::string& path) : path_(path) {
  if (path.empty()) return;
  // Non-blocking, so a fifo nobody reads fails now (ENXIO) instead of hanging the run; a pipe
  // with a reader (--metrics /dev/stdout under a pipe) and devices still work.
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0666);
  if (fd < 0 && errno == ENXIO)
    LOOM_FAIL(path, ": is a fifo that nothing reads: give a file for the metrics (or start its reader first)");
  LOOM_CHECK(fd >= 0, path, ": cannot open the metrics file for appending: ", std::strerror(errno));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  file_ = ::fdopen(fd, "a");
  if (file_ == nullptr) {
    const int err = errno;
    ::close(fd);
    LOOM_FAIL(path, ": cannot open the metrics file for appending: ", std::strerror(err));
  }
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::write(const MetricRecord& record) {
  if (!file_) return;
  std::string line = to_json(record) + "\n";
  LOOM_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0, path_,
             ": cannot write metrics: ", std::strerror(errno));
}

void write_svg_chart(const std::string& path, const std::string& title, const std::vector<Panel>& panels) {
  constexpr double kPanelW = 460, kPanelH = 300, kLeft = 60, kRight = 20, kTop = 60, kBottom = 50;
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"};
  const double width = kPanelW * double(std::max<size_t>(panels.size(), 1));
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << kPanelH + kTop
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << width / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << xml_escape(title)
    << "</text>\n";
  for (size_t p = 0; p < panels.size(); ++p) {
    const Panel& panel = panels[p];
    double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
    for (const Series& ser : panel.series)
      for (auto [x, y] : ser.points)
        if (std::isfinite(x) && std::isfinite(y)) {
          x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
        }
    if (x0 > x1) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
    if (x1 - x0 < 1e-12) x1 = x0 + 1;
    if (y1 - y0 < 1e-12) y1 = y0 + 1;
    const double pad = (y1 - y0) * 0.05;
    y0 -= pad, y1 += pad;
    const double left = double(p) * kPanelW + kLeft, right = double(p + 1) * kPanelW - kRight;
    const double top = kTop, bottom = kTop + kPanelH - kBottom;
    auto sx = [&](double x) { return left + (x - x0) / (x1 - x0) * (right - left); };
    auto sy = [&](double y) { return bottom - (y - y0) / (y1 - y0) * (bottom - top); };
    s << "<text x=\"" << (left + right) / 2 << "\" y=\"" << top - 12 << "\" text-anchor=\"middle\">"
      << xml_escape(panel.title) << "</text>\n";
    s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << right - left << "\" height=\"" << bottom - top
      << "\" fill=\"none\" stroke=\"#888\"/>\n";
    for (int t = 0; t <= 4; ++t) {
      double yv = y0 + (y1 - y0) * t / 4, xv = x0 + (x1 - x0) * t / 4;
      s << "<text x=\"" << left - 6 << "\" y=\"" << sy(yv) + 4 << "\" text-anchor=\"end\">" << tick_label(yv)
        << "</text>\n";
      s << "<line x1=\"" << left << "\" x2=\"" << right << "\" y1=\"" << sy(yv) << "\" y2=\"" << sy(yv)
        << "\" stroke=\"#eee\"/>\n";
      s << "<text x=\"" << sx(xv) << "\" y=\"" << bottom + 16 << "\" text-anchor=\"middle\">" << tick_label(xv)
        << "</text>\n";
    }
    s << "<text x=\"" << (left + right) / 2 << "\" y=\"" << bottom + 36 << "\" text-anchor=\"middle\">"
      << xml_escape(panel.x_label) << "</text>\n";
    s << "<text transform=\"translate(" << left - 45 << "," << (top + bottom) / 2
      << ") rotate(-90)\" text-anchor=\"middle\">" << xml_escape(panel.y_label) << "</text>\n";
    for (size_t k = 0; k < panel.series.size(); ++k) {
      const Series& ser = panel.series[k];
      const char* color = kColors[k % 5];
      s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
      for (auto [x, y] : ser.points)
        if (std::isfinite(x) && std::isfinite(y)) s << sx(x) << "," << sy(y) << " ";
      s << "\"/>\n";
      if (ser.points.size() <= 60)
        for (auto [x, y] : ser.points)
          if (std::isfinite(x) && std::isfinite(y))
            s << "<circle cx=\"" << sx(x) << "\" cy=\"" << sy(y) << "\" r=\"2.5\" fill=\"" << color << "\"/>\n";
      s << "<text x=\"" << right - 8 << "\" y=\"" << top + 16 + 15 * double(k) << "\" text-anchor=\"end\" fill=\""
        << color << "\">" << xml_escape(ser.label) << "</text>\n";
    }
  }
  s << "</svg>\n";

  const std::string text = s.str();
  AtomicFile file(path, path + ": cannot write the chart: ");
  file.write(text.data(), text.size());
  file.commit();
}

}  // namespace loom::samples
