"""A MinIO Python SDK client (minio-py) that sends `X-Fence-Token` with
every request that is not a read.

minio-py has no hook for extra headers on every request: `put_object`'s
`metadata={"X-Fence-Token": ...}` goes out as `X-Amz-Meta-X-Fence-Token`
(fencegate answers 428), and multipart parts, completion and abort take no
headers at all. This subclass adds the header before minio-py signs each
request, so an upload's every step carries it:

    from fenced_minio import FencedMinio
    client = FencedMinio("fencegate:8080", access_key="...", secret_key="...", secure=False)
    client.token = lock.token          # after each lock grant
    client.fput_object("reports", "q4.csv", "report.csv")

It overrides minio-py's internal `_url_open`, the one method every request
goes through; tested with minio 7.2.20 (docs/gateway.md), check it when
upgrading.
"""

from minio import Minio

READS = ("GET", "HEAD")


class FencedMinio(Minio):
    token = None  # the fencing token of the current lock grant

    def _url_open(self, method, region, bucket_name=None, object_name=None, body=None,
                  headers=None, query_params=None, preload_content=True, no_body_trace=False):
        if self.token is not None and method not in READS:
            headers = dict(headers or {})
            headers["X-Fence-Token"] = str(self.token)
        return super()._url_open(method, region, bucket_name=bucket_name, object_name=object_name,
                                 body=body, headers=headers, query_params=query_params,
                                 preload_content=preload_content, no_body_trace=no_body_trace)
