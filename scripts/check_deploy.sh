#!/usr/bin/env bash
# Validates the deployment kit offline, without a cluster or a container
# engine (docs/gateway.md, "Kubernetes"):
#  1. renders each overlay of deploy/kubernetes with `kubectl kustomize` (no
#     cluster needed; without kubectl, by following the kustomization files:
#     resources, components, a configMapGenerator and inline JSON patches;
#     with kubectl, that rendering must agree with it), and each without
#     components/tls (the documented plain-only install);
#  2. kubernetes-validate --strict against Kubernetes 1.30 (the first with the
#     preStop sleep action on by default) and 1.37, on the rendered overlays
#     and on every manifest file. It has no schema for the PodMonitor CRD and
#     only warns: that one warning is allowed, any other fails, and step 3
#     checks the PodMonitor;
#  3. cross-checks the rendered manifests against each other and fencegate:
#     selectors and port names (Services, PDB, NetworkPolicy, PodMonitor),
#     probes, the drain arithmetic of terminationGracePeriodSeconds, the
#     security context against the Dockerfile's USER, TLS mounted without
#     subPath, one replica for the embedded store;
#  3b. applies the install commands of docs/gateway.md ("Deploying"), in
#     their order, to a model of the cluster: every namespace,
#     ServiceAccount, Secret (and key) and ConfigMap an object names exists
#     by the step that applies it; `kubectl wait` has a timeout;
#  4. `fencegate check-config` on the ConfigMap's TOML with each workload's
#     environment (needs a built binary, $FENCEGATE_BIN or
#     target/release/fencegate: skipped without one, except under CI);
#  5. checkov on deploy/kubernetes (kubernetes and kustomize frameworks) and
#     on the Dockerfile, offline; every finding is fixed or skipped inline
#     with its reason (checkov.io/skipN annotations); hadolint on the
#     Dockerfile.
# The tools are pinned in .ci/requirements-deploy.txt and installed into
# their own venv (checkov's boto3 pin conflicts with .ci/requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

K8S=deploy/kubernetes
OVERLAYS=(shared-store embedded)
K8S_VERSIONS=(1.30.0 1.37.0)
# Outside the work tree, so that a fresh clone (CI) reuses it; reinstalled
# when the pins change.
VENV=${CHECK_DEPLOY_VENV:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/fencegate/deploy-venv}
REQ=.ci/requirements-deploy.txt
OUT=target/deploy-check
BIN=${FENCEGATE_BIN:-target/release/fencegate}
KUBECTL=${KUBECTL:-kubectl}

fail() {
  echo "check_deploy: FAILED: $*" >&2
  exit 1
}

if ! cmp -s "$REQ" "$VENV/.requirements" 2>/dev/null; then
  [[ -z ${CHECK_DEPLOY_NO_INSTALL:-} ]] || fail "no $VENV with the tools of $REQ: run scripts/test without --no-install"
  echo "check_deploy: installing $REQ into $VENV" >&2
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv --clear "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQ"
  cp "$REQ" "$VENV/.requirements"
fi
PY=$VENV/bin/python
rm -rf "$OUT"
mkdir -p "$OUT"

cat >"$OUT/check.py" <<'PY'
"""Renders the overlays without kubectl, and cross-checks rendered output."""
import copy
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib

import yaml

ERRORS = []


def err(where, msg):
    ERRORS.append(f"{where}: {msg}")


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def render(directory, skip=(), parent=None):
    """kustomize build for kustomizations made of resources, components,
    configMapGenerator files and inline JSON patches (RFC 6902) that target
    objects by kind and name; ConfigMaps keep their plain names (kustomize
    adds a hash suffix and rewrites references). A Component works on its
    parent's objects (`parent`); components listed in `skip` (as the
    overlay names them) are left out, as a user who removes them would."""
    kust = load_docs(os.path.join(directory, "kustomization.yaml"))[0]
    known = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "patches"}
    if set(kust) - known:
        raise SystemExit(f"{directory}/kustomization.yaml: {sorted(set(kust) - known)} need kubectl kustomize")
    docs = list(parent or [])
    for entry in kust.get("resources", []):
        path = os.path.join(directory, entry)
        if os.path.isdir(path):
            docs += render(path, skip)
        elif os.path.isfile(path):
            docs += load_docs(path)
        else:
            raise SystemExit(f"{directory}/kustomization.yaml lists {entry}, which does not exist")
    for gen in kust.get("configMapGenerator", []):
        data = {}
        for name in gen.get("files", []):
            with open(os.path.join(directory, name)) as f:
                data[os.path.basename(name)] = f.read()
        meta = {"name": gen["name"]}
        if "namespace" in gen:
            meta["namespace"] = gen["namespace"]
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for entry in kust.get("components", []):
        if entry in skip:
            continue
        path = os.path.join(directory, entry)
        if not os.path.isdir(path):
            raise SystemExit(f"{directory}/kustomization.yaml lists component {entry}, which does not exist")
        docs = render(path, skip, parent=docs)
    for patch in kust.get("patches", []):
        json_patch(directory, docs, patch)
    return docs


