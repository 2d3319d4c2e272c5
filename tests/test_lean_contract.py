"""What django_joblock.lean relies on from redis-py, checked against the installed redis-py.

CI runs the suite on the newest supported redis-py and, in its compatibility run, on the
oldest (``.ci/run``), so a redis-py release that changes one of these fails here first, by
name, rather than somewhere in a lock's round trip.
"""

from __future__ import annotations

import time
import types

import pytest
import redis

from django_joblock import lean
from tests import harness

URL = harness.redis_url()


def _pool(**options: object) -> redis.ConnectionPool:
    return redis.ConnectionPool.from_url(URL, **options)


@pytest.mark.parametrize("options", [{}, {"protocol": 3}, {"decode_responses": True}])
def test_a_connection_made_from_the_pools_class_and_arguments_speaks_raw_commands(
    redis_server, options
):
    pool = _pool(**options)
    conn = pool.connection_class(**pool.connection_kwargs)
    assert conn._sock is None, "a new connection is not connected"
    conn.connect()
    assert conn._sock is not None
    conn.send_packed_command([lean.pack(("PING",)), lean.pack(("INCRBY", "contract:n", 2))])
    assert conn.read_response() in (b"PONG", "PONG")
    assert conn.read_response() == 2
    conn.send_packed_command([lean.pack(("HGET",))], check_health=False)  # wrong arity
    with pytest.raises(redis.ResponseError):
        conn.read_response()
    conn.send_packed_command([lean.pack(("GET", "contract:n"))], check_health=False)
    assert conn.read_response() in (b"2", "2"), "an error reply leaves the connection in step"
    conn.disconnect()
    assert conn._sock is None, "disconnect() drops the socket; the next send reconnects"
    conn.send_packed_command([lean.pack(("DEL", "contract:n"))], check_health=False)
    assert conn.read_response() == 1


def test_the_pools_checkout_and_release_work_as_the_lean_path_uses_them(redis_server):
    pool = _pool(max_connections=1)
    stash = lean._Lean()
    conn, own = stash.take(pool)  # a process's first calls borrow the pool's connection
    assert own is False
    conn.send_packed_command([lean.pack(("PING",))], check_health=False)
    assert conn.read_response() in (b"PONG", "PONG")
    stash.give(pool, conn, own)
    again, own = stash.take(pool)
    assert (again, own) == (conn, False), "released to the pool, checked out again"
    stash.give(pool, again, own)
    for _ in range(lean.LEAN_AFTER):
        stash.give(pool, *stash.take(pool))
    made, own = stash.take(pool)
    assert own is True and made is not conn, "then the lean path makes its own connection"
    stash.give(pool, made, own)


def test_a_connection_the_server_closed_is_found_stale_before_sending(redis_server):
    client = redis.Redis.from_url(URL)
    pool = client.connection_pool
    conn = pool.connection_class(**pool.connection_kwargs)
    conn.connect()
    conn.send_packed_command([lean.pack(("CLIENT", "SETNAME", "contract-stale"))])
    assert conn.read_response() in (b"OK", "OK", True)
    assert lean._readable(conn) is False, "an idle, healthy connection has nothing to read"
    assert client.client_kill_filter(_type="normal", skipme=True) >= 1
    killed = False
    for _ in range(50):
        if lean._readable(conn):
            killed = True
            break
        time.sleep(0.02)
    assert killed, "the server's close is seen as readable (EOF)"
    lean.drop_if_stale(conn)
    assert conn._sock is None
    conn.send_packed_command([lean.pack(("PING",))])
    assert conn.read_response() in (b"PONG", "PONG")


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "k", "välue"),
        ("SET", b"k", b"\x00\xff"),
        ("EXPIRE", "k", 30),
        ("INCRBYFLOAT", "k", 1.5),
        ("ZADD", "z", 0.1, "m"),
    ],
)
def test_pack_encodes_like_redis_py(args):
    conn = redis.Connection()
    assert lean.pack(args) == b"".join(conn.pack_command(*args))


@pytest.mark.parametrize("bad", [None, True, object(), ["a"]])
def test_pack_refuses_what_redis_py_would_not_send(bad):
    with pytest.raises(TypeError, match="Cannot send"):
        lean.pack(("SET", "k", bad))


def test_clients_without_a_plain_pool_take_redis_pys_own_path():
    assert lean.usable(redis.Redis.from_url(URL))
    assert not lean.usable(types.SimpleNamespace(connection_pool=object()))
    assert not lean.usable(object())


def _version_reported(conn: object) -> object:
    info = getattr(conn, "driver_info", None)  # redis-py >= 8
    return getattr(info, "lib_version", None) if info is not None else conn.lib_version  # type: ignore[attr-defined]


def test_new_connections_report_the_same_library_version_without_looking_it_up(redis_server):
    pool = _pool()
    made = lean.new_connection(pool, socket_timeout=3.0)
    assert _version_reported(made) == _version_reported(
        pool.connection_class(**pool.connection_kwargs)
    )
    assert made.socket_timeout == 3.0
    made.send_packed_command([lean.pack(("PING",))])
    assert made.read_response() in (b"PONG", "PONG")
