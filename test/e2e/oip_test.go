//go:build unix

package e2e

import (
	"context"
	"encoding/base64"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// python is Debian's Python with grpcio, protobuf and numpy (scripts/test.sh
// installs them); the engines of worker/python run on it.
const python = "/usr/bin/python3"

var engineServingRE = regexp.MustCompile(`troupe_engine: serving model (\S+) on (\S+)`)

// repoRoot is the repository's root, where worker/python lives.
func repoRoot(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	require.NoError(t, err)
	return strings.TrimSpace(string(out))
}

// requirePython skips without the Python engines' dependencies, except under
// CI, where their absence is a failure.
func requirePython(t testing.TB) {
	t.Helper()
	if err := exec.Command(python, "-c", "import grpc, google.protobuf, numpy").Run(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("e2e: %s cannot import grpc, protobuf and numpy (Debian: python3-grpcio python3-protobuf python3-numpy): %v", python, err)
		}
		t.Skipf("e2e: %s without grpc, protobuf or numpy: %v", python, err)
	}
}

// omniStage runs one stage of worker/python/examples/omni_numpy.py on a
// unix socket and a `troupe worker --engine oip` in front of it.
func omniStage(t testing.TB, etcd, stage string, args ...string) (*worker, *proc) {
	t.Helper()
	root := repoRoot(t)
	dir, err := os.MkdirTemp("", "oip") // short: a socket's path has at most 107 bytes
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := "unix://" + filepath.Join(dir, stage+".sock")
	eng := startExec(t, "omni "+stage, python, []string{"PYTHONPATH=" + filepath.Join(root, "worker/python")},
		append([]string{filepath.Join(root, "worker/python/examples/omni_numpy.py"), "--stage", stage, "--listen", sock, "--width", "256"}, args...)...)
	eng.waitLine(t, eng.stderr, engineServingRE)
	w := startWorker(t, etcd, stage, "--replica-id", "auto", "--engine", "oip", "--upstream", sock, "--model", stage)
	return w, eng
}

// omniChain is what the three stages make chained in one Python process.
func omniChain(t testing.TB, prompt string, maxTokens string) (string, []byte) {
	t.Helper()
	root := repoRoot(t)
	dir := t.TempDir()
	cmd := exec.Command(python, filepath.Join(root, "worker/python/examples/omni_chain.py"), "--prompt", prompt, "--max-tokens", maxTokens,
		"--width", "256", "--out-pcm", filepath.Join(dir, "out.pcm"), "--out-text", filepath.Join(dir, "out.txt"))
	cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join(root, "worker/python"))
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	pcm, err := os.ReadFile(filepath.Join(dir, "out.pcm"))
	require.NoError(t, err)
	text, err := os.ReadFile(filepath.Join(dir, "out.txt"))
	require.NoError(t, err)
	return string(text), pcm
}

// streamOmni sends a streamed chat with audio and returns its text, its
// audio and, when onAudio is set, calls it after the first audio delta.
func streamOmni(ctx context.Context, t testing.TB, h *head, prompt string, maxTokens int64, onAudio func()) (string, []byte) {
	t.Helper()
	client := oa.NewClient(option.WithBaseURL(h.base+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(h.client), option.WithMaxRetries(0))
	stream := client.Chat.Completions.NewStreaming(ctx, oa.ChatCompletionNewParams{
		Model:      modelName,
		Messages:   []oa.ChatCompletionMessageParamUnion{oa.UserMessage(prompt)},
		MaxTokens:  oa.Int(maxTokens),
		Modalities: []string{"text", "audio"},
		Audio:      oa.ChatCompletionAudioParam{Voice: oa.ChatCompletionAudioParamVoiceUnion{OfString: oa.String("alloy")}, Format: "pcm16"},
	})
	var text strings.Builder
	var pcm []byte
	for stream.Next() {
		for _, ch := range stream.Current().Choices {
			text.WriteString(ch.Delta.Content)
			if ch.Delta.Audio.Data == "" {
				continue
			}
			b, err := base64.StdEncoding.DecodeString(ch.Delta.Audio.Data)
			require.NoError(t, err)
			if len(pcm) == 0 && onAudio != nil {
				onAudio()
			}
			pcm = append(pcm, b...)
		}
	}
	require.NoError(t, stream.Err())
	return text.String(), pcm
}

// omniPipeline writes the pipeline file of the example: thinker → talker
// (the thinker's hidden states) → vocoder.
func omniPipeline(t testing.TB) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "pipeline.yaml")
	yaml := "model: " + modelName + "\nstages:\n  - name: thinker\n  - name: talker\n  - name: vocoder\n"
	require.NoError(t, os.WriteFile(path, []byte(yaml), 0o600))
	return path
}

// TestOIPOmniPipeline: three `troupe worker --engine oip` in front of the
// three numpy stages of omni_numpy.py (Python, over the Open Inference
// Protocol), one head: a streamed chat with audio through the official
// client returns the text and audio the same stages make chained in one
// Python process, the thinker's hidden states having gone to the talker
// worker to worker. Then a talker's worker is killed (SIGKILL) mid-request:
// the answer is still whole and equal, from the other talker.
func TestOIPOmniPipeline(t *testing.T) {
	requireBinary(t)
	requirePython(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	h := startHead(t, etcd, "--pipeline", omniPipeline(t))
	th, _ := omniStage(t, etcd, "thinker", "--delay-ms", "15")
	talkers := map[uint32]*worker{}
	for range 2 {
		w, _ := omniStage(t, etcd, "talker")
		talkers[w.replica] = w
	}
	voc, _ := omniStage(t, etcd, "vocoder")
	h.waitState(ctx, t, "thinker", th.replica, "attached")
	for id := range talkers {
		h.waitState(ctx, t, "talker", id, "attached")
	}
	h.waitState(ctx, t, "vocoder", voc.replica, "attached")

	wantText, wantPCM := omniChain(t, "hello", "24")
	require.NotEmpty(t, wantPCM)
	text, pcm := streamOmni(ctx, t, h, "hello", 24, nil)
	assert.Equal(t, wantText, text)
	assert.Equal(t, len(wantPCM), len(pcm))
	assert.True(t, wantPCM != nil && string(wantPCM) == string(pcm), "the audio equals the chained stages'")

	killed := false
	text, pcm = streamOmni(ctx, t, h, "hello", 24, func() {
		rows, err := h.replicas(ctx)
		require.NoError(t, err)
		for _, r := range rows {
			if r.StageName == "talker" && r.InFlight > 0 {
				talkers[r.Replica].kill(t)
				killed = true
				return
			}
		}
	})
	require.True(t, killed, "a talker was serving the request when its worker was killed")
	assert.Equal(t, wantText, text)
	assert.True(t, string(wantPCM) == string(pcm), "after the kill: %d bytes of audio, want %d", len(pcm), len(wantPCM))
}
