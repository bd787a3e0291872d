#include "tandem/spec/qwen_mtp_split.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tandem/core/error.h"
#include "tandem/io/json_file.h"
#include "tandem/io/safetensors.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/qwen3_5_config.h"
#include "tandem/spec/qwen_mtp_weights.h"

namespace tandem::spec {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// 1 + w in fp32, stored back in the tensor's own dtype.
std::vector<std::byte> to_runtime_norm(const TensorView& t) {
  std::vector<float> f = to_f32(t);
  std::vector<std::byte> out(t.nbytes);
  for (size_t i = 0; i < f.size(); ++i) {
    const float v = 1.0f + f[i];
    if (t.dtype == DType::F32) {
      std::memcpy(out.data() + i * 4, &v, 4);
    } else {
      const uint16_t h = t.dtype == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
      std::memcpy(out.data() + i * 2, &h, 2);
    }
  }
  return out;
}

}  // namespace

MtpSplitResult write_mtp_companion(const std::string& model_dir, const std::string& out_dir,
                                   int64_t block_size) {
  if (block_size < 1) fail("mtp-split: block_size must be >= 1, got ", block_size);
  std::error_code ec;
  if (fs::exists(out_dir, ec) && !(fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)))
    fail("mtp-split: output ", out_dir, " exists and is not an empty directory");
  // Parsing the config validates that this is a Qwen3.5 checkpoint.
  const Qwen35Config target = load_qwen35_config(model_dir);
  const json root = read_json_file((fs::path(model_dir) / "config.json").string());
  const json& text = root.contains("text_config") ? root["text_config"] : root;

  const WeightStore store = WeightStore::open(model_dir, false);
  const std::vector<std::string> names = store.names_with_prefix("mtp.");
  if (names.empty())
    fail("mtp-split: ", model_dir,
         " has no mtp.* tensors (mtp_num_hidden_layers = ", target.mtp_num_hidden_layers,
         "): there is no MTP layer to split out");
  const std::vector<std::string>& norms = mtp_norm_names();

  std::vector<std::vector<std::byte>> converted;
  converted.reserve(names.size());
  std::vector<TensorToWrite> tensors;
  MtpSplitResult result;
  for (const std::string& name : names) {
    const TensorView& t = store.get(name);
    const std::string out_name = name.substr(4);
    TensorToWrite w{out_name, t.dtype, t.shape, {}};
    if (std::find(norms.begin(), norms.end(), out_name) != norms.end()) {
      if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16)
        fail("mtp-split: norm tensor '", name, "' has dtype ", dtype_name(t.dtype),
             " (expected F32, BF16 or F16)");
      converted.push_back(to_runtime_norm(t));
      w.bytes = converted.back();
    } else {
      w.bytes = {static_cast<const std::byte*>(t.data), t.nbytes};
    }
    result.bytes += t.nbytes;
    tensors.push_back(std::move(w));
  }
  result.tensors = static_cast<int64_t>(tensors.size());

  fs::create_directories(out_dir, ec);
  if (ec) fail("mtp-split: cannot create ", out_dir, ": ", ec.message());
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), tensors,
                    {{"format", "pt"}});
  json config = {{"model_type", "qwen3_5_mtp"},
                 {"text_config", text},
                 {"block_size", block_size},
                 {"tie_word_embeddings", target.tie_word_embeddings}};
  const std::string config_path = (fs::path(out_dir) / "config.json").string();
  std::ofstream out(config_path, std::ios::binary);
  out << config.dump(2) << "\n";
  out.close();
  if (!out) fail("mtp-split: cannot write ", config_path);
  return result;
}

}  // namespace tandem::spec
