package httpapi

import (
	"encoding/binary"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tone is ms of a 440 Hz sine at amplitude amp (fraction of full scale),
// PCM16 at 24 kHz; amp 0 is silence.
func tone(ms int, amp float64) []byte {
	n := realtimeSampleRate * ms / 1000
	pcm := make([]byte, 2*n)
	for i := range n {
		s := amp * 32767 * math.Sin(2*math.Pi*440*float64(i)/realtimeSampleRate)
		binary.LittleEndian.PutUint16(pcm[2*i:], uint16(int16(s)))
	}
	return pcm
}

// TestVAD: speech starts at its first voiced frame less the prefix
// padding, survives a dip under the entry threshold (hysteresis), and
// stops where the silence that lasted silence_duration_ms began, whatever
// the chunking (odd byte splits included).
func TestVAD(t *testing.T) {
	var audio []byte
	audio = append(audio, tone(500, 0)...)     // silence
	audio = append(audio, tone(400, 0.2)...)   // speech: RMS 0.14 >= 0.05
	audio = append(audio, tone(100, 0.05)...)  // a dip: RMS 0.035, under entry, over stay
	audio = append(audio, tone(400, 0.2)...)   // speech
	audio = append(audio, tone(1000, 0.01)...) // quiet: RMS 0.007
	for _, chunk := range []int{len(audio), 4800, 999, 1} {
		v := newVAD(realtimeSampleRate, &rtTurnDetection{Type: "server_vad"})
		var got []vadEvent
		var startMs, stopMs int64
		for off := 0; off < len(audio); off += chunk {
			v.feed(audio[off:min(off+chunk, len(audio))], func(e vadEvent) {
				got = append(got, e)
				startMs, stopMs = v.startMs, v.stopMs
			})
		}
		require.Equal(t, []vadEvent{vadStarted, vadStopped}, got, "chunk %d", chunk)
		assert.Equal(t, int64(200), startMs, "500 ms less 300 ms of prefix padding")
		assert.Equal(t, int64(1400), stopMs)
	}
}

// BenchmarkVAD: the detector's cost per second of audio, fed in 20 ms
// appends as clients send it; core_%/session is the share of one core a
// session's VAD takes.
func BenchmarkVAD(b *testing.B) {
	second := tone(1000, 0.2)
	v := newVAD(realtimeSampleRate, &rtTurnDetection{Type: "server_vad"})
	on := func(vadEvent) {}
	b.SetBytes(int64(len(second)))
	b.ResetTimer()
	start := time.Now()
	for b.Loop() {
		for off := 0; off < len(second); off += 960 {
			v.feed(second[off:off+960], on)
		}
	}
	perSecond := time.Since(start) / time.Duration(b.N)
	b.ReportMetric(100*perSecond.Seconds(), "core_%/session")
}
