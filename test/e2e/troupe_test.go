//go:build unix

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// modelName is the model of the default pipeline and of thinkerOnly.
const modelName = "troupe-omni-sim"

// The lines the binary prints once it is serving (cmd/troupe).
var (
	etcdServingRE = regexp.MustCompile(`^troupe etcd: serving clients on (http://\S+) `)
	headAPIRE     = regexp.MustCompile(`^troupe head: .* API on (http://\S+)$`)
	workerReadyRE = regexp.MustCompile(`^troupe worker: stage (\S+) replica (\d+) addr (\S+) `)
)

// startEtcd runs `troupe etcd` on free loopback ports with a temporary
// data dir and returns its client URL.
func startEtcd(t testing.TB) string {
	t.Helper()
	_, url := startEtcdProc(t)
	return url
}

// startEtcdProc is startEtcd that also returns the process, for tests
// that freeze or kill it.
func startEtcdProc(t testing.TB) (*proc, string) {
	t.Helper()
	p := startProc(t, "etcd", nil, "etcd",
		"--data-dir", filepath.Join(t.TempDir(), "etcd"),
		"--listen-client-urls", "http://127.0.0.1:0",
		"--listen-peer-urls", "http://127.0.0.1:0",
		"--log-level", "error")
	return p, p.waitLine(t, p.stdout, etcdServingRE)[1]
}

// thinkerOnly writes a one-stage pipeline file and returns its path.
func thinkerOnly(t testing.TB) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "pipeline.yaml")
	yaml := "model: " + modelName + "\nstages:\n  - name: thinker\n"
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// head is a running `troupe head` and a client for its API.
type head struct {
	*proc
	base   string // http://127.0.0.1:port
	client *http.Client
}

// startHead runs `troupe head` on a free loopback port against etcd and
// waits until its API listens.
func startHead(t testing.TB, etcd string, args ...string) *head {
	t.Helper()
	args = append([]string{"head", "--etcd-endpoints", etcd, "--http", "127.0.0.1:0", "--log-level", "warn"}, args...)
	p := startProc(t, "head", nil, args...)
	base := p.waitLine(t, p.stdout, headAPIRE)[1]
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &head{proc: p, base: base, client: &http.Client{Transport: tr}}
}

// worker is a running `troupe worker`, registered in etcd.
type worker struct {
	*proc
	replica uint32
	addr    string
}

// startWorker runs `troupe worker` for stage on a free loopback port and
// waits until it is registered (not until the head routes to it).
func startWorker(t testing.TB, etcd, stage string, args ...string) *worker {
	t.Helper()
	p := launchWorker(t, etcd, stage, args...)
	m := p.waitLine(t, p.stdout, workerReadyRE)
	id, err := strconv.ParseUint(m[2], 10, 32)
	if err != nil {
		t.Fatal(err)
	}
	return &worker{proc: p, replica: uint32(id), addr: m[3]}
}

// launchWorker starts `troupe worker` and returns at once.
func launchWorker(t testing.TB, etcd, stage string, args ...string) *proc {
	t.Helper()
	args = append([]string{"worker", "--etcd-endpoints", etcd, "--stage", stage, "--listen", "127.0.0.1:0", "--log-level", "warn"}, args...)
	return startProc(t, "worker "+stage, nil, args...)
}

