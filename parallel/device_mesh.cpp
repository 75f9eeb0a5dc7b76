#include "parallel/device_mesh.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "kernels/core/error.h"

namespace loom::dist {

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<ProcessGroup> world, std::vector<int> shape, std::vector<std::string> names)
    : world_(std::move(world)), shape_(std::move(shape)), names_(std::move(names)) {
  LOOM_CHECK(world_ != nullptr, "DeviceMesh: the world group is null");
  LOOM_CHECK(!shape_.empty(), "DeviceMesh: the shape is empty; expected one length per dimension, e.g. {pp, dp}");
  LOOM_CHECK(names_.size() == shape_.size(), "DeviceMesh: ", shape_.size(), " dimensions but ", names_.size(),
             " names (", joined(names_), "); expected one name per dimension");
  std::set<std::string> distinct(names_.begin(), names_.end());
  LOOM_CHECK(distinct.size() == names_.size(), "DeviceMesh: dimension names must be distinct, got ", joined(names_));
  int64_t product = 1;
  std::string text;
  for (int n : shape_) {
    LOOM_CHECK(n >= 1, "DeviceMesh: every dimension needs a length of at least 1, got ", n);
    product *= n;
    text += (text.empty() ? "" : " x ") + std::to_string(n);
  }
  LOOM_CHECK(product == world_->size(), "DeviceMesh: a ", text, " mesh (", joined(names_), ") holds ", product,
             " ranks but the world has ", world_->size(), ": the lengths must multiply to the world size");
  coordinates_ = coordinates_of(world_->rank());

  // Along dimension d, every line of the grid (the other coordinates fixed) is a group; all
  // ranks create all of them in the same order.
  for (int d = 0; d < ndim(); ++d) {
    std::shared_ptr<ProcessGroup> mine;
    for (int r = 0; r < world_->size(); ++r) {
      std::vector<int> c = coordinates_of(r);
      if (c[d] != 0) continue;  // r starts a line along d
      std::vector<int> line;
      for (int i = 0; i < shape_[d]; ++i) {
        c[d] = i;
        line.push_back(rank_at(c));
      }
      auto group = world_->new_group(line);
      if (group) mine = group;
    }
    LOOM_ASSERT(mine != nullptr, "DeviceMesh: rank ", world_->rank(), " is in no group along ", names_[d]);
    groups_.push_back(mine);
  }
}

int DeviceMesh::dimension(const std::string& name) const {
  for (int d = 0; d < ndim(); ++d)
    if (names_[d] == name) return d;
  std::vector<std::string> known = names_;
  for (const Flattened& f : flattened_) known.push_back(f.name);
  LOOM_FAIL("DeviceMesh: no dimension '", name, "'; the mesh has ", joined(known));
}

const DeviceMesh::Flattened* DeviceMesh::find_flattened(const std::string& name) const {
  for (const Flattened& f : flattened_)
    if (f.name == name) return &f;
  return nullptr;
}

int DeviceMesh::size(const std::string& name) const {
  if (const Flattened* f = find_flattened(name)) return f->size;
  return shape_[dimension(name)];
}
int DeviceMesh::coordinate(const std::string& name) const {
  if (const Flattened* f = find_flattened(name)) return f->coordinate;
  return coordinates_[dimension(name)];
}
const std::shared_ptr<ProcessGroup>& DeviceMesh::group(const std::string& name) const {
  if (const Flattened* f = find_flattened(name)) return f->group;
  return groups_[dimension(name)];
}

