"""The Host header names a loopback-only server (the HTTP API, the metrics server) answers to."""

from __future__ import annotations

import pytest

from rollout.service.loopback_hosts import is_loopback_host


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]", "[::1]:80", "::1", b"localhost:9"]
)
def test_loopback_names_are_answered(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize(
    "host",
    ["", "evil.com", "127.0.0.1.evil.com", "localhost:80@evil.com", "[::1]evil.com", "localhost:abc", "localhost/x"],
)
def test_other_names_are_not(host):
    assert not is_loopback_host(host)
