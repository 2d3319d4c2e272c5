"""The test harness's throwaway servers (tests/procs/redis_server.py): the suites run side by
side on one machine, so a server must never take another process's server for its own."""

from __future__ import annotations

import pytest

from tests.procs.redis_server import PORTS_GIVEN, RedisServer, RedisServerError, free_port

pytestmark = pytest.mark.slow  # starts servers


def test_a_server_whose_port_another_process_holds_fails_to_start():
    """Regression (CI): another suite's server took the port first; ours could not bind, and
    its start returned anyway because the other server answered the ping."""
    first = RedisServer(free_port())
    first.start()
    try:
        second = RedisServer(first.port)
        with pytest.raises(RedisServerError, match="another process's server answering"):
            second.start()
        assert first.client().ping(), "the first server is untouched"
    finally:
        first.stop()


def test_free_port_gives_no_port_twice_within_its_reservation():
    given = [free_port() for _ in range(50)]
    assert len(set(given)) == len(given)
    assert all((PORTS_GIVEN / str(port)).exists() for port in given), "reserved for others"
