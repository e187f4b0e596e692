// Package helm holds the test of troupe's Helm chart (deploy/helm/troupe).
// It is its own Go module, so that Helm's and Kubernetes' libraries stay out
// of troupe's module: `go build ./...` and `go test ./...` at the repository
// root do not see it; scripts/test.sh runs it with
// `(cd deploy/helm && go test ./...)`.
package helm
