#!/usr/bin/env bash
# Coverage-guided fuzzing of the parsers that face the network or the disk
# (fuzz/fuzz_targets/, docs/reliability.md "Fuzzing"), with libFuzzer
# through cargo-fuzz on the stable toolchain (`-s none`: no sanitizer; Rust
# is memory-safe here, `#![forbid(unsafe_code)]`, and a panic or a failed
# property is what is looked for).
#
#   scripts/fuzz.sh TARGET SECONDS   run one target
#   scripts/fuzz.sh --all SECONDS    run every target, one after the other
#   scripts/fuzz.sh --merge TARGET   minimise what runs found into the
#                                    committed corpus (fuzz/corpus/TARGET)
#   scripts/fuzz.sh --list           the targets
#   scripts/fuzz.sh --totals         CPU time and executions per target,
#                                    summed over fuzz/runs.tsv, and the
#                                    most coverage and corpus any run had
#
# A run reads the committed corpus and writes what it finds to
# fuzz/work/TARGET (not committed); a crash or a failed property leaves its
# input in fuzz/artifacts/TARGET/ and fails the run. Each run appends a line
# to fuzz/runs.tsv (its first line names the columns); docs/reliability.md's
# totals are summed from it (scripts/fuzz.sh --totals).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.2
if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  echo "scripts/fuzz.sh: installing cargo-fuzz $CARGO_FUZZ_VERSION" >&2
  cargo install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

targets() { sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^fencegate-fuzz$'; }

build() { (cd fuzz && cargo fuzz build -s none --release "$@" >&2); }

bin_of() { echo "fuzz/target/$(rustc -vV | sed -n 's/^host: //p')/release/$1"; }

run() {
  local target=$1 secs=$2
  targets | grep -qx "$target" || { echo "scripts/fuzz.sh: no target $target (scripts/fuzz.sh --list)" >&2; exit 2; }
  mkdir -p "fuzz/work/$target" "fuzz/artifacts/$target" "fuzz/corpus/$target"
  local log
  log=$(mktemp)
  local rc=0 bin
  bin=$(bin_of "$target")
  # -timeout: an input that takes 10 s is a hang, and a finding. The CPU
  # time is measured (bash's `time`): on a busy machine it is less than the
  # wall time asked for, and the totals count CPU time.
  set +e
  { TIMEFORMAT='%3U %3S'; time "$bin" "fuzz/work/$target" "fuzz/corpus/$target" \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="fuzz/artifacts/$target/" >"$log" 2>&1; } 2>"$log.time"
  rc=$?
  set -e
  local cpu
  cpu=$(awk '{printf "%d", $1 + $2}' "$log.time")
  local done execs corpus
  done=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  corpus=$(($(ls "fuzz/work/$target" | wc -l) + $(ls "fuzz/corpus/$target" | wc -l)))
  local cov ft outcome
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$done")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$done")
  outcome=ok
  if ((rc != 0)); then
    outcome="FAILED(rc=$rc)"
    grep -E -m5 "panicked|SUMMARY|ERROR|Test unit written" "$log" >&2 || tail -20 "$log" >&2
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$target" "$secs" "$cpu" \
    "${execs:-0}" "${cov:-?}" "${ft:-?}" "$corpus" "$outcome" >>fuzz/runs.tsv
  echo "fuzz $target: ${secs}s (${cpu}s CPU), ${execs:-0} executions, cov ${cov:-?}, ft ${ft:-?}, corpus $corpus: $outcome" >&2
  rm -f "$log" "$log.time"
  return "$rc"
}

case "${1:-}" in
  --list) targets ;;
  --totals)
    awk -F'\t' '!/^#/ { cpu[$2] += $4; ex[$2] += $5; if ($6 > cov[$2]) cov[$2] = $6; if ($7 > ft[$2]) ft[$2] = $7; if ($8 > corp[$2]) corp[$2] = $8; if ($9 != "ok") bad[$2]++ }
      END { printf "%-14s %9s %14s %6s %7s %7s %s\n", "target", "CPU min", "executions", "cov", "ft", "corpus", "failed runs";
            for (t in cpu) printf "%-14s %9.1f %14d %6s %7s %7s %d\n", t, cpu[t] / 60, ex[t], cov[t], ft[t], corp[t], bad[t] }' fuzz/runs.tsv
    ;;
  --all)
    secs=${2:?usage: scripts/fuzz.sh --all SECONDS}
    build
    failed=0
    for t in $(targets); do run "$t" "$secs" || failed=1; done
    exit "$failed"
    ;;
  --merge)
    target=${2:?usage: scripts/fuzz.sh --merge TARGET}
    build "$target"
    mkdir -p "fuzz/work/$target" "fuzz/corpus/$target"
    merged=$(mktemp -d)
    "$(bin_of "$target")" -merge=1 "$merged" "fuzz/corpus/$target" "fuzz/work/$target" >/dev/null 2>&1
    rm -rf "fuzz/corpus/$target" && mv "$merged" "fuzz/corpus/$target" && chmod 755 "fuzz/corpus/$target"
    echo "fuzz $target: corpus minimised to $(ls "fuzz/corpus/$target" | wc -l) inputs" >&2
    ;;
  ""|-h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  *)
    target=$1
    secs=${2:?usage: scripts/fuzz.sh TARGET SECONDS}
    build "$target"
    run "$target" "$secs"
    ;;
esac
