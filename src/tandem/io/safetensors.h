// Reading and writing safetensors files (https://github.com/huggingface/safetensors).
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON header, then the data section.
// The header maps tensor name -> {dtype, shape, data_offsets: [begin, end)} with offsets relative
// to the start of the data section, plus an optional "__metadata__" object of string -> string.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/core/tensor.h"

namespace tandem {

// One memory-mapped safetensors file, fully validated at open.
//
// Ownership and lifetimes: the object owns a read-only private mapping of the whole file. Every
// TensorView it hands out points into that mapping and is valid exactly as long as this object
// lives; hold the shared_ptr (not just a view) for as long as the views are used. Nothing is
// copied: opening a 60 GB checkpoint costs one header parse.
//
// Alignment: safetensors does not align tensor data. TensorView::data may be at any byte offset
// (a BF16 tensor may start at an odd address), so code reading it must use unaligned loads
// (memcpy, or SIMD loadu) or copy it first. Files written by write_safetensors below and by the
// Python library pad the header so that the data section starts 8-aligned, but individual
// tensors are packed back to back.
class SafetensorsFile {
 public:
  // Maps and validates `path`. Throws tandem::Error naming the file (and the tensor, where there
  // is one) for anything malformed: short or truncated file, absurd header length, bad JSON,
  // missing/mistyped entry fields, unknown dtype, negative dims, offsets out of range or reversed,
  // byte length != shape x dtype size, overlapping tensors, duplicate names.
  static std::shared_ptr<const SafetensorsFile> open(const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In file order (sorted by data offset; ties keep header order).
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // nullptr if absent. The pointer is stable for the life of this object.
  const TensorView* find(std::string_view name) const;
  // The "__metadata__" object (empty if absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t file_size() const { return size_; }
  // The whole mapping (header included), e.g. for pre-faulting pages or hashing.
  std::span<const std::byte> bytes() const { return {base_, size_}; }

 private:
  SafetensorsFile() = default;

  std::string path_;
  const std::byte* base_ = nullptr;  // start of the mmap'ed file; munmap'ed in the destructor
  size_t size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index into tensors_
  std::map<std::string, std::string> metadata_;
};

// One tensor to write. `bytes` is borrowed for the duration of the call and must hold exactly
// numel(shape) * dtype_size(dtype) bytes in row-major order.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

// Writes a safetensors file with the tensors in the given order, packed back to back (the header
// is padded with spaces so the data section starts 8-aligned, as the Python writer does).
// Writes to path + ".tmp" and renames it over `path` only when complete, so a failure never
// leaves a half-written file under `path`. Throws tandem::Error on a size mismatch, a duplicate
// or reserved name, a negative dim, or an I/O failure.
void write_safetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace tandem
