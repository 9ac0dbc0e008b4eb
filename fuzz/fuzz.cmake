# libFuzzer targets (clang; -DHETERO_FUZZ=ON in their own build tree, `make fuzz`): every
# library they reach is compiled with AddressSanitizer, UndefinedBehaviorSanitizer and the
# fuzzer's coverage (the flags are set in CMakeLists.txt before any target).
foreach(target wire prefill_request front_request safetensors auth http_server)
  add_executable(hetero_fuzz_${target} fuzz/${target}_fuzz.cc)
  target_include_directories(hetero_fuzz_${target} PRIVATE fuzz)
  target_link_options(hetero_fuzz_${target} PRIVATE -fsanitize=fuzzer)
endforeach()
target_link_libraries(hetero_fuzz_wire PRIVATE hetero_decode)
target_link_libraries(hetero_fuzz_prefill_request PRIVATE hetero_bridge)
target_link_libraries(hetero_fuzz_front_request PRIVATE hetero_front)
target_link_libraries(hetero_fuzz_safetensors PRIVATE hetero_common)
target_link_libraries(hetero_fuzz_auth PRIVATE hetero_common)
target_link_libraries(hetero_fuzz_http_server PRIVATE hetero_common)
add_executable(hetero_fuzz_seeds fuzz/make_seeds.cc)
target_include_directories(hetero_fuzz_seeds PRIVATE fuzz)
target_link_libraries(hetero_fuzz_seeds PRIVATE hetero_bridge)
