# DeepSeek-V4 on the GPU: the forward's sources join hetero_engine_cuda; its tests join
# hetero_gpu_tests; its layer benchmark is its own executable.
target_sources(hetero_engine_cuda PRIVATE src/engine/cuda/dsv4_cuda.cc
                                          src/engine/cuda/dsv4_cuda_layers.cc
                                          src/engine/cuda/dsv4_cuda_weights.cc
                                          src/kernels/cuda/checkpoint_formats.cu
                                          src/kernels/cuda/dsv4_fwd_ops.cu
                                          src/kernels/cuda/dsv4_fwd_attention.cu)
target_sources(hetero_gpu_tests PRIVATE tests/gpu/dsv4_cuda_test.cc
                                        tests/gpu/checkpoint_precision_test.cc)
add_executable(hetero_gpu_dsv4_layer_bench bench/gpu/dsv4_layer_bench.cc)
target_link_libraries(hetero_gpu_dsv4_layer_bench PRIVATE hetero_engine_cuda hetero_bridge_cuda)
add_executable(hetero_gpu_dsv4_checkpoint_load_bench bench/gpu/dsv4_checkpoint_load_bench.cc)
target_link_libraries(hetero_gpu_dsv4_checkpoint_load_bench PRIVATE hetero_engine_cuda)
