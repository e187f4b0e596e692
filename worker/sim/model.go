package sim

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math"
	"strings"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// RoleForStage picks the sim's role (a stagepb role) from a stage name:
// thinker → text, talker → codes, vocoder → audio, anything else → text.
func RoleForStage(stage string) string {
	switch stage {
	case "talker":
		return stagepb.RoleCodes
	case "vocoder":
		return stagepb.RoleAudio
	}
	return stagepb.RoleText
}

// The sim's fixed model constants. Its tokenizer is tokenizers.Sim (text
// prompts are tokenizers.SimBOS, then one token per word), which the head
// runs too.
const CodebookSize uint32 = 1024 // codec codes are in [0, CodebookSize)

// The sim's audio and output lengths.
const (
	SampleRate     = 24000 // Hz, PCM16 mono little-endian
	SamplesPerCode = 960   // 40 ms of audio per codec code

	// DefaultMaxTextTokens and DefaultMaxCodes replace max_tokens 0.
	DefaultMaxTextTokens = 64
	DefaultMaxCodes      = 2048
)

// vocabulary is what the text role says; each output token is one word.
var vocabulary = [...]string{
	"the", "a", "sound", "of", "river", "light", "moves", "under", "stone", "and",
	"quiet", "music", "over", "green", "hills", "bright", "morning", "voice", "calls", "far",
	"across", "open", "water", "wind", "carries", "small", "birds", "through", "old", "trees",
	"every", "road", "leads", "home", "slowly", "warm", "rain", "falls", "on", "roofs",
	"people", "sing", "together", "in", "evening", "air", "clear", "sky", "holds", "stars",
	"gentle", "waves", "return", "to", "shore", "while", "children", "laugh", "near", "fire",
	"time", "turns", "softly", "again",
}

// mix is the splitmix64 finalizer: a cheap, well-spread 64-bit hash.
func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// promptKey hashes a token sequence (FNV-1a over little-endian ids).
func promptKey(ids []uint32) uint64 {
	h := fnv.New64a()
	var b [4]byte
	for _, id := range ids {
		binary.LittleEndian.PutUint32(b[:], id)
		h.Write(b[:])
	}
	return h.Sum64()
}

// Salts separate the independent draws made from one (prompt, seed).
const (
	saltLength uint64 = 0x6c656e67746800 // natural length
	saltToken  uint64 = 0x746f6b656e0000 // output token at a position
	saltCode   uint64 = 0x636f646500000  // codec code at a position
	saltSpec   uint64 = 0x7370656300000  // speculative acceptance at a position
)

// draw is the sim's only source of "randomness": a pure function of the
// prompt key, the seed, a position and a salt.
func draw(key uint64, seed int64, pos int, salt uint64) uint64 {
	h := mix(key ^ salt)
	h = mix(h ^ uint64(seed))
	return mix(h ^ uint64(pos))
}

// naturalTextLength is where the text role stops on its own: 4..35 tokens.
func naturalTextLength(key uint64, seed int64) int {
	return 4 + int(draw(key, seed, 0, saltLength)%32)
}

// CodesPerToken is how many codec codes the codes role makes per input
// token: its natural length is CodesPerToken per token it consumes.
const CodesPerToken = 2

// params is the part of SamplingParams the sim looks at. Temperature is
// ignored: the sim always "samples" its hash.
type params struct {
	maxTokens int // 0: the role's default
	seed      int64
	stop      []string
	ignoreEOS bool
	continues bool // the output continues an answer (GenerateRequest.continuation): its first word is spaced off too
}

func paramsOf(sp *stagepb.SamplingParams) params {
	if sp == nil {
		return params{}
	}
	return params{maxTokens: int(sp.GetMaxTokens()), seed: sp.GetSeed(), stop: sp.GetStop(), ignoreEOS: sp.GetIgnoreEos()}
}

