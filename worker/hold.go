package worker

import (
	"sync"
	"time"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// maxHold bounds GenerateRequest.hold_output_ms: output is never held for
// longer, whatever the head asks, so the head's stall timeout (seconds)
// always sees progress.
const maxHold = stagepb.MaxHeldOutput

// maxHeldBytes bounds the output merged into one chunk, far below the
// gRPC message limits (17 MiB by default): a fast engine's audio can make
// megabytes within one hold.
const maxHeldBytes = 1 << 20

// outputHolder sends one request's chunks, holding output as the head
// allows: every chunk is merged into the held one, which is sent at once
// with the final chunk, once it holds maxHeldBytes, once it holds codes
// codes (GenerateRequest.output_codes_per_chunk: the next stage could not
// start a segment on fewer), once the text sent and held makes the next
// stage's next segment (output_words_per_chunk: cut as that stage's
// segmenter cuts, textCut), and hold after it was started at the latest
// (GenerateRequest.hold_output_ms, or maxHold). Each output in a sent chunk
// is dated by its age (GenerateChunk.output_ages_us), so the head measures
// time to first token and inter-token latencies as if the outputs had come
// one by one. A head that reads a stage's output only when it ends thus
// gets one message, or one per hold, instead of one per token, a vocoder
// one per segment, and neither end-to-end latency nor the next stage's
// start grows.
//
// emit is called by one goroutine (the engine's); the flush timer runs on
// its own. mu serializes every send on the stream, as gRPC requires. After
// finish returns no send is in progress and none starts.
type outputHolder struct {
	send  func(*stagepb.GenerateChunk) error
	hold  time.Duration
	codes int // send once this many codes are held; 0: no such rule
	words int // send once the text makes a segment of this many words (textCut); 0: no such rule
	// unsegmented is the end of the text sent that the next stage cannot
	// have cut into a segment yet (with the words rule).
	unsegmented string

	mu       sync.Mutex
	pending  *stagepb.GenerateChunk // owned by the holder; nil when nothing is held
	outputAt []time.Time            // when each output in pending was made
	timer    *time.Timer
	closed   bool
	err      error // the first failed send; emit returns it from then on
}

// newOutputHolder returns send itself (nothing held) when req asks for no
// hold, and a holder's emit otherwise; finish must be called when the
// engine is done, before the RPC returns.
func newOutputHolder(req *stagepb.GenerateRequest, send func(*stagepb.GenerateChunk) error) (emit func(*stagepb.GenerateChunk) error, finish func() error) {
	ms, codes, words := req.GetHoldOutputMs(), req.GetOutputCodesPerChunk(), req.GetOutputWordsPerChunk()
	if ms == 0 && codes == 0 && words == 0 {
		return send, func() error { return nil }
	}
	h := &outputHolder{send: send, hold: maxHold, codes: int(codes), words: int(words)}
	if ms > 0 {
		h.hold = min(time.Duration(ms)*time.Millisecond, maxHold)
	}
	return h.emit, h.finish
}

func (h *outputHolder) emit(c *stagepb.GenerateChunk) error {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err != nil {
		return h.err
	}
	if h.pending == nil {
		h.pending = &stagepb.GenerateChunk{}
		if h.timer == nil {
			h.timer = time.AfterFunc(h.hold, h.flush)
		} else {
			h.timer.Reset(h.hold)
		}
	}
	stagepb.MergeChunk(h.pending, c)
	if stagepb.HasOutput(c) {
		h.outputAt = append(h.outputAt, now)
	}
	if c.GetFinishReason() != stagepb.FinishReason_FINISH_REASON_UNSPECIFIED || stagepb.OutputBytes(h.pending) >= maxHeldBytes ||
		(h.codes > 0 && len(h.pending.GetCodes()) >= h.codes) ||
		(h.words > 0 && c.GetText() != "" && textCut(h.unsegmented+h.pending.GetText(), h.words) > 0) {
		return h.flushLocked()
	}
	return nil
}

// segmented notes that text was sent: the next stage cuts the segments
// that unsegmented and text make, and keeps the rest.
func (h *outputHolder) segmented(text string) {
	if h.words == 0 || text == "" {
		return
	}
	rest := h.unsegmented + text
	for cut := textCut(rest, h.words); cut > 0; cut = textCut(rest, h.words) {
		rest = rest[cut:]
	}
	h.unsegmented = rest
}

// flush is the timer's: it sends what is held.
func (h *outputHolder) flush() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.closed && h.err == nil {
		_ = h.flushLocked() // a failure is kept in h.err for the next emit
	}
}

func (h *outputHolder) flushLocked() error {
	if h.pending == nil {
		return nil
	}
	c := h.pending
	h.pending = nil
	if h.timer != nil {
		h.timer.Stop()
	}
	if len(h.outputAt) > 0 {
		now := time.Now()
		c.OutputAgesUs = make([]uint32, len(h.outputAt))
		for i, at := range h.outputAt {
			c.OutputAgesUs[i] = uint32(min(now.Sub(at).Microseconds(), 1<<32-1))
		}
		h.outputAt = h.outputAt[:0]
	}
	h.segmented(c.GetText())
	if err := h.send(c); err != nil {
		h.err = err
		return err
	}
	return nil
}

// finish sends what is still held (output the engine made before it
// stopped, even on an error) and stops the timer.
func (h *outputHolder) finish() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	if h.err != nil {
		return h.err
	}
	return h.flushLocked()
}
