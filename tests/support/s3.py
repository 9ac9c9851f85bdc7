"""A bucket on the tests' S3 server (moto on 127.0.0.1, the `s3_server` fixture), and the
StorageOptions that reach it with the server's dummy credentials."""

from __future__ import annotations

from prefixflow.storage import StorageOptions

CREDENTIALS = {"region": "us-east-1", "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def s3_bucket(endpoint: str, name: str) -> StorageOptions:
    """Create bucket `name` on the S3 server at `endpoint`; the job's storage settings for it."""
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=CREDENTIALS["region"],
        aws_access_key_id=CREDENTIALS["aws_access_key_id"],
        aws_secret_access_key=CREDENTIALS["aws_secret_access_key"],
    ).create_bucket(Bucket=name)
    return StorageOptions(endpoint_url=endpoint, **CREDENTIALS)
