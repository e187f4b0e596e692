package orchestrator

import (
	"testing"

	"gopkg.in/yaml.v3"
)

// FuzzParsePipeline: any file either parses into a pipeline that validates
// and survives a write and re-read, or is refused with an error.
func FuzzParsePipeline(f *testing.F) {
	for _, s := range []string{
		"model: troupe\nstages:\n  - name: thinker\n  - name: talker\n  - name: vocoder\n",
		"model: m\nstreaming: false\nstages:\n  - name: a\n    input_chunk: 4\n    policy: prefix-aware\n    prefix_source: prompt\n    session_affinity: false\n",
		"model: m\nstages: []\n",
		"model: m\nstages:\n  - name: a\n  - name: a\n",
		"model: m\nstages:\n  - {name: a, input_chunk: -1}\n",
		"model: m\nstages:\n  - name: a\n    polcy: x\n",
		"a: &a [*a, *a]\n",
		"model: &m x\nstages:\n  - name: *m\n",
		"---\n---\n", "", "model: [",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := ParsePipeline(data)
		if err != nil {
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("parsed a pipeline that does not validate: %v", err)
		}
		out, err := yaml.Marshal(p)
		if err != nil {
			t.Fatalf("parsed pipeline does not encode: %v", err)
		}
		if _, err := ParsePipeline(out); err != nil {
			t.Fatalf("re-encoded pipeline refused: %v\n%s", err, out)
		}
	})
}
