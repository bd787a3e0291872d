#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/io/safetensors.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

template <class T>
std::span<const std::byte> as_bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

// Writes a file by hand: 8-byte length, `header` verbatim, then `data`.
void write_raw(const std::string& path, const std::string& header, const std::string& data = "",
               uint64_t header_len_override = 0) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = header_len_override ? header_len_override : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << data;
}

// Opens `path` expecting failure; returns the message.
std::string open_error(const std::string& path) {
  try {
    SafetensorsFile::open(path);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "opening " << path << " did not throw";
  return "";
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

TEST(Safetensors, RoundTripAllKinds) {
  ScratchDir tmp("st");
  const std::string path = tmp.file("model.safetensors");
  const std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, -7.0f};
  const std::vector<uint8_t> u8 = {42};  // makes the next tensor start at an odd offset
  const std::vector<uint16_t> bf16 = {f32_to_bf16(1.0f), f32_to_bf16(-0.5f), f32_to_bf16(3.0f)};
  const std::vector<uint16_t> f16 = {f32_to_f16(0.25f), f32_to_f16(-8.0f), f32_to_f16(2.0f),
                                     f32_to_f16(65504.0f)};
  const std::vector<int64_t> scalar = {-1234567890123LL};
  const std::vector<float> empty;
  const std::vector<TensorToWrite> tensors = {
      {"w.f32", DType::F32, {2, 3}, as_bytes_of(f32)},
      {"odd.u8", DType::U8, {1}, as_bytes_of(u8)},
      {"w.bf16", DType::BF16, {3}, as_bytes_of(bf16)},
      {"w.f16", DType::F16, {2, 2}, as_bytes_of(f16)},
      {"step", DType::I64, {}, as_bytes_of(scalar)},
      {"nothing", DType::F32, {0, 4}, as_bytes_of(empty)},
  };
  write_safetensors(path, tensors, {{"format", "pt"}, {"note", "hello"}});
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(f->file_size(), fs::file_size(path));
  EXPECT_EQ(f->metadata().size(), 2u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("note"), "hello");
  ASSERT_EQ(f->tensors().size(), 6u);
  // File order = offset order = write order here (the empty tensor sits at the end).
  const char* order[] = {"w.f32", "odd.u8", "w.bf16", "w.f16", "step", "nothing"};
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(f->tensors()[i].name, order[i]);

  const TensorView* a = f->find("w.f32");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::F32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->nbytes, 24u);
  EXPECT_EQ(to_f32(*a), f32);

  const TensorView* b = f->find("w.bf16");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::BF16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data) % 2, 1u) << "expected an unaligned tensor";
  std::vector<uint16_t> got(3);
  std::memcpy(got.data(), b->data, 6);  // unaligned-safe read
  EXPECT_EQ(got, bf16);

  const TensorView* h = f->find("w.f16");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->dtype, DType::F16);
  std::vector<uint16_t> goth(4);
  std::memcpy(goth.data(), h->data, 8);
  EXPECT_EQ(goth, f16);

  const TensorView* s = f->find("step");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dtype, DType::I64);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel(), 1);
  int64_t sv;
  std::memcpy(&sv, s->data, 8);
  EXPECT_EQ(sv, scalar[0]);

  const TensorView* e = f->find("nothing");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->nbytes, 0u);
  EXPECT_EQ(e->numel(), 0);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{0, 4}));

  EXPECT_EQ(f->find("missing"), nullptr);
  // The data section starts 8-aligned.
  const auto* base = reinterpret_cast<const std::byte*>(f->bytes().data());
  EXPECT_EQ((static_cast<const std::byte*>(a->data) - base) % 8, 0);
}

TEST(Safetensors, EmptyFileAndNoMetadata) {
  ScratchDir tmp("st");
  const std::string path = tmp.file("empty.safetensors");
  write_safetensors(path, {});
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_TRUE(f->metadata().empty());
}