def json_patch(directory, docs, patch):
    target = patch.get("target", {})
    if set(patch) != {"target", "patch"} or set(target) - {"kind", "name"}:
        raise SystemExit(f"{directory}: only inline JSON patches on a kind and name render without kubectl")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise SystemExit(f"{directory}: a strategic merge patch needs kubectl kustomize")
    for d in docs:
        meta = (d.get("kind"), d["metadata"]["name"])
        if meta == (target.get("kind", meta[0]), target.get("name", meta[1])):
            for op in ops:
                apply_op(d, op)


def apply_op(doc, op):
    """One RFC 6902 operation: add (`-` appends), replace, remove."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node = doc
    for key in parts[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last, kind, value = parts[-1], op["op"], copy.deepcopy(op.get("value"))
    if kind not in ("add", "replace", "remove"):
        raise SystemExit(f"JSON patch op {kind} needs kubectl kustomize")
    if isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), value)
        elif kind == "replace":
            node[int(last)] = value
        else:
            del node[int(last)]
    elif kind == "add":
        node[last] = value
    else:
        if last not in node:
            raise SystemExit(f"JSON patch: {op['path']} does not exist (kustomize fails too)")
        if kind == "replace":
            node[last] = value
        else:
            del node[last]


def seconds(text):
    """fencegate's durations as used here: 250ms, 10s, 2m, 1h 30m."""
    total = 0.0
    for part in str(text).split():
        m = re.fullmatch(r"(\d+)(ms|s|m|h)", part)
        if not m:
            raise ValueError(f"duration {text!r}")
        total += int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    return total