// chatRequest is the body of POST /v1/chat/completions.
type chatRequest struct {
	Model         string         `json:"model"`
	Messages      []chatMessage  `json:"messages"`
	MaxTokens     int            `json:"max_tokens,omitempty"`
	Seed          *int64         `json:"seed,omitempty"`
	IgnoreEOS     bool           `json:"ignore_eos,omitempty"`
	Stream        bool           `json:"stream,omitempty"`
	StreamOptions map[string]any `json:"stream_options,omitempty"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func userPrompt(model, prompt string, maxTokens int) chatRequest {
	return chatRequest{Model: model, Messages: []chatMessage{{Role: "user", Content: prompt}}, MaxTokens: maxTokens}
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// chatCompletion is the part of the OpenAI response the tests read.
type chatCompletion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
}

// chat posts a non-streaming chat completion; anything but a 200 with one
// choice and a usage is an error.
func (h *head) chat(ctx context.Context, req chatRequest) (*chatCompletion, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	return postChat(ctx, h.client, h.base, body)
}

func postChat(ctx context.Context, client *http.Client, base string, body []byte) (*chatCompletion, error) {
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(hreq)
	if err != nil {
		return nil, errorf("chat: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, errorf("chat: reading the response: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, errorf("chat: %s: %s", resp.Status, bytes.TrimSpace(b))
	}
	var out chatCompletion
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, errorf("chat: %w: %s", err, b)
	}
	if len(out.Choices) != 1 || out.Usage == nil {
		return nil, errorf("chat: want one choice and a usage: %s", b)
	}
	return &out, nil
}

// stream is one streaming chat completion being read.
type stream struct {
	resp   *http.Response
	sc     *bufio.Scanner
	chunks int    // content chunks read so far
	text   string // content so far
	finish string
	usage  *usage
	done   bool // [DONE] seen
}

// chatStream starts a streaming chat completion with usage on its last
// chunk; the caller reads it with next and closes it.
func (h *head) chatStream(ctx context.Context, req chatRequest) (*stream, error) {
	req.Stream = true
	req.StreamOptions = map[string]any{"include_usage": true}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, h.base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := h.client.Do(hreq)
	if err != nil {
		return nil, errorf("stream: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return nil, errorf("stream: %s: %s", resp.Status, bytes.TrimSpace(b))
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		resp.Body.Close()
		return nil, errorf("stream: Content-Type %q, want text/event-stream", ct)
	}
	return &stream{resp: resp, sc: bufio.NewScanner(resp.Body)}, nil
}

func (s *stream) Close() error { return s.resp.Body.Close() }

// next reads up to the next content chunk; it returns false at [DONE].
func (s *stream) next() (bool, error) {
	for s.sc.Scan() {
		line := s.sc.Text()
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue // blank separators, comments
		}
		if data == "[DONE]" {
			s.done = true
			return false, nil
		}
		var c struct {
			Choices []struct {
				Delta struct {
					Content *string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *usage           `json:"usage"`
			Error *json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return false, errorf("stream: %w: %s", err, data)
		}
		if c.Error != nil {
			return false, errorf("stream: error event: %s", *c.Error)
		}
		if c.Usage != nil {
			s.usage = c.Usage
		}
		for _, ch := range c.Choices {
			if ch.FinishReason != nil {
				s.finish = *ch.FinishReason
			}
			if ch.Delta.Content != nil && *ch.Delta.Content != "" {
				s.text += *ch.Delta.Content
				s.chunks++
				return true, nil
			}
		}
	}
	if err := s.sc.Err(); err != nil {
		return false, errorf("stream: %w", err)
	}
	return false, errorf("stream: ended without [DONE] (finish %q, %d chunks)", s.finish, s.chunks)
}

// replicaRow is one row of GET /v1/replicas.
type replicaRow struct {
	Stage       int    `json:"stage"`
	StageName   string `json:"stage_name"`
	Replica     uint32 `json:"replica"`
	EngineIndex int    `json:"engine_index"`
	Addr        string `json:"addr"`
	State       string `json:"state"`
	JoinedAt    string `json:"joined_at"`
	InFlight    int64  `json:"in_flight"`
	// LeaseLostUntil is set while the record is gone but the replica serves.
	LeaseLostUntil *string `json:"lease_lost_until,omitempty"`
}

func (h *head) replicas(ctx context.Context) ([]replicaRow, error) {
	b, err := h.get(ctx, "/v1/replicas", "")
	if err != nil {
		return nil, err
	}
	var out struct {
		Data []replicaRow `json:"data"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, errorf("/v1/replicas: %w: %s", err, b)
	}
	return out.Data, nil
}

