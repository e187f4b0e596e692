package oip

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	pmodel "github.com/prometheus/common/model"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// PendingMetric is Triton's per-model gauge of the requests it has received
// and no backend has started executing yet: its queue.
const PendingMetric = "nv_inference_pending_request_count"

// maxMetricsBytes bounds one scrape's body.
const maxMetricsBytes = 16 << 20

// CheckMetricsURL checks a metrics URL: http or https, with a host.
func CheckMetricsURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") {
		return fmt.Errorf("oip: upstream metrics %q: want an http or https URL, e.g. http://127.0.0.1:8002/metrics", raw)
	}
	if u.Host == "" {
		return fmt.Errorf("oip: upstream metrics %q: no host", raw)
	}
	return nil
}

// ParsePending reads Prometheus text exposition (format 0.0.4) with the
// Prometheus parser and returns Triton's pending request count of model:
// the sum of PendingMetric's series whose model label is model (one per
// loaded version). ok is false when there is no such series.
func ParsePending(r io.Reader, modelName string) (pending float64, ok bool, err error) {
	p := expfmt.NewTextParser(pmodel.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return 0, false, fmt.Errorf("oip: parse metrics: %w", err)
	}
	for _, m := range fams[PendingMetric].GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "model" && lp.GetValue() == modelName {
				pending += value(m)
				ok = true
			}
		}
	}
	return pending, ok, nil
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	}
	return 0
}

// scraped is one good scrape of the engine's metrics and when it was read.
type scraped struct {
	pending float64
	at      time.Time
}

// scrapeState is what only Run's goroutine touches: what was last logged.
type scrapeState struct {
	failing  bool // the latest scrape failed (logged once a streak)
	noSeries bool // the latest good scrape had no series of the model
	logged   bool // a good scrape with the series was logged
}

// scrape reads MetricsURL (when set) into the load Health reports. A
// scrape that fails, or finds no series of the model, leaves the load to
// what this worker has in flight until one succeeds; it never touches the
// engine's availability.
func (e *Engine) scrape(ctx context.Context) {
	if e.cfg.MetricsURL == "" {
		return
	}
	pending, ok, err := e.readPending(ctx)
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		e.scraped.Store(nil)
		if !e.scrapeState.failing {
			e.scrapeState.failing = true
			e.log.Warn("oip: metrics scrape failed; load is what this worker has in flight until one succeeds", "url", e.cfg.MetricsURL, "err", err)
		} else {
			e.log.Debug("oip: metrics scrape failed", "url", e.cfg.MetricsURL, "err", err)
		}
		return
	}
	if e.scrapeState.failing {
		e.scrapeState.failing = false
		e.log.Info("oip: metrics scrape answers again", "url", e.cfg.MetricsURL)
	}
	if !ok {
		e.scraped.Store(nil)
		if !e.scrapeState.noSeries {
			e.scrapeState.noSeries = true
			e.log.Info("oip: the engine's metrics have no "+PendingMetric+" of the model; load is what this worker has in flight", "url", e.cfg.MetricsURL, "model", e.cfg.Model)
		}
		return
	}
	if e.scrapeState.noSeries || !e.scrapeState.logged {
		e.scrapeState.noSeries, e.scrapeState.logged = false, true
		e.log.Info("oip: scraping the engine's metrics", "url", e.cfg.MetricsURL, "model", e.cfg.Model)
	}
	e.scraped.Store(&scraped{pending: pending, at: time.Now()})
}

// readPending GETs MetricsURL and parses the model's pending count.
func (e *Engine) readPending(ctx context.Context) (float64, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, e.checkTimeout())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.cfg.MetricsURL, nil)
	if err != nil {
		return 0, false, err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := e.http.Do(req)
	if err != nil {
		return 0, false, err
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxMetricsBytes))
		_ = resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return 0, false, fmt.Errorf("GET %s: %s", e.cfg.MetricsURL, resp.Status)
	}
	return ParsePending(io.LimitReader(resp.Body, maxMetricsBytes), e.cfg.Model)
}

// gauges is the load. Without a good scrape (no MetricsURL, a scrape that
// failed, no series of the model): the requests this worker has in
// flight, all running (the worker queues none; the protocol does not say
// what the engine queues). With one: Triton's pending count of the model
// as waiting, and as running those of this worker's requests in flight
// that the pending count does not already hold, dated by the scrape.
func (e *Engine) gauges() *stagepb.EngineStats {
	inFlight := uint32(max(e.inFlight.Load(), 0))
	s := e.scraped.Load()
	if s == nil {
		return &stagepb.EngineStats{NumRequestsRunning: inFlight}
	}
	waiting := uint32(min(max(s.pending, 0), math.MaxUint32))
	return &stagepb.EngineStats{
		NumRequestsRunning:         inFlight - min(inFlight, waiting),
		NumRequestsWaitingCapacity: waiting,
		GaugesAgeMs:                uint32(min(max(time.Since(s.at).Milliseconds(), 0), math.MaxUint32)),
	}
}