def subset(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def dockerfile_user():
    user = None
    with open("Dockerfile") as f:
        for line in f:
            m = re.match(r"\s*USER\s+(\d+)(?::(\d+))?\s*$", line)
            if m:
                user = (int(m.group(1)), int(m.group(2) or m.group(1)))
    if user is None:
        raise SystemExit("Dockerfile: no numeric USER")
    return user


PODMONITOR_SPEC = {
    "attachMetadata", "bodySizeLimit", "convertClassicHistogramsToNHCB", "fallbackScrapeProtocol",
    "jobLabel", "keepDroppedTargets", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit",
    "namespaceSelector", "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
    "podMetricsEndpoints", "podTargetLabels", "sampleLimit", "scrapeClass", "scrapeClassicHistograms",
    "scrapeProtocols", "selector", "selectorMechanism", "targetLimit",
}
PODMONITOR_ENDPOINT = {
    "authorization", "basicAuth", "bearerTokenSecret", "enableHttp2", "filterRunning",
    "followRedirects", "honorLabels", "honorTimestamps", "interval", "metricRelabelings",
    "noProxy", "oauth2", "params", "path", "port", "portNumber", "proxyConnectHeader",
    "proxyFromEnvironment", "proxyUrl", "relabelings", "scheme", "scrapeTimeout", "targetPort",
    "tlsConfig", "trackTimestampsStaleness",
}
# Fixed in fencegate: Server::wait lets lease releases settle this long.
SETTLE_SECONDS = 2
MIN_MARGIN_SECONDS = 5


def check_workload(name, docs, workload, uid_gid):
    where = f"{name}: {workload['kind']}/{workload['metadata']['name']}"
    spec = workload["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    if not subset(spec["selector"]["matchLabels"], labels):
        err(where, "selector does not match the pod labels")
    containers = {c["name"]: c for c in pod["containers"]}
    c = containers.get("fencegate")
    if c is None:
        return err(where, "no container named fencegate")
    env = {e["name"]: e for e in c.get("env", [])}
    val = lambda k, default=None: env[k].get("value", default) if k in env else default
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}

    # Ports agree with the listen addresses.
    for port, var in (("http", "FENCEGATE_LISTEN"), ("https", "FENCEGATE_TLS_LISTEN"), ("admin", "FENCEGATE_ADMIN_LISTEN")):
        addr = val(var)
        if addr == "off" and port == "http" and port not in ports:
            continue
        # No TLS listener (an overlay without components/tls).
        if addr is None and port == "https" and port not in ports:
            continue
        if addr is None or port not in ports or not addr.endswith(f":{ports[port]}"):
            err(where, f"container port {port} and {var}={addr} disagree")
        elif addr.startswith("127.") and port == "admin":
            err(where, "the admin listener is on loopback: probes and Prometheus cannot reach it")

    # Probes on the admin port.
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = c.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or get.get("port") not in ("admin", ports.get("admin")):
            err(where, f"{probe} must GET {path} on the admin port")
    store_timeout = seconds(val("FENCEGATE_STORE_TIMEOUT", "2s"))
    if c.get("readinessProbe", {}).get("timeoutSeconds", 1) <= store_timeout:
        err(where, "readinessProbe.timeoutSeconds must exceed FENCEGATE_STORE_TIMEOUT (/readyz pings the store)")

    # The drain arithmetic.
    pre = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        pre_stop = pre["sleep"]["seconds"]
    elif pre.get("exec", {}).get("command", [""])[0].endswith("sleep"):
        pre_stop = int(pre["exec"]["command"][1])
    else:
        pre_stop = None
        err(where, "no preStop sleep")
    grace = seconds(val("FENCEGATE_SHUTDOWN_GRACE", "30s"))
    needed = (pre_stop or 0) + grace + store_timeout + SETTLE_SECONDS + MIN_MARGIN_SECONDS
    tgps = pod.get("terminationGracePeriodSeconds", 30)
    if tgps < needed:
        err(where, f"terminationGracePeriodSeconds {tgps} < preStop {pre_stop} + shutdown_grace {grace:g}"
                   f" + store_timeout {store_timeout:g} + settle {SETTLE_SECONDS} + margin {MIN_MARGIN_SECONDS}")

    # Security context: non-root as the image's user, read-only, no privileges.
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    uid, gid = uid_gid
    for sc, what in ((psc, "pod"), (csc, "container")):
        if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") != uid or sc.get("runAsGroup") != gid:
            err(where, f"{what} securityContext must run as non-root {uid}:{gid} (the Dockerfile's USER)")
        if sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            err(where, f"{what} securityContext needs seccompProfile RuntimeDefault")
    if not (csc.get("readOnlyRootFilesystem") is True and csc.get("allowPrivilegeEscalation") is False
            and csc.get("capabilities", {}).get("drop") == ["ALL"]):
        err(where, "container needs readOnlyRootFilesystem, no privilege escalation, capabilities drop ALL")
    if pod.get("automountServiceAccountToken") is not False:
        err(where, "automountServiceAccountToken must be false")
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        if not {"cpu", "memory"} <= set(res.get(kind, {})):
            err(where, f"resources.{kind} needs cpu and memory")
    image = c.get("image", "")
    if "@sha256:" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
        err(where, f"image {image} is not pinned to a tag or digest")

    # Volumes: no subPath; TLS and config mounted as directories where the env points.
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    for m in mounts.values():
        if "subPath" in m or "subPathExpr" in m:
            err(where, f"volumeMount {m['name']} uses subPath: Secret and ConfigMap updates would not reach it")

    def mounted(path, kind):
        m = mounts.get(os.path.dirname(path))
        if m is None:
            err(where, f"nothing is mounted at {os.path.dirname(path)} for {path}")
            return None
        return volumes.get(m["name"], {}).get(kind)

    tls = val("FENCEGATE_TLS_LISTEN", "off") != "off"
    for var, key in (("FENCEGATE_TLS_CERT", "tls.crt"), ("FENCEGATE_TLS_KEY", "tls.key")) if tls else ():
        path = val(var)
        secret = mounted(path, "secret") if path else None
        if not path or os.path.basename(path) != key or not secret:
            err(where, f"{var} must be {key} of a kubernetes.io/tls Secret mounted as a directory")
    config = val("FENCEGATE_CONFIG")
    cm = mounted(config, "configMap") if config else None
    cms = [d for d in docs if d["kind"] == "ConfigMap" and cm and d["metadata"]["name"] == cm["name"]]
    if not cms or os.path.basename(config) not in cms[0].get("data", {}):
        err(where, f"FENCEGATE_CONFIG={config} is not a key of a mounted ConfigMap of this overlay")
        toml = None
    else:
        toml = tomllib.loads(cms[0]["data"][os.path.basename(config)])
        for r in toml.get("routes", []):
            if seconds(r.get("upstream_timeout", "60s")) > grace:
                err(where, f"route {r.get('name')}: upstream_timeout above FENCEGATE_SHUTDOWN_GRACE: a drain cannot finish its writes")

    store = env.get("FENCEGATE_STORE", {})
    if workload["kind"] == "StatefulSet":
        if spec.get("replicas") != 1:
            err(where, "the embedded store allows one replica only")
        m = mounts.get(os.path.dirname(store.get("value", "")))
        if m is None or m["name"] not in claims:
            err(where, "FENCEGATE_STORE must be on the volumeClaimTemplate's volume")
    elif "secretKeyRef" not in store.get("valueFrom", {}):
        err(where, "FENCEGATE_STORE must come from a Secret")

    # Everything that selects pods selects these, by names that exist.
    for d in docs:
        kind, dn = d["kind"], f"{d['kind']}/{d['metadata']['name']}"
        if kind == "Service":
            if not subset(d["spec"]["selector"], labels):
                err(name, f"{dn} does not select the pods")
            for p in d["spec"]["ports"]:
                if isinstance(p.get("targetPort"), str) and p["targetPort"] not in ports:
                    err(name, f"{dn} targets port {p['targetPort']}, which the container does not name")
        elif kind == "PodDisruptionBudget" and not subset(d["spec"]["selector"]["matchLabels"], labels):
            err(name, f"{dn} does not select the pods")
        elif kind == "NetworkPolicy":
            if not subset(d["spec"]["podSelector"]["matchLabels"], labels):
                err(name, f"{dn} does not select the pods")
            for rule in d["spec"].get("ingress", []):
                for p in rule.get("ports", []):
                    if isinstance(p.get("port"), str) and p["port"] not in ports:
                        err(name, f"{dn} names port {p['port']}, which the container does not name")
        elif kind == "PodMonitor":
            s = d["spec"]
            if d["apiVersion"] != "monitoring.coreos.com/v1":
                err(name, f"{dn}: apiVersion {d['apiVersion']}")
            if set(s) - PODMONITOR_SPEC:
                err(name, f"{dn}: unknown spec fields {sorted(set(s) - PODMONITOR_SPEC)}")
            if not subset(s.get("selector", {}).get("matchLabels"), labels):
                err(name, f"{dn} does not select the pods")
            for e in s.get("podMetricsEndpoints", []) or [None]:
                if e is None:
                    err(name, f"{dn} has no podMetricsEndpoints")
                    continue
                if set(e) - PODMONITOR_ENDPOINT:
                    err(name, f"{dn}: unknown endpoint fields {sorted(set(e) - PODMONITOR_ENDPOINT)}")
                if e.get("port") != "admin" or e.get("path") != "/metrics":
                    err(name, f"{dn} must scrape /metrics on the admin port")
                if seconds(e.get("scrapeTimeout", "10s")) > seconds(e.get("interval", "30s")):
                    err(name, f"{dn}: scrapeTimeout above interval")
    for d in docs:
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == pod.get("serviceAccountName"):
            if d.get("automountServiceAccountToken") is not False:
                err(name, "the ServiceAccount must not automount its token")
            break
    else:
        err(where, f"ServiceAccount {pod.get('serviceAccountName')} is not in the overlay")
    return {"env": env, "toml": toml, "config": cms[0]["data"][os.path.basename(config)] if cms else None}


def check_config(name, found, binary, openssl_dir):
    """fencegate check-config on the ConfigMap's file with the workload's
    literal environment; paths and the store replaced by local ones."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for k, e in found["env"].items():
        if "value" in e:
            env[k] = e["value"]
    env["FENCEGATE_TLS_CERT"] = os.path.join(openssl_dir, "tls.crt")
    env["FENCEGATE_TLS_KEY"] = os.path.join(openssl_dir, "tls.key")
    store = found["env"].get("FENCEGATE_STORE", {})
    env["FENCEGATE_STORE"] = ("redis://127.0.0.1:6379/0" if "valueFrom" in store
                              else os.path.join(openssl_dir, "fences.redb"))
    env.pop("FENCEGATE_CONFIG", None)
    path = os.path.join(openssl_dir, f"{name}.toml")
    with open(path, "w") as f:
        f.write(found["config"])
    run = subprocess.run([binary, "check-config", path], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        err(name, f"fencegate check-config refused the ConfigMap with this environment: {run.stderr.strip()}")


# Where a pod spec sits in each kind that has one.
POD_SPEC = {
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
    "Pod": ("spec",),
}


def references(doc):
    """What an object needs to exist before its pods can start: (kind,
    name, key or None, where) for its ServiceAccount, the Secrets and
    ConfigMaps its environment and volumes name."""
    pod = doc
    for k in POD_SPEC.get(doc["kind"], ()):
        pod = pod.get(k, {}) if pod else {}
    if doc["kind"] not in POD_SPEC or not pod:
        return []
    refs = [("ServiceAccount", pod.get("serviceAccountName", "default"), None, "serviceAccountName")]
    for s in pod.get("imagePullSecrets", []):
        refs.append(("Secret", s["name"], None, "imagePullSecrets"))
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        for e in c.get("env", []):
            src = e.get("valueFrom", {})
            for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if field in src and not src[field].get("optional"):
                    refs.append((kind, src[field]["name"], src[field]["key"], f"env {e['name']}"))
        for e in c.get("envFrom", []):
            for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if field in e and not e[field].get("optional"):
                    refs.append((kind, e[field]["name"], None, f"envFrom {c['name']}"))
    # A file of a mounted Secret that the environment points at (the TLS
    # certificate and key) must be one of its keys.
    used = {}
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        for m in c.get("volumeMounts", []):
            for e in c.get("env", []):
                value = str(e.get("value", ""))
                if value.startswith(m["mountPath"].rstrip("/") + "/"):
                    key = value[len(m["mountPath"].rstrip("/")) + 1:].split("/")[0]
                    used.setdefault(m["name"], []).append((key, e["name"]))
    for v in pod.get("volumes", []):
        if "secret" in v and not v["secret"].get("optional"):
            refs.append(("Secret", v["secret"]["secretName"], None, f"volume {v['name']}"))
            for key, var in used.get(v["name"], []):
                refs.append(("Secret", v["secret"]["secretName"], key, f"volume {v['name']}, {var}"))
        if "configMap" in v and not v["configMap"].get("optional"):
            refs.append(("ConfigMap", v["configMap"]["name"], None, f"volume {v['name']}"))
    return refs


def shared_store(workload):
    """Whether a workload's fencegate takes its store from a Secret (a
    shared store's URL) rather than a file."""
    pod = workload["spec"]["template"]["spec"]
    return any(e["name"] == "FENCEGATE_STORE" and "secretKeyRef" in e.get("valueFrom", {})
               for c in pod.get("containers", []) for e in c.get("env", []))


def doc_blocks(path):
    """The ```sh blocks of a document that follow a marker line
    `<!-- check_deploy: order NAME -->`, by NAME, as commands (backslash
    continuations joined, comments dropped)."""
    blocks, name, inside, lines = {}, None, False, []
    with open(path) as f:
        for line in f:
            m = re.match(r"<!-- check_deploy: order (\S+) -->", line.strip())
            if m:
                name = m.group(1)
            elif name and line.startswith("```sh"):
                inside, lines = True, []
            elif inside and line.startswith("```"):
                text = "".join(lines).replace("\\\n", " ")
                blocks[name] = [c for c in (ln.split("#", 1)[0].strip() for ln in text.splitlines()) if c]
                inside, name = False, None
            elif inside:
                lines.append(line)
    return blocks


def check_order(scenario, commands, rendered):
    """Applies `commands` (kubectl as the docs write it) to a model of the
    cluster: each object's namespace, and everything its pods name, must
    exist before it is applied or come in the same apply; a Secret's keys
    must include those named. `rendered`: what `apply -k DIR` applies, by
    the directory's last name."""
    state = {}  # (kind, namespace, name) -> set of keys, or None if unknown
    marked = set()  # init-store Jobs waited for until complete: (namespace, name)
    init_jobs = {}  # (namespace, name) of Jobs that run `init-store`

    def require(ns, kind, name, key, where, pending):
        have = pending.get((kind, ns, name), state.get((kind, ns, name), False))
        if have is False:
            err(scenario, f"{where} needs {kind} {ns}/{name}, which does not exist at this step")
        elif key is not None and have is not None and key not in have:
            err(scenario, f"{where} needs key {key} of {kind} {ns}/{name}, which has {sorted(have)}")

    def apply(docs, ns_flag, cmd):
        pending = {}
        for d in docs:
            ns = d["metadata"].get("namespace", ns_flag)
            if d["kind"] == "Namespace":
                pending[("Namespace", None, d["metadata"]["name"])] = None
            else:
                keys = set(d.get("data", {})) | set(d.get("stringData", {})) if d["kind"] in ("Secret", "ConfigMap") else None
                pending[(d["kind"], ns, d["metadata"]["name"])] = keys
        for d in docs:
            if d["kind"] == "Namespace":
                continue
            ns = d["metadata"].get("namespace", ns_flag)
            where = f"`{cmd}`: {d['kind']}/{d['metadata']['name']}"
            require(None, "Namespace", ns, None, where, pending)
            for kind, name, key, field in references(d):
                require(ns, kind, name, key, f"{where} ({field})", pending)
            if d["kind"] == "Job" and any(c.get("args") == ["init-store"]
                                          for c in d["spec"]["template"]["spec"]["containers"]):
                init_jobs[(ns, d["metadata"]["name"])] = True
            # Replicas refuse an unmarked shared store: the init-store Job
            # must have completed (waited for) before they are applied.
            if d["kind"] in ("Deployment", "StatefulSet") and shared_store(d) and not (
                    set(init_jobs) & marked):
                err(scenario, f"{where} runs on a shared store before an init-store Job was waited for"
                              " (`kubectl wait --for=condition=complete job/...`): its replicas would refuse the"
                              " unmarked store")
        state.update(pending)

    for cmd in commands:
        words = shlex.split(cmd)
        if not words or words[0] != "kubectl":
            err(scenario, f"`{cmd}`: not a kubectl command; the order check knows kubectl only")
            continue
        ns, rest, i = "default", [], 1
        while i < len(words):
            if words[i] in ("-n", "--namespace"):
                ns, i = words[i + 1], i + 2
            else:
                rest.append(words[i])
                i += 1
        if rest[:2] == ["create", "namespace"]:
            apply([{"kind": "Namespace", "metadata": {"name": rest[2]}}], ns, cmd)
        elif rest[:1] == ["label"] and rest[1] in ("namespace", "ns"):
            require(None, "Namespace", rest[2], None, f"`{cmd}`", {})
        elif rest[:2] == ["create", "secret"]:
            kind, name = rest[2], rest[3]
            keys = {"tls.crt", "tls.key"} if kind == "tls" else set()
            for w in rest[4:]:
                m = re.match(r"--from-(?:literal|file)=([^=]+)", w)
                if m:
                    keys.add(os.path.basename(m.group(1)))
            apply([{"kind": "Secret", "metadata": {"name": name}, "data": dict.fromkeys(keys)}], ns, cmd)
        elif rest[:2] == ["apply", "-f"]:
            apply(load_docs(rest[2]), ns, cmd)
        elif rest[:2] == ["apply", "-k"]:
            name = os.path.basename(rest[2].rstrip("/"))
            if name not in rendered:
                err(scenario, f"`{cmd}`: {rest[2]} is not an overlay the checks render")
                continue
            apply(rendered[name], ns, cmd)
        elif rest[:1] == ["wait"]:
            if not any(w.startswith("--timeout") for w in rest):
                err(scenario, f"`{cmd}`: kubectl wait without --timeout waits 30 s, then fails; give a timeout")
            for w in rest[1:]:
                if "/" in w and not w.startswith("-"):
                    kind, name = w.split("/", 1)
                    kind = {"job": "Job", "deployment": "Deployment", "statefulset": "StatefulSet", "pod": "Pod"}.get(kind, kind)
                    require(ns, kind, name, None, f"`{cmd}`", {})
                    if kind == "Job" and "--for=condition=complete" in rest:
                        marked.add((ns, name))
        else:
            err(scenario, f"`{cmd}`: the order check does not know this command")


def main():
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "render":
        for directory in sys.argv[3:]:
            with open(os.path.join(out, os.path.basename(directory) + ".yaml"), "w") as f:
                yaml.safe_dump_all(render(directory), f, sort_keys=False)
        return 0
    if mode == "render-plain":
        # The plain-only install the docs describe: the overlay without
        # components/tls (which it must list, or "plain" would be the same).
        for directory in sys.argv[3:]:
            kust = load_docs(os.path.join(directory, "kustomization.yaml"))[0]
            if "../components/tls" not in kust.get("components", []):
                raise SystemExit(f"{directory}: no ../components/tls in its components to leave out")
            with open(os.path.join(out, os.path.basename(directory) + "-plain.yaml"), "w") as f:
                yaml.safe_dump_all(render(directory, skip={"../components/tls"}), f, sort_keys=False)
        return 0
    if mode == "order":
        # The documented install, in the documented order, for each
        # overlay with TLS, and plain only (without the fencegate-tls
        # Secret, which the docs then skip).
        doc, overlays = sys.argv[3], sys.argv[4:]
        blocks = doc_blocks(doc)
        checked = 0
        for name in overlays:
            if "common" not in blocks or name not in blocks:
                err(doc, f"no command blocks marked `check_deploy: order common` and `... order {name}`")
                continue
            for plain in (False, True):
                suffix = "-plain" if plain else ""
                rendered = {o: load_docs(os.path.join(out, o + suffix + ".yaml")) for o in overlays}
                commands = [c for c in blocks["common"] + blocks[name]
                            if not (plain and "fencegate-tls" in c)]
                check_order(f"{doc} ({name}{', plain only' if plain else ''})", commands, rendered)
                checked += len(commands)
        for e in ERRORS:
            print(f"check_deploy: {e}", file=sys.stderr)
        if not ERRORS:
            print(f"install order: {checked} documented commands applied in order, every reference met")
        return 1 if ERRORS else 0
    if mode == "compare":
        def plain(path):
            hashed = re.compile(r"\b(fencegate-config)-[a-z0-9]{10}\b")
            return {(d["kind"], hashed.sub(r"\1", d["metadata"]["name"])):
                    hashed.sub(r"\1", yaml.safe_dump(d, sort_keys=True)) for d in load_docs(path)}
        for name in sys.argv[3:]:
            a = plain(os.path.join(out, name + ".yaml"))
            b = plain(os.path.join(out, "files", name + ".yaml"))
            if set(a) != set(b):
                err(name, f"kubectl kustomize renders {sorted(a)}, the kustomization files {sorted(b)}")
            for k in sorted(set(a) & set(b)):
                if a[k] != b[k]:
                    diff = difflib.unified_diff(a[k].splitlines(), b[k].splitlines(), "kubectl", "files", lineterm="")
                    err(name, f"{k[0]}/{k[1]} renders differently:\n" + "\n".join(diff))
        for e in ERRORS:
            print(f"check_deploy: {e}", file=sys.stderr)
        return 1 if ERRORS else 0
    binary = sys.argv[3]
    overlays = sys.argv[4:]
    uid_gid = dockerfile_user()
    tmp = tempfile.mkdtemp(dir=out)
    have_bin = os.access(binary, os.X_OK)
    if have_bin:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                        "-nodes", "-days", "1", "-subj", "/CN=fencegate", "-keyout", os.path.join(tmp, "tls.key"),
                        "-out", os.path.join(tmp, "tls.crt")], check=True, capture_output=True)
    for name in overlays:
        docs = load_docs(os.path.join(out, name + ".yaml"))
        workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        if len(workloads) != 1:
            err(name, f"{len(workloads)} workloads, expected one")
            continue
        try:
            found = check_workload(name, docs, workloads[0], uid_gid)
        except (KeyError, TypeError, ValueError, IndexError, tomllib.TOMLDecodeError) as e:
            err(name, f"{workloads[0]['kind']}/{workloads[0]['metadata']['name']}: cannot read {type(e).__name__}: {e}")
            continue
        if found and found["config"] is not None and have_bin:
            check_config(name, found, binary, tmp)
    shutil.rmtree(tmp)
    for e in ERRORS:
        print(f"check_deploy: {e}", file=sys.stderr)
    if not ERRORS:
        print(f"cross-checks: {', '.join(overlays)} consistent"
              + ("; fencegate check-config accepts their config" if have_bin else ""))
    return 1 if ERRORS else 0


