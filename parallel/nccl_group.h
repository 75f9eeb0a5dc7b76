// What the NCCL group's watchdog tells the other ranks, and how it reads them back.
//
// Each rank keeps "nccl/<group>/progress/<rank>" in the store: two decimal numbers, the
// sequence numbers (ProcessGroup::sequence_number) of the last collective of that group it
// has seen complete and of the last one it has issued ("12 14"); sends and receives are
// not counted, as only the ranks taking part see them. When collective #n times out, the
// waiting rank reads every other rank's entry: a rank whose last issued collective is
// below n has not reached it (it is slow, hung, or took another path through the
// program), and a rank with no entry never joined the group. The text is best effort:
// entries are published about once a second, and the store itself may be gone when rank 0
// (which serves a TcpStore) has died.
//
// Kept apart from nccl_group.cpp because it is plain text over numbers: it builds and is
// tested without NCCL or a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loom::dist::detail {

// The store key that holds `rank`'s progress in NCCL group number `group`.
std::string nccl_progress_key(int group, int rank);
// The value published under it.
std::string nccl_progress_value(int64_t completed, int64_t issued);

// One sentence naming the ranks that have not issued collective #`call`, from what the
// store held for each rank (`progress[r]`: nullopt when rank r has no entry); `call` 0
// asks which ranks never joined. `self` is the rank asking; its own entry is skipped.
std::string nccl_ranks_behind(int self, int64_t call, const std::vector<std::optional<std::string>>& progress);

}  // namespace loom::dist::detail
