// The Store entry points shared by every store: argument checks, the convenience forms,
// and the one timeout message, so that a hung rendezvous reads the same on any store.
#include "parallel/store.h"

#include <charconv>

#include "kernels/core/error.h"
#include "parallel/socket.h"

namespace loom::dist {

namespace {

void check_key(const std::string& key) { LOOM_CHECK(!key.empty(), "store keys must not be empty"); }

void check_keys(const std::vector<std::string>& keys) {
  for (const auto& key : keys) check_key(key);
}

std::string quoted_list(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  return out;
}

}  // namespace

void Store::set(const std::string& key, const Bytes& value) {
  check_key(key);
  set_impl(key, value);
}

void Store::set(const std::string& key, std::string_view value) { set(key, Bytes(value.begin(), value.end())); }

Bytes Store::get(const std::string& key) { return get(key, timeout_); }

Bytes Store::get(const std::string& key, Duration timeout) {
  check_key(key);
  return get_impl(key, bounded(timeout));
}

std::string Store::get_string(const std::string& key) {
  Bytes value = get(key);
  return std::string(value.begin(), value.end());
}

int64_t Store::add(const std::string& key, int64_t delta) {
  check_key(key);
  return add_impl(key, delta);
}

void Store::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void Store::wait(const std::vector<std::string>& keys, Duration timeout) {
  check_keys(keys);
  if (!keys.empty()) wait_impl(keys, bounded(timeout));
}

bool Store::check(const std::vector<std::string>& keys) {
  check_keys(keys);
  return keys.empty() || check_impl(keys);
}

bool Store::delete_key(const std::string& key) {
  check_key(key);
  return delete_key_impl(key);
}

void Store::fail_timeout(const std::vector<std::string>& keys, const std::vector<std::string>& missing,
                         std::chrono::steady_clock::time_point start) const {
  std::string what = keys.size() == 1 ? "key " + quoted_list(keys) : "keys " + quoted_list(keys);
  std::string still = keys.size() > 1 && !missing.empty() ? " (still missing: " + quoted_list(missing) + ")" : "";
  throw StoreTimeout(::loom::detail::str(describe(), ": timed out after ", net::elapsed_since(start),
                                        " waiting for ", what, still,
                                        ": did every rank start, and does every rank reach this point?"));
}

namespace detail {

int64_t counter_value(const std::string& key, const Bytes* value) {
  if (value == nullptr) return 0;
  int64_t out = 0;
  const char* first = reinterpret_cast<const char*>(value->data());
  const char* last = first + value->size();
  auto [end, ec] = std::from_chars(first, last, out);
  LOOM_CHECK(ec == std::errc() && end == last && first != last, "cannot add to store key '", key,
             "': it holds '", std::string(first, std::min<size_t>(value->size(), 40)),
             "', which is not a decimal integer (a key used with add() must only be set by add())");
  return out;
}

Bytes counter_bytes(int64_t value) {
  std::string text = std::to_string(value);
  return Bytes(text.begin(), text.end());
}

}  // namespace detail

int Store::take_group_number(const std::string& backend) {
  std::lock_guard lock(groups_mutex_);
  return groups_made_[backend]++;
}

// ---- PrefixStore ---------------------------------------------------------------------------

PrefixStore::PrefixStore(std::shared_ptr<Store> base, std::string prefix)
    : Store(base ? base->timeout() : kDefaultTimeout), base_(std::move(base)), prefix_(std::move(prefix)) {
  LOOM_CHECK(base_ != nullptr, "PrefixStore: the base store is null");
  LOOM_CHECK(!prefix_.empty(), "PrefixStore: the prefix must not be empty");
}

std::string PrefixStore::describe() const { return base_->describe() + " (keys under '" + prefix_ + "')"; }

std::vector<std::string> PrefixStore::prefixed(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(prefix_ + key);
  return out;
}

void PrefixStore::set_impl(const std::string& key, const Bytes& value) { base_->set(prefix_ + key, value); }
Bytes PrefixStore::get_impl(const std::string& key, Duration timeout) { return base_->get(prefix_ + key, timeout); }
int64_t PrefixStore::add_impl(const std::string& key, int64_t delta) { return base_->add(prefix_ + key, delta); }
void PrefixStore::wait_impl(const std::vector<std::string>& keys, Duration timeout) {
  base_->wait(prefixed(keys), timeout);
}
bool PrefixStore::check_impl(const std::vector<std::string>& keys) { return base_->check(prefixed(keys)); }
bool PrefixStore::delete_key_impl(const std::string& key) { return base_->delete_key(prefix_ + key); }

}  // namespace loom::dist
