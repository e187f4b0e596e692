#!/usr/bin/env bash
# Builds troupe's container images with one command. Nothing is pulled: the
# binaries are compiled here (static, CGO_ENABLED=0) and copied into images
# that are FROM scratch, built by the classic builder (DOCKER_BUILDKIT=0).
#
#   scripts/images.sh                 # troupe:dev, troupe-prometheus:dev and troupe-haproxy:dev: no Jaeger
#   scripts/images.sh all             # the same and troupe-jaeger:dev
#   scripts/images.sh troupe          # only the troupe image
#   scripts/images.sh jaeger          # only the Jaeger image (compose profile tracing)
#   scripts/images.sh prometheus      # only the Prometheus image (compose profile monitoring)
#   scripts/images.sh haproxy         # only the HAProxy image (compose profile ha)
#   TROUPE_TAG=v1 scripts/images.sh   # tag :v1 instead of :dev
#
# Environment:
#   TROUPE_TAG     the tag of every image (default dev); docker-compose.yml
#                  runs the images of the same TROUPE_TAG
#   TROUPE_JAEGER  1: the default set includes Jaeger too (as `all`)
#   PROMETHEUS_BIN    the Prometheus binary to package (default: `prometheus`
#                  on PATH, from Debian's prometheus package; installed with
#                  apt-get when missing and running as root)
#   HAPROXY_BIN    the HAProxy binary to package (default: /usr/sbin/haproxy
#                  from Debian's haproxy package, installed with apt-get
#                  when missing and running as root)
#   NICE           niceness of the Go builds (default 10: shared machines)
#   JAEGER_BIN     where scripts/build-jaeger.sh puts Jaeger (default bin/jaeger)
#
# Jaeger is built only when asked (`all`, `jaeger`, TROUPE_JAEGER=1): the
# compose stack serves without it, and its first build compiles its whole
# dependency graph (many minutes on two cores, see docs/tracing.md);
# scripts/build-jaeger.sh skips it while bin/jaeger is fresh.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

tag="${TROUPE_TAG:-dev}"
troupe_image="troupe:$tag"
jaeger_image="troupe-jaeger:$tag"
prometheus_image="troupe-prometheus:$tag"
haproxy_image="troupe-haproxy:$tag"
nice_level="${NICE:-10}"
jaeger_bin="${JAEGER_BIN:-$root/bin/jaeger}"
what="${1:-default}"
case "$what" in
  default | all | troupe | jaeger | prometheus | haproxy) ;;
  *)
    echo "usage: scripts/images.sh [all|troupe|jaeger|prometheus|haproxy]" >&2
    exit 2
    ;;
esac
# wants IMAGE: whether this run builds IMAGE.
wants() {
  case "$what" in
    all) return 0 ;;
    default) [ "$1" != jaeger ] || [ "${TROUPE_JAEGER:-0}" = 1 ] ;;
    *) [ "$what" = "$1" ] ;;
  esac
}

log() { echo "images: $*" >&2; }
die() {
  echo "images: $*" >&2
  exit 1
}

command -v docker >/dev/null || die "docker is not installed"
command -v go >/dev/null || die "go is not installed"

# Guard: only FROM scratch and no syntax directive, either of which would make
# the engine reach for a registry.
for f in deploy/troupe.Dockerfile deploy/jaeger.Dockerfile deploy/prometheus.Dockerfile deploy/haproxy.Dockerfile; do
  if grep -qiE '^#[[:space:]]*syntax[[:space:]]*=' "$f"; then
    die "$f has a syntax directive: the engine would pull the frontend image"
  fi
  if grep -iE '^[[:space:]]*FROM[[:space:]]' "$f" | grep -viqE '^[[:space:]]*FROM[[:space:]]+scratch([[:space:]]|$)'; then
    die "$f has a FROM other than scratch: the engine would pull it"
  fi
done

stage="$root/dist/docker"
version="$(git describe --tags --always --dirty 2>/dev/null || echo dev)"

# Puts a file into a build context: a hard link when possible (the Jaeger
# binary is ~85 MB), a copy otherwise.
place() { ln -f "$1" "$2" 2>/dev/null || cp -f "$1" "$2"; }

build_troupe_binary() {
  local out="$stage/troupe.bin"
  mkdir -p "$stage"
  log "building troupe $version (static, CGO_ENABLED=0)"
  CGO_ENABLED=0 nice -n "$nice_level" go build -trimpath \
    -ldflags "-s -w -X main.version=$version" -o "$out.tmp" ./cmd/troupe
  mv "$out.tmp" "$out"
  if command -v readelf >/dev/null && readelf -l "$out" 2>/dev/null | grep -q 'Requesting program interpreter'; then
    die "$out is dynamically linked"
  fi
}

