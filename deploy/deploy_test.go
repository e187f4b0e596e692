package deploy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"gopkg.in/yaml.v3"

	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	dashboardFile = "grafana/troupe.json"
	rulesFile     = "prometheus/rules.yml"
	pendingFile   = "prometheus/pending-metrics.txt"
	docFile       = "../docs/observability.md"
)

// allowedLintWarnings are the `promtool check metrics` findings troupe keeps
// on purpose, by metric name, with the reason (listed in docs/stats.md).
var allowedLintWarnings = map[string]string{
	"troupe_iteration_tokens_total": "vLLM's name for a histogram; renaming it would break vLLM dashboards",
}

// prometheusOwn are series Prometheus makes itself, not the head.
var prometheusOwn = []string{"up", "scrape_duration_seconds", "scrape_timeout_seconds"}

// targetLabels are added by Prometheus to every scraped series.
var targetLabels = []string{"job", "instance"}

// ---- the files ------------------------------------------------------------

type dashboard struct {
	Title         string  `json:"title"`
	UID           string  `json:"uid"`
	SchemaVersion int     `json:"schemaVersion"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID          int         `json:"id"`
	Type        string      `json:"type"`
	Title       string      `json:"title"`
	Description string      `json:"description"`
	Datasource  *datasource `json:"datasource"`
	GridPos     *struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []target `json:"targets"`
	Panels  []panel  `json:"panels"` // a collapsed row's panels
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type target struct {
	RefID      string      `json:"refId"`
	Expr       string      `json:"expr"`
	Datasource *datasource `json:"datasource"`
}

type variable struct {
	Name       string      `json:"name"`
	Type       string      `json:"type"`
	Query      any         `json:"query"` // a string, or {"query": "..."}
	Datasource *datasource `json:"datasource"`
}

func (v variable) queryString() string {
	switch q := v.Query.(type) {
	case string:
		return q
	case map[string]any:
		s, _ := q["query"].(string)
		return s
	}
	return ""
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	data, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var d dashboard
	dec := json.NewDecoder(bytes.NewReader(data))
	require.NoError(t, dec.Decode(&d), "the dashboard is JSON")
	return d
}

// dashboardPanels are every panel but rows, collapsed rows' panels included.
func (d dashboard) dashboardPanels() []panel {
	var out []panel
	for _, p := range d.Panels {
		if p.Type == "row" {
			out = append(out, p.Panels...)
			continue
		}
		out = append(out, p)
	}
	return out
}

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []rule `yaml:"rules"`
	} `yaml:"groups"`
}

type rule struct {
	Record      string            `yaml:"record"`
	Alert       string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func loadRules(t *testing.T) []rule {
	t.Helper()
	data, err := os.ReadFile(rulesFile)
	require.NoError(t, err)
	var f ruleFile
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	require.NoError(t, dec.Decode(&f))
	var out []rule
	for _, g := range f.Groups {
		out = append(out, g.Rules...)
	}
	require.NotEmpty(t, out)
	return out
}

// pendingFamilies reads pending-metrics.txt: family → why.
func pendingFamilies(t *testing.T) map[string]string {
	t.Helper()
	data, err := os.ReadFile(pendingFile)
	require.NoError(t, err)
	out := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, why, _ := strings.Cut(line, " ")
		require.NotEmpty(t, strings.TrimSpace(why), "%s: %q names no reason", pendingFile, line)
		out[name] = strings.TrimSpace(why)
	}
	return out
}

// grafanaVarRE matches $name, ${name} and ${name:format}.
var grafanaVarRE = regexp.MustCompile(`\$\{([A-Za-z0-9_]+)(?::[a-z]+)?\}|\$([A-Za-z0-9_]+)`)

// grafanaBuiltins are the variables Grafana itself defines that the
// dashboard may use.
var grafanaBuiltins = map[string]string{"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}

// concrete substitutes the dashboard's variables as scripts/e2e-compose.sh
// does: template variables match everything, interval builtins become
// durations.
func concrete(expr string) string {
	return grafanaVarRE.ReplaceAllStringFunc(expr, func(m string) string {
		sub := grafanaVarRE.FindStringSubmatch(m)
		name := sub[1] + sub[2]
		if d, ok := grafanaBuiltins[name]; ok {
			return d
		}
		return ".*"
	})
}

// ---- the dashboard's shape ------------------------------------------------

func TestDashboardSchema(t *testing.T) {
	d := loadDashboard(t)
	assert.NotEmpty(t, d.Title)
	assert.NotEmpty(t, d.UID)
	assert.GreaterOrEqual(t, d.SchemaVersion, 36, "a schema Grafana 9+ imports without migration")

	vars := map[string]variable{}
	for _, v := range d.Templating.List {
		require.NotContains(t, vars, v.Name, "variable %s defined twice", v.Name)
		vars[v.Name] = v
	}
	require.Contains(t, vars, "datasource")
	assert.Equal(t, "datasource", vars["datasource"].Type)
	assert.Equal(t, "prometheus", vars["datasource"].queryString())
	for _, name := range []string{"model", "stage", "replica"} {
		require.Contains(t, vars, name)
		v := vars[name]
		assert.Equal(t, "query", v.Type, name)
		require.NotNil(t, v.Datasource, name)
		assert.Equal(t, "${datasource}", v.Datasource.UID, "variable %s uses the datasource variable", name)
	}
	assert.Contains(t, vars["stage"].queryString(), "troupe_stage_info", "stage names come from troupe_stage_info")

	ids := map[int]bool{}
	panels := d.dashboardPanels()
	require.NotEmpty(t, panels)
	for _, p := range d.Panels {
		require.False(t, ids[p.ID], "panel id %d used twice", p.ID)
		ids[p.ID] = true
		require.NotNil(t, p.GridPos, "panel %q has a gridPos", p.Title)
		assert.True(t, p.GridPos.W > 0 && p.GridPos.H > 0 && p.GridPos.X+p.GridPos.W <= 24, "panel %q gridPos %+v", p.Title, *p.GridPos)
	}
	for _, p := range panels {
		assert.NotEmpty(t, p.Title, "panel %d has a title", p.ID)
		assert.NotEmpty(t, p.Description, "panel %q says what it shows", p.Title)
		require.NotNil(t, p.Datasource, "panel %q has a datasource", p.Title)
		assert.Equal(t, "${datasource}", p.Datasource.UID, "panel %q uses the datasource variable", p.Title)
		require.NotEmpty(t, p.Targets, "panel %q has targets", p.Title)
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			assert.NotEmpty(t, tg.RefID, "panel %q target has a refId", p.Title)
			assert.False(t, refs[tg.RefID], "panel %q refId %s twice", p.Title, tg.RefID)
			refs[tg.RefID] = true
			assert.NotEmpty(t, strings.TrimSpace(tg.Expr), "panel %q target %s has an expr", p.Title, tg.RefID)
			for _, m := range grafanaVarRE.FindAllStringSubmatch(tg.Expr, -1) {
				name := m[1] + m[2]
				_, builtin := grafanaBuiltins[name]
				assert.True(t, builtin || vars[name].Name != "", "panel %q uses undefined variable $%s", p.Title, name)
			}
		}
	}

	// The panels the issue names.
	var titles []string
	for _, p := range panels {
		titles = append(titles, strings.ToLower(p.Title))
	}
	all := strings.Join(titles, "\n")
	for _, want := range []string{"finished requests", "token throughput", "time to first token", "inter-token",
		"end-to-end", "time to first audio", "queue, prefill and decode", "kv cache usage", "prefix cache hit rate",
		"finish reasons", "replicas attached", "sleep state", "membership events"} {
		assert.Contains(t, all, want, "a panel for %s", want)
	}
}

// ---- PromQL ---------------------------------------------------------------

// query is one PromQL expression of the dashboard or the rules.
type query struct {
	where, expr string
}

func allQueries(t *testing.T) []query {
	t.Helper()
	var out []query
	d := loadDashboard(t)
	for _, p := range d.dashboardPanels() {
		for _, tg := range p.Targets {
			out = append(out, query{"panel " + p.Title + " " + tg.RefID, concrete(tg.Expr)})
		}
	}
	for _, v := range d.Templating.List {
		q := v.queryString()
		if v.Type != "query" {
			continue
		}
		// Grafana's label_values(expr, label) and query_result(expr) wrap
		// PromQL.
		if m := regexp.MustCompile(`^label_values\((.*),\s*\w+\)$`).FindStringSubmatch(q); m != nil {
			q = m[1]
		} else if m := regexp.MustCompile(`^query_result\((.*)\)$`).FindStringSubmatch(q); m != nil {
			q = m[1]
		}
		out = append(out, query{"variable " + v.Name, concrete(q)})
	}
	for _, r := range loadRules(t) {
		out = append(out, query{"rule " + r.Record + r.Alert, r.Expr})
	}
	return out
}

// TestQueriesParse parses every expression with Prometheus' own parser.
func TestQueriesParse(t *testing.T) {
	for _, q := range allQueries(t) {
		assert.NotContains(t, q.expr, "$", "%s: a variable left after substitution", q.where)
		_, err := parser.ParseExpr(q.expr)
		assert.NoError(t, err, "%s: %s", q.where, q.expr)
	}
}

func TestRulesShape(t *testing.T) {
	recordRE := regexp.MustCompile(`^[a-z_]+:troupe_[a-z0-9_]+:[a-z0-9_]+$`)
	doc, err := os.ReadFile(docFile)
	require.NoError(t, err)
	headings := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if h, ok := strings.CutPrefix(line, "### "); ok {
			headings[strings.TrimSpace(h)] = true
		}
	}
	for _, r := range loadRules(t) {
		switch {
		case r.Record != "":
			assert.Regexp(t, recordRE, r.Record, "recording rules are named level:metric:operations")
		case r.Alert != "":
			assert.Contains(t, []string{"critical", "warning"}, r.Labels["severity"], "%s has a severity", r.Alert)
			assert.NotEmpty(t, r.Annotations["summary"], "%s has a summary", r.Alert)
			assert.Contains(t, r.Annotations["description"], "docs/observability.md#"+strings.ToLower(r.Alert),
				"%s points at its runbook", r.Alert)
			assert.True(t, headings[r.Alert], "docs/observability.md has a section ### %s", r.Alert)
		default:
			t.Errorf("a rule with neither record nor alert: %+v", r)
		}
	}
}

// ---- against a real head --------------------------------------------------

// TestAgainstRealHead runs a head and sim workers (orchestratortest) behind
// the real HTTP API with the collectors `troupe head` registers, serves some
// traffic, and checks its /metrics: promtool finds nothing troupe could
// avoid, and every family and label the dashboard and the rules select is
// one the head exposes (or a recording rule, Prometheus' own, or pending).
func TestAgainstRealHead(t *testing.T) {
	// Wired as troupe head is: the per-replica stats are written by the
	// head (the API's Exposer), everything else is gathered.
	c := orchestratortest.Start(t, orchestratortest.Options{Sim: sim.Config{Logger: slog.New(slog.DiscardHandler)}, SeparateStats: true})
	c.Metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m, err := httpapi.NewMetrics(c.Metrics)
	require.NoError(t, err)
	api := httpapi.New(c.Head, httpapi.Config{Gatherer: c.Metrics, Exposer: c.Head, Metrics: m, Logger: slog.New(slog.DiscardHandler)})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := httpapi.NewHTTPServer(lis.Addr().String(), api.Handler())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	tr := &http.Transport{}
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, srv.Shutdown(ctx))
		require.ErrorIs(t, <-served, http.ErrServerClosed)
	})
	base := "http://" + lis.Addr().String()
	post := func(body string) int {
		resp, err := client.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	for range 3 {
		require.Equal(t, 200, post(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hello there"}],"max_tokens":8,"modalities":["text","audio"]}`))
	}
	require.Equal(t, 400, post(`{"model":`))
	resp, err := client.Get(base + "/metrics")
	require.NoError(t, err)
	text, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, 200, resp.StatusCode)

	t.Run("promtool check metrics", func(t *testing.T) { promtoolLint(t, text) })
	t.Run("queries select what the head exposes", func(t *testing.T) { selectorsExist(t, text) })
}

