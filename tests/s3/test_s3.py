"""Real S3 clients (boto3, the aws CLI) through fencegate to a real
S3-compatible server (moto, with signature checking on), with literal keys.

Run by .ci/run: `python3 -m pytest -q tests/s3` after `cargo build --release`.
FENCEGATE_BIN overrides the binary.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

import boto3
import botocore
import pytest
from botocore.config import Config

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "s3"))
import fencegate_token  # noqa: E402

BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
BUCKET = "fence-bucket"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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


@pytest.fixture(scope="module")
def moto():
    proc, url = start_moto(auth=True)
    # The three unauthenticated actions create the credentials; from then on
    # moto checks every signature.
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1",
                       aws_access_key_id="x", aws_secret_access_key="x")
    iam.create_user(UserName="fencegate-test")
    key = iam.create_access_key(UserName="fencegate-test")["AccessKey"]
    iam.put_user_policy(UserName="fencegate-test", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    yield {"url": url, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    proc.kill()
    proc.wait()


def start_fencegate(upstream, d):
    assert os.path.exists(BIN), f"{BIN} missing: run cargo build --release first"
    proc = subprocess.Popen(
        [BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--upstream", upstream,
         "--store", str(d / "fences.redb"), "--literal-keys", "--key", "path", "--namespace", "s3"],
        stdout=subprocess.PIPE, stderr=open(d / "fencegate.log", "w"),
    )
    line = proc.stdout.readline().decode()
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    return proc, {"url": "http://" + fields["proxy"], "admin": "http://" + fields["admin"]}


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
def fencegate(moto, tmp_path_factory):
    proc, fg = start_fencegate(moto["url"], tmp_path_factory.mktemp("fencegate"))
    yield fg
    proc.kill()
    proc.wait()


def client(fencegate, moto, secret=None):
    c = boto3.client(
        "s3", endpoint_url=fencegate["url"], region_name="us-east-1",
        aws_access_key_id=moto["key"], aws_secret_access_key=secret or moto["secret"],
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
def s3(fencegate, moto):
    c, holder = client(fencegate, moto)
    holder.token = 1
    c.create_bucket(Bucket=BUCKET)
    return c, holder


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


def test_signatures_survive_the_proxy_and_are_checked(fencegate, moto):
    # moto rejects a wrong signature: so the accepted requests above were
    # verified after passing through fencegate byte for byte.
    bad, holder = client(fencegate, moto, secret="not-the-secret")
    holder.token = 50
    assert status_of(lambda: bad.put_object(Bucket=BUCKET, Key="sig", Body=b"x")) == 403


def test_object_names_with_double_slashes_and_encoded_slashes(s3):
    c, holder = s3
    holder.token = 3
    # (Keys with an encoded slash, '+' or non-ASCII fail moto's own signature
    # check even without fencegate, so they are not covered here.)
    for key in ["a//b", "x~y-z_.txt", "deep/er/path"]:
        c.put_object(Bucket=BUCKET, Key=key, Body=key.encode())
        assert c.get_object(Bucket=BUCKET, Key=key)["Body"].read() == key.encode()
    holder.token = 2
    assert status_of(lambda: c.put_object(Bucket=BUCKET, Key="a//b", Body=b"stale")) == 409


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


def test_expect_100_continue_large_put(s3):
    # botocore sends Expect: 100-continue with PutObject bodies; a stale
    # one is refused before the body, a current one goes through.
    c, holder = s3
    body = b"z" * (2 * 1024 * 1024)
    holder.token = 40
    c.put_object(Bucket=BUCKET, Key="large", Body=body)
    holder.token = 39
    assert status_of(lambda: c.put_object(Bucket=BUCKET, Key="large", Body=body)) == 409
    holder.token = None
    assert len(c.get_object(Bucket=BUCKET, Key="large")["Body"].read()) == len(body)


def test_presigned_put_with_the_token_header(tmp_path):
    # moto answers 500 to presigned URLs while its signature checking is on,
    # even without fencegate: this case uses a moto without it. The query
    # string (the signature) is forwarded byte for byte either way.
    moto_proc, moto_url = start_moto(auth=False)
    fg_proc, fg = start_fencegate(moto_url, tmp_path)
    try:
        presigned_case(fg)
    finally:
        fg_proc.kill()
        moto_proc.kill()


def presigned_case(fg):
    c = boto3.client("s3", endpoint_url=fg["url"], region_name="us-east-1", aws_access_key_id="k",
                     aws_secret_access_key="s", config=Config(s3={"addressing_style": "path"}))
    holder = fencegate_token.attach(c, token=1)
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


def test_aws_cli_with_the_plugin(s3, fencegate, moto, tmp_path):
    config = tmp_path / "config"
    config.write_text("[default]\nregion = us-east-1\ns3 =\n    addressing_style = path\n[plugins]\nfencegate = fencegate_token\n")
    src = tmp_path / "file.txt"
    src.write_text("from the cli")
    env = dict(os.environ, AWS_CONFIG_FILE=str(config), AWS_ACCESS_KEY_ID=moto["key"],
               AWS_SECRET_ACCESS_KEY=moto["secret"], PYTHONPATH=str(ROOT / "examples" / "s3"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))

    def aws(token, *args):
        e = dict(env, FENCEGATE_TOKEN=str(token))
        return subprocess.run(["aws", "--endpoint-url", fencegate["url"], *args], env=e,
                              capture_output=True, text=True, timeout=60)

    r = aws(70, "s3", "cp", str(src), f"s3://{BUCKET}/cli.txt")
    assert r.returncode == 0, r.stderr
    r = aws(69, "s3api", "put-object", "--bucket", BUCKET, "--key", "cli.txt", "--body", str(src))
    assert r.returncode != 0 and "409" in r.stderr, r.stderr
    out = tmp_path / "out.txt"
    r = aws(70, "s3", "cp", f"s3://{BUCKET}/cli.txt", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "from the cli"
