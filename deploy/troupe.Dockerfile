# troupe: the one static binary (CGO_ENABLED=0) on an empty image. The same
# image runs every role: `etcd`, `head`, `worker`, `up` (the default command)
# and `healthcheck`.
#
# Build it with scripts/images.sh, which compiles the binary on the host and
# stages the build context in dist/docker/troupe. Every stage of this file is
# FROM scratch and there is no `# syntax=` line, so the engine pulls nothing
# (classic builder, DOCKER_BUILDKIT=0).
#
# Context (made by scripts/images.sh):
#   troupe                  the binary
#   ca-certificates.crt     the host's CA bundle, for https OTLP endpoints
#   rootfs/                 empty directories: /data/etcd, /tmp
FROM scratch

COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
# scratch has no shell to mkdir or chown: the directories come from the
# context, owned by the unprivileged user. A named volume mounted on
# /data/etcd starts as a copy of this directory, ownership included.
COPY --chown=65532:65532 rootfs/ /
COPY troupe /troupe

USER 65532:65532
ENV TMPDIR=/tmp

# The HTTP API of the default command. The other roles listen where their
# flags say (docker-compose.yml: etcd 2379/2380, workers 7000).
EXPOSE 8000

# The default command is the head-serving all-in-one `up`, so the image
# healthcheck probes the head's liveness. Services running another role set
# their own healthcheck (see docker-compose.yml).
HEALTHCHECK --interval=5s --timeout=3s --start-period=20s --retries=3 \
  CMD ["/troupe", "healthcheck", "--timeout", "2s", "http://127.0.0.1:8000/healthz"]

ENTRYPOINT ["/troupe"]
CMD ["up", "--http", "0.0.0.0:8000"]
