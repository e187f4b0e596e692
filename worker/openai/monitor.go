package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// ErrModelNotFound is wrapped by Run when the upstream does not serve the
// configured model: a startup error, not something to wait for.
var ErrModelNotFound = errors.New("openai: model not found")

// errFatal marks check errors that waiting will not fix.
type errFatal struct{ err error }

func (e errFatal) Error() string { return e.err.Error() }
func (e errFatal) Unwrap() error { return e.err }

// Run watches the upstream until ctx ends. First it waits, at most
// ReadyTimeout, until the upstream answers its health endpoint and lists
// the model (logging the wait); it fails at once when the model is not
// listed or the API key is refused. Then, every HealthInterval, it checks
// the upstream and scrapes its metrics: HealthFailures failed checks in a
// row make the engine unavailable, the next success makes it available
// again. Run returns nil when ctx ends. Call it once.
func (u *upstream) Run(ctx context.Context) error {
	if err := u.waitReady(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	u.log.Info("openai: upstream ready", "url", u.base, "model", u.Model())
	u.initialSleepState(ctx)
	u.scrape(ctx)
	u.setAvailable(true, "")

	tick := time.NewTicker(u.cfg.HealthInterval)
	defer tick.Stop()
	failures := 0
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		err := u.check(ctx)
		u.scrape(ctx)
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case err == nil:
			if failures >= u.cfg.HealthFailures {
				u.log.Info("openai: upstream healthy again", "url", u.base, "after_failures", failures)
			}
			failures = 0
			u.setAvailable(true, "")
		default:
			failures++
			u.log.Debug("openai: upstream health check failed", "url", u.root, "failures", failures, "err", err)
			if failures == u.cfg.HealthFailures {
				u.log.Warn("openai: upstream unhealthy; leaving rotation", "url", u.root, "failures", failures, "err", err)
			}
			if failures >= u.cfg.HealthFailures {
				u.setAvailable(false, fmt.Sprintf("%d health checks failed in a row: %v", failures, err))
			}
		}
	}
}

