#!/usr/bin/env bash
# A private Docker engine for PSRL's docker-marked tests.
#
#   eval "$(.ci/docker.sh up)"   # installs docker.io + debootstrap if missing, starts dockerd,
#                                # builds psrl-sandbox:latest offline, prints `export DOCKER_HOST=...`
#   .ci/docker.sh down           # removes psrl containers/volumes and stops that dockerd
#
# The engine runs with --bridge=none --iptables=false --ip-masq=false: without them dockerd rewrites
# the host's iptables (MACHINE_NOTES.md). No registry is reachable, so the image is a debootstrap'ed
# bookworm (minbase + python3) imported with `docker import`; the rootfs tarball is cached so a
# second `up` costs seconds. Everything but the final export line goes to stderr.
set -euo pipefail

RUN_DIR=${PSRL_DOCKER_RUN_DIR:-/tmp/psrl-docker}          # socket, pid file, log
DATA_ROOT=${PSRL_DOCKER_DATA_ROOT:-/var/lib/psrl-docker}   # images survive down/up
CACHE_DIR=${PSRL_DOCKER_CACHE:-/var/cache/psrl}
IMAGE=${PSRL_SANDBOX_IMAGE:-psrl-sandbox:latest}
SUITE=bookworm
# The Debian mirror apt is already configured with on this machine (first "main" URI of the sources).
apt_mirror() {
    local uri
    uri=$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | grep -v -- '-security' | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' \
        | awk '{print $1}' | grep -E '/debian/?$' | head -n 1)
    echo "${uri%/}"
}
MIRROR=${PSRL_DEBIAN_MIRROR:-$(apt_mirror)}
SOCK="$RUN_DIR/docker.sock"
HOST="unix://$SOCK"

log() { echo "docker.sh: $*" >&2; }
dock() { docker -H "$HOST" "$@"; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        log "must run as root (it installs packages and starts dockerd)"
        exit 1
    fi
}

install_missing() {
    local pkgs=()
    command -v dockerd >/dev/null 2>&1 || pkgs+=(docker.io)
    command -v debootstrap >/dev/null 2>&1 || pkgs+=(debootstrap)
    if [ ${#pkgs[@]} -gt 0 ]; then
        log "installing ${pkgs[*]}"
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2
    fi
}

engine_answers() { dock version --format '{{.Server.Version}}' >/dev/null 2>&1; }

start_engine() {
    mkdir -p "$RUN_DIR" "$DATA_ROOT"
    if [ -S "$SOCK" ] && engine_answers; then
        log "engine already running at $HOST"
        return
    fi
    rm -f "$SOCK" "$RUN_DIR/dockerd.pid"
    log "starting dockerd (data root $DATA_ROOT, log $RUN_DIR/dockerd.log)"
    # setsid: the engine must not die with this script's shell, and must not get its signals.
    setsid dockerd \
        --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
        --data-root "$DATA_ROOT" --exec-root "$RUN_DIR/exec" \
        --pidfile "$RUN_DIR/dockerd.pid" -H "$HOST" \
        --containerd-namespace psrl --containerd-plugins-namespace psrl-plugins \
        >"$RUN_DIR/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 120); do
        engine_answers && return
        sleep 0.5
    done
    log "dockerd did not answer within 60 s; last log lines:"
    tail -n 30 "$RUN_DIR/dockerd.log" >&2 || true
    exit 1
}

build_image() {
    if dock image inspect "$IMAGE" >/dev/null 2>&1; then
        log "image $IMAGE present"
        return
    fi
    local tarball="$CACHE_DIR/$SUITE-minbase-python3.tar"
    if [ ! -s "$tarball" ]; then
        local root
        root=$(mktemp -d /tmp/psrl-rootfs.XXXXXX)
        log "debootstrap $SUITE into $root (~1 min, cached afterwards in $tarball)"
        debootstrap --variant=minbase --include=python3-minimal "$SUITE" "$root" "$MIRROR" >&2
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        mkdir -p "$CACHE_DIR" "$root/workspace"
        tar -C "$root" -cf "$tarball.part" .
        mv "$tarball.part" "$tarball"
        rm -rf "$root"
    fi
    log "importing $tarball as $IMAGE"
    dock import --change 'CMD ["sleep", "infinity"]' --change 'WORKDIR /workspace' \
        "$tarball" "$IMAGE" >&2
}

remove_psrl_objects() {
    local ids
    ids=$(dock ps -aq --filter label=psrl.sandbox 2>/dev/null || true)
    [ -n "$ids" ] && dock rm -f -v $ids >/dev/null 2>&1 || true
    ids=$(dock volume ls -q --filter label=psrl.sandbox 2>/dev/null || true)
    [ -n "$ids" ] && dock volume rm -f $ids >/dev/null 2>&1 || true
}

stop_engine() {
    local pid
    if [ -S "$SOCK" ] && engine_answers; then
        remove_psrl_objects
    fi
    pid=$(cat "$RUN_DIR/dockerd.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" || true
    fi
    # dockerd starts its own containerd; it goes with dockerd, but a crash can leave it behind.
    pid=$(cat "$RUN_DIR/exec/containerd/containerd.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" || true
    fi
    rm -f "$SOCK"
    log "engine stopped"
}

case "${1:-}" in
    up)
        need_root
        install_missing
        start_engine
        build_image
        echo "export DOCKER_HOST=$HOST"
        ;;
    down)
        stop_engine
        ;;
    host)
        echo "export DOCKER_HOST=$HOST"
        ;;
    *)
        echo "usage: $0 up|down|host" >&2
        exit 2
        ;;
esac
