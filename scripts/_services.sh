# Sourced by scripts/test and .ci/run: make sure what the test suite needs is here and running.
# Each step is a no-op when the thing is already there. Installing needs root (apt-get); without
# root a missing tool is reported with the command that installs it, never silently skipped.

_say() { printf '[setup] %s\n' "$*" >&2; }

_apt_install() {
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        _say "missing: $*; install it with: sudo apt-get install -y $*"
        return 1
    fi
    _say "installing $* (apt-get)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# redis-server: the suite starts its own throwaway servers from this binary (its sentinels
# too: redis-server --sentinel); redis-cli creates the test Redis Cluster.
ensure_redis_server() {
    command -v redis-server >/dev/null 2>&1 || _apt_install redis-server || return 1
    command -v redis-cli >/dev/null 2>&1 || _apt_install redis-tools
}

# The Redis on 6379 that the demo and the benchmarks default to (not needed by the suite).
ensure_redis_running() {
    ensure_redis_server || return 1
    if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
        _say "starting redis-server on 127.0.0.1:6379"
        mkdir -p /var/lib/redis /var/log/redis
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
            --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
    fi
    for _ in $(seq 50); do
        redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    _say "redis-server on 127.0.0.1:6379 does not answer"
    return 1
}

# PostgreSQL on 127.0.0.1:5432: the chaos tests (and DATABASE_URL=postgres://...) need it.
ensure_postgres() {
    if ! command -v pg_isready >/dev/null 2>&1; then
        _apt_install postgresql || return 1
    fi
    if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
        if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
            _say "starting PostgreSQL"
            pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start \
                || _say "pg_ctlcluster could not start PostgreSQL"
        fi
    fi
    for _ in $(seq 50); do
        pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    _say "PostgreSQL on 127.0.0.1:5432 does not answer"
    return 1
}

# Debian's chromium for the browser test (Playwright drives it; it never downloads a browser).
ensure_chromium() {
    local want=${JOBLOCK_CHROMIUM:-/usr/bin/chromium}
    [ -x "$want" ] || command -v "$want" >/dev/null 2>&1 || _apt_install chromium chromium-driver
}

# valgrind, for the benchmark that counts instructions per job (run by tests/test_benchmarks.py).
ensure_valgrind() {
    command -v valgrind >/dev/null 2>&1 || _apt_install valgrind
}
