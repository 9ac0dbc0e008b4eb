// The DeepSeek-V4 CUDA engine's weights: what each layer holds (layer_specs), how each weight
// lives on the device for a WeightDtype (form_of), and the three ways they get there — uploaded
// from host weights (bf16, FP8 experts requantized), drawn on the device from a seed, or streamed
// from the official checkpoint's shards tensor by tensor with the FP8 and FP4 codes kept as
// stored (WeightDtype::kCheckpoint).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "common/bf16.h"
#include "common/safetensors.h"
#include "engine/cuda/dsv4_cuda_impl.h"
#include "kernels/cuda/dsv4_fwd_ops.h"

namespace hetero {

using namespace dsv4_cuda;

namespace dsv4_cuda {

std::vector<Spec> layer_specs(DLayer& L, const Dsv4Config& c, int64_t layer) {
  const int64_t H = c.hidden, hd = c.head_dim, W = c.hc_mult * H, mix = c.hc_mix();
  const int64_t E = c.n_routed_experts, I = c.moe_inter, S = c.moe_inter * c.n_shared_experts;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim, G = c.o_groups, R = c.o_lora_rank;
  const int64_t QL = c.q_lora_rank;
  std::vector<Spec> s;
  auto add = [&](cuda::DeviceBuffer* b, int64_t n, int eb, Init i, int64_t fi,
                 std::vector<std::string> names) -> Spec& {
    Spec x;
    x.buf = b, x.count = n, x.elem_bytes = eb, x.init = i, x.fan_in = fi;
    x.names = std::move(names);
    return s.emplace_back(std::move(x));
  };
  // A matrix [rows, cols] the official checkpoint stores as FP8, kept so under kCheckpoint.
  auto fp8 = [&](cuda::DeviceBuffer* b, DFp8* f, int64_t rows, int64_t cols, std::string name) {
    Spec& x = add(b, rows * cols, 2, Init::kMatrix, cols, {std::move(name)});
    x.fp8 = f, x.rows = rows, x.cols = cols, x.fp8_stored = true;
  };
  add(&L.attn_norm, H, 2, Init::kNorm, 0, {"attn_norm.weight"});
  add(&L.ffn_norm, H, 2, Init::kNorm, 0, {"ffn_norm.weight"});
  for (auto [hc, name] : {std::pair{&L.hc_attn, "hc_attn"}, std::pair{&L.hc_ffn, "hc_ffn"}}) {
    add(&hc->fn, mix * W, 4, Init::kMatrix, W, {std::string(name) + "_fn"});
    add(&hc->base, mix, 4, Init::kSmall, 0, {std::string(name) + "_base"});
    add(&hc->scale, 3, 4, Init::kHcScale, 0, {std::string(name) + "_scale"});
  }
  fp8(&L.wq_a, &L.wq_a_8, QL, H, "attn.wq_a.weight");
  add(&L.q_norm, QL, 2, Init::kNorm, 0, {"attn.q_norm.weight"});
  fp8(&L.wq_b, &L.wq_b_8, c.heads * hd, QL, "attn.wq_b.weight");
  fp8(&L.wkv, &L.wkv_8, hd, H, "attn.wkv.weight");
  add(&L.kv_norm, hd, 2, Init::kNorm, 0, {"attn.kv_norm.weight"});
  add(&L.wo_a, G * R * (c.heads * hd / G), 2, Init::kMatrix, c.heads * hd / G, {"attn.wo_a.weight"})
      .fp8_stored = true;
  fp8(&L.wo_b, &L.wo_b_8, H, G * R, "attn.wo_b.weight");
  add(&L.sinks, c.heads, 4, Init::kSink, 0, {"attn.attn_sink"});
  add(&L.gate, E * H, 2, Init::kMatrix, H, {"ffn.gate.weight"});
  std::vector<std::string> w13, w2;
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = "ffn.experts." + std::to_string(e) + ".";
    w13.push_back(p + "w1.weight"), w13.push_back(p + "w3.weight"), w2.push_back(p + "w2.weight");
  }
  for (auto [b, f8, f4, rows, cols, names] :
       {std::tuple{&L.w13, &L.w13_8, &L.w13_4, 2 * I, H, &w13},
        std::tuple{&L.w2, &L.w2_8, &L.w2_4, H, I, &w2}}) {
    Spec& x = add(b, E * rows * cols, 2, Init::kMatrix, cols, std::move(*names));
    x.fp8 = f8, x.fp4 = f4, x.rows = rows, x.cols = cols, x.expert = true;
  }
  if (c.attention_bias) add(&L.wo_b_bias, H, 2, Init::kSmall, 0, {"attn.wo_b.bias"});
  if (layer < c.num_hash_layers)
    add(&L.tid2eid, c.vocab * c.experts_per_tok, 4, Init::kExpertId, 0, {"ffn.gate.tid2eid"});
  else
    add(&L.gate_bias, E, 4, Init::kSmall, 0, {"ffn.gate.bias"});
  if (S > 0) {
    const std::string p = "ffn.shared_experts.";
    for (auto [b, f8, rows, cols, names] :
         {std::tuple{&L.sh_w13, &L.sh_w13_8, 2 * S, H,
                     std::vector<std::string>{p + "w1.weight", p + "w3.weight"}},
          std::tuple{&L.sh_w2, &L.sh_w2_8, H, S, std::vector<std::string>{p + "w2.weight"}}}) {
      Spec& x = add(b, rows * cols, 2, Init::kMatrix, cols, names);
      x.fp8 = f8, x.rows = rows, x.cols = cols, x.expert = true, x.fp8_stored = true;
    }
  }
  auto comp = [&](DComp& cm, int64_t ratio, int64_t d, const std::string& p) {
    cm.ratio = ratio, cm.head_dim = d, cm.out_dim = ratio == 4 ? 2 * d : d;
    add(&cm.wkv, cm.out_dim * H, 2, Init::kMatrix, H, {p + "wkv.weight"});
    add(&cm.wgate, cm.out_dim * H, 2, Init::kMatrix, H, {p + "wgate.weight"});
    add(&cm.ape, ratio * cm.out_dim, 4, Init::kSmall, 0, {p + "ape"});
    add(&cm.norm, d, 2, Init::kNorm, 0, {p + "norm.weight"});
  };
  if (L.ratio > 0) comp(L.comp, L.ratio, hd, "attn.compressor.");
  if (L.ratio == 4) {
    comp(L.icomp, 4, ihd, "attn.indexer.compressor.");
    fp8(&L.idx_wq_b, &L.idx_wq_b_8, ih * ihd, QL, "attn.indexer.wq_b.weight");
    add(&L.idx_wproj, ih * H, 2, Init::kMatrix, H, {"attn.indexer.weights_proj.weight"});
  }
  return s;
}

Form form_of(const Spec& s, cuda::WeightDtype dtype) {
  if (dtype == cuda::WeightDtype::kFp8) return s.expert ? Form::kFp8 : Form::kBf16OrF32;
  if (dtype == cuda::WeightDtype::kCheckpoint)
    return s.fp4 ? Form::kFp4 : s.fp8 ? Form::kFp8 : Form::kBf16OrF32;
  return Form::kBf16OrF32;
}

Status put(cuda::DeviceBuffer& b, const void* src, size_t bytes) {
  if (bytes != b.bytes())
    return failed_precondition("a weight of " + std::to_string(bytes) +
                               " bytes where the config says " + std::to_string(b.bytes()));
  HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.get(), src, bytes, cudaMemcpyHostToDevice));
  return Status::ok();
}
Status put(cuda::DeviceBuffer& b, const std::vector<float>& v) {
  return put(b, v.data(), v.size() * sizeof(float));
}

}  // namespace dsv4_cuda