sys.exit(main())
PY

# 1. Render.
dirs=()
rendered=()
checked=()
for o in "${OVERLAYS[@]}"; do
  dirs+=("$K8S/$o")
  rendered+=("$OUT/$o.yaml" "$OUT/$o-plain.yaml")
  checked+=("$o" "$o-plain")
done
mkdir -p "$OUT/files"
"$PY" "$OUT/check.py" render "$OUT/files" "${dirs[@]}" || fail "rendering the overlays from the kustomization files"
"$PY" "$OUT/check.py" render-plain "$OUT/files" "${dirs[@]}" || fail "rendering the overlays without components/tls"
if command -v "$KUBECTL" >/dev/null; then
  renderer=kubectl
  # Plain only, as the docs say: the overlays without components/tls.
  rm -rf "$OUT/k8s-plain"
  cp -r "$K8S" "$OUT/k8s-plain"
  for o in "${OVERLAYS[@]}"; do
    "$KUBECTL" kustomize "$K8S/$o" >"$OUT/$o.yaml" || fail "kubectl kustomize $K8S/$o"
    sed -i '\|^  - \.\./components/tls$|d' "$OUT/k8s-plain/$o/kustomization.yaml"
    "$KUBECTL" kustomize "$OUT/k8s-plain/$o" >"$OUT/$o-plain.yaml" || fail "kubectl kustomize $o without components/tls"
  done
  # The fallback below renders the same objects (ConfigMap hash suffixes aside).
  "$PY" "$OUT/check.py" compare "$OUT" "${checked[@]}" || fail "the kustomization files render differently without kubectl"
