#!/usr/bin/env bash
# The head's cost per request against nginx (docs/benchmarks.md, "Against
# nginx"). One run, on loopback only:
#
#   - nginx (Debian's package; installed here if missing) as a reverse proxy
#     (keep-alive upstream, no buffering) in front of a minimal
#     OpenAI-compatible backend (test/bench/vsnginx backend: a fixed 16-token
#     answer, streamed one SSE event per token, or whole; for audio, one of
#     troupe's own audio answers captured at the start, so both proxies move
#     the same bytes);
#   - troupe's processes: troupe etcd, troupe head with the three-stage
#     pipeline (thinker -> talker -> vocoder), one sim worker per stage at
#     zero delay; text requests run the thinker alone, audio ones all three;
#
# and the same client (test/bench/vsnginx load: C concurrent keep-alive
# clients, 16 tokens with ignore_eos) loads each in turn, alternating,
# ROUNDS times per mode (MODES, default all of non-stream, stream, audio:
# text and a WAV, not streamed). It prints req/s, p50/p99 and the proxy's
# CPU per request (utime+stime from /proc: nginx's workers summed, the head
# process), and the troupe/nginx ratios (with BASELINE, baseline's too).
#
#   scripts/bench-vs-nginx.sh                # about 3 minutes
#   DURATION=4s ROUNDS=1 scripts/bench-vs-nginx.sh
#   BASELINE=main scripts/bench-vs-nginx.sh  # also a head built from a git rev
#   WORKER_FLAGS="--decode-latency 5ms --prefill-tps 5000" scripts/bench-vs-nginx.sh
#
# BASELINE (a git revision) adds a second head, built from that revision,
# on the same etcd and worker, loaded in the same alternation (target
# "baseline"): before/after figures of one run on one machine.
# WORKER_FLAGS go to every troupe worker (the sim's pace); the nginx
# backend answers at once whatever they say, so compare troupe with
# baseline then, not with nginx.
# Both proxies log every request (nginx's default access log to a file,
# the head's request log to stderr, redirected to a file).
set -euo pipefail
cd "$(dirname "$0")/.."

C=${C:-32}
DURATION=${DURATION:-8s}
ROUNDS=${ROUNDS:-2}
MODES=${MODES:-"non-stream stream audio"}
PORT=${PORT:-18400} # PORT..PORT+5 on 127.0.0.1
BASELINE=${BASELINE:-}
WORKER_FLAGS=${WORKER_FLAGS:-} # e.g. "--decode-latency 5ms --prefill-tps 5000"

if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
	echo "installing nginx (Debian package)..." >&2
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

tmp=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT

go build -o "$tmp/troupe" ./cmd/troupe
go build -o "$tmp/vsnginx" ./test/bench/vsnginx
if [ -n "$BASELINE" ]; then
	git worktree add -q --detach "$tmp/baseline-src" "$BASELINE"
	(cd "$tmp/baseline-src" && go build -o "$tmp/troupe-baseline" ./cmd/troupe)
	git worktree remove --force "$tmp/baseline-src"
fi

backend=127.0.0.1:$PORT
nginx_addr=127.0.0.1:$((PORT + 1))
etcd=http://127.0.0.1:$((PORT + 2)) # its peer port is PORT+3
head=127.0.0.1:$((PORT + 4))
baseline_head=127.0.0.1:$((PORT + 5))

wait_http() { # URL: until it answers 200, at most 30 s
	for _ in $(seq 300); do
		if [ "$(curl -s -o /dev/null -w '%{http_code}' "$1" || true)" = 200 ]; then return 0; fi
		sleep 0.1
	done
	echo "no answer from $1" >&2
	return 1
}


