# DeepSeek-V4 on the GPU: the forward's sources join hetero_engine_cuda; its tests join
# hetero_gpu_tests; its layer benchmark is its own executable.
target_sources(hetero_engine_cuda PRIVATE src/engine/cuda/dsv4_cuda.cc
                                          src/engine/cuda/dsv4_cuda_checkpoint.cc
                                          src/engine/cuda/dsv4_cuda_forward.cc
                                          src/engine/cuda/dsv4_cuda_layers.cc
                                          src/engine/cuda/dsv4_cuda_weights.cc
                                          src/engine/cuda/dsv4_pipeline.cc
                                          src/kernels/cuda/checkpoint_formats.cu
                                          src/kernels/cuda/dsv4_fwd_ops.cu
                                          src/kernels/cuda/dsv4_fwd_attention.cu
                                          src/kernels/cuda/dsv4_fwd_index.cu
                                          src/kernels/cuda/dsv4_fwd_norm.cu)
target_sources(hetero_gpu_tests PRIVATE tests/gpu/dsv4_cuda_test.cc
                                        tests/gpu/dsv4_attention_test.cc
                                        tests/gpu/dsv4_fwd_ops_test.cc
                                        tests/gpu/checkpoint_precision_test.cc
                                        tests/gpu/dsv4_pipeline_test.cc
                                        tests/gpu/dsv4_served_gpu_test.cc)
add_executable(hetero_gpu_dsv4_layer_bench bench/gpu/dsv4_layer_bench.cc)
target_link_libraries(hetero_gpu_dsv4_layer_bench PRIVATE hetero_engine_cuda hetero_bridge_cuda)
add_executable(hetero_gpu_dsv4_checkpoint_load_bench bench/gpu/dsv4_checkpoint_load_bench.cc)
target_link_libraries(hetero_gpu_dsv4_checkpoint_load_bench PRIVATE hetero_engine_cuda)

# NCCL links the stages of a layer pipeline that sit on different GPUs (dsv4_pipeline.h). Optional:
# without it the build still works, and only pipelines whose stages share one GPU run.
find_path(HETERO_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
find_library(HETERO_NCCL_LIB nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib
             ${CUDAToolkit_LIBRARY_ROOT}/lib64)
if(HETERO_NCCL_INCLUDE AND HETERO_NCCL_LIB)
  message(STATUS "NCCL: ${HETERO_NCCL_LIB} (pipeline stages on several GPUs)")
  target_compile_definitions(hetero_engine_cuda PUBLIC HETERO_HAVE_NCCL)
  target_include_directories(hetero_engine_cuda PRIVATE ${HETERO_NCCL_INCLUDE})
  target_link_libraries(hetero_engine_cuda PUBLIC ${HETERO_NCCL_LIB})
else()
  message(STATUS "NCCL not found: pipeline stages on one GPU only")
endif()
add_executable(hetero_gpu_dsv4_pipeline_bench bench/gpu/dsv4_pipeline_bench.cc)
target_link_libraries(hetero_gpu_dsv4_pipeline_bench PRIVATE hetero_engine_cuda hetero_bridge_cuda)