// replica returns the row of (stage, replica), if the head lists it.
func (h *head) replica(ctx context.Context, stage string, replica uint32) (replicaRow, bool, error) {
	rows, err := h.replicas(ctx)
	if err != nil {
		return replicaRow{}, false, err
	}
	for _, r := range rows {
		if r.StageName == stage && r.Replica == replica {
			return r, true, nil
		}
	}
	return replicaRow{}, false, nil
}

// waitState waits until (stage, replica) is listed in state.
func (h *head) waitState(ctx context.Context, t testing.TB, stage string, replica uint32, state string) replicaRow {
	t.Helper()
	var row replicaRow
	eventually(ctx, t, fmt.Sprintf("replica %s/%d %s", stage, replica, state), func() (bool, string, error) {
		r, ok, err := h.replica(ctx, stage, replica)
		if err != nil || !ok {
			return false, fmt.Sprintf("listed %v, err %v", ok, err), nil
		}
		row = r
		return r.State == state, "state " + r.State, nil
	})
	return row
}

// get returns the body of a 200 answer to GET path.
func (h *head) get(ctx context.Context, path, accept string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.base+path, nil)
	if err != nil {
		return nil, err
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return nil, errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, errorf("GET %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, errorf("GET %s: %s: %s", path, resp.Status, bytes.TrimSpace(b))
	}
	return b, nil
}

// metrics is one scrape of the head's /metrics.
type metrics map[string]*dto.MetricFamily

// scrape reads /metrics in the Prometheus text format, as a scraper that
// does not ask for OpenMetrics gets it.
func (h *head) scrape(ctx context.Context) (metrics, error) {
	b, err := h.get(ctx, "/metrics", "text/plain;version=0.0.4")
	if err != nil {
		return nil, err
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(bytes.NewReader(b))
	if err != nil {
		return nil, errorf("parsing /metrics: %w", err)
	}
	return mfs, nil
}

// value is the value of the one series of family whose labels include
// labels: a counter's or gauge's value, a histogram's sample count. ok is
// false when no series matches; more than one match is an error.
func (m metrics) value(family string, labels map[string]string) (v float64, ok bool, err error) {
	ms := m.series(family, labels)
	switch len(ms) {
	case 0:
		return 0, false, nil
	case 1:
		return sampleValue(ms[0]), true, nil
	}
	return 0, false, errorf("%s%v matches %d series", family, labels, len(ms))
}

// sum adds the values of every series of family whose labels include
// labels.
func (m metrics) sum(family string, labels map[string]string) float64 {
	var s float64
	for _, x := range m.series(family, labels) {
		s += sampleValue(x)
	}
	return s
}

func (m metrics) series(family string, labels map[string]string) []*dto.Metric {
	mf, ok := m[family]
	if !ok {
		return nil
	}
	var out []*dto.Metric
next:
	for _, x := range mf.GetMetric() {
		have := map[string]string{}
		for _, lp := range x.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		for k, v := range labels {
			if have[k] != v {
				continue next
			}
		}
		out = append(out, x)
	}
	return out
}

func sampleValue(x *dto.Metric) float64 {
	switch {
	case x.Counter != nil:
		return x.GetCounter().GetValue()
	case x.Gauge != nil:
		return x.GetGauge().GetValue()
	case x.Histogram != nil:
		return float64(x.GetHistogram().GetSampleCount())
	case x.Untyped != nil:
		return x.GetUntyped().GetValue()
	}
	return 0
}

// replicaLabels selects the series of replica r of stage 0.
func replicaLabels(r uint32, extra ...string) map[string]string {
	l := map[string]string{"stage": "0", "replica": strconv.FormatUint(uint64(r), 10)}
	for i := 0; i+1 < len(extra); i += 2 {
		l[extra[i]] = extra[i+1]
	}
	return l
}
