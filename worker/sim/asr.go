package sim

import (
	"fmt"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// TranscriptBytesPerWord sizes the sim's transcripts: a speech recognizer
// sim (Config.InputRole audio) writes TranscriptWords(audio) words for the
// audio parts of its input, drawn as a thinker's answer is from a prompt
// made of the audio's media tokens alone (MediaTokens). So the transcript
// is a pure function of the audio's bytes and the seed: the same audio
// always gives the same words, other audio other words. Text in the input
// (a transcription prompt, the language) does not change it.
const TranscriptBytesPerWord = 3200 // 0.1 s of 16 kHz PCM16

// TranscriptWords is how many words the sim transcribes from audio bytes:
// 1 + len(audio)/TranscriptBytesPerWord.
func TranscriptWords(audio []byte) int { return 1 + len(audio)/TranscriptBytesPerWord }

// InputRoleForStage picks what the sim takes from a stage name: audio for
// asr (speech recognition), else what its role takes (stagepb.InputRoleOf).
func InputRoleForStage(stage string) string {
	if stage == "asr" {
		return stagepb.RoleAudio
	}
	return ""
}

// asrInput is a speech recognizer's prompt (SimBOS, then the media tokens
// of every audio part, in order) and its transcript's length in words.
func asrInput(req *stagepb.GenerateRequest) (prompt []uint32, words int, err error) {
	chat := req.GetChat()
	if chat == nil {
		return nil, 0, invalidArgument(fmt.Sprintf("speech recognition takes a conversation with audio parts, got %s input", inputName(req)))
	}
	prompt = []uint32{tokenizers.SimBOS}
	for _, m := range chat.GetMessages() {
		for _, p := range m.GetParts() {
			if p.GetKind() != stagepb.PartAudio {
				continue
			}
			if len(p.GetData()) == 0 {
				return nil, 0, invalidArgument("speech recognition takes audio with its bytes, not by URL")
			}
			prompt = append(prompt, tokenizers.Sim(tokenizers.MediaText(p))[1:]...) // without its BOS
			words += TranscriptWords(p.GetData())
		}
	}
	if words == 0 {
		return nil, 0, invalidArgument("speech recognition needs audio: the input has no audio part")
	}
	return prompt, words, nil
}

func inputName(req *stagepb.GenerateRequest) string {
	switch req.GetInput().(type) {
	case *stagepb.GenerateRequest_Text:
		return "text"
	case *stagepb.GenerateRequest_TokenIds:
		return "token_ids"
	case *stagepb.GenerateRequest_Codes:
		return "codes"
	}
	return "no"
}

// asrPlan is the speech recognizer's answer to req with params p: exactly
// the transcript's words, finished with stop.
func asrPlan(req *stagepb.GenerateRequest, p params) ([]uint32, plan, error) {
	prompt, words, err := asrInput(req)
	if err != nil {
		return nil, plan{}, err
	}
	p.maxTokens, p.ignoreEOS, p.stop = words, true, nil
	pl := buildPlan(stagepb.RoleText, prompt, 0, p)
	pl.finish = stagepb.FinishReason_FINISH_REASON_STOP
	return prompt, pl, nil
}

// Transcript is what a sim speech recognizer writes for one audio part of
// audio's bytes with the given seed (unset: 0).
func Transcript(audio []byte, seed int64) string {
	req := &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{
		{Role: "user", Parts: []*stagepb.ContentPart{{Kind: stagepb.PartAudio, Data: audio}}}}}}}
	_, pl, err := asrPlan(req, params{seed: seed})
	if err != nil {
		return ""
	}
	return pl.output(stagepb.RoleText).Text
}