else
  renderer=files
  echo "check_deploy: no kubectl: rendered from the kustomization files; checkov's kustomize framework is skipped" >&2
  cp "$OUT"/files/*.yaml "$OUT"/
fi

# 2. Schemas.
mapfile -t manifests < <(find "$K8S" -name '*.yaml' ! -name kustomization.yaml | sort)
kv=(--strict)
for v in "${K8S_VERSIONS[@]}"; do kv+=(-k "$v"); done
rc=0
"$VENV/bin/kubernetes-validate" "${kv[@]}" "${rendered[@]}" "${manifests[@]}" >"$OUT/kubernetes-validate.log" 2>&1 || rc=$?
unexpected=$(grep -v -e '^INFO ' -e "^WARN .* Couldn't find schema for kind PodMonitor with api version monitoring.coreos.com/v1 " \
  "$OUT/kubernetes-validate.log" || true)
passed=$(grep -c '^INFO .* passed for resource' "$OUT/kubernetes-validate.log" || true)
if ((rc != 0)) || [[ -n $unexpected ]] || ((passed == 0)); then
  printf '%s\n' "$unexpected" >&2
  fail "kubernetes-validate (log: $OUT/kubernetes-validate.log)"
fi
echo "kubernetes-validate: $passed resource validations passed (--strict, Kubernetes ${K8S_VERSIONS[*]}; PodMonitor: cross-checks)"

# 3 and 4. Cross-checks, and fencegate check-config.
if [[ ! -x $BIN ]]; then
  [[ -n ${CI:-} ]] && fail "no fencegate binary at $BIN (build it first, or set FENCEGATE_BIN)"
  echo "check_deploy: no fencegate binary at $BIN: check-config of the ConfigMap skipped" >&2
fi
"$PY" "$OUT/check.py" check "$OUT" "$BIN" "${checked[@]}" || fail "cross-checks"
"$PY" "$OUT/check.py" order "$OUT" docs/gateway.md "${OVERLAYS[@]}" || fail "the documented install order"

# 5. checkov, offline: no API key, no download of external checks, no update check.
export CKV_SKIP_PACKAGE_UPDATE_CHECK=true
unset BC_API_KEY PRISMA_API_URL
ck=("$VENV/bin/checkov" --quiet --compact --skip-download)
if [[ $renderer == kubectl ]]; then
  "${ck[@]}" -d "$K8S" --framework kubernetes kustomize || fail "checkov on $K8S"
else
  "${ck[@]}" -d "$K8S" --framework kubernetes || fail "checkov on $K8S"
  "${ck[@]}" -f "${rendered[@]}" --framework kubernetes || fail "checkov on the rendered overlays"
fi
"${ck[@]}" -f Dockerfile --framework dockerfile || fail "checkov on the Dockerfile"
"$VENV/bin/hadolint" Dockerfile || fail "hadolint on the Dockerfile"
echo "hadolint: Dockerfile clean"

# 6. The image's build context: what the build stage COPYs (and nothing
#    else) must be a package cargo can build. `cargo fetch --locked` parses
#    the manifest with its targets (a declared bench or example whose file
#    the stage does not copy fails here, as it would in `docker build`)
#    and checks the lock file, without compiling.
ctx=$OUT/build-context
mkdir -p "$ctx"
"$PY" - "$ctx" <<'PY' || fail "the Dockerfile's build stage"
import os, shutil, sys
ctx = sys.argv[1]
stage, copied = 0, []
for line in open("Dockerfile"):
    words = line.split()
    if not words or words[0].startswith("#"):
        continue
    if words[0].upper() == "FROM":
        stage += 1
        continue
    if stage == 1 and words[0].upper() == "COPY" and not any(w.startswith("--from") for w in words):
        *srcs, dest = words[1:]
        into_dir = dest.endswith("/") or dest == "." or len(srcs) > 1
        dst = os.path.join(ctx, os.path.normpath(dest))
        for src in srcs:
            if os.path.isdir(src):
                shutil.copytree(src, dst, dirs_exist_ok=True)
            else:
                os.makedirs(dst if into_dir else os.path.dirname(dst), exist_ok=True)
                shutil.copy(src, dst)
            copied.append(src)
if not copied:
    raise SystemExit("Dockerfile: no COPY in the build stage")
print("build context:", " ".join(copied))
PY
(cd "$ctx" && cargo fetch --locked -q) || fail "the Dockerfile's build stage copies $(ls "$ctx" | tr '\n' ' '): cargo cannot read that package (a file Cargo.toml names is not copied?)"
echo "build context: the build stage's files make a package cargo reads"
echo "check_deploy: OK"
