// FileStore: c10d's file store. The file is a log of records appended under an exclusive
// flock; readers take a shared flock and replay only what was appended since their last
// look, so each process keeps a cached map and an offset. A record is
//   kind(u8: 0 set, 1 delete) key_len(u32) key value_len(u32) value     (little-endian)
// Nothing is rewritten in place, so a reader never sees half a record from a live
// writer. Waiting is polling with a growing sleep: no process can notify another here.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "kernels/core/error.h"
#include "parallel/socket.h"
#include "parallel/store.h"

namespace loom::dist {

using Clock = std::chrono::steady_clock;

namespace {

enum class Record : uint8_t { set = 0, del = 1 };
constexpr char kUsersKey[] = "__loom/filestore/finished";

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

uint32_t get_u32(const std::string& in, size_t pos) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(in[pos + i])) << (8 * i);
  return v;
}

}  // namespace

struct FileStoreState {
  std::mutex mutex;  // guards the cache and the offset for threads sharing this store
  std::unordered_map<std::string, Bytes> cache;
  off_t offset = 0;
};

// Opens the file and holds a flock on it for one operation.
class LockedFile {
 public:
  LockedFile(const std::string& path, int how) {
    fd_.reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    LOOM_CHECK(fd_.valid(), "FileStore cannot open ", path, ": ", std::strerror(errno),
               " (is its folder there and writable by every rank?)");
    int rc;
    while ((rc = ::flock(fd_.get(), how)) != 0 && errno == EINTR) {
    }
    LOOM_CHECK(rc == 0, "FileStore cannot lock ", path, ": ", std::strerror(errno));
  }
  ~LockedFile() {
    if (fd_.valid()) ::flock(fd_.get(), LOCK_UN);
  }
  int fd() const { return fd_.get(); }

 private:
  net::Fd fd_;
};

FileStore::FileStore(std::string path, int world_size, Duration timeout)
    : Store(timeout), path_(std::move(path)), world_size_(world_size), state_(std::make_unique<FileStoreState>()) {
  LOOM_CHECK(!path_.empty(), "FileStore needs a file path, got an empty one");
  LOOM_CHECK(world_size >= 0, "FileStore world_size must be >= 0 (0: never delete the file), got ", world_size);
  LockedFile file(path_, LOCK_SH);  // creates the file, and fails early on a bad path
}

FileStore::~FileStore() {
  if (world_size_ == 0) return;
  try {
    if (add(kUsersKey, 1) >= world_size_) ::unlink(path_.c_str());
  } catch (const Error&) {
    // Never throw from a destructor; the file is then left for the user to remove.
  }
}

std::string FileStore::describe() const { return "FileStore at " + path_; }

