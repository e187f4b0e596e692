package httpapi

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
)

// Audio in: every audio a client sends (a transcription's file, a chat's
// input_audio part or audio data: URL, a realtime append or input_audio
// item) is checked before any stage runs, so that an engine never gets a
// header it would misread (a 4 GiB data size, 65,535 channels) and a
// client learns what is wrong with its file rather than getting a
// transcript of noise. docs/api.md, "Audio in", lists what is taken.

// audioError is audio that is not what it claims to be; reason is what the
// client is told.
type audioError struct{ reason string }

func (e *audioError) Error() string { return "httpapi: audio: " + e.reason }

func audioErrorf(format string, args ...any) error {
	return &audioError{reason: fmt.Sprintf(format, args...)}
}

// invalidAudio is the 400 of audio at param that checkAudio refused.
func invalidAudio(param string, err error) *apiError {
	reason := err.Error()
	if ae, ok := errors.AsType[*audioError](err); ok {
		reason = ae.reason
	}
	return badRequest(param, "invalid_audio", "%q is not audio troupe takes: %s (docs/api.md, Audio in)", param, reason)
}

// checkAudio checks audio b (not empty) that its sender says is of format
// (input_audio's format, a transcription file's extension, a data: URL's
// media type made one of these): a WAV file, or any file that starts as a
// WAV file does, is read whole (readWAV); pcm16 is raw samples
// (checkPCM16); a compressed format must start as one does. troupe does
// not decode compressed audio: the engine does.
func checkAudio(format string, b []byte) error {
	switch {
	case format == "pcm16":
		return checkPCM16(b)
	case format == "wav" || containerOf(b) == "WAV":
		_, err := readWAV(b)
		return err
	case sniffAudio(b) == "":
		return audioErrorf("not an audio file: it starts with %q, as no WAV, MP3, FLAC, Ogg, WebM, MP4 or AAC file does", b[:min(len(b), 8)])
	}
	return nil
}

// checkPCM16 checks raw PCM16 samples (not empty): whole samples, and not
// an audio file whose header would be played as samples.
func checkPCM16(b []byte) error {
	if c := containerOf(b); c != "" {
		return audioErrorf("a %s file where raw PCM16 samples are expected: send the samples without the file's header", c)
	}
	if len(b)%2 != 0 {
		return audioErrorf("%d bytes are not a whole number of 16-bit samples", len(b))
	}
	return nil
}

// containerOf names the audio file format whose signature of 4 bytes or
// more b starts with; "" when none does. Raw samples start with such bytes
// by chance once in 2^32 appends or more.
func containerOf(b []byte) string {
	switch {
	case len(b) < 4:
		return ""
	case bytes.HasPrefix(b, []byte("RIFF")), bytes.HasPrefix(b, []byte("RIFX")), bytes.HasPrefix(b, []byte("RF64")):
		return "WAV"
	case bytes.HasPrefix(b, []byte("fLaC")):
		return "FLAC"
	case bytes.HasPrefix(b, []byte("OggS")):
		return "Ogg"
	case bytes.HasPrefix(b, []byte("\x1a\x45\xdf\xa3")):
		return "WebM"
	case len(b) >= 8 && string(b[4:8]) == "ftyp":
		return "MP4"
	}
	return ""
}

// sniffAudio names the audio file format b starts as: containerOf's, or
// the shorter signatures of MP3 (an ID3 tag, or an MPEG audio frame's
// sync) and AAC (ADTS or ADIF); "" when none.
func sniffAudio(b []byte) string {
	if c := containerOf(b); c != "" {
		return c
	}
	switch {
	case bytes.HasPrefix(b, []byte("ID3")):
		return "MP3"
	case bytes.HasPrefix(b, []byte("ADIF")):
		return "AAC"
	case len(b) < 2 || b[0] != 0xff:
		return ""
	case b[1]&0xf6 == 0xf0: // 12 sync bits, layer 0: ADTS
		return "AAC"
	case b[1]&0xe0 == 0xe0 && b[1]&0x06 != 0: // 11 sync bits, a layer: MPEG audio
		return "MP3"
	}
	return ""
}

// audioFormatOfMIME is the format checkAudio takes a data: URL's media
// type for: wav or pcm16 when it says so, else "" (whatever the bytes
// start as).
func audioFormatOfMIME(mime string) string {
	switch strings.ToLower(mime) {
	case "audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave":
		return "wav"
	case "audio/pcm", "audio/l16":
		return "pcm16"
	}
	return ""
}
