package httpapi

import "encoding/json"

// The wire shapes of the realtime events troupe speaks: the subset of
// OpenAI's Realtime API (GA names) listed in docs/api.md ("Realtime").
// Client events are decoded into clientEvent, whose fields are the union of
// the fields troupe reads; server events are the structs below, written
// with encoding/json.

// clientEvent is any client event. Fields a type does not use are ignored.
type clientEvent struct {
	Type    string          `json:"type"`
	EventID string          `json:"event_id"`
	Session json.RawMessage `json:"session"`
	Item    *rtItem         `json:"item"`
	Audio   *string         `json:"audio"`
	// conversation.item.truncate
	ItemID       string `json:"item_id"`
	ContentIndex int    `json:"content_index"`
	AudioEndMs   *int64 `json:"audio_end_ms"`
}

// rtSession is the session as session.created and session.updated show it,
// and the part of session.update troupe reads.
type rtSession struct {
	Type             string          `json:"type"`
	Object           string          `json:"object,omitempty"`
	ID               string          `json:"id,omitempty"`
	Model            string          `json:"model,omitempty"`
	Instructions     *string         `json:"instructions,omitempty"`
	OutputModalities []string        `json:"output_modalities,omitempty"`
	Audio            *rtSessionAudio `json:"audio,omitempty"`
}

type rtSessionAudio struct {
	Input  *rtAudioIn  `json:"input,omitempty"`
	Output *rtAudioOut `json:"output,omitempty"`
}

type rtAudioIn struct {
	Format *rtFormat `json:"format,omitempty"`
	// TurnDetection is a pointer to a pointer: absent keeps the setting,
	// null turns detection off.
	TurnDetection **rtTurnDetection `json:"turn_detection,omitempty"`
}

// UnmarshalJSON tells turn_detection null (detection off) from an absent
// one (unchanged): encoding/json decodes both into a nil pointer.
func (a *rtAudioIn) UnmarshalJSON(b []byte) error {
	type plain rtAudioIn
	var in struct {
		plain
		TurnDetection json.RawMessage `json:"turn_detection"`
	}
	if err := json.Unmarshal(b, &in); err != nil {
		return err
	}
	*a = rtAudioIn(in.plain)
	if in.TurnDetection != nil {
		var td *rtTurnDetection
		if err := json.Unmarshal(in.TurnDetection, &td); err != nil {
			return err
		}
		a.TurnDetection = &td
	}
	return nil
}

type rtAudioOut struct {
	Format *rtFormat `json:"format,omitempty"`
	Voice  *string   `json:"voice,omitempty"`
}

type rtFormat struct {
	Type string `json:"type"`
	Rate int    `json:"rate,omitempty"`
}

// rtTurnDetection is server_vad's settings (vad.go).
type rtTurnDetection struct {
	Type              string   `json:"type"`
	Threshold         *float64 `json:"threshold,omitempty"`
	PrefixPaddingMs   *int     `json:"prefix_padding_ms,omitempty"`
	SilenceDurationMs *int     `json:"silence_duration_ms,omitempty"`
	CreateResponse    *bool    `json:"create_response,omitempty"`
	InterruptResponse *bool    `json:"interrupt_response,omitempty"`
}

// rtItem is a conversation item: a message.
type rtItem struct {
	ID      string      `json:"id,omitempty"`
	Object  string      `json:"object,omitempty"`
	Type    string      `json:"type"`
	Status  string      `json:"status,omitempty"`
	Role    string      `json:"role,omitempty"`
	Content []rtContent `json:"content"`
}

type rtContent struct {
	Type       string  `json:"type"`
	Text       string  `json:"text,omitempty"`
	Transcript *string `json:"transcript,omitempty"`
	Audio      string  `json:"audio,omitempty"`
}

// rtResponse is the response of response.created and response.done.
type rtResponse struct {
	Object           string           `json:"object"`
	ID               string           `json:"id"`
	Status           string           `json:"status"`
	StatusDetails    *rtStatusDetails `json:"status_details"`
	Output           []*rtItem        `json:"output"`
	OutputModalities []string         `json:"output_modalities"`
	Usage            *rtUsage         `json:"usage,omitempty"`
}

type rtStatusDetails struct {
	Type   string   `json:"type"`
	Reason string   `json:"reason,omitempty"`
	Error  *rtError `json:"error,omitempty"`
}

type rtUsage struct {
	TotalTokens  int `json:"total_tokens"`
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
}

// rtError is the error of an error event (OpenAI's shape; event_id names
// the client event that caused it).
type rtError struct {
	Type    string  `json:"type"`
	Code    string  `json:"code,omitempty"`
	Message string  `json:"message"`
	Param   *string `json:"param"`
	EventID string  `json:"event_id,omitempty"`
}

// serverEvent is every server event: the fields an event type does not
// have are left out.
type serverEvent struct {
	Type           string      `json:"type"`
	EventID        string      `json:"event_id"`
	Session        *rtSession  `json:"session,omitempty"`
	Error          *rtError    `json:"error,omitempty"`
	PreviousItemID *string     `json:"previous_item_id,omitempty"`
	Item           *rtItem     `json:"item,omitempty"`
	Response       *rtResponse `json:"response,omitempty"`
	ResponseID     string      `json:"response_id,omitempty"`
	ItemID         string      `json:"item_id,omitempty"`
	OutputIndex    *int        `json:"output_index,omitempty"`
	ContentIndex   *int        `json:"content_index,omitempty"`
	Part           *rtContent  `json:"part,omitempty"`
	Delta          string      `json:"delta,omitempty"`
	Text           *string     `json:"text,omitempty"`
	Transcript     *string     `json:"transcript,omitempty"`
	AudioStartMs   *int64      `json:"audio_start_ms,omitempty"`
	AudioEndMs     *int64      `json:"audio_end_ms,omitempty"`
}

// Close codes of a realtime session (docs/api.md "Realtime").
const (
	// A client message over the size limit closes with 1009 (the
	// websocket library's read limit).

	// closeGoingAway (1001): the head is shutting down; reconnect to
	// another head.
	closeGoingAway = 1001
	// closeTryAgain (1013): the head is at its limit of sessions.
	closeTryAgain = 1013
	// closeIdle (4000): no client event for the idle timeout.
	closeIdle = 4000
)