// waitReady polls until the first successful check.
func (u *upstream) waitReady(ctx context.Context) error {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, u.cfg.ReadyTimeout)
	defer cancel()
	tick := time.NewTicker(readyPoll)
	defer tick.Stop()
	var lastLog time.Time
	var lastErr error // the last check that failed on its own, not cut by the deadline
	for {
		err := u.check(ctx)
		if err == nil {
			return nil
		}
		if fe := (errFatal{}); errors.As(err, &fe) {
			return fe.err
		}
		if ctx.Err() == nil || lastErr == nil {
			lastErr = err
		}
		u.setAvailable(false, "not ready: "+lastErr.Error())
		if time.Since(lastLog) >= readyLogEvery {
			lastLog = time.Now()
			u.log.Info("openai: waiting for the upstream to be ready", "url", u.base,
				"waited", time.Since(start).Round(time.Second), "timeout", u.cfg.ReadyTimeout, "last_err", err)
		}
		select {
		case <-ctx.Done():
			if ctx.Err() == context.DeadlineExceeded {
				return fmt.Errorf("openai: upstream %s not ready after %s (--upstream-ready-timeout): %w", u.base, u.cfg.ReadyTimeout, lastErr)
			}
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// checkTimeout bounds one health check or scrape.
func (u *upstream) checkTimeout() time.Duration { return max(u.cfg.HealthInterval, 2*time.Second) }

// check asks the upstream's health endpoint (when it has one) and its
// model list, which must hold the model; with no configured model it
// resolves the model to the first one listed.
func (u *upstream) check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, u.checkTimeout())
	defer cancel()
	if !u.noHealth.Load() {
		code, err := u.get(ctx, u.root+"/health", nil)
		switch {
		case err != nil:
			return err
		case code == http.StatusNotFound || code == http.StatusMethodNotAllowed:
			// Ollama and others have none: the model list is the check.
			u.noHealth.Store(true)
			u.log.Info("openai: upstream has no /health endpoint; checking /v1/models only", "url", u.root)
		case code != http.StatusOK:
			return fmt.Errorf("GET /health: %d %s", code, http.StatusText(code))
		}
	}
	var list struct {
		Data []struct {
			ID      string `json:"id"`
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	code, err := u.get(ctx, u.base+"/models", &list)
	switch {
	case err != nil:
		return err
	case code == http.StatusUnauthorized || code == http.StatusForbidden:
		return errFatal{fmt.Errorf("openai: upstream %s refused the API key (GET /v1/models: %d): set TROUPE_UPSTREAM_API_KEY or --upstream-api-key-file", u.base, code)}
	case code != http.StatusOK:
		return fmt.Errorf("GET /v1/models: %d %s", code, http.StatusText(code))
	case len(list.Data) == 0:
		return errors.New("GET /v1/models lists no model yet")
	}
	ids := make([]string, len(list.Data))
	for i, m := range list.Data {
		ids[i] = m.ID
	}
	want := u.Model()
	if want == "" {
		u.model.Store(&ids[0])
		want = ids[0]
	}
	i := slices.Index(ids, want)
	if i < 0 {
		return errFatal{fmt.Errorf("%w: upstream %s does not serve model %q (it lists %q); check --upstream-model", ErrModelNotFound, u.base, want, ids)}
	}
	u.ownedBy.Store(&list.Data[i].OwnedBy)
	return nil
}

// get fetches url and decodes a 200 JSON body into v (when not nil). It
// returns the status code; err is for transport and decoding failures.
func (u *upstream) get(ctx context.Context, url string, v any) (int, error) {
	req, err := u.newRequest(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := u.do(req)
	if err != nil {
		return 0, fmt.Errorf("GET %s: %w", req.URL.Path, err)
	}
	defer closeBody(resp)
	if resp.StatusCode == http.StatusOK && v != nil {
		if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
			return resp.StatusCode, fmt.Errorf("GET %s: decode: %w", req.URL.Path, err)
		}
	}
	return resp.StatusCode, nil
}

// scrape reads the upstream's /metrics (at the server root) into the load
// gauges and the pending prefix-cache and multimodal-cache counters. A
// scrape that fails keeps the previous load; an upstream without /metrics
// reports zeros.
func (u *upstream) scrape(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, u.checkTimeout())
	defer cancel()
	req, err := u.newRequest(ctx, http.MethodGet, u.root+"/metrics", nil)
	if err != nil {
		return
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	start := time.Now()
	resp, err := u.do(req)
	if err != nil {
		if !u.scrapeFailing.Swap(true) && u.load.Load() != nil {
			u.log.Warn("openai: metrics scrape failed; the load reported to heads ages until one succeeds", "url", u.root+"/metrics", "err", err)
		}
		return
	}
	if u.scrapeFailing.Swap(false) {
		u.log.Info("openai: metrics scrape answers again", "url", u.root+"/metrics")
	}
	defer closeBody(resp)
	if resp.StatusCode != http.StatusOK {
		if !u.noMetrics.Swap(true) {
			u.log.Info("openai: upstream exposes no Prometheus metrics; load is what this worker has in flight", "url", u.root+"/metrics", "status", resp.StatusCode)
		}
		return
	}
	l, err := ParseMetrics(resp.Body, u.Model())
	if err != nil {
		u.log.Warn("openai: cannot parse the upstream's metrics", "url", u.root+"/metrics", "err", err)
		return
	}
	if u.noMetrics.Swap(false) || u.load.Load() == nil {
		u.log.Info("openai: scraping the upstream's metrics", "url", u.root+"/metrics", "engine", l.Engine)
	}
	if prev := u.load.Load(); prev != nil && l.HasPrefixCounters && prev.HasPrefixCounters {
		u.pendingQueries.Add(counterDelta(prev.PrefixCacheQueries, l.PrefixCacheQueries))
		u.pendingHits.Add(counterDelta(prev.PrefixCacheHits, l.PrefixCacheHits))
	}
	if prev := u.load.Load(); prev != nil && l.HasMMCounters && prev.HasMMCounters {
		u.pendingMMQueries.Add(counterDelta(prev.MMCacheQueries, l.MMCacheQueries))
		u.pendingMMHits.Add(counterDelta(prev.MMCacheHits, l.MMCacheHits))
	}
	u.load.Store(&scraped{Load: l, at: start})
}

// counterDelta is a counter's increase between two scrapes; after a reset
// (the upstream restarted) the new value is the increase.
func counterDelta(prev, cur float64) uint64 {
	if cur < prev {
		return uint64(cur)
	}
	return uint64(cur) - uint64(prev)
}

// initialSleepState asks vLLM's /is_sleeping, so a worker that starts in
// front of a sleeping upstream reports it (as level 1: vLLM does not say
// which level). Upstreams without the endpoint are awake.
func (u *upstream) initialSleepState(ctx context.Context) {
	if asleep, err := u.isSleeping(ctx); err == nil && asleep {
		u.sleep.Store(int32(stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED))
		u.log.Info("openai: the upstream is asleep")
	}
}

func (u *upstream) isSleeping(ctx context.Context) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, u.checkTimeout())
	defer cancel()
	var v struct {
		IsSleeping bool `json:"is_sleeping"`
	}
	code, err := u.get(ctx, u.root+"/is_sleeping", &v)
	if err != nil {
		return false, err
	}
	if code != http.StatusOK {
		return false, fmt.Errorf("GET /is_sleeping: %d", code)
	}
	return v.IsSleeping, nil
}

