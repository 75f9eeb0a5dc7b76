// Training metrics as JSON lines (one object per line, appended and flushed as it is
// written, so a crash loses at most the line being written and other tools can follow the
// file while training runs), and the same history drawn as an SVG chart.
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace loom::samples {

using MetricValue = std::variant<double, int64_t, std::string>;
using MetricRecord = std::vector<std::pair<std::string, MetricValue>>;

// The JSON text of one record, on one line (Json::dump_line, parallel/diagnostics/json.h):
// {"epoch": 3, "loss": 0.25, "model": "simplecnn"}. Non-finite numbers are written as null
// (JSON has no NaN).
std::string to_json(const MetricRecord& record);

class MetricsLog {
 public:
  MetricsLog() = default;
  // Opens `path` for appending (a resumed run continues the same file); "" logs nothing.
  explicit MetricsLog(const std::string& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const MetricRecord& record);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// One curve of a chart: (x, y) points and a legend label.
struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;
};

// A chart panel: a title, axis labels and its curves.
struct Panel {
  std::string title, x_label, y_label;
  std::vector<Series> series;
};

// Writes panels side by side as a standalone SVG file, atomically (engine/serialization.h's
// AtomicFile: symlinks followed, a path that is not a regular file refused, permissions
// kept). Throws loom::Error naming the file when it cannot be written.
void write_svg_chart(const std::string& path, const std::string& title, const std::vector<Panel>& panels);

}  // namespace loom::samples
