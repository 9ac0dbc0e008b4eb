// hetero-front: the front door alone, as the decode host runs it (`hetero front` in the full
// binary). It links no prefill engine and no GPU code (cmake/layers.cmake checks), so it builds
// wherever the decoder runs.
#include "commands.h"

int main(int argc, char** argv) { return hetero::cmd_front(argc - 1, argv + 1); }
