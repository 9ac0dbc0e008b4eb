// The hetero command: one binary, subcommands like git.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "commands.h"

namespace {

struct Subcommand {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

const Subcommand kSubcommands[] = {
    {"prefill", hetero::cmd_prefill, "prefill engine: serve POST /v1/prefill, or run one offline"},
    {"program", hetero::cmd_program, "run the cache program on dumped attention inputs"},
    {"verify", hetero::cmd_verify, "one bridge vs the decoder natively: arrays and continuation"},
    {"compare", hetero::cmd_compare, "compare the tensors of two safetensors files"},
    {"front", hetero::cmd_front, "the OpenAI-compatible front door with bridge routing"},
    {"up", hetero::cmd_up, "start prefill host, decoder (with seam) and front on one model"},
    {"doctor", hetero::cmd_doctor, "check every link of a running stack"},
    {"bench", hetero::cmd_bench, "benchmarks: 'hetero bench cold' (native vs bridged TTFT)"},
    {"options-doc", hetero::cmd_options_doc, "print every option table as markdown"},
};

void usage() {
  std::fprintf(stderr, "usage: hetero <command> [options]\n\ncommands:\n");
  for (const auto& s : kSubcommands) std::fprintf(stderr, "  %-12s %s\n", s.name, s.summary);
  std::fprintf(stderr, "\n'hetero <command> --help' for a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  // OpenMP workers spin after each parallel region by default; on a 2-core machine with the
  // program thread beside the forward, that spinning steals the cores the work needs (small
  // chunks ran 40x slower). libgomp reads the policy when it loads, so set it and re-exec once.
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);  // on failure, carry on with the default policy
  }
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  for (const auto& s : kSubcommands)
    if (!std::strcmp(argv[1], s.name)) return s.run(argc - 2, argv + 2);
  std::fprintf(stderr, "hetero: unknown command '%s'\n", argv[1]);
  usage();
  return 2;
}
