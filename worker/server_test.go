package worker_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/clusterauth"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tlsconfig"
	"github.com/troupe-serving/troupe/pkg/tlsconfig/tlsconfigtest"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

func TestGenerateOverGRPC(t *testing.T) {
	for _, c := range []struct {
		stage string
		req   *stagepb.GenerateRequest
	}{
		{"thinker", textReq("hello over the wire", &stagepb.SamplingParams{Seed: proto.Int64(9)})},
		{"talker", textReq("say this out loud", nil)},
		{"vocoder", &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{5, 6, 7}}}}},
	} {
		t.Run(c.stage, func(t *testing.T) {
			role := sim.RoleForStage(c.stage)
			r := start(t, worker.Config{Stage: c.stage, Engine: newSim(t, sim.Config{Role: role})})
			r.waitRegistered(t)
			cli := dial(t, r.Advertise())
			stream, err := cli.Generate(testCtx(t), c.req)
			require.NoError(t, err)
			chunks, err := recvAll(stream)
			require.NoError(t, err)
			require.NotEmpty(t, chunks)

			want, err := sim.Expect(role, c.req)
			require.NoError(t, err)
			last := chunks[len(chunks)-1]
			assert.Equal(t, want, concat(chunks))
			assert.NotNil(t, last.GetTimings())

			h, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
			require.NoError(t, err)
			assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_SERVING, h.GetStatus())
			assert.Equal(t, string(role), h.GetRole())
			assert.Equal(t, "sim", h.GetEngine())
			assert.Equal(t, uint32(sim.DefaultBlockSize), h.GetCacheConfig().GetBlockSize())
		})
	}
}

func TestWrongInputKindIsInvalidArgument(t *testing.T) {
	vocoder := start(t, worker.Config{Stage: "vocoder", Engine: newSim(t, sim.Config{Role: stagepb.RoleAudio})})
	thinker := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{Role: stagepb.RoleText})})
	vocoder.waitRegistered(t)
	thinker.waitRegistered(t)
	for _, c := range []struct {
		addr string
		req  *stagepb.GenerateRequest
		msg  string
	}{
		{vocoder.Advertise(), textReq("hi", nil), "stage vocoder (role audio) takes codes input, got text"},
		{thinker.Advertise(), &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{1}}}}, "stage thinker (role text) takes text, chat or token_ids input, got codes"},
		{thinker.Advertise(), &stagepb.GenerateRequest{}, "request has no input"},
		{vocoder.Advertise(), &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{1 << 20}}}}, "out of range"},
	} {
		stream, err := dial(t, c.addr).Generate(testCtx(t), c.req)
		require.NoError(t, err)
		_, err = recvAll(stream)
		require.Error(t, err)
		assert.Equal(t, codes.InvalidArgument, status.Code(err))
		assert.Contains(t, status.Convert(err).Message(), c.msg)
	}
}

func TestDrainRPCRefusesNewWorkAndFinishesInFlight(t *testing.T) {
	g := newGated(newSim(t, sim.Config{}))
	r := start(t, worker.Config{Stage: "thinker", Engine: g})
	r.waitRegistered(t)
	conn := dialWith(t, r.Advertise(), insecure.NewCredentials())
	cli := stagepb.NewStageServiceClient(conn)
	hc := healthpb.NewHealthClient(conn)
	hr, err := hc.Check(testCtx(t), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	assert.Equal(t, healthpb.HealthCheckResponse_SERVING, hr.GetStatus())

	req := textReq("keep going", &stagepb.SamplingParams{MaxTokens: 30, IgnoreEos: true})
	stream, err := cli.Generate(testCtx(t), req)
	require.NoError(t, err)
	g.waitHeld(t)

	d, err := cli.Drain(testCtx(t), &stagepb.DrainRequest{})
	require.NoError(t, err)
	assert.Equal(t, uint32(1), d.GetInFlight())

	refused, err := cli.Generate(testCtx(t), textReq("one more", nil))
	require.NoError(t, err)
	_, err = recvAll(refused)
	assert.Equal(t, codes.Unavailable, status.Code(err))
	h, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_DRAINING, h.GetStatus())
	for _, svc := range []string{"", "troupe.stage.v1.StageService"} {
		hr, err = hc.Check(testCtx(t), &healthpb.HealthCheckRequest{Service: svc})
		require.NoError(t, err)
		assert.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, hr.GetStatus(), "service %q", svc)
	}

	close(g.gate)
	chunks, err := recvAll(stream)
	require.NoError(t, err)
	want, err := sim.Expect(stagepb.RoleText, req)
	require.NoError(t, err)
	assert.Equal(t, want.Text, joinText(chunks))
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, chunks[len(chunks)-1].GetFinishReason())

	d, err = cli.Drain(testCtx(t), &stagepb.DrainRequest{})
	require.NoError(t, err)
	assert.Equal(t, uint32(0), d.GetInFlight())
	assert.NoError(t, r.stop(t))
}

