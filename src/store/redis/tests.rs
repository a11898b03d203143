//! The Redis engine's unit tests: reading INFO and Sentinel's answers.

use super::conn::*;

#[test]
fn replication_reads_the_role_and_the_replicas_online() {
    let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
                slave0:ip=127.0.0.1,port=1,state=online,offset=5,lag=0\r\n\
                slave1:ip=127.0.0.1,port=2,state=wait_bgsave,offset=0,lag=0\r\n\
                master_failover_state:no-failover\r\n";
    assert_eq!(replication(info), ("master".to_string(), 1));
    assert_eq!(
        replication("role:slave\r\nmaster_link_status:up\r\n"),
        ("slave".to_string(), 0)
    );
    assert_eq!(replication("").0, "server of unknown role");
}

#[test]
fn sentinel_counts_the_replicas_it_sees_up() {
    let entry = |flags: &str| {
        vec![
            "name".to_string(),
            "127.0.0.1:1".into(),
            "flags".into(),
            flags.into(),
        ]
    };
    let replicas = vec![
        entry("slave"),
        entry("s_down,slave"),
        entry("slave,disconnected"),
        entry("o_down,slave"),
        entry("slave,promoted"),
    ];
    assert_eq!(sentinel_up(&replicas), 2);
    assert_eq!(sentinel_up(&[]), 0);
    assert_eq!(sentinel_up(&[vec!["flags".into()]]), 0);
}
