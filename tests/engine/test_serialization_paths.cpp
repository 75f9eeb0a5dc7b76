// What a save does with what is already at its path (engine/serialization.h, AtomicFile):
// symlinks are followed and kept, a device, directory or fifo is refused before anything is
// written, permissions are kept, killed saves' temporary files are cleaned up, and
// check_output_path fails up front for every path a save would fail on.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "engine/serialization.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/loom_paths_XXXXXX";
    EXPECT_NE(::mkdtemp(name), nullptr) << std::strerror(errno);
    path = name;
  }
  ~TempDir() {
    ::chmod(path.c_str(), 0700);
    fs::remove_all(path);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
  std::vector<std::string> names(const std::string& sub = "") const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path + "/" + sub)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a loom::Error holding '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' missing from: " << e.what();
  }
}

double first_value(const std::string& path) { return load_safetensors_map(path).at("w").to_vector<double>()[0]; }

// A pid that ran a moment ago and runs no more.
pid_t dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

TEST(AtomicSave, FollowsSymlinksToTheirTargetAndKeepsTheLinks) {
  TempDir dir;
  fs::create_directory(dir.file("real"));
  save_safetensors(dir.file("real/ck.safetensors"), {{"w", zeros({2})}});
  fs::create_symlink("real/ck.safetensors", dir.file("link1"));  // relative
  fs::create_symlink(dir.file("link1"), dir.file("link2"));       // absolute, to a link
  save_safetensors(dir.file("link2"), {{"w", ones({2})}});
  EXPECT_TRUE(fs::is_symlink(dir.file("link1")));
  EXPECT_TRUE(fs::is_symlink(dir.file("link2")));
  EXPECT_EQ(first_value(dir.file("real/ck.safetensors")), 1.0);
  EXPECT_EQ(dir.names(), (std::vector<std::string>{"link1", "link2", "real"}));
  EXPECT_EQ(dir.names("real"), std::vector<std::string>{"ck.safetensors"});
  EXPECT_EQ(resolve_output_path(dir.file("link2")), dir.file("real/ck.safetensors"));
}

TEST(AtomicSave, ADanglingSymlinkCreatesItsTarget) {
  TempDir dir;
  fs::create_symlink("new.safetensors", dir.file("link"));
  save_safetensors(dir.file("link"), {{"w", ones({1})}});
  EXPECT_TRUE(fs::is_symlink(dir.file("link")));
  EXPECT_EQ(first_value(dir.file("new.safetensors")), 1.0);
}

TEST(AtomicSave, RefusesWhatIsNotARegularFileBeforeWriting) {
  TempDir dir;
  fs::create_directory(dir.file("a_dir"));
  ASSERT_EQ(::mkfifo(dir.file("a_fifo").c_str(), 0600), 0);
  fs::create_symlink("a_fifo", dir.file("link_to_fifo"));
  struct Case {
    std::string path, kind;
  };
  for (const Case& c : {Case{dir.file("a_dir"), "is a directory"}, Case{dir.file("a_dir/"), "is a directory"},
                        Case{dir.file("a_fifo"), "is a fifo"}, Case{dir.file("link_to_fifo"), "is a fifo"}}) {
    SCOPED_TRACE(c.path);
    expect_error([&] { save_safetensors(c.path, {{"w", ones({2})}}); }, {c.path, c.kind, "not a regular file"});
    expect_error([&] { check_output_path(c.path, "--save"); }, {"--save", c.path, c.kind});
  }
  EXPECT_TRUE(fs::is_directory(dir.file("a_dir")));
  EXPECT_TRUE(fs::is_fifo(dir.file("a_fifo")));
  EXPECT_EQ(dir.names(), (std::vector<std::string>{"a_dir", "a_fifo", "link_to_fifo"}));
  EXPECT_TRUE(dir.names("a_dir").empty());
  // A device is refused by the same check, so it is asked here without risking a write.
  expect_error([] { resolve_output_path("/dev/null"); }, {"/dev/null", "is a character device"});
  expect_error([] { check_output_path("/dev/null", "--plot"); }, {"--plot", "/dev/null", "character device"});
  struct stat st {};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST(AtomicSave, KeepsTheFilesPermissions) {
  TempDir dir;
  const std::string path = dir.file("ck.safetensors");
  for (mode_t mode : {mode_t(0600), mode_t(0640), mode_t(0444)}) {
    SCOPED_TRACE(mode);
    save_safetensors(path, {{"w", zeros({2})}});
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
    save_safetensors(path, {{"w", ones({2})}});
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, mode);
    EXPECT_EQ(first_value(path), 1.0);
    ::chmod(path.c_str(), 0600);
  }
}

