#include "kernels/cuda/cudnn_attention.h"

#include <map>
#include <tuple>
#include <utility>

#include "kernels/cuda/device.h"
#include "kernels/cuda/fast_ops.h"
#include "kernels/cuda/resource.h"

#if HETERO_HAVE_CUDNN
#include <cudnn.h>
#include <cudnn_frontend.h>
#endif

namespace hetero::cuda {

#if !HETERO_HAVE_CUDNN

namespace {
Status no_cudnn() {
  return unavailable(
      "this build has no cuDNN attention (cuDNN's headers and library, and its frontend's headers "
      "from `make`, are needed when building)");
}
}  // namespace

bool cudnn_attention_built() { return false; }
Result<std::string> cudnn_attention_runtime() { return no_cudnn(); }
struct CudnnAttention::Impl {
  std::string name;
};
CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnAttention::~CudnnAttention() = default;
Result<std::unique_ptr<CudnnAttention>> CudnnAttention::create(int, int, int, float, int) {
  return no_cudnn();
}
Status CudnnAttention::begin_chunk(int64_t, int64_t, int64_t, cudaStream_t) { return no_cudnn(); }
Status CudnnAttention::run(const uint16_t*, const CudnnPagedKv&, uint16_t*, cudaStream_t) {
  return no_cudnn();
}
const std::string& CudnnAttention::name() const { return impl_->name; }

#else

namespace fe = cudnn_frontend;

namespace {

Status cudnn_status(cudnnStatus_t s, const char* call) {
  if (s == CUDNN_STATUS_SUCCESS) return Status::ok();
  return internal_error(std::string(call) + ": " + cudnnGetErrorString(s));
}

// The frontend's error as a Status: a graph cuDNN does not support is a precondition the shape
// fails; anything else is internal.
Status fe_status(fe::error_t e, const char* step) {
  if (e.is_good()) return Status::ok();
  std::string m = std::string("cuDNN attention, ") + step + ": " + e.get_message();
  return e.get_code() == fe::error_code_t::GRAPH_NOT_SUPPORTED ? failed_precondition(std::move(m))
                                                               : internal_error(std::move(m));
}

#define HETERO_FE_RETURN_IF_ERROR(expr, step)       \
  do {                                              \
    ::hetero::Status st_ = fe_status((expr), step); \
    if (!st_.is_ok()) return st_;                   \
  } while (0)

std::string version_text(size_t v) {
  // cuDNN 9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

enum Uid : int64_t { kQ = 1, kK, kV, kO, kSeqQ, kSeqKv, kTableK, kTableV };

}  // namespace

bool cudnn_attention_built() { return true; }

Result<std::string> cudnn_attention_runtime() {
  const size_t v = cudnnGetVersion();
  if (v / 10000 != CUDNN_MAJOR)
    return unavailable("cuDNN " + version_text(v) + " is loaded; this build needs major " +
                       std::to_string(CUDNN_MAJOR));
  return "cuDNN " + version_text(v);
}

struct CudnnAttention::Impl {
  int heads = 0, kv_heads = 0, head_dim = 0, device = 0;
  float scale = 1.f;
  std::string name;
  cudnnHandle_t handle = nullptr;
  // The chunk's lengths [seq_q, seq_kv] and the identity page table, on the device.
  DeviceBuffer lengths, table, workspace;
  int64_t table_pages = 0;
  int64_t n = 0, pages = 0;  // the chunk's
  // By (query rows, pages, page stride: 0 for the token-major layout).
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::shared_ptr<fe::graph::Graph>> graphs;
  fe::graph::Graph* graph = nullptr;  // the chunk's
  bool graph_token_major = false;
  int64_t graph_stride = 0;

  ~Impl() {
    graphs.clear();
    if (handle) cudnnDestroy(handle);
  }