// plan is the whole output of one request, fixed before it is scheduled:
// the scheduler decides only when each item comes out.
type plan struct {
	ids    []uint32 // one per output token: word ids (text), codes (codes), input codes (audio)
	pieces []string // text role: the text each token adds (already cut at a stop string)
	finish stagepb.FinishReason
}

// outputLength is how many tokens a request produces before any stop
// string, and why it ends; decided without building the output, so a huge
// max_tokens is rejected before any work. The natural end wins when it falls
// on max_tokens (EOS is checked before length, as in vLLM).
//
// ctxLen leading tokens of prompt are context: input that earlier segments
// of a streamed request consumed (GenerateRequest.context). The codes role
// makes output for the tokens after it only.
func outputLength(role string, prompt []uint32, ctxLen int, p params) (int, stagepb.FinishReason) {
	if role == stagepb.RoleAudio {
		return len(prompt), stagepb.FinishReason_FINISH_REASON_STOP
	}
	limit, natural := p.maxTokens, 0
	if role == stagepb.RoleCodes {
		if limit <= 0 {
			limit = DefaultMaxCodes
		}
		natural = CodesPerToken * (len(prompt) - ctxLen)
	} else {
		if limit <= 0 {
			limit = DefaultMaxTextTokens
		}
		natural = naturalTextLength(promptKey(prompt), p.seed)
	}
	if !p.ignoreEOS && natural <= limit {
		return natural, stagepb.FinishReason_FINISH_REASON_STOP
	}
	return limit, stagepb.FinishReason_FINISH_REASON_LENGTH
}

// buildPlan computes the output of one request.
func buildPlan(role string, prompt []uint32, ctxLen int, p params) plan {
	n, finish := outputLength(role, prompt, ctxLen, p)
	switch role {
	case stagepb.RoleAudio:
		return plan{ids: append([]uint32(nil), prompt...), finish: finish}
	case stagepb.RoleCodes:
		return plan{ids: talkerCodes(prompt, ctxLen, p.seed, n), finish: finish}
	}
	return textPlan(promptKey(prompt), p, n, finish)
}

// talkerCodes are the first n codes the codes role makes for the tokens of
// prompt after ctxLen: CodesPerToken per token, each drawn from the hash of
// the prompt up to and including that token and its position in the whole
// input. A code therefore depends only on the input before it, so a talker
// fed its input in segments (each with the earlier ones as context) makes
// exactly the codes it makes for the whole input at once.
func talkerCodes(prompt []uint32, ctxLen int, seed int64, n int) []uint32 {
	ids := make([]uint32, 0, n)
	h := fnv.New64a()
	var b [4]byte
	for j, tok := range prompt {
		binary.LittleEndian.PutUint32(b[:], tok)
		h.Write(b[:])
		if j < ctxLen {
			continue
		}
		key := h.Sum64()
		for k := range CodesPerToken {
			if len(ids) == n {
				return ids
			}
			ids = append(ids, uint32(draw(key, seed, CodesPerToken*j+k, saltCode)%uint64(CodebookSize)))
		}
	}
	return ids
}

// textPlan generates n words and cuts the text before the first stop string,
// as vLLM does (the stop string is not returned; the token that completed it
// is counted).
func textPlan(key uint64, p params, n int, finish stagepb.FinishReason) plan {
	ids := make([]uint32, 0, n)
	ends := make([]int, 0, n) // byte offset where each token's text ends
	var full strings.Builder
	cut := -1
	for i := 0; i < n && cut < 0; i++ {
		w := vocabulary[draw(key, p.seed, i, saltToken)%uint64(len(vocabulary))]
		before := full.Len()
		if i > 0 || p.continues {
			full.WriteByte(' ')
		}
		full.WriteString(w)
		ids = append(ids, tokenizers.SimWordID(w))
		ends = append(ends, full.Len())
		text := full.String()
		for _, s := range p.stop {
			if s == "" {
				continue
			}
			// A new match must end inside this token's text.
			from := max(0, before-len(s)+1)
			if j := strings.Index(text[from:], s); j >= 0 && (cut < 0 || from+j < cut) {
				cut = from + j
			}
		}
	}
	text := full.String()
	if cut >= 0 {
		text = text[:cut]
		finish = stagepb.FinishReason_FINISH_REASON_STOP
	}
	pieces := make([]string, len(ids))
	prev := 0
	for i, end := range ends {
		end = min(end, len(text))
		pieces[i] = text[prev:end]
		prev = end
	}
	return plan{ids: ids, pieces: pieces, finish: finish}
}