TEST(AtomicSave, RemovesTemporaryFilesOfKilledSavesAndSaysSo) {
  TempDir dir;
  const std::string path = dir.file("ck.safetensors");
  const std::string dead = "ck.safetensors.tmp-" + std::to_string(dead_pid());
  const std::string live = "ck.safetensors.tmp-" + std::to_string(::getppid());
  const std::vector<std::string> kept = {"ck.safetensors.tmp-notapid", "other.safetensors.tmp-" +
                                         dead.substr(dead.rfind('-') + 1)};
  for (const std::string& name : std::vector<std::string>{dead, live, kept[0], kept[1]})
    write_text(dir.file(name), "half a checkpoint");
  testing::internal::CaptureStderr();
  save_safetensors(path, {{"w", ones({2})}});
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find(dir.file(dead)), std::string::npos) << said;
  EXPECT_NE(said.find("no longer runs"), std::string::npos) << said;
  EXPECT_FALSE(fs::exists(dir.file(dead)));
  EXPECT_TRUE(fs::exists(dir.file(live)));  // a save that may still be running
  for (const std::string& name : kept) EXPECT_TRUE(fs::exists(dir.file(name))) << name;
  EXPECT_EQ(first_value(path), 1.0);
}

TEST(AtomicSave, AFileNotCommittedLeavesTheTargetAsItWas) {
  TempDir dir;
  const std::string path = dir.file("chart.svg");
  write_text(path, "old");
  {
    AtomicFile f(path);
    f.write("new", 3);
  }
  EXPECT_EQ(read_text(path), "old");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"chart.svg"});
  AtomicFile f(path);
  f.write("new", 3);
  f.commit();
  EXPECT_EQ(read_text(path), "new");
}

TEST(CheckOutputPath, FailsUpFrontWhereASaveWouldFailAndLeavesNoFile) {
  TempDir dir;
  write_text(dir.file("plain"), "x");
  struct Case {
    std::string path;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {dir.file("missing/ck.safetensors"), {"--save", "missing", "does not exist"}},
      {dir.file("plain/ck.safetensors"), {"--save", "Not a directory"}},
      {"", {"empty path"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path);
    expect_error([&] { check_output_path(c.path, "--save"); }, c.parts);
  }
  check_output_path(dir.file("new.safetensors"), "--save");
  check_output_path(dir.file("plain"), "--save");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"plain"});
  EXPECT_EQ(read_text(dir.file("plain")), "x");
}

TEST(CheckOutputPath, AReadOnlyDirectoryIsNamed) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: a read-only directory is still writable";
  TempDir dir;
  fs::create_directory(dir.file("ro"));
  ASSERT_EQ(::chmod(dir.file("ro").c_str(), 0500), 0);
  expect_error([&] { check_output_path(dir.file("ro/ck.safetensors"), "--save"); },
               {"--save", dir.file("ro"), "Permission denied"});
  ::chmod(dir.file("ro").c_str(), 0700);
}

TEST(SafetensorsMetadata, ReadsTheHeaderAlone) {
  TempDir dir;
  const std::string path = dir.file("ck.safetensors");
  save_safetensors(path, {{"w", ones({1000})}}, {{"user.epoch", "3"}});
  // The tensor bytes cut off: the header is still whole, and all that is read.
  fs::resize_file(path, fs::file_size(path) - 100);
  EXPECT_EQ(load_safetensors_metadata(path).at("user.epoch"), "3");
  expect_error([&] { load_safetensors(path); }, {path, "truncated"});
  expect_error([&] { load_safetensors_metadata(dir.file("absent")); }, {dir.file("absent"), "No such file"});
}

}  // namespace
}  // namespace loom
