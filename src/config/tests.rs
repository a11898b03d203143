//! The configuration's unit tests: each rejected value, and the defaults.

use std::path::PathBuf;
use std::time::Duration;

use super::parse::*;
use super::raw::*;
use super::route::*;
use super::store::*;
use super::validated::*;
use crate::key::KeyTemplate;
use crate::tls::TlsConfig;

fn base() -> RawConfig {
    RawConfig::from_toml(
        r#"
        store = "/tmp/fencegate-config-test.redb"
        [[routes]]
        upstream = "http://127.0.0.1:9000"
        "#,
    )
    .unwrap()
}

fn err(raw: RawConfig) -> String {
    Config::try_from(raw).unwrap_err().to_string()
}

/// The base config with `extra` lines added to its route, and `top`
/// lines before it.
fn with(top: &str, extra: &str) -> RawConfig {
    RawConfig::from_toml(&format!(
        "store = \"/tmp/fencegate-config-test.redb\"\n{top}\n[[routes]]\nupstream = \"http://127.0.0.1:9000\"\n{extra}\n"
    ))
    .unwrap()
}

#[test]
fn the_admin_token_has_at_least_16_characters() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    let top = format!("admin_token_file = \"{}\"", file.display());
    for (token, ok) in [
        ("0123456789abcde", false),
        ("0123456789abcdef", true),
        (" 0123456789abcdef0 \n", true),
    ] {
        std::fs::write(&file, token).unwrap();
        let c = Config::try_from(with(&top, ""));
        assert_eq!(c.is_ok(), ok, "{token:?}");
        if ok {
            assert_eq!(c.unwrap().admin_token.as_deref(), Some(token.trim()));
        } else {
            assert!(err(with(&top, "")).contains("admin_token_file"));
        }
    }
}

#[test]
fn listeners_files_and_the_longest_timeout() {
    assert!(err(with(
        "listen = \"127.0.0.1:7200\"\nadmin_listen = \"127.0.0.1:7200\"",
        ""
    ))
    .contains("admin_listen"));
    // Port 0 on both: two ephemeral ports, no clash.
    assert!(Config::try_from(with(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"",
        ""
    ))
    .is_ok());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f.toml");
    std::fs::write(
        &file,
        "store = \"/tmp/x.redb\"\n[[routes]]\nupstream = \"http://127.0.0.1:1\"\nupstream_timeout = \"7s\"\n[[routes]]\npath_prefix = \"/b\"\nupstream = \"http://127.0.0.1:2\"\nupstream_timeout = \"9s\"\n",
    )
    .unwrap();
    let raw = RawConfig::from_file(&file).unwrap();
    assert_eq!(raw.store.as_deref(), Some("/tmp/x.redb"));
    let c = Config::try_from(raw).unwrap();
    assert_eq!(c.max_upstream_timeout(), Duration::from_secs(9));
    assert!(RawConfig::from_file(&dir.path().join("missing.toml")).is_err());
}

#[test]
fn an_upstream_timeout_past_the_shutdown_grace_is_warned_about() {
    let config = |text: &str| Config::try_from(RawConfig::from_toml(text).unwrap()).unwrap();
    let route = "store = \"/tmp/x.redb\"\n[[routes]]\nupstream = \"http://127.0.0.1:1\"\n";
    assert!(config(route).warnings.is_empty());
    let w = config(&format!("{route}upstream_timeout = \"120s\"")).warnings;
    assert_eq!(w.len(), 1);
    assert!(
        w[0].starts_with("routes[0].upstream_timeout (120s) is longer than shutdown_grace (30s)"),
        "{w:?}"
    );
    assert!(config(&format!(
        "shutdown_grace = \"2m\"\n{route}upstream_timeout = \"120s\""
    ))
    .warnings
    .is_empty());
    // A shorter shutdown_grace than the default upstream_timeout.
    assert_eq!(
        config(&format!("shutdown_grace = \"10s\"\n{route}"))
            .warnings
            .len(),
        1
    );
    // The flag sets every route's, as given.
    let mut raw = RawConfig::from_toml(route).unwrap();
    raw.routes[0].upstream_timeout = Some("45s".into());
    assert_eq!(Config::try_from(raw).unwrap().warnings.len(), 1);
}

