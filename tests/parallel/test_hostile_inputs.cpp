// The programs run as a careless or hostile user would run them: a corpus of bad arguments,
// hostile output paths (devices, directories, fifos, missing and unwritable directories,
// symlinks), corrupt and mismatched checkpoints and data files. Every case must exit non-zero
// with a message naming the thing that was wrong, never abort (exit 134, std::terminate) or
// hang, and leave the files that were there before exactly as they were. meson passes the
// programs in TRAIN_CNN, TRAIN_GPT and BENCH_COLLECTIVES; the train_cnn cases need Debian's
// dataset-fashion-mnist and skip without it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "engine/serialization.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";

std::string program(const char* var) {
  const char* path = std::getenv(var);
  return path ? path : "";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

struct RunResult {
  int code = -1;
  std::string output;
};

// Runs `command` in `dir` under a deadline (exit 124 when it passes), stdout and stderr together.
RunResult run_in(const std::string& dir, const std::string& command, int seconds = 120) {
  const std::string log = dir + "/../hostile_run.log";
  const std::string full =
      "cd '" + dir + "' && timeout " + std::to_string(seconds) + " " + command + " > '" + log + "' 2>&1";
  const int status = std::system(full.c_str());
  RunResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.output = read_file(log);
  return r;
}

// A work directory (the corpus) beside the log, removed at the end.
struct Corpus {
  std::string root, dir;
  Corpus() {
    root = (fs::path(::testing::TempDir()) / ("loom_hostile_" + std::to_string(::getpid()))).string();
    fs::remove_all(root);
    dir = root + "/work";
    fs::create_directories(dir);
  }
  ~Corpus() {
    ::chmod(dir.c_str(), 0700);
    fs::remove_all(root);
  }
  std::string path(const std::string& name) const { return dir + "/" + name; }

  // Every file of the work directory and its bytes (symlinks as their target's name).
  std::map<std::string, std::string> snapshot() const {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      const std::string rel = fs::relative(e.path(), dir).string();
      if (e.is_symlink()) out[rel] = "-> " + fs::read_symlink(e.path()).string();
      else if (e.is_regular_file()) out[rel] = read_file(e.path().string());
      else out[rel] = e.is_directory() ? "(dir)" : "(other)";
    }
    return out;
  }
};

struct Case {
  std::string what;                // the command line after the program (shell words)
  std::vector<std::string> parts;  // each must appear in the output
};

// Runs every case and checks the corpus's promises; returns how many ran.
int run_cases(const Corpus& corpus, const std::string& prog, const std::vector<Case>& cases,
              const std::vector<std::string>& never_said = {}) {
  const std::map<std::string, std::string> before = corpus.snapshot();
  for (const Case& c : cases) {
    SCOPED_TRACE(fs::path(prog).filename().string() + " " + c.what);
    const RunResult r = run_in(corpus.dir, "'" + prog + "' " + c.what);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.code, 134) << "aborted:\n" << r.output;  // SIGABRT: std::terminate
    EXPECT_NE(r.code, 124) << "hung:\n" << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
    for (const std::string& part : c.parts) EXPECT_NE(r.output.find(part), std::string::npos) << part << " in:\n" << r.output;
    for (const std::string& part : never_said) EXPECT_EQ(r.output.find(part), std::string::npos) << part << " in:\n" << r.output;
    EXPECT_EQ(corpus.snapshot(), before) << "the files changed";
  }
  return int(cases.size());
}

// Rewrites a safetensors file with `change` applied to its tensors and metadata.
void rewrite(const std::string& from, const std::string& to, const std::function<void(SafetensorsFile&)>& change) {
  SafetensorsFile f = load_safetensors(from);
  change(f);
  save_safetensors(to, f.tensors, f.metadata);
}

void set_first(SafetensorsFile& f, const std::string& name, double value) {
  for (auto& [n, t] : f.tensors) {
    if (n != name) continue;
    std::vector<double> v = t.to(DType::f64).to_vector<double>();
    v[0] = value;
    t = from_vector(v, t.shape()).to(t.dtype());
  }
}

