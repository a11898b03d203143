# Multi-stage build: compile in the Rust image, run from a slim Debian base
# as an unprivileged user. The store lives in /var/lib/fencegate (a volume).
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Every file Cargo.toml names must be here (the bench target too), or
# cargo cannot read the manifest; scripts/check_deploy.sh checks this set.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked --bin fencegate && strip target/release/fencegate

FROM debian:bookworm-slim
# CA roots: https upstreams are verified against the system's by default.
# Not pinned: Debian replaces a package version in its archive with each
# security update, and a pinned one then no longer installs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --home-dir /var/lib/fencegate --create-home fencegate
COPY --from=build /src/target/release/fencegate /usr/local/bin/fencegate
USER 10001:10001
VOLUME ["/var/lib/fencegate"]
ENV FENCEGATE_LISTEN=0.0.0.0:8080 \
    FENCEGATE_ADMIN_LISTEN=0.0.0.0:9090 \
    FENCEGATE_STORE=/var/lib/fencegate/fences.redb
# 8443: the TLS listener, when --tls-listen/[tls] is configured.
EXPOSE 8080 8443 9090
# The image has no curl: the binary probes its own liveness endpoint.
# /healthz, not /readyz: a store outage makes every replica unready, and
# Docker, Swarm or ECS would restart them all for it (Kubernetes uses
# /readyz for readiness only). The address is FENCEGATE_ADMIN_LISTEN's
# port on loopback: change both together.
HEALTHCHECK --interval=10s --timeout=6s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/fencegate", "probe", "http://127.0.0.1:9090/healthz"]
# SIGTERM drains in-flight requests and records a clean stop.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/fencegate"]
