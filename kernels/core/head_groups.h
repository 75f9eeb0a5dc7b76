// The grid layout of the Hopper attention kernels (kernels/cuda/attention_wgmma*.cu), in
// groups of heads. A grid of heads x per_head blocks (a head's query tiles in the forward,
// its key blocks in the backward) runs group by group, a group being `group` heads' blocks
// (the last group the heads left), and inside a group the index within the head slowest:
// block b of a group is head b % heads_in_group, index b / heads_in_group. The blocks
// resident at once then read, and with dQ's sums write, a few heads' rows, which stay in
// L2, while each group still starts with its longest blocks (causal's first key blocks,
// last query tiles). Here so the host can test the layout: every (head, index) once.
#pragma once

#include <algorithm>
#include <cstdint>

#include "host_device.h"

namespace loom::head_groups {

struct Place {
  unsigned head, index;
};

// Block `block`'s head and index within it. 32-bit division (heads * per_head < 2^31), as
// the kernels' other per-block arithmetic.
LOOM_HOST_DEVICE Place place(unsigned block, unsigned heads, unsigned per_head, unsigned group) {
  const unsigned span = group * per_head, g = block / span, first = g * group, within = block - g * span;
  const unsigned in_group = heads - first < group ? heads - first : group;
  return {first + within % in_group, within / in_group};
}

// Heads per group for about `wanted` heads a group: at least 1, at most `heads`, and the
// heads spread evenly over the groups that makes, so the last group is nearly as large as
// the others (a small last group would start its longest blocks too close to the grid's
// end, leaving SMs idle while they finish).
inline int64_t balanced(int64_t heads, int64_t wanted) {
  heads = std::max<int64_t>(heads, 1);
  wanted = std::clamp<int64_t>(wanted, 1, heads);
  const int64_t groups = (heads + wanted - 1) / wanted;
  return (heads + groups - 1) / groups;
}

}  // namespace loom::head_groups
