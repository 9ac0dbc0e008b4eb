#!/usr/bin/env bash
# A run longer than one device call (10 minutes): `start` launches a command in a process session
# of its own (setsid), which the machine keeps running between back-to-back calls while it is
# held (30 s idle); `wait` waits for the named runs, up to SECONDS, and copies what each has
# written so far into $OUT/NAME/, finished or not, so a later call can wait again.
# Each run lives in /tmp/hetero-detached/NAME: its command sees OUT=<that>/out and TMPDIR=<that>/tmp
# (so two runs of bench/gpu/e2e_device.sh do not share a work dir); `rc` appears when it ends.
#
# usage: bench/gpu/detached.sh start NAME CMD...
#        bench/gpu/detached.sh wait SECONDS NAME...
# e.g. (device tool) run(command="bench/gpu/detached.sh start exact bench/gpu/e2e_device.sh ...;
#        bench/gpu/detached.sh wait 560 exact")  then  run(command="bench/gpu/detached.sh wait 560 exact")
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
BASE=/tmp/hetero-detached

case ${1:-} in
  start)
    (($# >= 3)) || { echo "usage: $0 start NAME CMD..." >&2; exit 2; }
    name=$2
    shift 2
    dir=$BASE/$name
    [[ -e $dir ]] && { echo "detached: $name already started ($dir)" >&2; exit 1; }
    mkdir -p "$dir/out" "$dir/tmp"
    OUT=$dir/out TMPDIR=$dir/tmp setsid bash -c '"$@" >"$0/log" 2>&1; echo $? >"$0/rc"' \
      "$dir" "$@" </dev/null >/dev/null 2>&1 &
    echo "detached: $name started, pid $!, $dir"
    ;;
  wait)
    (($# >= 3)) || { echo "usage: $0 wait SECONDS NAME..." >&2; exit 2; }
    deadline=$((SECONDS + $2))
    shift 2
    while ((SECONDS < deadline)); do
      done_all=1
      for name; do [[ -f $BASE/$name/rc ]] || done_all=0; done
      ((done_all)) && break
      sleep 5
    done
    status=0
    for name; do
      dir=$BASE/$name
      [[ -d $dir ]] || { echo "detached: $name was never started here" >&2; status=1; continue; }
      if [[ -f $dir/rc ]]; then
        echo "detached: $name ended, rc $(cat "$dir/rc")"
        [[ $(cat "$dir/rc") == 0 ]] || status=1
      else
        echo "detached: $name still running"
        status=3
      fi
      echo "--- $name: tail of its log"
      tail -25 "$dir/log"
      if [[ -n ${OUT:-} ]]; then
        mkdir -p "$OUT/$name"
        cp "$dir"/out/* "$OUT/$name/" 2>/dev/null
      fi
    done
    exit "$status"
    ;;
  *)
    echo "usage: $0 start NAME CMD... | wait SECONDS NAME..." >&2
    exit 2
    ;;
esac
