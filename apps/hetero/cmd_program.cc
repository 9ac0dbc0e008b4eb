// `hetero program`: the same-input check. Runs the decoder-cache program on attention inputs
// dumped from the decoder itself (`layers.{i}.x`, bf16 [T, hidden]) in the given chunking and
// writes the cache arrays, to be compared with the decoder's native cache.
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bridge/dsv4_program.h"
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
                     {"calls", "", "",
                      "deepseek_v4: the decoder's call lengths, repeated to cover T "
                      "(default: the chunks)"},
                     {"out", "", "", "output safetensors (layers.{i}.keys/values)"},
                 });
}

namespace {

// "a,b,c" -> sizes; empty on a malformed or non-positive entry.
std::vector<int64_t> parse_sizes(const std::string& text) {
  std::vector<int64_t> sizes;
  std::stringstream ss(text);
  for (std::string tok; std::getline(ss, tok, ',');) {
    char* end = nullptr;
    const long long v = std::strtoll(tok.c_str(), &end, 10);
    if (tok.empty() || *end != '\0' || v <= 0) return {};
    sizes.push_back(v);
  }
  return sizes;
}

// The pattern repeated until it covers exactly T (the last entry cut short).
std::vector<int64_t> cover(const std::vector<int64_t>& pattern, int64_t T) {
  std::vector<int64_t> out;
  for (int64_t p = 0, i = 0; p < T; i = (i + 1) % static_cast<int64_t>(pattern.size())) {
    out.push_back(std::min(pattern[static_cast<size_t>(i)], T - p));
    p += out.back();
  }
  return out;
}

const Tensor* layer_input(const SafetensorsFile& in, int64_t layer, int64_t hidden) {
  auto it = in.tensors.find("layers." + std::to_string(layer) + ".x");
  if (it == in.tensors.end() || it->second.dtype != DType::kBF16 || it->second.shape.size() != 2 ||
      it->second.shape[1] != hidden)
    return nullptr;
  return &it->second;
}

int program_dsv4(const Options& opts, const SafetensorsFile& in,
                 const std::vector<int64_t>& chunks) {
  auto w = load_dsv4_decoder_weights(opts.get("weights"));
  if (!w.is_ok()) return std::fprintf(stderr, "program: %s\n", w.status().to_string().c_str()), 1;
  const auto& layout = w->layout;
  const Tensor* x0 = layer_input(in, 0, layout.hidden);
  if (!x0) return std::fprintf(stderr, "program: layers.0.x missing or not bf16 [T, hidden]\n"), 1;
  const int64_t T = x0->shape[0];
  std::vector<int64_t> calls = chunks;
  if (opts.has("calls")) calls = parse_sizes(opts.get("calls"));
  if (calls.empty()) return std::fprintf(stderr, "program: --calls must be positive sizes\n"), 2;
  Dsv4CacheProgram program(&w.value(), cover(calls, T));
  TensorMap out;
  for (int64_t l = 0; l < layout.layers; ++l) {
    const Tensor* x = layer_input(in, l, layout.hidden);
    if (!x || x->shape[0] != T)
      return std::fprintf(stderr, "program: layers.%lld.x missing or not bf16 [%lld, hidden]\n",
                          static_cast<long long>(l), static_cast<long long>(T)),
             1;
    int64_t p = 0;
    for (int64_t n : cover(chunks, T)) {
      Status st = program.feed(l, p, n, x->data<uint16_t>() + p * layout.hidden, nullptr);
      if (!st.is_ok()) return std::fprintf(stderr, "program: %s\n", st.to_string().c_str()), 1;
      p += n;
    }
    auto a = program.finish_layer(l);
    if (!a.is_ok()) return std::fprintf(stderr, "program: %s\n", a.status().to_string().c_str()), 1;
    const std::string p0 = "layers." + std::to_string(l) + ".";
    out.emplace(p0 + "window", std::move(a->window));
    auto put = [&](const std::string& name, Dsv4PoolArrays& pa) {
      out.emplace(p0 + name + ".buf_kv", std::move(pa.buf_kv));
      out.emplace(p0 + name + ".buf_gate", std::move(pa.buf_gate));
      out.emplace(p0 + name + ".pooled", std::move(pa.pooled));
    };
    if (a->ratio > 0) put("pool", a->pool);
    if (a->ratio == 4) put("index", a->index);
  }
  Status st = write_safetensors(
      opts.get("out"), out,
      {{"window_idx", std::to_string(program.window_idx())}, {"family", layout.family}});
  if (!st.is_ok()) return std::fprintf(stderr, "program: %s\n", st.to_string().c_str()), 1;
  return 0;
}

}  // namespace

int cmd_program(int argc, char** argv) {
  Options opts = program_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  if (!opts.has("weights") || !opts.has("inputs") || !opts.has("out"))
    return std::fprintf(stderr, "program: --weights, --inputs and --out are required\n"), 2;
  auto in = read_safetensors(opts.get("inputs"));
  if (!in.is_ok()) return std::fprintf(stderr, "program: %s\n", in.status().to_string().c_str()), 1;
  const std::vector<int64_t> chunks =
      parse_sizes(opts.get("chunks").empty() ? "512" : opts.get("chunks"));
  if (chunks.empty()) return std::fprintf(stderr, "program: chunk sizes must be positive\n"), 2;
  if (decoder_family(opts.get("weights")) == "deepseek_v4")
    return program_dsv4(opts, in.value(), chunks);
  auto w = load_llama_decoder_weights(opts.get("weights"));
  if (!w.is_ok()) return std::fprintf(stderr, "program: %s\n", w.status().to_string().c_str()), 1;

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
    // Rows past a sliding window are computed as any other (only the engine's attention
    // differs there); past a dynamic rope's reach they would need the decoder's calls.
    if (Status reach = check_rope_reach(w->rope_config, T); !reach.is_ok())
      return std::fprintf(stderr, "program: %s\n", reach.to_string().c_str()), 1;
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