// Output is everything the sim produces for one request.
type Output struct {
	Text             string   // text role
	TokenIDs         []uint32 // text role: output token ids
	Codes            []uint32 // codes role
	Audio            []byte   // audio role: PCM16 mono little-endian at SampleRate
	GenerationTokens int      // output tokens counted as generation_tokens
	Finish           stagepb.FinishReason
}

// Expect returns what a sim engine of the given role answers to req, byte
// for byte, or the InvalidArgument error it would return. It is a pure
// function of the input, the seed (unset = 0), max_tokens, stop and
// ignore_eos; temperature does not matter.
func Expect(role string, req *stagepb.GenerateRequest) (Output, error) {
	prompt, ctxLen, err := promptOf(role, req)
	if err != nil {
		return Output{}, err
	}
	p := paramsOf(req.GetSampling())
	p.continues = req.GetContinuation() != ""
	pl := buildPlan(role, prompt, ctxLen, p)
	return pl.output(role), nil
}

func (pl plan) output(role string) Output {
	out := Output{GenerationTokens: len(pl.ids), Finish: pl.finish}
	switch role {
	case stagepb.RoleCodes:
		out.Codes = append([]uint32(nil), pl.ids...)
	case stagepb.RoleAudio:
		out.Audio = ExpectedAudio(pl.ids)
	default:
		out.Text = strings.Join(pl.pieces, "")
		out.TokenIDs = append([]uint32(nil), pl.ids...)
	}
	return out
}

// ExpectedText is what a text-role sim answers to a text prompt with the
// given seed and max_tokens (0: DefaultMaxTextTokens), no stop strings:
// the text, the number of generated tokens and the finish reason.
func ExpectedText(prompt string, seed int64, maxTokens int) (text string, tokens int, finish stagepb.FinishReason) {
	pl := buildPlan(stagepb.RoleText, tokenizers.Sim(prompt), 0, params{maxTokens: max(0, maxTokens), seed: seed})
	return strings.Join(pl.pieces, ""), len(pl.ids), pl.finish
}

// ExpectedCodes is what a codes-role sim (a talker) answers to a text
// prompt with the given seed and max_tokens (0: DefaultMaxCodes).
func ExpectedCodes(text string, seed int64, maxTokens int) (codes []uint32, finish stagepb.FinishReason) {
	pl := buildPlan(stagepb.RoleCodes, tokenizers.Sim(text), 0, params{maxTokens: max(0, maxTokens), seed: seed})
	return pl.ids, pl.finish
}

// ExpectedAudio is what an audio-role sim (a vocoder) answers to codes:
// SamplesPerCode PCM16 samples per code, each code a sine tone whose
// frequency depends on the code alone (see CodeFrequency).
func ExpectedAudio(codes []uint32) []byte {
	out := make([]byte, 0, len(codes)*SamplesPerCode*2)
	for _, c := range codes {
		out = appendTone(out, c)
	}
	return out
}

// CodeFrequency is the pitch of a code: 48 semitones up from 110 Hz.
func CodeFrequency(code uint32) float64 {
	return 110 * math.Pow(2, float64(code%48)/12)
}

