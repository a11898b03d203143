#!/usr/bin/env bash
# The network-fault scenarios at length (issue 43; docs/reliability.md,
# "Network faults"): every history run of tests/partition.rs for
# HISTORY_SECS seconds each (60 by default), one at a time so that their
# figures are not skewed by each other, then the clock tests. The short
# form of the same runs is part of scripts/test.
#
#   sudo scripts/network_faults.sh            a minute each
#   sudo HISTORY_SECS=300 scripts/network_faults.sh
#
# Needs root (network namespaces), iproute2, nftables, faketime and the
# store servers: scripts/test installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
export HISTORY_SECS=${HISTORY_SECS:-60}
cargo test --release --locked --test partition -- --nocapture --test-threads 1 history 2>&1 |
  grep -E '^history |^test |test result|panicked'
cargo test --release --locked --test clocks -- --nocapture --test-threads 1 2>&1 |
  grep -E 'waited|^test |test result|panicked'
