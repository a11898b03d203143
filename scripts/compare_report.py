#!/usr/bin/env python3
"""Turns the raw rows of one scripts/compare.sh run into its report.

Usage: compare_report.py ROWS OUT_DIR "machine line" FSYNC_PER_S

ROWS holds one line per measurement, tab-separated:
  kind  system  round  value  p50_ms  p99_ms  cpu_us_per_req
where kind is `rps` (wrk or h2load: value is requests/s) or `mibs` (a
256 MiB transfer with curl: value is MiB/s; the latency columns are `-`),
`store` (the store server's CPU per request in value) or `wire` (Redis's
commands per read in value, requests per fsync of its append-only files
in the p50 column, requests per script call in the last).
Writes OUT_DIR/results.md (the tables docs/benchmarks.md shows) and
OUT_DIR/chart.svg (req/s and proxy CPU per request per system), and prints
the tables. Medians over rounds; every ratio is taken within this run.
"""

import statistics
import sys
from collections import defaultdict

LABELS = {
    "direct": "direct (nginx answering 200)",
    "nginx": "nginx, plain reverse proxy (1 worker)",
    "haproxy": "HAProxy (1 thread)",
    "steady": "fencegate, steady token, one key",
    "newkey": "fencegate, new key per request (durable advance)",
    "steady-redis": "fencegate on Redis, steady token",
    "newkey-redis": "fencegate on Redis, new key per request",
    "steady-redis-replica": "fencegate on Redis waiting for its replica, steady token",
    "newkey-redis-replica": "fencegate on Redis waiting for its replica, new key per request",
    "steady-redis-cluster": "fencegate on a Redis Cluster (3 primaries), steady token",
    "newkey-redis-cluster": "fencegate on a Redis Cluster (3 primaries), new key per request",
    "steady-postgres": "fencegate on PostgreSQL, steady token",
    "newkey-postgres": "fencegate on PostgreSQL, new key per request",
    "steady-etcd": "fencegate on etcd, steady token",
    "newkey-etcd": "fencegate on etcd, new key per request",
    "nginx-tls": "nginx terminating TLS (1 worker)",
    "steady-tls": "fencegate TLS listener, steady token",
    "steady-base": "baseline binary, steady token (`BASELINE_BIN`)",
    "newkey-base": "baseline binary, new key (`BASELINE_BIN`)",
    "newkey-redis-base": "baseline binary on Redis, new key (`BASELINE_BIN`)",
    "nginx-h2c": "nginx, HTTP/2 cleartext (h2c), h2load",
    "steady-h2c": "fencegate, HTTP/2 cleartext (h2c), steady token, h2load",
    "nginx-h2": "nginx, HTTP/2 over TLS, h2load",
    "steady-h2": "fencegate, HTTP/2 over TLS, steady token, h2load",
    "upload-direct": "256 MiB upload, direct to nginx",
    "upload-fencegate": "256 MiB upload through fencegate",
    "download-direct": "256 MiB download, direct from nginx",
    "download-fencegate": "256 MiB download through fencegate",
}


def num(v):
    return None if v == "-" else float(v)


