#!/usr/bin/env bash
# `make unit`: runs the C++ tests and fails when one that should have run was skipped. GPU tests
# (label gpu) may skip only where no GPU is usable; every other test must run.
set -uo pipefail
cd "$(dirname "$0")/../build" || exit 2
jobs=${JOBS:-2}
rc=0
ctest --output-on-failure -L unit -j"$jobs" | tee ctest-unit.log || rc=1
if grep -q '(Skipped)' ctest-unit.log; then
  echo "skipped unit tests (they must run everywhere):"
  grep '(Skipped)' ctest-unit.log
  rc=1
fi
if ctest -N -L gpu | grep -q 'Total Tests: [1-9]'; then
  ctest --output-on-failure -L gpu -j1 | tee ctest-gpu.log || rc=1
  skipped=$(grep -c '(Skipped)' ctest-gpu.log)
  if ((skipped > 0)); then
    # On a machine with a GPU, only a test that needs a second one may skip (its reason says
    # "one GPU:"); every other skip fails the run.
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if ((gpus == 0)); then
      echo "GPU tests skipped: no GPU on this machine ($skipped tests)"
    else
      other=$(grep -A1 ': Skipped$' Testing/Temporary/LastTest.log | grep -v ': Skipped$' |
              grep -v '^--$' | grep -vc '^one GPU:')
      echo "GPU tests skipped on a machine with $gpus GPU(s): $skipped, for another reason: $other"
      ((other == 0)) || rc=1
    fi
  fi
fi
exit $rc
