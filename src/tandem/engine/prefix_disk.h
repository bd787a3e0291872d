// The prefix cache's disk tier: one self-describing file per saved boundary, so that saved prompt
// prefixes survive a restart (DESIGN.md §7).
//
// A file is "TANDEMPC", a format version, a JSON header and its sections:
//   header: the key it was written under (target artifact identity, tokenizer hash, KV scheme),
//           the boundary's token count, the drafter attachment's schema / namespace / processed
//           tokens / metadata, and per section its name, dtype, shape, offset, size and content
//           hash (XXH3-64);
//   sections: the token ids, per attention layer the keys and the values of every position, the
//           Gated DeltaNet state, the drafter checkpoint's tensors and token history.
// Writes go to a temporary name in the same folder, are flushed to the disk and renamed, so a
// reader (another process, a restart) sees a whole file or none; two writers of the same boundary
// write the same name and content. A restarted server finds the files by reading their headers;
// a file that is corrupt, truncated or written under another key is a miss and is removed, never
// an error or a wrong answer.
//
// Not thread-safe: one engine loop uses one PrefixDisk; several processes may share the folder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/engine/prefix_store.h"
#include "tandem/spec/checkpoint.h"

namespace tandem {

// What a file must have been written under to be used.
struct PrefixDiskKey {
  std::string target_identity;  // artifact identity of the weights and config
  std::string tokenizer_hash;   // of the tokenizer the token ids came from ("" = none)
  std::string kv_scheme;        // layout of the state: dtype, block size, layer and head shapes
  DType kv_dtype = DType::F32;  // how the KV stores keys and values (part of kv_scheme)
};

// One boundary's state on the host.
struct PrefixRecord {
  std::vector<int32_t> tokens;
  // Per attention layer: [tokens, kv heads, dim] elements of kv_dtype (F32 or BF16), as the KV
  // stores them, so a restore writes the very bits that were saved.
  DType kv_dtype = DType::F32;
  std::vector<std::vector<std::byte>> keys, values;
  std::vector<float> linear;  // [linear layers][conv | recurrent]
  spec::CheckpointPtr draft;  // the drafter's checkpoint; may be null
};

class PrefixDisk {
 public:
  // Creates `dir` if needed and indexes the files written under `key`; removes the others and
  // every unreadable one. Throws Error when the folder cannot be created or listed.
  PrefixDisk(std::string dir, PrefixDiskKey key);

  // Writes the record (temporary name, flush, rename) and indexes it. Returns false, leaving no
  // file behind, when the disk refuses (full, read-only): the boundary stays in memory only.
  bool write(const PrefixRecord& record);

  // The longest indexed prefix of `prompt` longer than `longer_than` tokens and leaving at least
  // one token to prefill; 0 tokens when there is none.
  struct Found {
    int64_t tokens = 0;
    std::string path;
  };
  Found find(std::span<const int32_t> prompt, int64_t longer_than) const;

  // Reads a file `find` returned and checks every section against its header. A file that fails
  // is removed (from the folder and the index) and nullopt returned.
  std::optional<PrefixRecord> read(const std::string& path);

  // Removes a file whose contents turned out unusable after reading (a caller's check failed).
  void remove(const std::string& path) { drop(path); }

  int64_t files() const { return static_cast<int64_t>(index_.size()); }
  int64_t bytes() const;                        // of the indexed files
  int64_t removed() const { return removed_; }  // files dropped as unusable since construction
  const std::string& dir() const { return dir_; }

  static constexpr uint32_t kFormatVersion = 1;

 private:
  struct Indexed {
    std::string path;
    std::vector<int32_t> tokens;
    uint64_t bytes = 0;  // the file's size
  };
  std::string dir_;
  PrefixDiskKey key_;
  std::vector<Indexed> index_;
  int64_t removed_ = 0;

  void drop(const std::string& path);
  std::string file_name(std::span<const int32_t> tokens) const;
};

// A store's lookup with a disk tier: the memory hit, or, when `disk` holds a longer prefix of
// the prompt, that file read back (`load(record)` adds it as an entry; false, and the file is
// removed, when it does not fit) and the memory looked up again, since its attachment may not suit
// and loading may have evicted the first hit. `lookup_memory()` returns a PrefixHit; `loads`
// counts files read back.
template <class LookupMemory, class Load>
PrefixHit lookup_through_disk(PrefixDisk* disk, std::span<const int32_t> prompt,
                              const LookupMemory& lookup_memory, const Load& load, int64_t* loads) {
  PrefixHit hit = lookup_memory();
  if (!disk) return hit;
  const PrefixDisk::Found found = disk->find(prompt, hit.tokens);
  if (found.tokens == 0) return hit;
  std::optional<PrefixRecord> r = disk->read(found.path);
  if (!r) return hit;
  const bool loaded = load(std::move(*r));
  if (!loaded) disk->remove(found.path);
  *loads += loaded;
  PrefixHit again = lookup_memory();
  again.from_disk = loaded && again.tokens == found.tokens;
  return again;
}

// A store's disk-tier figures into s: the folder's files (when there is a disk), and the writes
// and loads the store counted.
inline void add_disk_stats(const PrefixDisk* disk, int64_t writes, int64_t loads,
                           PrefixCacheStats* s) {
  if (disk) {
    s->disk_files = disk->files();
    s->disk_removed = disk->removed();
    s->disk_bytes = disk->bytes();
  }
  s->disk_writes = writes;
  s->disk_loads = loads;
}

}  // namespace tandem
