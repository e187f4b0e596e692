package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func TestHealthcheckHTTP(t *testing.T) {
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}))
	defer ok.Close()
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(503) }))
	defer bad.Close()
	require.NoError(t, runHealthcheck(context.Background(), []string{ok.URL}, io.Discard))
	err := runHealthcheck(context.Background(), []string{bad.URL}, io.Discard)
	require.ErrorContains(t, err, "503")
}

func TestHealthcheckGRPC(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	defer func() { srv.Stop(); <-done }()

	url := "grpc://" + lis.Addr().String()
	require.NoError(t, runHealthcheck(context.Background(), []string{url}, io.Discard))
	hs.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	err = runHealthcheck(context.Background(), []string{url}, io.Discard)
	assert.ErrorContains(t, err, "NOT_SERVING", "a draining worker is unhealthy")
	err = runHealthcheck(context.Background(), []string{url + "/no.such.Service"}, io.Discard)
	assert.Error(t, err)
}
