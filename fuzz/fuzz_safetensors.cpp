// Fuzz target: safetensors files (8-byte header length, JSON header, data section) as a
// checkpoint downloaded from anywhere may hold them. SafetensorsFile::open takes a path and maps
// the file, so each input is written to one in-memory file (memfd) and opened through
// /proc/self/fd: the real open, fstat, mmap and header validation run, with no disk I/O and no
// change to the library. open() must either throw tandem::Error or return a file whose every
// tensor lies inside the data section, with the size its shape and dtype say, overlapping no
// other tensor; all of each tensor's bytes are read so a bad pointer faults here.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "tandem/core/dtype.h"
#include "tandem/core/error.h"
#include "tandem/io/safetensors.h"

namespace tandem::fuzz::safetensors {

// The memfd every input is written to, and the path that opens it.
struct MemFile {
  int fd = -1;
  std::string path;
  MemFile() {
    fd = memfd_create("fuzz_safetensors", MFD_CLOEXEC);
    if (fd < 0) fail("memfd_create failed");
    path = "/proc/self/fd/" + std::to_string(fd);
  }
  void write(const uint8_t* data, size_t size) const {
    if (ftruncate(fd, 0) != 0) fail("ftruncate failed");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) fail("pwrite failed");
      done += static_cast<size_t>(n);
    }
  }
};

void check_file(const tandem::SafetensorsFile& f, size_t size) {
  if (f.file_size() != size) fail("file_size() differs from the input size");
  const auto* begin = f.bytes().data();
  const auto* end = begin + f.bytes().size();
  struct Range {
    const std::byte *lo, *hi;
  };
  std::vector<Range> ranges;
  uint64_t checksum = 0;
  for (const tandem::TensorView& t : f.tensors()) {
    const auto* p = static_cast<const std::byte*>(t.data);
    // The data section starts after the 8-byte length and the header.
    if (p < begin + 8 || p > end || t.nbytes > static_cast<size_t>(end - p))
      fail("a tensor lies outside the file");
    // numel() is what every consumer multiplies sizes with; it must not overflow.
    uint64_t want = tandem::dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) fail("a negative dimension was accepted");
      if (__builtin_mul_overflow(want, static_cast<uint64_t>(d), &want))
        fail("a tensor's byte size overflows");
    }
    if (want != t.nbytes) fail("a tensor's byte size disagrees with its shape and dtype");
    if (t.numel() < 0) fail("numel() is negative");
    if (f.find(t.name) == nullptr || f.find(t.name)->data != t.data) fail("find() misses a tensor");
    for (size_t i = 0; i < t.nbytes; ++i) checksum += static_cast<uint8_t>(p[i]);
    if (t.nbytes > 0) ranges.push_back({p, p + t.nbytes});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.lo < b.lo; });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].lo < ranges[i - 1].hi) fail("two tensors overlap");
  // Keep the reads from being optimized away.
  volatile uint64_t sink = checksum;
  (void)sink;
}

inline int run_one(const uint8_t* data, size_t size) {
  static const MemFile file;
  file.write(data, size);
  try {
    const auto f = tandem::SafetensorsFile::open(file.path);
    check_file(*f, size);
  } catch (const tandem::Error&) {
    // Malformed input: the loader's answer.
  }
  return 0;
}

}  // namespace tandem::fuzz::safetensors

#ifndef TANDEM_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return tandem::fuzz::safetensors::run_one(data, size);
}
#endif
