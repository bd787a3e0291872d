// The bundled demo model (models/qwen35-demo) with its tokenizer and both drafters, and the
// prompts the speculative tests decode. Shared by the CPU tests and the GPU tests, which are
// separate executables; each keeps one instance for its whole run.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/engine/generator.h"
#include "tandem/io/tokenizer.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/spec/eagle3_random.h"
#include "tandem/spec/ngram.h"
#include "tandem/spec/qwen_mtp.h"

namespace tandem::test {

inline const std::string kDemoDir = std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo";

struct DemoModel {
  std::unique_ptr<Qwen35Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<spec::TargetView> target;  // named "demo-target"
  std::unique_ptr<spec::DraftProvider> mtp, ngram;
};

// Loads the demo on the current backend: its MTP drafter and an n-gram drafter (1..3-grams).
inline std::unique_ptr<DemoModel> load_demo_model() {
  auto d = std::make_unique<DemoModel>();
  d->model = Qwen35Model::load(kDemoDir);
  d->tok = std::make_unique<Tokenizer>(Tokenizer::load(kDemoDir + "/tokenizer.json"));
  d->target = std::make_unique<spec::QwenTargetView>(*d->model, "demo-target");
  d->mtp = spec::QwenMtpProvider::from_target(*d->target);
  d->ngram = std::make_unique<spec::NgramProvider>(spec::NgramOptions{1, 3});
  return d;
}

// Code prompts: a docstring to continue, a class with repeated structure, a loop to repeat.
inline const std::vector<std::string> kDemoPrompts = {
    "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n",
    "import os\nimport sys\n\n\nclass Cache:\n    def __init__(self, size):\n        self.size = "
    "size\n        self.items = {}\n\n    def get(self, key):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
};

// A request for `prompt` (encoded by the demo's tokenizer) at `temperature`, with top_p 0.95 when
// sampling.
inline GenerateRequest demo_request(const DemoModel& d, const std::string& prompt,
                                    float temperature, uint64_t seed, int64_t max_tokens) {
  GenerateRequest r;
  r.prompt = d.tok->encode(prompt);
  r.sampling.temperature = temperature;
  r.sampling.top_p = temperature > 0 ? 0.95f : 1.0f;
  r.sampling.seed = seed;
  r.max_tokens = max_tokens;
  return r;
}

// A random EAGLE-3 head shape for the demo target: the oracle fixture's (tools/
// make_eagle3_fixture.py: intermediate 256, 6 / 2 heads of 64, 512 draft ids, taps [1, 3, 6]).
inline spec::Eagle3RandomShape demo_eagle3_shape() {
  spec::Eagle3RandomShape s;
  s.hidden_size = 384;
  s.intermediate_size = 256;
  s.num_attention_heads = 6;
  s.num_key_value_heads = 2;
  s.head_dim = 64;
  s.vocab_size = 4096;
  s.draft_vocab_size = 512;
  s.tap_layers = {1, 3, 6};
  return s;
}

// The tokens plain decoding gives each request, every one run alone.
inline std::vector<std::vector<int32_t>> plain_tokens(const Qwen35Model& model,
                                                      const std::vector<GenerateRequest>& reqs) {
  std::vector<std::vector<int32_t>> out;
  Generator gen(model);
  for (const auto& r : reqs) out.push_back(gen.run({r}).at(0).tokens);
  return out;
}

}  // namespace tandem::test
