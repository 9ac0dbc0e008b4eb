// `hetero program`: the same-input check. Runs the decoder-cache program on attention inputs
// dumped from the decoder itself (`layers.{i}.x`, bf16 [T, hidden]) in the given chunking and
// writes the cache arrays, to be compared with the decoder's native cache.
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bridge/llama_program.h"
#include "commands.h"
#include "common/safetensors.h"

namespace hetero {

Options program_options() {
  return Options("program",
                 "Run the cache program on dumped attention inputs (same-input exactness).",
                 {
                     {"weights", "HETERO_DECODER_WEIGHTS", "", "decoder-weights export"},
                     {"inputs", "", "", "safetensors with layers.{i}.x bf16 [T, hidden]"},
                     {"chunks", "", "", "comma-separated chunk sizes, repeated to cover T"},
                     {"out", "", "", "output safetensors (layers.{i}.keys/values)"},
                 });
}

int cmd_program(int argc, char** argv) {
  Options opts = program_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  if (!opts.has("weights") || !opts.has("inputs") || !opts.has("out"))
    return std::fprintf(stderr, "program: --weights, --inputs and --out are required\n"), 2;
  auto w = load_llama_decoder_weights(opts.get("weights"));
  if (!w.is_ok()) return std::fprintf(stderr, "program: %s\n", w.status().to_string().c_str()), 1;
  auto in = read_safetensors(opts.get("inputs"));
  if (!in.is_ok()) return std::fprintf(stderr, "program: %s\n", in.status().to_string().c_str()), 1;
  std::vector<int64_t> chunks;
  std::stringstream ss(opts.get("chunks").empty() ? "512" : opts.get("chunks"));
  for (std::string tok; std::getline(ss, tok, ',');) chunks.push_back(std::stoll(tok));
  for (int64_t c : chunks)
    if (c <= 0) return std::fprintf(stderr, "program: chunk sizes must be positive\n"), 2;

  const auto& layout = w->layout;
  LlamaCacheProgram program(&w.value());
  TensorMap out;
  for (int64_t l = 0; l < layout.layers; ++l) {
    auto it = in->tensors.find("layers." + std::to_string(l) + ".x");
    if (it == in->tensors.end() || it->second.dtype != DType::kBF16 ||
        it->second.shape.size() != 2 || it->second.shape[1] != layout.hidden)
      return std::fprintf(stderr, "program: layers.%lld.x missing or not bf16 [T, hidden]\n",
                          static_cast<long long>(l)),
             1;
    const Tensor& x = it->second;
    const int64_t T = x.shape[0], hd = layout.head_dim, kvh = layout.kv_heads;
    Tensor keys(DType::kBF16, {kvh, T, hd}), values(DType::kBF16, {kvh, T, hd});
    size_t ci = 0;
    for (int64_t p = 0; p < T; ci = (ci + 1) % chunks.size()) {
      const int64_t n = std::min(chunks[ci], T - p);
      KvRows r = program.run(l, p, n, x.data<uint16_t>() + p * layout.hidden);
      for (int64_t h = 0; h < kvh; ++h) {
        std::memcpy(keys.data<uint16_t>() + (h * T + p) * hd, r.keys.data<uint16_t>() + h * n * hd,
                    n * hd * 2);
        std::memcpy(values.data<uint16_t>() + (h * T + p) * hd,
                    r.values.data<uint16_t>() + h * n * hd, n * hd * 2);
      }
      p += n;
    }
    out.emplace("layers." + std::to_string(l) + ".keys", std::move(keys));
    out.emplace("layers." + std::to_string(l) + ".values", std::move(values));
  }
  Status st = write_safetensors(opts.get("out"), out);
  if (!st.is_ok()) return std::fprintf(stderr, "program: %s\n", st.to_string().c_str()), 1;
  return 0;
}

}  // namespace hetero
