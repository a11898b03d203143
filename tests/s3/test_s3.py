"""Real S3 clients (boto3, the aws CLI, s3cmd) through fencegate to two
S3-compatible servers, each checking every signature: moto (a mock of S3 in
Python) and SeaweedFS (a real object store, `weed mini`), with literal keys,
over plain http and over https to fencegate's TLS listener (fencegate to the
server is plain http either way). Most tests run once per server (ids `moto`
and `seaweedfs`); the few that rely on one server's behaviour say why.

Run by scripts/test: `python -m pytest -q tests/s3` after `cargo build --release`
and `pip install -r .ci/requirements.txt` (which brings moto, `weed` and
`s3cmd`). FENCEGATE_BIN overrides the binary.
"""

import base64
import datetime
import hashlib
import hmac
import http.server
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
import zlib

import boto3
import botocore
import pytest
from botocore.config import Config

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "s3"))
sys.path.insert(0, str(ROOT / "tests"))
import fencegate_token  # noqa: E402
from fencegate_listening import read_listening  # noqa: E402
from process_group import stop_group  # noqa: E402
import throwaway_pki  # noqa: E402

BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
BUCKET = "fence-bucket"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def free_port_with(offset):
    """A free loopback port p with p + offset free too."""
    while True:
        port = free_port()
        if port + offset < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
                return port
            except OSError:
                pass


def wait_port(port, proc, what):
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def backend(request, tmp_path_factory):
    """The S3 server behind fencegate, with signature checking on: `name`,
    `url`, and the `key` and `secret` it accepts. The bucket BUCKET exists
    on seaweedfs (created at its start) but not yet on moto (the `s3`
    fixture creates it through fencegate)."""
    if request.param == "moto":
        yield from moto_backend()
    else:
        yield from seaweedfs_backend(tmp_path_factory.mktemp("seaweedfs"))


# A test that needs seaweedfs's behaviour takes moto out this way, and says
# why where it is used. (The moto-only cases, which need a moto without
# signature checking or nothing but a recording upstream, start their own.)
seaweedfs_only = pytest.mark.parametrize("backend", ["seaweedfs"], indirect=True)


def moto_backend():
    proc, url = start_moto(auth=True)
    try:
        # The three unauthenticated actions create the credentials; from then
        # on moto checks every signature.
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x")
        iam.create_user(UserName="fencegate-test")
        key = iam.create_access_key(UserName="fencegate-test")["AccessKey"]
        iam.put_user_policy(UserName="fencegate-test", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        yield {"name": "moto", "url": url, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        proc.kill()
        proc.wait()


INSTALL = ("install the test requirements: scripts/test does (into a venv), or "
           "`python3 -m pip install -r .ci/requirements.txt`")


def tool(name, install=INSTALL):
    """The path of the command `name` (a PyPI package's script: first where
    pip puts this interpreter's scripts, then $PATH), checked to run; fails
    the test, not skips it, when it is missing."""
    scripts = pathlib.Path(sysconfig.get_path("scripts")) / name
    path = str(scripts) if scripts.exists() else shutil.which(name)
    # (A pyenv shim may outlive its package: it is found but fails.)
    if path is None or subprocess.run([path, "--version" if name == "s3cmd" else "version"],
                                      capture_output=True, timeout=30).returncode != 0:
        pytest.fail(f"`{name}` is missing or does not run: {install}", pytrace=False)
    return path


def seaweedfs_backend(d):
    """`weed mini` (master, volume server, filer, S3 gateway, admin server
    and its maintenance worker in one process) in `d`, every listener on a
    free loopback port (the gRPC ones too: by default each is its http
    port + 10000), WebDAV, the Iceberg and Lance catalogs and telemetry off.
    With AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in its environment it
    makes them its admin identity and checks every signature (anonymous
    requests get 403). It starts in about a second; ready once the bucket
    answers a signed HeadBucket. Stopped with its whole process group:
    SIGTERM, then SIGKILL if it is still there after 10 s."""
    weed = tool("weed")
    key, secret = "fencegate-test", secrets.token_hex(20)
    ports = {name: free_port() for name in [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
        "s3.port", "s3.port.grpc"]}
    # Its maintenance workers reach the admin server's gRPC port at the admin
    # http port + 10000 whatever -admin.port.grpc says (else they retry, and
    # the stop waits ~10 s for them).
    ports["admin.port"] = free_port_with(10000)
    ports["admin.port.grpc"] = ports["admin.port"] + 10000
    args = [weed, "mini", f"-dir={d / 'data'}", f"-bucket={BUCKET}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            # Unix sockets it would put in /tmp (its gRPC ones stay there:
            # their paths are fixed; it removes them when it stops).
            f"-filer.localSocket={d / 'filer.sock'}", f"-s3.localSocket={d / 's3.sock'}",
            *(f"-{name}={port}" for name, port in ports.items())]
    (d / "data").mkdir()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    with open(d / "weed.log", "w") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        direct = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=key,
                              aws_secret_access_key=secret,
                              config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                            connect_timeout=1, read_timeout=5))
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed mini exited: {proc.returncode}\n{(d / 'weed.log').read_text()[-3000:]}")
            try:
                direct.head_bucket(Bucket=BUCKET)
                break
            except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError):
                if time.time() > deadline:
                    raise RuntimeError(f"weed mini: no bucket after 60 s\n{(d / 'weed.log').read_text()[-3000:]}")
                time.sleep(0.1)
        yield {"name": "seaweedfs", "url": url, "key": key, "secret": secret}
    finally:
        stop_group(proc)
        for p in pathlib.Path("/tmp").glob("seaweedfs-*.sock"):
            if any(p.name.endswith(f"-{port}.sock") for port in ports.values()):
                p.unlink(missing_ok=True)


