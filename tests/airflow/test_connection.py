"""An Airflow AWS connection as storage options; the hook opens a job's store with them."""

from __future__ import annotations

import json
import os
import uuid
from types import SimpleNamespace

import pytest

from statebackend.airflow.connection import (
    ConnectionConfigError,
    options_from_fields,
    storage_options_from_connection,
)
from statebackend.airflow.hook import CheckpointHook

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_PROFILE")


def conn(login=None, password=None, conn_type="aws", **extra):
    return SimpleNamespace(conn_type=conn_type, login=login, password=password,
                           extra_dejson=extra)


@pytest.mark.parametrize("fields, want", [
    (conn("AK", "SK", aws_session_token="TOK", endpoint_url="http://minio:9000",
          region_name="eu-west-1"),
     {"key": "AK", "secret": "SK", "token": "TOK",
      "client_kwargs": {"endpoint_url": "http://minio:9000", "region_name": "eu-west-1"}}),
    (conn("AK", "SK", service_config={"s3": {"endpoint_url": "http://s3.local"}}),
     {"key": "AK", "secret": "SK", "client_kwargs": {"endpoint_url": "http://s3.local"}}),
    (conn(aws_access_key_id="AK", aws_secret_access_key="SK"), {"key": "AK", "secret": "SK"}),
    (conn(profile_name="team"), {"profile": "team"}),
    (conn(), {}),
])
def test_connection_fields_become_fsspec_options(fields, want):
    assert storage_options_from_connection("c", lambda _id: fields) == want


@pytest.mark.parametrize("fields, message", [
    (conn("AK", None), "has no secret access key"),
    (conn(None, "SK"), "has no access key id"),
    (conn("AK", "SK", conn_type="postgres"), "has type 'postgres'; use an 'aws' connection"),
    (conn("AK", "SK", role_arn="arn:aws:iam::1:role/r", assume_role_method="assume_role_with_saml"),
     "assume_role_method 'assume_role_with_saml' is not supported"),
])
def test_bad_connections_are_one_line_errors_naming_the_connection(fields, message):
    with pytest.raises(ConnectionConfigError) as err:
        storage_options_from_connection("ckpt_s3", lambda _id: fields)
    assert message in str(err.value) and "'ckpt_s3'" in str(err.value)
    assert "\n" not in str(err.value) and "SK" not in str(err.value).replace("ASK", "")


def test_missing_connection_is_named():
    def missing(conn_id):
        raise KeyError(conn_id)

    with pytest.raises(ConnectionConfigError, match="'nope' cannot be read"):
        storage_options_from_connection("nope", missing)
    assert storage_options_from_connection(None, missing) == {}


@pytest.mark.s3
def test_role_assumption_gives_temporary_credentials(s3_server):
    options = options_from_fields("ckpt_s3", "aws", "base-key", "base-secret",
                                  {"endpoint_url": s3_server,
                                   "role_arn": "arn:aws:iam::123456789012:role/ckpt"})
    assert options["key"] != "base-key" and options["token"]  # STS' temporary credentials
    assert options["client_kwargs"] == {"endpoint_url": s3_server}


@pytest.mark.s3
def test_hook_opens_the_store_with_the_connection_not_the_environment(s3_server, monkeypatch,
                                                                     caplog):
    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_S3", json.dumps(
        {"conn_type": "aws", "login": "k", "password": secret,
         "extra": {"endpoint_url": s3_server}}))
    url = f"s3://ckpt-test/{uuid.uuid4().hex}"
    before = dict(os.environ)
    with caplog.at_level("INFO"):
        hook = CheckpointHook("ckpt_s3", storage=url, job="clicks")
        store = hook.get_store()
        store.storage.write_bytes("probe", b"x")
    assert store.storage.read_bytes("probe") == b"x"
    assert hook.test_connection()[0] is True
    assert dict(os.environ) == before  # nothing exported
    assert secret not in caplog.text and secret not in repr(store.storage.options)
    assert "'ckpt_s3'" in caplog.text
    # Without the connection the same storage is unreachable: there is no endpoint.
    ok, message = CheckpointHook(None, storage=url, job="clicks").test_connection()
    assert ok is False and message
