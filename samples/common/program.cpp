#include "samples/common/program.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <new>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "kernels/core/error.h"

namespace loom::samples {

int run_guarded(const char* program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: out of memory: a size or count asked for more memory than this machine could give; "
                 "lower it\n", program);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: stopped by an exception of unknown type\n", program);
  }
  return 1;
}

void reject_positional(const Flags& flags, const std::vector<std::string>& positional, const std::string& hint) {
  if (positional.empty()) return;
  flags.fail("unexpected argument '" + positional[0] + "': this program takes only --flags" +
             (hint.empty() ? "" : " (" + hint + ")"));
}

void check_output_paths(const Flags& flags, const std::vector<std::pair<std::string, std::string>>& paths) {
  for (const auto& [flag, path] : paths) {
    if (path.empty()) continue;
    try {
      check_output_path(path, flag);
    } catch (const Error& e) {
      flags.fail(e.what());
    }
  }
}

std::map<std::string, std::string> checkpoint_entries(const Flags& flags, const std::string& path,
                                                      const std::string& program) {
  const std::map<std::string, std::string> meta = load_safetensors_metadata(path);
  auto format = meta.find("format");
  if (format == meta.end() || format->second != "loom-training-checkpoint")
    flags.fail("--resume " + path + " is not a Loom training checkpoint (its metadata has no format = "
               "loom-training-checkpoint): " + program + " resumes the checkpoints it writes with --save");
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : meta)
    if (key.starts_with("user.")) out.emplace(key.substr(5), value);
  return out;
}

int64_t checkpoint_integer(const std::string& path, const std::map<std::string, std::string>& entries,
                           const std::string& key, const std::string& program) {
  auto it = entries.find(key);
  LOOM_CHECK(it != entries.end(), path, ": the checkpoint has no user.", key, " entry; was it written by ", program,
             "?");
  const std::string& text = it->second;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  LOOM_CHECK(!text.empty() && ec == std::errc() && end == text.data() + text.size() && v >= 0, path,
             ": checkpoint entry user.", key, " = '", text, "' is not a whole number >= 0, as ", program,
             " writes it: the file was changed after it was saved");
  return v;
}

void check_saved_settings(const Flags& flags, const std::string& path, const std::map<std::string, std::string>& entries,
                          const std::vector<SavedSetting>& settings) {
  for (const SavedSetting& s : settings) {
    auto it = entries.find(s.key);
    if (it == entries.end() || it->second == s.value) continue;
    flags.fail("--resume " + path + " was saved with " + s.flag + " " + it->second + ", this run has " + s.flag + " " +
               s.value + ": " + s.why + "; resume with " + s.flag + " " + it->second);
  }
}

void check_finite_parameters(const nn::Module& model, const std::string& source) {
  NoGradGuard no_grad;
  for (const auto& [name, p] : model.named_parameters()) {
    // x * 0 is 0 for a finite x and NaN for a NaN or an infinity: one reduction per tensor.
    if (std::isfinite(sum(mul(p.detach(), 0.0)).item())) continue;
    const std::vector<double> values = p.detach().to(Device::cpu()).to(DType::f64).contiguous().to_vector<double>();
    size_t i = 0;
    while (i < values.size() && std::isfinite(values[i])) ++i;
    LOOM_FAIL(source, ": parameter '", name, "' holds ", i < values.size() ? std::to_string(values[i]) : "a non-finite value",
              " at element ", i, " of ", values.size(), ", the first value that is not finite: a run from it trains on ",
              "NaN; start from other weights, or pass ", kAllowNonfiniteFlag, " to train anyway");
  }
}

void check_finite_loss(double loss, int64_t step, bool exact) {
  if (std::isfinite(loss)) return;
  LOOM_FAIL("the loss is ", loss, " at step ", step,
            exact ? "" : " (the first step at which it was read: on a GPU it is read every few steps)",
            ": training stopped (a learning rate too high for this model? lower --lr, or add --clip); pass ",
            kAllowNonfiniteFlag, " to go on regardless");
}

}  // namespace loom::samples
