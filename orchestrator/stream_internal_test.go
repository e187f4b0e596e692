package orchestrator

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TestStageInputBackPressure: the previous stage can run at most
// inputWindow pieces ahead of the sender; each piece sent frees one slot.
// A retry replays from the first piece and the window follows it.
func TestStageInputBackPressure(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	in := newStageInput()
	for i := range inputWindow {
		require.NoError(t, in.append(ctx, piece{text: string(rune('a' + i))}))
	}
	blocked, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop()
	require.ErrorIs(t, in.append(blocked, piece{text: "x"}), context.DeadlineExceeded, "a full window blocks the previous stage")

	appended := make(chan error, 1)
	go func() { appended <- in.append(ctx, piece{text: "late"}) }()
	p, ok, err := in.next(ctx, 0)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, "a", p.text)
	in.markSent(0)
	require.NoError(t, <-appended, "sending one piece frees a slot")

	in.restart() // a retry: everything is replayed, the window starts over
	blocked2, stop2 := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop2()
	require.ErrorIs(t, in.append(blocked2, piece{text: "y"}), context.DeadlineExceeded)

	in.close()
	for i := 0; i <= inputWindow; i++ {
		_, ok, err := in.next(ctx, i)
		require.NoError(t, err)
		assert.True(t, ok, "piece %d is kept for the retry", i)
	}
	_, ok, err = in.next(ctx, inputWindow+1)
	require.NoError(t, err)
	assert.False(t, ok, "the input ended")
}

// TestStageInputAvailableSendsWhatIsThere: the sender takes every piece
// that is there as one message, waits for the first when none is, and
// learns that the input ended.
func TestStageInputAvailableSendsWhatIsThere(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	in := newStageInput()
	t0 := time.Now()
	require.NoError(t, in.append(ctx, piece{text: "one ", at: t0}))
	require.NoError(t, in.append(ctx, piece{text: "two ", at: t0.Add(time.Millisecond)}))
	ps, ok, err := in.available(ctx, 0)
	require.NoError(t, err)
	require.True(t, ok)
	require.Len(t, ps, 2)
	assert.Equal(t, piece{text: "one two ", at: t0}, joined(ps), "text in order, dated by the first piece")

	got := make(chan []piece, 1)
	go func() {
		ps, _, _ := in.available(ctx, 2)
		got <- ps
	}()
	require.NoError(t, in.append(ctx, piece{codes: []uint32{1, 2}}))
	select {
	case ps = <-got:
	case <-ctx.Done():
		t.Fatal("available did not return once a piece came")
	}
	require.Len(t, ps, 1, "the first piece is sent without waiting for a second")
	require.NoError(t, in.append(ctx, piece{codes: []uint32{3}}))
	ps, _, err = in.available(ctx, 3)
	require.NoError(t, err)
	assert.Equal(t, []uint32{3}, joined(append([]piece{}, ps...)).codes)
	assert.Equal(t, []uint32{1, 2, 3}, joined([]piece{{codes: []uint32{1, 2}}, {codes: []uint32{3}}}).codes)

	in.close()
	_, ok, err = in.available(ctx, 4)
	require.NoError(t, err)
	assert.False(t, ok, "the input ended")
}

func TestOutputCursorSkipsWhatWasDelivered(t *testing.T) {
	c := outputCursor{text: 3, codes: 1, pcm: 4}
	text, codes, pcm := c.cut(&stagepb.GenerateChunk{Text: "ab", Codes: []uint32{1, 2}, AudioPcm16: []byte{1, 2}})
	assert.Empty(t, text)
	assert.Equal(t, []uint32{2}, codes)
	assert.Empty(t, pcm)
	text, _, pcm = c.cut(&stagepb.GenerateChunk{Text: "cde", AudioPcm16: []byte{3, 4, 5, 6}})
	assert.Equal(t, "de", text)
	assert.Equal(t, []byte{5, 6}, pcm)
	assert.Equal(t, outputCursor{}, c)
}

