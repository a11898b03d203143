"""Send a fencing token with every S3 request boto3 or the aws CLI makes.

boto3:
    import fencegate_token
    s3 = boto3.client("s3", endpoint_url="http://fencegate:8080", ...)
    holder = fencegate_token.attach(s3)   # registers the hook
    holder.token = lock.token             # set after each lock grant

aws CLI (v1, from PyPI): put this directory on PYTHONPATH and add to the
config file
    [plugins]
    fencegate = fencegate_token
then every `aws s3` / `aws s3api` call sends $FENCEGATE_TOKEN.

The header is added before signing, so it is signed like the others;
fencegate forwards it unchanged, which keeps SigV4 valid.
"""

import os


class TokenHolder:
    """The token of the current lock grant (None: send no token)."""

    def __init__(self, token=None):
        self.token = token

    def add_header(self, request, **kwargs):
        if self.token is not None:
            request.headers["X-Fence-Token"] = str(self.token)


def attach(client, token=None):
    """Registers the hook on a boto3 S3 client; returns the holder."""
    holder = TokenHolder(token)
    client.meta.events.register("before-sign.s3.*", holder.add_header)
    return holder


def _from_env(request, **kwargs):
    token = os.environ.get("FENCEGATE_TOKEN")
    if token:
        request.headers["X-Fence-Token"] = token


def awscli_initialize(cli):
    """aws CLI plugin entry point."""
    cli.register("before-sign.s3.*", _from_env)
