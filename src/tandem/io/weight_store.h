// All safetensors files of one checkpoint directory, looked up by tensor name.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/tensor.h"
#include "tandem/io/safetensors.h"

namespace tandem {

// Ownership and lifetimes: the store holds shared handles to its mapped files; the TensorViews it
// returns point into those mappings and stay valid while the store, or any copy of it, lives.
// Copies and moves are cheap (shared handles plus a name index of pointers into the immutable,
// heap-allocated files, which moving does not relocate).
class WeightStore {
 public:
  // Which files make up the checkpoint, in order of preference:
  //   1. dir/model.safetensors;
  //   2. dir/model.safetensors.index.json, whose "weight_map" maps tensor name -> shard file name
  //      (relative to dir); every tensor it names must exist in that shard;
  //   3. the single *.safetensors file in dir (several without an index is an error).
  // Tensors a shard holds beyond those its index names are loaded too; a tensor name found in two
  // files is an error. With `prefault`, every page of every file is
  // faulted in (MADV_WILLNEED, then a read of one byte per page on a few threads) so that later
  // timing does not measure page faults; above 256 MB a progress line goes to stderr.
  static WeightStore open(const std::string& dir, bool prefault = true);

  WeightStore() = default;

  const TensorView* find(std::string_view name) const;
  // Throws "tensor 'x' not found in <dir> (N tensors; did you mean 'a', 'b'?)".
  const TensorView& get(std::string_view name) const;
  std::vector<std::string> names() const;                                     // sorted
  std::vector<std::string> names_with_prefix(std::string_view prefix) const;  // sorted
  uint64_t total_bytes() const { return total_bytes_; }  // sum of tensor sizes, all files
  const std::string& dir() const { return dir_; }
  std::vector<std::string> files() const;  // file paths in load order (shard names sorted)
  size_t size() const { return by_name_.size(); }

 private:
  std::string dir_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  // Points into files_[i]->tensors(); stable because the files are immutable and heap-allocated.
  std::map<std::string, const TensorView*, std::less<>> by_name_;
  uint64_t total_bytes_ = 0;
};

}  // namespace tandem
