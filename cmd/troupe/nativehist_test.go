package main

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// protobufAccept is what Prometheus sends with --enable-feature=native-histograms.
const protobufAccept = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7,text/plain;version=0.0.4;q=0.3"

// TestUpServesNativeHistograms: a scraper that prefers protobuf (Prometheus
// with native histograms on) gets the per-replica histograms with native
// buckets beside the classic ones, through the head's /metrics; one that
// asks for text gets text, as before.
func TestUpServesNativeHistograms(t *testing.T) {
	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error")
	base := up.wait(t, apiRE)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	client := openai.NewClient(option.WithBaseURL(base+"/v1"), option.WithAPIKey("unused"))
	_, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:    "troupe-omni-sim",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("native histograms, please")},
	})
	require.NoError(t, err)

	scrape := func(accept string) *http.Response {
		req, err := http.NewRequestWithContext(ctx, "GET", base+"/metrics", nil)
		require.NoError(t, err)
		req.Header.Set("Accept", accept)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		t.Cleanup(func() { resp.Body.Close() })
		require.Equal(t, http.StatusOK, resp.StatusCode)
		return resp
	}
	resp := scrape(protobufAccept)
	require.Equal(t, expfmt.TypeProtoDelim, expfmt.ResponseFormat(resp.Header).FormatType(), resp.Header.Get("Content-Type"))
	dec := expfmt.NewDecoder(resp.Body, expfmt.ResponseFormat(resp.Header))
	families := map[string]*dto.MetricFamily{}
	for {
		mf := &dto.MetricFamily{}
		if err := dec.Decode(mf); err != nil {
			break
		}
		families[mf.GetName()] = mf
	}
	require.Contains(t, families, "troupe_http_requests_total", "the gathered families too")
	ttft := families["troupe_time_to_first_token_seconds"]
	require.NotNil(t, ttft, "the per-replica stats")
	native := 0
	for _, m := range ttft.GetMetric() {
		h := m.GetHistogram()
		if h.GetSampleCount() == 0 {
			continue
		}
		assert.NotEmpty(t, h.GetBucket(), "the classic buckets stay")
		if len(h.GetPositiveSpan()) > 0 {
			assert.Equal(t, h.GetSampleCount(), nativeCount(h), "native buckets add up to the count")
			native++
		}
	}
	assert.Positive(t, native, "a replica that served has native buckets")

	text := scrape("text/plain;version=0.0.4")
	assert.True(t, strings.HasPrefix(text.Header.Get("Content-Type"), "text/plain"), text.Header.Get("Content-Type"))
}

// nativeCount sums a native histogram's buckets (deltas) and its zero bucket.
func nativeCount(h *dto.Histogram) uint64 {
	n, v := h.GetZeroCount(), int64(0)
	for _, d := range h.GetPositiveDelta() {
		v += d
		n += uint64(v)
	}
	v = 0
	for _, d := range h.GetNegativeDelta() {
		v += d
		n += uint64(v)
	}
	return n
}