/// Relative paths in a config file are the file's directory's; absolute
/// ones and shared-store URLs are left as they are.
#[test]
fn relative_paths_in_a_file_are_relative_to_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("conf");
    std::fs::create_dir(&conf).unwrap();
    let read = |text: &str| {
        std::fs::write(conf.join("f.toml"), text).unwrap();
        RawConfig::from_file(&conf.join("f.toml")).unwrap()
    };
    let raw = read(
        "store = \"fences.redb\"\nlease_token_file = \"tokens\"\nadmin_token_file = \"/etc/admin\"\n\
         [tls]\ncert = \"tls/chain.pem\"\nkey = \"./key.pem\"\n\
         [[routes]]\nupstream = \"https://x\"\nupstream_ca = \"ca.pem\"\n",
    );
    assert_eq!(
        raw.store,
        Some(conf.join("fences.redb").display().to_string())
    );
    assert_eq!(raw.lease_token_file, Some(conf.join("tokens")));
    assert_eq!(raw.admin_token_file, Some(PathBuf::from("/etc/admin")));
    let tls = raw.tls.unwrap();
    assert_eq!(tls.cert, Some(conf.join("tls/chain.pem")));
    assert_eq!(tls.key, Some(conf.join("./key.pem")));
    assert_eq!(raw.routes[0].upstream_ca, Some(conf.join("ca.pem")));
    assert_eq!(
        read("store = \"redb://f.redb\"").store,
        Some(format!("redb://{}", conf.join("f.redb").display()))
    );
    for url in [
        "redis://127.0.0.1:6379/0",
        "/var/lib/f.redb",
        "redb:///var/f.redb",
    ] {
        assert_eq!(
            read(&format!("store = \"{url}\"")).store.as_deref(),
            Some(url)
        );
    }
    // In the working directory itself: nothing to join.
    let here = RawConfig::from_toml("store = \"f.redb\"").unwrap();
    assert_eq!(here.store.as_deref(), Some("f.redb"));
    // A store the old rule found (from the working directory) and the
    // new one does not: refused, not replaced by a new empty store.
    // The old store sits under the working directory and is named
    // without `..`, so the name cannot also lead somewhere from the
    // config file's directory (a `../` chain climbing to the root would,
    // whenever both directories are equally deep).
    let cwd_dir = tempfile::tempdir_in(std::env::current_dir().unwrap()).unwrap();
    let name = cwd_dir.path().file_name().unwrap().to_str().unwrap();
    let from_cwd = format!("{name}/old.redb");
    std::fs::write(&from_cwd, b"x").unwrap();
    assert!(!conf.join(&from_cwd).exists());
    std::fs::write(conf.join("f.toml"), format!("store = \"{from_cwd}\"")).unwrap();
    let e = RawConfig::from_file(&conf.join("f.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("invalid `store`") && e.contains("move it beside the config file"),
        "{e}"
    );
}

/// Store TLS files given in the URL are printed there only; given as
/// settings, as settings: the printed config reads back the same.
#[test]
fn store_tls_files_print_once() {
    let dir = tempfile::tempdir().unwrap();
    let f = |n: &str| {
        let p = dir.path().join(n);
        std::fs::write(&p, "x").unwrap();
        p.display().to_string()
    };
    let (ca, cert, key) = (f("ca.pem"), f("c.pem"), f("k.pem"));
    let in_url = format!(
        "store = \"postgres://fg@db/fg?sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}\""
    );
    let as_settings = format!(
        "store = \"postgres://fg@db/fg?sslmode=verify-full\"\nstore_ca = \"{ca}\"\nstore_client_cert = \"{cert}\"\nstore_client_key = \"{key}\""
    );
    for (top, settings) in [(in_url, false), (as_settings, true)] {
        let raw = RawConfig::from_toml(&format!(
            "{top}\n[[routes]]\nupstream = \"http://127.0.0.1:9000\"\n"
        ))
        .unwrap();
        let printed = Config::try_from(raw).unwrap().to_toml();
        for field in ["store_ca", "store_client_cert", "store_client_key"] {
            assert_eq!(printed.contains(field), settings, "{field}: {printed}");
        }
    }
}

