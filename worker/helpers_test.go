package worker_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// wait bounds every wait on a condition; generous for a loaded machine.
const wait = 20 * time.Second

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func newSim(t *testing.T, cfg sim.Config) *sim.Engine {
	t.Helper()
	cfg.Logger = quietLogger()
	e := sim.New(cfg)
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// running is a Server whose Run goroutine the test owns.
type running struct {
	*worker.Server
	cancel context.CancelFunc
	done   chan error // Run's result
}

// start runs a Server until the test ends (or stop is called).
func start(t testing.TB, cfg worker.Config) *running {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	srv, err := worker.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{Server: srv, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(wait):
			t.Error("worker did not stop")
		}
	})
	return r
}

// stop cancels Run and returns its result.
func (r *running) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return err
	case <-time.After(wait):
		t.Fatal("worker did not stop")
		return nil
	}
}

func (r *running) waitRegistered(t *testing.T) {
	t.Helper()
	select {
	case <-r.Registered():
	case err := <-r.done:
		r.done <- err
		t.Fatalf("worker stopped before registering: %v", err)
	case <-time.After(wait):
		t.Fatal("worker did not register")
	}
}

func dialWith(t testing.TB, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func dial(t testing.TB, addr string) stagepb.StageServiceClient {
	return stagepb.NewStageServiceClient(dialWith(t, addr, insecure.NewCredentials()))
}

// gatedEngine is the real sim engine whose requests, once they have sent
// their first chunk, wait for the gate: a test can hold requests in flight
// for as long as it needs, without depending on timing.
type gatedEngine struct {
	*sim.Engine
	held chan struct{} // one send per request that reached the gate
	gate chan struct{} // closed to let held requests go on
}

func newGated(e *sim.Engine) *gatedEngine {
	return &gatedEngine{Engine: e, held: make(chan struct{}, 64), gate: make(chan struct{})}
}

func (g *gatedEngine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	first := true
	return g.Engine.Generate(ctx, req, func(c *stagepb.GenerateChunk) error {
		if err := emit(c); err != nil {
			return err
		}
		if first {
			first = false
			g.held <- struct{}{}
			select {
			case <-g.gate:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
}

func (g *gatedEngine) waitHeld(t *testing.T) {
	t.Helper()
	select {
	case <-g.held:
	case <-time.After(wait):
		t.Fatal("no request reached the gate")
	}
}

func textReq(text string, sp *stagepb.SamplingParams) *stagepb.GenerateRequest {
	return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: text}, Sampling: sp}
}

// recvAll reads a stream to its end.
func recvAll(stream grpc.ServerStreamingClient[stagepb.GenerateChunk]) ([]*stagepb.GenerateChunk, error) {
	var chunks []*stagepb.GenerateChunk
	for {
		c, err := stream.Recv()
		if err == io.EOF {
			return chunks, nil
		}
		if err != nil {
			return chunks, err
		}
		chunks = append(chunks, c)
	}
}

func joinText(chunks []*stagepb.GenerateChunk) string {
	s := ""
	for _, c := range chunks {
		s += c.GetText()
	}
	return s
}

// requireDraining checks that a draining server refuses new work with
// Unavailable while Run has not returned (a request is still in flight).
func (r *running) requireDraining(t *testing.T, cli stagepb.StageServiceClient) {
	t.Helper()
	// Shutdown deregisters before it drains: a request that arrives in
	// between is still taken (and finishes), so wait for the drain itself.
	require.Eventually(t, func() bool {
		h, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
		return err == nil && h.GetStatus() == stagepb.ServingStatus_SERVING_STATUS_DRAINING
	}, wait, time.Millisecond, "the replica never reported DRAINING")
	refused, err := cli.Generate(testCtx(t), textReq("too late", nil))
	require.NoError(t, err)
	_, err = recvAll(refused)
	assert.Equal(t, codes.Unavailable, status.Code(err))
	select {
	case err := <-r.done:
		t.Fatalf("Run returned with a request in flight: %v", err)
	default:
	}
}