// appendTone renders one code: a sine at CodeFrequency, amplitude 0.25 of
// full scale, with 2 ms linear fades so frames join without clicks.
func appendTone(dst []byte, code uint32) []byte {
	const fade = SampleRate / 500
	f := CodeFrequency(code)
	for i := range SamplesPerCode {
		gain := 0.25
		if i < fade {
			gain *= float64(i) / fade
		} else if r := SamplesPerCode - 1 - i; r < fade {
			gain *= float64(r) / fade
		}
		phase := float64(2*math.Pi*f) * float64(float64(i)/SampleRate)
		v := int16(math.Round(float64(gain*math.Sin(phase)) * 32767))
		dst = binary.LittleEndian.AppendUint16(dst, uint16(v))
	}
	return dst
}

// promptOf checks the input kind against the role and returns the prompt
// tokens, and how many of them are context (GenerateRequest.context: the
// tokenized context, words of the input after it). Errors are
// InvalidArgument.
func promptOf(role string, req *stagepb.GenerateRequest) (prompt []uint32, ctxLen int, err error) {
	if c := req.GetContext(); c != "" {
		if _, ok := req.GetInput().(*stagepb.GenerateRequest_Text); !ok || role == stagepb.RoleAudio {
			return nil, 0, invalidArgument("context is only taken with text input by the text and codes roles")
		}
		prompt = tokenizers.Sim(c)
		ctxLen = len(prompt)
		for _, w := range strings.Fields(req.GetText()) {
			prompt = append(prompt, tokenizers.SimWordID(w))
		}
		return prompt, ctxLen, nil
	}
	prompt, err = promptWithoutContext(role, req)
	if c := req.GetContinuation(); c != "" && err == nil && role == stagepb.RoleText {
		// The answer so far is part of the prompt: the output continues it.
		for _, w := range strings.Fields(c) {
			prompt = append(prompt, tokenizers.SimWordID(w))
		}
	}
	return prompt, 0, err
}

func promptWithoutContext(role string, req *stagepb.GenerateRequest) ([]uint32, error) {
	switch in := req.GetInput().(type) {
	case *stagepb.GenerateRequest_Text:
		if role == stagepb.RoleAudio {
			return nil, invalidInput(role, "text")
		}
		return tokenizers.Sim(in.Text), nil
	case *stagepb.GenerateRequest_Chat:
		if role == stagepb.RoleAudio {
			return nil, invalidInput(role, "chat")
		}
		return chatTokens(in.Chat.GetMessages())
	case *stagepb.GenerateRequest_TokenIds:
		if role == stagepb.RoleAudio {
			return nil, invalidInput(role, "token_ids")
		}
		ids := in.TokenIds.GetIds()
		if len(ids) == 0 {
			return nil, invalidArgument("empty token_ids")
		}
		for _, id := range ids {
			if id >= tokenizers.SimVocabSize {
				return nil, invalidArgument(fmt.Sprintf("token id %d out of range [0, %d)", id, tokenizers.SimVocabSize))
			}
		}
		return append([]uint32(nil), ids...), nil
	case *stagepb.GenerateRequest_Codes:
		if role != stagepb.RoleAudio {
			return nil, invalidInput(role, "codes")
		}
		codes := in.Codes.GetCodes()
		if len(codes) == 0 {
			return nil, invalidArgument("empty codes")
		}
		for _, c := range codes {
			if c >= CodebookSize {
				return nil, invalidArgument(fmt.Sprintf("code %d out of range [0, %d)", c, CodebookSize))
			}
		}
		return append([]uint32(nil), codes...), nil
	case nil:
		return nil, invalidArgument("request has no input")
	default:
		return nil, invalidArgument(fmt.Sprintf("unsupported input %T", in))
	}
}

func invalidInput(role string, got string) error {
	want := "text, chat or token_ids"
	if role == stagepb.RoleAudio {
		want = "codes"
	}
	return invalidArgument(fmt.Sprintf("role %s takes %s input, got %s", role, want, got))
}
