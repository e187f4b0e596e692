# HAProxy, Debian's build, on an empty image: the load balancer in front of
# several heads (docker-compose.yml, profile ha). scripts/images.sh copies
# the host's /usr/sbin/haproxy (apt-get install haproxy) and the shared
# libraries ldd lists for it, the loader included, into the context. A copy
# of the troupe binary is only there for the healthcheck: scratch has no
# shell or curl.
#
# FROM scratch only and no `# syntax=` line: nothing is pulled (classic
# builder, DOCKER_BUILDKIT=0).
#
# Context (made by scripts/images.sh):
#   haproxy                 /usr/sbin/haproxy
#   libs/                   its shared libraries, under their absolute paths
#   haproxy.cfg             deploy/haproxy/haproxy.cfg
#   troupe                  the troupe binary (healthcheck only)
#   rootfs/                 empty directories: /tmp
FROM scratch

COPY libs/ /
COPY --chown=65532:65532 rootfs/ /
COPY haproxy.cfg /etc/haproxy/haproxy.cfg
COPY haproxy /usr/sbin/haproxy
COPY troupe /troupe

USER 65532:65532
ENV TMPDIR=/tmp

# The API of the heads behind it, and its stats and liveness page.
EXPOSE 8000 8404

HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
  CMD ["/troupe", "healthcheck", "--timeout", "2s", "http://127.0.0.1:8404/healthz"]

# SIGUSR1 is HAProxy's soft stop: it stops accepting and lets open
# connections finish (SIGTERM would cut them).
STOPSIGNAL SIGUSR1
ENTRYPOINT ["/usr/sbin/haproxy"]
CMD ["-db", "-f", "/etc/haproxy/haproxy.cfg"]