// Sleep calls vLLM's POST /sleep?level=N, then checks /is_sleeping. An
// upstream without sleep mode (404) fails with Unimplemented.
func (u *upstream) Sleep(ctx context.Context, level int) (stagepb.SleepState, error) {
	cur := stagepb.SleepState(u.sleep.Load())
	if level != 1 && level != 2 {
		return cur, status.Errorf(codes.InvalidArgument, "openai: sleep level must be 1 or 2, got %d", level)
	}
	if err := u.admin(ctx, "/sleep?level="+strconv.Itoa(level)); err != nil {
		return cur, err
	}
	if asleep, err := u.isSleeping(ctx); err == nil && !asleep {
		return cur, status.Errorf(codes.Internal, "openai: upstream %s answered POST /sleep but /is_sleeping says it is awake", u.root)
	}
	st := stagepb.SleepState(level)
	u.sleep.Store(int32(st))
	u.log.Info("openai: upstream asleep", "sleep_state", sleepName(st))
	return st, nil
}

// WakeUp calls vLLM's POST /wake_up. An upstream without sleep mode (404)
// fails with Unimplemented.
func (u *upstream) WakeUp(ctx context.Context) (stagepb.SleepState, error) {
	if err := u.admin(ctx, "/wake_up"); err != nil {
		return stagepb.SleepState(u.sleep.Load()), err
	}
	if asleep, err := u.isSleeping(ctx); err == nil && asleep {
		return stagepb.SleepState(u.sleep.Load()), status.Errorf(codes.Internal, "openai: upstream %s answered POST /wake_up but /is_sleeping says it still sleeps", u.root)
	}
	u.sleep.Store(int32(stagepb.SleepState_SLEEP_STATE_AWAKE))
	u.log.Info("openai: upstream awake")
	return stagepb.SleepState_SLEEP_STATE_AWAKE, nil
}

// admin posts to a sleep-mode endpoint at the server root.
func (u *upstream) admin(ctx context.Context, path string) error {
	req, err := u.newRequest(ctx, http.MethodPost, u.root+path, nil)
	if err != nil {
		return err
	}
	resp, err := u.do(req)
	if err != nil {
		return err
	}
	defer closeBody(resp)
	switch {
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed:
		// The message reaches the operator through the head's admin
		// answer: what to do, and no address (the log has it).
		u.log.Warn("openai: upstream has no sleep mode", "upstream", u.root, "path", path, "status", resp.StatusCode)
		return status.Errorf(codes.Unimplemented, "upstream has no sleep mode (POST %s: %d); vLLM needs --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1", path, resp.StatusCode)
	case resp.StatusCode/100 != 2:
		return statusError(resp)
	}
	return nil
}
