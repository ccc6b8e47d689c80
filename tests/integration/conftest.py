"""Fixtures the integration tests that need Redis share: one redis-server per module, and a client on a flushed db."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.processes import redis_server


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()