mkdir -p "$tmp/nginx"
cat >"$tmp/nginx/nginx.conf" <<CONF
worker_processes auto;
pid $tmp/nginx/nginx.pid;
error_log $tmp/nginx/error.log warn;
events { worker_connections 1024; }
http {
	access_log $tmp/nginx/access.log;
	client_body_temp_path $tmp/nginx/body;
	proxy_temp_path $tmp/nginx/proxy;
	fastcgi_temp_path $tmp/nginx/fastcgi;
	uwsgi_temp_path $tmp/nginx/uwsgi;
	scgi_temp_path $tmp/nginx/scgi;
	upstream backend { server $backend; keepalive 64; }
	server {
		listen $nginx_addr;
		location / {
			proxy_pass http://backend;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_buffering off;
		}
	}
}
CONF
"$NGINX" -p "$tmp/nginx" -c "$tmp/nginx/nginx.conf" -g 'daemon off;' 2>"$tmp/nginx/stderr" &
nginx_master=$!
pids+=("$nginx_master")

"$tmp/troupe" etcd --data-dir "$tmp/etcd" --listen-client-urls "$etcd" >"$tmp/etcd.log" 2>&1 &
pids+=($!)
printf 'model: troupe-omni-sim\nstages:\n  - name: thinker\n  - name: talker\n  - name: vocoder\n' >"$tmp/pipeline.yaml"
for stage in thinker talker vocoder; do
	"$tmp/troupe" worker --etcd-endpoints "$etcd" --stage "$stage" --listen 127.0.0.1:0 $WORKER_FLAGS >"$tmp/worker-$stage.log" 2>&1 &
	pids+=($!)
done
"$tmp/troupe" head --etcd-endpoints "$etcd" --pipeline "$tmp/pipeline.yaml" --http "$head" >"$tmp/head.log" 2>&1 &
head_pid=$!
pids+=("$head_pid")

wait_http "http://$head/readyz"
if [ -n "$BASELINE" ]; then
	"$tmp/troupe-baseline" head --etcd-endpoints "$etcd" --pipeline "$tmp/pipeline.yaml" --http "$baseline_head" >"$tmp/baseline-head.log" 2>&1 &
	baseline_pid=$!
	pids+=("$baseline_pid")
	wait_http "http://$baseline_head/readyz"
fi
# The backend's audio answer is one of the head's own: the same bytes.
curl -sf "http://$head/v1/chat/completions" -H 'Content-Type: application/json' \
	-d '{"model":"troupe-omni-sim","max_tokens":16,"ignore_eos":true,"modalities":["text","audio"],"audio":{"format":"wav"},"messages":[{"role":"user","content":"tell me a story about a fox"}]}' \
	>"$tmp/audio-answer.json"
"$tmp/vsnginx" backend -listen "$backend" -audio-body "$tmp/audio-answer.json" &
pids+=($!)
for _ in $(seq 300); do # the backend
	if [ "$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://$backend/v1/chat/completions" -d '{}' || true)" = 200 ]; then break; fi
	sleep 0.1
done
for _ in $(seq 100); do # nginx's workers
	workers=$(pgrep -P "$nginx_master" | paste -sd, -)
	[ -n "$workers" ] && break
	sleep 0.1
done

echo "nginx workers: $workers; troupe head: $head_pid; $C clients, $DURATION per run, $ROUNDS rounds" >&2
: >"$tmp/runs.jsonl"
for mode in $MODES; do
	case $mode in
	non-stream) flag="" ;;
	stream) flag=-stream ;;
	audio) flag=-audio ;;
	stream-audio) flag="-stream -audio" ;;
	*) echo "unknown mode $mode (non-stream, stream, audio, stream-audio)" >&2; exit 2 ;;
	esac
	for r in $(seq "$ROUNDS"); do
		if [ "$mode" != stream-audio ]; then # the backend has no streamed audio: troupe against baseline only
			"$tmp/vsnginx" load -target nginx -url "http://$nginx_addr" -c "$C" -d "$DURATION" -pids "$workers" $flag | tee -a "$tmp/runs.jsonl" >&2
		fi
		"$tmp/vsnginx" load -target troupe -url "http://$head" -c "$C" -d "$DURATION" -pids "$head_pid" $flag | tee -a "$tmp/runs.jsonl" >&2
		if [ -n "$BASELINE" ]; then
			"$tmp/vsnginx" load -target baseline -url "http://$baseline_head" -c "$C" -d "$DURATION" -pids "$baseline_pid" $flag | tee -a "$tmp/runs.jsonl" >&2
		fi
	done
done
"$tmp/vsnginx" report <"$tmp/runs.jsonl"