namespace {

using dsv4_cuda::put;
Status put(cuda::DeviceBuffer& b, const Tensor& t) {
  return dsv4_cuda::put(b, t.bytes.data(), t.bytes.size());
}
Status put_hc(DHc& d, const Dsv4HyperConnection& hc) {
  HETERO_RETURN_IF_ERROR(put(d.fn, hc.fn));
  HETERO_RETURN_IF_ERROR(put(d.base, hc.base));
  return put(d.scale, hc.scale);
}
Status put_comp(DComp& d, const Dsv4Compressor& cm) {
  HETERO_RETURN_IF_ERROR(put(d.wkv, cm.wkv));
  HETERO_RETURN_IF_ERROR(put(d.wgate, cm.wgate));
  HETERO_RETURN_IF_ERROR(put(d.ape, cm.ape));
  return put(d.norm, cm.norm);
}

// The attention sinks as the decoder adds them: bf16.
void round_sinks(std::vector<float>& v) {
  for (float& x : v) x = round_bf16(x);
}

}  // namespace

Status Dsv4CudaEngine::upload(const Dsv4Weights& w) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  if (m.ckpt)
    return failed_precondition(
        "checkpoint-precision weights are streamed from the checkpoint (Dsv4CudaEngine::load), "
        "not uploaded from host weights");
  cudaStream_t st = m.stream.get();
  if (m.embed) HETERO_RETURN_IF_ERROR(put(m.embed, w.embed));
  const int64_t E = c.n_routed_experts, I = c.moe_inter, H = c.hidden;
  for (int64_t l = m.first; l < m.end; ++l) {
    DLayer& D = m.layers[static_cast<size_t>(l)];
    const Dsv4LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::pair<cuda::DeviceBuffer*, const Tensor*> plain[] = {
        {&D.attn_norm, &L.attn_norm}, {&D.ffn_norm, &L.ffn_norm},
        {&D.wq_a, &L.wq_a},           {&D.q_norm, &L.q_norm},
        {&D.wq_b, &L.wq_b},           {&D.wkv, &L.wkv},
        {&D.kv_norm, &L.kv_norm},     {&D.wo_a, &L.wo_a},
        {&D.wo_b, &L.wo_b},           {&D.gate, &L.gate}};
    for (auto [dst, src] : plain) HETERO_RETURN_IF_ERROR(put(*dst, *src));
    HETERO_RETURN_IF_ERROR(put_hc(D.hc_attn, L.hc_attn));
    HETERO_RETURN_IF_ERROR(put_hc(D.hc_ffn, L.hc_ffn));
    if (D.wo_b_bias) HETERO_RETURN_IF_ERROR(put(D.wo_b_bias, L.wo_b_bias));
    std::vector<float> sinks = L.attn_sink;
    round_sinks(sinks);
    HETERO_RETURN_IF_ERROR(put(D.sinks, sinks));
    if (D.ratio > 0) HETERO_RETURN_IF_ERROR(put_comp(D.comp, L.compressor));
    if (D.ratio == 4) {
      HETERO_RETURN_IF_ERROR(put_comp(D.icomp, L.index_compressor));
      HETERO_RETURN_IF_ERROR(put(D.idx_wq_b, L.index_wq_b));
      HETERO_RETURN_IF_ERROR(put(D.idx_wproj, L.index_weights_proj));
    }
    if (D.tid2eid) HETERO_RETURN_IF_ERROR(put(D.tid2eid, L.tid2eid.data(), L.tid2eid.size() * 4));
    if (D.gate_bias) HETERO_RETURN_IF_ERROR(put(D.gate_bias, L.gate_bias));
    const size_t mat = static_cast<size_t>(I * H) * 2;
    if (m.fp8) {
      // Each expert's bf16 weights through one scratch buffer into their FP8 form, in the
      // stream's order (the scratch is refilled only once the quantizer has read it).
      cuda::DeviceBuffer tmp;
      HETERO_RETURN_IF_ERROR(tmp.allocate(2 * std::max(mat, L.shared_w1.bytes.size()),
                                          "expert weights before quantization", &m.budget));
      auto up = [&](const Tensor& t, size_t at) -> Status {
        HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tmp.get<uint8_t>() + at, t.bytes.data(),
                                                    t.bytes.size(), cudaMemcpyHostToDevice, st));
        return Status::ok();
      };
      for (int64_t e = 0; e < E; ++e) {
        const size_t i = static_cast<size_t>(e);
        HETERO_RETURN_IF_ERROR(up(L.w1[i], 0));
        HETERO_RETURN_IF_ERROR(up(L.w3[i], mat));
        D.w13_8.quantize_one(bf(tmp), e, st);
        HETERO_RETURN_IF_ERROR(up(L.w2[i], 0));
        D.w2_8.quantize_one(bf(tmp), e, st);
      }
      if (D.sh_w13_8.mats > 0) {
        HETERO_RETURN_IF_ERROR(up(L.shared_w1, 0));
        HETERO_RETURN_IF_ERROR(up(L.shared_w3, L.shared_w1.bytes.size()));
        D.sh_w13_8.quantize(bf(tmp), st);
        HETERO_RETURN_IF_ERROR(up(L.shared_w2, 0));
        D.sh_w2_8.quantize(bf(tmp), st);
      }
      HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {
      const size_t i = static_cast<size_t>(e), at = i * 2 * mat;
      uint8_t* w13 = D.w13.get<uint8_t>();
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(w13 + at, L.w1[i].bytes.data(), mat, cudaMemcpyHostToDevice));
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(w13 + at + mat, L.w3[i].bytes.data(), mat, cudaMemcpyHostToDevice));
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(D.w2.get<uint8_t>() + i * mat, L.w2[i].bytes.data(),
                                             mat, cudaMemcpyHostToDevice));
    }
    if (D.sh_w13) {
      const size_t half = L.shared_w1.bytes.size();
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(D.sh_w13.get(), L.shared_w1.bytes.data(), half, cudaMemcpyHostToDevice));
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(
          D.sh_w13.get<uint8_t>() + half, L.shared_w3.bytes.data(), half, cudaMemcpyHostToDevice));
      HETERO_RETURN_IF_ERROR(put(D.sh_w2, L.shared_w2));
    }
  }
  return Status::ok();
}

