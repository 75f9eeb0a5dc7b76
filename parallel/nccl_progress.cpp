// The progress entries NCCL groups publish in the store, and the naming of the ranks that
// have not reached a call from them (nccl_group.h): plain text, independent of NCCL.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "parallel/nccl_group.h"
#include "parallel/rendezvous.h"

namespace loom::dist::detail {

std::string nccl_progress_key(int group, int rank) {
  return "nccl/" + std::to_string(group) + "/progress/" + std::to_string(rank);
}

std::string nccl_progress_value(int64_t completed, int64_t issued) {
  return std::to_string(completed) + " " + std::to_string(issued);
}

namespace {

// The issued count in a progress value, or nothing when it is not two integers.
std::optional<int64_t> issued_count(std::string_view value) {
  size_t space = value.find(' ');
  if (space == std::string_view::npos || !parse_integer(value.substr(0, space))) return std::nullopt;
  return parse_integer(value.substr(space + 1));
}

std::string ranks_text(const std::vector<std::string>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + ranks[i];
  return out;
}

}  // namespace

std::string nccl_ranks_behind(int self, int64_t call, const std::vector<std::optional<std::string>>& progress) {
  std::vector<std::string> behind, absent, unreadable;
  int others = 0;
  for (int r = 0; r < static_cast<int>(progress.size()); ++r) {
    if (r == self) continue;
    ++others;
    if (!progress[r]) {
      absent.push_back(std::to_string(r));
    } else if (auto issued = issued_count(*progress[r]); !issued) {
      unreadable.push_back(std::to_string(r));
    } else if (*issued < call) {
      behind.push_back(std::to_string(r) + " (issued " + std::to_string(*issued) + ")");
    }
  }
  if (others == 0) return "this group has no other rank, so none can be behind";
  std::vector<std::string> parts;
  if (!behind.empty())
    parts.push_back(ranks_text(behind) + (behind.size() == 1 ? " has" : " have") + " not issued collective #" +
                    std::to_string(call) + " of this group yet: look at what " +
                    (behind.size() == 1 ? "it is" : "they are") + " doing");
  if (!absent.empty())
    parts.push_back(ranks_text(absent) + " never joined this group (no progress entry in the store)");
  if (!unreadable.empty()) parts.push_back(ranks_text(unreadable) + " left a progress entry that is not two numbers");
  if (parts.empty()) {
    return call == 0 ? "every rank has joined, so NCCL's own bootstrap is stuck: can the nodes reach each other "
                       "(NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO)?"
                     : "every other rank has issued collective #" + std::to_string(call) +
                           " too, so none is behind: they are all stuck in it (a peer that died inside it, or a "
                           "network or GPU fault; NCCL_DEBUG=WARN shows NCCL's view)";
  }
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "; " : "") + parts[i];
  return out;
}

}  // namespace loom::dist::detail