func TestShutdownFinishesInFlight(t *testing.T) {
	g := newGated(newSim(t, sim.Config{}))
	r := start(t, worker.Config{Stage: "thinker", Engine: g})
	r.waitRegistered(t)
	cli := dial(t, r.Advertise())
	req := textReq("finish me", &stagepb.SamplingParams{MaxTokens: 20, IgnoreEos: true})
	stream, err := cli.Generate(testCtx(t), req)
	require.NoError(t, err)
	g.waitHeld(t)

	r.cancel() // SIGTERM
	require.Eventually(t, func() bool {
		h, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
		return err == nil && h.GetStatus() == stagepb.ServingStatus_SERVING_STATUS_DRAINING
	}, wait, 5*time.Millisecond)
	r.requireDraining(t, cli)

	close(g.gate)
	chunks, err := recvAll(stream)
	require.NoError(t, err)
	assert.Len(t, chunks, 20)
	assert.NoError(t, r.stop(t))
}

func TestDrainTimeoutAbortsInEngine(t *testing.T) {
	eng := newSim(t, sim.Config{DecodeTokenLatency: 10 * time.Millisecond})
	r := start(t, worker.Config{Stage: "thinker", Engine: eng, DrainTimeout: 100 * time.Millisecond})
	r.waitRegistered(t)
	stream, err := dial(t, r.Advertise()).Generate(testCtx(t), textReq("endless", &stagepb.SamplingParams{MaxTokens: 10000, IgnoreEos: true}))
	require.NoError(t, err)
	_, err = stream.Recv()
	require.NoError(t, err)
	assert.NoError(t, r.stop(t), "a drain timeout is still a clean exit")
	_, err = recvAll(stream)
	require.Error(t, err)
	require.Eventually(t, func() bool {
		s := eng.Snapshot()
		return s.Finished[stagepb.FinishReason_FINISH_REASON_ABORT] == 1 && s.KVBlocksUsed == 0
	}, wait, 5*time.Millisecond)
}

func TestClientCancelAbortsInEngine(t *testing.T) {
	eng := newSim(t, sim.Config{DecodeTokenLatency: 10 * time.Millisecond})
	r := start(t, worker.Config{Stage: "thinker", Engine: eng})
	r.waitRegistered(t)
	ctx, cancel := context.WithCancel(testCtx(t))
	stream, err := dial(t, r.Advertise()).Generate(ctx, textReq("endless", &stagepb.SamplingParams{MaxTokens: 10000, IgnoreEos: true}))
	require.NoError(t, err)
	_, err = stream.Recv()
	require.NoError(t, err)
	require.Equal(t, 1, eng.Snapshot().Running)
	cancel()
	require.Eventually(t, func() bool {
		s := eng.Snapshot()
		return s.Finished[stagepb.FinishReason_FINISH_REASON_ABORT] == 1 && s.KVBlocksUsed == 0 && s.Running == 0
	}, wait, 5*time.Millisecond)
}

func TestSleepAndWakeOverGRPC(t *testing.T) {
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{})})
	r.waitRegistered(t)
	cli := dial(t, r.Advertise())
	_, err := cli.Sleep(testCtx(t), &stagepb.SleepRequest{Level: 7})
	assert.Equal(t, codes.InvalidArgument, status.Code(err))

	s, err := cli.Sleep(testCtx(t), &stagepb.SleepRequest{Level: 2})
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_DISCARD_ALL, s.GetSleepState())
	h, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_DISCARD_ALL, h.GetSleepState())
	stream, err := cli.Generate(testCtx(t), textReq("wake up", nil))
	require.NoError(t, err)
	_, err = recvAll(stream)
	assert.Equal(t, codes.FailedPrecondition, status.Code(err))

	w, err := cli.WakeUp(testCtx(t), &stagepb.WakeUpRequest{})
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, w.GetSleepState())
	stream, err = cli.Generate(testCtx(t), textReq("wake up", nil))
	require.NoError(t, err)
	chunks, err := recvAll(stream)
	require.NoError(t, err)
	want, _, _ := sim.ExpectedText("wake up", 0, 0)
	assert.Equal(t, want, joinText(chunks))
}

