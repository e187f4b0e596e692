package worker_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
)

// benchRows is how many chunks (tokens) a benchmark request's tensors come
// in: a request of S bytes sends rows of S/benchRows.
const benchRows = 64

// stampedProducer emits benchRows chunks, each with one uint8 row whose
// first 8 bytes are the time it was made.
type stampedProducer struct {
	rowBytes int
	pace     time.Duration // between rows, as a decoding thinker's; 0: a burst
}

func (e *stampedProducer) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	for i := range benchRows {
		if i > 0 && e.pace > 0 {
			time.Sleep(e.pace) // the engine's decoding time, not a wait for a condition
		}
		data := make([]byte, max(e.rowBytes, 8))
		binary.LittleEndian.PutUint64(data, uint64(time.Now().UnixNano()))
		c := &stagepb.GenerateChunk{Text: "x", Stats: &stagepb.EngineStats{GenerationTokens: 1},
			Tensors: []*stagepb.Tensor{{Name: "hidden", Dtype: stagepb.DType_DTYPE_UINT8, Shape: []int64{1, int64(len(data))}, Data: data}}}
		if i == benchRows-1 {
			c.FinishReason = stagepb.FinishReason_FINISH_REASON_LENGTH
		}
		if err := emit(c); err != nil {
			return err
		}
	}
	return nil
}

func (e *stampedProducer) Health() *stagepb.HealthResponse {
	return &stagepb.HealthResponse{Status: stagepb.ServingStatus_SERVING_STATUS_SERVING, Role: stagepb.RoleText, OutputTensors: []string{"hidden"}}
}
func (e *stampedProducer) Sleep(context.Context, int) (stagepb.SleepState, error) { return 0, nil }
func (e *stampedProducer) WakeUp(context.Context) (stagepb.SleepState, error)     { return 0, nil }

// stampReader takes the rows and records, per row, the time from when it
// was made to when its engine got it.
type stampReader struct {
	mu   sync.Mutex
	lags []time.Duration
}

func (e *stampReader) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	now := time.Now()
	e.mu.Lock()
	for _, t := range req.GetTensors() {
		rows, width := int(t.GetShape()[0]), int(t.GetShape()[1])
		for r := range rows {
			at := int64(binary.LittleEndian.Uint64(t.GetData()[r*width:]))
			e.lags = append(e.lags, now.Sub(time.Unix(0, at)))
		}
	}
	e.mu.Unlock()
	return emit(&stagepb.GenerateChunk{Codes: []uint32{1}, FinishReason: stagepb.FinishReason_FINISH_REASON_STOP})
}

func (e *stampReader) ContinuesInput() bool { return true }
func (e *stampReader) Health() *stagepb.HealthResponse {
	return &stagepb.HealthResponse{Status: stagepb.ServingStatus_SERVING_STATUS_SERVING, Role: stagepb.RoleCodes, InputRole: stagepb.RoleTensors, InputTensors: []string{"hidden"}}
}
func (e *stampReader) Sleep(context.Context, int) (stagepb.SleepState, error) { return 0, nil }
func (e *stampReader) WakeUp(context.Context) (stagepb.SleepState, error)     { return 0, nil }

func (e *stampReader) report(b *testing.B) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.lags) == 0 {
		return
	}
	slices.Sort(e.lags)
	b.ReportMetric(float64(e.lags[len(e.lags)/2].Microseconds()), "p50-µs/row")
	b.ReportMetric(float64(e.lags[len(e.lags)*99/100].Microseconds()), "p99-µs/row")
}

var benchSizes = []int{1 << 20, 8 << 20, 40 << 20}

// BenchmarkTensorPath: requests whose producer sends S bytes of tensors to
// its consumer, worker to worker (PushTensors, as the head sets it up),
// against BenchmarkPlainStream, the same bytes on a plain gRPC stream.
// burst: all 64 rows at once, for MB/s; paced: a row every 10 ms, as a
// decoding thinker makes them, for the time from a row's making to its
// consumer's engine. docs/benchmarks.md "Tensors worker to worker".
func BenchmarkTensorPath(b *testing.B) {
	for _, bc := range []struct {
		name string
		pace time.Duration
	}{{"burst", 0}, {"paced", 10 * time.Millisecond}} {
		for _, size := range benchSizes {
			b.Run(fmt.Sprintf("%s/%dMB", bc.name, size>>20), func(b *testing.B) { benchTensorPath(b, size, bc.pace) })
		}
	}
}