Status Dsv4CudaEngine::fill_random(uint64_t seed) {
  Impl& m = *impl_;
  const Dsv4Config& c = config_;
  cudaStream_t st = m.stream.get();
  if (m.embed) cuda::fill_random_bf16(bf(m.embed), c.vocab * c.hidden, 1.0f, seed, st);
  uint64_t k = seed * 1000;  // each weight's stream: the same whichever layers a stage holds
  // Quantized forms: each matrix drawn in bf16 into scratch, then quantized (FP8 under kFp8
  // with float32 scales; under kCheckpoint into the official forms with UE8M0 scales).
  cuda::DeviceBuffer scratch, e8m0;
  for (int64_t l = 0; l < c.layers; ++l) {
    for (const Spec& s : layer_specs(m.layers[static_cast<size_t>(l)], c, l)) {
      ++k;
      if (l < m.first || l >= m.end) continue;
      const Form form = form_of(s, options_.weight_dtype);
      const float sc = 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(1, s.fan_in)));
      if (form != Form::kBf16OrF32) {
        const int64_t mats = s.count / (s.rows * s.cols);
        HETERO_RETURN_IF_ERROR(
            m.ensure(scratch, static_cast<size_t>(s.rows * s.cols) * 2, "random weights"));
        HETERO_RETURN_IF_ERROR(
            m.ensure(e8m0, cuda::Fp4GroupWeight::scale_bytes(s.rows, s.cols), "random weights"));
        for (int64_t i = 0; i < mats; ++i) {
          cuda::fill_random_bf16(bf(scratch), s.rows * s.cols, sc, k * 1000003 + i, st);
          if (form == Form::kFp4) {
            const cuda::Fp4GroupWeight w = s.fp4->at(i);
            cuda::quantize_fp4_ue8m0(bf(scratch), s.rows, s.cols, const_cast<uint8_t*>(w.codes),
                                     const_cast<uint8_t*>(w.scale), st);
          } else if (m.ckpt) {
            const cuda::Fp8BlockWeight w = s.fp8->at(i);
            cuda::quantize_fp8_ue8m0(bf(scratch), s.rows, s.cols, const_cast<uint8_t*>(w.q),
                                     e8m0.get<uint8_t>(), st);
            cuda::ue8m0_to_fp8_scales(e8m0.get<uint8_t>(), s.rows, s.cols,
                                      const_cast<float*>(w.scale), st);
          } else {
            s.fp8->quantize_one(bf(scratch), i, st);
          }
        }
        continue;
      }
      switch (s.init) {
        case Init::kMatrix:
          if (s.elem_bytes == 2)
            cuda::fill_random_bf16(bf(*s.buf), s.count, sc, k, st);
          else
            cuda::fill_random_f32(f32(*s.buf), s.count, sc, 0.0f, k, st);
          break;
        case Init::kNorm:
          cuda::fill_random_bf16(bf(*s.buf), s.count, 0.1f, k, st);  // then + 1 below
          break;
        case Init::kSmall:
          if (s.elem_bytes == 2)
            cuda::fill_random_bf16(bf(*s.buf), s.count, 0.1f, k, st);
          else
            cuda::fill_random_f32(f32(*s.buf), s.count, 0.1f, 0.0f, k, st);
          break;
        case Init::kHcScale:
          cuda::fill_random_f32(f32(*s.buf), s.count, 0.1f, 1.0f, k, st);
          break;
        case Init::kSink:
          cuda::fill_random_f32(f32(*s.buf), s.count, 1.0f, 0.0f, k, st);
          break;
        case Init::kExpertId:
          cuda::fill_random_i32(s.buf->get<int32_t>(), s.count,
                                static_cast<int32_t>(c.n_routed_experts), k, st);
          break;
      }
    }
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // Norm weights near one: fill 1 + N(0, 0.1) by adding one on the host side of a small copy.
  for (int64_t l = m.first; l < m.end; ++l)
    for (const Spec& s : layer_specs(m.layers[static_cast<size_t>(l)], c, l)) {
      if (s.init != Init::kNorm) continue;
      std::vector<uint16_t> v(static_cast<size_t>(s.count));
      HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(v.data(), s.buf->get(), v.size() * 2, cudaMemcpyDeviceToHost));
      for (auto& x : v) x = f32_to_bf16(1.0f + bf16_to_f32(x));
      HETERO_RETURN_IF_ERROR(put(*s.buf, v.data(), v.size() * 2));
    }
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  return Status::ok();
}