func promtoolLint(t *testing.T, metrics []byte) {
	path, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("promtool is not installed (Debian package prometheus; scripts/test.sh installs it): %v", err)
		}
		t.Skip("promtool is not installed (apt-get install -y prometheus); CI fails here instead")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, "check", "metrics")
	cmd.Stdin = bytes.NewReader(metrics)
	out, err := cmd.CombinedOutput()
	// promtool exits 3 when it only has lint findings.
	var findings []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			findings = append(findings, line)
		}
	}
	for _, f := range findings {
		name, _, _ := strings.Cut(f, " ")
		if why, ok := allowedLintWarnings[name]; ok {
			t.Logf("kept on purpose (%s): %s", why, f)
			continue
		}
		t.Errorf("promtool check metrics: %s", f)
	}
	if err != nil && len(findings) == 0 {
		t.Fatalf("promtool check metrics failed without findings: %v", err)
	}
}

func selectorsExist(t *testing.T, metrics []byte) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(bytes.NewReader(metrics))
	require.NoError(t, err)
	labels := map[string]map[string]bool{} // family → label names
	for _, mf := range mfs {
		ls := map[string]bool{}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				ls[lp.GetName()] = true
			}
		}
		labels[mf.GetName()] = ls
	}
	pending := pendingFamilies(t)
	recorded := map[string]bool{}
	for _, r := range loadRules(t) {
		if r.Record != "" {
			recorded[r.Record] = true
		}
	}

	var checked []string
	for _, q := range allQueries(t) {
		expr, err := parser.ParseExpr(q.expr)
		require.NoError(t, err, q.where)
		parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
			vs, ok := n.(*parser.VectorSelector)
			if !ok {
				return nil
			}
			name, suffix := vs.Name, ""
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				if base, ok := strings.CutSuffix(vs.Name, s); ok && (labels[base] != nil || pending[base] != "") {
					name, suffix = base, s
				}
			}
			switch {
			case recorded[name] || slices.Contains(prometheusOwn, name):
				return nil
			case pending[name] != "":
				t.Logf("%s: %s is pending (%s)", q.where, name, pending[name])
				return nil
			case labels[name] == nil:
				t.Errorf("%s: the head exposes no family %s", q.where, vs.Name)
				return nil
			}
			checked = append(checked, name)
			for _, m := range vs.LabelMatchers {
				l := m.Name
				if l == "__name__" || slices.Contains(targetLabels, l) || (l == "le" && suffix == "_bucket") {
					continue
				}
				assert.True(t, labels[name][l], "%s: %s has no label %q", q.where, name, l)
			}
			return nil
		})
	}
	sort.Strings(checked)
	checked = slices.Compact(checked)
	assert.GreaterOrEqual(t, len(checked), 25, "families checked: %v", checked)
}