def main():
    rows_path, out, machine, fsync = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    order = []
    data = defaultdict(lambda: defaultdict(list))
    kinds = {}
    for line in open(rows_path):
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 7:
            continue
        kind, system, _round, value, p50, p99, cpu = parts
        if kind in ("store", "wire"):
            # The store server's CPU, or how writes reached Redis, on a
            # shared-store row: kept apart.
            system = system + "@" + kind
        if system not in kinds:
            order.append(system)
            kinds[system] = kind
        for name, v in (("value", value), ("p50", p50), ("p99", p99), ("cpu", cpu)):
            if num(v) is not None:
                data[system][name].append(num(v))

    def med(system, name):
        values = data[system][name]
        return statistics.median(values) if values else None

    def fmt(v, digits=2):
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [f"Machine: {machine}", ""]
    # ONLY= may leave out either: a ratio to a row not run is "-".
    direct = med("direct", "value")
    best = max((v for v in (med("nginx", "value"), med("haproxy", "value")) if v), default=None)
    over = lambda v, base: "-" if v is None or not base else f"{v / base:.2f}x"  # noqa: E731
    lines += [
        "| system | req/s | p50 ms | p99 ms | proxy CPU µs/req | vs direct | vs best plain proxy |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in order:
        if kinds[s] != "rps":
            continue
        v = med(s, "value")
        p50 = med(s, "p50")
        lines.append(
            f"| {LABELS.get(s, s)} | {v:.0f} | {fmt(p50, 3)} | {fmt(med(s, 'p99'))} "
            f"| {fmt(med(s, 'cpu'), 1) if s != 'direct' else '-'} | {over(v, direct)} | {over(v, best)} |"
        )
    ratio = lambda a, b: (  # noqa: E731
        f"{med(a, 'value') / med(b, 'value'):.2f}x" if med(a, "value") and med(b, "value") else "-"
    )
    lines += [
        "",
        f"- steady token vs the better plain proxy: {ratio('steady', 'nginx' if med('nginx', 'value') == best else 'haproxy')}",
        f"- disk fsync rate (4 KiB write+fsync, same filesystem): {fsync:.0f}/s; "
        f"new-key durable advances: {over(med('newkey', 'value'), fsync)} that rate",
        f"- shared stores vs the embedded store (steady / new key): "
        f"Redis {ratio('steady-redis', 'steady')} / {ratio('newkey-redis', 'newkey')}, "
        f"PostgreSQL {ratio('steady-postgres', 'steady')} / {ratio('newkey-postgres', 'newkey')}, "
        f"etcd {ratio('steady-etcd', 'steady')} / {ratio('newkey-etcd', 'newkey')}",
        f"- waiting for a Redis replica (WAIT 1 after each call) vs a lone Redis (steady / new key): "
        f"{ratio('steady-redis-replica', 'steady-redis')} / {ratio('newkey-redis-replica', 'newkey-redis')}",
        f"- a Redis Cluster of three primaries vs a lone Redis (steady / new key): "
        f"{ratio('steady-redis-cluster', 'steady-redis')} / {ratio('newkey-redis-cluster', 'newkey-redis')}",
        "- store server CPU per request, same rounds (µs; it runs on the proxy's core): "
        + ", ".join(
            f"{name} {fmt(med(f'steady-{s}@store', 'value'), 0)} steady / "
            f"{fmt(med(f'newkey-{s}@store', 'value'), 0)} new key"
            for name, s in (
                ("Redis", "redis"),
                ("Redis Cluster", "redis-cluster"),
                ("PostgreSQL", "postgres"),
                ("etcd", "etcd"),
            )
        ),
        "- how new-key writes reach Redis (commands per read: calls the client sent together; "
        "requests per fsync: the servers' group commit; requests per script call: fencegate's batches): "
        + ", ".join(
            f"{name} {fmt(med(f'newkey-{s}@wire', 'value'))} / {fmt(med(f'newkey-{s}@wire', 'p50'))}"
            f" / {fmt(med(f'newkey-{s}@wire', 'cpu'))}"
            for name, s in (("Redis", "redis"), ("Redis Cluster", "redis-cluster"))
        ),
        f"- fencegate TLS vs nginx terminating TLS: {ratio('steady-tls', 'nginx-tls')}; "
        f"vs its own plain listener: {ratio('steady-tls', 'steady')}",
    ]
    if "steady-h2c" in data:
        lines.append(
            f"- HTTP/2: fencegate h2c vs nginx h2c: {ratio('steady-h2c', 'nginx-h2c')}; "
            f"over TLS: {ratio('steady-h2', 'nginx-h2')}"
        )
    if "steady-base" in data:
        lines.append(
            f"- this build vs the baseline binary: steady {ratio('steady', 'steady-base')}, "
            f"new key {ratio('newkey', 'newkey-base')}"
            + (
                f", new key on Redis {ratio('newkey-redis', 'newkey-redis-base')} "
                f"(store server CPU per request {fmt(med('newkey-redis@store', 'value'), 0)} µs "
                f"against {fmt(med('newkey-redis-base@store', 'value'), 0)})"
                if "newkey-redis-base" in data
                else ""
            )
        )
    transfers = [s for s in order if kinds[s] == "mibs"]
    if transfers:
        lines += ["", "| transfer | MiB/s | vs direct | proxy CPU µs/MiB |", "|---|---|---|---|"]
        for s in transfers:
            base = s.split("-")[0] + "-direct"
            v = med(s, "value")
            lines.append(
                f"| {LABELS.get(s, s)} | {v:.0f} | {v / med(base, 'value'):.2f}x "
                f"| {fmt(med(s, 'cpu'), 0) if not s.endswith('direct') else '-'} |"
            )
    text = "\n".join(lines) + "\n"
    with open(f"{out}/results.md", "w") as f:
        f.write(text)
    with open(f"{out}/chart.svg", "w") as f:
        f.write(chart([s for s in order if kinds[s] == "rps"], med, machine))
    print(text)


def chart(systems, med, machine):
    """Two bar panels side by side: req/s and proxy CPU µs per request."""
    row, top, label_w, bar_w, gap = 22, 46, 330, 260, 40
    height = top + row * len(systems) + 30
    width = label_w + 2 * bar_w + gap + 80
    max_rps = max(med(s, "value") for s in systems)
    cpus = [med(s, "cpu") for s in systems if med(s, "cpu") is not None and s != "direct"]
    max_cpu = max(cpus) if cpus else 1.0

    def esc(t):
        return t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="8" y="16" font-weight="bold">scripts/compare.sh: 1 KiB PUTs, 64 concurrent; medians</text>',
        f'<text x="8" y="32" fill="#555">{esc(machine)}</text>',
        f'<text x="{label_w}" y="{top - 4}" font-weight="bold">requests/s (longer is better)</text>',
        f'<text x="{label_w + bar_w + gap}" y="{top - 4}" font-weight="bold">'
        "proxy CPU µs per request (shorter is better)</text>",
    ]
    for i, s in enumerate(systems):
        y = top + i * row
        fencegate = s.startswith(("steady", "newkey"))
        colour = "#d9822b" if fencegate else "#4a78a8"
        rps = med(s, "value")
        w = bar_w * rps / max_rps
        out.append(f'<text x="8" y="{y + 14}">{esc(LABELS.get(s, s))}</text>')
        out.append(f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" fill="{colour}"/>')
        out.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 14}">{rps:,.0f}</text>')
        cpu = med(s, "cpu")
        if cpu is not None and s != "direct":
            cw = bar_w * cpu / max_cpu
            x = label_w + bar_w + gap
            out.append(f'<rect x="{x}" y="{y + 3}" width="{cw:.1f}" height="{row - 6}" fill="{colour}"/>')
            out.append(f'<text x="{x + cw + 4:.1f}" y="{y + 14}">{cpu:.1f}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
