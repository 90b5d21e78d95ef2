#!/usr/bin/env bash
# The flake finder: run tests N times with a busy CPU hog on every core beside them, then report every test that
# failed at least once, with how often. A test that passes alone and fails here depends on the machine's speed
# (a sleep that waits for a state, a tight wall-clock bound, a fault that acts at a time): make it wait for the
# state instead (tests/polling.py, an event, a hold gate: services/faults.py). docs/testing.md has the reports.
#
#   tests/stress.sh [-n RUNS] [-H HOGS] [-o DIR] [--] [PYTEST ARGS...]
#     -n RUNS  how many times the whole selection runs (default 3)
#     -H HOGS  busy processes beside it (default: one per core, `nproc`); 0 for none
#     -o DIR   where each run's JUnit XML, output and the report go (default: a new directory under /tmp)
#     PYTEST ARGS: the tests (files, node ids, -k, -n 2 --dist loadfile as .ci/run ...); default: the suite
#
# Exit status: 0 when every run passed, 1 when a test failed at least once, 2 on bad usage.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=3 hogs=$(nproc) out=""
while getopts "n:H:o:h" opt; do
  case $opt in
    n) runs=$OPTARG ;;
    H) hogs=$OPTARG ;;
    o) out=$OPTARG ;;
    h) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "usage: tests/stress.sh [-n RUNS] [-H HOGS] [-o DIR] [--] [PYTEST ARGS...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $runs =~ ^[1-9][0-9]*$ && $hogs =~ ^[0-9]+$ ]] || { echo "stress.sh: -n needs a count >= 1, -H a count >= 0" >&2; exit 2; }
out=${out:-$(mktemp -d /tmp/eyrie-stress.XXXXXX)}
mkdir -p "$out"

hog_pids=()
stop_hogs() { for pid in "${hog_pids[@]}"; do kill "$pid" 2>/dev/null; done; wait "${hog_pids[@]}" 2>/dev/null; }
trap stop_hogs EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 "$hogs"); do
  python -c "while True: pass" &
  hog_pids+=($!)
done

echo "stress: $runs run(s) of: ${*:-the suite}; $hogs CPU hog(s) beside it; results in $out"
for i in $(seq 1 "$runs"); do
  start=$SECONDS
  python -m pytest -q -p no:cacheprovider --junitxml="$out/run-$i.xml" "$@" >"$out/run-$i.log" 2>&1
  rc=$?
  echo "$rc" >"$out/run-$i.rc"
  echo "run $i: exit $rc, $((SECONDS - start)) s: $(tail -n 1 "$out/run-$i.log")"
done
stop_hogs
trap - EXIT

python - "$out" "$runs" <<'EOF'
"""Every test that failed or errored in at least one run's JUnit XML, with its count, most often first."""
import collections
import pathlib
import sys
import xml.etree.ElementTree as ET

out, runs = pathlib.Path(sys.argv[1]), int(sys.argv[2])
failed, first = collections.Counter(), {}
for xml in sorted(out.glob("run-*.xml")):
    for case in ET.parse(xml).iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            name = f"{case.get('classname')}::{case.get('name')}"
            failed[name] += 1
            first.setdefault(name, (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else "")
for rc in sorted(out.glob("run-*.rc")):  # 0: passed, 1: tests failed (named above); else no result at all
    if int(rc.read_text()) not in (0, 1):
        failed[f"(pytest exited {rc.read_text().strip()}: see {rc.with_suffix('.log')})"] += 1
        first.setdefault(f"(pytest exited {rc.read_text().strip()}: see {rc.with_suffix('.log')})", "")
lines = [f"{n}/{runs}  {name}\n      {first[name]}" for name, n in failed.most_common()]
report = "\n".join(lines) if lines else f"no test failed in {runs} run(s)"
(out / "report.txt").write_text(report + "\n")
print("stress report (failed runs / runs, test, first message):")
print(report)
sys.exit(1 if failed else 0)
EOF