namespace {

// Host -> device copies of a checkpoint's tensors through two page-locked halves of one buffer:
// the next piece is read from disk while the last one is copied, and the host holds only this
// buffer, whatever the checkpoint's size.
class Stager {
 public:
  static constexpr size_t kHalf = size_t{32} << 20;
  Status init(cudaStream_t st) {
    st_ = st;
    HETERO_RETURN_IF_ERROR(buf_.allocate(2 * kHalf, "checkpoint staging"));
    for (auto& e : done_) {
      HETERO_ASSIGN_OR_RETURN(e, cuda::Event::create());
    }
    for (auto& e : done_) HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(e.get(), st_));
    return Status::ok();
  }
  // e's bytes [0, n) (all when n < 0) to device memory dst.
  Status copy(const CheckpointReader& r, const TensorEntry& e, void* dst, int64_t n = -1) {
    if (n < 0) n = e.bytes;
    for (int64_t off = 0; off < n;) {
      const int64_t piece = std::min<int64_t>(static_cast<int64_t>(kHalf), n - off);
      uint8_t* half = buf_.get<uint8_t>() + static_cast<size_t>(next_) * kHalf;
      HETERO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_[next_].get()));
      HETERO_RETURN_IF_ERROR(r.read(e, off, piece, half));
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + off, half,
                                                  static_cast<size_t>(piece),
                                                  cudaMemcpyHostToDevice, st_));
      HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_[next_].get(), st_));
      next_ ^= 1, off += piece;
    }
    return Status::ok();
  }

 private:
  cudaStream_t st_ = nullptr;
  cuda::PinnedBuffer buf_;
  cuda::Event done_[2];
  int next_ = 0;
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string scale_name(const std::string& weight) {
  return weight.substr(0, weight.size() - std::string(".weight").size()) + ".scale";
}