#[test]
fn durations_print_in_the_unit_they_read_back_in() {
    assert_eq!(format_duration(Duration::from_secs(2)), "2s");
    assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
    assert_eq!(format_duration(Duration::ZERO), "0ms");
}

#[test]
fn route_names_prefixes_and_client_certificates_are_checked() {
    assert!(Config::try_from(with("", "name = \"ok-1.x_y\"")).is_ok());
    for bad in ["\"\"", "\"a b\"", "\"a/b\""] {
        assert!(
            err(with("", &format!("name = {bad}"))).contains("routes[0].name"),
            "{bad}"
        );
    }
    assert!(Config::try_from(with("", "path_prefix = \"/\"")).is_ok());
    assert!(Config::try_from(with("", "path_prefix = \"/a/\"")).is_ok());
    for bad in ["/.", "/./", "/a//b", "/a/.."] {
        assert!(
            err(with("", &format!("path_prefix = \"{bad}\""))).contains("routes[0].path_prefix"),
            "{bad}"
        );
    }
    assert!(Config::try_from(with("", "path_prefix = \"/a+b\"")).is_ok());
    assert!(err(with("", "path_prefix = \"/a+b\"\nliteral_keys = true"))
        .contains("routes[0].path_prefix"));
    let https = |line: &str| {
        RawConfig::from_toml(&format!(
            "store = \"/tmp/fencegate-config-test.redb\"\n[[routes]]\nupstream = \"https://127.0.0.1:9443\"\n{line}\n"
        ))
        .unwrap()
    };
    assert!(err(https("upstream_client_key = \"/nonexistent/k.pem\""))
        .contains("routes[0].upstream_client_cert"));
    assert!(err(https("upstream_client_cert = \"/nonexistent/c.pem\""))
        .contains("routes[0].upstream_client_key"));
}

#[test]
fn the_lease_listener_needs_an_address_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("lease-tokens");
    std::fs::write(&tokens, "abcdefghijklmnopqrstuvwx\n").unwrap();
    let top = |lease: &str| {
        format!(
            "listen = \"127.0.0.1:7100\"\nadmin_listen = \"127.0.0.1:7101\"\nlease_listen = \"{lease}\"\nlease_token_file = \"{}\"",
            tokens.display()
        )
    };
    let ok = Config::try_from(with(&top("127.0.0.1:7102"), "")).unwrap();
    assert_eq!(
        ok.lease.map(|l| l.listen.to_string()),
        Some("127.0.0.1:7102".to_string())
    );
    for clash in ["127.0.0.1:7100", "127.0.0.1:7101"] {
        assert!(
            err(with(&top(clash), "")).contains("lease_listen"),
            "{clash}"
        );
    }
}

#[test]
fn tls_listener_files_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let one = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let two = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let cert = write("cert.pem", one.cert.pem());
    let key = write("key.pem", one.signing_key.serialize_pem());
    let other_key = write("other.pem", two.signing_key.serialize_pem());
    let with = |key: &PathBuf, listen: &str| {
        let mut raw = base();
        raw.tls = Some(RawTls {
            listen: Some(listen.into()),
            cert: Some(cert.clone()),
            key: Some(key.clone()),
            client_ca: Some(cert.clone()),
            watch_interval: None,
            proxy_protocol: None,
        });
        raw
    };
    let c = Config::try_from(with(&key, "127.0.0.1:8443")).unwrap();
    let tls = c.tls.clone().unwrap();
    assert_eq!(tls.watch_interval, Duration::from_secs(5));
    let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
    assert_eq!(again.tls, c.tls);
    assert!(err(with(&other_key, "127.0.0.1:8443")).contains("`tls.key`"));
    assert!(err(with(&key, "127.0.0.1:8080")).contains("`tls.listen`"));
    // TLS only: the plain listener can be turned off.
    let mut only_tls = with(&key, "127.0.0.1:8443");
    only_tls.listen = Some("off".into());
    let c = Config::try_from(only_tls).unwrap();
    assert_eq!(c.listen, None);
    assert!(c.to_toml().contains("listen = \"off\""));
}