namespace {

// Replays the records appended since state.offset into state.cache.
void refresh(const std::string& path, int fd, FileStoreState& state) {
  struct stat st{};
  LOOM_CHECK(::fstat(fd, &st) == 0, "FileStore cannot stat ", path, ": ", std::strerror(errno));
  if (st.st_size < state.offset) {  // the file was removed and made again: start over
    state.cache.clear();
    state.offset = 0;
  }
  if (st.st_size == state.offset) return;
  std::string data(static_cast<size_t>(st.st_size - state.offset), '\0');
  size_t got = 0;
  while (got < data.size()) {
    ssize_t n = ::pread(fd, data.data() + got, data.size() - got, state.offset + static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    LOOM_CHECK(n > 0, "FileStore cannot read ", path, ": ", n == 0 ? "file shrank" : std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  size_t pos = 0;
  auto corrupt = [&] {
    LOOM_FAIL("FileStore file ", path, " is corrupt at byte ", state.offset + static_cast<off_t>(pos),
              " (a process died while writing, or it is not a FileStore file): remove it and start again");
  };
  while (pos < data.size()) {
    if (data.size() - pos < 5) corrupt();
    auto kind = static_cast<Record>(data[pos]);
    uint32_t key_len = get_u32(data, pos + 1);
    if (kind != Record::set && kind != Record::del) corrupt();
    if (data.size() - pos - 5 < key_len + size_t{4}) corrupt();
    std::string key = data.substr(pos + 5, key_len);
    uint32_t value_len = get_u32(data, pos + 5 + key_len);
    size_t value_at = pos + 9 + key_len;
    if (data.size() - value_at < value_len) corrupt();
    if (kind == Record::set)
      state.cache[key] = Bytes(data.begin() + static_cast<ptrdiff_t>(value_at),
                               data.begin() + static_cast<ptrdiff_t>(value_at + value_len));
    else
      state.cache.erase(key);
    pos = value_at + value_len;
  }
  state.offset = st.st_size;
}

void append(const std::string& path, int fd, Record kind, const std::string& key, const Bytes& value) {
  std::string record(1, static_cast<char>(kind));
  put_u32(record, static_cast<uint32_t>(key.size()));
  record += key;
  put_u32(record, static_cast<uint32_t>(value.size()));
  record.append(reinterpret_cast<const char*>(value.data()), value.size());
  off_t end = ::lseek(fd, 0, SEEK_END);
  LOOM_CHECK(end >= 0, "FileStore cannot seek in ", path, ": ", std::strerror(errno));
  net::write_all(fd, record.data(), record.size(), "FileStore " + path);
}

}  // namespace

void FileStore::set_impl(const std::string& key, const Bytes& value) {
  std::lock_guard lock(state_->mutex);
  LockedFile file(path_, LOCK_EX);
  append(path_, file.fd(), Record::set, key, value);
}

Bytes FileStore::get_impl(const std::string& key, Duration timeout) {
  auto start = Clock::now();
  auto sleep = std::chrono::milliseconds(1);
  while (true) {
    {
      std::lock_guard lock(state_->mutex);
      LockedFile file(path_, LOCK_SH);
      refresh(path_, file.fd(), *state_);
      if (auto it = state_->cache.find(key); it != state_->cache.end()) return it->second;
    }
    if (Clock::now() - start >= timeout) fail_timeout({key}, {key}, start);
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(100));
  }
}

int64_t FileStore::add_impl(const std::string& key, int64_t delta) {
  std::lock_guard lock(state_->mutex);
  LockedFile file(path_, LOCK_EX);
  refresh(path_, file.fd(), *state_);
  auto it = state_->cache.find(key);
  int64_t value = detail::counter_value(key, it == state_->cache.end() ? nullptr : &it->second) + delta;
  append(path_, file.fd(), Record::set, key, detail::counter_bytes(value));
  return value;
}

void FileStore::wait_impl(const std::vector<std::string>& keys, Duration timeout) {
  auto start = Clock::now();
  auto sleep = std::chrono::milliseconds(1);
  while (true) {
    std::vector<std::string> missing;
    {
      std::lock_guard lock(state_->mutex);
      LockedFile file(path_, LOCK_SH);
      refresh(path_, file.fd(), *state_);
      for (const auto& key : keys)
        if (!state_->cache.contains(key)) missing.push_back(key);
    }
    if (missing.empty()) return;
    if (Clock::now() - start >= timeout) fail_timeout(keys, missing, start);
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(100));
  }
}

bool FileStore::check_impl(const std::vector<std::string>& keys) {
  std::lock_guard lock(state_->mutex);
  LockedFile file(path_, LOCK_SH);
  refresh(path_, file.fd(), *state_);
  return std::all_of(keys.begin(), keys.end(), [&](const auto& key) { return state_->cache.contains(key); });
}

bool FileStore::delete_key_impl(const std::string& key) {
  std::lock_guard lock(state_->mutex);
  LockedFile file(path_, LOCK_EX);
  refresh(path_, file.fd(), *state_);
  bool existed = state_->cache.contains(key);
  if (existed) append(path_, file.fd(), Record::del, key, {});
  return existed;
}

}  // namespace loom::dist
