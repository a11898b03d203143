//! Unit tests of `cluster.rs`: the group mappings, sessions, the
//! connection drop rule.

use super::*;

#[test]
fn each_group_is_one_slot_in_its_own_range() {
    let mut seen = std::collections::HashSet::new();
    for g in 0..GROUPS {
        let tag = group_tag(g);
        let slot = usize::from(slot_of(tag.trim_matches(['{', '}']).as_bytes()));
        assert_eq!(slot * GROUPS / SLOTS, g, "{tag}");
        assert!(seen.insert(slot), "{tag}: a slot twice");
        // Every key name of the group hashes to that slot (the tag is
        // the name's first braces, whatever the fence key holds).
        let k = Keyspace::group(tag.clone());
        for name in [k.fence("/b/{x}"), k.marker(), k.sync(), k.lease_order("}{")] {
            let hashed = &name[name.find('{').unwrap() + 1..];
            let hashed = &hashed[..hashed.find('}').unwrap()];
            assert_eq!(usize::from(slot_of(hashed.as_bytes())), slot, "{name}");
        }
    }
}

#[test]
fn an_answer_without_the_marker_seen_starts_a_new_session() {
    let seeds = crate::config::RedisCluster {
        seeds: vec![("127.0.0.1".into(), 1)],
        user: None,
        password: None,
    };
    let cluster = Cluster::new(ClusterOptions {
        cluster: &seeds,
        password: None,
        pem: None,
        timeout: Duration::from_secs(1),
        replicas_to_wait: None,
    })
    .unwrap();
    let g = ClusterGroup::new(cluster, 3);
    let m = |e: &str, s: &str| (Some(e.to_string()), Some(s.to_string()));
    let session = || Calls::session(&g);
    let steps = [
        // (the marker an answer carried, whether a new session starts)
        (m("e1", "5"), false), // the first seen
        (m("e1", "5"), false),
        (m("e1", "6"), false), // the heartbeat's bump
        ((None, None), true),  // gone: wiped, or a node that lost it
        (m("e1", "6"), true),  // back: must be checked all the same
        (m("e1", "4"), true),  // lower: a restored backup
        (m("e2", "1"), true),  // another epoch: a confirmed reset
        (m("e2", "9"), false),
    ];
    for (i, ((epoch, seq), new)) in steps.into_iter().enumerate() {
        let before = session();
        g.saw_marker(epoch, seq);
        assert_eq!(session() != before, new, "step {i}");
    }
}

#[test]
fn a_connection_is_dropped_when_its_calls_fail_for_two_timeouts() {
    let t = 1000;
    // (failing for, dropped)
    for (failing, dropped) in [(0, false), (1999, false), (2000, true), (10_000, true)] {
        assert_eq!(stale(failing, t), dropped, "failing for {failing} ms");
    }
}

#[test]
fn the_mappings_never_change() {
    // Where a key's fence is: a change would lose every fence
    // (docs/stores.md). These values are pinned on purpose.
    assert_eq!(group_tag(0), "{fg0.59}");
    assert_eq!(group_tag(17), "{fg17.111}");
    assert_eq!(group_tag(63), "{fg63.19}");
    // CRC16/XMODEM's check value: the slot Redis Cluster gives.
    assert_eq!(slot_of(b"123456789"), 0x31C3);
    let keys = ["a", "default:/a", "default:/bucket/x", ""];
    let groups: Vec<usize> = keys.iter().map(|k| group_of(k)).collect();
    assert_eq!(groups, vec![60, 27, 50, 0]);
}