TEST(Safetensors, ViewsOutliveOnlyWithTheFile) {
  ScratchDir tmp("st");
  const std::string path = tmp.file("m.safetensors");
  const std::vector<float> v = {1, 2, 3, 4};
  const std::vector<TensorToWrite> t = {{"x", DType::F32, {4}, as_bytes_of(v)}};
  write_safetensors(path, t);
  std::shared_ptr<const SafetensorsFile> keep;
  {
    auto f = SafetensorsFile::open(path);
    keep = f;
  }
  // Deleting the path does not invalidate the mapping.
  fs::remove(path);
  EXPECT_EQ(to_f32(*keep->find("x")), v);
}

TEST(Safetensors, WriterRejectsBadInputAndLeavesNothing) {
  ScratchDir tmp("st");
  const std::string path = tmp.file("bad.safetensors");
  const std::vector<float> v = {1, 2, 3};
  {
    const std::vector<TensorToWrite> t = {{"x", DType::F32, {2, 2}, as_bytes_of(v)}};
    try {
      write_safetensors(path, t);
      ADD_FAILURE() << "no throw";
    } catch (const Error& e) {
      EXPECT_HAS(e.what(), "'x'");
      EXPECT_HAS(e.what(), "needs 16 bytes, got 12");
    }
  }
  {
    const std::vector<TensorToWrite> t = {{"x", DType::F32, {3}, as_bytes_of(v)},
                                          {"x", DType::F32, {3}, as_bytes_of(v)}};
    try {
      write_safetensors(path, t);
      ADD_FAILURE() << "no throw";
    } catch (const Error& e) {
      EXPECT_HAS(e.what(), "'x' given twice");
    }
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  // An unwritable location fails cleanly too.
  const std::vector<TensorToWrite> ok = {{"x", DType::F32, {3}, as_bytes_of(v)}};
  EXPECT_THROW(write_safetensors(tmp.file("no/such/dir/x.safetensors"), ok), Error);
}

TEST(Safetensors, MissingAndShortFiles) {
  ScratchDir tmp("st");
  const std::string missing = tmp.file("nope.safetensors");
  std::string msg = open_error(missing);
  EXPECT_HAS(msg, missing);
  EXPECT_HAS(msg, "No such file");

  const std::string dir = tmp.file("");
  EXPECT_HAS(open_error(dir), "not a regular file");

  const std::string shortf = tmp.file("short.safetensors");
  std::ofstream(shortf, std::ios::binary) << "abc";
  msg = open_error(shortf);
  EXPECT_HAS(msg, shortf);
  EXPECT_HAS(msg, "3 bytes, too short");
}

TEST(Safetensors, BadHeaderLength) {
  ScratchDir tmp("st");
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, "{}", "", 1000);
  std::string msg = open_error(p);
  EXPECT_HAS(msg, p);
  EXPECT_HAS(msg, "header length 1000 exceeds the 2 bytes");

  write_raw(p, "{}", "", 1ull << 40);
  msg = open_error(p);
  EXPECT_HAS(msg, "absurd");
}

TEST(Safetensors, BadJson) {
  ScratchDir tmp("st");
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, "{not json");
  std::string msg = open_error(p);
  EXPECT_HAS(msg, p);
  EXPECT_HAS(msg, "header is not valid JSON");

  write_raw(p, "[1, 2]");
  msg = open_error(p);
  EXPECT_HAS(msg, "header must be a JSON object, got array");

  write_raw(p, R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
            std::string(8, '\0'));
  msg = open_error(p);
  EXPECT_HAS(msg, "'a' more than once");

  write_raw(p, R"({"__metadata__": {"format": 1}})");
  msg = open_error(p);
  EXPECT_HAS(msg, "__metadata__['format'] must be a string");

  write_raw(p, R"({"__metadata__": [1]})");
  EXPECT_HAS(open_error(p), "'__metadata__' must be an object");
}

