package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
)

// report reads load's JSON lines and prints, per mode, one row per target
// (means over its runs) and the troupe/nginx ratios, as a Markdown table.
func report(r io.Reader, w io.Writer) error {
	type key struct {
		mode   string
		target string
	}
	runs := map[key][]result{}
	var order []key
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		var res result
		if err := json.Unmarshal(sc.Bytes(), &res); err != nil {
			return fmt.Errorf("vsnginx: report: %w", err)
		}
		k := key{res.mode(), res.Target}
		if _, ok := runs[k]; !ok {
			order = append(order, k)
		}
		runs[k] = append(runs[k], res)
	}
	if err := sc.Err(); err != nil {
		return err
	}
	mean := func(rs []result) result {
		var m result
		for _, r := range rs {
			m.Requests += r.Requests
			m.Errors += r.Errors
			m.ReqPerSec += r.ReqPerSec / float64(len(rs))
			m.P50Ms += r.P50Ms / float64(len(rs))
			m.P99Ms += r.P99Ms / float64(len(rs))
			m.CPUUsPerReq += r.CPUUsPerReq / float64(len(rs))
		}
		return m
	}
	fmt.Fprintln(w, "| mode | proxy | runs | requests | errors | req/s | p50 (ms) | p99 (ms) | proxy CPU/req (µs) |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|")
	for _, k := range order {
		m := mean(runs[k])
		fmt.Fprintf(w, "| %s | %s | %d | %d | %d | %.0f | %.2f | %.2f | %.1f |\n", k.mode, k.target,
			len(runs[k]), m.Requests, m.Errors, m.ReqPerSec, m.P50Ms, m.P99Ms, m.CPUUsPerReq)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| mode | ratio | req/s | p50 | p99 | CPU/req |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|")
	modes := []string{}
	for _, k := range order {
		if !slices.Contains(modes, k.mode) {
			modes = append(modes, k.mode)
		}
	}
	ratio := func(s string, num, den string) {
		n, d := runs[key{s, num}], runs[key{s, den}]
		if len(n) == 0 || len(d) == 0 {
			return
		}
		a, b := mean(d), mean(n)
		fmt.Fprintf(w, "| %s | %s/%s | %.2f | %.2f | %.2f | %.2f |\n", s, num, den,
			b.ReqPerSec/a.ReqPerSec, b.P50Ms/a.P50Ms, b.P99Ms/a.P99Ms, b.CPUUsPerReq/a.CPUUsPerReq)
	}
	for _, s := range modes {
		ratio(s, "troupe", "nginx")
		ratio(s, "baseline", "nginx")
		ratio(s, "troupe", "baseline")
	}
	return nil
}

// mode names a run's workload: non-stream, stream or audio (lines
// written before audio existed have no mode).
func (r result) mode() string {
	switch {
	case r.Mode != "":
		return r.Mode
	case r.Stream:
		return "stream"
	}
	return "non-stream"
}

func runReport() error { return report(os.Stdin, os.Stdout) }