TEST(HostileInputs, TrainCnnCorpus) {
  if (!fs::exists(std::string(kFashionMnist) + "/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  ASSERT_FALSE(program("TRAIN_CNN").empty()) << "meson test sets TRAIN_CNN";
  Corpus c;
  const std::string quick = "--device cpu --subset 256 --test-subset 100 --epochs 1 --workers 0 --quiet --metrics ''";
  // A real checkpoint, and the files that make the corpus.
  RunResult made = run_in(c.dir, "'" + program("TRAIN_CNN") + "' " + quick + " --plot '' --save ck.safetensors");
  ASSERT_EQ(made.code, 0) << made.output;
  const auto meta = [](const char* key, const char* value) {
    return [=](SafetensorsFile& f) { f.metadata[key] = value; };
  };
  rewrite(c.path("ck.safetensors"), c.path("epoch_text.st"), meta("user.epoch", "one"));
  rewrite(c.path("ck.safetensors"), c.path("step_float.st"), meta("user.step", "1e3"));
  rewrite(c.path("ck.safetensors"), c.path("batch_negative.st"), meta("user.batch", "-1"));
  rewrite(c.path("ck.safetensors"), c.path("batch_empty.st"), meta("user.batch", ""));
  rewrite(c.path("ck.safetensors"), c.path("epoch_huge.st"), meta("user.epoch", "99999999999999999999999"));
  rewrite(c.path("ck.safetensors"), c.path("from_gpt.st"), [](SafetensorsFile& f) {
    f.metadata["user.program"] = "train_gpt", f.metadata["user.config"] = "tiny";
    f.metadata.erase("user.model");
  });
  rewrite(c.path("ck.safetensors"), c.path("nan.st"), [](SafetensorsFile& f) { set_first(f, "classifier.3.bias", NAN); });
  rewrite(c.path("ck.safetensors"), c.path("inf.st"), [](SafetensorsFile& f) { set_first(f, "features.0.weight", -INFINITY); });
  rewrite(c.path("ck.safetensors"), c.path("weights_only.st"), [](SafetensorsFile& f) { f.metadata.clear(); });
  const std::string ck = read_file(c.path("ck.safetensors"));
  write_file(c.path("truncated.st"), ck.substr(0, ck.size() - 1000));
  write_file(c.path("not_safetensors.txt"), "hello, I am a text file\n");
  fs::create_directory(c.path("a_dir"));
  ASSERT_EQ(::mkfifo(c.path("a_fifo").c_str(), 0600), 0);
  fs::create_symlink("a_fifo", c.path("link_to_fifo"));
  write_file(c.path("plain"), "x");
  // Fashion-MNIST whose test labels were cut short by 3 bytes (in the gzip trailer).
  fs::create_directory(c.path("fm_cut"));
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz"})
    fs::create_symlink(std::string(kFashionMnist) + "/" + f, c.path("fm_cut/") + f);
  const std::string labels = read_file(std::string(kFashionMnist) + "/t10k-labels-idx1-ubyte.gz");
  write_file(c.path("fm_cut/t10k-labels-idx1-ubyte.gz"), labels.substr(0, labels.size() - 3));
  // Test images of another shape than the training images (plain IDX: 12 of 28x28, 4 of 32x32).
  fs::create_directory(c.path("fm_shape"));
  const auto idx = [](std::vector<uint32_t> dims, size_t bytes) {
    std::string out = {0, 0, 8, char(dims.size())};
    for (uint32_t d : dims)
      for (int s = 24; s >= 0; s -= 8) out += char((d >> s) & 0xff);
    return out + std::string(bytes, '\x01');
  };
  write_file(c.path("fm_shape/train-images-idx3-ubyte"), idx({12, 28, 28}, 12 * 28 * 28));
  write_file(c.path("fm_shape/train-labels-idx1-ubyte"), idx({12}, 12));
  write_file(c.path("fm_shape/t10k-images-idx3-ubyte"), idx({4, 32, 32}, 4 * 32 * 32));
  write_file(c.path("fm_shape/t10k-labels-idx1-ubyte"), idx({4}, 4));

  const std::string q = quick + " --plot ''";
  const std::vector<Case> cases = {
      {q + " stray.txt", {"unexpected argument 'stray.txt'"}},
      {q + " --init ck.safetensors --resume ck.safetensors", {"--init ck.safetensors", "--resume ck.safetensors"}},
      {q + " --momentum 0.5", {"--momentum", "adam"}},
      {quick + " --plot /dev/null", {"--plot", "/dev/null", "character device"}},
      {q + " --save /dev/null", {"--save", "/dev/null", "character device"}},
      {q + " --save a_dir", {"--save", "a_dir", "is a directory"}},
      {q + " --save a_dir/", {"--save", "a_dir/", "is a directory"}},
      {quick + " --plot a_fifo", {"--plot", "a_fifo", "fifo"}},
      {q + " --save link_to_fifo", {"--save", "link_to_fifo", "fifo"}},
      {q + " --save missing/ck.safetensors", {"--save", "missing", "does not exist"}},
      {quick + " --plot '' --metrics a_fifo", {"a_fifo", "fifo that nothing reads"}},
      {quick + " --plot '' --metrics a_dir", {"a_dir", "Is a directory"}},
      {quick + " --plot missing/deeper/p.svg", {"--plot", "missing/deeper", "does not exist"}},
      {q + " --save plain/ck.safetensors", {"--save", "plain/ck.safetensors", "Not a directory"}},
      {q + " --save /proc/ck.safetensors", {"--save", "/proc"}},
      {q + " --resume epoch_text.st", {"epoch_text.st", "user.epoch", "'one'"}},
      {q + " --resume step_float.st", {"step_float.st", "user.step", "'1e3'"}},
      {q + " --resume batch_negative.st", {"batch_negative.st", "user.batch", "'-1'"}},
      {q + " --resume batch_empty.st", {"batch_empty.st", "user.batch", "''"}},
      {q + " --resume epoch_huge.st", {"epoch_huge.st", "user.epoch", "99999999999999999999999"}},
      {q + " --resume nan.st", {"--resume nan.st", "classifier.3.bias", "nan", "--allow-nonfinite"}},
      {q + " --init inf.st", {"--init inf.st", "features.0.weight", "inf"}},
      {q + " --resume from_gpt.st", {"from_gpt.st", "train_gpt", "config tiny"}},
      {q + " --resume weights_only.st", {"weights_only.st", "not a Loom training checkpoint"}},
      {q + " --resume truncated.st", {"truncated.st", "truncated"}},
      {q + " --resume not_safetensors.txt", {"not_safetensors.txt"}},
      {q + " --resume absent.st", {"absent.st", "No such file"}},
      {q + " --init not_safetensors.txt", {"not_safetensors.txt"}},
      {q + " --resume ck.safetensors --batch-size 64", {"--batch-size 128", "--batch-size 64"}},
      {q + " --resume ck.safetensors --seed 7", {"--seed 0", "--seed 7"}},
      {q + " --resume ck.safetensors --subset 200", {"training image count 256"}},
      {q + " --resume ck.safetensors --model resnet18", {"holds a simplecnn", "--model simplecnn"}},
      {q + " --resume ck.safetensors --optimizer sgd", {"--optimizer adam", "--optimizer sgd"}},
      {q + " --resume ck.safetensors --data cifar10 --data-dir a_dir", {"holds a simplecnn trained on fashion-mnist"}},
      {q + " --data-dir fm_cut", {"t10k-labels-idx1-ubyte.gz", "truncated"}},
      {"--device cpu --data-dir fm_shape --batch-size 4 --epochs 1 --quiet --metrics '' --plot ''",
       {"fm_shape/t10k-images-idx3-ubyte", "1x32x32", "fm_shape/train-images-idx3-ubyte", "1x28x28"}},
      {q + " --optimizer sgd --lr 1e30", {"the loss is", "at step", "--allow-nonfinite"}},
      {q + " --batch-size 100000", {"--batch-size 100000"}},
  };
  EXPECT_GE(run_cases(c, program("TRAIN_CNN"), cases), 35);

  // A gemm kernel set the CPU does not have, or that does not exist, is named with the ones it has.
  RunResult no_kernel = run_in(c.dir, "env LOOM_CPU_GEMM=sse9 '" + program("TRAIN_CNN") + "' " + q);
  EXPECT_NE(no_kernel.code, 0) << no_kernel.output;
  EXPECT_EQ(no_kernel.output.find("terminate called"), std::string::npos) << no_kernel.output;
  for (const char* part : {"LOOM_CPU_GEMM=sse9", "generic", "unset LOOM_CPU_GEMM"})
    EXPECT_NE(no_kernel.output.find(part), std::string::npos) << part << " in:\n" << no_kernel.output;

  // Allowed on purpose: non-finite weights with the flag, and a warning for a warm-up
  // longer than the run.
  RunResult allowed = run_in(c.dir, "'" + program("TRAIN_CNN") + "' " + q + " --init inf.st --allow-nonfinite --max-steps 1");
  EXPECT_EQ(allowed.code, 0) << allowed.output;
  RunResult warned = run_in(c.dir, "'" + program("TRAIN_CNN") + "' " + q + " --warmup 100 --max-steps 1");
  EXPECT_EQ(warned.code, 0) << warned.output;
  EXPECT_NE(warned.output.find("--warmup 100 is longer than the run's 1 steps"), std::string::npos) << warned.output;
}

TEST(HostileInputs, TrainCnnSaveFollowsALinkAndKeepsPermissions) {
  if (!fs::exists(std::string(kFashionMnist) + "/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  Corpus c;
  fs::create_directory(c.path("store"));
  write_file(c.path("store/ck.safetensors"), "old");
  ::chmod(c.path("store/ck.safetensors").c_str(), 0640);
  fs::create_symlink("store/ck.safetensors", c.path("ck.link"));
  fs::create_directory(c.path("charts"));
  fs::create_symlink("charts/loss.svg", c.path("chart.link"));  // dangling: the chart is created there
  const RunResult r = run_in(c.dir, "'" + program("TRAIN_CNN") +
                                        "' --device cpu --subset 256 --test-subset 100 --epochs 1 --workers 0 --quiet "
                                        "--metrics '' --save ck.link --plot chart.link");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::is_symlink(c.path("ck.link")));
  EXPECT_EQ(load_safetensors_metadata(c.path("ck.link")).at("user.program"), "train_cnn");
  struct stat st {};
  ASSERT_EQ(::stat(c.path("store/ck.safetensors").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  EXPECT_TRUE(fs::is_symlink(c.path("chart.link")));
  EXPECT_NE(read_file(c.path("charts/loss.svg")).find("<svg"), std::string::npos);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(c.path("store"))) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"ck.safetensors"});
}

TEST(HostileInputs, TrainGptCorpus) {
  ASSERT_FALSE(program("TRAIN_GPT").empty()) << "meson test sets TRAIN_GPT";
  Corpus c;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  write_file(c.path("corpus.txt"), text);
  const std::string quick =
      "--device cpu --data corpus.txt --config tiny --context 16 --batch-size 4 --max-steps 2 --workers 0 "
      "--metrics '' --plot ''";
  RunResult made = run_in(c.dir, "'" + program("TRAIN_GPT") + "' " + quick + " --generate 0 --save gpt.st");
  ASSERT_EQ(made.code, 0) << made.output;
  rewrite(c.path("gpt.st"), c.path("step_text.st"), [](SafetensorsFile& f) { f.metadata["user.step"] = "two"; });
  rewrite(c.path("gpt.st"), c.path("nan.st"),
          [](SafetensorsFile& f) { set_first(f, "transformer.h.1.mlp.c_fc.bias", NAN); });
  rewrite(c.path("gpt.st"), c.path("from_cnn.st"), [](SafetensorsFile& f) {
    f.metadata["user.program"] = "train_cnn", f.metadata["user.model"] = "resnet18";
    f.metadata["user.data"] = "cifar10";
  });
  rewrite(c.path("gpt.st"), c.path("old_cnn.st"), [](SafetensorsFile& f) {  // before programs named themselves
    f.metadata.erase("user.program"), f.metadata.erase("user.config");
    f.metadata["user.model"] = "simplecnn", f.metadata["optimizer"] = "Adam";
  });
  rewrite(c.path("gpt.st"), c.path("weights_only.st"), [](SafetensorsFile& f) { f.metadata.clear(); });
  write_file(c.path("plain"), "x");

  const std::string g = quick + " --generate 0";
  const std::vector<Case> cases = {
      {quick + " corpus.txt", {"unexpected argument 'corpus.txt'", "--data corpus.txt"}},
      {quick + " --shards 'nothing_*.bin'", {"--data corpus.txt", "--shards"}},
      {quick + " --prompt ''", {"--prompt is empty"}},
      {g + " --prompt hello", {"--prompt", "--generate 0"}},
      {g + " --top-k 5", {"--top-k", "--generate 0"}},
      {g + " --save /dev/null", {"--save", "/dev/null", "character device"}},
      {quick + " --generate 0 --plot /dev/zero", {"--plot", "/dev/zero", "character device"}},
      {g + " --save missing/gpt.st", {"--save", "missing", "does not exist"}},
      {g + " --save plain/gpt.st", {"--save", "Not a directory"}},
      {g + " --resume step_text.st", {"step_text.st", "user.step", "'two'"}},
      {g + " --resume nan.st", {"--resume nan.st", "transformer.h.1.mlp.c_fc.bias", "nan", "--allow-nonfinite"}},
      {g + " --resume from_cnn.st", {"from_cnn.st", "train_cnn", "resnet18"}},
      {g + " --resume old_cnn.st", {"old_cnn.st", "simplecnn"}},
      {g + " --resume weights_only.st", {"weights_only.st", "not a Loom training checkpoint", "--save"}},
      {g + " --resume gpt.st --context 8", {"--context 16", "--context 8"}},
      {g + " --resume gpt.st --batch-size 2", {"--batch-size 4", "--batch-size 2"}},
      {g + " --resume gpt.st --seed 3", {"--seed 0", "--seed 3"}},
      {"--device cpu --data corpus.txt --config guide --context 16 --batch-size 4 --generate 0 --metrics '' --plot '' "
       "--resume gpt.st",
       {"config tiny", "--config guide"}},
      {g + " --data absent.txt", {"absent.txt"}},
      {g + " --shards 'absent_*.bin' --data corpus.txt", {"--shards"}},
      {"--device cpu --shards 'absent_*.bin' --generate 0 --metrics '' --plot ''", {"absent_*.bin"}},
      {g + " --context 100000", {"--context 100000"}},
  };
  // train_gpt has no --optimizer, --init or --warmup: no message may send the user to them.
  EXPECT_GE(run_cases(c, program("TRAIN_GPT"), cases, {"--optimizer", "--init", "initial weights", "--warmup"}), 20);
}

TEST(HostileInputs, BenchCollectivesSizesBeyondTheMemoryAreErrors) {
  ASSERT_FALSE(program("BENCH_COLLECTIVES").empty()) << "meson test sets BENCH_COLLECTIVES";
  Corpus c;
  const std::vector<Case> cases = {
      {"--device cpu -b 64G", {"-e"}},
      {"--device cpu -b 64G -e 64G", {"-e/--maxbytes 64G", "GiB of host memory", "available"}},
      {"--device cpu -b 8 -e 900G --collective all_gather", {"-e/--maxbytes 900G", "all_gather"}},
      {"--device cpu -e 8589934592G", {"-e/--maxbytes"}},
      {"--device cpu stray", {"unexpected argument 'stray'"}},
      {"--device cpu -b 1Q", {"1Q"}},
  };
  EXPECT_EQ(run_cases(c, program("BENCH_COLLECTIVES"), cases), 6);
}

}  // namespace
}  // namespace loom