  Result<std::shared_ptr<fe::graph::Graph>> build(int64_t n_rows, int64_t n_pages, bool token_major,
                                                  int64_t page_stride) const {
    const int64_t H = heads, Hk = kv_heads, D = head_dim, P = n_pages;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    using TA = fe::graph::Tensor_attributes;
    // q and out are [n][heads][d] row-major: dims (batch, head, row, d).
    const std::vector<int64_t> q_dim = {1, H, n_rows, D}, q_stride = {n_rows * H * D, D, H * D, 1};
    auto q = g->tensor(TA().set_name("q").set_uid(kQ).set_dim(q_dim).set_stride(q_stride));
    // A layer's cache: one entry per page; every layer's pages share one stride (one slab per
    // layer), so one graph serves all layers with their own base pointers. Token-major: rows.
    auto kv_tensor = [&](const char* nm, int64_t uid) {
      auto t = TA().set_name(nm).set_uid(uid);
      if (token_major)
        t.set_dim({1, Hk, P * kKvPageTokens, D})
            .set_stride({P * kKvPageTokens * Hk * D, D, Hk * D, 1});
      else
        t.set_dim({P, Hk, kKvPageTokens, D}).set_stride({page_stride, kKvPageTokens * D, D, 1});
      return g->tensor(t);
    };
    auto k = kv_tensor("k_pages", kK);
    auto v = kv_tensor("v_pages", kV);
    auto len = [&](const char* nm, int64_t uid) {
      return g->tensor(TA().set_name(nm)
                           .set_uid(uid)
                           .set_dim({1, 1, 1, 1})
                           .set_stride({1, 1, 1, 1})
                           .set_data_type(fe::DataType_t::INT32));
    };
    auto seq_q = len("seq_q", kSeqQ), seq_kv = len("seq_kv", kSeqKv);
    auto tab = [&](const char* nm, int64_t uid) {
      return g->tensor(TA().set_name(nm)
                           .set_uid(uid)
                           .set_dim({1, 1, P, 1})
                           .set_stride({P, P, 1, 1})
                           .set_data_type(fe::DataType_t::INT32));
    };
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("attention")
                    .set_generate_stats(false)
                    .set_attn_scale(scale)
                    .set_causal_mask_bottom_right(true)
                    .set_padding_mask(true)
                    .set_seq_len_q(seq_q)
                    .set_seq_len_kv(seq_kv);
    if (!token_major)
      opts.set_paged_attention_k_table(tab("table_k", kTableK))
          .set_paged_attention_v_table(tab("table_v", kTableV))
          .set_paged_attention_max_seq_len_kv(static_cast<int>(P * kKvPageTokens));
    auto [o, stats] = g->sdpa(q, k, v, opts);
    (void)stats;
    o->set_output(true).set_uid(kO).set_dim(q_dim).set_stride(q_stride);
    HETERO_FE_RETURN_IF_ERROR(g->validate(), "validate");
    HETERO_FE_RETURN_IF_ERROR(g->build_operation_graph(handle), "operation graph");
    HETERO_FE_RETURN_IF_ERROR(
        g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "plans");
    HETERO_FE_RETURN_IF_ERROR(g->check_support(), "support");
    HETERO_FE_RETURN_IF_ERROR(g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build");
    return g;
  }
};

CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnAttention::~CudnnAttention() {
  if (impl_) {
    DeviceGuard on(impl_->device);
    impl_.reset();
  }
}

Result<std::unique_ptr<CudnnAttention>> CudnnAttention::create(int heads, int kv_heads,
                                                               int head_dim, float scale,
                                                               int device) {
  HETERO_ASSIGN_OR_RETURN(std::string runtime, cudnn_attention_runtime());
  if (kv_heads <= 0 || heads % kv_heads != 0 || head_dim % 8 != 0)
    return invalid_argument("cuDNN attention: heads " + std::to_string(heads) + ", kv heads " +
                            std::to_string(kv_heads) + ", head_dim " + std::to_string(head_dim));
  DeviceGuard on(device);
  auto impl = std::make_unique<Impl>();
  impl->heads = heads, impl->kv_heads = kv_heads, impl->head_dim = head_dim;
  impl->scale = scale, impl->device = device;
  impl->name = runtime + " SDPA (bf16 cache)";
  HETERO_RETURN_IF_ERROR(cudnn_status(cudnnCreate(&impl->handle), "cudnnCreate"));
  HETERO_RETURN_IF_ERROR(impl->lengths.allocate(2 * sizeof(int32_t), "cuDNN attention's lengths"));
  return std::unique_ptr<CudnnAttention>(new CudnnAttention(std::move(impl)));
}

Status CudnnAttention::begin_chunk(int64_t n, int64_t pos0, int64_t pages, cudaStream_t stream) {
  Impl& I = *impl_;
  if (n <= 0 || pos0 < 0 || (pos0 + n + kKvPageTokens - 1) / kKvPageTokens > pages)
    return invalid_argument("cuDNN attention: " + std::to_string(n) + " rows at " +
                            std::to_string(pos0) + " over " + std::to_string(pages) + " pages");
  set_i32_pair(I.lengths.get<int32_t>(), static_cast<int32_t>(n), static_cast<int32_t>(pos0 + n),
               stream);
  I.n = n, I.pages = pages, I.graph = nullptr;
  return Status::ok();
}

Status CudnnAttention::run(const uint16_t* q, const CudnnPagedKv& kv, uint16_t* out,
                           cudaStream_t stream) {
  Impl& I = *impl_;
  if (kv.pages != I.pages) return invalid_argument("cuDNN attention: the cache grew mid-chunk");
  if (!kv.token_major && I.pages > I.table_pages) {
    // The identity table: page i of the sequence is the slab's page i.
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    HETERO_RETURN_IF_ERROR(I.table.allocate(static_cast<size_t>(I.pages) * sizeof(int32_t),
                                            "cuDNN attention's page table"));
    iota_i32(I.table.get<int32_t>(), I.pages, stream);
    I.table_pages = I.pages;
  }
  const int64_t stride = kv.token_major ? 0 : kv.page_stride;
  if (I.graph == nullptr || I.graph_token_major != kv.token_major || I.graph_stride != stride) {
    auto& g = I.graphs[{I.n, I.pages, stride}];
    if (!g) {
      HETERO_ASSIGN_OR_RETURN(g, I.build(I.n, I.pages, kv.token_major, stride));
      int64_t ws = 0;
      HETERO_FE_RETURN_IF_ERROR(g->get_workspace_size(ws), "workspace");
      if (static_cast<size_t>(ws) > I.workspace.bytes()) {
        HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
        HETERO_RETURN_IF_ERROR(
            I.workspace.allocate(static_cast<size_t>(ws), "cuDNN attention's workspace"));
      }
    }
    I.graph = g.get();
    I.graph_token_major = kv.token_major, I.graph_stride = stride;
  }
  HETERO_RETURN_IF_ERROR(cudnn_status(cudnnSetStream(I.handle, stream), "cudnnSetStream"));
  int32_t* len = I.lengths.get<int32_t>();
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<uint16_t*>(q)},
                                             {kK, const_cast<void*>(kv.k)},
                                             {kV, const_cast<void*>(kv.v)},
                                             {kO, out},
                                             {kSeqQ, len},
                                             {kSeqKv, len + 1}};
  if (!kv.token_major)
    pack[kTableK] = I.table.get<int32_t>(), pack[kTableV] = I.table.get<int32_t>();
  HETERO_FE_RETURN_IF_ERROR(I.graph->execute(I.handle, pack, I.workspace.get()), "execute");
  return Status::ok();
}

const std::string& CudnnAttention::name() const { return impl_->name; }

#endif

}  // namespace hetero::cuda