// BenchmarkForwardChunk is the head's own work per chunk it forwards from
// one stage to the next (skip check, input log, hand to the sender), gRPC's
// send excluded.
//
//	go test -run '^$' -bench ForwardChunk -benchmem ./orchestrator/
func BenchmarkForwardChunk(b *testing.B) {
	ctx := context.Background()
	in := newStageInput()
	var cur outputCursor
	chunk := &stagepb.GenerateChunk{Codes: []uint32{1, 2}}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		_, codes, _ := cur.cut(chunk)
		if err := in.append(ctx, piece{codes: codes}); err != nil {
			b.Fatal(err)
		}
		if _, _, err := in.next(ctx, i); err != nil {
			b.Fatal(err)
		}
		in.markSent(i)
	}
}

// TestSizeBoundIsAnUpperBound: the cheap bound that lets most requests
// skip proto.Size never undercuts the real size.
func TestSizeBoundIsAnUpperBound(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		str := func(label string) string { return rapid.StringN(0, 300, -1).Draw(t, label) }
		req := Request{ID: str("id"), Prompt: str("prompt"), Voice: str("voice"),
			Sampling: &stagepb.SamplingParams{MaxTokens: rapid.Uint32().Draw(t, "max"), Stop: rapid.SliceOfN(rapid.StringN(0, 50, -1), 0, 5).Draw(t, "stop")}}
		for range rapid.IntRange(0, 5).Draw(t, "messages") {
			req.Messages = append(req.Messages, &stagepb.ChatMessage{Role: str("role"), Content: str("content")})
		}
		in := &stagepb.GenerateRequest{RequestId: req.ID, Input: &stagepb.GenerateRequest_Text{Text: req.Prompt}, Sampling: req.Sampling, Voice: req.Voice}
		if len(req.Messages) > 0 {
			in.Input = &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: req.Messages}}
		}
		if got, want := sizeBound(req), proto.Size(in); got < want {
			t.Fatalf("bound %d below the size %d", got, want)
		}
	})
}

// countingStream answers Recv with chunks of pcm bytes of audio, forever,
// counting the calls.
type countingStream struct {
	pcm   int
	calls atomic.Int64
}

func (s *countingStream) Recv() (*stagepb.GenerateChunk, error) {
	s.calls.Add(1)
	return &stagepb.GenerateChunk{AudioPcm16: make([]byte, s.pcm)}, nil
}

// TestReadAheadHoldsABoundedWindow: a client that reads nothing leaves the
// read-ahead holding at most readAheadBytes of output (and the chunk that
// crosses it), or readAheadChunks chunks of small ones; each chunk the
// delivery loop takes lets it receive again.
func TestReadAheadHoldsABoundedWindow(t *testing.T) {
	for _, pcm := range []int{readAheadBytes / 4, 2 * readAheadBytes, 10} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		s := &countingStream{pcm: pcm}
		ra := startReadAhead(ctx, s)
		want := int64(min(readAheadChunks+1, (readAheadBytes+pcm-1)/pcm))
		if pcm*readAheadChunks < readAheadBytes {
			want = readAheadChunks + 1 // the channel's chunks and the one waiting to go in
		}
		require.Eventually(t, func() bool { return s.calls.Load() == want }, 5*time.Second, time.Millisecond, "%d-byte chunks", pcm)
		assert.Never(t, func() bool { return s.calls.Load() > want }, 100*time.Millisecond, time.Millisecond, "%d-byte chunks: no more received", pcm)
		before := s.calls.Load()
		_, err := ra.next(ctx, func() error { return nil })
		require.NoError(t, err)
		require.Eventually(t, func() bool { return s.calls.Load() > before }, 5*time.Second, time.Millisecond, "taking a chunk makes room")
		if pcm >= readAheadBytes {
			assert.Equal(t, before+1, s.calls.Load(), "one big chunk at a time")
		}
		cancel()
		<-ra.done
	}
}
