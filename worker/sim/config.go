package sim

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Defaults for zero Config fields.
const (
	DefaultMaxNumSeqs          = 256
	DefaultMaxNumBatchedTokens = 8192
	DefaultNumKVBlocks         = 4096
	DefaultBlockSize           = 16
	// DefaultEncoderCacheEntries is how many media parts' encoder outputs
	// the encoder cache keeps.
	DefaultEncoderCacheEntries = 256
	// DefaultEncodeTimePerKiB is what encoding a media part not in the
	// encoder cache costs per KiB of its bytes: 20 µs, about 20 ms a MiB.
	DefaultEncodeTimePerKiB = 20 * time.Microsecond
)

// Config configures a sim Engine. Zero fields take the defaults above; the
// prefill and decode delays default to 0, which makes the engine run as
// fast as it can (the encoder's, of media only, to DefaultEncodeTimePerKiB).
type Config struct {
	Role string // a stagepb role; default stagepb.RoleText
	// InputRole is what the engine takes: "" for what its role takes
	// (stagepb.InputRoleOf), or audio with role text: a speech recognizer
	// (asr.go), which transcribes the audio parts of a conversation.
	InputRole string
	// TextOnly makes a text-in engine take no media parts, as one serving a
	// text-only model: Health lists none, so the head refuses a
	// conversation with a media part before it reaches the engine.
	TextOnly             bool
	MaxNumSeqs           int // most requests running at once
	MaxNumBatchedTokens  int // token budget of one engine step (chunked prefill)
	NumKVBlocks          int // KV cache size in blocks
	BlockSize            int // tokens per KV block
	DisablePrefixCaching bool
	// PrefillTokensPerSec is the prefill throughput: a step that computes n
	// prompt tokens takes n/PrefillTokensPerSec longer. 0: instant.
	PrefillTokensPerSec float64
	// DecodeTokenLatency is how long a step that decodes takes (one token
	// per running request, plus accepted drafts). 0: instant.
	DecodeTokenLatency time.Duration
	// NumSpeculativeTokens is K, the draft positions per decode step (0: off).
	NumSpeculativeTokens int
	// EncoderCacheEntries bounds the multimodal encoder cache (media parts,
	// by the hash of their bytes, least recently used evicted first).
	EncoderCacheEntries int
	// EncodeTimePerKiB is the encoder's time per KiB of a media part
	// missing from the encoder cache, added to the step that first
	// schedules its request. 0: DefaultEncodeTimePerKiB; negative: instant.
	EncodeTimePerKiB time.Duration
	Logger           *slog.Logger // default slog.Default()
}

// Validate reports what is wrong with the configuration, if anything.
// New does not fail: call Validate first on values from users.
func (c Config) Validate() error {
	var errs []error
	if c.Role != "" {
		if _, err := stagepb.ParseRole(c.Role); err != nil {
			errs = append(errs, err)
		}
	}
	if c.InputRole != "" && (c.InputRole != stagepb.RoleAudio || (c.Role != "" && c.Role != stagepb.RoleText)) {
		errs = append(errs, fmt.Errorf("sim: input role %q with role %q: only a text role may take audio (speech recognition)", c.InputRole, c.Role))
	}
	for _, f := range []struct {
		name string
		v    int
	}{
		{"max-num-seqs", c.MaxNumSeqs}, {"max-num-batched-tokens", c.MaxNumBatchedTokens},
		{"num-kv-blocks", c.NumKVBlocks}, {"block-size", c.BlockSize},
		{"encoder-cache-entries", c.EncoderCacheEntries},
	} {
		if f.v < 0 {
			errs = append(errs, fmt.Errorf("sim: %s must be positive, got %d", f.name, f.v))
		}
	}
	if c.NumSpeculativeTokens < 0 || c.NumSpeculativeTokens > stagepb.MaxSpeculativeTokens {
		errs = append(errs, fmt.Errorf("sim: num-speculative-tokens %d out of range 0..%d", c.NumSpeculativeTokens, stagepb.MaxSpeculativeTokens))
	}
	if c.PrefillTokensPerSec < 0 || math.IsNaN(c.PrefillTokensPerSec) || math.IsInf(c.PrefillTokensPerSec, 0) {
		errs = append(errs, fmt.Errorf("sim: prefill tokens per second must be a finite number >= 0, got %v", c.PrefillTokensPerSec))
	}
	if c.DecodeTokenLatency < 0 {
		errs = append(errs, fmt.Errorf("sim: decode latency must be >= 0, got %v", c.DecodeTokenLatency))
	}
	if c.MaxNumBatchedTokens > 0 && c.MaxNumBatchedTokens < 1+c.NumSpeculativeTokens {
		errs = append(errs, fmt.Errorf("sim: max-num-batched-tokens %d cannot hold one decode step of 1+%d tokens", c.MaxNumBatchedTokens, c.NumSpeculativeTokens))
	}
	return errors.Join(errs...)
}

// withDefaults fills zero fields and clamps what Validate would refuse, so
// that New never builds an engine that cannot make progress.
func (c Config) withDefaults() Config {
	if _, err := stagepb.ParseRole(c.Role); err != nil {
		c.Role = stagepb.RoleText
	}
	if c.InputRole != stagepb.RoleAudio || c.Role != stagepb.RoleText {
		c.InputRole = ""
	}
	if c.MaxNumSeqs <= 0 {
		c.MaxNumSeqs = DefaultMaxNumSeqs
	}
	if c.MaxNumBatchedTokens <= 0 {
		c.MaxNumBatchedTokens = DefaultMaxNumBatchedTokens
	}
	if c.NumKVBlocks <= 0 {
		c.NumKVBlocks = DefaultNumKVBlocks
	}
	if c.BlockSize <= 0 {
		c.BlockSize = DefaultBlockSize
	}
	c.NumSpeculativeTokens = min(max(c.NumSpeculativeTokens, 0), stagepb.MaxSpeculativeTokens)
	c.MaxNumBatchedTokens = max(c.MaxNumBatchedTokens, 1+c.NumSpeculativeTokens)
	if c.PrefillTokensPerSec < 0 || math.IsNaN(c.PrefillTokensPerSec) || math.IsInf(c.PrefillTokensPerSec, 0) {
		c.PrefillTokensPerSec = 0
	}
	c.DecodeTokenLatency = max(c.DecodeTokenLatency, 0)
	if c.EncoderCacheEntries <= 0 {
		c.EncoderCacheEntries = DefaultEncoderCacheEntries
	}
	if c.EncodeTimePerKiB == 0 {
		c.EncodeTimePerKiB = DefaultEncodeTimePerKiB
	}
	c.EncodeTimePerKiB = max(c.EncodeTimePerKiB, 0)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// maxModelLen is the longest sequence (prompt + output + drafts) that fits
// in the whole KV cache; longer requests are refused up front, so a request
// running alone always completes.
func (c Config) maxModelLen() int { return c.NumKVBlocks * c.BlockSize }
