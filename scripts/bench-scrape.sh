#!/usr/bin/env bash
# A real Prometheus scrapes 1,000 replicas (docs/benchmarks.md, "Scrapes at
# 1,000 replicas"). On loopback only:
#
#   - test/bench/scrape1000 serve: the head's real /metrics handler, wired as
#     troupe head wires it, for a stats Logger with REPLICAS replicas over
#     three stages, recording into every replica every second (so every
#     series and exemplar changes between scrapes);
#   - Debian's prometheus (installed here if missing), with a throw-away
#     config and TSDB, scraping it every 2 s, exemplar storage and the extra
#     scrape metrics on;
#
# then test/bench/scrape1000 report waits for SCRAPES scrapes and prints what
# Prometheus measured and stored: scrape_duration_seconds (last, mean, max),
# scrape_samples_scraped, scrape_body_size_bytes, series counts and the TTFT
# exemplars. It fails if the target is not up or a check fails.
#
#   scripts/bench-scrape.sh                 # about 30 s after the build
#   REPLICAS=2000 SCRAPES=10 scripts/bench-scrape.sh
set -euo pipefail
cd "$(dirname "$0")/.."

REPLICAS=${REPLICAS:-1000}
SCRAPES=${SCRAPES:-5}
PORT=${PORT:-18500} # PORT (target) and PORT+1 (Prometheus) on 127.0.0.1

if ! command -v prometheus >/dev/null; then
	echo "installing prometheus (Debian package)..." >&2
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi

tmp=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT

# SCRAPE1000: a prebuilt target, such as one built from another revision to
# compare with.
if [ -n "${SCRAPE1000:-}" ]; then
	cp "$SCRAPE1000" "$tmp/scrape1000"
else
	go build -o "$tmp/scrape1000" ./test/bench/scrape1000
fi

target=127.0.0.1:$PORT
prom=127.0.0.1:$((PORT + 1))
"$tmp/scrape1000" serve -listen "$target" -replicas "$REPLICAS" >"$tmp/target.log" 2>&1 &
pids+=($!)

cat >"$tmp/prometheus.yml" <<YAML
global:
  scrape_interval: 2s
  scrape_timeout: 2s
scrape_configs:
  - job_name: troupe
    static_configs:
      - targets: ["$target"]
YAML
prometheus --version 2>&1 | head -1
prometheus \
	--config.file="$tmp/prometheus.yml" \
	--storage.tsdb.path="$tmp/tsdb" \
	--web.listen-address="$prom" \
	--enable-feature=exemplar-storage,extra-scrape-metrics \
	>"$tmp/prometheus.log" 2>&1 &
pids+=($!)

if ! timeout 120 "$tmp/scrape1000" report -prometheus "http://$prom" -scrapes "$SCRAPES" -replicas "$REPLICAS" -timeout 100s; then
	echo "--- target log" >&2; tail -20 "$tmp/target.log" >&2
	echo "--- prometheus log" >&2; tail -20 "$tmp/prometheus.log" >&2
	exit 1
fi