struct BadEntry {
  const char* header;
  size_t data_bytes;
  const char* expect;  // substring of the message (besides file and tensor name)
};

TEST(Safetensors, BadEntries) {
  const BadEntry cases[] = {
      {R"({"t": 5})", 0, "header entry must be an object"},
      {R"({"t": {"shape": [1], "data_offsets": [0, 4]}})", 4, "missing 'dtype'"},
      {R"({"t": {"dtype": "F32", "data_offsets": [0, 4]}})", 4, "missing 'shape'"},
      {R"({"t": {"dtype": "F32", "shape": [1]}})", 4, "missing 'data_offsets'"},
      {R"({"t": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})", 4,
       "'dtype' must be a string, got number"},
      {R"({"t": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})", 4,
       "'shape' must be an array, got string"},
      {R"({"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4,
       "shape[0] must be an integer"},
      {R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4,
       "'data_offsets' must be an array of 2 integers, got [0]"},
      {R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": ["0", 4]}})", 4,
       "data_offsets[0] must be an integer"},
      {R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 4]}})", 4,
       "data_offsets[0] = -4 is negative"},
      {R"({"t": {"dtype": "F8_E5M2", "shape": [1], "data_offsets": [0, 1]}})", 1,
       "unknown dtype 'F8_E5M2' (supported: F32, F16, BF16"},
      {R"({"t": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 4]}})", 4,
       "shape[0] = -1 is negative"},
      {R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8,
       "data_offsets [8, 4) are reversed"},
      {R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8,
       "run past the end of the data section (8 bytes)"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8,
       "shape [3] x F32 needs 12 bytes, but data_offsets [0, 8) hold 8"},
      {R"({"t": {"dtype": "BF16", "shape": [4611686018427387904, 8], "data_offsets": [0, 8]}})", 8,
       "overflows 64 bits"},
      {R"({"t": {"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 8]}})", 8,
       "is too large"},
  };
  ScratchDir tmp("st");
  const std::string p = tmp.file("bad.safetensors");
  for (const BadEntry& c : cases) {
    SCOPED_TRACE(c.header);
    write_raw(p, c.header, std::string(c.data_bytes, '\0'));
    const std::string msg = open_error(p);
    EXPECT_HAS(msg, p);
    EXPECT_HAS(msg, "tensor 't'");
    EXPECT_HAS(msg, c.expect);
  }
}

TEST(Safetensors, OverlappingTensors) {
  ScratchDir tmp("st");
  const std::string p = tmp.file("overlap.safetensors");
  write_raw(p, R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                   "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
            std::string(12, '\0'));
  const std::string msg = open_error(p);
  EXPECT_HAS(msg, p);
  EXPECT_HAS(msg, "tensor 'b' at data_offsets [4, 12) overlaps tensor 'a'");

  // Gaps and empty tensors inside another tensor's range are fine.
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "z": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
            std::string(12, '\0'));
  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->tensors().size(), 3u);
}

TEST(Safetensors, TruncatedFile) {
  ScratchDir tmp("st");
  const std::string p = tmp.file("m.safetensors");
  const std::vector<float> a(16, 1.0f), b(16, 2.0f);
  const std::vector<TensorToWrite> t = {{"a", DType::F32, {16}, as_bytes_of(a)},
                                        {"b", DType::F32, {4, 4}, as_bytes_of(b)}};
  write_safetensors(p, t);
  fs::resize_file(p, fs::file_size(p) - 5);
  std::string msg = open_error(p);
  EXPECT_HAS(msg, p);
  EXPECT_HAS(msg, "tensor 'b'");
  EXPECT_HAS(msg, "truncated");

  // Cut into the header itself.
  fs::resize_file(p, 20);
  msg = open_error(p);
  EXPECT_HAS(msg, "exceeds the 12 bytes");
  EXPECT_HAS(msg, "truncated");
}

}  // namespace
}  // namespace tandem