#[test]
fn defaults_apply() {
    let c = Config::try_from(base()).unwrap();
    assert_eq!(c.listen.unwrap().to_string(), "127.0.0.1:8080");
    assert_eq!(c.admin_listen.to_string(), "127.0.0.1:9090");
    assert_eq!(c.routes[0].namespace, "default");
    assert_eq!(c.routes[0].key, KeyTemplate::Path);
    assert!(c.routes[0].write_methods.is_write("MKCOL"));
    assert!(c.routes[0].write_methods.is_write("get"));
    assert!(!c.routes[0].write_methods.is_write("GET"));
    assert_eq!(c.routes[0].upstream_timeout, Duration::from_secs(60));
    // The cap and its queue (issue 42.6): a wait as long as a dial.
    assert_eq!(c.routes[0].upstream_max_connections, 64);
    assert_eq!(c.routes[0].upstream_queue_timeout, Duration::from_secs(5));
    // One worker per CPU, decided at start.
    assert_eq!(c.workers, None);
    let mut raw = base();
    raw.workers = Some(1024);
    assert_eq!(Config::try_from(raw).unwrap().workers, Some(1024));
    // The printed config parses back to the same thing.
    let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
    assert_eq!(again.to_toml(), c.to_toml());
}

/// A streaming response's pause has its own bound, 60 s by default
/// (nginx's `proxy_read_timeout` and `send_timeout`), never shorter than
/// the idle timeout it replaces while a response streams.
#[test]
fn the_response_idle_timeout_is_bounded() {
    let c = Config::try_from(base()).unwrap();
    assert_eq!(c.limits.response_idle_timeout, Duration::from_secs(60));
    let limits = |header: Option<&str>, response: &str| {
        let mut raw = base();
        raw.limits.header_read_timeout = header.map(str::to_string);
        raw.limits.response_idle_timeout = Some(response.to_string());
        raw
    };
    for (header, response) in [
        (None, "0s"),
        (None, "9s"),
        (Some("2s"), "1500ms"),
        (None, "25h"),
        (None, "soon"),
        (None, "-1s"),
    ] {
        let e = err(limits(header, response));
        assert!(
            e.contains("limits.response_idle_timeout"),
            "{header:?} {response}: {e}"
        );
    }
    for (header, response, want) in [
        (None, "10s", 10),
        (Some("1s"), "1s", 1),
        (None, "5m", 300),
        (None, "24h", 86400),
    ] {
        let c = Config::try_from(limits(header, response)).unwrap();
        assert_eq!(
            c.limits.response_idle_timeout,
            Duration::from_secs(want),
            "{response}"
        );
        // Printed and read back the same.
        let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
        assert_eq!(again.limits, c.limits);
    }
}

