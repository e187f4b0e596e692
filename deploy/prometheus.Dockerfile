# Prometheus for the compose profile `monitoring`: Debian's prometheus
# binary, the C libraries it links (it is dynamically linked: libc and the
# loader, nothing else, see scripts/images.sh), and troupe's configuration
# and rules, on an empty image. A copy of the troupe binary is only there for
# the healthcheck: scratch has no shell or curl.
#
# Build it with scripts/images.sh, which stages the build context in
# dist/docker/prometheus. FROM scratch only and no `# syntax=` line: nothing
# is pulled (classic builder, DOCKER_BUILDKIT=0).
#
# Context (made by scripts/images.sh):
#   prometheus              /usr/bin/prometheus of Debian's prometheus package
#   libs/                   the shared libraries `ldd prometheus` lists, at their paths
#   troupe                  the troupe binary (healthcheck only)
#   prometheus.yml          deploy/prometheus/prometheus.yml
#   rules.yml               deploy/prometheus/rules.yml
#   ca-certificates.crt     the host's CA bundle, for heads scraped over https
#   rootfs/                 empty directories: /prometheus (the TSDB), /tmp
FROM scratch

COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY libs/ /
COPY --chown=65532:65532 rootfs/ /
COPY prometheus.yml rules.yml /etc/prometheus/
COPY prometheus /bin/prometheus
COPY troupe /troupe

USER 65532:65532
# The pure-Go resolver: scratch has no NSS modules for glibc's.
ENV TMPDIR=/tmp \
    GODEBUG=netdns=go

EXPOSE 9090

HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
  CMD ["/troupe", "healthcheck", "--timeout", "2s", "http://127.0.0.1:9090/-/ready"]

ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", \
     "--storage.tsdb.path=/prometheus", \
     "--storage.tsdb.retention.time=7d", \
     "--web.listen-address=0.0.0.0:9090", \
     "--enable-feature=exemplar-storage,extra-scrape-metrics"]
