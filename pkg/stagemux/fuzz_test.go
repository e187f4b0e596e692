package stagemux

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// frameStream is the head's end of a Multiplex stream whose worker sends
// frames, once release is closed, then ends it. The fuzz target runs the
// reader over it in memory: a loopback stream per input would spend the
// budget on gRPC.
type frameStream struct {
	grpc.ClientStream
	ctx     context.Context
	release chan struct{}
	frames  []*stagepb.MuxFrame
}

func (s *frameStream) Context() context.Context     { return s.ctx }
func (s *frameStream) Send(*stagepb.MuxFrame) error { return nil }

func (s *frameStream) Recv() (*stagepb.MuxFrame, error) {
	select {
	case <-s.release:
	case <-s.ctx.Done():
		return nil, status.FromContextError(s.ctx.Err()).Err()
	}
	if len(s.frames) == 0 {
		return nil, io.EOF
	}
	f := s.frames[0]
	s.frames = s.frames[1:]
	return f, nil
}

// frameClient opens its one frameStream.
type frameClient struct {
	stagepb.StageServiceClient
	stream *frameStream
}

func (c *frameClient) Multiplex(ctx context.Context, _ ...grpc.CallOption) (grpc.BidiStreamingClient[stagepb.MuxFrame, stagepb.MuxFrame], error) {
	c.stream.ctx = ctx
	return c.stream, nil
}

// decodeFrames splits data into frames: a length byte, then that many
// bytes of a MuxFrame (a segment that does not decode is skipped). Ids
// are taken modulo fuzzCalls+2, so that most name a call and some none.
func decodeFrames(data []byte) []*stagepb.MuxFrame {
	var frames []*stagepb.MuxFrame
	for len(data) > 0 {
		n := min(int(data[0]), len(data)-1)
		f := &stagepb.MuxFrame{}
		if proto.Unmarshal(data[1:1+n], f) == nil {
			f.Id %= fuzzCalls + 2
			frames = append(frames, f)
		}
		data = data[1+n:]
	}
	return frames
}

const fuzzCalls = 3

// FuzzMuxFrameReader feeds the frames a worker might send (any bytes,
// decoded as a sequence of MuxFrames) to a Client's reader, with small
// queue limits, and checks that each call gets its own chunks in order
// and ends once: with its end's status, with the stream's end when none
// came, or with ResourceExhausted when it fell behind; and that the calls,
// once closed, hold no output.
func FuzzMuxFrameReader(f *testing.F) {
	seed := func(frames ...*stagepb.MuxFrame) []byte {
		var b []byte
		for _, fr := range frames {
			m, err := proto.Marshal(fr)
			if err != nil || len(m) > 255 {
				f.Fatalf("seed frame: %v", err)
			}
			b = append(append(b, byte(len(m))), m...)
		}
		return b
	}
	text := func(s string) *stagepb.GenerateChunk { return &stagepb.GenerateChunk{Text: s} }
	f.Add(seed(
		&stagepb.MuxFrame{Id: 1, Chunk: text("a")},
		&stagepb.MuxFrame{Id: 2, Chunk: text("b"), End: &stagepb.MuxEnd{}},
		&stagepb.MuxFrame{Id: 1, End: &stagepb.MuxEnd{Code: uint32(codes.Internal), Message: "boom"}},
		&stagepb.MuxFrame{Id: 1, Chunk: text("after the end")},
	))
	f.Add(seed(
		&stagepb.MuxFrame{Id: 3, Chunk: &stagepb.GenerateChunk{AudioPcm16: make([]byte, 200)}},
		&stagepb.MuxFrame{Id: 3, Chunk: &stagepb.GenerateChunk{AudioPcm16: make([]byte, 200)}},
		&stagepb.MuxFrame{Id: 4, Chunk: text("nobody's")},
		&stagepb.MuxFrame{Id: 0, Cancel: true},
	))
	f.Add([]byte{3, 0xff, 0xff, 0xff, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		frames := decodeFrames(data)
		stream := &frameStream{release: make(chan struct{}), frames: frames}
		mux := NewClient(&frameClient{stream: stream})
		mux.limits = limits{call: 600, stream: 900}
		defer mux.Close()
		ctx := context.Background()
		calls := make([]*Call, fuzzCalls)
		for i := range calls {
			call, err := mux.Generate(ctx, request("x", 1), nil)
			if err != nil {
				t.Fatalf("call %d: %v", i, err)
			}
			calls[i] = call
		}
		close(stream.release)
		st := calls[0].st
		<-st.ctx.Done() // the reader saw every frame

		for i, call := range calls {
			id := uint64(i + 1)
			var want []*stagepb.GenerateChunk
			var end *stagepb.MuxEnd
			for _, fr := range frames {
				if fr.GetId() != id || (fr.GetChunk() == nil && fr.GetEnd() == nil) {
					continue
				}
				if fr.GetChunk() != nil {
					want = append(want, fr.GetChunk())
				}
				if end = fr.GetEnd(); end != nil {
					break
				}
			}
			var got []*stagepb.GenerateChunk
			var err error
			for {
				var c *stagepb.GenerateChunk
				if c, err = call.Recv(); err != nil {
					break
				}
				got = append(got, c)
				if len(got) > len(want) {
					t.Fatalf("call %d: more chunks than were sent for it", id)
				}
			}
			for j := range got {
				if !proto.Equal(got[j], want[j]) {
					t.Fatalf("call %d: chunk %d is %v, not %v", id, j, got[j], want[j])
				}
			}
			switch {
			case status.Code(err) == codes.ResourceExhausted && (end == nil || codes.Code(end.GetCode()) != codes.ResourceExhausted):
				// fell behind: what it had is dropped
			case len(got) != len(want):
				t.Fatalf("call %d: %d chunks of %d, then %v", id, len(got), len(want), err)
			case end == nil:
				if status.Code(err) != codes.Unavailable {
					t.Fatalf("call %d without an end: %v, not the stream's end", id, err)
				}
			case codes.Code(end.GetCode()) == codes.OK:
				if !errors.Is(err, io.EOF) {
					t.Fatalf("call %d ended OK: %v, not io.EOF", id, err)
				}
			case status.Code(err) != codes.Code(end.GetCode()):
				t.Fatalf("call %d ended with code %d: %v", id, end.GetCode(), err)
			}
			if c, again := call.Recv(); c != nil || again == nil {
				t.Fatalf("call %d: Recv after its end gave %v, %v", id, c, again)
			}
			call.Close()
		}
		if n := st.queued.Load(); n != 0 {
			t.Fatalf("%d bytes held after every call closed", n)
		}
	})
}
