# Jaeger v2 all-in-one (OTLP in, memory storage, query API on 16686), built
# from the Go module pinned in tools/jaeger as a static binary by
# scripts/build-jaeger.sh, on an empty image. A copy of the troupe binary is
# only there for the healthcheck: scratch has no shell or curl.
#
# Build it with scripts/images.sh, which stages the build context in
# dist/docker/jaeger. FROM scratch only and no `# syntax=` line: nothing is
# pulled (classic builder, DOCKER_BUILDKIT=0).
#
# Context (made by scripts/images.sh):
#   jaeger                  bin/jaeger
#   troupe                  the troupe binary (healthcheck only)
#   config.yaml             tools/jaeger/config.yaml
#   ca-certificates.crt     the host's CA bundle
#   rootfs/                 empty directories: /tmp
FROM scratch

COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --chown=65532:65532 rootfs/ /
COPY config.yaml /etc/jaeger/config.yaml
# The big, rarely changing binary first, so a troupe rebuild reuses its layer.
COPY jaeger /jaeger
COPY troupe /troupe

USER 65532:65532
ENV TMPDIR=/tmp \
    JAEGER_LISTEN_HOST=0.0.0.0

# OTLP gRPC and HTTP, query HTTP (API and UI) and gRPC, health (GET /status).
EXPOSE 4317 4318 16686 16685 13133

HEALTHCHECK --interval=5s --timeout=3s --start-period=20s --retries=3 \
  CMD ["/troupe", "healthcheck", "--timeout", "2s", "http://127.0.0.1:13133/status"]

ENTRYPOINT ["/jaeger"]
CMD ["--config", "/etc/jaeger/config.yaml"]
