//! The store settings' unit tests: URLs, their TLS, passwords and files.

use super::*;

fn raw(url: &str) -> RawConfig {
    RawConfig {
        store: Some(url.into()),
        ..RawConfig::default()
    }
}

fn shared_of(r: &RawConfig) -> SharedStoreConfig {
    match store(r).unwrap() {
        StoreConfig::Shared(s) => s,
        other => panic!("not shared: {other:?}"),
    }
}

fn field_of(r: &RawConfig) -> String {
    match store(r) {
        Err(ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn client_certificates_in_a_postgres_url_and_bad_etcd_endpoints() {
    let dir = tempfile::tempdir().unwrap();
    let f = |n: &str| {
        let p = dir.path().join(n);
        std::fs::write(&p, "x").unwrap();
        p
    };
    let (ca, cert, key) = (f("ca.pem"), f("c.pem"), f("k.pem"));
    let s = shared_of(&raw(&format!(
        "postgres://fg@db/fg?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        ca.display(),
        cert.display(),
        key.display()
    )));
    let tls = s.tls.expect("TLS");
    assert_eq!(tls.ca, Some(ca));
    assert_eq!(tls.client_cert, Some(cert));
    assert_eq!(tls.client_key, Some(key));
    for bad in [
        "etcd://127.0.0.1:2379,",
        "etcd://127.0.0.1",
        "etcd://127.0.0.1:2379/x,127.0.0.1:2380",
    ] {
        assert_eq!(field_of(&raw(bad)), "store", "{bad}");
    }
    assert!(matches!(
        store(&raw("etcd://127.0.0.1:2379,127.0.0.1:2380")),
        Ok(StoreConfig::Shared(_))
    ));
}

#[test]
fn the_page_cache_is_bounded() {
    let with = |mib: u64| RawConfig {
        store_cache_mib: Some(mib),
        ..raw("fences.redb")
    };
    for ok in [1, 64, 1 << 20] {
        assert!(store(&with(ok)).is_ok(), "{ok}");
    }
    for bad in [0, (1 << 20) + 1] {
        assert_eq!(field_of(&with(bad)), "store_cache_mib", "{bad}");
    }
}

#[test]
fn embedded_paths_and_printed_urls() {
    let dir = tempfile::tempdir().unwrap();
    // A bare file name is in the working directory, which exists.
    assert!(matches!(
        store(&raw("fences.redb")),
        Ok(StoreConfig::Embedded { .. })
    ));
    assert_eq!(
        field_of(&raw(&dir
            .path()
            .join("missing/f.redb")
            .display()
            .to_string())),
        "store"
    );
    assert_eq!(field_of(&raw(&dir.path().display().to_string())), "store");
    // A key=value connection string, not a file name with a space or
    // an `=` alone.
    assert_eq!(field_of(&raw("host=db user=fg")), "store");
    let spaced = dir.path().join("a b.redb").display().to_string();
    assert!(matches!(
        store(&raw(&spaced)),
        Ok(StoreConfig::Embedded { .. })
    ));
    let eq = dir.path().join("a=b.redb").display().to_string();
    assert!(matches!(store(&raw(&eq)), Ok(StoreConfig::Embedded { .. })));
    let s = shared_of(&raw("redis://fg:s3cret@127.0.0.1:6379/0"));
    assert_eq!(s.redacted_url(), "redis://fg:****@127.0.0.1:6379/0");
    let shown = format!("{s:?}");
    assert!(shown.contains("fg:****@127.0.0.1"), "{shown}");
    assert!(!shown.contains("s3cret"), "{shown}");
}

#[test]
fn a_state_file_needs_an_existing_directory() {
    let dir = tempfile::tempdir().unwrap();
    let with = |p: PathBuf| RawConfig {
        store_state_file: Some(p),
        ..raw("redis://127.0.0.1:6379")
    };
    let ok = dir.path().join("marker");
    assert_eq!(shared_of(&with(ok.clone())).state_file, Some(ok));
    // A bare name is in the working directory.
    let bare = PathBuf::from("marker");
    assert_eq!(shared_of(&with(bare.clone())).state_file, Some(bare));
    for bad in [dir.path().join("missing/marker"), dir.path().to_path_buf()] {
        assert_eq!(field_of(&with(bad)), "store_state_file");
    }
}

#[test]
fn passwords_are_redacted() {
    assert_eq!(
        redact_url("rediss://fg:s3cret@redis:6380/0"),
        "rediss://fg:****@redis:6380/0"
    );
    assert_eq!(
        redact_url("postgres://fg:p%40ss@db/x?sslmode=verify-full&password=x"),
        "postgres://fg:****@db/x?sslmode=verify-full&password=****"
    );
    assert_eq!(
        redact_url("etcds://fg:pw@a:2379,b:2379"),
        "etcds://fg:****@a:2379,b:2379"
    );
    assert_eq!(redact_url("redis://127.0.0.1/0"), "redis://127.0.0.1/0");
    assert_eq!(
        redact_url("postgres://fg:Zk3/9q?#+L@db/f?sslmode=require"),
        "postgres://fg:****@db/f?sslmode=require"
    );
    assert_eq!(
        url_password("etcds://fg:a/b+c@h:1").unwrap().expose(),
        "a/b+c"
    );
    assert_eq!(redact_url("redis://user@h/0"), "redis://user@h/0");
    assert_eq!(format!("{:?}", Secret::new("x")), "****");
    assert_eq!(
        url_password("postgres://fg:p%40ss@db/x").unwrap().expose(),
        "p@ss"
    );
    assert!(url_password("redis://h:6379").is_none());
}

#[test]
fn tls_from_the_url() {
    let s = shared_of(&raw("rediss://fg@redis:6380/0"));
    assert_eq!(s.tls.unwrap().verify, TlsVerify::Full);
    assert!(shared_of(&raw("redis://redis:6379/0")).tls.is_none());
    let s = shared_of(&raw("etcds://fg@a:2379,b:2379"));
    assert_eq!(
        s.engine,
        SharedEngine::Etcd {
            endpoints: vec!["https://a:2379".into(), "https://b:2379".into()],
            user: Some("fg".into())
        }
    );
    assert!(s.tls.is_some());
    let pg = |q: &str| shared_of(&raw(&format!("postgres://fg@db:5432/x{q}")));
    assert!(pg("").tls.is_none());
    assert_eq!(pg("?sslmode=require").tls.unwrap().verify, TlsVerify::None);
    assert_eq!(
        pg("?sslmode=verify-ca&sslrootcert=/etc/hostname")
            .tls
            .unwrap()
            .verify,
        TlsVerify::Chain
    );
    // Other parameters reach the driver as written.
    match pg("?options=-c%20search_path%3Dfg&sslmode=require").engine {
        SharedEngine::Postgres { conn, .. } => assert_eq!(
            conn,
            "postgres://fg@db:5432/x?options=-c%20search_path%3Dfg&sslmode=require"
        ),
        other => panic!("{other:?}"),
    }
    let full = pg("?sslmode=verify-full&sslrootcert=/etc/hostname&application_name=fg");
    let tls = full.tls.unwrap();
    assert_eq!(tls.verify, TlsVerify::Full);
    assert_eq!(tls.ca, Some(PathBuf::from("/etc/hostname")));
    match full.engine {
        SharedEngine::Postgres { conn, prefer } => {
            assert_eq!(
                conn,
                "postgres://fg@db:5432/x?application_name=fg&sslmode=require"
            );
            assert!(!prefer);
        }
        other => panic!("{other:?}"),
    }
    // libpq: `require` with a CA checks the chain.
    assert_eq!(
        pg("?sslmode=require&sslrootcert=/etc/hostname")
            .tls
            .unwrap()
            .verify,
        TlsVerify::Chain
    );
}

#[test]
fn bad_store_settings_name_their_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pw");
    std::fs::write(&file, "\n").unwrap();
    let with = |url: &str, f: fn(&mut RawConfig)| {
        let mut r = raw(url);
        f(&mut r);
        r
    };
    let cases: Vec<(RawConfig, &str)> = vec![
        (raw("postgres://db/x?sslmode=verify"), "store"),
        (raw("postgres://db/x?sslmode=verify-ca"), "store"),
        (raw("host=db user=fg dbname=f"), "store"),
        (raw("postgres://db/x?bogus=1"), "store"),
        (raw("rediss://h:6380/#insecure"), "store"),
        (raw("etcd://@a:1"), "store"),
        (raw("etcds://a:1,b"), "store"),
        (
            with("redis://h:6379", |r| {
                r.store_ca = Some("/etc/hostname".into())
            }),
            "store_ca",
        ),
        (
            with("rediss://h:6379", |r| {
                r.store_ca = Some("/no/such/ca.pem".into())
            }),
            "store_ca",
        ),
        (
            with("rediss://h:6379", |r| {
                r.store_client_cert = Some("/etc/hostname".into())
            }),
            "store_client_key",
        ),
        (
            with(
                "postgres://db/x?sslmode=verify-full&sslrootcert=/etc/hostname",
                |r| r.store_ca = Some("/etc/hostname".into()),
            ),
            "store_ca",
        ),
        (
            with("etcds://a:2379", |r| {
                r.store_password = Some(Secret::new("x"))
            }),
            "store",
        ),
        (
            with("./f.redb", |r| r.store_ca = Some("/etc/hostname".into())),
            "store_ca",
        ),
    ];
    for (r, field) in cases {
        assert_eq!(field_of(&r), field, "{:?}", r.store);
    }
    let mut r = raw("rediss://fg@h:6380/0");
    r.store_password_file = Some(file.clone());
    assert_eq!(field_of(&r), "store_password_file");
    std::fs::write(&file, "s3cret\nignored\n").unwrap();
    r.store_password = Some(Secret::new("from-env"));
    assert_eq!(shared_of(&r).password.unwrap().expose(), "s3cret");
    r.store_password_file = Some(dir.path().join("missing"));
    assert_eq!(field_of(&r), "store_password_file");
}

#[test]
fn sentinel_urls_name_their_sentinels_master_and_database() {
    let sentinel = |url: &str| match shared_of(&raw(url)).engine {
        SharedEngine::Redis { sentinel: Some(s) } => s,
        other => panic!("{url}: {other:?}"),
    };
    let s = sentinel("redis+sentinel://fg:p%40ss@10.0.0.1:26380,10.0.0.2,[::1]:5,[::2]/fg-main/3");
    assert_eq!(
        s.addrs,
        vec![
            ("10.0.0.1".to_string(), 26380),
            ("10.0.0.2".to_string(), 26379),
            ("::1".to_string(), 5),
            ("::2".to_string(), 26379)
        ]
    );
    assert_eq!((s.master.as_str(), s.db), ("fg-main", 3));
    assert_eq!(s.user.as_deref(), Some("fg"));
    assert_eq!(s.password.as_ref().map(Secret::expose), Some("p@ss"));
    assert!(!s.sentinel_auth);
    let s = sentinel("redis+sentinel://h:1/m?sentinel_auth=same");
    assert!(s.sentinel_auth && s.user.is_none() && s.password.is_none());
    assert_eq!(s.db, 0);
    // The password never shows.
    assert!(!format!("{s:?}").contains("p@ss"));
    for bad in [
        "redis+sentinel://h:1",
        "redis+sentinel://h:1/",
        "redis+sentinel://h:x/m",
        "redis+sentinel://h:0/m",
        "redis+sentinel://,h:1/m",
        "redis+sentinel://h:1/m/-1",
        "redis+sentinel://h:1/m/a",
        "redis+sentinel://h:1/m?sentinel_auth=maybe",
        "redis+sentinel://h:1/m?password=x",
        "rediss+sentinel://h:1/m",
    ] {
        assert_eq!(field_of(&raw(bad)), "store", "{bad}");
    }
}

#[test]
fn cluster_urls_name_their_seed_nodes() {
    let cluster = |url: &str| match shared_of(&raw(url)) {
        SharedStoreConfig {
            engine: SharedEngine::RedisCluster(c),
            tls,
            ..
        } => (c, tls.is_some()),
        other => panic!("{url}: {other:?}"),
    };
    let (c, tls) = cluster("redis+cluster://fg:p%40ss@10.0.0.1:7001,10.0.0.2,[::1]:7003/");
    assert_eq!(
        c.seeds,
        vec![
            ("10.0.0.1".to_string(), 7001),
            ("10.0.0.2".to_string(), 6379),
            ("::1".to_string(), 7003)
        ]
    );
    assert_eq!(c.user.as_deref(), Some("fg"));
    assert_eq!(c.password.as_ref().map(Secret::expose), Some("p@ss"));
    assert!(!tls);
    assert!(!format!("{c:?}").contains("p@ss"));
    let (c, tls) = cluster("rediss+cluster://h:1");
    assert!(tls && c.user.is_none() && c.password.is_none());
    assert_eq!(
        shared_of(&RawConfig {
            store_replicas_to_wait: Some(1),
            ..raw("redis+cluster://h:1")
        })
        .replicas_to_wait,
        Some(1)
    );
    for bad in [
        "redis+cluster://",
        "redis+cluster://h:x",
        "redis+cluster://h:0",
        "redis+cluster://,h:1",
        "redis+cluster://h:1/0",
        "redis+cluster://h:1/?x=1",
        "redis+cluster://h:1?x=1",
    ] {
        assert_eq!(field_of(&raw(bad)), "store", "{bad}");
    }
}

#[test]
fn replicas_to_wait_is_for_redis_and_bounded() {
    let with = |url: &str, n: u32| RawConfig {
        store_replicas_to_wait: Some(n),
        ..raw(url)
    };
    assert_eq!(
        shared_of(&with("redis://h:1/0", 2)).replicas_to_wait,
        Some(2)
    );
    assert_eq!(
        shared_of(&with("redis+sentinel://h:1/m", 0)).replicas_to_wait,
        Some(0)
    );
    assert_eq!(shared_of(&raw("redis://h:1/0")).replicas_to_wait, None);
    for bad in [
        with("redis://h:1/0", 101),
        with("postgres://u@h/db", 1),
        with("etcd://h:1", 1),
        with("fences.redb", 1),
    ] {
        assert_eq!(field_of(&bad), "store_replicas_to_wait");
    }
}