# Makes a context dir with the CA bundle and the empty directories a scratch
# image cannot mkdir itself.
new_context() {
  local ctx="$1"
  shift
  rm -rf "$ctx"
  mkdir -p "$ctx/rootfs"
  if [ -r /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/ca-certificates.crt"
  else
    : >"$ctx/ca-certificates.crt" # no bundle on this host: only private CAs (--tls-ca) work
  fi
  local d
  for d in "$@"; do mkdir -p "$ctx/rootfs/$d"; done
  chmod 1777 "$ctx/rootfs/tmp" 2>/dev/null || true
}

docker_build() {
  local dockerfile="$1" image="$2" ctx="$3"
  log "docker build $image ($dockerfile)"
  local old_id
  old_id="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
  # --pull=false: never look for a newer base (there is none: FROM scratch).
  local out
  # The classic builder warns that it is deprecated; keep its output for errors.
  if ! out=$(DOCKER_BUILDKIT=0 docker build --pull=false -f "$dockerfile" -t "$image" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.source=https://github.com/troupe-serving/troupe" \
    "$ctx" 2>&1); then
    echo "$out" >&2
    die "docker build $image failed"
  fi
  log "built $image ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))"
  # The image this tag named before is now dangling: remove it (and its
  # build layers), unless a container still uses it.
  local now_id
  now_id="$(docker image inspect -f '{{.Id}}' "$image")"
  if [ -n "$old_id" ] && [ "$old_id" != "$now_id" ]; then
    docker rmi "$old_id" >/dev/null 2>&1 || true
  fi
}

# prometheus_binary prints the Prometheus binary to package: $PROMETHEUS_BIN,
# else Debian's (installed when missing and we are root).
prometheus_binary() {
  if [ -n "${PROMETHEUS_BIN:-}" ]; then
    [ -x "$PROMETHEUS_BIN" ] || die "PROMETHEUS_BIN=$PROMETHEUS_BIN is not an executable"
    echo "$PROMETHEUS_BIN"
    return
  fi
  if ! command -v prometheus >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      log "installing prometheus (Debian package)"
      apt-get install -y -qq prometheus >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null && apt-get install -y -qq prometheus >/dev/null; } ||
        die "apt-get install prometheus failed"
    else
      die "prometheus is not installed: apt-get install -y prometheus, or set PROMETHEUS_BIN"
    fi
  fi
  command -v prometheus
}

# haproxy_binary prints the HAProxy binary to package: $HAPROXY_BIN, else
# Debian's (installed when missing and we are root).
haproxy_binary() {
  if [ -n "${HAPROXY_BIN:-}" ]; then
    [ -x "$HAPROXY_BIN" ] || die "HAPROXY_BIN=$HAPROXY_BIN is not an executable"
    echo "$HAPROXY_BIN"
    return
  fi
  if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      log "installing haproxy (Debian package)"
      apt-get install -y -qq haproxy >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null && apt-get install -y -qq haproxy >/dev/null; } ||
        die "apt-get install haproxy failed"
    else
      die "haproxy is not installed: apt-get install -y haproxy, or set HAPROXY_BIN"
    fi
  fi
  if [ -x /usr/sbin/haproxy ]; then echo /usr/sbin/haproxy; else command -v haproxy; fi
}

# copy_libs BINARY DIR: copies the shared libraries BINARY loads (ldd's list,
# the loader included) into DIR under their absolute paths, links resolved.
# Nothing for a static binary.
copy_libs() {
  local bin="$1" dir="$2" out lib
  mkdir -p "$dir"
  if ! out="$(ldd "$bin" 2>&1)"; then
    case "$out" in
      *"not a dynamic executable"* | *"statically linked"*) return ;;
      *) die "ldd $bin: $out" ;;
    esac
  fi
  for lib in $(awk '/=> \// { print $3; next } /^[[:space:]]*\// { print $1 }' <<<"$out"); do
    mkdir -p "$dir$(dirname "$lib")"
    cp -L "$lib" "$dir$lib"
  done
}

start=$SECONDS
build_troupe_binary

if wants troupe; then
  ctx="$stage/troupe"
  new_context "$ctx" data/etcd tmp
  place "$stage/troupe.bin" "$ctx/troupe"
  docker_build deploy/troupe.Dockerfile "$troupe_image" "$ctx"
fi

if wants jaeger; then
  JAEGER_BIN="$jaeger_bin" nice -n "$nice_level" scripts/build-jaeger.sh
  ctx="$stage/jaeger"
  new_context "$ctx" tmp
  place "$jaeger_bin" "$ctx/jaeger"
  place "$stage/troupe.bin" "$ctx/troupe"
  cp tools/jaeger/config.yaml "$ctx/config.yaml"
  docker_build deploy/jaeger.Dockerfile "$jaeger_image" "$ctx"
fi

if wants prometheus; then
  prom_bin="$(prometheus_binary)"
  ctx="$stage/prometheus"
  new_context "$ctx" prometheus tmp
  place "$prom_bin" "$ctx/prometheus"
  copy_libs "$prom_bin" "$ctx/libs"
  place "$stage/troupe.bin" "$ctx/troupe"
  cp deploy/prometheus/prometheus.yml deploy/prometheus/rules.yml "$ctx/"
  log "prometheus: $("$prom_bin" --version 2>&1 | head -n1); libraries: $(cd "$ctx/libs" && find . -type f | sed 's|^\.||' | tr '\n' ' ')"
  docker_build deploy/prometheus.Dockerfile "$prometheus_image" "$ctx"
fi

if wants haproxy; then
  haproxy_bin="$(haproxy_binary)"
  ctx="$stage/haproxy"
  new_context "$ctx" tmp
  place "$haproxy_bin" "$ctx/haproxy"
  copy_libs "$haproxy_bin" "$ctx/libs"
  place "$stage/troupe.bin" "$ctx/troupe"
  cp deploy/haproxy/haproxy.cfg "$ctx/haproxy.cfg"
  log "haproxy: $("$haproxy_bin" -v 2>&1 | head -n1)"
  docker_build deploy/haproxy.Dockerfile "$haproxy_image" "$ctx"
fi

log "done in $((SECONDS - start))s"
