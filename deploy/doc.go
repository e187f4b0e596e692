// Package deploy holds no code: the directory holds the deployment files
// (Dockerfiles, deploy/prometheus's configuration, rules and their unit
// tests, deploy/grafana's dashboard). Its tests check them: the dashboard's
// shape, that every PromQL expression parses, that every metric and label
// they select is one a real head exposes, that the head's /metrics passes
// `promtool check metrics`, and that docs/observability.md covers every
// alert.
package deploy