func TestMutualTLSOverGRPC(t *testing.T) {
	ca := tlsconfigtest.NewCA(t, "troupe")
	srvTLS, err := tlsconfig.Server(ca.Issue(t, "worker"))
	require.NoError(t, err)
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{}), TLS: srvTLS})
	r.waitRegistered(t)
	good := ca.Issue(t, "head")

	health := func(files tlsconfig.Files) error {
		creds, err := tlsconfig.ClientCredentials(files)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(testCtx(t), 10*time.Second)
		defer cancel()
		_, err = stagepb.NewStageServiceClient(dialWith(t, r.Advertise(), creds)).Health(ctx, &stagepb.HealthRequest{})
		return err
	}
	require.NoError(t, health(good))
	rogue := tlsconfigtest.NewCA(t, "rogue").Issue(t, "intruder")
	err = health(tlsconfig.Files{Cert: rogue.Cert, Key: rogue.Key, CA: good.CA})
	require.Error(t, err, "a client cert from another CA must be refused")
	assert.Equal(t, codes.Unavailable, status.Code(err))
	err = health(tlsconfig.Files{CA: good.CA})
	require.Error(t, err, "a client without a cert must be refused")
	_, err = dial(t, r.Advertise()).Health(testCtx(t), &stagepb.HealthRequest{})
	require.Error(t, err, "plaintext must be refused")
}

func TestPhaseSpansUnderTheRPCSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	r := start(t, worker.Config{
		Stage: "thinker", Engine: newSim(t, sim.Config{DecodeTokenLatency: time.Millisecond}),
		ServerOptions: []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(tp)))},
	})
	r.waitRegistered(t)
	stream, err := dial(t, r.Advertise()).Generate(testCtx(t), textReq("trace me", &stagepb.SamplingParams{MaxTokens: 5, IgnoreEos: true}))
	require.NoError(t, err)
	_, err = recvAll(stream)
	require.NoError(t, err)

	var rpc sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			if s.Name() == "troupe.stage.v1.StageService/Generate" {
				rpc = s
				return true
			}
		}
		return false
	}, wait, 5*time.Millisecond)
	phases := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.Parent().SpanID() == rpc.SpanContext().SpanID() {
			phases[s.Name()] = s
		}
	}
	require.Contains(t, phases, "queue")
	require.Contains(t, phases, "prefill")
	require.Contains(t, phases, "decode")
	assert.Equal(t, phases["queue"].EndTime(), phases["prefill"].StartTime())
	assert.Equal(t, phases["prefill"].EndTime(), phases["decode"].StartTime())
	assert.GreaterOrEqual(t, phases["decode"].EndTime().Sub(phases["decode"].StartTime()), 4*time.Millisecond, "four decode steps of 1ms")
}

func TestNewRejectsBadConfig(t *testing.T) {
	eng := newSim(t, sim.Config{})
	_, err := worker.New(worker.Config{Stage: "thinker"})
	assert.ErrorContains(t, err, "no engine")
	_, err = worker.New(worker.Config{Stage: "bad/name", Engine: eng})
	assert.ErrorContains(t, err, "invalid stage name")
	_, err = worker.New(worker.Config{Stage: "thinker", Engine: eng, Cluster: "a b"})
	assert.ErrorContains(t, err, "invalid cluster name")
	_, err = worker.New(worker.Config{Stage: "thinker", Engine: eng, Listen: "127.0.0.1:notaport"})
	assert.ErrorContains(t, err, "worker: listen")
	srv, err := worker.New(worker.Config{Stage: "thinker", Engine: eng})
	require.NoError(t, err)
	require.NoError(t, srv.Close())
	assert.ErrorContains(t, srv.Run(context.Background()), "Run called twice, or after Close")
}

// TestMessageLimit: by default a replica takes a prompt as large as the
// head's default body limit (gRPC alone stops at 4 MiB); MaxMessageBytes
// sets the limit.
func TestMessageLimit(t *testing.T) {
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{Role: stagepb.RoleText})})
	small := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{Role: stagepb.RoleText}), MaxMessageBytes: 1 << 20})
	r.waitRegistered(t)
	small.waitRegistered(t)
	word := strings.Repeat("x", 6<<20) // one word: two tokens, however long
	stream, err := dial(t, r.Advertise()).Generate(testCtx(t), textReq(word, &stagepb.SamplingParams{MaxTokens: 2}))
	require.NoError(t, err)
	chunks, err := recvAll(stream)
	require.NoError(t, err, "a 6 MiB prompt is within the default limit")
	assert.NotEmpty(t, chunks)

	stream, err = dial(t, small.Advertise()).Generate(testCtx(t), textReq(strings.Repeat("x", 2<<20), nil))
	require.NoError(t, err)
	_, err = recvAll(stream)
	assert.Equal(t, codes.ResourceExhausted, status.Code(err), "over the configured limit: %v", err)
}

