#!/bin/sh
# Entrypoint of both Eyrie images.
#
# 1. An empty EYRIE_* variable means "unset" (its default): compose files write `${EYRIE_DRAFT:-}`, and an
#    empty string is not a valid path, port or number for the settings.
# 2. EYRIE_ADVERTISE_HOST (the address other services dial, recorded in the Redis registry) defaults to
#    this container's own IP address, so every replica started with `docker compose up --scale` registers
#    an address that reaches it, not the service name shared by all replicas.
set -eu

for name in $(env | sed -n 's/^\(EYRIE_[A-Z0-9_]*\)=$/\1/p'); do
    unset "$name"
done

if [ -z "${EYRIE_ADVERTISE_HOST:-}" ]; then
    # /etc/hosts maps the container's hostname to its address on the compose network.
    addr="$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))' 2>/dev/null || true)"
    if [ -n "$addr" ] && [ "${addr#127.}" = "$addr" ]; then
        EYRIE_ADVERTISE_HOST="$addr"
    else
        EYRIE_ADVERTISE_HOST="$(hostname)"
    fi
    export EYRIE_ADVERTISE_HOST
fi

exec "$@"
