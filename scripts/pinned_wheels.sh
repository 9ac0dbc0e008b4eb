# Sourced: pinned_wheels DIR NAME... downloads into DIR the wheels requirements.txt pins for each
# NAME, built for the GPU machine's interpreter (CPython 3.12, x86_64 Linux), without their
# dependencies: the caller names every one the machine lacks. Run from the repository root.
pinned_wheels() {
  local dir=$1 w pin
  shift
  local pins=()
  for w in "$@"; do
    pin=$(grep -i -E "^${w//[-_]/[-_]}==" requirements.txt) ||
      { echo "no pin for $w in requirements.txt" >&2; return 1; }
    pins+=("$pin")
  done
  echo "wheels: ${pins[*]}"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${pins[@]}"
}