func benchTensorPath(b *testing.B, size int, pace time.Duration) {
	{
		{
			reader := &stampReader{}
			prod := start(b, worker.Config{Stage: "thinker", Engine: &stampedProducer{rowBytes: size / benchRows, pace: pace}, MaxRequestTensorBytes: 64 << 20})
			cons := start(b, worker.Config{Stage: "talker", Engine: reader, MaxRequestTensorBytes: 64 << 20})
			prodCli, consCli := dial(b, prod.Advertise()), dial(b, cons.Advertise())
			ctx := context.Background()
			b.SetBytes(int64(size))
			b.ResetTimer()
			for i := range b.N {
				ticket := fmt.Sprintf("t%d", i)
				cs, err := consCli.GenerateStream(ctx)
				require.NoError(b, err)
				require.NoError(b, cs.Send(&stagepb.StreamInput{Request: &stagepb.GenerateRequest{RequestId: ticket, TensorTicket: ticket}}))
				ps, err := prodCli.GenerateStream(ctx)
				require.NoError(b, err)
				require.NoError(b, ps.Send(&stagepb.StreamInput{Request: textReq("go", nil), TensorSink: &stagepb.TensorSink{Addr: cons.Advertise(), Ticket: ticket}}))
				_, err = recvBidi(ps)
				require.NoError(b, err)
				require.NoError(b, cs.CloseSend())
				_, err = recvBidi(cs)
				require.NoError(b, err)
			}
			b.StopTimer()
			reader.report(b)
		}
	}
}

// plainSink acknowledges each push as it arrives: a gRPC stream with
// nothing of troupe's around it.
type plainSink struct {
	stagepb.UnimplementedStageServiceServer
}

func (plainSink) PushTensors(s grpc.BidiStreamingServer[stagepb.TensorPush, stagepb.TensorAck]) error {
	for {
		p, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := s.Send(&stagepb.TensorAck{Seq: p.GetSeq()}); err != nil {
			return err
		}
	}
}

// BenchmarkPlainStream sends BenchmarkTensorPath's bytes, in the same
// pushes, on a plain loopback gRPC stream.
func BenchmarkPlainStream(b *testing.B) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(64 << 20))
	stagepb.RegisterStageServiceServer(srv, plainSink{})
	go func() { _ = srv.Serve(lis) }()
	b.Cleanup(srv.Stop)
	cli := dial(b, lis.Addr().String())
	for _, size := range benchSizes {
		b.Run(fmt.Sprintf("%dMB", size>>20), func(b *testing.B) {
			var lags []time.Duration
			b.SetBytes(int64(size))
			for range b.N {
				s, err := cli.PushTensors(context.Background(), grpc.MaxCallSendMsgSize(64<<20))
				require.NoError(b, err)
				sent := make([]time.Time, benchRows+1)
				done := make(chan error, 1)
				go func() {
					for {
						ack, err := s.Recv()
						if err != nil {
							if errors.Is(err, io.EOF) {
								err = nil
							}
							done <- err
							return
						}
						lags = append(lags, time.Since(sent[ack.GetSeq()]))
					}
				}()
				for r := 1; r <= benchRows; r++ {
					data := make([]byte, size/benchRows)
					sent[r] = time.Now()
					require.NoError(b, s.Send(&stagepb.TensorPush{Ticket: "t", Seq: uint64(r),
						Tensors: []*stagepb.Tensor{{Name: "hidden", Dtype: stagepb.DType_DTYPE_UINT8, Shape: []int64{1, int64(len(data))}, Data: data}}}))
				}
				require.NoError(b, s.CloseSend())
				require.NoError(b, <-done)
			}
			b.StopTimer()
			slices.Sort(lags)
			b.ReportMetric(float64(lags[len(lags)/2].Microseconds()), "p50-µs/row")
			b.ReportMetric(float64(lags[len(lags)*99/100].Microseconds()), "p99-µs/row")
		})
	}
}
