package httpapi

import (
	"encoding/json"

	"github.com/troupe-serving/troupe/orchestrator"
)

// OpenAI response shapes. Fields that OpenAI sends as null (logprobs,
// refusal) are sent as null, so strict clients find every key they expect.
// The answers and chunks are encoded by hand (jsonenc.go): a field added
// here goes there too, or TestAppendJSONCoversEveryField fails.

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	// PromptTokensDetails: only when the prompt had media parts.
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

// promptTokensDetails says how many prompt tokens stage 0 made of media
// parts, as OpenAI's usage.prompt_tokens_details does (video_tokens: a
// vLLM-style extension).
type promptTokensDetails struct {
	AudioTokens int `json:"audio_tokens"`
	ImageTokens int `json:"image_tokens"`
	VideoTokens int `json:"video_tokens,omitempty"`
}

func usageOf(res *orchestrator.Result) *usage {
	u := &usage{
		PromptTokens:     res.PromptTokens,
		CompletionTokens: res.CompletionTokens,
		TotalTokens:      res.PromptTokens + res.CompletionTokens,
	}
	if m := res.PromptMedia; m != (orchestrator.MediaTokens{}) {
		u.PromptTokensDetails = &promptTokensDetails{AudioTokens: m.Audio, ImageTokens: m.Image, VideoTokens: m.Video}
	}
	return u
}

// nullUsage is the "usage": null that OpenAI puts on every chunk but the
// last when stream_options.include_usage is set.
var nullUsage = json.RawMessage("null")

type audioOut struct {
	ID string `json:"id"`
	// Data is the WAV, or the PCM16 samples for format pcm16: encoding/json
	// writes a []byte as standard base64 straight into its buffer, without
	// the copy and escape scan a base64 string would cost.
	Data       []byte `json:"data"`
	ExpiresAt  int64  `json:"expires_at"`
	Transcript string `json:"transcript"`
	// wav, when set, is the pooled buffer Data lies in (see release).
	wav *[]byte
}

type chatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"` // chat.completion
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   *usage       `json:"usage"`
}

type chatChoice struct {
	Index        int                 `json:"index"`
	Message      chatResponseMessage `json:"message"`
	Logprobs     *struct{}           `json:"logprobs"`
	FinishReason string              `json:"finish_reason"`
}

type chatResponseMessage struct {
	Role    string    `json:"role"`
	Content string    `json:"content"`
	Refusal *string   `json:"refusal"`
	Audio   *audioOut `json:"audio,omitempty"`
}

type chatChunk struct {
	ID      string            `json:"id"`
	Object  string            `json:"object"` // chat.completion.chunk
	Created int64             `json:"created"`
	Model   string            `json:"model"`
	Choices []chatChunkChoice `json:"choices"`
	Usage   any               `json:"usage,omitempty"` // nil, nullUsage or *usage
}

type chatChunkChoice struct {
	Index        int       `json:"index"`
	Delta        chatDelta `json:"delta"`
	Logprobs     *struct{} `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

type chatDelta struct {
	Role    string      `json:"role,omitempty"`
	Content *string     `json:"content,omitempty"`
	Audio   *audioDelta `json:"audio,omitempty"`
}

// audioDelta is delta.audio of a streamed answer, as OpenAI streams audio:
// every delta names the audio; one carries a piece of the transcript or a
// piece of base64 PCM16 samples; the first carries expires_at.
type audioDelta struct {
	ID         string `json:"id"`
	Data       string `json:"data,omitempty"`
	Transcript string `json:"transcript,omitempty"`
	ExpiresAt  int64  `json:"expires_at,omitempty"`
	// pcm, when set, is written as data, base64-encoded straight into the
	// event (appendJSON): a stream whose client does not read holds its
	// pending audio once, as its event, not also as a base64 string.
	pcm []byte
}

type textCompletion struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"` // text_completion
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   any                `json:"usage,omitempty"` // nil, nullUsage or *usage
}

type completionChoice struct {
	Index        int       `json:"index"`
	Text         string    `json:"text"`
	Logprobs     *struct{} `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

type modelList struct {
	Object string      `json:"object"` // list
	Data   []modelCard `json:"data"`
}

type modelCard struct {
	ID      string `json:"id"`
	Object  string `json:"object"` // model
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// replicaList is GET /v1/replicas, as docs/contracts.md specifies.
type replicaList struct {
	Data []orchestrator.ReplicaStatus `json:"data"`
}

// sdTargetGroup is one element of GET /v1/replicas/sd, Prometheus's
// http_sd format.
type sdTargetGroup struct {
	Targets []string          `json:"targets"`
	Labels  map[string]string `json:"labels"`
}

// sleepAnswer is the body of a successful sleep or wake_up.
type sleepAnswer struct {
	Stage      int    `json:"stage"`
	StageName  string `json:"stage_name"`
	Replica    uint32 `json:"replica"`
	SleepState string `json:"sleep_state"` // awake | weights_offloaded | discard_all
}