std::shared_ptr<ProcessGroup> DeviceMesh::flatten(const std::vector<std::string>& names, const std::string& as) {
  LOOM_CHECK(!names.empty(), "DeviceMesh::flatten: no dimensions given to join into '", as, "'");
  std::vector<int> dims;
  for (const std::string& n : names) {
    LOOM_CHECK(find_flattened(n) == nullptr, "DeviceMesh::flatten: '", n, "' is a flattened group already; join "
               "the mesh's own dimensions (", joined(names_), ")");
    dims.push_back(dimension(n));
  }
  for (size_t i = 1; i < dims.size(); ++i)
    LOOM_CHECK(dims[i] == dims[i - 1] + 1, "DeviceMesh::flatten: ", joined(names), " are not adjacent dimensions in "
               "mesh order (", joined(names_), ")");
  LOOM_CHECK(std::find(names_.begin(), names_.end(), as) == names_.end() && find_flattened(as) == nullptr,
             "DeviceMesh::flatten: the mesh has a dimension '", as, "' already");
  const int first = dims.front(), last = dims.back();
  Flattened f{.name = as, .size = 1, .coordinate = 0, .group = nullptr};
  for (int d = first; d <= last; ++d) {
    f.size *= shape_[d];
    f.coordinate = f.coordinate * shape_[d] + coordinates_[d];
  }
  // Every block of the grid (the other coordinates fixed) is a group, its ranks in mesh order;
  // all ranks create all of them in the same order.
  for (int r = 0; r < world_->size(); ++r) {
    std::vector<int> c = coordinates_of(r);
    bool starts = true;
    for (int d = first; d <= last; ++d) starts = starts && c[d] == 0;
    if (!starts) continue;
    std::vector<int> block;
    for (int i = 0; i < f.size; ++i) {
      for (int d = last, rest = i; d >= first; --d) {
        c[d] = rest % shape_[d];
        rest /= shape_[d];
      }
      block.push_back(rank_at(c));
    }
    auto group = world_->new_group(block);
    if (group) f.group = group;
  }
  LOOM_ASSERT(f.group != nullptr, "DeviceMesh: rank ", world_->rank(), " is in no group of ", as);
  flattened_.push_back(std::move(f));
  return flattened_.back().group;
}

int DeviceMesh::rank_at(const std::vector<int>& coordinates) const {
  LOOM_CHECK(coordinates.size() == shape_.size(), "DeviceMesh: ", coordinates.size(),
             " coordinates given for a mesh of ", shape_.size(), " dimensions");
  int rank = 0;
  for (int d = 0; d < ndim(); ++d) {
    LOOM_CHECK(coordinates[d] >= 0 && coordinates[d] < shape_[d], "DeviceMesh: coordinate ", coordinates[d],
               " along ", names_[d], " is out of range (0..", shape_[d] - 1, ")");
    rank = rank * shape_[d] + coordinates[d];
  }
  return rank;
}

std::vector<int> DeviceMesh::coordinates_of(int rank) const {
  std::vector<int> c(shape_.size());
  for (int d = ndim() - 1; d >= 0; --d) {
    c[d] = rank % shape_[d];
    rank /= shape_[d];
  }
  return c;
}

std::string DeviceMesh::table() const {
  // The last dimension runs across, the one before it down; any earlier ones select a table.
  const int cols = shape_.back(), rows = ndim() >= 2 ? shape_[ndim() - 2] : 1;
  const int tables = world_->size() / (cols * rows);
  const std::string& col_name = names_.back();
  const std::string row_name = ndim() >= 2 ? names_[ndim() - 2] : "";
  size_t width = std::to_string(world_->size() - 1).size() + 1;
  width = std::max(width, col_name.size() + 1 + std::to_string(cols - 1).size() + 1);
  size_t label = row_name.size() + 1 + std::to_string(rows - 1).size() + 2;
  auto pad = [](std::string s, size_t w) { return std::string(w > s.size() ? w - s.size() : 0, ' ') + s; };
  std::string out;
  for (int t = 0; t < tables; ++t) {
    if (tables > 1) {
      std::vector<int> c = coordinates_of(t * rows * cols);
      std::string where;
      for (int d = 0; d + 2 < ndim(); ++d) where += (where.empty() ? "" : ", ") + names_[d] + "=" + std::to_string(c[d]);
      out += where + ":\n";
    }
    out += std::string(label, ' ');
    for (int j = 0; j < cols; ++j) out += pad(col_name + "=" + std::to_string(j), width);
    out += "\n";
    for (int i = 0; i < rows; ++i) {
      out += row_name.empty() ? std::string(label, ' ')
                              : pad(row_name + "=" + std::to_string(i), label - 2) + std::string(2, ' ');
      for (int j = 0; j < cols; ++j) out += pad(std::to_string((t * rows + i) * cols + j), width);
      out += "\n";
    }
  }
  return out;
}

}  // namespace loom::dist