def start_fencegate(upstream, d, tls=None, config=None):
    """Starts fencegate in front of `upstream` as the docs set it up for S3
    (literal keys, refusals as S3 errors), its files in `d`. With `tls`
    (the files of the `tls` fixture) it also listens for https, at
    `https`: https://localhost:PORT, so that clients check the name in the
    certificate too. `config`: routes of a config file instead (the
    upstream is then theirs)."""
    assert os.path.exists(BIN), f"{BIN} missing: run cargo build --release first"
    tls_args = (["--tls-listen", "127.0.0.1:0", "--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"])]
                if tls else [])
    if config is None:
        route_args = ["--upstream", upstream, "--literal-keys", "--key", "path", "--namespace", "s3",
                      "--error-format", "s3"]
    else:
        (d / "routes.toml").write_text(config)
        route_args = ["--config", str(d / "routes.toml")]
    proc = subprocess.Popen(
        [BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--store", str(d / "fences.redb"),
         *route_args, *tls_args],
        stdout=subprocess.PIPE, stderr=open(d / "fencegate.log", "w"),
    )
    fields = read_listening(proc, d / "fencegate.log")
    fg = {"url": "http://" + fields["proxy"], "admin": "http://" + fields["admin"]}
    if tls:
        fg["https"] = "https://localhost:" + fields["tls"].rsplit(":", 1)[1]
    return proc, fg


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A throwaway CA and a server certificate for localhost (see
    throwaway_pki.make)."""
    return throwaway_pki.make(tmp_path_factory.mktemp("tls"))


def start_moto(auth):
    port = free_port()
    env = dict(os.environ)
    if auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_port(port, proc, "moto")
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fencegate(backend, tmp_path_factory, tls):
    proc, fg = start_fencegate(backend["url"], tmp_path_factory.mktemp("fencegate"), tls)
    yield fg
    proc.kill()
    proc.wait()


def client(fencegate, backend, secret=None, url=None, verify=None):
    """A boto3 S3 client of fencegate (at `url` if given, else its plain
    http listener) and the token holder attached to it. `verify`: the CA
    bundle that checks an https server (None: botocore's default)."""
    c = boto3.client(
        "s3", endpoint_url=url or fencegate["url"], region_name="us-east-1", verify=verify,
        aws_access_key_id=backend["key"], aws_secret_access_key=secret or backend["secret"],
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    return c, fencegate_token.attach(c)


def status_of(call):
    try:
        call()
        return 200
    except botocore.exceptions.ClientError as e:
        return e.response["ResponseMetadata"]["HTTPStatusCode"]


@pytest.fixture(scope="module")
def s3(fencegate, backend):
    c, holder = client(fencegate, backend)
    holder.token = 1
    if backend["name"] == "moto":  # (seaweedfs made it at its start)
        c.create_bucket(Bucket=BUCKET)
    return c, holder


def test_the_s3_tools_are_installed():
    # Fails, with what to install, when seaweedfs or s3cmd is missing (the
    # tests that use them then fail the same way: none is skipped).
    tool("weed")
    tool("s3cmd")
    # docs/gateway.md's recipes (tests/docs); Debian's package.
    tool("rclone", "install rclone: scripts/test does (apt-get install rclone)")


def test_put_get_and_a_stale_put_is_refused(s3):
    c, holder = s3
    holder.token = 10
    c.put_object(Bucket=BUCKET, Key="reports/q4.csv", Body=b"v10")
    assert c.get_object(Bucket=BUCKET, Key="reports/q4.csv")["Body"].read() == b"v10"
    holder.token = 9
    assert status_of(lambda: c.put_object(Bucket=BUCKET, Key="reports/q4.csv", Body=b"stale")) == 409
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key="reports/q4.csv")["Body"].read() == b"v10", "stale write applied"
    assert status_of(lambda: c.put_object(Bucket=BUCKET, Key="reports/q4.csv", Body=b"x")) == 428


def error_code(call):
    """The S3 error code a boto3 call got (None: it succeeded)."""
    try:
        call()
        return None
    except botocore.exceptions.ClientError as e:
        return e.response["Error"]["Code"]


def refusal(call):
    """The HTTP status and the parsed `Error` of a boto3 call that must
    fail."""
    with pytest.raises(botocore.exceptions.ClientError) as e:
        call()
    return e.value.response["ResponseMetadata"]["HTTPStatusCode"], e.value.response["Error"]


@seaweedfs_only
def test_boto3_and_the_aws_cli_show_fencegates_code_and_reason(s3, fencegate, backend, tmp_path):
    """S3 SDKs read S3's XML errors: a refusal in problem+json reaches them
    as `(409) Conflict`. Through a route with error_format = "s3" they show
    fencegate's code and reason, and boto3 the key's highest token."""
    c, holder = s3
    holder.token = 500
    c.put_object(Bucket=BUCKET, Key="codes/a.csv", Body=b"v500")
    holder.token = 499
    status, err = refusal(lambda: c.put_object(Bucket=BUCKET, Key="codes/a.csv", Body=b"stale"))
    assert status == 409 and err["Code"] == "StaleFenceToken", err
    assert err["Message"] == "token 499 is lower than the highest token 500 for this key", err
    assert err["HighestToken"] == "500" and err["FenceKey"] == f"s3:/{BUCKET}/codes/a.csv", err
    assert err["Resource"] == f"/{BUCKET}/codes/a.csv", err
    holder.token = None
    assert error_code(lambda: c.put_object(Bucket=BUCKET, Key="codes/a.csv", Body=b"x")) == "MissingFenceToken"
    assert c.get_object(Bucket=BUCKET, Key="codes/a.csv")["Body"].read() == b"v500"
    # A malformed token; the S3 server's own errors pass as they came.
    holder.token = "12x"
    assert error_code(lambda: c.put_object(Bucket=BUCKET, Key="codes/a.csv", Body=b"x")) == "InvalidFenceToken"
    assert error_code(lambda: c.get_object(Bucket=BUCKET, Key="codes/missing")) == "NoSuchKey"
    # A key that does not parse (a dot segment) is refused in S3's form too.
    holder.token = 501
    assert error_code(lambda: c.put_object(Bucket=BUCKET, Key="codes/../x", Body=b"x")) == "InvalidURI"

    aws = aws_cli(backend, tmp_path, "--endpoint-url", fencegate["url"])
    src = tmp_path / "file.txt"
    src.write_text("from the cli")
    r = aws(499, "s3", "cp", str(src), f"s3://{BUCKET}/codes/a.csv")
    assert r.returncode != 0, r.stderr
    assert ("An error occurred (StaleFenceToken) when calling the PutObject operation: "
            "token 499 is lower than the highest token 500 for this key") in r.stderr, r.stderr
    r = subprocess.run(["aws", "--endpoint-url", fencegate["url"], "s3api", "put-object", "--bucket", BUCKET,
                        "--key", "codes/a.csv", "--body", str(src)],
                       env=dict(os.environ, AWS_ACCESS_KEY_ID=backend["key"], AWS_SECRET_ACCESS_KEY=backend["secret"],
                                AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=str(tmp_path / "none"),
                                AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "(MissingFenceToken)" in r.stderr and "X-Fence-Token" in r.stderr, r.stderr


@seaweedfs_only
def test_a_token_never_granted_shows_its_code_in_boto3_and_the_aws_cli(backend, tmp_path):
    """403 on a route that admits only tokens fencegate's lease service
    granted (docs/leases.md): the SDKs show FenceTokenNotGranted."""
    config = (f'[[routes]]\nupstream = "{backend["url"]}"\nkey = "path"\nliteral_keys = true\n'
              'namespace = "s3-granted"\ntokens = "granted"\nerror_format = "s3"\n')
    proc, fg = start_fencegate(None, tmp_path, config=config)
    try:
        c, holder = client(fg, backend)
        holder.token = 7
        status, err = refusal(lambda: c.put_object(Bucket=BUCKET, Key="granted/a.csv", Body=b"forged"))
        assert status == 403 and err["Code"] == "FenceTokenNotGranted", err
        assert "token 7 was never granted for this key" in err["Message"], err
        aws = aws_cli(backend, tmp_path, "--endpoint-url", fg["url"])
        src = tmp_path / "forged.txt"
        src.write_text("forged")
        r = aws(7, "s3", "cp", str(src), f"s3://{BUCKET}/granted/a.csv")
        assert r.returncode != 0 and "(FenceTokenNotGranted)" in r.stderr, r.stderr
        assert error_code(lambda: c.head_object(Bucket=BUCKET, Key="granted/a.csv")) == "404", "a refused write was applied"
    finally:
        proc.kill()
        proc.wait()


def test_signatures_survive_the_proxy_and_are_checked(fencegate, backend):
    # On its own, in a bucket of its own: the same requests through
    # fencegate, signed with the right secret and with a wrong one. The
    # server refusing the wrong ones shows that it checks signatures here; its
    # accepting the right ones shows that each signature still matched the
    # request fencegate forwarded: method, path (with `//`), query string,
    # Host and the signed X-Fence-Token, for writes and reads.
    bucket, key = "fence-signatures", "sig/a//b"
    good, holder = client(fencegate, backend)
    bad, bad_holder = client(fencegate, backend, secret="not-the-secret")
    holder.token = bad_holder.token = 1
    assert error_code(lambda: bad.create_bucket(Bucket=bucket)) == "SignatureDoesNotMatch"
    assert error_code(lambda: good.create_bucket(Bucket=bucket)) is None
    holder.token = bad_holder.token = 50
    assert error_code(lambda: bad.put_object(Bucket=bucket, Key=key, Body=b"bad")) == "SignatureDoesNotMatch"
    assert error_code(lambda: good.put_object(Bucket=bucket, Key=key, Body=b"good")) is None
    holder.token = bad_holder.token = None
    assert error_code(lambda: bad.get_object(Bucket=bucket, Key=key)) == "SignatureDoesNotMatch"
    assert good.get_object(Bucket=bucket, Key=key)["Body"].read() == b"good"
    # (A `/` in a query value fails moto's own signature check even without
    # fencegate, so the prefix has none.)
    assert error_code(lambda: bad.list_objects_v2(Bucket=bucket, Prefix="sig")) == "SignatureDoesNotMatch"
    listed = good.list_objects_v2(Bucket=bucket, Prefix="sig")
    # (seaweedfs stores the object under the path with `//` made `/`: see
    # test_seaweedfs_names_one_object_by_two_paths.)
    assert [o["Key"] for o in listed["Contents"]] == [key if backend["name"] == "moto" else "sig/a/b"]


def test_object_names_with_double_slashes_and_encoded_slashes(s3, backend):
    c, holder = s3
    holder.token = 3
    keys = ["a//b", "x~y-z_.txt", "deep/er/path", "sp ace"]
    # (Keys with '+', '%', non-ASCII or most other punctuation fail moto's
    # own signature check even without fencegate, so only seaweedfs has them:
    # each is percent-encoded in the path, which fencegate forwards as sent
    # and decodes for the fence key.)
    if backend["name"] == "seaweedfs":
        keys += ["plus+sign", "pct%2Fnot-a-slash", "ünï/ключ", "a=b&c;(1)*'", "q?mark#hash",
                 "@:,\"<>{}[]|^`\t"]
    for key in keys:
        c.put_object(Bucket=BUCKET, Key=key, Body=key.encode())
        assert c.get_object(Bucket=BUCKET, Key=key)["Body"].read() == key.encode()
    holder.token = 2
    for key in keys:
        assert status_of(lambda: c.put_object(Bucket=BUCKET, Key=key, Body=b"stale")) == 409, key
        assert c.get_object(Bucket=BUCKET, Key=key)["Body"].read() == key.encode(), f"stale write applied: {key}"


def test_multipart_upload_with_a_stale_part_refused(s3):
    c, holder = s3
    holder.token = 20
    up = c.create_multipart_upload(Bucket=BUCKET, Key="big.bin")["UploadId"]
    part = b"p" * (5 * 1024 * 1024)
    e1 = c.upload_part(Bucket=BUCKET, Key="big.bin", UploadId=up, PartNumber=1, Body=part)["ETag"]
    holder.token = 21  # a new holder takes over the object
    e2 = c.upload_part(Bucket=BUCKET, Key="big.bin", UploadId=up, PartNumber=2, Body=b"tail")["ETag"]
    holder.token = 20  # the old holder wakes up
    assert status_of(lambda: c.upload_part(Bucket=BUCKET, Key="big.bin", UploadId=up, PartNumber=1, Body=b"stale")) == 409
    holder.token = 21
    c.complete_multipart_upload(Bucket=BUCKET, Key="big.bin", UploadId=up, MultipartUpload={
        "Parts": [{"ETag": e1, "PartNumber": 1}, {"ETag": e2, "PartNumber": 2}]})
    body = c.get_object(Bucket=BUCKET, Key="big.bin")["Body"].read()
    assert body == part + b"tail"


def test_copy_and_delete_are_fenced(s3):
    c, holder = s3
    holder.token = 30
    c.put_object(Bucket=BUCKET, Key="src", Body=b"source")
    c.copy_object(Bucket=BUCKET, Key="dst", CopySource={"Bucket": BUCKET, "Key": "src"})
    assert c.get_object(Bucket=BUCKET, Key="dst")["Body"].read() == b"source"
    holder.token = 29
    assert status_of(lambda: c.copy_object(Bucket=BUCKET, Key="dst", CopySource={"Bucket": BUCKET, "Key": "src"})) == 409
    assert status_of(lambda: c.delete_object(Bucket=BUCKET, Key="dst")) == 409
    holder.token = 31
    c.delete_object(Bucket=BUCKET, Key="dst")
    holder.token = None
    assert status_of(lambda: c.get_object(Bucket=BUCKET, Key="dst")) == 404


def test_expect_100_continue_large_put(s3, fencegate, backend):
    # Expect: 100-continue, as botocore sends it with PutObject bodies, on a
    # socket. A current write gets `100 Continue` from fencegate before any
    # byte of its body is sent, then the final 200; a stale one gets the
    # final 409 at once: no `100 Continue`, and its body is never sent.
    c, holder = s3
    body, stale = os.urandom(2 * 1024 * 1024), os.urandom(2 * 1024 * 1024)
    path = f"/{BUCKET}/large"
    with expect_100_put(backend, fencegate["url"], path, 40, body) as sock:
        status_line, _ = first_answer(sock, "no 100 Continue to a current write")
        assert status_line == "HTTP/1.1 100 Continue", f"{status_line!r} instead of 100 Continue"
        sock.sendall(body)
        status_line, headers = read_head(sock)
        while status_line.startswith("HTTP/1.1 1"):  # a client skips further interim answers
            status_line, headers = read_head(sock)
        assert status_line.startswith("HTTP/1.1 200 "), (status_line, read_body(sock, headers))
        read_body(sock, headers)
    with expect_100_put(backend, fencegate["url"], path, 39, stale) as sock:
        status_line, headers = first_answer(sock, "no answer to a stale write until its body is sent")
        assert status_line.startswith("HTTP/1.1 409 "), f"{status_line!r} instead of the final 409"
        assert headers["x-fence-token-highest"] == "40"
        read_body(sock, headers)
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key="large")["Body"].read() == body, "stale write applied"
    # botocore itself, through its own 100-continue handling.
    holder.token = 41
    c.put_object(Bucket=BUCKET, Key="large", Body=stale)
    holder.token = 40
    assert status_of(lambda: c.put_object(Bucket=BUCKET, Key="large", Body=body)) == 409
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key="large")["Body"].read() == stale, "stale write applied"


def first_answer(sock, failure):
    """The status line and headers of the first answer on `sock`, which
    comes without the client sending its body; fails with `failure` if
    none comes within the socket's timeout."""
    try:
        return read_head(sock)
    except TimeoutError:
        pytest.fail(failure)


def expect_100_put(backend, url, path, token, body):
    """A socket to fencegate on which the head of a SigV4-signed PUT of
    `body` with `token` was sent, with `Expect: 100-continue`, and nothing
    of the body yet. Reads on it time out after 10 s."""
    host = url.removeprefix("http://")
    headers, _ = sign_put(backend, host, path, {"content-length": str(len(body)),
                                                "x-amz-content-sha256": hashlib.sha256(body).hexdigest(),
                                                "x-fence-token": str(token)})
    head = f"PUT {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    address, port = host.rsplit(":", 1)
    sock = socket.create_connection((address, int(port)), timeout=10)
    sock.sendall(head.encode() + b"expect: 100-continue\r\n\r\n")
    return sock


def test_presigned_put_with_the_token_header(tmp_path):
    # moto answers 500 to presigned URLs while its signature checking is on,
    # even without fencegate: this case uses a moto without it (and no
    # `backend`). The query string (the signature) is forwarded byte for
    # byte either way; the next test has seaweedfs check it.
    moto_proc, moto_url = start_moto(auth=False)
    fg_proc, fg = start_fencegate(moto_url, tmp_path)
    try:
        presigned_case(fg, {"key": "k", "secret": "s"}, create_bucket=True)
    finally:
        fg_proc.kill()
        moto_proc.kill()


@seaweedfs_only  # (moto: the test above)
def test_presigned_put_with_the_token_header_signature_checked(s3, fencegate, backend):
    presigned_case(fencegate, backend, create_bucket=False)
    # A URL signed with the wrong secret is refused by seaweedfs: it checks
    # the signature in the query string that fencegate forwarded.
    c = boto3.client("s3", endpoint_url=fencegate["url"], region_name="us-east-1", aws_access_key_id=backend["key"],
                     aws_secret_access_key="not-the-secret", config=PRESIGN)
    url = c.generate_presigned_url("put_object", Params={"Bucket": BUCKET, "Key": "presigned"}, ExpiresIn=300)
    req = urllib.request.Request(url, data=b"forged", method="PUT", headers={"X-Fence-Token": "61"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 403
    body = client(fencegate, backend)[0].get_object(Bucket=BUCKET, Key="presigned")["Body"].read()
    assert body == b"presigned v60"


# SigV4 query-string signing (botocore presigns with SigV2 by default, whose
# signature covers Content-Type).
PRESIGN = Config(s3={"addressing_style": "path"}, signature_version="s3v4")


def presigned_case(fg, credentials, create_bucket):
    c = boto3.client("s3", endpoint_url=fg["url"], region_name="us-east-1", aws_access_key_id=credentials["key"],
                     aws_secret_access_key=credentials["secret"], config=PRESIGN)
    holder = fencegate_token.attach(c, token=1)
    if create_bucket:
        c.create_bucket(Bucket=BUCKET)
    holder.token = None
    url = c.generate_presigned_url("put_object", Params={"Bucket": BUCKET, "Key": "presigned"}, ExpiresIn=300)

    def put(token, data):
        req = urllib.request.Request(url, data=data, method="PUT",
                                     headers={"Content-Type": "application/octet-stream"})
        if token is not None:
            req.add_header("X-Fence-Token", str(token))
        try:
            return urllib.request.urlopen(req, timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code

    assert put(60, b"presigned v60") == 200
    assert put(59, b"stale") == 409
    assert put(None, b"none") == 428
    assert c.get_object(Bucket=BUCKET, Key="presigned")["Body"].read() == b"presigned v60"


def aws_cli(backend, tmp_path, *options):
    """Returns aws(token, *args), which runs the aws CLI with `options`
    and the plugin of examples/s3, the token in $FENCEGATE_TOKEN."""
    config = tmp_path / "config"
    config.write_text("[default]\nregion = us-east-1\ns3 =\n    addressing_style = path\n[plugins]\nfencegate = fencegate_token\n")
    env = dict(os.environ, AWS_CONFIG_FILE=str(config), AWS_ACCESS_KEY_ID=backend["key"],
               AWS_SECRET_ACCESS_KEY=backend["secret"], PYTHONPATH=str(ROOT / "examples" / "s3"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))

    def aws(token, *args):
        e = dict(env, FENCEGATE_TOKEN=str(token))
        return subprocess.run(["aws", *options, *args], env=e, capture_output=True, text=True, timeout=60)

    return aws


def test_aws_cli_with_the_plugin(s3, fencegate, backend, tmp_path):
    aws = aws_cli(backend, tmp_path, "--endpoint-url", fencegate["url"])
    src = tmp_path / "file.txt"
    src.write_text("from the cli")
    r = aws(70, "s3", "cp", str(src), f"s3://{BUCKET}/cli.txt")
    assert r.returncode == 0, r.stderr
    r = aws(69, "s3api", "put-object", "--bucket", BUCKET, "--key", "cli.txt", "--body", str(src))
    assert r.returncode != 0 and "(StaleFenceToken)" in r.stderr, r.stderr
    out = tmp_path / "out.txt"
    r = aws(70, "s3", "cp", f"s3://{BUCKET}/cli.txt", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "from the cli"


# aws-chunked (streaming SigV4) uploads. botocore 1.43 sends them only to an
# https endpoint (over http it signs the whole payload and puts the checksum
# in a header), so these requests are built here and sent on a socket.

REGION = "us-east-1"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
AWS_CHUNK = 64 * 1024
FRAMINGS = ["content-length", "transfer-encoding-chunked"]


def crc32_of(data):
    """The CRC32 of `data` as S3 writes it in x-amz-checksum-crc32."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def hmac_sha256(key, msg):
    return hmac.new(key, msg.encode(), hashlib.sha256)


def sign_put(backend, host, path, headers):
    """Signs a PUT with SigV4 in the Authorization header (AWS docs:
    "Signature Calculations for the Authorization Header").

    Every header given is signed, X-Fence-Token included, as
    examples/s3/fencegate_token.py does for boto3. The payload hash is the
    x-amz-content-sha256 value: for a streaming upload it names the scheme
    instead of hashing the body. Returns the headers to send and the seed
    (signing key, date, scope, signature) the chunk signatures chain on.
    """
    amz_date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    scope = f"{amz_date[:8]}/{REGION}/s3/aws4_request"
    signed = {"host": host, "x-amz-date": amz_date, **headers}
    names = sorted(signed)
    canonical = "\n".join(["PUT", path, "", *(f"{n}:{signed[n]}" for n in names), "",
                           ";".join(names), signed["x-amz-content-sha256"]])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + backend["secret"]).encode()
    for part in (amz_date[:8], REGION, "s3", "aws4_request"):
        key = hmac_sha256(key, part).digest()
    signature = hmac_sha256(key, to_sign).hexdigest()
    signed["authorization"] = (f"AWS4-HMAC-SHA256 Credential={backend['key']}/{scope}, "
                               f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return signed, {"key": key, "amz_date": amz_date, "scope": scope, "signature": signature}


def aws_chunked_signed(data, seed):
    r"""Encodes `data` as the body of a STREAMING-AWS4-HMAC-SHA256-PAYLOAD
    upload (AWS docs: "Signature Calculations for the Authorization Header:
    Transferring Payload in Multiple Chunks (Chunked Upload)").

    Each chunk is `hex(size);chunk-signature=SIG\r\n<data>\r\n`, and a chunk
    of size 0 ends the body. SIG is the HMAC, with the request's signing
    key, of

        AWS4-HMAC-SHA256-PAYLOAD\n<amz-date>\n<scope>\n<previous SIG>\n<sha256('')>\n<sha256(data)>

    where the first previous SIG is the seed: the Authorization header's
    signature. Each chunk is so bound to the request and to the chunks
    before it.
    """
    body, previous = [], seed["signature"]
    chunks = [data[i:i + AWS_CHUNK] for i in range(0, len(data), AWS_CHUNK)] + [b""]
    for chunk in chunks:
        to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", seed["amz_date"], seed["scope"], previous,
                             EMPTY_SHA256, hashlib.sha256(chunk).hexdigest()])
        previous = hmac_sha256(seed["key"], to_sign).hexdigest()
        body.append(b"%x;chunk-signature=%s\r\n%s\r\n" % (len(chunk), previous.encode(), chunk))
    return b"".join(body)


def aws_chunked_with_trailer(data, name, value):
    r"""Encodes `data` as the body of a STREAMING-UNSIGNED-PAYLOAD-TRAILER
    upload, as SDKs send flexible checksums over https: chunks
    `hex(size)\r\n<data>\r\n` without signatures, then `0\r\n`, the trailer
    `<name>:<value>\r\n` (named in x-amz-trailer) and `\r\n`."""
    chunks = [data[i:i + AWS_CHUNK] for i in range(0, len(data), AWS_CHUNK)]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + f"0\r\n{name}:{value}\r\n\r\n".encode()


def streaming_put(backend, url, path, token, body_of, content_sha256, decoded_length, framing, extra=None):
    """Signs and sends an aws-chunked PUT through fencegate on a plain
    socket; `body_of(seed)` builds the aws-chunked body. The body is framed
    with Content-Length, or with HTTP chunked encoding in 50,000-byte HTTP
    chunks unrelated to the aws-chunked ones inside. Like botocore's
    PutObject it sends `Expect: 100-continue` and the body only after
    `100 Continue`: fencegate answers a stale write with 409 without reading
    the body and closes the connection, so a client streaming the body
    regardless could fail writing it before it reads the 409.
    Returns (status, lower-cased headers, response body)."""
    host = url.removeprefix("http://")
    headers = {"content-encoding": "aws-chunked", "x-amz-content-sha256": content_sha256,
               "x-amz-decoded-content-length": str(decoded_length), "x-fence-token": str(token), **(extra or {})}
    headers, seed = sign_put(backend, host, path, headers)
    body = body_of(seed)
    if framing == "content-length":
        headers["content-length"] = str(len(body))
    else:
        headers["transfer-encoding"] = "chunked"
        pieces = [body[i:i + 50_000] for i in range(0, len(body), 50_000)] + [b""]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    head = f"PUT {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    address, port = host.rsplit(":", 1)
    with socket.create_connection((address, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"expect: 100-continue\r\n\r\n")
        status, answer_headers = read_response_head(sock)
        if status == 100:
            sock.sendall(body)
            status, answer_headers = read_response_head(sock)
        answer = b""
        while len(answer) < int(answer_headers.get("content-length", 0)):
            data = sock.recv(65536)
            assert data, f"connection closed in a response body: {answer!r}"
            answer += data
    return status, answer_headers, answer


def read_response_head(sock):
    """Reads a response's status line and headers, byte by byte so that
    nothing after them is consumed. Returns (status, lower-cased headers)."""
    status_line, headers = read_head(sock)
    return int(status_line.split()[1]), headers


def read_head(sock):
    """Like read_response_head, but returns the whole status line."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        assert byte, f"connection closed in a response head: {head!r}"
        head += byte
    status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
    return status_line, {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines)}


def read_body(sock, headers):
    """Reads a response body of `content-length` bytes."""
    answer = b""
    while len(answer) < int(headers.get("content-length", 0)):
        data = sock.recv(65536)
        assert data, f"connection closed in a response body: {answer!r}"
        answer += data
    return answer


@pytest.mark.parametrize("framing", FRAMINGS)
def test_aws_chunked_signed_put_and_a_stale_one_refused(s3, fencegate, backend, framing):
    c, holder = s3
    key = f"chunked/signed-{framing}"
    data = os.urandom(5 * AWS_CHUNK + 1234)  # 5 full chunks, a short one, the empty one

    def put(token, payload):
        return streaming_put(backend, fencegate["url"], f"/{BUCKET}/{key}", token,
                             lambda seed: aws_chunked_signed(payload, seed),
                             "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", len(payload), framing)

    status, _, answer = put(80, data)
    assert status == 200, answer
    # The server checked the seed signature (seaweedfs: and every chunk
    # signature) and decoded the aws-chunked body: the object is exactly the
    # payload, so fencegate forwarded the body intact.
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data
    status, _, _ = put(79, os.urandom(len(data)))
    assert status == 409
    assert c.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data, "stale write applied"


def test_aws_chunked_seed_signature_is_checked(s3, fencegate, backend):
    # A streaming upload signed with the wrong secret is refused by the
    # server through fencegate. (moto 5.2 checks only this seed signature,
    # not the chunk signatures: it accepts chunks signed with a wrong key.
    # seaweedfs checks them: the next test; and the recording upstream below
    # shows that fencegate delivers them unchanged.)
    wrong = dict(backend, secret="not-the-secret")
    status, _, answer = streaming_put(wrong, fencegate["url"], f"/{BUCKET}/chunked/seed", 82,
                                      lambda seed: aws_chunked_signed(b"x" * 100, seed),
                                      "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", 100, "content-length")
    assert status == 403 and b"SignatureDoesNotMatch" in answer, answer


@seaweedfs_only  # (moto does not check chunk signatures)
@pytest.mark.parametrize("framing", FRAMINGS)
def test_aws_chunked_chunk_signatures_are_checked(s3, fencegate, backend, framing):
    # The same upload, with the right seed signature, through fencegate:
    # accepted as sent, refused with one chunk signature changed (seaweedfs
    # 4.48 answers that with 500 InternalError) and the object not written.
    c, holder = s3
    data = os.urandom(3 * AWS_CHUNK + 17)

    def put(key, tamper):
        def body_of(seed):
            body = aws_chunked_signed(data, seed)
            if tamper:  # the second chunk's signature, its first hex digit changed
                at = body.index(b"chunk-signature=", body.index(b"chunk-signature=") + 1) + len(b"chunk-signature=")
                body = body[:at] + (b"0" if body[at:at + 1] != b"0" else b"1") + body[at + 1:]
            return body

        return streaming_put(backend, fencegate["url"], f"/{BUCKET}/{key}", 84, body_of,
                             "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", len(data), framing)

    status, _, answer = put(f"chunked/sigs-{framing}", tamper=False)
    assert status == 200, answer
    status, _, answer = put(f"chunked/tampered-{framing}", tamper=True)
    assert status >= 400, answer
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key=f"chunked/sigs-{framing}")["Body"].read() == data
    assert status_of(lambda: c.head_object(Bucket=BUCKET, Key=f"chunked/tampered-{framing}")) == 404


class Recorder(http.server.BaseHTTPRequestHandler):
    """An upstream that keeps the headers and body of each PUT it gets
    (`server.seen`) and answers 200."""

    def do_PUT(self):
        if self.headers.get("Transfer-Encoding") == "chunked":
            body = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
        else:
            body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append((self.headers, body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("framing", FRAMINGS)
def test_aws_chunked_body_reaches_the_upstream_as_sent(tmp_path, framing):
    # moto checks the chunk data but not the chunk signatures, so this case
    # records what fencegate sends upstream: the aws-chunked body, chunk
    # signatures included, and the signed headers arrive exactly as sent.
    recorder = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    recorder.seen = []
    threading.Thread(target=recorder.serve_forever, args=(0.05,), daemon=True).start()
    fg_proc, fg = start_fencegate(f"http://127.0.0.1:{recorder.server_port}", tmp_path)
    sent = {}

    def body_of(seed):
        sent["seed"], sent["body"] = seed, aws_chunked_signed(os.urandom(3 * AWS_CHUNK + 5), seed)
        return sent["body"]

    try:
        credentials = {"key": "AKIDEXAMPLE", "secret": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"}
        status, _, _ = streaming_put(credentials, fg["url"], f"/{BUCKET}/recorded", 1, body_of,
                                     "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", 3 * AWS_CHUNK + 5, framing)
    finally:
        fg_proc.kill()
        fg_proc.wait()
        recorder.shutdown()
    assert status == 200
    [(headers, body)] = recorder.seen
    assert body == sent["body"]
    assert headers["Authorization"].endswith("Signature=" + sent["seed"]["signature"])
    assert headers["X-Amz-Date"] == sent["seed"]["amz_date"]
    assert headers["X-Amz-Content-SHA256"] == "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
    assert headers["Content-Encoding"] == "aws-chunked"
    assert headers["X-Amz-Decoded-Content-Length"] == str(3 * AWS_CHUNK + 5)
    assert headers["X-Fence-Token"] == "1"
    assert headers["Host"] == fg["url"].removeprefix("http://")


@pytest.mark.parametrize("framing", FRAMINGS)
def test_aws_chunked_unsigned_payload_with_a_trailing_checksum(s3, fencegate, backend, framing):
    c, holder = s3
    key = f"chunked/trailer-{framing}"
    data = os.urandom(4 * AWS_CHUNK + 99)
    crc32 = crc32_of(data)

    def put(token, payload, checksum):
        return streaming_put(backend, fencegate["url"], f"/{BUCKET}/{key}", token,
                             lambda seed: aws_chunked_with_trailer(payload, "x-amz-checksum-crc32", checksum),
                             "STREAMING-UNSIGNED-PAYLOAD-TRAILER", len(payload), framing,
                             {"x-amz-trailer": "x-amz-checksum-crc32", "x-amz-sdk-checksum-algorithm": "CRC32"})

    if backend["name"] == "seaweedfs":
        # seaweedfs compares the trailer's checksum with the data: a wrong
        # one (the checksum of other data) is refused, 400 InvalidDigest.
        status, _, answer = put(90, data, crc32_of(b"other data"))
        assert status == 400 and b"InvalidDigest" in answer, answer
    status, headers, answer = put(90, data, crc32)
    assert status == 200, answer
    # The server read the checksum from the trailer at the end of the body
    # (moto keeps it but does not compare it with the data) ...
    assert headers["x-amz-checksum-crc32"] == crc32
    # ... and boto3 checks it against the object it gets back.
    holder.token = None
    got = c.get_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")
    assert got["Body"].read() == data
    assert got["ChecksumCRC32"] == crc32
    other = os.urandom(len(data))
    status, _, _ = put(89, other, crc32_of(other))
    assert status == 409
    assert c.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data, "stale write applied"


# boto3 and the aws CLI over https to fencegate's TLS listener, with their
# default checksum settings.

# What botocore 1.43 sends for PutObject and UploadPart to an https endpoint:
# an aws-chunked body, unsigned, with the CRC32 of the data in a trailer after
# the last chunk, framed with HTTP chunked encoding (and Expect: 100-continue).
AWS_CHUNKED_WITH_TRAILER = {
    "content-encoding": "aws-chunked",
    "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
    "x-amz-trailer": "x-amz-checksum-crc32",
    "transfer-encoding": "chunked",
}


@pytest.fixture(scope="module")
def s3_https(s3, fencegate, backend, tls):
    """A boto3 client of the bucket at fencegate's https address, trusting
    the test CA; `sent` maps each operation to the headers (lower-cased
    names, str values) of its last request as botocore sent it."""
    c, holder = client(fencegate, backend, url=fencegate["https"], verify=str(tls["ca"]))
    sent = {}

    def record(request, event_name, **kwargs):
        sent[event_name.rsplit(".", 1)[1]] = {
            k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}

    c.meta.events.register("before-send.s3.*", record)
    return c, holder, sent


def test_boto3_over_https_put_get_and_a_stale_put_refused(s3_https):
    c, holder, sent = s3_https
    data = os.urandom(3 * AWS_CHUNK + 7)
    holder.token = 100
    c.put_object(Bucket=BUCKET, Key="https/obj", Body=data)
    assert AWS_CHUNKED_WITH_TRAILER.items() <= sent.pop("PutObject").items()
    holder.token = None
    got = c.get_object(Bucket=BUCKET, Key="https/obj", ChecksumMode="ENABLED")
    assert got["Body"].read() == data
    # The server kept the checksum it read from the trailer: the trailer got through.
    assert got["ChecksumCRC32"] == crc32_of(data)
    holder.token = 99
    assert status_of(lambda: c.put_object(Bucket=BUCKET, Key="https/obj", Body=b"stale")) == 409
    assert AWS_CHUNKED_WITH_TRAILER.items() <= sent.pop("PutObject").items()
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key="https/obj")["Body"].read() == data, "stale write applied"


def test_boto3_over_https_multipart_upload_with_a_stale_part_refused(s3_https):
    c, holder, sent = s3_https
    part = os.urandom(2 * AWS_CHUNK + 11)
    holder.token = 110
    up = c.create_multipart_upload(Bucket=BUCKET, Key="https/multipart")["UploadId"]
    etag = c.upload_part(Bucket=BUCKET, Key="https/multipart", UploadId=up, PartNumber=1, Body=part)["ETag"]
    assert AWS_CHUNKED_WITH_TRAILER.items() <= sent.pop("UploadPart").items()
    holder.token = 109
    assert status_of(lambda: c.upload_part(Bucket=BUCKET, Key="https/multipart", UploadId=up,
                                           PartNumber=1, Body=b"stale")) == 409
    holder.token = 110
    c.complete_multipart_upload(Bucket=BUCKET, Key="https/multipart", UploadId=up,
                                MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": 1}]})
    assert c.get_object(Bucket=BUCKET, Key="https/multipart")["Body"].read() == part


def test_boto3_over_https_delete_is_fenced(s3_https):
    c, holder, _ = s3_https
    holder.token = 120
    c.put_object(Bucket=BUCKET, Key="https/delete", Body=b"v120")
    holder.token = 119
    assert status_of(lambda: c.delete_object(Bucket=BUCKET, Key="https/delete")) == 409
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key="https/delete")["Body"].read() == b"v120"
    holder.token = 121
    c.delete_object(Bucket=BUCKET, Key="https/delete")
    holder.token = None
    assert status_of(lambda: c.get_object(Bucket=BUCKET, Key="https/delete")) == 404


def test_a_client_that_does_not_trust_the_ca_is_refused(s3_https, fencegate, backend):
    c, holder, _ = s3_https
    holder.token = 130
    c.put_object(Bucket=BUCKET, Key="https/untrusted", Body=b"v130")
    untrusting, untrusting_holder = client(fencegate, backend, url=fencegate["https"])
    untrusting_holder.token = 131  # newer: fencegate would let this write through
    with pytest.raises(botocore.exceptions.SSLError, match="CERTIFICATE_VERIFY_FAILED"):
        untrusting.put_object(Bucket=BUCKET, Key="https/untrusted", Body=b"v131")
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key="https/untrusted")["Body"].read() == b"v130"


def test_aws_cli_over_https(s3, fencegate, backend, tls, tmp_path):
    aws = aws_cli(backend, tmp_path, "--endpoint-url", fencegate["https"], "--ca-bundle", str(tls["ca"]))
    src, stale, out = tmp_path / "file.txt", tmp_path / "stale.txt", tmp_path / "out.txt"
    src.write_text("from the cli over https")
    stale.write_text("stale")
    r = aws(140, "--debug", "s3", "cp", str(src), f"s3://{BUCKET}/https/cli.txt")
    assert r.returncode == 0, r.stderr
    # --debug logs each request's headers: the CLI's upload was aws-chunked too.
    assert "'X-Amz-Content-SHA256': b'STREAMING-UNSIGNED-PAYLOAD-TRAILER'" in r.stderr
    r = aws(139, "s3", "cp", str(stale), f"s3://{BUCKET}/https/cli.txt")
    assert r.returncode != 0 and "(StaleFenceToken)" in r.stderr, r.stderr
    r = aws(140, "s3", "cp", f"s3://{BUCKET}/https/cli.txt", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "from the cli over https"


# Large objects: a single 64 MiB PutObject (its whole body signed) and the
# aws CLI's multipart upload of the same size (8 MiB parts, several at once,
# each carrying the token).

MIB = 1024 * 1024


def sha256_of(data):
    return hashlib.sha256(data).hexdigest()


def test_a_64_mib_object_put_and_read_back_intact(s3):
    c, holder = s3
    data, stale = os.urandom(64 * MIB), os.urandom(64 * MIB)
    holder.token = 150
    c.put_object(Bucket=BUCKET, Key="big/64mib", Body=data)
    holder.token = None
    got = c.get_object(Bucket=BUCKET, Key="big/64mib")["Body"].read()
    assert (len(got), sha256_of(got)) == (len(data), sha256_of(data))
    holder.token = 149
    assert status_of(lambda: c.put_object(Bucket=BUCKET, Key="big/64mib", Body=stale)) == 409
    holder.token = None
    got = c.get_object(Bucket=BUCKET, Key="big/64mib")["Body"].read()
    assert sha256_of(got) == sha256_of(data), "stale write applied"


def test_aws_cli_multipart_upload_of_64_mib(s3, fencegate, backend, tmp_path):
    aws = aws_cli(backend, tmp_path, "--endpoint-url", fencegate["url"])
    big, stale = tmp_path / "big.bin", tmp_path / "stale.bin"
    big.write_bytes(os.urandom(64 * MIB))
    stale.write_bytes(os.urandom(64 * MIB))
    r = aws(160, "--debug", "s3", "cp", str(big), f"s3://{BUCKET}/big/cli")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("Making request for OperationModel(name=UploadPart)") == 8
    r = aws(159, "s3", "cp", str(stale), f"s3://{BUCKET}/big/cli")
    assert r.returncode != 0 and "(StaleFenceToken)" in r.stderr, r.stderr
    out = tmp_path / "out.bin"
    r = aws(159, "s3", "cp", f"s3://{BUCKET}/big/cli", str(out))  # reads pass with any token
    assert r.returncode == 0, r.stderr
    assert sha256_of(out.read_bytes()) == sha256_of(big.read_bytes()), "stale write applied"


def uploads_of(c, key):
    """The bucket's unfinished multipart uploads of `key` (listed whole:
    moto refuses the signature of a `prefix` with a `/` in it, with or
    without fencegate)."""
    return [u for u in c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) if u["Key"] == key]


def refused_midway(c, holder, key, upload, newer):
    """Runs `upload()` (a tool's multipart upload of `key` with token 300,
    slow enough to be caught midway) on a thread; once its upload shows
    in the bucket, a new holder writes the object with token `newer`.
    Returns the upload's id and what `upload()` returned or raised."""
    outcome = {}

    def run():
        try:
            outcome["result"] = upload()
        except Exception as e:  # the tool's own failure, for the test to read
            outcome["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    uploads = []
    while not uploads:
        assert time.monotonic() < deadline, "the tool's upload never started"
        assert t.is_alive(), f"the upload ended before it was caught midway: {outcome}"
        uploads = uploads_of(c, key)
        time.sleep(0.05)
    holder.token = newer  # a new holder takes the object over
    c.put_object(Bucket=BUCKET, Key=key, Body=b"newer")
    t.join(180)
    assert not t.is_alive(), "the tool's upload did not end"
    return uploads[0]["UploadId"], outcome


def next_holder_cleans_up(c, key, upload_id):
    """The stale abort was refused (the upload is still there); the next
    holder, whose token is the highest, aborts it."""
    assert [u["UploadId"] for u in uploads_of(c, key)] == [upload_id], "the stale abort went through"
    c.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)
    assert uploads_of(c, key) == []
    assert c.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"newer"


# The decision (docs/contract.md, docs/gateway.md): AbortMultipartUpload
# stays fenced. A holder whose token went stale while its upload ran gets
# its next part refused (409); each tool then aborts the upload with the
# same stale token, which is refused too, and the upload's parts stay. The
# next holder, whose token is the highest, aborts it (or a bucket lifecycle
# rule does). Each tool is slowed so that the new holder writes midway.

def test_the_aws_clis_abort_after_a_refused_part_is_left_to_the_next_holder(s3, fencegate, backend, tmp_path):
    c, holder = s3
    config = tmp_path / "config"
    config.write_text("[default]\nregion = us-east-1\ns3 =\n    addressing_style = path\n"
                      "    max_bandwidth = 8MB/s\n    multipart_chunksize = 8MB\n"
                      "[plugins]\nfencegate = fencegate_token\n")
    env = dict(os.environ, AWS_CONFIG_FILE=str(config), AWS_ACCESS_KEY_ID=backend["key"],
               AWS_SECRET_ACCESS_KEY=backend["secret"], PYTHONPATH=str(ROOT / "examples" / "s3"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), FENCEGATE_TOKEN="300")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(48 * MIB))
    key = "abort/cli"
    argv = ["aws", "--endpoint-url", fencegate["url"], "--debug", "s3", "cp", str(big), f"s3://{BUCKET}/{key}"]
    upload_id, outcome = refused_midway(
        c, holder, key, lambda: subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120), 301)
    r = outcome["result"]
    assert r.returncode != 0 and "(StaleFenceToken)" in r.stderr, r.stderr[-3000:]
    assert "OperationModel(name=AbortMultipartUpload)" in r.stderr, "the CLI did not try to abort"
    next_holder_cleans_up(c, key, upload_id)


def test_rclones_abort_after_a_refused_part_is_left_to_the_next_holder(s3, fencegate, backend, tmp_path):
    c, holder = s3
    rclone = tool("rclone", "install rclone: scripts/test does (apt-get install rclone)")
    env = dict(os.environ, RCLONE_CONFIG="/dev/null", RCLONE_CONFIG_FENCED_TYPE="s3",
               RCLONE_CONFIG_FENCED_PROVIDER="Other", RCLONE_CONFIG_FENCED_ENDPOINT=fencegate["url"],
               RCLONE_CONFIG_FENCED_FORCE_PATH_STYLE="true", RCLONE_CONFIG_FENCED_REGION="us-east-1",
               RCLONE_CONFIG_FENCED_ACCESS_KEY_ID=backend["key"],
               RCLONE_CONFIG_FENCED_SECRET_ACCESS_KEY=backend["secret"])
    env.pop("AWS_CA_BUNDLE", None)  # rclone 1.60 cannot load one (docs/gateway.md)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(24 * MIB))
    key = "abort/rclone"
    argv = [rclone, "copyto", str(big), f"fenced:{BUCKET}/{key}", "--header", "X-Fence-Token: 300",
            "--retries", "1", "--low-level-retries", "1", "--s3-upload-cutoff", "5M", "--s3-chunk-size", "5M",
            "--s3-upload-concurrency", "1", "--bwlimit", "4M", "-vv"]
    upload_id, outcome = refused_midway(
        c, holder, key, lambda: subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120), 301)
    r = outcome["result"]
    assert r.returncode != 0 and "StaleFenceToken" in r.stderr, r.stderr[-3000:]
    assert "Cancelling multipart upload" in r.stderr, "rclone did not try to abort: " + r.stderr[-3000:]
    next_holder_cleans_up(c, key, upload_id)


def test_minio_pys_abort_after_a_refused_part_is_left_to_the_next_holder(s3, fencegate, backend):
    from minio.error import S3Error
    from fenced_minio import FencedMinio  # examples/s3, on sys.path above

    c, holder = s3
    m = FencedMinio(fencegate["url"].removeprefix("http://"), access_key=backend["key"],
                    secret_key=backend["secret"], secure=False, region="us-east-1")
    m.token = 300
    data = os.urandom(15 * MIB)

    class Slow:
        """The file minio-py reads its parts from, a second a read."""
        pos = 0

        def read(self, n=-1):
            time.sleep(1)
            chunk = data[self.pos:self.pos + (n if n >= 0 else len(data))]
            self.pos += len(chunk)
            return chunk

    key = "abort/minio"
    upload_id, outcome = refused_midway(
        c, holder, key, lambda: m.put_object(BUCKET, key, Slow(), len(data), part_size=5 * MIB), 301)
    e = outcome.get("error")
    assert isinstance(e, S3Error) and e.code == "StaleFenceToken", outcome
    next_holder_cleans_up(c, key, upload_id)


# s3cmd: another real client, its own SigV4 signer. `--add-header` adds the
# token to the request before it is signed.

def s3cmd_runner(backend, fencegate, tmp_path):
    """Returns s3cmd(token, *args), which runs s3cmd with a config file
    for fencegate's plain listener (path-style: host_bucket without
    %(bucket)s) and `--add-header=X-Fence-Token:token`."""
    s3cmd = tool("s3cmd")
    host = fencegate["url"].removeprefix("http://")
    config = tmp_path / "s3cmd.cfg"
    config.write_text(f"[default]\naccess_key = {backend['key']}\nsecret_key = {backend['secret']}\n"
                      f"host_base = {host}\nhost_bucket = {host}\nuse_https = False\nsignature_v2 = False\n"
                      "bucket_location = us-east-1\n")

    def run(token, *args):
        return subprocess.run([s3cmd, "-c", str(config), f"--add-header=X-Fence-Token:{token}", *args],
                              env=dict(os.environ, HOME=str(tmp_path)), capture_output=True, text=True, timeout=120)

    return run


def test_s3cmd_put_get_and_a_stale_put_refused(s3, fencegate, backend, tmp_path):
    s3cmd = s3cmd_runner(backend, fencegate, tmp_path)
    src, stale, out = tmp_path / "file.txt", tmp_path / "stale.txt", tmp_path / "out.txt"
    src.write_text("from s3cmd")
    stale.write_text("stale from s3cmd")
    r = s3cmd(170, "put", str(src), f"s3://{BUCKET}/s3cmd/file.txt")
    assert r.returncode == 0, r.stderr
    r = s3cmd(169, "put", str(stale), f"s3://{BUCKET}/s3cmd/file.txt")
    assert r.returncode != 0 and "409 (StaleFenceToken)" in r.stderr, (r.returncode, r.stderr)
    r = s3cmd(169, "get", "--force", f"s3://{BUCKET}/s3cmd/file.txt", str(out))  # reads pass with any token
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "from s3cmd", "stale write applied"


def test_s3cmd_large_put_and_a_stale_one_refused(s3, fencegate, backend, tmp_path):
    # s3cmd 2.4 sends `--add-header` headers with a multipart upload's
    # CreateMultipartUpload but not with its UploadPart requests, and it
    # splits files over 15 MiB into parts by default: fencegate refuses
    # those parts (428 MissingFenceToken), so the upload fails and nothing is
    # written. With --disable-multipart the file goes in one PutObject,
    # which carries the token.
    s3cmd = s3cmd_runner(backend, fencegate, tmp_path)
    big, stale, out = tmp_path / "big.bin", tmp_path / "stale.bin", tmp_path / "out.bin"
    big.write_bytes(os.urandom(20 * MIB))
    stale.write_bytes(os.urandom(20 * MIB))
    r = s3cmd(180, "put", str(big), f"s3://{BUCKET}/s3cmd/big.bin")
    assert r.returncode != 0 and "428 (MissingFenceToken)" in r.stderr, (r.returncode, r.stderr)
    # The refusal names the request that lacked the token.
    assert "UploadPart: the write carries no X-Fence-Token header" in r.stderr, r.stderr
    r = s3cmd(180, "get", f"s3://{BUCKET}/s3cmd/big.bin", str(out))
    assert r.returncode != 0 and "does not exist" in r.stderr, "an upload without a token written"
    r = s3cmd(180, "put", "--disable-multipart", str(big), f"s3://{BUCKET}/s3cmd/big.bin")
    assert r.returncode == 0, r.stderr
    r = s3cmd(179, "put", "--disable-multipart", str(stale), f"s3://{BUCKET}/s3cmd/big.bin")
    assert r.returncode != 0 and "409 (StaleFenceToken)" in r.stderr, (r.returncode, r.stderr)
    r = s3cmd(179, "get", "--force", f"s3://{BUCKET}/s3cmd/big.bin", str(out))
    assert r.returncode == 0, r.stderr
    assert sha256_of(out.read_bytes()) == sha256_of(big.read_bytes()), "stale write applied"


@seaweedfs_only  # (moto, like S3, keeps `a//b` and `a/b` apart)
def test_one_object_by_two_paths_is_one_fence(s3):
    # seaweedfs makes every `//` in an object's path `/` (a leading one
    # too: /bucket//x is x), so `alias//obj` and `alias/obj` name one object
    # there. fencegate's literal keys merge runs of `/` (on a strict S3 two
    # objects then share a fence, which is safe): a holder writing
    # `alias//obj` with token 200 stops a stale one writing `alias/obj`.
    # The same for `\` (boto3 sends it as %5C), which seaweedfs reads as `/`.
    c, holder = s3
    holder.token = 200
    c.put_object(Bucket=BUCKET, Key="alias//obj", Body=b"v200")
    holder.token = 199
    stale = [status_of(lambda k=k: c.put_object(Bucket=BUCKET, Key=k, Body=b"stale"))
             for k in ["alias/obj", "alias\\obj", "alias/obj/"]]
    stale_delete = status_of(lambda: c.delete_object(Bucket=BUCKET, Key="alias\\obj"))
    holder.token = None
    assert c.get_object(Bucket=BUCKET, Key="alias//obj")["Body"].read() == b"v200", "stale write applied"
    assert stale == [409, 409, 409]
    assert stale_delete == 409
