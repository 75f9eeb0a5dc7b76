// DeviceMesh: the world's ranks laid out as a grid, one dimension per strategy, as
// PyTorch's init_device_mesh. DeviceMesh(world, {2, 4}, {"pp", "dp"}) puts 8 ranks in 2 rows
// of 4, row-major:
//
//              dp=0  dp=1  dp=2  dp=3
//       pp=0      0     1     2     3
//       pp=1      4     5     6     7
//
// Rank 5 sits at (pp=1, dp=1). Along "dp" its group is its row, ranks {4, 5, 6, 7}: the
// replicas of the same pipeline stage, whose gradients DDP averages. Along "pp" its group is
// its column, ranks {1, 5}: the stages of one pipeline, which pass activations and
// gradients to each other. Data-parallel neighbours are adjacent ranks, so with one
// process per GPU they share a node (and NVLink) whenever dp divides the GPUs of a node.
//
// The mesh makes every group of every dimension through ProcessGroup::new_group, on every
// rank in the same order (each rank keeps the groups it belongs to), so all ranks must build
// the same mesh at the same point of the program.
//
// flatten() joins adjacent dimensions into one more group, as PyTorch's mesh[...]._flatten():
// on DeviceMesh(world, {2, 2, 2}, {"pp", "replicate", "shard"}), flatten({"replicate",
// "shard"}, "dp") gives each rank the 4 ranks of its pp row, in mesh order, under "dp": the
// data-parallel replicas of a stage that HSDP shards along "shard" and replicates along
// "replicate" (parallel/fsdp.h, step 8).
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "process_group.h"

namespace loom::dist {

class DeviceMesh {
 public:
  // `shape`'s product must be world->size(); `names` one per dimension, distinct.
  DeviceMesh(std::shared_ptr<ProcessGroup> world, std::vector<int> shape, std::vector<std::string> names);

  int ndim() const { return int(shape_.size()); }
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& names() const { return names_; }
  // The length of dimension `name`; throws naming the dimensions when there is none.
  int size(const std::string& name) const;
  // This rank's coordinate along `name` (its rank in group(name)).
  int coordinate(const std::string& name) const;
  // The ranks that differ from this one along `name` only, as a group (`name` may be a
  // flattened one's, whose size and coordinate the two above give too).
  const std::shared_ptr<ProcessGroup>& group(const std::string& name) const;
  // Joins the adjacent dimensions `names` (in mesh order) into a group named `as`: the ranks
  // that differ from this one along those dimensions only, ordered as the mesh orders them.
  // Every rank calls it at the same point (it creates groups); returns this rank's.
  std::shared_ptr<ProcessGroup> flatten(const std::vector<std::string>& names, const std::string& as);
  const std::shared_ptr<ProcessGroup>& world() const { return world_; }

  // The world rank at `coordinates` (one per dimension), and the reverse.
  int rank_at(const std::vector<int>& coordinates) const;
  std::vector<int> coordinates_of(int rank) const;

  // The grid as a table of world ranks, as in the header comment (a 3-D mesh prints one
  // table per index of its first dimension).
  std::string table() const;

 private:
  int dimension(const std::string& name) const;

  std::shared_ptr<ProcessGroup> world_;
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> coordinates_;                       // this rank's
  std::vector<std::shared_ptr<ProcessGroup>> groups_;  // this rank's, one per dimension
  struct Flattened {
    std::string name;
    int size = 0, coordinate = 0;
    std::shared_ptr<ProcessGroup> group;
  };
  std::deque<Flattened> flattened_;  // a deque: group() hands out references into it
  const Flattened* find_flattened(const std::string& name) const;
};

}  // namespace loom::dist
