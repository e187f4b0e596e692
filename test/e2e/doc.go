// Package e2e tests troupe across processes: it builds the troupe binary
// once per test run and starts real `troupe etcd`, `troupe head`,
// `troupe worker` and `troupe up` processes on loopback, each in its own
// process group, killed at cleanup. Only the binary's contracts are used:
// the CLI, the HTTP API, /metrics and the exit codes.
//
// The tests are skipped with -short. TROUPE_E2E_BIN names a prebuilt binary
// to test instead of building one.
package e2e
