//! `GET /v1/status`: the fence's health at a glance, for the admin page
//! (and anyone with the admin token): the store and its state, recovery,
//! writes in flight, connections, workers, reloads, and every counter the
//! page turns into admitted and refused per second.

use prometheus::core::Collector;
use prometheus::proto::MetricType;
use serde_json::{json, Map, Value};

use crate::fence::Fence;
use crate::metrics::Metrics;

/// The sum of `collector`'s samples per value of `label` (counters and
/// gauges alike).
fn by_label(collector: &dyn Collector, label: &str) -> Map<String, Value> {
    let mut sums = std::collections::BTreeMap::<String, f64>::new();
    for family in collector.collect() {
        let counter = family.get_field_type() == MetricType::COUNTER;
        for m in family.get_metric() {
            let value = if counter {
                m.get_counter().get_value()
            } else {
                m.get_gauge().get_value()
            };
            let name = m
                .get_label()
                .iter()
                .find(|l| l.name() == label)
                .map(|l| l.value().to_string())
                .unwrap_or_default();
            *sums.entry(name).or_default() += value;
        }
    }
    sums.into_iter().map(|(k, v)| (k, json!(v))).collect()
}

/// Store calls since start, all operations together: how many and the
/// seconds they took (the page shows the mean between two polls).
fn store_calls(metrics: &Metrics) -> Value {
    let (mut count, mut seconds) = (0u64, 0.0);
    for family in metrics.store_latency.collect() {
        for m in family.get_metric() {
            count += m.get_histogram().get_sample_count();
            seconds += m.get_histogram().get_sample_sum();
        }
    }
    json!({ "count": count, "seconds": seconds })
}

/// The answer of `GET /v1/status`; `store` is the outcome of a ping, the
/// time it took, and the shards of a store spread over several.
pub(super) fn status(
    fence: &Fence,
    metrics: &Metrics,
    (store, ping, shards): (
        Result<(), String>,
        std::time::Duration,
        Option<Vec<crate::store::Shard>>,
    ),
    draining: bool,
    refusals_newest: u64,
) -> Value {
    let s = fence.store();
    let in_flight: f64 = by_label(&metrics.in_flight, "route")
        .values()
        .filter_map(Value::as_f64)
        .sum();
    json!({
        "store": {
            "engine": s.kind(),
            "up": store.is_ok(),
            "error": store.err(),
            "amnesia": s.amnesia(),
            "way_out": s.amnesia().map(|_| {
                "writes are refused until an operator confirms the store as it is: \
                 POST /v1/store/confirm-reset (admin token), or restart with \
                 --accept-store-reset (docs/stores.md)"
            }),
            "in_flight_marks": s.in_flight_marks(),
            "ping_ms": ping.as_secs_f64() * 1000.0,
            "calls": store_calls(metrics),
            // Redis: the replicas the last call waited for and how many
            // confirmed it.
            "replicas": s.replicas(),
            // Redis Cluster: each shard (its primary) and its groups.
            "shards": shards,
        },
        "recovery": {
            "seconds_left": fence.recovering_for().map(|d| d.as_secs_f64()),
            "held_keys": fence.held_keys(),
        },
        "draining": draining,
        "workers": metrics.workers.get(),
        "in_flight_writes": in_flight,
        "connections": by_label(&metrics.connections, "listener"),
        "reloads": by_label(&metrics.reloads, "result"),
        "writes": by_label(&metrics.writes, "decision"),
        "requests": by_label(&metrics.requests, "status"),
        "refusals_newest": refusals_newest,
    })
}