#[test]
fn proxy_protocol_needs_trusted_proxies_on_each_listener() {
    let mut raw = base();
    raw.proxy_protocol = Some(true);
    raw.trusted_proxies = Some(vec!["10.0.0.0/8".into(), "192.0.2.7".into()]);
    let c = Config::try_from(raw.clone()).unwrap();
    assert!(c.proxy_protocol);
    let trusted = c.trusted_proxies.clone().unwrap();
    assert!(trusted.contains("10.9.9.9".parse().unwrap()));
    assert!(!trusted.contains("192.0.2.8".parse().unwrap()));
    // Written back as it reads.
    let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
    assert_eq!(again.trusted_proxies, c.trusted_proxies);
    assert!(again.proxy_protocol);
    // The TLS listener's own switch needs the same trust.
    raw.proxy_protocol = None;
    raw.trusted_proxies = None;
    let tls = TlsConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        cert: "c".into(),
        key: "k".into(),
        client_ca: None,
        watch_interval: Duration::from_secs(5),
        proxy_protocol: true,
    };
    let e = proxies(&raw, Some(&tls)).unwrap_err().to_string();
    assert!(e.contains("tls.proxy_protocol"), "{e}");
    raw.trusted_proxies = Some(vec!["10.0.0.0/8".into()]);
    assert!(proxies(&raw, Some(&tls)).is_ok());
}

#[test]
fn a_value_of_the_wrong_type_is_named_by_its_field() {
    for (text, field) in [
        ("raises_kept = -1", "`raises_kept`"),
        ("refusals_kept = \"10\"", "`refusals_kept`"),
        ("[limits]\nmax_connections = 1.5", "`limits.max_connections`"),
        (
            "[[routes]]\nupstream = \"http://a\"\n[[routes]]\nupstream = \"http://b\"\nupstream_max_connections = -2",
            "`routes[1].upstream_max_connections`",
        ),
    ] {
        let e = RawConfig::from_toml(text).unwrap_err();
        assert!(e.starts_with(field), "{text}: {e}");
    }
}

#[test]
fn unknown_fields_are_refused() {
    let e = RawConfig::from_toml("stor = \"x\"").unwrap_err();
    assert!(e.contains("stor"), "{e}");
    let e = RawConfig::from_toml("[[routes]]\nupstrem = \"x\"").unwrap_err();
    assert!(e.contains("upstrem"), "{e}");
}

