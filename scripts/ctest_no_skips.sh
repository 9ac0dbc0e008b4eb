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
  if nvidia-smi -L >/dev/null 2>&1 && grep -q '(Skipped)' ctest-gpu.log; then
    echo "skipped GPU tests on a machine with a GPU:"
    grep '(Skipped)' ctest-gpu.log
    rc=1
  elif grep -q '(Skipped)' ctest-gpu.log; then
    echo "GPU tests skipped: no GPU on this machine ($(grep -c '(Skipped)' ctest-gpu.log) tests)"
  fi
fi
exit $rc