// TestClusterTokenOverGRPC: a worker with a cluster token refuses every
// call without it (Generate, the admin RPCs, the stream), Unauthenticated,
// and serves the head's, which sends it as per-RPC credentials; the
// grpc.health.v1 probe stays open.
func TestClusterTokenOverGRPC(t *testing.T) {
	token := clusterauth.NewToken()
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{}), ClusterToken: token})
	r.waitRegistered(t)
	ctx := testCtx(t)

	calls := func(cli stagepb.StageServiceClient) map[string]error {
		errs := map[string]error{}
		stream, err := cli.Generate(ctx, textReq("hi", nil))
		if err == nil {
			_, err = recvAll(stream)
		}
		errs["Generate"] = err
		_, errs["Health"] = cli.Health(ctx, &stagepb.HealthRequest{})
		_, errs["Sleep"] = cli.Sleep(ctx, &stagepb.SleepRequest{Level: 2})
		_, errs["WakeUp"] = cli.WakeUp(ctx, &stagepb.WakeUpRequest{})
		sub, err := cli.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{})
		if err == nil {
			_, err = sub.Recv()
		}
		errs["SubscribeCache"] = err
		return errs
	}
	for name, creds := range map[string]grpc.DialOption{
		"no token":    grpc.EmptyDialOption{},
		"wrong token": clusterauth.DialOption(clusterauth.NewToken()),
	} {
		conn, err := grpc.NewClient(r.Advertise(), grpc.WithTransportCredentials(insecure.NewCredentials()), creds)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		cli := stagepb.NewStageServiceClient(conn)
		for rpc, err := range calls(cli) {
			assert.Equal(t, codes.Unauthenticated, status.Code(err), "%s: %s: %v", name, rpc, err)
		}
		_, err = cli.Drain(ctx, &stagepb.DrainRequest{})
		assert.Equal(t, codes.Unauthenticated, status.Code(err), "%s: Drain", name)
		hs, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err, "%s: the grpc.health.v1 probe needs no token", name)
		assert.Equal(t, healthpb.HealthCheckResponse_SERVING, hs.GetStatus())
	}
	h, err := dial(t, r.Advertise()).Health(ctx, &stagepb.HealthRequest{})
	assert.Equal(t, codes.Unauthenticated, status.Code(err))
	assert.Nil(t, h)

	conn, err := grpc.NewClient(r.Advertise(), grpc.WithTransportCredentials(insecure.NewCredentials()), clusterauth.DialOption(token))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	head := stagepb.NewStageServiceClient(conn)
	stream, err := head.Generate(ctx, textReq("hi", nil))
	require.NoError(t, err)
	chunks, err := recvAll(stream)
	require.NoError(t, err)
	assert.NotEmpty(t, chunks)
	_, err = head.Sleep(ctx, &stagepb.SleepRequest{Level: 1})
	require.NoError(t, err)
	_, err = head.WakeUp(ctx, &stagepb.WakeUpRequest{})
	require.NoError(t, err)
	sub, err := head.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{})
	require.NoError(t, err)
	snap, err := sub.Recv()
	require.NoError(t, err)
	assert.True(t, snap.GetSnapshot())
	d, err := head.Drain(ctx, &stagepb.DrainRequest{})
	require.NoError(t, err)
	assert.Zero(t, d.GetInFlight())
}

func TestNewRefusesShortClusterToken(t *testing.T) {
	_, err := worker.New(worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{}), ClusterToken: "short", Logger: quietLogger()})
	assert.ErrorContains(t, err, "token too short")
}

// TestHealthSaysWhoItIs: Health carries the replica id and an instance id
// that is stable for a process and differs between processes, which the
// head checks records against.
func TestHealthSaysWhoItIs(t *testing.T) {
	ids := map[string]bool{}
	for range 2 {
		r := start(t, worker.Config{Stage: "thinker", ReplicaID: 3, Engine: newSim(t, sim.Config{})})
		r.waitRegistered(t)
		cli := dial(t, r.Advertise())
		h1, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
		require.NoError(t, err)
		h2, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
		require.NoError(t, err)
		assert.Equal(t, uint32(3), h1.GetReplicaId())
		assert.Len(t, h1.GetInstanceId(), 32)
		assert.Equal(t, h1.GetInstanceId(), h2.GetInstanceId())
		ids[h1.GetInstanceId()] = true
	}
	assert.Len(t, ids, 2, "each process its own instance id")
}