// The checkpoint's tensor `name`, stored as `dtype` (or `alt`) with `shape` (numel only when
// exact_shape is false), or a refusal naming it.
Result<const TensorEntry*> expect(const CheckpointReader& r, const std::string& name,
                                  std::vector<DType> dtypes, const std::vector<int64_t>& shape,
                                  bool exact_shape = true) {
  const TensorEntry* e = r.find(name);
  if (!e)
    return not_found("the checkpoint has no '" + name +
                     "' (checkpoint precision reads DeepSeek-V4's official layout)");
  std::string want;
  for (DType d : dtypes) want += std::string(want.empty() ? "" : " or ") + dtype_name(d);
  if (std::find(dtypes.begin(), dtypes.end(), e->dtype) == dtypes.end())
    return failed_precondition("'" + name + "' is stored as " + dtype_name(e->dtype) +
                               "; checkpoint precision expects " + want);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (exact_shape ? e->shape != shape : e->numel() != numel)
    return failed_precondition("'" + name + "' has shape " + shape_text(e->shape) +
                               "; the config says " + shape_text(shape));
  return e;
}

}  // namespace

Status Dsv4CudaEngine::stream_checkpoint(const std::string& model_dir) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  cudaStream_t st = m.stream.get();
  HETERO_ASSIGN_OR_RETURN(CheckpointReader r, CheckpointReader::open(model_dir));
  Stager stage;
  HETERO_RETURN_IF_ERROR(stage.init(st));
  // UE8M0 scales and the FP8 codes of wo_a on their way to their device form.
  cuda::DeviceBuffer tmp_scale, tmp_codes;
  if (m.embed) {
    HETERO_ASSIGN_OR_RETURN(const TensorEntry* e,
                            expect(r, "embed.weight", {DType::kBF16}, {c.vocab, c.hidden}));
    HETERO_RETURN_IF_ERROR(stage.copy(r, *e, m.embed.get()));
  }
  for (int64_t l = m.first; l < m.end; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const Spec& s : layer_specs(m.layers[static_cast<size_t>(l)], c, l)) {
      const Form form = form_of(s, options_.weight_dtype);
      const int64_t parts = static_cast<int64_t>(s.names.size());
      if (form == Form::kFp4 || form == Form::kFp8) {
        // Each part [rows / parts, cols] (two per expert for w1|w3) laid back to back: codes,
        // then scales.
        const int64_t part_rows = s.count / s.cols / parts;
        int64_t code_at = 0, scale_at = 0;
        const bool fp4 = form == Form::kFp4;
        const int64_t scale_cols = fp4 ? s.cols / cuda::kFp4Group : cuda::fp8_blocks(s.cols);
        const int64_t scale_rows = fp4 ? part_rows : cuda::fp8_blocks(part_rows);
        if (!fp4)
          HETERO_RETURN_IF_ERROR(m.ensure(
              tmp_scale, static_cast<size_t>(parts * scale_rows * scale_cols), "FP8 scales"));
        for (const std::string& name : s.names) {
          HETERO_ASSIGN_OR_RETURN(
              const TensorEntry* codes,
              fp4 ? expect(r, p + name, {DType::kI8, DType::kU8}, {part_rows, s.cols / 2})
                  : expect(r, p + name, {DType::kF8E4M3}, {part_rows, s.cols}));
          HETERO_ASSIGN_OR_RETURN(
              const TensorEntry* scale,
              expect(r, p + scale_name(name), {DType::kF8E8M0}, {scale_rows, scale_cols}));
          uint8_t* code_dst = fp4 ? s.fp4->codes.get<uint8_t>() : s.fp8->q.get<uint8_t>();
          uint8_t* scale_dst = fp4 ? s.fp4->scale.get<uint8_t>() : tmp_scale.get<uint8_t>();
          HETERO_RETURN_IF_ERROR(stage.copy(r, *codes, code_dst + code_at));
          HETERO_RETURN_IF_ERROR(stage.copy(r, *scale, scale_dst + scale_at));
          code_at += codes->bytes, scale_at += scale->bytes;
        }
        if (!fp4)  // one matrix: the parts' row blocks are whole (check_options)
          cuda::ue8m0_to_fp8_scales(tmp_scale.get<uint8_t>(), s.count / s.cols, s.cols,
                                    f32(s.fp8->scale), st);
        continue;
      }
      const std::string name = p + s.names.front();
      if (s.fp8_stored) {  // wo_a: FP8 in the official checkpoint, bf16 on the device
        const int64_t rows = s.count / s.fan_in, cols = s.fan_in;
        HETERO_ASSIGN_OR_RETURN(const TensorEntry* codes,
                                expect(r, name, {DType::kF8E4M3}, {rows, cols}));
        HETERO_ASSIGN_OR_RETURN(const TensorEntry* scale,
                                expect(r, p + scale_name(s.names.front()), {DType::kF8E8M0},
                                       {cuda::fp8_blocks(rows), cuda::fp8_blocks(cols)}));
        HETERO_RETURN_IF_ERROR(m.ensure(tmp_codes, static_cast<size_t>(codes->bytes), "wo_a"));
        HETERO_RETURN_IF_ERROR(m.ensure(tmp_scale, static_cast<size_t>(scale->bytes), "wo_a"));
        HETERO_RETURN_IF_ERROR(stage.copy(r, *codes, tmp_codes.get()));
        HETERO_RETURN_IF_ERROR(stage.copy(r, *scale, tmp_scale.get()));
        cuda::dequant_fp8_ue8m0_to_bf16(tmp_codes.get<uint8_t>(), tmp_scale.get<uint8_t>(), rows,
                                        cols, bf(*s.buf), st);
        continue;
      }
      if (s.elem_bytes == 2) {
        HETERO_ASSIGN_OR_RETURN(const TensorEntry* e,
                                expect(r, name, {DType::kBF16}, {s.count}, false));
        HETERO_RETURN_IF_ERROR(stage.copy(r, *e, s.buf->get()));
        continue;
      }
      if (s.init == Init::kExpertId) {  // tid2eid: I64 [vocab, top_k] -> int32, each checked
        HETERO_ASSIGN_OR_RETURN(const TensorEntry* e,
                                expect(r, name, {DType::kI64}, {c.vocab, c.experts_per_tok}));
        std::vector<int64_t> ids(static_cast<size_t>(e->numel()));
        HETERO_RETURN_IF_ERROR(r.read(*e, 0, e->bytes, ids.data()));
        std::vector<int32_t> narrow(ids.size());
        for (size_t i = 0; i < ids.size(); ++i) {
          if (ids[i] < 0 || ids[i] >= c.n_routed_experts)
            return failed_precondition("'" + name + "' routes to expert " + std::to_string(ids[i]) +
                                       " of " + std::to_string(c.n_routed_experts));
          narrow[i] = static_cast<int32_t>(ids[i]);
        }
        HETERO_RETURN_IF_ERROR(put(*s.buf, narrow.data(), narrow.size() * 4));
        continue;
      }
      HETERO_ASSIGN_OR_RETURN(const TensorEntry* e,
                              expect(r, name, {DType::kF32}, {s.count}, false));
      std::vector<float> v(static_cast<size_t>(s.count));
      HETERO_RETURN_IF_ERROR(r.read(*e, 0, e->bytes, v.data()));
      if (s.init == Init::kSink) round_sinks(v);
      HETERO_RETURN_IF_ERROR(put(*s.buf, v));
    }
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  return Status::ok();
}

