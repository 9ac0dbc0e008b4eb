// The CUTLASS side of fp8_grouped_gemm.h: the grouped Hopper kernel of a tile configuration
// (GroupedKernel<Cfg>), compiled for sm_90a in fp8_grouped_gemm_kernel.cu, the only file that
// includes CUTLASS (a configuration is a minute of compile time on two cores).
//
// The problem per group is CUTLASS's (M, N, K) = (rows, n, k): A the activations (row-major, one
// scale per row and 128 columns), B the weight (column-major B = row-major W [n, k], one scale per
// 128x128 block), D row-major bf16. No source operand C (beta is 0).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/fp8_grouped_gemm.h"

namespace hetero::cuda::grouped_detail {

// A kernel configuration behind one interface: how many bytes a launch's argument arrays and
// workspace take, and the launch itself (arguments staged in `host`, copied to `dev` on the
// stream).
class Runner {
 public:
  virtual ~Runner() = default;
  virtual size_t arg_bytes(int64_t groups) const = 0;
  virtual size_t workspace_bytes(int64_t groups, int device, int sm_count) const = 0;
  virtual Status run(const Fp8GemmGroup* groups, int64_t count, int64_t n, int64_t k, void* host,
                     void* dev, void* workspace, size_t workspace_bytes, int device, int sm_count,
                     cudaStream_t stream) = 0;
};

std::unique_ptr<Runner> make_runner();  // null where the build has no CUTLASS

}  // namespace hetero::cuda::grouped_detail

#if defined(HETERO_GROUPED_KERNEL_DEFINITIONS)
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace hetero::cuda::grouped_detail {

using namespace cute;

// Tile, cluster and the two schedules of one configuration.
template <class TileT, class ClusterT, class MainloopSchedule, class EpilogueSchedule>
struct Cfg {
  using Tile = TileT;
  using Cluster = ClusterT;
  using Mainloop = MainloopSchedule;
  using Epilogue = EpilogueSchedule;
};

template <class C>
class GroupedKernel final : public Runner {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 8;  // 16 bytes each
  // One scale per row and 128 columns for the rows, per 128x128 block for the weight.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename C::Tile, typename C::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, typename C::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignB, float, typename C::Tile, typename C::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename C::Mainloop>::CollectiveOp;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The per-group argument arrays, one after another in one block (host staging and device
  // copy): each array starts on a 16-byte boundary.
  struct ArgLayout {
    size_t shapes, a, sa, sfa, lsfa, b, sb, sfb, lsfb, d, sd, bytes;
    explicit ArgLayout(int64_t g) {
      size_t at = 0;
      auto take = [&](size_t each) {
        const size_t here = at;
        at += (each * static_cast<size_t>(g) + 15) / 16 * 16;
        return here;
      };
      shapes = take(sizeof(Shape3));
      a = take(sizeof(void*)), sa = take(sizeof(StrideA));
      sfa = take(sizeof(void*)), lsfa = take(sizeof(LayoutSFA));
      b = take(sizeof(void*)), sb = take(sizeof(StrideB));
      sfb = take(sizeof(void*)), lsfb = take(sizeof(LayoutSFB));
      d = take(sizeof(void*)), sd = take(sizeof(StrideD));
      bytes = at;
    }
  };
  template <class T>
  static T* at(void* base, size_t off) {
    return reinterpret_cast<T*>(static_cast<char*>(base) + off);
  }
  static cutlass::KernelHardwareInfo hw(int device, int sm_count) {
    cutlass::KernelHardwareInfo h;
    h.device_id = device;
    h.sm_count = sm_count;
    return h;
  }

 public:
  size_t arg_bytes(int64_t groups) const override { return ArgLayout(groups).bytes; }

  size_t workspace_bytes(int64_t groups, int device, int sm_count) const override {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(groups), nullptr, nullptr};
    args.hw_info = hw(device, sm_count);
    return Gemm::get_workspace_size(args);
  }

  Status run(const Fp8GemmGroup* groups, int64_t count, int64_t n, int64_t k, void* h, void* d,
             void* workspace, size_t workspace_bytes, int device, int sm_count,
             cudaStream_t stream) override {
    const ArgLayout L(count);
    host_shapes_.resize(static_cast<size_t>(count));
    for (int64_t g = 0; g < count; ++g) {
      const Fp8GemmGroup& x = groups[g];
      const int M = static_cast<int>(x.rows), N = static_cast<int>(n), K = static_cast<int>(k);
      const Shape3 shape{M, N, K};
      host_shapes_[static_cast<size_t>(g)] = shape;
      at<Shape3>(h, L.shapes)[g] = shape;
      at<const void*>(h, L.a)[g] = x.act_q;
      at<StrideA>(h, L.sa)[g] = cutlass::make_cute_packed_stride(StrideA{}, {M, K, 1});
      at<const void*>(h, L.sfa)[g] = x.act_scale;
      at<LayoutSFA>(h, L.lsfa)[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
      at<const void*>(h, L.b)[g] = x.w_q;
      at<StrideB>(h, L.sb)[g] = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
      at<const void*>(h, L.sfb)[g] = x.w_scale_t;
      at<LayoutSFB>(h, L.lsfb)[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
      at<void*>(h, L.d)[g] = x.out;
      at<StrideD>(h, L.sd)[g] = cutlass::make_cute_packed_stride(StrideD{}, {M, N, 1});
    }
    const cudaError_t copied = cudaMemcpyAsync(d, h, L.bytes, cudaMemcpyHostToDevice, stream);
    if (copied != cudaSuccess)
      return internal_error(std::string("grouped FP8 GEMM arguments: ") +
                            cudaGetErrorString(copied));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {static_cast<int>(count), at<Shape3>(d, L.shapes), host_shapes_.data()},
        {at<const ElementA*>(d, L.a), at<StrideA>(d, L.sa), at<const ElementB*>(d, L.b),
         at<StrideB>(d, L.sb), at<const float*>(d, L.sfa), at<LayoutSFA>(d, L.lsfa),
         at<const float*>(d, L.sfb), at<LayoutSFB>(d, L.lsfb)},
        {{}, nullptr, nullptr, at<ElementD*>(d, L.d), at<StrideD>(d, L.sd)},
        hw(device, sm_count)};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    const std::string shape = "grouped FP8 GEMM (" + std::to_string(count) +
                              " groups, n=" + std::to_string(n) + " k=" + std::to_string(k) + ")";
    cutlass::Status st = gemm_.can_implement(args);
    if (st != cutlass::Status::kSuccess)
      return failed_precondition(shape + ": " + cutlassGetStatusString(st));
    if (Gemm::get_workspace_size(args) > workspace_bytes)
      return internal_error(shape + ": the workspace sized at creation is too small");
    st = gemm_.initialize(args, workspace, stream);
    if (st != cutlass::Status::kSuccess)
      return internal_error(shape + ", initialize: " + cutlassGetStatusString(st));
    st = gemm_.run(stream);
    if (st != cutlass::Status::kSuccess)
      return internal_error(shape + ", run: " + cutlassGetStatusString(st));
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess)
      return internal_error(shape + ", launch: " + cudaGetErrorString(launched));
    return Status::ok();
  }

 private:
  Gemm gemm_;
  std::vector<Shape3> host_shapes_;
};

}  // namespace hetero::cuda::grouped_detail
#endif
