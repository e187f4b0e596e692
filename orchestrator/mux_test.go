package orchestrator_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// streamOpens counts the streams a head opens to its workers, by method.
type streamOpens struct {
	mu     sync.Mutex
	counts map[string]int
}

func (o *streamOpens) option() grpc.DialOption {
	o.counts = map[string]int{}
	return grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		o.mu.Lock()
		if name := method[strings.LastIndexByte(method, '/')+1:]; name != "SubscribeLoad" { // a subscription, not a call
			o.counts[name]++
		}
		o.mu.Unlock()
		return streamer(ctx, desc, cc, method, opts...)
	})
}

func (o *streamOpens) get() map[string]int {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := map[string]int{}
	for k, v := range o.counts {
		out[k] = v
	}
	return out
}

// Generate calls share one Multiplex stream per replica, whether the
// client streams or not.
func TestHeldCallsShareOneMultiplexStream(t *testing.T) {
	var opens streamOpens
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, HeadDialOptions: []grpc.DialOption{opens.option()}})
	c.WaitReady(t)
	ctx := ctxT(t)

	// Concurrent answers are the answers each request gets alone: no
	// chunk went to another call.
	const requests = 24
	run := func(i int) (string, error) {
		res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("mux-", i), Prompt: fmt.Sprint("share a stream, request ", i), Sampling: sampling(8, 1)}, nil)
		if err != nil {
			return "", err
		}
		return res.Text, nil
	}
	concurrent := make([]string, requests)
	var g errgroup.Group
	for i := range requests {
		g.Go(func() (err error) {
			concurrent[i], err = run(i)
			return err
		})
	}
	require.NoError(t, g.Wait())
	for i := range requests {
		alone, err := run(i)
		require.NoError(t, err)
		require.NotEmpty(t, alone)
		assert.Equal(t, alone, concurrent[i], "request %d", i)
	}
	distinct := map[string]bool{}
	for _, text := range concurrent {
		distinct[text] = true
	}
	require.Greater(t, len(distinct), requests/2, "the prompts give different answers, or the check above proves little")
	assert.Equal(t, map[string]int{"Multiplex": 1}, opens.get(), "every held call on the replica's one stream")

	var streamed strings.Builder
	res, err := c.Head.Execute(ctx, orchestrator.Request{ID: "streamed", Prompt: "stream it", Sampling: sampling(4, 1), Flush: func() error { return nil }},
		func(text string) error { streamed.WriteString(text); return nil })
	require.NoError(t, err)
	assert.Equal(t, res.Text, streamed.String())
	assert.Equal(t, map[string]int{"Multiplex": 1}, opens.get(), "a streaming client's call too")
}

// A head that sends traces to its workers sends its calls over the same
// one stream: each call's frame carries its trace context (tracing_test
// checks the spans).
func TestATracingHeadSendsItsCallsOverMultiplexToo(t *testing.T) {
	var opens streamOpens
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, HeadTracer: tp, HeadDialOptions: []grpc.DialOption{opens.option()}})
	c.WaitReady(t)
	for i := range 3 {
		_, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: fmt.Sprint("traced-", i), Prompt: "trace me", Sampling: sampling(4, 1)}, nil)
		require.NoError(t, err)
	}
	assert.Equal(t, map[string]int{"Multiplex": 1}, opens.get())
}