Status Dsv4CudaEngine::finish_experts() {
  Impl& m = *impl_;
  if (options_.widen_experts_at_load) return widen_experts();
  if (!m.w4a8) return Status::ok();
  for (int64_t l = m.first; l < m.end; ++l) {
    DLayer& L = m.layers[static_cast<size_t>(l)];
    for (DFp4* f4 : {&L.w13_4, &L.w2_4}) {
      HETERO_RETURN_IF_ERROR(m.alloc(f4->block_max,
                                     cuda::Fp4Experts::block_max_bytes(f4->mats, f4->n, f4->k),
                                     "FP4 experts' block exponents"));
      cuda::fp4_block_max(f4->at(0), f4->mats, f4->block_max.get<uint8_t>(), m.stream.get());
      weight_bytes_ += static_cast<int64_t>(f4->block_max.bytes());
    }
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream.get()));
  return Status::ok();
}

// Each layer's routed experts from FP4 to FP8, one layer at a time, its FP4 form freed before
// the next layer is widened (so the peak is the widened layers, the rest still FP4, and one
// layer of both). The widening kernel is the one the per-chunk path runs, so the codes and
// scales the GEMMs read are the same bits.
Status Dsv4CudaEngine::widen_experts() {
  Impl& m = *impl_;
  cudaStream_t st = m.stream.get();
  cuda::DeviceBuffer ids;  // int32 0..mats-1
  for (int64_t l = m.first; l < m.end; ++l) {
    DLayer& L = m.layers[static_cast<size_t>(l)];
    for (auto [f4, f8] : {std::pair{&L.w13_4, &L.w13_8}, std::pair{&L.w2_4, &L.w2_8}}) {
      f8->n = f4->n, f8->k = f4->k, f8->mats = f4->mats;
      HETERO_RETURN_IF_ERROR(
          m.alloc(f8->q, static_cast<size_t>(f8->mats * f8->n * f8->k), "widened FP8 experts"));
      HETERO_RETURN_IF_ERROR(m.alloc(f8->scale,
                                     static_cast<size_t>(f8->mats * f8->scale_floats()) * 4,
                                     "widened FP8 experts"));
      // Every expert in one launch (the list 0..mats-1), into the layout the GEMMs read.
      if (ids.bytes() < static_cast<size_t>(f8->mats) * 4) {
        std::vector<int32_t> all(static_cast<size_t>(f8->mats));
        std::iota(all.begin(), all.end(), 0);
        HETERO_RETURN_IF_ERROR(ids.allocate(all.size() * 4, "the experts' list"));
        HETERO_CUDA_RETURN_IF_ERROR(
            cudaMemcpy(ids.get(), all.data(), all.size() * 4, cudaMemcpyHostToDevice));
      }
      cuda::widen_fp4_experts_to_fp8(f4->at(0), ids.get<int32_t>(), f8->mats, f8->q.get<uint8_t>(),
                                     f32(f8->scale), m.lossy.get<unsigned long long>(), st);
      HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
      weight_bytes_ += static_cast<int64_t>(f8->q.bytes() + f8->scale.bytes()) -
                       static_cast<int64_t>(f4->codes.bytes() + f4->scale.bytes());
      f4->codes.reset(), f4->scale.reset(), f4->mats = 0;
    }
  }
  return Status::ok();
}

}  // namespace hetero