#[test]
fn bad_values_name_their_field() {
    type Mutation = fn(&mut RawConfig);
    let cases: Vec<(Mutation, &str)> = vec![
        (|r| r.workers = Some(0), "workers"),
        (|r| r.workers = Some(1025), "workers"),
        (|r| r.refusals_kept = Some(100_001), "refusals_kept"),
        (|r| r.raises_kept = Some(100_001), "raises_kept"),
        (|r| r.proxy_protocol = Some(true), "proxy_protocol"),
        (
            |r| r.routes[0].error_format = Some("xml".into()),
            "routes[0].error_format",
        ),
        (
            |r| {
                r.routes[0].websocket = Some(true);
                r.routes[0].upstream_http2 = Some(true);
            },
            "routes[0].websocket",
        ),
        (
            |r| {
                r.proxy_protocol = Some(true);
                r.trusted_proxies = Some(vec![]);
            },
            "proxy_protocol",
        ),
        (
            |r| r.trusted_proxies = Some(vec!["10.0.0.0/8".into(), "10.0.0.0/40".into()]),
            "trusted_proxies",
        ),
        (
            |r| r.routes[0].upstream = Some("127.0.0.1:9000".into()),
            "routes[0].upstream",
        ),
        (
            |r| r.routes[0].upstream = Some("ftp://x".into()),
            "routes[0].upstream",
        ),
        (
            |r| r.routes[0].upstream = Some("http://x/base".into()),
            "routes[0].upstream",
        ),
        (|r| r.routes[0].upstream = None, "routes[0].upstream"),
        (
            |r| r.routes[0].upstream_ca = Some("/etc/hostname".into()),
            "routes[0].upstream_ca",
        ),
        (
            |r| {
                r.routes[0].upstream = Some("https://x".into());
                r.routes[0].upstream_ca = Some("/no/such/ca.pem".into());
            },
            "routes[0].upstream_ca",
        ),
        (
            |r| {
                r.routes[0].upstream = Some("https://x".into());
                r.routes[0].upstream_client_cert = Some("/no/such/c.pem".into());
            },
            "routes[0].upstream_client_key",
        ),
        (|r| r.tls = Some(RawTls::default()), "tls.cert"),
        (
            |r| {
                r.tls = Some(RawTls {
                    cert: Some("/no/such/cert.pem".into()),
                    ..RawTls::default()
                })
            },
            "tls.key",
        ),
        (
            |r| {
                r.tls = Some(RawTls {
                    cert: Some("/etc/hostname".into()),
                    key: Some("/etc/hostname".into()),
                    ..RawTls::default()
                })
            },
            "tls.cert",
        ),
        (|r| r.store = Some("/no/such/dir/f.redb".into()), "store"),
        (|r| r.store = Some("mongodb://x".into()), "store"),
        (|r| r.store = Some("etcd://a:1,/x".into()), "store"),
        (
            |r| {
                r.store = Some("redis://127.0.0.1:6379".into());
                r.store_timeout = Some("x".into());
            },
            "store_timeout",
        ),
        (|r| r.store = None, "store"),
        (|r| r.listen = Some("8080".into()), "listen"),
        (|r| r.listen = Some("off".into()), "listen"),
        (|r| r.routes[0].key = Some("bucket".into()), "routes[0].key"),
        (
            |r| r.routes[0].namespace = Some("a:b".into()),
            "routes[0].namespace",
        ),
        (
            |r| r.routes[0].upstream_timeout = Some("10".into()),
            "routes[0].upstream_timeout",
        ),
        (
            |r| r.routes[0].upstream_timeout = Some("0s".into()),
            "routes[0].upstream_timeout",
        ),
        (
            |r| r.routes[0].upstream_max_connections = Some(1_000_001),
            "routes[0].upstream_max_connections",
        ),
        (
            |r| r.routes[0].upstream_queue_timeout = Some("0s".into()),
            "routes[0].upstream_queue_timeout",
        ),
        (
            |r| r.routes[0].upstream_queue_timeout = Some("soon".into()),
            "routes[0].upstream_queue_timeout",
        ),
        (
            // The wait counts within the write's deadline.
            |r| r.routes[0].upstream_queue_timeout = Some("60s".into()),
            "routes[0].upstream_queue_timeout",
        ),
        (
            // No cap, no queue: a wait for it would never apply.
            |r| {
                r.routes[0].upstream_max_connections = Some(0);
                r.routes[0].upstream_queue_timeout = Some("1s".into());
            },
            "routes[0].upstream_queue_timeout",
        ),
        (
            |r| r.routes[0].upstream_timeout = Some("18446744073709551615s".into()),
            "routes[0].upstream_timeout",
        ),
        (
            |r| r.shutdown_grace = Some("307445734561825861m".into()),
            "shutdown_grace",
        ),
        (
            |r| r.routes[0].write_methods = Some(vec!["P UT".into()]),
            "routes[0].write_methods",
        ),
        (
            |r| {
                let mut twin = r.routes[0].clone();
                twin.name = Some("twin".into());
                r.routes.push(twin);
            },
            "routes[1].path_prefix",
        ),
        (
            |r| r.routes[0].host = Some("api.example:8080".into()),
            "routes[0].host",
        ),
        (
            |r| r.routes[0].tokens = Some("strict".into()),
            "routes[0].tokens",
        ),
        (
            |r| {
                let mut granted = r.routes[0].clone();
                granted.name = Some("granted".into());
                granted.path_prefix = Some("/g".into());
                granted.tokens = Some("granted".into());
                r.routes.push(granted);
            },
            "routes[1].tokens",
        ),
        (
            |r| r.lease_token_file = Some("/nonexistent/lease".into()),
            "lease_token_file",
        ),
        (
            |r| r.lease_listen = Some("127.0.0.1:0".into()),
            "lease_token_file",
        ),
        (
            |r| {
                r.lease_listen = Some("127.0.0.1:0".into());
                r.lease_token_file = Some("/nonexistent/lease".into());
            },
            "lease_token_file",
        ),
        (|r| r.max_lease_ttl = Some("0s".into()), "max_lease_ttl"),
        (
            |r| r.routes[0].host = Some("api.example.".into()),
            "routes[0].host",
        ),
        (
            |r| r.routes[0].host = Some("[::1]".into()),
            "routes[0].host",
        ),
        (
            |r| r.routes[0].host = Some("u@api.example".into()),
            "routes[0].host",
        ),
        (
            |r| r.routes[0].path_prefix = Some("/%7Euser".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| r.routes[0].path_prefix = Some("/a b".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| r.routes[0].path_prefix = Some("api".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| r.routes[0].path_prefix = Some("/a//b".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| r.routes[0].path_prefix = Some("//a".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| r.routes[0].path_prefix = Some("/a/../b/".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| r.routes[0].path_prefix = Some("/./a".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| r.routes[0].path_prefix = Some("/a;v=1".into()),
            "routes[0].path_prefix",
        ),
        (
            |r| {
                r.routes[0].path_prefix = Some("/a+b".into());
                r.routes[0].literal_keys = Some(true);
            },
            "routes[0].path_prefix",
        ),
        (
            |r| r.limits.max_header_bytes = Some(10),
            "limits.max_header_bytes",
        ),
        (
            |r| r.limits.max_body_bytes = Some(0),
            "limits.max_body_bytes",
        ),
        (
            |r| r.admin_token_file = Some("/no/such/token".into()),
            "admin_token_file",
        ),
        (|r| r.routes.clear(), "routes"),
        (|r| r.shutdown_grace = Some("soon".into()), "shutdown_grace"),
    ];
    for (mutate, field) in cases {
        let mut raw = base();
        mutate(&mut raw);
        let e = err(raw);
        assert!(
            e.contains(&format!("`{field}`")),
            "expected {field} in: {e}"
        );
    }
}

#[test]
fn store_urls() {
    let store = |url: &str| {
        let mut raw = base();
        raw.store = Some(url.into());
        Config::try_from(raw).unwrap().store
    };
    let shared = |url: &str| match store(url) {
        StoreConfig::Shared(s) => s.engine,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        shared("redis://127.0.0.1:6379/0"),
        SharedEngine::Redis { sentinel: None }
    );
    assert!(matches!(
        shared("postgres://u@127.0.0.1/db"),
        SharedEngine::Postgres { prefer: false, .. }
    ));
    assert!(matches!(
        shared("postgresql://u@127.0.0.1/db"),
        SharedEngine::Postgres { .. }
    ));
    assert_eq!(
        shared("etcd://127.0.0.1:2379,127.0.0.2:2379"),
        SharedEngine::Etcd {
            endpoints: vec![
                "http://127.0.0.1:2379".into(),
                "http://127.0.0.2:2379".into()
            ],
            user: None
        }
    );
    assert!(matches!(
        store("redb:///tmp/x.redb"),
        StoreConfig::Embedded { .. }
    ));
}

#[test]
fn durations() {
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
    assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
    assert!(parse_duration("s").is_err());
    assert!(parse_duration("-1s").is_err());
    assert!(parse_duration("10").is_err());
    assert_eq!(parse_duration("24h"), Ok(MAX_DURATION));
    // Out of range is an error, never a wrapped or saturated value.
    for big in [
        "25h",
        "307445734561825861m",
        "18446744073709551615s",
        "99999999999999999999999ms",
    ] {
        let e = parse_duration(big).unwrap_err();
        assert!(e.contains(big), "{e}");
    }
}

#[test]
fn route_hosts_are_spelled_as_requests_are_parsed() {
    for (given, kept) in [
        ("API.example", "api.example"),
        ("::1", "::1"),
        ("127.0.0.1", "127.0.0.1"),
    ] {
        let mut raw = base();
        raw.routes[0].host = Some(given.into());
        let c = Config::try_from(raw).unwrap();
        assert_eq!(c.routes[0].host.as_deref(), Some(kept));
    }
}

#[test]
fn prefix_matching_is_on_segment_boundaries() {
    let mut raw = base();
    raw.routes[0].path_prefix = Some("/api".into());
    let c = Config::try_from(raw).unwrap();
    let r = &c.routes[0];
    assert!(r.matches_path("/api"));
    assert!(r.matches_path("/api/x"));
    assert!(!r.matches_path("/apix"));
    assert!(!r.matches_path("/"));
}

use proptest::prelude::*;

fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("listen".to_string()),
        Just("store".to_string()),
        Just("upstream".to_string()),
        Just("key".to_string()),
        Just("namespace".to_string()),
        Just("upstream_timeout".to_string()),
        Just("write_methods".to_string()),
        Just("max_token_step".to_string()),
        Just("path_prefix".to_string()),
        "[a-z_]{1,12}",
    ]
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        "\"[ -~]{0,24}\"",
        "-?[0-9]{1,22}",
        Just("true".to_string()),
        Just("[\"PUT\", \"post\"]".to_string()),
        Just("\"http://127.0.0.1:9000\"".to_string()),
        Just("\"/{a}/{b}\"".to_string()),
        Just("\"10ms\"".to_string()),
    ]
}

proptest! {
    /// Whatever a config file says, loading it never panics: it is a
    /// config or an error naming a field.
    #[test]
    fn the_loader_never_panics(
        top in proptest::collection::vec((field(), value()), 0..5),
        routes in proptest::collection::vec(proptest::collection::vec((field(), value()), 0..6), 0..3),
    ) {
        let mut text = String::new();
        for (k, v) in &top {
            text.push_str(&format!("{k} = {v}\n"));
        }
        for r in &routes {
            text.push_str("[[routes]]\n");
            for (k, v) in r {
                text.push_str(&format!("{k} = {v}\n"));
            }
        }
        if let Ok(raw) = RawConfig::from_toml(&text) {
            match Config::try_from(raw) {
                Ok(c) => {
                    // A valid config prints to a config that loads to the
                    // same thing.
                    let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
                    prop_assert_eq!(again.to_toml(), c.to_toml());
                }
                Err(e) => prop_assert!(e.to_string().contains('`') || e.to_string().contains("config")),
            }
        }
    }
}

#[test]
fn explicit_write_methods_are_case_insensitive() {
    let w = WriteMethods::Only(["PUT".to_string()].into());
    assert!(w.is_write("PUT") && w.is_write("put"));
    assert!(!w.is_write("POST"));
}

#[test]
fn bodies_on_bodiless_methods_are_allowed_per_route_and_only_there() {
    // None by default: every bodiless method's body is refused.
    let c = Config::try_from(base()).unwrap();
    assert!(c.routes[0].allow_bodies_on.is_empty());
    assert!(!c.to_toml().contains("allow_bodies_on"));
    // Listed in any case, kept in upper case, printed back.
    let c = Config::try_from(with(
        "",
        r#"allow_bodies_on = ["get", "DELETE", "Options"]"#,
    ))
    .unwrap();
    let allowed: Vec<_> = c.routes[0].allow_bodies_on.iter().cloned().collect();
    assert_eq!(allowed, ["DELETE", "GET", "OPTIONS"]);
    let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
    assert_eq!(again.routes[0].allow_bodies_on, c.routes[0].allow_bodies_on);
    // HEAD and TRACE never have a body; other methods need no permission.
    for m in ["HEAD", "TRACE", "POST", "PUT", "G ET"] {
        let e = err(with("", &format!("allow_bodies_on = [\"{m}\"]")));
        assert!(e.contains("routes[0].allow_bodies_on"), "{m}: {e}");
    }
    // Which methods have no body semantics, in any spelling.
    for m in ["GET", "get", "HEAD", "OPTIONS", "DELETE", "delete", "TRACE"] {
        assert!(bodiless(m), "{m}");
    }
    for m in ["PUT", "POST", "PATCH", "PROPFIND", "QUERY"] {
        assert!(!bodiless(m), "{m}");
    }
}
