// Package omnisim is a native omni pipeline's first two stages in Go,
// with real arithmetic on real tensors: a thinker that writes words and,
// for each, a hidden-state row, and a talker that reads those rows (worker
// to worker, input role tensors) and gives codec codes. troupe's sim
// vocoder turns the codes into audio. They stand in for engines that pass
// hidden states (Qwen-Omni's thinker and talker) in tests and benchmarks:
// a row lost, repeated or reordered changes the codes.
package omnisim

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// HiddenTensor is the name of the thinker's per-token rows.
const HiddenTensor = "hidden"

// Thinker writes MaxTokens words (or the request's max_tokens) chosen from
// its prompt's hash, one chunk a word, each with a [1, Width] float32 row of
// HiddenTensor.
type Thinker struct {
	Width     int // floats per row; 0: none (text only)
	MaxTokens int // default 16
	// TokenDelay is how long each word takes (0: none), for a benchmark
	// that compares requests of equal length but different tensors.
	TokenDelay time.Duration
}

// Talker gives CodesPerRow codes for each [n, width] row it is fed.
type Talker struct {
	CodesPerRow int // default 2
	Codebook    int // codes are below it; default 1024
}

var words = strings.Fields("the quick brown fox jumps over a lazy dog while seven small birds sing near an old stone wall")

func (e *Thinker) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	prompt, ok := req.SpeechText()
	if !ok {
		return status.Error(codes.InvalidArgument, "omnisim: the thinker takes text or chat")
	}
	n := e.MaxTokens
	if n <= 0 {
		n = 16
	}
	if m := int(req.GetSampling().GetMaxTokens()); m > 0 && m < n {
		n = m
	}
	h := fnv.New64a()
	h.Write([]byte(prompt))
	state := h.Sum64()
	for i := range n {
		if e.TokenDelay > 0 {
			t := time.NewTimer(e.TokenDelay)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		state = state*6364136223846793005 + 1442695040888963407
		tok := int(state>>33) % len(words)
		text := words[tok]
		if i > 0 {
			text = " " + text
		}
		c := &stagepb.GenerateChunk{Text: text, Stats: &stagepb.EngineStats{GenerationTokens: 1}}
		if e.Width > 0 {
			c.Tensors = []*stagepb.Tensor{Row(HiddenTensor, tok, i, e.Width)}
		}
		if i == n-1 {
			c.FinishReason = stagepb.FinishReason_FINISH_REASON_LENGTH
		}
		if err := emit(c); err != nil {
			return err
		}
	}
	return nil
}

// Row is the hidden-state row of token tok at position pos: a [1, width]
// float32 tensor whose values depend on both.
func Row(name string, tok, pos, width int) *stagepb.Tensor {
	data := make([]byte, 4*width)
	for j := range width {
		v := float32(math.Sin(float64(tok*131+j*7)) + 0.01*float64(pos))
		binary.LittleEndian.PutUint32(data[4*j:], math.Float32bits(v))
	}
	return &stagepb.Tensor{Name: name, Dtype: stagepb.DType_DTYPE_FLOAT32, Shape: []int64{1, int64(width)}, Data: data}
}

func (e *Thinker) Health() *stagepb.HealthResponse {
	h := &stagepb.HealthResponse{Status: stagepb.ServingStatus_SERVING_STATUS_SERVING, Engine: "omnisim", Role: stagepb.RoleText, InputRole: stagepb.RoleText}
	if e.Width > 0 {
		h.OutputTensors = []string{HiddenTensor}
	}
	return h
}

func (e *Thinker) Sleep(context.Context, int) (stagepb.SleepState, error) {
	return 0, status.Error(codes.Unimplemented, "omnisim: no sleep")
}

func (e *Thinker) WakeUp(context.Context) (stagepb.SleepState, error) {
	return stagepb.SleepState_SLEEP_STATE_AWAKE, nil
}

func (e *Talker) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	per, book := e.CodesPerRow, e.Codebook
	if per <= 0 {
		per = 2
	}
	if book <= 0 {
		book = 1024
	}
	var out []uint32
	for _, t := range req.GetTensors() {
		if t.GetName() != HiddenTensor {
			continue
		}
		if t.GetDtype() != stagepb.DType_DTYPE_FLOAT32 || len(t.GetShape()) != 2 {
			return status.Errorf(codes.InvalidArgument, "omnisim: %s must be a float32 [n, width] tensor, got %v %v", HiddenTensor, t.GetDtype(), t.GetShape())
		}
		rows, width := int(t.GetShape()[0]), int(t.GetShape()[1])
		if len(t.GetData()) != 4*rows*width {
			return status.Errorf(codes.InvalidArgument, "omnisim: %s holds %d bytes, not %d", HiddenTensor, len(t.GetData()), 4*rows*width)
		}
		for r := range rows {
			row := t.GetData()[4*r*width : 4*(r+1)*width]
			out = append(out, CodesOf(row, per, book)...)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return emit(&stagepb.GenerateChunk{Codes: out, Stats: &stagepb.EngineStats{GenerationTokens: uint64(len(out))}, FinishReason: stagepb.FinishReason_FINISH_REASON_STOP})
}

// CodesOf is the talker's projection of one little-endian float32 row:
// per codes, each a weighted sum of every element, folded below book.
func CodesOf(row []byte, per, book int) []uint32 {
	out := make([]uint32, per)
	for k := range per {
		var acc float64
		for j := 0; j < len(row)/4; j++ {
			v := math.Float32frombits(binary.LittleEndian.Uint32(row[4*j:]))
			acc += float64(v) * math.Cos(float64((k+1)*(j+3)))
		}
		out[k] = uint32(math.Abs(math.Round(acc*1000))) % uint32(book)
	}
	return out
}

// ContinuesInput: the talker's codes for rows fed in parts are its codes
// for all of them.
func (e *Talker) ContinuesInput() bool { return true }

func (e *Talker) Health() *stagepb.HealthResponse {
	return &stagepb.HealthResponse{Status: stagepb.ServingStatus_SERVING_STATUS_SERVING, Engine: "omnisim", Role: stagepb.RoleCodes,
		InputRole: stagepb.RoleTensors, InputTensors: []string{HiddenTensor}}
}

func (e *Talker) Sleep(context.Context, int) (stagepb.SleepState, error) {
	return 0, status.Error(codes.Unimplemented, "omnisim: no sleep")
}

func (e *Talker) WakeUp(context.Context) (stagepb.SleepState, error) {
	return stagepb.SleepState_SLEEP_STATE_AWAKE, nil
}

// String describes the thinker.
func (e *Thinker) String() string { return fmt.Sprintf("omnisim thinker (width %d)", e.Width) }
