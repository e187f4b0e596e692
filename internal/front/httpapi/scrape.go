package httpapi

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"

	"github.com/klauspost/compress/gzip"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
)

// Exposer writes metric families itself, in the Prometheus text format or
// OpenMetrics, for families with too many series to gather on every scrape
// (the head's per-replica stats, stats.Logger). Both methods may be called
// concurrently.
type Exposer interface {
	// MetricFamilyNames are the families WriteMetrics writes.
	MetricFamilyNames() []string
	// WriteMetrics writes them to w in format f (text or OpenMetrics,
	// without the final "# EOF").
	WriteMetrics(w io.Writer, f expfmt.Format) error
}

// scrapeFormats are the formats /metrics serves, in order of preference when
// the scraper accepts several. Protobuf, which alone carries native
// histograms, is served only with an ExposerGatherer (protoScrapeFormats):
// a scraper that asks only for protobuf otherwise gets the text format, in
// which the Exposer writes its families.
var (
	scrapeFormats      = []expfmt.Format{expfmt.FmtOpenMetrics_1_0_0, expfmt.FmtOpenMetrics_0_0_1, expfmt.FmtText}
	protoScrapeFormats = append([]expfmt.Format{expfmt.NewFormat(expfmt.TypeProtoDelim)}, scrapeFormats...)
)

// metricsHandler serves /metrics: the Gatherer's families, encoded by
// expfmt, then the Exposer's (either may be nil), then "# EOF" in
// OpenMetrics; gzipped when the scraper accepts it. A gathered family that
// the Exposer also writes is left out, and logged as the wiring bug it is,
// so no family ever appears twice. Gather errors are logged and the
// families gathered are served (promhttp's ContinueOnError). With xg (the
// Exposer's families, gathered) a scraper that prefers protobuf gets it,
// xg's families in place of the Exposer's text: native histograms travel
// only in protobuf (Prometheus' native-histograms feature asks for it).
func metricsHandler(g prometheus.Gatherer, x Exposer, xg prometheus.Gatherer, log *slog.Logger) http.Handler {
	formats := scrapeFormats
	if xg != nil {
		formats = protoScrapeFormats
	}
	owned := map[string]bool{}
	if x != nil {
		for _, n := range x.MetricFamilyNames() {
			owned[n] = true
		}
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		format := expfmt.NegotiateAccept(r.Header, formats...)
		om := format.FormatType() == expfmt.TypeOpenMetrics
		h := w.Header()
		h.Set("Content-Type", string(format))
		h.Add("Vary", "Accept-Encoding")
		var out io.Writer = w
		if acceptsGzip(r.Header) {
			h.Set("Content-Encoding", "gzip")
			gz := gzipPool.Get().(*gzip.Writer)
			gz.Reset(w)
			defer func() {
				if err := gz.Close(); err != nil {
					log.Debug("httpapi: metrics: gzip", "err", err)
				}
				gz.Reset(nil)
				gzipPool.Put(gz)
			}()
			out = gz
		}
		bw := bufPool.Get().(*bufio.Writer)
		bw.Reset(out)
		defer func() {
			bw.Reset(nil)
			bufPool.Put(bw)
		}()
		gather, expose, skip := g, x, owned
		if format.FormatType() == expfmt.TypeProtoDelim {
			gather, expose, skip = prometheus.Gatherers{xg}, nil, nil
			if g != nil {
				gather = prometheus.Gatherers{g, xg}
			}
		}
		if err := writeMetrics(bw, format, om, gather, expose, skip, log); err != nil {
			// The client left, most likely; the status is already sent.
			log.Debug("httpapi: metrics: write", "err", err)
			return
		}
		if err := bw.Flush(); err != nil {
			log.Debug("httpapi: metrics: write", "err", err)
		}
	})
}

func writeMetrics(w io.Writer, format expfmt.Format, om bool, g prometheus.Gatherer, x Exposer, owned map[string]bool, log *slog.Logger) error {
	if g != nil {
		mfs, err := g.Gather()
		if err != nil {
			log.Warn("httpapi: metrics", "err", err)
		}
		enc := expfmt.NewEncoder(w, format)
		for _, mf := range mfs {
			if owned[mf.GetName()] {
				log.Error("httpapi: metrics: family is both gathered and written by the exposer; the gathered one is left out", "family", mf.GetName())
				continue
			}
			if err := enc.Encode(mf); err != nil {
				return fmt.Errorf("httpapi: encode %s: %w", mf.GetName(), err)
			}
		}
	}
	if x != nil {
		if err := x.WriteMetrics(w, format); err != nil {
			return err
		}
	}
	if om {
		if _, err := expfmt.FinalizeOpenMetrics(w); err != nil {
			return fmt.Errorf("httpapi: %w", err)
		}
	}
	return nil
}

// acceptsGzip reports whether Accept-Encoding lists gzip with a q above 0.
func acceptsGzip(h http.Header) bool {
	for _, v := range h.Values("Accept-Encoding") {
		for part := range strings.SplitSeq(v, ",") {
			coding, params, _ := strings.Cut(strings.TrimSpace(part), ";")
			if !strings.EqualFold(strings.TrimSpace(coding), "gzip") {
				continue
			}
			q := strings.ReplaceAll(strings.TrimSpace(params), " ", "")
			return q != "q=0" && q != "q=0.0" && q != "q=0.00" && q != "q=0.000"
		}
	}
	return false
}

var (
	// BestSpeed: a scrape of a large fleet is tens of MB of text, which
	// the default level compresses hardly smaller and many times slower
	// (docs/stats.md); klauspost's gzip is already in the build (promhttp's
	// zstd) and faster than compress/gzip's.
	gzipPool = sync.Pool{New: func() any {
		gz, _ := gzip.NewWriterLevel(nil, gzip.BestSpeed)
		return gz
	}}
	bufPool = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 64<<10) }}
)
