package httpapi

// vad is server_vad: voice activity detection on the client's PCM16 audio
// by the energy of 20 ms frames, with hysteresis. A frame is voiced when
// its RMS, as a fraction of full scale, is at least threshold/10 (0.5:
// 5 % of full scale, about -26 dBFS); once speech has started, frames stay
// voiced down to half that, so speech that dips briefly does not end.
// Speech stops after silenceMs of unvoiced frames. Speech start is reported
// prefixPaddingMs before the first voiced frame (not before the buffer's
// start). A vad is owned by one session's reader: not safe for concurrent
// use.
type vad struct {
	rate            int
	enter, stay     float64 // mean-square thresholds, in units of full scale²
	silenceSamples  int64
	prefixSamples   int64
	frame           []int16 // the current frame's samples so far
	frameSamples    int
	sample          int64 // samples seen, over the whole buffer
	speaking        bool
	silentSince     int64 // first sample of the current unvoiced run
	odd             []byte
	startMs, stopMs int64
}

// vadEvent is what one append of audio caused.
type vadEvent int

const (
	vadNone vadEvent = iota
	vadStarted
	vadStopped
)

func newVAD(rate int, td *rtTurnDetection) *vad {
	threshold, prefix, silence := 0.5, 300, 500
	if td.Threshold != nil {
		threshold = *td.Threshold
	}
	if td.PrefixPaddingMs != nil {
		prefix = *td.PrefixPaddingMs
	}
	if td.SilenceDurationMs != nil {
		silence = *td.SilenceDurationMs
	}
	rms := threshold / 10
	return &vad{
		rate:           rate,
		enter:          rms * rms,
		stay:           rms * rms / 4,
		silenceSamples: int64(silence) * int64(rate) / 1000,
		prefixSamples:  int64(prefix) * int64(rate) / 1000,
		frameSamples:   rate / 50,
		frame:          make([]int16, 0, rate/50),
	}
}

// feed runs pcm through the detector and returns the events it caused, in
// order (at most a start then a stop, or a stop then a start, per frame).
func (v *vad) feed(pcm []byte, on func(vadEvent)) {
	if len(v.odd) > 0 {
		pcm = append(v.odd, pcm...)
		v.odd = v.odd[:0]
	}
	for i := 0; i+1 < len(pcm); i += 2 {
		v.frame = append(v.frame, int16(uint16(pcm[i])|uint16(pcm[i+1])<<8))
		if len(v.frame) == v.frameSamples {
			v.endFrame(on)
		}
	}
	if len(pcm)%2 == 1 {
		v.odd = append(v.odd, pcm[len(pcm)-1])
	}
}

func (v *vad) endFrame(on func(vadEvent)) {
	var sum float64
	for _, s := range v.frame {
		f := float64(s) / 32768
		sum += f * f
	}
	ms := sum / float64(len(v.frame))
	first := v.sample
	v.sample += int64(len(v.frame))
	v.frame = v.frame[:0]
	switch {
	case !v.speaking && ms >= v.enter:
		v.speaking, v.silentSince = true, -1
		v.startMs = max(0, first-v.prefixSamples) * 1000 / int64(v.rate)
		on(vadStarted)
	case v.speaking && ms >= v.stay:
		v.silentSince = -1
	case v.speaking:
		if v.silentSince < 0 {
			v.silentSince = first
		}
		if v.sample-v.silentSince >= v.silenceSamples {
			v.speaking = false
			v.stopMs = v.silentSince * 1000 / int64(v.rate)
			on(vadStopped)
		}
	}
}

// reset forgets the buffer (input_audio_buffer.clear or .commit).
func (v *vad) reset() {
	v.frame, v.odd = v.frame[:0], v.odd[:0]
	v.sample, v.speaking = 0, false
}
