// Package chaos holds the hostile-client chaos case that runs in CI (plain
// `go test ./...`): the attacks of issue 44 through the head's front door,
// on a real head with sim workers in this process, while a normal client
// is served. docs/reliability.md, "What a hostile client costs", has its
// figures.
package chaos
